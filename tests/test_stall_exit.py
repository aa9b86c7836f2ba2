"""A training loop's own watch (``StallExit.beat``): a rank stuck exits with its stacks.

Each case runs in a subprocess: the watch exits the process it is in. The event loop's
form (``LoopStallExit``) is tested with the coordinator (test_coordinator_process.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

STEPS = """
import sys, time
from ds_diloco.stall_exit import StallExit

limit = float(sys.argv[2])
try:
    with StallExit(limit) as watch:
        for _ in range(int(3 * limit / 0.05)):  # steps of 50 ms for 3x the limit: no exit
            watch.beat()
            time.sleep(0.05)
        print("stepped", flush=True)
        with watch.paused():  # a checkpoint save longer than the limit
            time.sleep(1.5 * limit)
        print("saved", flush=True)
        for _ in range(10):
            watch.beat()
            time.sleep(0.05)
        if sys.argv[1] == "error":
            raise ValueError("a rank's own error")

        def stuck_in_a_collective():  # a peer froze
            print("stalling", flush=True)
            time.sleep(6 * limit)

        stuck_in_a_collective()
except ValueError:  # the watch is off once its block is left: the error's exit stands
    time.sleep(1.5 * limit)
print("went on", flush=True)
"""


def _steps(case: str, limit_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STEPS, case, str(limit_s)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


def test_a_training_loop_that_stops_beating_exits_with_its_stacks_but_not_while_paused():
    t0 = time.monotonic()
    p = _steps("stall", 1.0)
    # Beaten every step for 3 s and paused for a 1.5 s save with a 1 s limit: left alone.
    assert "stepped" in p.stdout and "saved" in p.stdout and "stalling" in p.stdout, (
        p.stdout,
        p.stderr,
    )
    # Stuck: every thread's stack, then exit 1 (what the launcher takes as a rank's death).
    assert p.returncode == 1 and "went on" not in p.stdout, (p.stdout, p.stderr)
    assert "Timeout (0:00:01)!" in p.stderr and "in stuck_in_a_collective" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30


def test_an_error_that_leaves_the_watched_loop_disarms_the_watch():
    p = _steps("error", 1.0)
    assert p.returncode == 0 and "went on" in p.stdout, (p.stdout, p.stderr)
    assert "Timeout" not in p.stderr, p.stderr
