"""Resuming a whole run, and starting a run from another run's export (real processes).

``ds-diloco run FILE`` is stopped with Ctrl-C half-way; ``ds-diloco run FILE --resume``
continues it: the coordinator at the versions, merges and outer momentum of its state
directory, every island from its last DeepSpeed checkpoint (step, tokens, AdamW state,
data position). Then the run's export is the pretrained model of a second run, whose
coordinator starts from exactly the first run's final tensors. About 1.5-2 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.coordinator import Coordinator
from ds_diloco.export import load_global

REPO = Path(__file__).resolve().parents[1]
STEPS = 60
TOKENS_PER_STEP = 4 * 32  # micro_batch x seq_len, world size 1


def write_run_file(tmp_path, name, model, steps, **train) -> Path:
    run = {
        "workdir": str(tmp_path / name),
        "model": model,
        "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        "data": {"path": str(REPO / "tests" / "data"), "vocab_size": 512, "seq_len": 32,
                 "cache_dir": str(tmp_path / "cache"), "heldout_fraction": 0.05},
        "train": {"steps": steps, "micro_batch": 4, "lr": 3e-3, "log_every": 2, **train},
        "islands": [{"name": "a", "world_size": 1}, {"name": "b", "world_size": 1}],
        "coordinator": {"num_fragments": 4, "sync_every": 4,
                        "policy": {"min_quorum": 1, "grace_gamma": 0.5, "tau": 1}},
        "prompt": "Shall I",
    }  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(run))
    return path


def ds_diloco_run(*args, timeout=400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ds_diloco.cli", "run", *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def last_step(progress: Path) -> int:
    if not progress.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in progress.read_text().splitlines()]
    return max(steps, default=0)


def logs(workdir: Path, out: str) -> str:
    tails = "".join(p.read_text()[-2000:] for p in workdir.glob("islands/*/log.txt"))
    return out[-3000:] + tails


@pytest.mark.timeout(600)  # 1.5-2 min on 2 free cores; more on a loaded machine
def test_stopped_run_resumes_and_its_export_starts_the_next_run(
    tmp_path, tiny_config_path, kill_leftovers
):
    run_file = write_run_file(tmp_path, "run1", {"config": tiny_config_path, "seed": 0}, STEPS,
                              checkpoint_every=5, step_delay_s=0.1)  # fmt: skip
    workdir = tmp_path / "run1"

    # Nothing to resume yet: one clear line, no traceback.
    first = ds_diloco_run(run_file, "--resume", timeout=60)
    assert first.returncode == 2 and "nothing to resume" in first.stderr, first.stderr

    # 1. Ctrl-C once both islands are past a checkpoint or two. Started with SIGINT ignored,
    # as a shell starts a background job: the run installs its own handler.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ds_diloco.cli", "run", str(run_file)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    progress = {n: workdir / "islands" / n / "progress.jsonl" for n in ("a", "b")}
    try:
        deadline = time.monotonic() + 180
        while not all(last_step(p) >= 12 for p in progress.values()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not train"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        leftovers = kill_leftovers(workdir)
    assert proc.returncode == 130 and "interrupted (SIGINT)" in out, logs(workdir, out)
    assert leftovers.strip() == "", leftovers  # no rank, launcher or coordinator left
    stopped = load_global(workdir / "state")  # what the coordinator served last, on disk
    merges = json.loads((workdir / "state" / "coordinator.json").read_text())["merges"]
    ckpt = {n: int((workdir / "islands" / n / "checkpoints" / "latest").read_text()[4:])
            for n in ("a", "b")}  # fmt: skip
    assert min(merges) >= 1 and min(stopped.versions) >= 1, (merges, stopped.versions)
    assert all(5 <= s < STEPS for s in ckpt.values()), ckpt

    # 2. --resume: the coordinator goes on from its versions, the islands from their checkpoints
    # (and the merged model is evaluated every 10 merges from there on, and at the end).
    run_file.write_text(json.dumps({**json.loads(run_file.read_text()), "eval_every_merges": 10}))
    resumed = ds_diloco_run(run_file, "--resume")
    assert resumed.returncode == 0, logs(workdir, resumed.stdout + resumed.stderr)
    assert f"resuming at versions {stopped.versions} (merges {merges})" in resumed.stdout
    summary = json.loads((workdir / "summary.json").read_text())
    # Planned and done: each island's first launch of this run began at its checkpoint.
    assert summary["resumed_from"] == {n: {"step": s, "started_step": s} for n, s in ckpt.items()}
    assert all(m > m0 for m, m0 in zip(summary["merges"], merges)), (summary["merges"], merges)
    evals = summary["global_evals"]
    assert all(e["merges"] > sum(merges) for e in evals), (evals, merges)  # none made again
    assert evals[-1]["merges"] == sum(summary["merges"]), (evals, summary["merges"])
    assert evals[-1]["heldout_loss"] == pytest.approx(summary["heldout_loss_merged"], abs=1e-5)
    final = load_global(workdir / "state")
    assert all(v > v0 for v, v0 in zip(final.versions, stopped.versions))
    for name, step in ckpt.items():
        starts = [r for line in progress[name].read_text().splitlines()
                  if "started_at" in (r := json.loads(line))]  # fmt: skip
        assert [(r["step"], r["resumed"]) for r in starts] == [(0, False), (step, True)], starts
        island = summary["islands"][name]
        assert island["start_step"] == step and island["steps"] == STEPS
        assert island["tokens"] == STEPS * TOKENS_PER_STEP  # counted on from the checkpoint
    assert summary["heldout_loss_merged"] < summary["heldout_loss_initial"] - 0.3, summary
    assert summary["sample"].startswith("Shall I")

    # 3. The export starts another run: its coordinator's tensors are run 1's final ones ...
    export = workdir / "export"
    start = Coordinator(CoordinatorConfig(model=ModelSource(pretrained=str(export)),
                                          state_dir=str(tmp_path / "c2"), num_fragments=4))  # fmt: skip
    got = start.global_tensors()
    assert got.keys() == final.tensors.keys()
    assert all(torch.equal(got[k], final.tensors[k]) for k in got)
    # ... and it trains on, with the export's tokenizer (run 1's), from run 1's loss: every
    # island's first logged loss is near run 1's level, not the 6.2 of a fresh model. On this
    # tiny model the held-out loss wanders +-0.1-0.2 around a slow descent (eval every 12
    # steps of a 144-step run: 5.46 at 24, 5.64 at 48, 5.19 at 144), so run 2 trains long
    # enough to descend past that: 24 steps at 1e-3 moved it by -0.06..-0.10 and twice by
    # +0.01/+0.03 (CI failures); 48 by -0.105..-0.219 in seven runs, but -0.043 beside a CPU
    # hog; 96 by -0.20 and -0.23 from one export (about 8 s more than 48).
    # In the same workdir, as the README offers (model.pretrained: runs/<run>/export): the
    # run's export replaces the folder it started from, and its "initial" loss, taken after
    # that, was the merged one.
    run2 = write_run_file(tmp_path, "run2", {"pretrained": str(export)}, 96, lr=1e-3,
                          warmup_steps=4)  # fmt: skip
    run2.write_text(json.dumps({**json.loads(run2.read_text()), "workdir": str(workdir)}))
    second = ds_diloco_run(run2)
    assert second.returncode == 0, logs(workdir, second.stdout + second.stderr)
    s2 = json.loads((workdir / "summary.json").read_text())
    assert s2["heldout_loss_initial"] == pytest.approx(summary["heldout_loss_merged"], rel=1e-5)
    for name in ("a", "b"):
        lines = (workdir / "islands" / name / "progress.jsonl").read_text().splitlines()
        first = next(r["loss"] for line in lines if "loss" in (r := json.loads(line)))
        assert first < s2["heldout_loss_initial"] + 0.4 < summary["heldout_loss_initial"], first
    assert s2["heldout_loss_merged"] < s2["heldout_loss_initial"], s2
    assert min(s2["merges"]) >= 1


@pytest.mark.timeout(300)
def test_an_island_resumed_with_more_ranks_goes_on_from_its_checkpoint(
    tmp_path, tiny_config_path, kill_leftovers
):
    # One island of 1 rank checkpoints at steps 5 and 6 (its last) and finishes; resumed for
    # more steps on 2 ranks, it goes on from step 6 through DeepSpeed's universal format.
    # Before, DeepSpeed refused the checkpoint and the island started over from step 0 (the
    # exact AdamW state across a resize: tests/test_zero.py).
    run_file = write_run_file(tmp_path, "run", {"config": tiny_config_path, "seed": 0}, 6,
                              checkpoint_every=5)  # fmt: skip
    workdir = tmp_path / "run"
    run = json.loads(run_file.read_text())
    run["islands"] = [{"name": "a", "world_size": 1}]
    run["eval_every_merges"] = 4
    run_file.write_text(json.dumps(run))
    first = ds_diloco_run(run_file)
    assert first.returncode == 0, logs(workdir, first.stdout + first.stderr)
    first_summary = json.loads((workdir / "summary.json").read_text())
    assert first_summary["global_evals"], first_summary
    checkpoints = workdir / "islands" / "a" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step6"

    run["islands"] = [{"name": "a", "world_size": 2}]
    run["train"].update(steps=8, micro_batch=2)  # not done yet: --resume starts it again
    run["max_restarts"] = 0  # the first failed launch ends the run
    run_file.write_text(json.dumps(run))
    resumed = ds_diloco_run(run_file, "--resume")
    leftovers = kill_leftovers(workdir)
    assert resumed.returncode == 0, logs(workdir, resumed.stdout + resumed.stderr)
    assert leftovers.strip() == "", leftovers
    log = (workdir / "islands" / "a" / "log.txt").read_text()
    assert (
        "was written with world size 1, this island has world size 2: loaded from its "
        "universal form" in log
    ), log[-3000:]
    lines = (workdir / "islands" / "a" / "progress.jsonl").read_text().splitlines()
    starts = [r for line in lines if "started_at" in (r := json.loads(line))]
    assert [(r["step"], r["resumed"]) for r in starts] == [(0, False), (6, True)], starts
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from"] == {"a": {"step": 6, "started_step": 6}}
    island = summary["islands"]["a"]
    assert island["start_step"] == 6 and island["steps"] == 8
    assert island["tokens"] == 6 * TOKENS_PER_STEP + 2 * 2 * 2 * 32  # 7 and 8: 2 ranks x 2
    # Its data went on from the checkpoint's place: 6 x 4 blocks on one rank, then 2 x 2 x 2
    # (not 3 micro-batches a rank of the new size, as each rank's count alone would say).
    assert island["data_rows"] == 6 * 4 + 2 * 2 * 2, island
    # The island's next checkpoint (step 8, two ranks) made the converted one stale.
    assert (checkpoints / "latest").read_text() == "step8"
    assert not (checkpoints / "universal").exists()


@pytest.mark.timeout(300)
def test_finished_run_resumed_for_more_steps_goes_on_from_its_last_step(
    tmp_path, tiny_config_path, kill_leftovers
):
    # Checkpoints every 4 steps, 6 steps: the island used to resume from step 4 and train
    # steps 5 and 6 a second time (on the same batches, counting their tokens twice).
    run_file = write_run_file(tmp_path, "run", {"config": tiny_config_path, "seed": 0}, 6,
                              checkpoint_every=4)  # fmt: skip
    workdir = tmp_path / "run"
    run = json.loads(run_file.read_text())
    run["islands"] = [{"name": "a", "world_size": 1}]
    run["eval_every_merges"] = 4
    run_file.write_text(json.dumps(run))
    first = ds_diloco_run(run_file)
    assert first.returncode == 0, logs(workdir, first.stdout + first.stderr)
    first_summary = json.loads((workdir / "summary.json").read_text())
    assert first_summary["global_evals"], first_summary

    # A rank lost in the final flush, after its last checkpoint: the island is started again
    # at its last step, trains none and leaves. It failed on the empty list of its step
    # times, with exit status 2, and was given up: "islands failed".
    (workdir / "islands" / "a" / "summary-rank0.json").unlink()
    again = ds_diloco_run(run_file, "--resume")
    assert again.returncode == 0, logs(workdir, again.stdout + again.stderr)
    summary = json.loads((workdir / "summary.json").read_text())
    island = summary["islands"]["a"]
    assert (island["start_step"], island["steps"], island["step_s_median"]) == (6, 6, None)
    # The summary rewritten by the resume keeps the run's held-out losses by merges (no
    # merge made since) and counts the first launch's time: both were lost with the file.
    assert summary["global_evals"] == first_summary["global_evals"], summary
    assert summary["wall_s_total"] == pytest.approx(
        first_summary["wall_s"] + summary["wall_s"], abs=0.11
    )

    # ... with 2 micro-batches per step from now on: the data goes on after the 6 batches
    # read, not after 6 x 2 (the checkpoint says how many were read).
    run["train"].update(steps=8, grad_accum=2)
    run_file.write_text(json.dumps(run))
    resumed = ds_diloco_run(run_file, "--resume")
    leftovers = kill_leftovers(workdir)
    assert resumed.returncode == 0, logs(workdir, resumed.stdout + resumed.stderr)
    assert leftovers.strip() == "", leftovers
    lines = (workdir / "islands" / "a" / "progress.jsonl").read_text().splitlines()
    starts = [r for line in lines if "started_at" in (r := json.loads(line))]
    assert [(r["step"], r["resumed"]) for r in starts] == [(0, False), (6, True), (6, True)]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from"] == {"a": {"step": 6, "started_step": 6}}
    island = summary["islands"]["a"]
    assert island["start_step"] == 6 and island["steps"] == 8
    assert island["tokens"] == (6 + 2 * 2) * TOKENS_PER_STEP  # each step's tokens counted once
    assert island["batches"] == 6 + 2 * 2 and island["optimizer_steps"] == 8, island
