"""launch/gpu_check.sh: its syntax, and its CPU fallback run for real (CUDA hidden)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "gpu_check.sh"


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.timeout(300)
def test_gpu_check_cpu_fallback_runs_both_modes_and_says_so(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable,
           "GPU_CHECK_WORKDIR": str(tmp_path / "run"), "GPU_CHECK_STEPS": "4"}  # fmt: skip
    extra = ["--corpus", str(REPO / "tests" / "data"), "--cache-dir", str(tmp_path / "cache"),
             "--json", str(tmp_path / "out.json")]  # fmt: skip
    p = subprocess.run(["bash", str(SCRIPT), *extra], env=env, capture_output=True, text=True,
                       timeout=280)  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "CPU FALLBACK with the tiny model" in p.stdout, p.stdout
    assert "ds_diloco / plain: step time" in p.stdout, p.stdout
    figures = json.loads((tmp_path / "out.json").read_text())
    plain, ds = figures["plain"], figures["ds_diloco"]
    assert plain["merges"] is None and sum(ds["merges"]) > 0, figures
    assert plain["step_s"] > 0 and ds["step_s"] > 0 and ds["tokens_per_s"] > 0
    assert plain["peak_gpu_mb"] is None  # on the CPU: host memory is reported instead
    # The sync part's breakdown: sends and applies happened, within the sync part (rounded).
    assert ds["send_ms"] > 0 and ds["apply_ms"] > 0
    assert ds["send_ms"] + ds["apply_ms"] <= ds["sync_ms"] + 0.1
    assert "sync part" in p.stdout and plain["send_ms"] == plain["apply_ms"] == 0
    # On the CPU the shard is host memory: applied from the base, no copy to a device.
    assert ds["applies"][0] == 0 < ds["applies"][1] and plain["applies"] == [0, 0]
    assert f"0 of {ds['applies'][1]} applies from a copy on the device" in p.stdout


def test_the_islands_take_the_gpus_the_job_was_given(tmp_path, monkeypatch):
    # A job given GPUs 4-7 (CUDA_VISIBLE_DEVICES, as Slurm sets it): the islands had
    # include 'localhost:0,1' and 'localhost:2,3', the devices' own ids to the launcher,
    # and ran on GPUs 0-3 (someone else's, or none at all where the job sees only its own).
    import argparse
    import base64

    import torch

    from ds_diloco import run as run_mod
    from ds_diloco.bench import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    args = argparse.Namespace(
        model=str(REPO / "model_configs" / "tiny-llama.json"),
        deepspeed_config=str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        corpus=str(REPO / "tests" / "data"), vocab_size=512, seq_len=32,
        cache_dir=str(tmp_path / "cache"), steps=2, micro_batch=2, fragments=2, sync_every=4,
        compression="none",
    )  # fmt: skip
    lr = run_mod.LocalRun(gpu_check.run_config(args, tmp_path / "run"))
    devices, popen = {}, subprocess.Popen

    def launch(cmd, **kwargs):  # what start_island launches, noted; a process that exits
        (info,) = [a.split("=", 1)[1] for a in cmd if a.startswith("--world_info=")]
        name = Path(cmd[cmd.index("--config") + 1]).parent.name
        devices[name] = json.loads(base64.urlsafe_b64decode(info))["localhost"]
        return popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(run_mod.subprocess, "Popen", launch)
    try:
        for shard, spec in enumerate(lr.cfg.islands):
            lr.start_island(spec, shard, 2, plain=True)
    finally:
        lr.stop()
    assert devices == {"island-a": [4, 5], "island-b": [6, 7]}, devices
