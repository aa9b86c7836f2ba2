"""Smoke test of ``ds-diloco bench coordinator`` at a tiny size: it runs the real paths.

No timing is asserted (the figures depend on the machine); what is asserted is
that both sides of each comparison ran and that the benchmark's outer step really
computed the merge the coordinator would.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ds_diloco import cli
from ds_diloco.bench.coordinator import (
    bench_memory,
    bench_outer_step,
    bench_round_cpu,
    bench_upload,
    llama_config,
    model_specs,
    whole_model_layout,
)
from ds_diloco.merge import DEFAULT_PLAIN_PATTERNS, is_plain_tensor, merge_reference

pytestmark = pytest.mark.timeout(60)


def _positive_finite(comparison) -> None:
    for side in (comparison.measured, comparison.baseline):
        assert len(side.seconds) == 1 and side.nbytes > 0, side
        assert math.isfinite(side.bytes_per_s) and side.bytes_per_s > 0, side
    assert math.isfinite(comparison.ratio) and comparison.ratio > 0


def test_llama_config_is_sized_to_the_fragment_and_has_both_merge_kinds():
    config = llama_config(4.0)
    _frag, segments, rda = whole_model_layout(model_specs(config))
    mib = 4 * sum(s.numel for s in segments) / 2**20
    assert 3.5 < mib <= 4.0, mib
    assert any(rda) and not all(rda)  # RDA matrices and plainly averaged embeddings
    assert sum(1 for s in segments if s.name.endswith("norm.weight")) == 2 * 4 + 1


def test_outer_step_bench_computes_the_reference_merge():
    _frag, segments, rda = whole_model_layout(model_specs(llama_config(1.0)))
    f = sum(s.numel for s in segments)
    run = bench_outer_step(segments, rda, k=3, repeats=1)
    _positive_finite(run.comparison)
    assert run.comparison.measured.nbytes == run.comparison.baseline.nbytes == (3 + 2) * f * 4
    assert set(run.comparison.phases) == {"merge_fragment", "nesterov_step"}

    assert run.grad.shape == (f,) and bool(torch.isfinite(run.grad).all())
    contributions = [
        {s.name: row[s.offset : s.offset + s.numel] for s in segments} for row in run.deltas
    ]
    ref = merge_reference(
        contributions, run.weights, lambda name: is_plain_tensor(name, DEFAULT_PLAIN_PATTERNS)
    )
    for s in segments:
        got = run.grad[s.offset : s.offset + s.numel]
        torch.testing.assert_close(got, ref[s.name].float(), rtol=1e-4, atol=1e-9)


def test_upload_bench_times_accepted_uploads_without_merges():
    run = bench_upload(llama_config(1.0), repeats=1)
    _positive_finite(run.comparison)
    assert run.merges_during_timing == 0
    # warm-up and one timed round, over HTTP and in-process
    assert len(run.replies) == 4
    assert all(r["status"] == "accepted" and r["version"] == 0 for r in run.replies)
    assert run.body_bytes == run.comparison.baseline.nbytes > run.fragment_bytes
    assert run.comparison.phases["coordinator_upload_in_process"] > 0


def test_round_cpu_bench_merges_once_per_round_in_a_coordinator_process():
    run = bench_round_cpu(llama_config(0.5), rounds=3, world_size=2, warmup=1)
    assert run.versions == (1, 4)  # every round closed with a merge that both ranks got
    assert run.rounds == 3 and run.world_size == 2 and run.fragment_bytes > 0
    assert run.cpu_s >= 0 and run.wall_s > 0
    assert run.to_json()["cpu_s_per_round"] == run.cpu_s / 3


def test_memory_bench_holds_about_what_the_coordinator_needs():
    # A 16 MiB model in 8 fragments, 4 islands: the values, the momentum and 7 buffers of
    # the largest fragment, 48.6 MiB; measured 51 MiB (1.05x). Rows, a merge output and a
    # spare copy of the values kept per fragment grew it by 133 MiB (2.74x).
    run = bench_memory(llama_config(16.0), fragments=8, islands=4)
    assert run.fragments == 8 and run.islands == 4
    assert run.model_bytes > 15 * 2**20 and run.largest_bytes < run.model_bytes / 4
    assert run.needed_bytes == 2 * run.model_bytes + 7 * run.largest_bytes
    assert 0.8 * run.needed_bytes < run.grown_bytes < 1.8 * run.needed_bytes, run.to_json()


def test_cli_prints_the_table_and_writes_the_json_summary(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "coordinator", "--fragment-mb", "0.5", "--contributions", "2"]
    assert cli.main([*argv, "--repeats", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(a) outer step" in out and "(b) upload" in out and out.count("ratio") == 5
    assert "(c) coordinator process CPU per round" in out
    assert "(d) coordinator memory, P = 8 fragments, M = 4 islands" in out
    summary = json.loads(path.read_text())
    assert summary["memory"]["grown_bytes"] > 0
    assert [c["name"] for c in summary["outer_step"]] == [f"outer step K={k}" for k in (1, 2, 4, 8)]
    for c in [*summary["outer_step"], summary["upload"]]:
        assert c["ratio"] > 0 and c["measured"]["bytes_per_s"] > 0
        assert c["baseline"]["bytes_per_s"] > 0
    [rounds] = summary["round_cpu"]  # 0.5 MiB is below the tiny Llama's fragment: one size
    assert rounds["rounds"] == 4 and rounds["versions"][1] - rounds["versions"][0] == 4


def test_sigterm_stops_the_bench_and_the_coordinator_process_it_started(tmp_path):
    # The coordinator of part (c) is a child of the bench; SIGTERM to the bench alone must
    # not leave it running (the bench's cleanup runs: exit 128 + 15).
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = ["bench", "coordinator", "--fragment-mb", "0.5", "--repeats", "50"]
    proc = subprocess.Popen([sys.executable, "-m", "ds_diloco.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    children = []
    try:
        deadline = time.monotonic() + 50
        while not children:
            assert proc.poll() is None and time.monotonic() < deadline, "no coordinator started"
            found = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "ds_diloco.cli coordinator"],
                                   capture_output=True, text=True).stdout.split()  # fmt: skip
            children = [int(pid) for pid in found]
            time.sleep(0.1)
        time.sleep(1.0)  # its rounds under way
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
        alive = [pid for pid in children if os.path.exists(f"/proc/{pid}")]
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped (SIGTERM)" in out
    assert alive == [], f"coordinator process(es) {alive} outlived the bench"


def test_bad_fragment_size_or_json_path_is_refused_before_anything_runs(
    tmp_path, monkeypatch, capsys
):
    def ran(*args, **kw):
        raise AssertionError("benchmarked before the arguments were checked")

    monkeypatch.setattr("ds_diloco.bench.coordinator.bench_outer_step", ran)
    for bad in (math.inf, math.nan, 0.0):
        with pytest.raises(ValueError, match="--fragment-mb must be a finite number > 0"):
            llama_config(bad)
    argv = ["bench", "coordinator", "--repeats", "1"]
    for value in ("inf", "1e400", "nan"):
        assert cli.main([*argv, "--fragment-mb", value]) == 2, value
        err = capsys.readouterr().err
        assert "--fragment-mb must be a finite number > 0" in err and len(err.splitlines()) == 1
    # Finite but more than the machine holds: refused with what it would need.
    assert cli.main([*argv, "--fragment-mb", "1e6"]) == 2
    err = capsys.readouterr().err
    assert "--fragment-mb 1e+06 needs about 30273.4 GiB for the outer step with K = 8" in err
    assert "31 fragment-sized buffers" in err and len(err.splitlines()) == 1, err
    a_file = tmp_path / "file"
    a_file.write_text("")
    for path, says in ((tmp_path / "missing" / "x.json", "does not exist"),
                       (a_file / "x.json", "is not a folder"),
                       (tmp_path, "is a folder")):  # fmt: skip
        assert cli.main([*argv, "--fragment-mb", "0.5", "--json", str(path)]) == 2, path
        err = capsys.readouterr().err
        assert f"--json {path}: " in err and says in err and len(err.splitlines()) == 1, err


def test_a_ratio_just_below_its_goal_prints_with_the_digits_that_show_it():
    # A ratio of 0.7996 printed as "ratio 0.80  (goal >= 0.8: MISSED)".
    from ds_diloco.bench.coordinator import Comparison, Timing, format_report

    def comparison(name: str, ratio: float, phases: dict) -> Comparison:
        return Comparison(name, Timing("m", 1000, [1.0 / ratio]), Timing("b", 1000, [1.0]), phases)

    outer = [comparison("outer step K=2", r, {"merge_fragment": 0.1, "nesterov_step": 0.1})
             for r in (0.7996, 0.8, 0.95)]  # fmt: skip
    upload = comparison("upload", 0.79999, {"coordinator_upload_in_process": 0.1})
    report = format_report("header", outer, upload, headline_k=2)
    assert "ratio 0.7996  (goal >= 0.8: MISSED)" in report, report
    assert "ratio 0.80  (goal >= 0.8: met)" in report and "ratio 0.95  (goal >= 0.8: met)" in report
    assert "ratio 0.79999  (goal >= 0.8: MISSED)" in report, report
