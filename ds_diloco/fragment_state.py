"""One fragment at the coordinator: its served versions, outer state lock, and the rows
of the contributions in its open round.

Served values are never written in place: a merge steps a copy (``copy_values``, in a
buffer of the coordinator's ``BufferPool``) and publishes it, so downloads read a
version's values without a lock and without a copy. A contribution's slices are copied
into a row (another buffer of the pool) as its ranks' uploads come in; the row goes back
to the pool once its round is merged or it is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import weakref

import numpy as np
import torch

from ds_diloco import wire
from ds_diloco.buffer_pool import BufferPool
from ds_diloco.fragments import Fragment
from ds_diloco.merge import fragment_layout


class RWLock:
    """Many readers (downloads, saves) or one writer (a merge's outer step)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    def acquire_read(self):
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1

    def release_read(self):
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True

    def release_write(self):
        with self._cond:
            self._writer = False
            self._cond.notify_all()


@dataclasses.dataclass
class Contribution:
    island: str
    world_size: int
    base_version: int
    step: int
    tokens: int
    steps: int
    row: torch.Tensor
    """(fragment numel,) fp32: its ranks' slices, copied in as they come (``BufferPool``)."""
    sq_norms: torch.Tensor  # (segments,) float64, summed over the ranks' slices
    incarnation: int = 1
    final: bool = False
    """From the island's final flush: merged with the next round, never closes one."""
    ranks: set[int] = dataclasses.field(default_factory=set)
    complete_at: float | None = None
    failed: int = 0
    """Failed merges it was in (it went back into the round after each)."""

    def counters(self) -> tuple[int, int, int, int, int]:
        return (self.world_size, self.base_version, self.tokens, self.steps, int(self.final))

    def norm(self) -> float:
        """L2 norm of the pseudo-gradient (over the ranks' slices received so far)."""
        return math.sqrt(float(self.sq_norms.sum()))


@dataclasses.dataclass(eq=False)
class Landing:
    """The row that an island's ranks' uploads for one step are read into, straight from
    the socket, while their bodies come in (``Coordinator.upload_begin``): the first one
    accepted makes it its contribution's row, so every rank's slices land in place."""

    island: str
    incarnation: int
    """The island's registration its ranks send from: a later one (a restarted island, maybe
    of another world size) never reads into the row of an earlier one's bodies still coming."""
    step: int
    row: torch.Tensor
    ranks: set[int] = dataclasses.field(default_factory=set)
    """Ranks whose bodies are being read into it now."""
    adopted: bool = False
    """A contribution holds the row (it gives it back); else the last rank reading does."""


@dataclasses.dataclass(eq=False)
class Ingest:
    """One rank's upload being taken in: the body's tensor data go straight into the
    rank's part of its landing's row (``write``), then its values are checked."""

    header: wire.UploadHeader
    landing: Landing
    parts: dict[str, torch.Tensor]
    """Every slice of the fragment: this rank's part of the row."""
    zeros: set[str]
    """Slices the upload leaves out as all zero (written so at the check)."""
    order: list[str] = dataclasses.field(default_factory=list)
    """The body's tensors in data order (a streamed upload's)."""
    _views: list[memoryview] | None = None
    _at: tuple[int, int] = (0, 0)  # (part, byte) the next byte goes to

    def fill_zeros(self) -> None:
        """Write the slices the upload left out as all zero."""
        for name in self.zeros:
            self.parts[name].zero_()

    def write(self, chunk) -> None:
        """The next bytes of the body's data (after its head), into the row."""
        if self._views is None:
            self._views = [
                memoryview(self.parts[n].numpy()).cast("B") for n in self.order
                if self.parts[n].numel()
            ]  # fmt: skip
        src = memoryview(chunk).cast("B")
        i, at = self._at
        while len(src):
            if i == len(self._views):
                raise wire.WireError("malformed body: more data than its tensors take")
            dst = self._views[i]
            n = min(len(dst) - at, len(src))
            dst[at : at + n] = src[:n]
            src, at = src[n:], at + n
            if at == len(dst):
                i, at = i + 1, 0
        self._at = (i, at)


@dataclasses.dataclass(frozen=True)
class Served:
    """A published version: its values are never written again, so a download's body
    aliases them (no copy) while a merge computes the next version in another tensor."""

    version: int
    values: torch.Tensor
    data: np.ndarray
    """``values`` as an array: download bodies are cut from it and keep it alive, so it
    is collected once no body of this version is left (see ``FragmentState.publish``)."""
    changed_at: tuple[int, ...] = ()
    """Per segment, the version since which its values are these (this process's
    versions: at load, the loaded one): a download ``after`` a later one may leave the
    segment out for an island that keeps it (``Coordinator.download``)."""
    bodies: dict[tuple, wire.Body] = dataclasses.field(default_factory=dict)
    """Encoded downloads of this version by (world_size, rank, slices left out): every
    island of the same world size gets the same slices, so each is encoded once."""


class FragmentState:
    def __init__(
        self,
        fragment: Fragment,
        values: torch.Tensor,
        optimizer,
        plain_patterns,
        norm_window,
        version: int,
        pool: BufferPool,
    ):
        self.fragment = fragment
        self.segments, self.rda = fragment_layout(fragment, plain_patterns)
        self.optimizer = optimizer
        self.pool = pool  # the coordinator's, shared by its fragments
        self.publish(version, values)  # once: a second publication would recycle ``values``
        self.lock = RWLock()
        self.assembling: dict[str, Contribution] = {}
        self.landings: dict[tuple[str, int, int], Landing] = {}  # by (island, incarnation, step)
        self._writers: dict[int, int] = {}  # id(row) -> uploads reading into it now
        self._give_after: dict[int, torch.Tensor] = {}  # rows let go while being read into
        self.complete: dict[str, Contribution] = {}
        self.merging = False
        self.merges = 0
        self.merges_at = version  # the version ``merges`` counts up to (published first)
        self.merge_failures = 0
        self.failures_in_a_row = 0
        self.retry_at: float | None = None  # no merge before (clock time), after a failure
        self.last_failure: dict = {}
        self.saved_version = -1
        # island -> {"incarnation", "step", "merges", "tokens", "steps"}: the last merged
        # contribution's registration and step, and the island's merges into this fragment.
        # Written with the fragment (durable with the merge): after a crash, an upload
        # merged since the table's last save is still a replay, and its counts are kept.
        self.merged_by: dict[str, dict] = {}
        self.last_merge: dict = {}
        # When the rounds that made recent versions got their first contribution (clock
        # time): a stale upload is told how long after that it came, i.e. how much earlier
        # its island has to send to be in the same round (islands shift their send phase).
        self.opened_at: dict[int, float] = {}
        # Per-inner-step norms of the last complete contributions it took (NormGuard).
        self.recent_norms: collections.deque[float] = collections.deque(maxlen=norm_window)

    def publish(
        self, version: int, values: torch.Tensor, changed_at: tuple[int, ...] | None = None
    ) -> None:
        """Serve ``values`` as ``version`` from now on; ``values`` must not change after this.
        ``changed_at``: per segment, the version since which it holds these values (None:
        ``version`` for all)."""
        data = values.numpy()
        # Once this version is replaced and no body of it is left anywhere (the array
        # is collected), its buffer takes a later merge's values: no new pages to fault in.
        weakref.finalize(data, self._recycle, values)
        if changed_at is None:
            changed_at = (version,) * len(self.segments)
        # ``served`` first: whoever sees the new ``version`` finds its values served.
        self.served = Served(version, values, data, changed_at)
        self.values, self.version = values, version

    def _recycle(self, values: torch.Tensor) -> None:
        """A finaliser (see ``publish``): it may run inside any call of any thread, so
        it takes no lock (``BufferPool.give_soon``)."""
        if values is self.served.values:  # published again (it must never be written)
            return
        self.pool.give_soon(values)

    def changed_at(self, values: torch.Tensor, version: int, quiet) -> tuple[int, ...]:
        """Per segment, since which version ``values`` (the next version's, ``version``)
        holds the served values bit for bit: the served ``changed_at`` for the segments
        that are (compared only where ``quiet[i]``: the merged pseudo-gradient was 0),
        ``version`` for the rest."""
        served, out = self.served, []
        old, new = served.values.view(torch.int32), values.view(torch.int32)  # bits, not ==
        for i, s in enumerate(self.segments):
            span = slice(s.offset, s.offset + s.numel)
            same = quiet[i] and torch.equal(old[span], new[span])
            out.append(served.changed_at[i] if same else version)
        return tuple(out)

    def copy_values(self) -> torch.Tensor:
        """A copy of the served values for a merge to step, in a buffer of the pool (given
        back once a later version replaced it and no download reads it)."""
        return self.pool.take(self.fragment.numel).copy_(self.values)

    def take_row(self) -> torch.Tensor:
        """A (fragment numel,) row for a contribution (or a merge's output), from the pool."""
        return self.pool.take_transient(self.fragment.numel)

    def give_row(self, row: torch.Tensor) -> None:
        """Back to the pool, or once no upload reads into it any more (a contribution
        dropped while one of its island's ranks still sends)."""
        if self._writers.get(id(row)):
            self._give_after[id(row)] = row
        else:
            self.pool.give(row)

    def receiving(self) -> dict[str, list[int]]:
        """By island, the ranks whose upload bodies are coming in now."""
        out: dict[str, set[int]] = {}
        for landing in self.landings.values():
            out.setdefault(landing.island, set()).update(landing.ranks)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def released(self, row: torch.Tensor) -> bool:
        """Whether ``row`` was given back and goes to the pool once no upload reads into it."""
        return id(row) in self._give_after

    def land(
        self, island: str, incarnation: int, step: int, rank: int, row: torch.Tensor | None
    ) -> Landing:
        """The landing of ``island``'s uploads (from registration ``incarnation``) for
        ``step`` with ``rank`` reading into it: the one open, else a new one on ``row`` (a
        contribution's), else on a new row."""
        key = (island, incarnation, step)
        landing = self.landings.get(key)
        if landing is None:
            adopted = row is not None
            row = self.take_row() if row is None else row
            landing = self.landings[key] = Landing(island, incarnation, step, row, adopted=adopted)
        landing.ranks.add(rank)
        self._writers[id(landing.row)] = self._writers.get(id(landing.row), 0) + 1
        return landing

    def leave(self, landing: Landing, rank: int) -> None:
        """``rank`` is done reading into ``landing`` (taken in or refused)."""
        landing.ranks.discard(rank)
        key = id(landing.row)
        self._writers[key] -= 1
        if self._writers[key] == 0:
            del self._writers[key]
            if self._give_after.pop(key, None) is not None:
                self.pool.give(landing.row)
        if not landing.ranks:
            at = (landing.island, landing.incarnation, landing.step)
            if self.landings.get(at) is landing:
                del self.landings[at]
            if not landing.adopted:  # no contribution took it
                self.give_row(landing.row)
