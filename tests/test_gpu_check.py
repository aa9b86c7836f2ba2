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
