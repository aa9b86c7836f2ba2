"""A process whose loop stops coming round exits, every thread's stack written first.

Watched: the coordinator's event loop (``LoopStallExit``), an island rank's training
loop (``StallExit.beat`` at every step) and each phase of its start-up (a beat between
phases). A process stuck on a lock, in a collective whose peer froze, or on a dead disk
lives on and answers nothing, SIGTERM included; exited, it is restarted by whatever
supervises it (``ds-diloco run``, the deepspeed launcher's job under systemd or
Kubernetes)."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import time


class StallExit:
    """faulthandler's timer, re-armed by ``beat``: if no beat comes for ``stall_s``, its
    thread (in C: it needs neither the GIL nor the loop) writes every thread's stack to
    stderr and exits the process with status 1. Each arming starts that thread anew, so a
    beat re-arms only once ``stall_s / 16`` has passed since the last: a loop that beats
    at least every ``15/16 stall_s`` is never stopped, and one stuck is stopped at most
    ``stall_s`` after its last beat. ``stall_s`` 0: never armed."""

    active: StallExit | None = None
    """The watch armed in this process (faulthandler has one timer a process), if any."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._armed_at: float | None = None

    @property
    def armed(self) -> bool:
        return self._armed_at is not None

    def start(self) -> None:
        if self.stall_s > 0:
            self._arm()

    def beat(self) -> None:
        """The loop came round."""
        if self._armed_at is not None and time.monotonic() - self._armed_at >= self.stall_s / 16:
            self._arm()

    def _arm(self) -> None:
        faulthandler.dump_traceback_later(self.stall_s, exit=True)  # replaces the last timer
        self._armed_at = time.monotonic()
        StallExit.active = self

    def stop(self) -> None:
        """Before what may hold the loop for long on purpose (a final save)."""
        if self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None
            if StallExit.active is self:
                StallExit.active = None

    def __enter__(self) -> StallExit:
        self.start()
        return self

    def __exit__(self, *exc) -> None:  # after an error too: its exit status is the error's
        self.stop()

    @contextlib.contextmanager
    def paused(self):
        """Not armed meanwhile (a checkpoint save, as long as the disk makes it); re-armed
        after, if it was."""
        was = self.armed
        self.stop()
        try:
            yield
        finally:
            if was:
                self._arm()


@contextlib.contextmanager
def unwatched():
    """The watch armed in this process, if any, not armed meanwhile: around a wait with a
    bound of its own (``zero.patient_group``: tokenising a corpus, converting a checkpoint,
    for hours on a large one)."""
    watch = StallExit.active
    if watch is None:
        yield
        return
    with watch.paused():
        yield


class LoopStallExit(StallExit):
    """Beaten by the event loop itself, every ``stall_s / 16``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stall_s: float):
        super().__init__(stall_s)
        self.loop = loop
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        super().start()
        if self.armed:
            self._tick()

    def _tick(self) -> None:
        self.beat()
        self._handle = self.loop.call_later(self.stall_s / 16, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        super().stop()
