"""The coordinator's own watchdog: a process whose event loop is stuck exits (see StallExit)."""

from __future__ import annotations

import asyncio
import faulthandler


class StallExit:
    """Exit the process, every thread's stack written to stderr first, if the event loop
    does not come round for ``stall_s``: faulthandler's timer, re-armed from the loop
    (a thread of its own, in C: it needs neither the GIL nor the loop). A coordinator
    whose loop is stuck answers nothing, SIGTERM included; exited, it is restarted."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stall_s: float):
        self.loop, self.stall_s = loop, stall_s
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.stall_s > 0:
            self._rearm()

    def _rearm(self) -> None:
        faulthandler.dump_traceback_later(self.stall_s, exit=True)  # replaces the last timer
        self._handle = self.loop.call_later(self.stall_s / 4, self._rearm)

    def stop(self) -> None:
        """Before what may hold the loop for long on purpose (the final save)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            faulthandler.cancel_dump_traceback_later()
