"""A process started by ``ds-diloco run`` stops once the run is gone (``orphan_exit``)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import psutil
import pytest

from ds_diloco import orphan_exit

CHILD = """
import os, signal, time
from ds_diloco import orphan_exit
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM", flush=True), os._exit(0)))
assert orphan_exit.watch_run(0.1) is not None
print("up", flush=True)
time.sleep(600)
"""

RUN = f"""
import os, subprocess, sys, time
from ds_diloco import orphan_exit
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}],
                         env={{**os.environ, **orphan_exit.run_env()}})
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_process_the_run_started_stops_once_the_run_is_killed():
    # The run SIGKILLed and not yet reaped by its own parent (here, this test): a zombie,
    # whose pid is still there.
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE, text=True)
    lines = queue.Queue()  # the run's and its child's (a bounded wait for each)
    threading.Thread(target=lambda: [lines.put(x) for x in run.stdout], daemon=True).start()
    try:
        child = psutil.Process(int(lines.get(timeout=60)))
        assert lines.get(timeout=60) == "up\n"
        time.sleep(0.5)  # several looks: the run is there
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        run.kill()
        deadline = time.monotonic() + 10  # its death takes a scheduler's turn on a busy host
        while psutil.Process(run.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, psutil.Process(run.pid).status()
            time.sleep(0.05)
        assert lines.get(timeout=15) == "SIGTERM\n"  # its own stop
        child.wait(timeout=10)
    finally:
        run.kill()
        run.wait()
        subprocess.run(["pkill", "-KILL", "-f", "orphan_exit.watch_run"], check=False)


def test_a_run_is_known_by_its_pid_and_start_time():
    here = orphan_exit.run_env()[orphan_exit.RUN_ENV]
    assert not orphan_exit.run_gone(here)
    pid, _, started = here.partition(":")
    started, host = started.split(":")
    assert orphan_exit.run_gone(f"{pid}:{float(started) - 1}:{host}")  # its pid, used again
    unused = max(p.pid for p in psutil.process_iter()) + 10_000
    assert orphan_exit.run_gone(f"{unused}:0.0:{host}")


def test_no_watch_without_a_run_and_a_malformed_variable_is_named(monkeypatch):
    monkeypatch.delenv(orphan_exit.RUN_ENV, raising=False)
    assert orphan_exit.watch_run() is None
    monkeypatch.setenv(orphan_exit.RUN_ENV, "1234")
    with pytest.raises(ValueError, match="DS_DILOCO_RUN='1234' is not PID:START_TIME:HOST"):
        orphan_exit.watch_run()
    assert os.environ[orphan_exit.RUN_ENV] == "1234"
    # A rank on another node than the run's: the pid names no process here.
    monkeypatch.setenv(orphan_exit.RUN_ENV, "1:0.0:another-node")
    assert orphan_exit.watch_run() is None
