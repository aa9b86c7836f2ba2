"""The README's main job, end to end: a coordinator and island processes on real text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_trains_and_merges_on_real_text(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ds_diloco.cli", "demo", "--islands", "2", "--steps", "24",
           "--corpus", str(REPO / "tests" / "data"), "--workdir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"] - 0.5, summary
    # 24 steps, H = P = 8: every fragment is due three times per island; K = 1 merges them.
    assert min(summary["merges"]) >= 2 and summary["versions"] == summary["merges"]
    for island, stats in summary["island_stats"].items():
        assert stats["uploads"] == 24 and stats["refused"] == 0 and stats["failed"] == 0, island
