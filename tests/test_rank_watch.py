"""Which rank of a launch died first, under the real deepspeed launcher (ds_diloco.rank_watch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil
import pytest

from ds_diloco import rank_watch
from ds_diloco.config import IslandSpec
from ds_diloco.rank_watch import RankWatch, local_rank
from ds_diloco.run import free_port, launcher_cmd

SLEEPER = "import time\nwhile True: time.sleep(1)\n"


@pytest.fixture
def launch(tmp_path):
    """Start the deepspeed launcher over ranks that only sleep; yields (launcher, its ranks)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    started = []

    def start(world: int):
        cmd = [*launcher_cmd(IslandSpec(name="a", world_size=world), free_port()), str(script)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        started.append(proc)
        deadline = time.monotonic() + 60
        while True:
            ranks = {local_rank(p.cmdline()): p for p in psutil.Process(proc.pid).children()}
            if len(ranks) == world:
                return proc, ranks
            assert time.monotonic() < deadline, "the launcher did not start its ranks"
            time.sleep(0.05)

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):  # the group is gone with its launcher
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def found(watch: RankWatch, name: str, world: int) -> bool:
    with watch._lock:
        return len(watch._launches[name].ranks) == world


def test_the_rank_that_dies_first_is_named_not_those_the_launcher_stops(launch):
    watch = RankWatch()
    try:
        launcher, ranks = launch(3)
        watch.watch("a", launcher.pid, 3)
        # Until the watch has found the ranks: a rank killed before then is a zombie whose
        # command line it cannot read, never found, and none is blamed (0.3 s of sleep is
        # not enough where a loaded machine runs its thread's first look later).
        deadline = time.monotonic() + 30
        while not found(watch, "a", 3):
            assert time.monotonic() < deadline, "the watch did not find the ranks"
            time.sleep(0.01)
        assert watch.first_dead("a") is None
        ranks[1].kill()
        assert launcher.wait(timeout=30) != 0  # it stopped ranks 0 and 2 itself
        assert not any(p.is_running() for p in ranks.values())
        assert watch.first_dead("a") == 1
        # Nothing left to watch: its thread has ended (a run keeps none per finished launch).
        deadline = time.monotonic() + 5
        while watch._thread is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch._thread is None
    finally:
        watch.close()


def test_without_pidfds_ranks_seen_gone_together_blame_none(launch, monkeypatch):
    # Where pidfd_open is missing (before Linux 5.3) the watch looks at each rank's status
    # every period: two ranks gone by the same look are not told apart, and none is blamed.
    monkeypatch.setattr(rank_watch, "_pidfd", lambda pid: None)
    watch = RankWatch(period_s=0.5)
    try:
        launcher, ranks = launch(2)
        watch.watch("a", launcher.pid, 2)
        deadline = time.monotonic() + 30  # until it found the ranks (see the test above)
        while not found(watch, "a", 2):
            assert time.monotonic() < deadline, "the watch did not find the ranks"
            time.sleep(0.01)
        # Both gone by the same look: the watch's lock (it looks holding it) is held until
        # both are dead. Killed microseconds apart against looks 0.5 s apart, a look still
        # fell between them now and then, and the rank killed first was blamed.
        with watch._lock:
            for p in ranks.values():
                p.kill()
            deadline = time.monotonic() + 30
            while any(rank_watch._running(p) for p in ranks.values()):
                assert time.monotonic() < deadline, "the ranks did not die"
                time.sleep(0.01)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30  # until it looked (1 s of sleep was luck too)
        while watch._launches["a"].first_dead is None:
            assert time.monotonic() < deadline, "the watch did not see the ranks gone"
            time.sleep(0.01)
        assert watch._launches["a"].first_dead == rank_watch.UNKNOWN
        assert watch.first_dead("a") is None
    finally:
        watch.close()
