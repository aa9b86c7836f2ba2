"""Smoke test of ``ds-diloco bench island`` at a tiny size: real launches of both modes.

No timing is asserted (the figures depend on the machine); what is asserted is
that both modes ran as what they claim to be (the plain launch without a syncer,
the ds_diloco launch merging at its coordinator) and that the result holds
positive, finite step times and memory figures for every rank.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_diloco import cli
from ds_diloco.bench.island import _renice, default_run_config, format_report, run_bench, to_json
from ds_diloco.config import (
    CoordinatorConfig,
    DataConfig,
    IslandSpec,
    ModelSource,
    RunConfig,
    TrainConfig,
)
from ds_diloco.round_policy import PolicyOptions

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def tiny_run(tmp_path, tiny_config_path) -> RunConfig:
    model = ModelSource(config=tiny_config_path, seed=0)
    return RunConfig(
        model=model,
        deepspeed_config=str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        data=DataConfig(
            path=str(REPO / "tests" / "data"),
            vocab_size=512,
            seq_len=32,
            cache_dir=str(tmp_path / "cache"),
            heldout_fraction=0.05,
        ),
        train=TrainConfig(steps=STEPS, micro_batch=4, lr=3e-3, log_every=2),
        islands=(IslandSpec(name="island", world_size=2),),
        coordinator=CoordinatorConfig(
            model=model,
            state_dir=str(tmp_path / "state"),
            num_fragments=4,
            sync_every=4,
            policy=PolicyOptions(min_quorum=1, grace_gamma=0.5, tau=1),
        ),
        workdir=str(tmp_path / "run"),
        export=False,
    )


def test_bench_island_runs_both_modes_and_reports_every_rank(tmp_path, tiny_config_path):
    cfg = tiny_run(tmp_path, tiny_config_path)
    bench = run_bench(
        cfg, repeats=1, warmup=2, workdir=tmp_path / "bench", memory_repeats=1, paired=2,
        paired_blocks=2,
    )  # fmt: skip

    assert [(x.mode, x.exact_memory) for x in bench.launches] == [
        ("plain", False), ("ds_diloco", False), ("paired", False), ("paired", False),
        ("plain", True), ("ds_diloco", True),
    ]  # fmt: skip
    for x in bench.launches:
        assert len(x.ranks) == 2 and [r["rank"] for r in x.ranks] == [0, 1]
        for r in x.ranks:
            assert r["steps"] == STEPS and len(r["step_times_s"]) == STEPS, r
            assert all(_positive_finite(t) for t in r["step_times_s"]), r["step_times_s"]
            assert _positive_finite(r["peak_rss_mb"]) and _positive_finite(r["shard_fp32_mb"]), r
            assert _positive_finite(r["setup_rss_mb"]) and len(r["step_rss_mb"]) == STEPS, r
            # Anonymous pages: most of a rank (its tensors), not all (libraries' code is not).
            assert 0.5 * r["setup_rss_mb"] < r["setup_anon_mb"] < r["setup_rss_mb"], r
            assert len(r["step_anon_mb"]) == STEPS, r
            assert all(0 < a < m for a, m in zip(r["step_anon_mb"], r["step_rss_mb"])), r
            assert all(_positive_finite(m) for m in r["step_rss_mb"]), r["step_rss_mb"]
            assert max(r["setup_rss_mb"], *r["step_rss_mb"]) <= r["peak_rss_mb"] + 1, r
            # the memory launches' ranks really ran with the allocator setting, the others not
            want = "131072" if x.exact_memory else os.environ.get("MALLOC_MMAP_THRESHOLD_")
            assert r["malloc_env"].get("MALLOC_MMAP_THRESHOLD_") == want, r["malloc_env"]
        assert _positive_finite(x.island_step_s) and _positive_finite(x.launch_s)
        assert _positive_finite(x.island_cpu_s)

    plain, ds = bench.of("plain")[0], bench.of("ds_diloco")[0]
    # The baseline really is plain ZeRO-3: no syncer, no coordinator.
    assert all(
        r["plain"] is True and r["stats"] is r["loop_stats"] is None and r["versions"] == []
        for r in plain.ranks
    )
    assert plain.coordinator_versions is None and plain.coordinator_cpu_s is None
    # Every module a ds_diloco rank imports after its engine is built, plain ZeRO-3's does
    # too: a module only the syncer's path loads is memory in every rank, beyond the base
    # copy (the idna codec and stringprep, 107 kB of objects, were one).
    for p_rank, d_rank in zip(plain.ranks, ds.ranks):
        extra = set(d_rank["modules_loaded"]) - set(p_rank["modules_loaded"])
        assert not extra, sorted(extra)
    # The ds_diloco launch really synced: every rank uploaded, the coordinator merged,
    # and the ranks applied merged fragments.
    assert all(r["plain"] is False for r in ds.ranks)
    # One fragment due per step: sent, or skipped by the whole island (its base not ready:
    # on a loaded machine downloads lag, and a CI run skipped 4 of 8); and on leaving, the
    # fragments with steps after their last send. None lost on the way.
    for r in ds.ranks:
        s = r["stats"]
        assert s["uploads"] + s["skipped"] == STEPS + s["flushed"] and s["uploads"] > 0, s
        assert s["failed"] == s["refused"] == 0, s
        # The sync part's breakdown is the loop's alone: within it, and without the final
        # flush's sends (which the whole-run timers hold: they could add up to more).
        loop = r["loop_stats"]
        assert sorted(loop) == ["agree_s", "apply_s", "cache_s", "send_s"], loop
        assert 0 < sum(loop.values()) <= r["sync_s"] + 1e-3, (loop, r["sync_s"])
        assert all(0 <= loop[k] <= s[k] for k in loop), (loop, s)
        assert loop["send_s"] < s["send_s"] or not s["flushed"], (loop, s)
    assert ds.coordinator_versions is not None and max(ds.coordinator_versions) > 0
    assert all(max(r["versions"]) > 0 and r["stats"]["applied"] > 0 for r in ds.ranks), ds.ranks
    assert ds.coordinator_cpu_s is not None and ds.coordinator_cpu_s >= 0
    # The paired launches' learners stepped only in their syncer-on blocks: steps 1-2, 5-6 of
    # 8 in the first, 3-4, 7-8 in the second (it starts with the syncer off): at most one
    # upload each (the all-on launch above sends one at every step).
    paired = bench.of("paired")
    assert [x.off_first for x in paired] == [False, True]
    for x in paired:
        assert all(r["sync_blocks"] == 2 and r["plain"] is False for r in x.ranks)
        assert all(r["sync_blocks_off_first"] == x.off_first for r in x.ranks)
        assert all(0 < r["stats"]["uploads"] - r["stats"]["flushed"] <= 4 for r in x.ranks), [
            r["stats"] for r in x.ranks
        ]
        assert max(x.coordinator_versions) > 0
    pr = bench.paired()
    assert pr["launches"] == 2 and (pr["blocks"], pr["settle"]) == (2, 1)
    # Block starts dropped, and warm-up: steps 6 (on) and 4, 8 (off) are compared in the
    # first launch, steps 4, 8 (on) and 6 (off) in the second.
    first, second = ([max(s) for s in zip(*(r["step_times_s"] for r in x.ranks))] for x in paired)
    on_off = [
        (first[5], statistics.median([first[3], first[7]])),
        (statistics.median([second[3], second[7]]), second[5]),
    ]
    assert [(x.block_step_s(True), x.block_step_s(False)) for x in paired] == on_off
    assert pr["ratios"] == pytest.approx([a / b for a, b in on_off])
    assert pr["ratio"] == pytest.approx(statistics.median(pr["ratios"]))
    assert (pr["ratio_on_first"], pr["ratio_off_first"]) == tuple(pr["ratios"])
    # The same job on both sides: the same shard of the same model on each rank.
    assert [r["shard_fp32_mb"] for r in plain.ranks] == [r["shard_fp32_mb"] for r in ds.ranks]

    rows = bench.rows()
    assert [row.name for row in rows] == ["rank 0", "rank 1", "island"]
    for row in rows:
        for side in (row.plain, row.ds_diloco):
            assert _positive_finite(side.step_s) and _positive_finite(side.peak_rss_mb)
        assert _positive_finite(row.step_ratio) and math.isfinite(row.rss_extra_mb)
    assert rows[-1].shard_fp32_mb == pytest.approx(rows[0].shard_fp32_mb + rows[1].shard_fp32_mb)
    assert rows[-1].plain.peak_rss_mb == pytest.approx(
        rows[0].plain.peak_rss_mb + rows[1].plain.peak_rss_mb
    )

    # The memory launches: rows from them alone, the verdict given on them.
    mem = bench.memory_rows()
    assert [m.name for m in mem] == ["rank 0", "rank 1", "island"]
    assert mem[-1].ds_diloco.peak_rss_mb == pytest.approx(
        sum(
            x.ranks[0]["peak_rss_mb"] + x.ranks[1]["peak_rss_mb"]
            for x in bench.memory_of("ds_diloco")
        )
    )
    assert mem[-1].shard_fp32_mb == rows[-1].shard_fp32_mb
    # Nothing is frozen: the base copy is the whole shard in fp32, rank by rank.
    for m in mem:
        assert m.base_copy_mb == pytest.approx(m.shard_fp32_mb, abs=0.01), m
    for m in mem:
        assert math.isfinite(m.extra_mb()) and m.met == (m.extra_mb() <= m.shard_fp32_mb)
        assert math.isfinite(m.anon_extra_mb()) and math.isfinite(m.anon_extra_mb("step_anon_mb"))

    report = format_report(bench, cfg)
    assert report.count("ratio") >= 3 and "coordinator process" in report
    assert "MALLOC_MMAP_THRESHOLD_=131072" in report and "extra before the first step" in report
    assert f"(anonymous {mem[0].anon_extra_mb():+.1f} MB), after a step" in report
    assert f"(anonymous {mem[0].anon_extra_mb('step_anon_mb'):+.1f} MB); of the peak's" in report
    assert f"the base copy {mem[0].base_copy_mb:.1f} MB" in report
    summary = json.loads(json.dumps(to_json(bench, cfg)))  # serialisable as it is
    assert "paired (2 ds_diloco launch(es)" in report
    assert f"{pr['ratios'][1]:.3f} (off first)" in report
    assert f"syncer on first {pr['ratios'][0]:.3f}, off first {pr['ratios'][1]:.3f}" in report
    assert summary["paired"]["ratio"] == pr["ratio"]
    assert len(summary["launches"]) == 6 and len(summary["rows"]) == 3
    assert len(summary["memory_rows"]) == 3 and summary["settings"]["memory_repeats"] == 1


def test_rss_reading_follows_an_allocation_and_counts_it_anonymous():
    import torch

    from ds_diloco.island import _resident_mb

    rss, anon = _resident_mb()
    assert 0 < anon < rss, (rss, anon)  # the interpreter's and libraries' code is file-backed
    x = torch.ones(16 * 2**20)  # 64 MiB, written: resident
    rss_after, anon_after = _resident_mb()
    assert rss_after - rss > 60 and anon_after - anon > 60, (rss, anon, rss_after, anon_after)
    del x


def test_cli_parses_bench_island_flags():
    args = cli.build_parser().parse_args(["bench", "island", "--steps", "7", "--json", "x.json"])
    got = (args.what, args.steps, args.repeats, args.run, args.json, args.coordinator_nice)
    assert got == ("island", 7, 3, None, "x.json", 10) and args.memory_repeats == 1
    assert (args.paired, args.paired_blocks) == (2, 10)
    args = cli.build_parser().parse_args(["bench", "coordinator", "--repeats", "2"])
    assert (args.what, args.repeats, args.fragment_mb) == ("coordinator", 2, 64.0)


def test_renice_lowers_every_thread_and_the_session_group_of_a_running_process():
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    group = Path(f"/proc/{proc.pid}/autogroup")  # its own session: its own group
    try:
        tasks = Path(f"/proc/{proc.pid}/task")
        deadline = time.monotonic() + 10
        while len(list(tasks.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _renice(proc.pid, 7)
        nices = [os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in tasks.iterdir()]
        assert len(nices) == 2 and all(n == os.getpriority(os.PRIO_PROCESS, 0) + 7 for n in nices)
        if group.exists():  # autogroup scheduling: sessions share the cores by the group's nice
            assert group.read_text().split()[-1] == "7", group.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_cli_refuses_bad_counts_in_one_line(capsys):
    assert cli.main(["bench", "island", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert cli.main(["bench", "island", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--memory-repeats must be >= 0"):
        run_bench(default_run_config(), repeats=1, memory_repeats=-1)
    with pytest.raises(ValueError, match=r"--coordinator-nice must be in 0\.\.19"):
        run_bench(default_run_config(), repeats=1, coordinator_nice=20)


def test_paired_launches_too_short_for_both_sides_are_refused_before_any_launch(capsys):
    # 10 steps, 5 of warm-up, blocks of 5 whose first 3 settle: the launch starting with
    # the syncer off times no step with it on. It ran every launch, then failed in the
    # report ("no median for empty data").
    assert cli.main(["bench", "island", "--steps", "10", "--paired", "1",
                     "--paired-blocks", "5", "--memory-repeats", "0"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--steps 10 leaves a paired launch no timed step with the syncer" in err, err
    assert "raise --steps or lower --paired-blocks" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs it")
def test_the_gpu_run_file_without_cuda_is_refused_in_one_line_before_any_launch():
    # The README's `ds-diloco bench island --run launch/bench-island-gpu.yaml` ("on one CUDA
    # GPU") on a machine without one ran the 125M model in bf16 on the CPU, 6 GB per rank
    # and minutes a step, and said nothing of it.
    cmd = [sys.executable, "-m", "ds_diloco.cli", "bench", "island", "--run",
           str(REPO / "launch" / "bench-island-gpu.yaml"), "--steps", "1", "--repeats", "1",
           "--paired", "0", "--memory-repeats", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        out, err = proc.communicate()
        pytest.fail(f"not refused: still running after 60 s\n{out[-2000:]}")
    assert proc.returncode == 2, (out, err)
    assert "bf16" in err and "no CUDA device" in err and "bench-island-125m.yaml" in err, err
    assert "Traceback" not in err and "launches" not in out, (out, err)


def _summary(rank: int, peak: float, step_s: float = 0.1) -> dict:
    """A rank's summary as ``run_island`` writes it, with the fields the report reads."""
    return {
        "rank": rank, "steps": 8, "step_times_s": [step_s] * 8, "peak_rss_mb": peak,
        "shard_fp32_mb": 8.0, "train_s": 0.7, "sync_s": 0.1, "setup_rss_mb": peak - 10,
        "step_rss_mb": [peak - 5] * 8, "setup_anon_mb": None, "step_anon_mb": None,
        "stats": None, "loop_stats": None,
    }  # fmt: skip


def test_json_gives_the_memory_verdict_of_the_memory_launches_alone(tmp_path, tiny_config_path):
    # Default allocator: ds_diloco +30 MB a rank (allocator noise), over the 8 MB shard; the
    # memory launches: +6 MB, met. The report gives the verdict on the memory launches alone
    # ("no verdict" on the others); the JSON's rows said rss_met False beside it.
    from ds_diloco.bench.island import IslandBench, Launch

    def launch(mode: str, peak: float, exact: bool) -> Launch:
        x = Launch(mode=mode, repeat=0, ranks=[_summary(0, peak), _summary(1, peak)], warmup=2,
                   launch_s=10.0, island_cpu_s=5.0, exact_memory=exact)  # fmt: skip
        x.coordinator_cpu_s = None if mode == "plain" else 0.5
        return x

    bench = IslandBench(
        launches=[
            launch("plain", 600, False), launch("ds_diloco", 630, False),
            launch("plain", 500, True), launch("ds_diloco", 506, True),
        ],
        world_size=2, steps=8, warmup=2,
    )  # fmt: skip
    cfg = tiny_run(tmp_path, tiny_config_path)
    assert all(m.met for m in bench.memory_rows())
    assert "(met)" in format_report(bench, cfg) and "MISSED" not in format_report(bench, cfg)
    summary = to_json(bench, cfg)
    assert all(m["met"] for m in summary["memory_rows"])
    assert [r["rss_met"] for r in summary["rows"]] == [None] * 3, summary["rows"]
    # Without memory launches the timed ones give the verdict, in the report and the JSON.
    bench.launches = bench.launches[:2]
    assert "(MISSED)" in format_report(bench, cfg)
    assert [r["rss_met"] for r in to_json(bench, cfg)["rows"]] == [False] * 3


def test_a_ratio_or_extra_just_past_its_goal_prints_with_the_digits_that_show_it(
    tmp_path, tiny_config_path
):
    # A step ratio of 1.0204 printed as "1.020 (MISSED)" under "goal <= 1.02", an extra of
    # 8.04 MB as "+8.0 MB vs shard fp32 8.0 MB (MISSED)": the printed figures said met.
    from ds_diloco.bench.island import IslandBench, Launch

    def launch(mode: str, peak: float, step_s: float) -> Launch:
        x = Launch(mode=mode, repeat=0, ranks=[_summary(0, peak, step_s), _summary(1, peak, step_s)],
                   warmup=2, launch_s=10.0, island_cpu_s=5.0)  # fmt: skip
        x.coordinator_cpu_s = None if mode == "plain" else 0.5
        return x

    bench = IslandBench(launches=[launch("plain", 500, 0.1), launch("ds_diloco", 508.04, 0.10204)],
                        world_size=2, steps=8, warmup=2)  # fmt: skip
    assert not any(r.step_met or r.rss_met for r in bench.rows())
    report = format_report(bench, tiny_run(tmp_path, tiny_config_path))
    assert "ratio 1.0204  (MISSED)" in report and "ratio 1.020 " not in report, report
    assert "extra +8.04 MB  vs shard fp32 8.00 MB  (MISSED)" in report, report
    # Well clear of the goal: the usual digits.
    bench = IslandBench(launches=[launch("plain", 500, 0.1), launch("ds_diloco", 506, 0.101)],
                        world_size=2, steps=8, warmup=2)  # fmt: skip
    report = format_report(bench, tiny_run(tmp_path, tiny_config_path))
    assert "ratio 1.010  (met)" in report and "extra +6.0 MB  vs shard fp32 8.0 MB  (met)" in report
