"""Which rank of an island's launch died first (the slot a downscale leaves out).

The deepspeed launcher polls its ranks once a second and, when one has exited non-zero,
SIGTERMs the rest; its log names the last rank it *started*, not the one that failed.
This thread holds a pidfd of each rank of each launch (Linux 5.3: readable once the
process has exited, whoever its parent is) and waits on all of them at once: the kernel
marks the first rank's pidfd when it exits, and the launcher's stop of the others comes
at its next poll, so the first wake-up sees one rank gone. Seen together (or where
pidfds are missing: looked at every ``period_s``), no rank is blamed.
"""

from __future__ import annotations

import os
import select
import threading

import psutil

UNKNOWN = -1
"""More than one rank was gone at the first look after a death: none is blamed."""


class _Launch:
    def __init__(self, launcher_pid: int, world: int):
        self.launcher_pid, self.world = launcher_pid, world
        self.ranks: dict[int, psutil.Process] = {}
        self.fds: dict[int, int] = {}  # pidfd -> local rank
        self.first_dead: int | None = None

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


class RankWatch:
    """``watch(name, launcher_pid, world)`` at each launch; ``first_dead(name)`` after it died."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self._launches: dict[str, _Launch] = {}
        self._retired: list[_Launch] = []  # launches whose pidfds the loop is to close
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # runs while a launch is watched

    def watch(self, name: str, launcher_pid: int, world: int) -> None:
        with self._lock:
            old = self._launches.get(name)
            if old is not None and old.first_dead is None:
                old.first_dead = UNKNOWN  # superseded: the loop closes its pidfds
                self._retired.append(old)
            self._launches[name] = _Launch(launcher_pid, world)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name="rank-watch", daemon=True)
                self._thread.start()

    def first_dead(self, name: str) -> int | None:
        """The local rank that died while the others of the launch ran; None: not seen."""
        with self._lock:
            launch = self._launches.get(name)
        if launch is None or launch.first_dead in (None, UNKNOWN):
            return None
        return launch.first_dead

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        with self._lock:
            for launch in [*self._launches.values(), *self._retired]:
                launch.close()

    def _loop(self) -> None:
        # The pidfds are opened, polled and closed on this thread alone: one closed while
        # polled could be reused by the next file opened anywhere in the process.
        while not self._stop.is_set():
            with self._lock:
                for launch in self._retired:
                    launch.close()
                self._retired.clear()
                open_ = [x for x in self._launches.values() if x.first_dead is None]
                if not open_:  # every launch decided: no thread left behind (watch starts one)
                    self._thread = None
                    return
                for launch in open_:
                    if len(launch.ranks) < launch.world:
                        _find_ranks(launch)
            fds = [fd for launch in open_ for fd in launch.fds]
            if fds:
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                ready = {fd for fd, _ in poller.poll(self.period_s * 1000)}
            else:
                ready = set()
                self._stop.wait(self.period_s)
            with self._lock:
                for launch in open_:
                    if launch.first_dead is None and len(launch.ranks) == launch.world:
                        _look(launch, ready)


def _look(launch: _Launch, ready: set[int]) -> None:
    if launch.fds:  # the kernel's word, at the wake-up
        dead = [launch.fds[fd] for fd in ready if fd in launch.fds]
    else:  # no pidfds here: a look at each rank's status
        dead = [rank for rank, proc in launch.ranks.items() if not _running(proc)]
    if dead:
        launch.first_dead = dead[0] if len(dead) == 1 else UNKNOWN
        launch.close()


def _find_ranks(launch: _Launch) -> None:
    """The launch's rank processes (the launcher's children), once it has started them all."""
    try:
        children = psutil.Process(launch.launcher_pid).children()
    except psutil.Error:
        launch.first_dead = UNKNOWN  # the launcher is gone before its ranks were seen
        return
    for child in children:
        try:
            rank = local_rank(child.cmdline())
        except psutil.Error:
            continue
        if rank is not None and rank not in launch.ranks:
            launch.ranks[rank] = child
            fd = _pidfd(child.pid)
            if fd is not None:
                launch.fds[fd] = rank
    if len(launch.ranks) == launch.world and len(launch.fds) < launch.world:
        launch.close()  # some pidfd missing: every rank is looked at by status instead


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3, or the rank is gone already
        return None


def _running(proc: psutil.Process) -> bool:
    try:  # is_running: False for a reaped rank whose pid was given to another process
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # reaped
        return False


def local_rank(cmdline: list[str]) -> int | None:
    """The ``--local_rank=N`` the deepspeed launcher gives each rank's command line."""
    for arg in cmdline:
        if arg.startswith("--local_rank="):
            return int(arg.split("=", 1)[1])
    return None
