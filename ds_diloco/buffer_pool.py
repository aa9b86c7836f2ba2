"""Fragment-sized fp32 buffers that the coordinator's fragments share (see BufferPool)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import torch

log = logging.getLogger(__name__)

IDLE_FREE_S = 60.0
"""A free buffer not taken again for this long is let go. Rounds come every few seconds,
so the buffers a run needs are taken again long before; what a burst needed (islands'
final flushes hold a row per fragment until its next round) goes back to the system."""


def size_class(numel: int) -> int:
    """``numel`` rounded up to its pool size class: 4 significant bits (at most 1/8 more).
    Fragments of similar sizes share buffers; a small one never takes a large one's."""
    shift = max(numel.bit_length() - 4, 0)
    return -(-numel >> shift) << shift


class BufferPool:
    """Fragment-sized fp32 buffers, shared by all fragments: the values a merge steps
    (served once published), and transient ones (contributions' rows, merge outputs, the
    outer state a failed merge puts back).

    Values take a buffer of their size class (``size_class``: at most 1/8 more than
    they need), which a later merge of any fragment of the class reuses once no download
    reads that version. Transient buffers are all of the largest fragment's class, so
    any fragment's row can take any free one: a row is held from a contribution's first
    upload until its round is merged or it is dropped, and rounds open one or two
    fragments at a time, so M islands take about M rows at once, not M per fragment.
    Kept per fragment instead, rows (M, rounded up to a power of two), a merge output
    and a spare copy of the values were M + 2 copies of the model for good (7B, M = 8:
    270 GB). Buffers are reused, so a reused one has its pages already in; the last
    freed is the first taken, and one idle for ``idle_free_s`` is let go.
    """

    def __init__(self, largest: int, idle_free_s: float = IDLE_FREE_S, clock=time.monotonic):
        self.largest = largest
        """The largest fragment's size: transient buffers are of its class."""
        self.idle_free_s, self._clock = idle_free_s, clock
        # Per size class, (when given back, buffer), the last given back last.
        self._free: dict[int, list[tuple[float, torch.Tensor]]] = collections.defaultdict(list)
        self._buffers: dict[int, torch.Tensor] = {}  # by data pointer: all held
        self._lock = threading.Lock()
        # Given back by finalisers (``give_soon``), taken in at the pool's next call.
        self._returned: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()

    def take(self, numel: int) -> torch.Tensor:
        """A buffer of ``numel``'s class, its first ``numel`` elements (whatever they hold)."""
        if not 0 < numel <= self.largest:
            raise ValueError(f"a buffer of {numel} elements (the largest fragment: {self.largest})")
        return self._take(size_class(numel), numel)

    def take_transient(self, numel: int) -> torch.Tensor:
        """Like ``take``, from the largest fragment's class: for a buffer given back soon."""
        if not 0 < numel <= self.largest:
            raise ValueError(f"a buffer of {numel} elements (the largest fragment: {self.largest})")
        return self._take(size_class(self.largest), numel)

    def _take(self, size: int, numel: int) -> torch.Tensor:
        with self._lock:
            self._take_returned()
            free = self._free[size]
            buf = free.pop()[1] if free else None
            self._let_go_idle()
        if buf is None:  # more of this class in use at once than the pool holds
            buf = torch.empty(size)
            with self._lock:
                self._buffers[buf.data_ptr()] = buf
        return buf[:numel]

    def owns(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is one ``take`` returned (values read from disk are not)."""
        with self._lock:
            return self._owns(view)

    def _owns(self, view: torch.Tensor) -> bool:
        buf = self._buffers.get(view.data_ptr())
        return buf is not None and view.untyped_storage().data_ptr() == buf.data_ptr()

    def give(self, view: torch.Tensor) -> None:
        """Back to the pool: ``view`` (one ``take`` returned) must not be used after."""
        with self._lock:
            self._take_returned()
            self._give(view)
            self._let_go_idle()

    def give_soon(self, view: torch.Tensor) -> None:
        """Back to the pool at its next call, if it is one of the pool's (else let go):
        for finalisers. The cyclic garbage collector runs them at whatever allocation
        it starts on, also one inside this pool's own calls, with ``_lock`` held: a
        finaliser that took the lock there waited for its own thread for good (a
        coordinator froze so). ``SimpleQueue.put`` takes no lock a thread may hold."""
        self._returned.put(view)

    def _give(self, view: torch.Tensor) -> None:
        buf = self._buffers[view.data_ptr()]
        free = self._free[buf.numel()]
        if any(b is buf for _, b in free):
            raise RuntimeError("a buffer was given back twice")
        free.append((self._clock(), buf))

    def _take_returned(self) -> None:
        """The buffers of ``give_soon`` back among the free ones (with ``_lock`` held)."""
        while True:
            try:
                view = self._returned.get_nowait()
            except queue.Empty:
                return
            if not self._owns(view):  # (values read from disk or made at start just go)
                continue
            try:
                self._give(view)
            except RuntimeError:  # not the caller's fault: say so, and go on
                log.exception("a finalised buffer was free already")

    def _let_go_idle(self) -> None:
        """Drop the free buffers idle for ``idle_free_s`` (with ``_lock`` held): the oldest
        are first in each list."""
        cutoff = self._clock() - self.idle_free_s
        for free in self._free.values():
            n = 0
            while n < len(free) and free[n][0] < cutoff:
                del self._buffers[free[n][1].data_ptr()]
                n += 1
            del free[:n]

    def usage(self) -> dict[str, int]:
        """Buffers held (in use or free: the most in use at once lately), those in use
        now, and the bytes they hold."""
        with self._lock:
            self._take_returned()
            held = len(self._buffers)
            free = sum(len(f) for f in self._free.values())
            nbytes = 4 * sum(b.numel() for b in self._buffers.values())
            return {"held": held, "in_use": held - free, "bytes": nbytes}
