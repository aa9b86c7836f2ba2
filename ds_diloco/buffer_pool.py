"""Fragment-sized fp32 buffers that the coordinator's fragments share (see BufferPool)."""

from __future__ import annotations

import collections
import threading

import torch


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
    270 GB). Buffers are never freed, only reused: a reused one has its pages already in.
    """

    def __init__(self, largest: int):
        self.largest = largest
        """The largest fragment's size: transient buffers are of its class."""
        self._free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self._buffers: dict[int, torch.Tensor] = {}  # by data pointer: all of them
        self._lock = threading.Lock()

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
            free = self._free[size]
            buf = free.pop() if free else None
        if buf is None:  # more of this class in use at once than ever before
            buf = torch.empty(size)
            with self._lock:
                self._buffers[buf.data_ptr()] = buf
        return buf[:numel]

    def owns(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is one ``take`` returned (values read from disk are not)."""
        with self._lock:
            buf = self._buffers.get(view.data_ptr())
        return buf is not None and view.untyped_storage().data_ptr() == buf.data_ptr()

    def give(self, view: torch.Tensor) -> None:
        """Back to the pool: ``view`` (one ``take`` returned) must not be used after."""
        with self._lock:
            buf = self._buffers[view.data_ptr()]
            free = self._free[buf.numel()]
            if any(b is buf for b in free):
                raise RuntimeError("a buffer was given back twice")
            free.append(buf)

    def usage(self) -> dict[str, int]:
        """Buffers made (the most in use at once so far, per class), those in use now, and
        the bytes they hold."""
        with self._lock:
            made = len(self._buffers)
            free = sum(len(f) for f in self._free.values())
            nbytes = 4 * sum(b.numel() for b in self._buffers.values())
            return {"made": made, "in_use": made - free, "bytes": nbytes}
