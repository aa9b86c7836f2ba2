"""A training loop's own watch (``StallExit.beat``): a rank stuck exits with its stacks;
and the same watch over an island rank's start-up (``train.startup_stall_s``).

Each case runs in a subprocess: the watch exits the process it is in. The event loop's
form (``LoopStallExit``) is tested with the coordinator (test_coordinator_process.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO

from ds_diloco.run import free_port, stall_reason

STEPS = """
import sys, time
from ds_diloco.stall_exit import StallExit, unwatched

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
        with unwatched():  # a wait with a bound of its own (zero.patient_group)
            time.sleep(1.5 * limit)
        assert StallExit.active is watch, StallExit.active  # armed again after
        print("waited", flush=True)
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
    assert StallExit.active is None
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
    assert all(w in p.stdout for w in ("stepped", "saved", "waited", "stalling")), (
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


STARTUP_S = 20.0  # train.startup_stall_s: over every phase of a one-rank tiny Llama's start-up
# (the longest, build_engine, took 3.4 s at load average 5: at 8 s, a loaded CI machine could
# fire the watch in that phase, not in the one the test holds)


def test_a_rank_stuck_in_its_start_up_exits_with_its_stacks(tmp_path, tiny_config_path):
    # A one-rank island has no peer whose collective would time out: a rank held before its
    # first step by a filesystem that does not answer (here its checkpoint pointer is a
    # FIFO nobody writes: reading it blocks for ever) waited for ever. Its start-up watch
    # stops it, its stacks in the log, for whatever supervises it to restart it.
    work = tmp_path / "island"
    (work / "checkpoints").mkdir(parents=True)
    os.mkfifo(work / "checkpoints" / "latest")
    cfg = {
        "island": "a", "coordinator_url": "http://127.0.0.1:9", "workdir": str(work),
        "model": {"config": tiny_config_path, "seed": 0},
        "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        "data": {"path": str(REPO / "tests" / "data"), "vocab_size": 512, "seq_len": 32,
                 "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": 4, "micro_batch": 2, "checkpoint_every": 2,
                  "startup_stall_s": STARTUP_S},
    }  # fmt: skip
    (tmp_path / "island.json").write_text(json.dumps(cfg))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ds_diloco.cli", "island", "--plain", "--config",
                        str(tmp_path / "island.json")], capture_output=True, text=True,
                       timeout=120, env=env)  # fmt: skip
    took = time.monotonic() - t0
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "in one phase of its start-up (train.startup_stall_s)" in p.stderr, p.stderr[-3000:]
    stacks = p.stderr[p.stderr.index(f"Timeout (0:00:{STARTUP_S:02.0f})!") :]
    assert "in latest_tag" in stacks and "in load_checkpoint" in stacks, stacks[:3000]
    assert STARTUP_S <= took < 120, took
    assert not (work / "summary-rank0.json").exists()


@pytest.mark.parametrize(
    ("fired", "loop_s", "startup_s", "said"),
    [
        ("0:00:08", 8.0, 3600.0, "a rank's training loop did not come round for train.stall_exit_s (0:00:08)"),
        ("1:00:00", 600.0, 3600.0, "a rank spent train.startup_stall_s (1:00:00) in one phase of its start-up"),
        ("0:00:08.500000", 600.0, 8.5, "a rank spent train.startup_stall_s (0:00:08.500000) in one phase of its start-up"),
        ("0:10:00", 600.0, 600.0, "a rank's start-up or training loop did not get on for 0:10:00 (train.startup_stall_s, train.stall_exit_s)"),
        ("0:10:00", 600.0, 0.0, "a rank's training loop did not come round for train.stall_exit_s (0:10:00)"),
    ],
)  # fmt: skip
def test_the_run_says_which_watch_stopped_an_island(fired, loop_s, startup_s, said):
    assert stall_reason(fired, loop_s, startup_s) == (
        f"stalled: {said}; the ranks' stacks are in its log"
    )
