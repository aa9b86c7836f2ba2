"""One rank's side of the outer loop: base copies, shard pseudo-gradients, background transport.

A rank owns a flat slice of every parameter (ZeRO-3's layout; the whole tensor
when the world size is 1). For each fragment it keeps the last global value of
its own slices (fp32: one extra copy of its shard; its frozen slices, which
nothing trains, need none), and when the fragment is due it sends ``base - local``
with the fragment's counters. The pseudo-gradient
is computed in place in the base and sent from there: no buffer of its own. The
base then holds the upload until a download writes it again: the fragment's
merged result, or (the upload failed, was dropped or its result was lost) the
version it started from, fetched again before the fragment's next send. With the shard
on a GPU, the copies between it and the base run in the transport threads
(``device_copies``: a send's slices are copied on the GPU and subtracted by the upload
thread, at most one fragment at a time; a merged fragment is copied to the GPU by the
download thread ahead of its apply). Uploads
and the wait for the merged result (one long poll whose answer is the merged fragment
itself, ``GET /v1/fragments``) run in background threads: the training loop
calls :meth:`FragmentSyncer.on_step` after each inner step and never blocks on
the network. A merged fragment is applied at the first step boundary at or
after ``send step + tau`` once it has arrived; until then training goes on.

When training ends, :meth:`FragmentSyncer.flush` sends what the last sends left
behind (each fragment's steps since its last apply: on average H/2 of them) and
waits for the results, so that the global model holds the island's final steps.

How a rank reads and writes its slices is a :class:`ShardAccess`; the island
(DeepSpeed ZeRO-3) provides one over its fp32 master partition, and
:class:`ModelShardAccess` serves a plain ``nn.Module``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from ds_diloco import compress, wire
from ds_diloco.client import CoordinatorClient, RefusedError
from ds_diloco.device_copies import CopyLane, Prefetch, Staged
from ds_diloco.fragments import Fragment, FragmentPlan, Schedule
from ds_diloco.round_policy import followed_late, phase_shift
from ds_diloco.sharding import shard_numel, shard_range

log = logging.getLogger(__name__)
_NEVER = 2**62  # a version no fragment reaches: "not waiting for this one"
HEARTBEAT_S = 2.0  # longest silence towards the coordinator: its lease (island_timeout_s) is longer
BACKGROUND_NICE = 10
"""OS priority offset of the transport threads: on cores that training keeps busy they
run in its gaps (collective waits) instead of taking time slices from the inner step."""
CLOSE_INTERRUPT_S = 5.0  # after close()'s deadline, how long requests still running are cut short
IDLE_LEASE_S = 120.0
"""Training silent this long (no step, no micro-batch, no flush), or ``IDLE_GAPS`` times its
longest silence so far if that is longer: the downloader stops polling, so the island's
lease lapses and no quorum waits for it. A ``train()`` that raised in a process that lives
on (a notebook, a caught error) never closes the syncer; its threads kept the lease for
ever, and with K = M no round closed. The next step renews it. Work between steps that
takes long (a checkpoint save) keeps the lease: :meth:`FragmentSyncer.keep_lease`."""
IDLE_GAPS = 4.0
"""See ``IDLE_LEASE_S``: an island whose steps (or micro-batches) take minutes, a large
model's, lost its lease every step at a fixed two minutes, though it trained on."""
TAKE_GLOBAL_TIMEOUT_S = 120.0  # take_global gives up (on every rank together) after this
GONE_RETRY_S = 10.0  # finish(): how long a coordinator found gone is tried once more


def _answers(client: CoordinatorClient) -> bool:
    """The coordinator answers a health check (within the client's timeout)."""
    try:
        client.health()
        return True
    except Exception:
        return False


class _Dest(Mapping):
    """Where a download of a slot's fragment is read to: the base for trained slices; for
    a frozen one that comes, a buffer of ``slot.incoming``, made when the body reaches it
    (a slice left out as unchanged takes no memory)."""

    def __init__(self, slot: _Slot, sizes: dict[str, int]) -> None:
        self.slot, self.sizes = slot, sizes  # in wire order

    def __getitem__(self, name: str) -> torch.Tensor:
        slot = self.slot
        if name in slot.base:
            return slot.base[name]
        if name not in slot.incoming:
            slot.incoming[name] = torch.empty(self.sizes[name], dtype=torch.float32)
        return slot.incoming[name]

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


def _received(slot: _Slot) -> dict[str, torch.Tensor]:
    """The values of ``slot.version`` the rank holds: its trained slices, and the frozen
    ones that came with the download."""
    return {**slot.base, **slot.incoming} if slot.incoming else slot.base


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t`` (fp32, host), without a temporary: the maximum and minimum
    are finite exactly when every value is (``np.maximum`` / ``np.minimum`` propagate NaN).
    numpy, single-threaded: a torch op here would start an OpenMP team in this thread,
    competing with training for the cores. Not a float64 sum: numpy casts through a 64 KiB
    buffer, below the allocator's mmap threshold, so it stayed resident in the download
    thread's malloc arena (measured +64 kB per rank); float32 min/max reduce in place, and
    run 2-3x faster."""
    x = t.numpy()
    return x.size == 0 or (
        math.isfinite(np.maximum.reduce(x)) and math.isfinite(np.minimum.reduce(x))
    )


def _lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value (Linux: per thread; elsewhere a no-op)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


class Superseded(RuntimeError):
    """The island registered again elsewhere: this process's uploads are refused for good."""

    exit_code = 3
    """``ds-diloco island``'s exit status when it stops for this. Its supervisor (``ds-diloco
    run``) must not start it again: the restart would register and supersede the later
    launch, which would then stop and be restarted in turn."""


class Diverged(RuntimeError):
    """The island's local model is not finite (NaN or Inf): its pseudo-gradient was refused,
    and every later one would be. Raised on every rank at the same step."""

    exit_code = 4
    """``ds-diloco island``'s exit status when it stops for this. ``ds-diloco run`` restarts
    it (bounded by ``max_restarts``): the restart takes the global model and the inner
    optimizer state of its last checkpoint, which was saved only while finite."""


class ShardAccess(Protocol):
    """Reads and writes the flat, unpadded slice of a parameter that this rank owns."""

    def trains(self, name: str) -> bool:
        """False for a frozen parameter: never read, its pseudo-gradient is 0."""
        ...

    def read(self, name: str) -> torch.Tensor: ...

    def write(self, name: str, values: torch.Tensor) -> None: ...


class ModelShardAccess:
    """Slices of a plain ``nn.Module``'s parameters (world size 1: whole tensors)."""

    def __init__(self, model: torch.nn.Module, world_size: int = 1, rank: int = 0):
        self.params = dict(model.named_parameters())
        self.world_size, self.rank = world_size, rank

    def _view(self, name: str) -> torch.Tensor:
        p = self.params[name].data.view(-1)
        a, b = shard_range(p.numel(), self.world_size, self.rank)
        return p[a:b]

    def trains(self, name: str) -> bool:
        return self.params[name].requires_grad

    def read(self, name: str) -> torch.Tensor:
        return self._view(name).float()

    @torch.no_grad()
    def write(self, name: str, values: torch.Tensor) -> None:
        self._view(name).copy_(values)


@dataclasses.dataclass
class _Slot:
    """What this rank knows about one fragment.

    ``base`` holds the global values of the rank's trained slices (views of one
    buffer for the whole shard). A downloaded version is written straight into it, so
    a new global fragment costs no memory beyond the base: ``version`` is what
    ``base`` holds, ``applied`` what the local values started from. ``version >
    applied``: a new version has arrived and waits for its step; ``version == -1``:
    ``base`` was torn by a bad download and must be fetched again.

    Frozen slices have no base: their local values are the global ones of ``applied``
    (nothing trains them). ``incoming`` holds those of ``version`` that came with its
    download (another island trains them, or a whole download), until applied; one
    that did not come is unchanged since ``applied``.
    """

    base: dict[str, torch.Tensor]
    incoming: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    version: int = -1
    applied: int = -1
    tokens: int = 0
    steps: int = 0
    sent_step: int | None = None  # step of the upload whose result we wait for
    in_flight: bool = False  # that upload is queued or was accepted: a result may come
    refetch: bool = False  # behind the island's other ranks: fetch a newer version
    # When (time.perf_counter) the round that made ``version`` opened, if the coordinator
    # said; ``followed_t``: the same for the version applied last if it was merged without
    # this island (None: its own result). They tell how late the island's sends come.
    opened_t: float | None = None
    followed_t: float | None = None
    # keep_local_steps: the local values at the last upload, and the counters in it, until
    # its result is applied (then the steps since the upload are kept; see _apply).
    sent_values: dict[str, torch.Tensor] | None = None
    sent_counts: tuple[int, int] = (0, 0)
    # The base holds the pseudo-gradient of the upload at sent_step (computed in place, no
    # buffer of its own), not global values, until a download writes it; ``sending``: that
    # upload's body, which aliases the base, is not sent yet, and no download may write it.
    holds_upload: bool = False
    sending: bool = False
    # The coordinator process that served ``version`` (its downloads' ``epoch``): a download
    # after that version may leave out the frozen slices that did not change since, which
    # the base holds (an apply writes them from there, as if they had come).
    epoch: str = ""
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)  # base memory

    @property
    def arrived(self) -> bool:
        # Older than the applied one: the coordinator came back with older state (restored
        # from a backup); the island follows it, as a restarted learner does.
        return self.version >= 0 and self.version != self.applied and not self.refetch


@dataclasses.dataclass
class SyncStats:
    uploads: int = 0
    dropped: int = 0
    refused: int = 0
    failed: int = 0
    bad_responses: int = 0
    applied: int = 0
    prefetched: int = 0  # of the applies, those that read a copy already on the shard's device
    skipped: int = 0  # sends skipped: the fragment's base was busy, newer or torn, or ...
    skipped_late: int = 0  # ... its last result came H steps late: applied at the send step
    applied_late: int = 0  # results of uploads applied after their step (sent step + tau):
    steps_late: int = 0  # ... not every rank held them in time; and by how many steps, in all
    agree_s: float = 0.0  # time in the island's agreement collective (waiting for peer ranks)
    send_s: float = 0.0  # training thread: reading the local values of the fragments sent
    apply_s: float = 0.0  # training thread: writing merged fragments into the shard
    cache_s: float = 0.0  # training thread: dropping ZeRO-3's gathered copies after applies
    bytes_sent: int = 0  # upload bodies the coordinator answered (payload, scales, header)
    bytes_received: int = 0  # download bodies read whole (header included)
    unchanged: int = 0  # frozen slices downloads left out (unchanged since the base's version)
    network_calls_in_loop: int = (
        0  # requests made by the training thread after bootstrap, before flush: must stay 0
    )
    phase_shifts: int = 0  # times the island moved its send phase earlier (stale uploads)
    phase: int = 0  # steps the send schedule now runs ahead of the inner steps (mod H)
    shifted_steps: int = 0  # steps the phase shifts moved the send clock on, in all (not mod H)
    shifted_over: int = 0  # scheduled sends a phase shift passed over (not sent, not skipped)
    steps_overwritten: int = 0  # steps on fragments that a version merged without them replaced
    flushed: int = 0  # fragments sent by the final flush (besides the scheduled sends)
    flush_unsettled: int = 0  # uploads still without a result when the flush gave up
    flush_s: float = 0.0  # time in the final flush (waiting for results included)
    transport_cpu_s: float = 0.0  # CPU time of the upload and download threads (at close)
    base_bytes: int = 0  # host memory of the base copy: the rank's trained slices in fp32


class FragmentSyncer:
    def __init__(
        self,
        client: CoordinatorClient,
        island: str,
        plan: FragmentPlan,
        schedule: Schedule,
        access: ShardAccess,
        *,
        world_size: int = 1,
        rank: int = 0,
        alpha: float = 0.0,
        poll_s: float = 0.05,
        long_poll_s: float = 2.0,
        agree=None,
        codec: compress.Codec | None = None,
        align_phase: bool = False,
        keep_local_steps: bool = False,
        incarnation: int = 1,
        run: str = "",
    ):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha (blend of local into global) must be in [0, 1), got {alpha}")
        if keep_local_steps and alpha > 0.0:
            raise ValueError("keep_local_steps and alpha > 0 are two ways to apply: pick one")
        self.client, self.island, self.plan, self.schedule = client, island, plan, schedule
        self.access, self.world_size, self.rank = access, world_size, rank
        self.incarnation = incarnation  # the island's registration, sent with every upload
        self.run = run  # the run's id (the coordinator's plan), sent with every upload too
        self.alpha, self.poll_s, self.long_poll_s = alpha, poll_s, long_poll_s
        # Applying a merged fragment overwrites the local values: the tau (or more) steps
        # trained between its upload and its result are lost. keep_local_steps keeps them:
        # local = global + (local now - local at the upload), at the cost of a copy of the
        # slices of the fragments in flight (about tau / P of the shard).
        self.keep_local_steps = keep_local_steps
        # agree(values) -> every rank's values, by rank (the island's all-gather); one rank
        # needs none. From the rows: versions held (min, max) and the island's tokens (sum).
        self.agree = agree or (lambda values: [values])
        # Compressed uploads keep a quantisation residual per (fragment, tensor) of this
        # rank: one more fp32 copy of the shard in all (half of one with the codec's
        # residual: bfloat16), allocated as fragments are sent.
        lossy = codec is not None and codec.name != "none"
        # Seeded by island and rank: by rank alone, rank r of every island drew the same
        # stochastic roundings, whose errors then did not average out in the merge.
        seed = int.from_bytes(hashlib.sha256(f"{island}/{rank}".encode()).digest()[:7], "big")
        self.feedback = compress.ErrorFeedback(codec, seed=seed) if lossy else None
        # Per fragment, the slices this rank does not train: their local values are the
        # global ones it applied last (an upload leaves them out), so they take no base
        # memory and a download may leave out unchanged ones.
        self._frozen = [
            frozenset(n for n in f.names if not access.trains(n)) for f in plan.fragments
        ]
        # Per fragment, name -> numel of this rank's slices, in wire order.
        self._sizes = [
            {p.name: shard_numel(p.numel, world_size, rank) for p in f.params}
            for f in plan.fragments
        ]
        self.stats = SyncStats()
        self.slots = [_Slot(base) for base in self._base_views()]
        self._lock = threading.Lock()  # slot state (not base memory: that is slot.lock)
        # Fragments waiting to be sent, oldest first, and the payload of each. At most one
        # per fragment: its base holds the pseudo-gradient until the body is sent, and the
        # fragment is not sent again before a download has written the base.
        self._uploads: queue.Queue = queue.Queue()
        self._pending: dict[int, tuple] = {}
        self._staged = 0  # sends staged on the GPU, not yet subtracted (_stage_on_device)
        self._up_lane = CopyLane()  # the upload thread's, for staged sends
        # Merged fragments copied to the GPU ahead of their apply (started at bootstrap).
        self._prefetch = Prefetch(f"{island}/{rank}")
        self._stop = threading.Event()
        # What the downloader waits for may have changed (a step, a send, an upload done,
        # close): it sleeps on this when nothing is wanted, instead of polling. Polling
        # every poll_s, the two threads woke up to 40 times a second between steps, each
        # time taking the GIL from training.
        self._wake = threading.Event()
        # The downloader's long poll under way: the versions it asks after (None: none, or
        # its answer is being read), and whether _recast cut it short (see there).
        self._polling: list[int] | None = None
        self._cut = False
        self._paused = False  # the flush reads the bases: the downloader starts no fetch
        self._flushing = False  # every base holding an upload is fetched again (flush)
        self._flush_lost = 0  # the flush's uploads that failed or were refused
        # Phase alignment. With K = 1 a round closes on the first island's upload (plus the
        # grace window); an island whose sends come later in wall time than the others'
        # finds every upload stale and every one dropped, round after round. The
        # coordinator says how late a stale upload came (late_s); the island's ranks agree
        # on moving the send schedule that many steps earlier (``phase``).
        self.align_phase = align_phase
        self.phase = 0
        self._not_ready = ""  # why this rank could not send the fragment due at its last step
        self._superseded = ""  # the coordinator's refusal: a later launch of the island took over
        self._diverged = ""  # why this rank's pseudo-gradient was not finite (refused)
        self._late: tuple[int, float] = (0, 0.0)  # (step of a stale upload, seconds late)
        self._shifted_at = 0  # uploads sent before this step predate the last shift
        # Fragments a shift skipped: they miss the round held meanwhile, and their next
        # upload is stale if its merged version has not come in before it (then about a
        # cycle late): that says nothing of the phase. Fragment -> the step of that
        # upload, once sent.
        self._skipped: dict[int, int | None] = {}
        self._step_s = 0.0  # this rank's inner step time, moving average
        self._step_t: float | None = None
        self._last_step: int | None = None  # the last inner step seen by on_step
        self._active_t = time.monotonic()  # the training thread's last step (IDLE_LEASE_S)
        self._longest_gap: float | None = None  # ... and its longest silence between two
        self._lease_kept = 0  # keep_lease() contexts open
        self._said_no_tokens = False  # the warning of an upload with no tokens, once
        self._fetch_error = ""  # the last download that failed, and why (take_global's error)
        self._train_thread: int | None = None  # set once training starts
        # A transport thread that died of an error (a fault of ours, not the network's,
        # which they ride out): the island would train on without syncing, and say nothing.
        self._died: str | None = None
        self._threads = [
            threading.Thread(target=fn, name=f"{fn.__name__}-{island}-{rank}", daemon=True)
            for fn in (self._uploader, self._downloader)
        ]

    def _base_views(self) -> list[dict[str, torch.Tensor]]:
        """One fp32 buffer for all of this rank's trained slices; per fragment, views in
        wire order (frozen slices have none: see ``_Slot``)."""
        sizes = [
            [(name, n) for name, n in frag.items() if name not in frozen]
            for frag, frozen in zip(self._sizes, self._frozen)
        ]
        flat = torch.empty(sum(n for frag in sizes for _, n in frag), dtype=torch.float32)
        self.stats.base_bytes = flat.numel() * flat.element_size()
        views, offset = [], 0
        for frag in sizes:
            views.append({})
            for name, n in frag:
                views[-1][name] = flat[offset : offset + n]
                offset += n
        return views

    # ----------------------------------------------------------- training side
    def alive(self) -> None:
        """Training goes on (a step, or a micro-batch of an accumulation): see IDLE_LEASE_S."""
        now = time.monotonic()
        if self._longest_gap is None:  # the first: after the start-up's waits, not a step
            self._longest_gap = 0.0
        else:
            self._longest_gap = max(self._longest_gap, now - self._active_t)
        self._active_t = now

    @contextlib.contextmanager
    def keep_lease(self):
        """Around work between steps that may take longer than ``IDLE_LEASE_S`` (a checkpoint
        save): the heartbeats go on meanwhile."""
        self._lease_kept += 1
        try:
            yield
        finally:
            self._lease_kept -= 1
            self.alive()

    def bootstrap(self, attempts: int = 20) -> list[int]:
        """Take the global model (:meth:`take_global`), then start the network thread."""
        largest = max((sum(frag.values()) for frag in self._sizes), default=0)
        self._prefetch.start(self._shard_device(), largest)
        versions = self.take_global(attempts)
        self._train_thread = threading.get_ident()
        self._active_t = time.monotonic()
        for t in self._threads:
            t.start()
        return versions

    def _shard_device(self) -> torch.device | None:
        """The GPU the shard lives on (merged fragments are copied there ahead of their
        applies), or None: host memory, applied from the base as it is."""
        names = (n for frag in self.plan.fragments for n in frag.names)
        first = next((n for n in names if self.access.trains(n)), None)
        if first is None:
            return None
        device = self.access.read(first).device
        return device if device.type == "cuda" else None

    def take_global(
        self,
        attempts: int = 20,
        timeout_s: float = TAKE_GLOBAL_TIMEOUT_S,
        client: CoordinatorClient | None = None,
    ) -> list[int]:
        """Take every fragment's current global value, the same version on every rank.

        Blocking, and only while the network thread is not running (before training,
        or after :meth:`close`). A merge between two ranks' downloads gives them
        different versions; the ones behind download again. Gives up after ``attempts``
        or ``timeout_s`` (every rank at the same attempt), saying why, with the trained
        values as they were: none is written before every fragment's version is agreed.
        """
        # Decided by the whole island: raised on one rank only, the others would wait for
        # it in the agreement below. Only the downloader writes bases.
        _, running, _ = self._agree([int(self._threads[1].is_alive())])
        if running[0]:
            raise RuntimeError("take_global() while a rank's downloader still runs: close() first")
        todo = list(self.plan.fragments)
        deadline, self._fetch_error = time.monotonic() + timeout_s, ""
        agreed: list[Fragment] = []
        for _ in range(attempts):
            # A fragment at a time, agreed before the next is fetched: its frozen slices
            # come into buffers of their own, written and let go once agreed, so at most one
            # fragment's are held (all of them at once were a whole shard's worth). The
            # trained slices wait in the bases until every fragment is agreed: applied as
            # they were agreed, a give-up half-way (the coordinator gone, the deadline) left
            # a model half global, half the island's own (saved as the island's at close).
            retry, over = [], 0
            for f in todo:  # each download retries a while: one past the deadline is not begun
                slot = self.slots[f.index]
                if time.monotonic() < deadline:
                    self._fetch(f, slot, after=None, client=client)
                lows, highs, _ = self._agree([slot.version, int(time.monotonic() >= deadline)])
                over |= highs[1]  # the same on every rank
                if lows[0] == highs[0] >= 0:
                    for name, values in slot.incoming.items():  # frozen: none of the island's
                        self.access.write(name, values)
                    slot.incoming = {}  # written: the apply leaves them as they are
                    agreed.append(f)
                else:
                    slot.incoming = {}  # fetched again whole
                    retry.append(f)
            if not retry:
                for f in agreed:  # on a GPU, each from a device copy: made now where the
                    slot = self.slots[f.index]  # download found every buffer taken
                    if f.index not in self._prefetch.held:
                        self._prefetch.copy(f.index, _received(slot), slot.version)
                    self._apply(f, slot, blend=False)
                self._flush()
                return self.versions()
            self._flush()
            todo = retry
            if over:
                break
            time.sleep(self.poll_s)
        frags = [f.index for f in todo]
        if self._fetch_error:  # the coordinator, not the ranks
            raise RuntimeError(
                f"{self.island}/{self.rank}: could not take the global model (fragments "
                f"{frags}): {self._fetch_error}"
            )
        raise RuntimeError(
            f"{self.island}/{self.rank}: ranks could not agree on the versions of fragments "
            f"{frags} within {attempts} attempts and {timeout_s:g} s"
        )

    def _agree(self, values: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
        """(element-wise min, max over the island's ranks, every rank's row)."""
        rows = self.agree(values)
        return [min(c) for c in zip(*rows)], [max(c) for c in zip(*rows)], rows

    def versions(self) -> list[int]:
        """The global version each fragment's local values started from."""
        return [s.applied for s in self.slots]

    def set_phase(self, phase: int) -> None:
        """Before the first :meth:`on_step`: send each fragment ``phase`` steps earlier
        than the schedule says (the same on every rank), in phase with the run's rounds."""
        if self._last_step is not None:
            raise RuntimeError("set_phase() after training started")
        self.phase = self.stats.phase = phase % self.schedule.sync_every

    def on_step(self, step: int, tokens: int) -> list[int]:
        """Call after inner step ``step`` (from 1) with this rank's tokens of that step.

        Applies the merged fragments that every rank holds (same version) and whose
        tau steps are over, then queues the fragment due now with the island's token
        count (summed over ranks in the same collective). Never touches the network;
        the only wait is the island's small agreement collective, and only at steps
        where a result is due or a fragment is sent (the same steps on every rank).
        """
        if self._died is not None:  # this rank stops; its launcher stops the island's others
            raise RuntimeError(f"{self.island}/{self.rank} no longer syncs: {self._died}")
        self._last_step = step
        self.alive()
        now = time.perf_counter()
        if self._step_t is not None:
            dt = now - self._step_t
            self._step_s = dt if self._step_s == 0.0 else 0.8 * self._step_s + 0.2 * dt
        self._step_t = now
        for slot in self.slots:
            slot.tokens += tokens
            slot.steps += 1
        due = [
            (frag, slot)
            for frag, slot in zip(self.plan.fragments, self.slots)
            if slot.sent_step is not None and step >= self.schedule.apply_at(slot.sent_step)
        ]
        p = self.schedule.due(step + self.phase)
        if self.align_phase and (due or p is not None):
            # Fragments with no upload waiting for a result take the versions merged
            # without this island (it was late, or a shift skipped its send): else their
            # base stays a version behind and the next upload is stale on arrival, and the
            # next, round after round. Rides on the agreement this step holds anyway.
            due += [
                (frag, slot)
                for frag, slot in zip(self.plan.fragments, self.slots)
                if slot.sent_step is None
            ]
        send = self.slots[p] if p is not None else None
        # The fragment due now is sent only if every rank's base holds the version its local
        # values started from (none has a newer one waiting to be applied, or a download
        # writing it): the ranks decide together, in the same collective as the applies, so
        # an island never sends half a contribution. Holding the slot's lock from here on
        # keeps the downloader from starting to write it.
        locked = send is not None and send.lock.acquire(blocking=False)
        try:
            flag = []  # [may send, this rank's tokens in the fragment since its last apply]
            if send is not None:
                with self._lock:
                    self._not_ready = self._why_not_ready(send, step, locked)
                flag = [0 if self._not_ready else 1, send.tokens]
            applied = []
            send_ok, send_tokens = False, 0  # set below whenever a fragment is due to be sent
            if due or flag:
                with self._lock:
                    held = [slot.version if slot.arrived else -1 for _, slot in due]
                    late_step, late_s = self._late
                    followed = self._followed_late(send, now)
                if followed is not None:
                    late_step, late_s = step, followed
                phase = [late_step, round(late_s * 1e3), round(self._step_s * 1e3)]
                gone = [1 if self._superseded else 0, 1 if self._diverged else 0]
                t0 = time.perf_counter()
                lows, highs, rows = self._agree(held + phase + gone + flag)
                self.stats.agree_s += time.perf_counter() - t0
                at = len(held) + len(phase)
                if highs[at]:  # every rank stops at the same step
                    raise Superseded(
                        f"island {self.island!r} rank {self.rank}: stopping at step {step}: "
                        f"{self._superseded or 'another rank was refused as superseded'}"
                    )
                if highs[at + 1]:
                    raise Diverged(
                        f"island {self.island!r} rank {self.rank}: stopping at step {step}: "
                        "its local model is not finite (NaN or Inf): "
                        f"{self._diverged or 'the upload of another rank was refused so'}"
                    )
                self._shift_phase(step, [r[len(held) : len(held) + 3] for r in rows])
                owed = {  # the results of this island's uploads, by the step each was due at
                    frag.index: self.schedule.apply_at(slot.sent_step)
                    for frag, slot in due
                    if slot.sent_step is not None
                }
                t0 = time.perf_counter()
                applied = self._apply_agreed(due, held, lows, highs)
                t1 = time.perf_counter()
                self._flush()
                self.stats.apply_s += t1 - t0
                self.stats.cache_s += time.perf_counter() - t1
                for i in applied:
                    if step > owed.get(i, step):
                        self.stats.applied_late += 1
                        self.stats.steps_late += step - owed[i]
                if send is not None:
                    # Usable on every rank; the island's tokens are the sum of its ranks'.
                    # Its result applied just now (it came H steps late): nothing trained
                    # since, nothing to send.
                    send_ok = p not in applied and lows[-2] == 1
                    send_tokens = sum(r[-1] for r in rows)
                    if p in applied:
                        self._not_ready = "its last result was applied only now"
                        self.stats.skipped_late += 1
            if send is not None:
                if send_ok and send_tokens == 0 and not self._said_no_tokens:
                    self._said_no_tokens = True  # once: every upload of it would say the same
                    log.warning(
                        "%s/%d fragment %d step %d: no tokens counted since its last sync on any "
                        "rank: the coordinator drops such an upload (its weight is 0), so this "
                        "island never counts in a merge, and a quorum K >= 2 may wait for it; "
                        "pass Learner.step(tokens=...) the tokens each step trained on",
                        self.island, self.rank, p, step,
                    )  # fmt: skip
                self._send(self.plan.fragments[p], step, send_ok, send_tokens)
        finally:
            if locked:
                send.lock.release()
            self._wake.set()  # a step moves what the downloader wants (see _wanted)
        return applied

    def _followed_late(self, send: _Slot | None, now: float) -> float | None:
        """How late this step's send comes when the fragment follows a version merged
        without the island (``_lock`` held): seconds since that version's round opened.

        A late island that takes the merged versions is never told it is late: a version
        that comes before the send replaces it (the send is skipped), and one taken a step
        or two earlier makes the upload current, so it is accepted and merged in a round
        of its own, a few steps after everyone else's. None: not that case, the coordinator
        did not say, or the round opened over H/2 steps ago (the previous cycle's: an island
        early, or one that missed a round for another reason)."""
        if not self.align_phase or send is None or self._step_s <= 0:
            return None
        # Arrived and not a result: applied at this step instead of the send.
        opened = send.opened_t if send.arrived and not send.in_flight else send.followed_t
        if opened is None:
            return None
        return followed_late(max(now - opened, 0.0), self._step_s, self.schedule.sync_every)

    def _why_not_ready(self, slot: _Slot, step: int, locked: bool) -> str:
        """Why this rank cannot send ``slot``'s fragment now ("": it can); ``_lock`` held."""
        if not locked:
            return "a download is writing its base"
        if slot.version < 0 or slot.refetch:
            return "its base is being fetched again"
        if slot.version != slot.applied:
            return f"version {slot.version} arrived and waits to be applied"
        # Its last upload's result is still on the way (a phase shift brought the fragment
        # round early): a new one now would be stale on arrival. Bounded: a result lost for
        # good (a coordinator restart) stops no send.
        if slot.in_flight and step - slot.sent_step < self.schedule.sync_every:
            return f"the result of its upload at step {slot.sent_step} is still on the way"
        if slot.holds_upload:  # the downloader fetches the version again (_wanted)
            return f"its base went out with the upload at step {slot.sent_step}: fetched again"
        return ""

    def _apply_agreed(self, pairs, held: list[int], lows: list[int], highs: list[int]) -> list[int]:
        """Apply each (fragment, slot) of ``pairs`` whose new version every rank holds
        (``held``: this rank's, -1 for none; ``lows`` / ``highs``: over the island's ranks);
        a rank behind another fetches again. Returns the fragments applied."""
        applied = []
        for (frag, slot), h, lo, hi in zip(pairs, held, lows, highs):
            if lo == hi >= 0:  # every rank holds the same new version: apply it now
                # An arrived version is not written to again until applied: no wait.
                with slot.lock:
                    self._apply(frag, slot, blend=True)
                applied.append(frag.index)
            elif 0 <= h < hi:  # behind another rank: fetch again
                with self._lock:
                    slot.refetch = True
        return applied

    def _shift_phase(self, step: int, rows: list[list[int]]) -> None:
        """Move the send schedule earlier if a rank's upload came back stale and late.

        ``rows``: every rank's [step of its latest late stale upload, ms late, its step
        time in ms]; every rank decides the same from the same rows. The shift is at
        most H - tau - 1 steps, and one per H steps (uploads sent before the next H
        steps are not acted on): a fragment whose last result is still on the way when
        it comes due again is not sent then (:meth:`on_step`).
        """
        if not self.align_phase:
            return
        late_step = max(r[0] for r in rows)
        late_ms = max(r[1] for r in rows if r[0] == late_step)
        step_ms = max(r[2] for r in rows)
        # round_policy.phase_shift: the rule the goodput simulator's islands follow too.
        decided = phase_shift(
            step, late_step, late_ms, step_ms, self._shifted_at,
            sync_every=self.schedule.sync_every, overlap=self.schedule.overlap,
        )  # fmt: skip
        if decided is None:
            return
        # One shift per cycle: the uploads of the next H steps show whether it worked.
        self._shifted_at = decided.next_at
        shift = decided.steps
        if shift < 1:
            return
        # The next step's clock is step + 1 + the new phase: the fragments due at the
        # clocks in between are not sent this cycle.
        with self._lock:
            for clock in decided.passed_over(step, self.phase):
                p = self.schedule.due(clock)
                if p is not None:
                    self._skipped[p] = None
                    self.stats.shifted_over += 1
        self.phase = (self.phase + shift) % self.schedule.sync_every
        self.stats.phase_shifts += 1
        self.stats.shifted_steps += shift
        self.stats.phase = self.phase
        log.info(
            "%s/%d an upload came %.2f s after its round's first contribution: sends move %d "
            "step(s) earlier (phase %d)", self.island, self.rank, late_ms / 1e3, shift, self.phase,
        )  # fmt: skip

    def _send(self, frag: Fragment, step: int, ok: bool, tokens: int, final: bool = False) -> None:
        slot = self.slots[frag.index]
        # Every rank marks the send, uploaded or not, so that the ranks' due steps agree. A
        # skip keeps the mark of an earlier upload still waiting for its result: moved on,
        # it put off the base's refetch (_wanted) past the next turn, every turn (with K > 1
        # and a slow island, a fragment was never sent again), and hid the fragment's steps
        # from the flush (_send_progress: "sent at the last step").
        with self._lock:
            if frag.index in self._skipped and self._skipped[frag.index] is None:
                self._skipped[frag.index] = step  # its first upload since the shift
        if ok or slot.sent_step is None:
            slot.sent_step = step
        if not ok:  # decided by the whole island (on_step): the next send carries the progress
            self.stats.skipped += 1
            log.info(
                "%s/%d fragment %d step %d: send skipped, marked at step %d (this rank: %s)",
                self.island, self.rank, frag.index, step, slot.sent_step,
                self._not_ready or "ready; another rank was not",
            )  # fmt: skip
            return
        # No download writes this base now: the caller holds its lock, or it was applied
        # this step (a download only writes a slot that waits for a result).
        t0 = time.perf_counter()
        with slot.lock, torch.no_grad():
            thawed = [n for n in self._frozen[frag.index] if self.access.trains(n)]
            if thawed:  # no base copy of it: its pseudo-gradient cannot be computed
                raise RuntimeError(
                    f"{self.island}/{self.rank}: {thawed[0]} was frozen when the syncer was "
                    "built and trains now: the parameters that train are fixed at the start "
                    "(ZeRO-3 gives a frozen parameter no fp32 master either)"
                )
            local = {n: self.access.read(n) for n in frag.names if self.access.trains(n)}
            # Frozen: it does not train, its pseudo-gradient is 0, left out of the body.
            zeros = ",".join(n for n in frag.names if n not in local)
            if self._stage_on_device(local):
                # A copy on the GPU, queued after the optimizer step: the copy to the host
                # and the subtraction run in the upload thread, not in the training loop.
                delta = Staged.of(slot.base, local)
                local = delta.local  # the clones: keep_local_steps holds on to them
                with self._lock:
                    self._staged += 1
            else:
                # On the host whatever device the shard lives on (the base copy is host
                # memory). keep_local_steps holds on to a copy (read() is a live view).
                copy = self.keep_local_steps
                local = {n: t.to("cpu", copy=copy) for n, t in local.items()}
                # In place: the base becomes the pseudo-gradient, and the body aliases it.
                delta = {n: slot.base[n].sub_(t) for n, t in local.items()}
            if self.keep_local_steps:
                slot.sent_values, slot.sent_counts = local, (slot.tokens, slot.steps)
            del local
        self.stats.send_s += time.perf_counter() - t0
        header = wire.UploadHeader(
            island=self.island,
            rank=self.rank,
            world_size=self.world_size,
            fragment=frag.index,
            base_version=slot.applied,
            step=step,
            tokens=tokens,
            steps=max(slot.steps, 1),
            incarnation=self.incarnation,
            run=self.run,
            final=int(final),
            zeros=zeros,
        )
        with self._lock:
            slot.in_flight = slot.holds_upload = slot.sending = True
            self._pending[frag.index] = (header, delta)
            self._uploads.put(frag.index)

    def _apply(self, frag: Fragment, slot: _Slot, blend: bool) -> None:
        """Write the fragment's global values (in ``slot.base``) into the local ones.

        ``blend``: a result at a step boundary (not the bootstrap's overwrite): blended
        with ``alpha``, or with ``keep_local_steps`` the steps since the upload are kept.
        """
        back = slot.version < slot.applied  # the coordinator went back: overwrite, no blend
        if blend and (slot.sent_step is None or back):  # merged without it: its steps are lost
            self.stats.steps_overwritten += slot.steps
        blend = blend and not back
        keep = blend and slot.sent_values is not None
        pre = self._prefetch.take(frag.index, slot.version)
        values = _received(slot) if pre is None else pre.values
        for name in frag.names:
            if name not in values:  # frozen, unchanged since the version applied last
                continue
            new = values[name]
            trains = self.access.trains(name)  # frozen: nothing trained here to keep or blend
            if keep and trains:  # global + what this rank trained since its upload (not merged)
                sent = slot.sent_values[name].to(new.device)
                new = new + (self.access.read(name).to(new.device) - sent)
            elif blend and trains and self.alpha > 0.0:
                new = self.alpha * self.access.read(name).to(new.device) + (1.0 - self.alpha) * new
            self.access.write(name, new)
        if pre is not None:
            self._prefetch.release(pre)
            self.stats.prefetched += 1
        with self._lock:
            # The counters follow the local values: with the steps since the upload kept,
            # the next upload carries them.
            tokens, steps = slot.sent_counts if keep else (slot.tokens, slot.steps)
            slot.tokens, slot.steps = slot.tokens - tokens, slot.steps - steps
            slot.followed_t = slot.opened_t if blend and not slot.in_flight else None
            slot.applied, slot.sent_values, slot.sent_counts = slot.version, None, (0, 0)
            slot.sent_step, slot.in_flight = None, False
            slot.incoming = {}  # written: the local values hold them now
        self.stats.applied += 1

    def _flush(self) -> None:
        flush = getattr(self.access, "flush", None)
        if flush is not None:
            flush()

    def _fetch(self, frag: Fragment, slot: _Slot, after: int | None, client=None) -> bool:
        """Download a newer version of ``frag`` into ``slot.base``; True if one came. Never raises.

        A bad or broken answer may have overwritten part of the base: the slot is then
        marked torn (version -1) and fetched again whole; the local values are untouched.
        """
        self._count_network_call()
        with slot.lock:
            with self._lock:
                if slot.sending:  # its base is an upload's body, not sent yet
                    return False
            self._prefetch.drop(frag.index)
            info: dict = {}
            try:
                version = (client or self.client).download_into(
                    frag.index, self.world_size, self.rank, _Dest(slot, self._sizes[frag.index]),
                    after=after, island=self.island, info=info, keep=self._frozen[frag.index],
                    epoch=slot.epoch if after == slot.version else "", run=self.run,
                )  # fmt: skip
            except Exception as e:
                return self._took(frag, slot, None, info, e)
            return self._took(frag, slot, version, info)

    def _fetch_next(self, wanted: list[int | None]) -> list[int] | None:
        """One long poll for every fragment in ``wanted`` (see :meth:`_wanted`) that answers
        with the first one newer: its body is read into its slot's base, whose lock is
        taken only once the answer names it (a send never finds the slot locked while the
        poll waits). Returns every fragment's version when none came within the wait (the
        caller checks for versions that went back), else None. Raises when the poll
        itself failed (no fragment named yet)."""
        self._count_network_call()
        known = [_NEVER if w is None else w for w in wanted]
        epoch = next((s.epoch for s in self.slots if s.epoch), "")
        keep = [  # frozen slices held at the version asked after: left out if unchanged
            self._frozen[f.index] if w is not None and w == s.version >= 0 and s.epoch == epoch
            else ()
            for f, s, w in zip(self.plan.fragments, self.slots, wanted)
        ]  # fmt: skip
        dests = [_Dest(s, self._sizes[f.index]) for f, s in zip(self.plan.fragments, self.slots)]
        claimed: list[int] = []

        def claim(i: int) -> bool:  # the answer is fragment i: take its slot, if still wanted
            with self._lock:
                if self._cut:  # cut short (_recast): asked again, for what is wanted now
                    return False
                self._polling = None  # its body is read now: no cut from here on
            self.slots[i].lock.acquire()
            claimed.append(i)
            if self._wanted()[i] != known[i]:  # a send took it meanwhile: not now
                return False
            self._prefetch.drop(i)
            return True

        info: dict = {}
        got, error = None, None
        with self._lock:
            self._polling, self._cut = known, False
        # An upload done since ``wanted`` was read found no poll to cut (_recast): its
        # fragment would be left out for the whole poll. Asked again at once instead.
        if any(w is not None and w < k for w, k in zip(self._wanted(), known)):
            with self._lock:
                self._polling = None
            return None
        try:
            got = self.client.download_next(
                known, self.world_size, self.rank, dests, claim, self.long_poll_s,
                island=self.island, keep=keep, epoch=epoch, info=info, run=self.run,
            )  # fmt: skip
        except Exception as e:
            error = e  # after the answer named its fragment: _took judges it
        finally:
            with self._lock:
                self._polling, cut = None, self._cut
            if cut:  # its interrupt may have come after the request ended
                self.client.forget_interrupt()
        if not claimed:
            if error is not None and not cut:  # (cut: no failure, asked again at once)
                self._note_refusal(error)
                raise error
            return None if got is None else got.versions
        i = claimed[0]
        try:
            if error is not None or got.version is not None:  # (None: claim said no)
                version = None if error is not None else got.version
                self._took(self.plan.fragments[i], self.slots[i], version, info, error)
        finally:
            self.slots[i].lock.release()
        return None

    def _took(
        self, frag: Fragment, slot: _Slot, version: int | None, info: dict,
        error: Exception | None = None,
    ) -> bool:  # fmt: skip
        """After a download into ``slot.base`` (``slot.lock`` held): check it and record
        the version that came (``version``; None: not newer), or mark the slot torn when
        the answer was bad or cut short (``error``). True if a usable version came."""
        problem = None
        if error is None:
            torn = False
            if version is not None:  # (the ones left out were checked when they came)
                left_out = set(info.get("unchanged", ()))
                bad = [
                    n
                    for n, t in _received(slot).items()
                    if n not in left_out and not _all_finite(t)
                ]
                problem = f"{bad[0]}: NaN or Inf" if bad else None
                torn = problem is not None
        elif isinstance(error, (RefusedError, wire.WireError)):
            self._note_refusal(error)
            version, problem = None, str(error)
            torn = isinstance(error, wire.WireError)  # a refusal comes before any byte
        else:  # unreachable, or cut short by close(): try again later
            self._fetch_error = f"the coordinator did not answer: {error}"
            if not self._woken_by_close():
                self.stats.failed += 1
                log.warning(
                    "%s/%d download of fragment %d failed: %s",
                    self.island,
                    self.rank,
                    frag.index,
                    error,
                )
            version, torn = None, True
        if version is not None and not torn:
            self._prefetch.copy(frag.index, _received(slot), version)
        if problem is not None:  # never applied: the base is fetched again whole
            self._fetch_error = f"bad answer for fragment {frag.index}: {problem}"
            self.stats.bad_responses += 1
            log.error(
                "%s/%d bad answer for fragment %d: %s",
                self.island,
                self.rank,
                frag.index,
                problem,
            )
        with self._lock:
            if torn:
                slot.version, slot.holds_upload = -1, False
                slot.epoch, slot.incoming = "", {}  # fetched again whole
            elif version is not None:
                slot.version, slot.refetch, slot.holds_upload = version, False, False
                slot.epoch = info.get("epoch", "")
                self.stats.unchanged += len(info.get("unchanged", ()))
                self.stats.bytes_received += info.get("bytes", 0)
                ago = info.get("opened_ago_s")
                slot.opened_t = None if ago is None else time.perf_counter() - ago
        return version is not None and not torn

    def _note_refusal(self, e: Exception) -> None:
        """A request refused as from a superseded process (a later launch of the island, or
        another run's coordinator): the island stops at its next agreement. Downloads and
        polls are refused so too: they renewed the lease of an island no longer its."""
        if isinstance(e, RefusedError) and e.status == 409 and wire.SUPERSEDED in e.message:
            self._superseded = e.message

    # ---------------------------------------------------------- network side
    def _uploader(self) -> None:
        self._transport("upload", self._upload_loop)

    def _transport(self, what: str, loop) -> None:
        """A transport thread's life: ``loop`` at a lower priority; if it dies of an error,
        the training thread hears of it at its next step (``on_step``)."""
        _lower_thread_priority(BACKGROUND_NICE)
        try:
            loop()
        except BaseException as e:
            self._died = f"the {what} thread died: {type(e).__name__}: {e}"
            raise  # (its traceback: threading's excepthook)
        finally:
            self._count_thread_cpu()

    def _count_thread_cpu(self) -> None:
        with self._lock:
            self.stats.transport_cpu_s += time.thread_time()

    def _upload_loop(self) -> None:
        while not self._stop.is_set():
            try:  # close() puts None to wake it; the timeout is only a safety net
                index = self._uploads.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                continue
            if index is None:
                self._uploads.task_done()
                continue
            with self._lock:
                header, delta = self._pending.pop(index)
            if isinstance(delta, Staged):
                delta = self._unstage(index, delta)
            keys = [(header.fragment, n) for n in delta]  # its error-feedback residuals
            # The residuals before this upload: put back if it is not taken.
            saved = self.feedback.snapshot(keys) if self.feedback is not None else {}
            body = self._encode(header, delta, keys)
            del delta
            slot = self.slots[index]
            if self.feedback is not None:  # the compressed body is a buffer of its own
                self._sent(slot)
            accepted = body is not None and self._upload(header, body, saved)
            self._sent(slot)  # the client dropped the body's parts once its bytes were sent
            if not accepted:
                with self._lock:  # no result of this upload will come: the base is fetched
                    if slot.sent_step == header.step:
                        slot.in_flight = False
            del body
            self._uploads.task_done()
            self._wake.set()  # the base is free to download into, or must be fetched again
            self._recast(index)

    def _recast(self, index: int) -> None:
        """The upload of fragment ``index`` is done: cut the downloader's long poll short if
        it leaves that fragment out (it started while the upload was being sent, or before
        it), so that the next poll asks for its result. That result, merged before the
        upload's reply was taken in, waited for the poll to time out (up to
        ``long_poll_s``) while the island trained on stale values, and came late for its
        step. One request more per upload at most, and no failure: the poll is asked again."""
        with self._lock:
            if self._polling is None or self._cut or self._polling[index] != _NEVER:
                return
            self._cut = True
            self.client.interrupt(self._threads[1])

    def _stage_on_device(self, local: dict[str, torch.Tensor]) -> bool:
        """Stage this send on the GPU: the shard is there and no other send is staged (at
        most one fragment's copy, 1/P of the shard, is held in GPU memory)."""
        t = next(iter(local.values()), None)
        return t is not None and t.is_cuda and self._staged == 0

    def _unstage(self, index: int, staged: Staged) -> dict[str, torch.Tensor]:
        """The staged send's pseudo-gradient, in place in its base (the upload thread)."""
        try:
            with self.slots[index].lock:
                return staged.subtract(self._up_lane)
        finally:
            with self._lock:
                self._staged -= 1

    def _sent(self, slot: _Slot) -> None:
        with self._lock:
            slot.sending = False

    def _wanted(self) -> list[int | None]:
        """Per fragment, the version to fetch a newer one than (-1: any), or None: not now."""
        with self._lock:
            if self._paused:
                return [None] * len(self.slots)
            out: list[int | None] = []
            step, cycle = self._last_step or 0, self.schedule.sync_every
            for s in self.slots:
                if s.sending:  # the base is an upload's body until it is sent
                    out.append(None)
                elif s.version < 0:  # torn by a bad download
                    out.append(-1)
                elif s.holds_upload and (
                    # One step before its next turn: the refetch is in by the turn.
                    self._flushing or not s.in_flight or step - s.sent_step >= cycle - 1
                ):
                    # No result will come (failed, dropped, or lost in a coordinator restart),
                    # or the flush may send the fragment again: the base is fetched again,
                    # whatever the version, before the next send.
                    out.append(-1)
                elif s.refetch or (
                    s.version == s.applied and (s.sent_step is not None or self.align_phase)
                ):  # a result of its upload; with phase alignment, any newer version
                    out.append(s.version)
                else:
                    out.append(None)
            return out

    def _downloader(self) -> None:
        self._transport("download", self._download_loop)

    def _download_loop(self) -> None:
        last_contact = time.monotonic()
        idle_logged = False
        # After a download that came bad or cut short, or a long poll that failed: a wait
        # before the next, doubling (up to HEARTBEAT_S) while they keep failing. Fetched again
        # at once, an answer bad every time (a global that overflowed, a broken proxy) was
        # downloaded whole and logged as an error hundreds of times a second, by every rank
        # of every island.
        bad_wait = 0.0
        while not self._stop.is_set():
            self._wake.clear()  # a change from here on ends the waits below
            idle = time.monotonic() - self._active_t
            limit = max(IDLE_LEASE_S, IDLE_GAPS * (self._longest_gap or 0.0))
            if idle > limit and not (self._flushing or self._lease_kept):  # see IDLE_LEASE_S
                if not idle_logged:
                    log.warning("%s/%d no training step for %.0f s: heartbeats stop until "
                                "the next step", self.island, self.rank, idle)  # fmt: skip
                idle_logged = True
                self._wake.wait(HEARTBEAT_S)  # the next step wakes it
                continue
            idle_logged = False
            wanted = self._wanted()
            if all(w is None for w in wanted):
                if time.monotonic() - last_contact >= HEARTBEAT_S:  # keep the lease alive
                    try:
                        self.client.versions(self.island, run=self.run)
                    except Exception as e:
                        self._note_refusal(e)
                    last_contact = time.monotonic()
                # Until something is wanted (a step, an upload done, the flush) or the
                # next heartbeat is due.
                self._wake.wait(max(0.0, HEARTBEAT_S - (time.monotonic() - last_contact)))
                continue
            last_contact = time.monotonic()
            errors = self.stats.bad_responses + self.stats.failed
            # Only fragments we wait for may end the long poll: another island's merge of
            # a fragment we are not waiting for must not wake us (that would spin).
            try:  # answers at once with the first fragment we wait for that is newer
                current = self._fetch_next(wanted)
            except Exception as e:
                if self._woken_by_close():
                    break
                self.stats.failed += 1
                log.warning("%s/%d long poll for fragments: %s", self.island, self.rank, e)
                current = None  # asked again after the wait below
            if self.stats.bad_responses + self.stats.failed > errors:  # failed, or came torn
                bad_wait = min(max(2 * bad_wait, self.poll_s), HEARTBEAT_S)
                self._stop.wait(bad_wait)
            else:
                bad_wait = 0.0
            if current is None:  # one came (or was dropped): ask again, for the next
                continue
            # None newer: only a version older than ours is left to take.
            for frag, slot, w in zip(self.plan.fragments, self.slots, self._wanted()):
                if self._stop.is_set():
                    break
                if w is not None and 0 <= current[frag.index] < w:  # the coordinator went back
                    log.warning(
                        "%s/%d the coordinator holds version %d of fragment %d, older than "
                        "this island's %d (its state was restored or lost?): taking it",
                        self.island, self.rank, current[frag.index], frag.index, w,
                    )  # fmt: skip
                    self._fetch(frag, slot, after=None)

    def _woken_by_close(self) -> bool:
        """In the downloader: close() has stopped it (a request it cut short is no failure)."""
        return self._stop.is_set() and threading.current_thread() is self._threads[1]

    def _count_network_call(self) -> None:
        if threading.get_ident() == self._train_thread and not self._flushing:
            self.stats.network_calls_in_loop += 1

    def _encode(self, header: wire.UploadHeader, delta, keys: list) -> wire.Body | None:
        """The upload's body (aliasing ``delta``, or its compressed form); None: not sendable.

        ``keys``: the (fragment, slice) residuals of ``delta``'s slices, in its order.
        """
        ef = self.feedback
        if ef is None:
            return wire.upload_parts(header, delta)
        # Compressed here, off the training thread. Error feedback: each
        # slice's residual from the fragment's previous upload is added to this one.
        try:
            enc = {n: ef.compress(k, delta[n]) for k, n in zip(keys, delta)}
        except ValueError as e:  # NaN or Inf in the pseudo-gradient: nothing to send
            for k in keys:
                ef.reset(k)
            self.stats.refused += 1
            log.warning("%s/%d upload not sent: %s", self.island, self.rank, e)
            self._diverged = f"fragment {header.fragment} step {header.step} not sent: {e}"
            return None
        return wire.upload_parts(header, *compress.to_wire(enc))

    def _upload(self, header: wire.UploadHeader, body: wire.Body, saved: dict) -> bool:
        """Send one upload (its body is released once sent); True if it was accepted.

        ``saved``: the error-feedback residuals of its slices from before it was compressed.
        """
        self._count_network_call()
        ef = self.feedback
        accepted = False
        try:
            reply = self.client.upload_body(body, release=True)
            self.stats.uploads += 1
            self.stats.bytes_sent += len(body)
            accepted = reply["status"] == "accepted"
            if not accepted:
                self.stats.dropped += 1
                late = reply.get("late_s")
                if isinstance(late, (int, float)) and late >= 0:
                    with self._lock:
                        skipped = self._skipped.get(header.fragment, -1)
                        if skipped is not None and skipped <= header.step:
                            self._skipped.pop(header.fragment, None)  # its phase is current now
                        if header.step > self._late[0] and skipped != header.step:
                            self._late = (header.step, float(late))
                log.info(
                    "%s/%d fragment %d step %d: %s",
                    self.island,
                    self.rank,
                    header.fragment,
                    header.step,
                    reply["reason"],
                )
        except RefusedError as e:
            self.stats.refused += 1
            self._flush_lost += self._flushing
            log.warning("%s/%d upload refused: %s", self.island, self.rank, e)
            self._note_refusal(e)
            if e.status == 422 and wire.NOT_FINITE in e.message:
                self._diverged = e.message  # so does a diverged one: every upload would be
        except Exception as e:  # coordinator unreachable: keep training, try again next time
            self.stats.failed += 1
            self._flush_lost += self._flushing
            log.warning("%s/%d upload failed: %s", self.island, self.rank, e)
        if ef is not None and not accepted:
            # The residuals took this upload's rounding as delivered; it was not taken: the
            # ones from before it go back. Still owed to the global model, they go out with
            # the fragment's next upload (which carries this one's progress again, or, when
            # a newer version overwrites it, has lost it as an uncompressed upload would).
            # Forgotten, one rounding error per value was lost at each upload not taken,
            # and the losses added up.
            ef.restore(saved)
        return accepted

    # ------------------------------------------------------------ end of training
    def flush(self, timeout_s: float = 60.0, final: bool = False) -> list[int]:
        """Send the progress the last scheduled sends left behind; every rank calls it.

        Call after the last :meth:`on_step`, before :meth:`close`, when the island is
        about to leave: each fragment's steps since its last apply (H/2 on average)
        would otherwise never reach the global model. In three parts, every decision
        taken by the whole island in the agreement collective (all ranks take the
        same ones, and give up at the same time):

        1. results in flight are applied once every rank holds them (at most
           ``timeout_s / 2``; training is over, so tau is not waited for), and every
           base that still holds an upload is fetched again;
        2. every fragment with steps since its last apply, and not sent at the last
           step already, is sent as :meth:`on_step` sends (each rank its slices,
           the island's tokens, step = the last step; a fragment whose result did
           not come is sent again: its newer upload replaces the older one);
        3. their results are waited for (until ``timeout_s``) and applied: merged,
           or dropped as stale like any upload. An island that leaves before its
           contribution is merged loses it (the coordinator drops what a leaving
           island has pending), so this wait is what makes the flush count.

        ``final``: the island leaves for good after it. Its uploads are then marked
        final: the coordinator merges each with the next round of its fragment that
        closes (at the latest once no island that trains is left), keeps it past the
        island's leave, and no round waits for the island any more. Closing a round on
        its own, a flush upload made the uploads of that round from the islands still
        training stale (with K = 1 they came after it): their steps on the fragment, up
        to H each, lost for the flush's H/2 on average. Part 3 then waits for the
        results of the islands' next uploads; one that comes after ``timeout_s`` is
        merged all the same.

        Returns the fragments sent. With K = M a round needs every live island's
        upload: each island's flush sends the same fragments (the schedule is
        shared), and an island that has left or is finishing no longer counts, so the
        rounds close. A flush upload based on a version that another island's merge
        has replaced is stale: dropped, as it would be at any step.
        """
        if self._last_step is None or not any(t.is_alive() for t in self._threads):
            return []
        t0 = time.monotonic()
        with self._lock:
            self._flushing, self._flush_lost = True, 0
        self._wake.set()
        self._settle(t0 + timeout_s / 2, refetch=True)
        sent = self._send_progress(self._last_step, final)
        self.stats.flushed += len(sent)
        # Failed or refused, an upload waits for nothing: its result is missing all the same.
        self.stats.flush_unsettled += self._settle(t0 + timeout_s) + self._flush_lost
        self.stats.flush_s += time.monotonic() - t0
        log.info(
            "%s/%d flush: sent fragments %s; %d result(s) missing after %.2f s",
            self.island, self.rank, sent, self.stats.flush_unsettled, self.stats.flush_s,
        )  # fmt: skip
        return sent

    def _settle(self, deadline: float, refetch: bool = False) -> int:
        """Apply results as every rank gets them until no rank waits for one, or until
        some rank's ``deadline`` has passed; returns this rank's uploads still waiting.

        ``refetch``: fetch every base that still holds a sent upload again from this
        thread, once. The downloader would too, but only once its long poll (up to
        ``long_poll_s``) returns, which may be after a short flush gave up (then the
        fragment's progress could not be sent). Tried once per slot, without retries and
        never waiting past ``deadline``: a coordinator down at the end must not hold the
        flush beyond its bound (the downloader keeps trying meanwhile)."""
        tried: set[int] = set()
        while True:
            if refetch:
                self._refetch_held(deadline, tried)
            with self._lock:
                held = [s.version if s.sent_step is not None and s.arrived else -1
                        for s in self.slots]  # fmt: skip
                waiting = sum(s.in_flight or s.holds_upload for s in self.slots)
            late = int(time.monotonic() >= deadline)
            lows, highs, _ = self._agree([*held, waiting, late])
            # held is -1 for a slot that waits for no result: nothing applied or fetched there.
            if self._apply_agreed(zip(self.plan.fragments, self.slots), held, lows, highs):
                self._flush()
            self._wake.set()  # applied, or behind another rank: fetch again
            if highs[-2] == 0:
                return 0
            if highs[-1] == 1:  # given up: what this rank still waits for
                with self._lock:
                    return sum(s.in_flight for s in self.slots)
            time.sleep(self.poll_s)

    def _refetch_held(self, deadline: float, tried: set[int]) -> None:
        for frag, slot in zip(self.plan.fragments, self.slots):
            with self._lock:
                holds = slot.holds_upload and not slot.sending
            left = deadline - time.monotonic()
            if holds and frag.index not in tried and left > 0:
                tried.add(frag.index)
                client = self.client.with_limits(timeout_s=left)
                try:
                    self._fetch(frag, slot, after=None, client=client)
                finally:
                    client.close()

    def _send_progress(self, step: int, final: bool = False) -> list[int]:
        """Send, at ``step``, every fragment with steps since its last apply (the island
        agrees); ``final``: marked as the island's final flush."""
        with self._lock:
            self._paused = True  # the downloader starts no new fetch ...
        for slot in self.slots:
            slot.lock.acquire()  # ... and one under way ends first: the bases stay as they are
        try:
            with self._lock:
                usable = [
                    int(s.version == s.applied >= 0 and not (s.refetch or s.holds_upload)
                        and s.steps > 0 and (s.sent_step is None or s.sent_step < step))
                    for s in self.slots
                ]  # fmt: skip
                tokens = [s.tokens for s in self.slots]
            lows, _, rows = self._agree(usable + tokens)
            p, sent = len(self.slots), []
            for i, frag in enumerate(self.plan.fragments):
                if lows[i] == 1:  # every rank has progress on it and the base it started from
                    self._send(frag, step, True, sum(r[p + i] for r in rows), final)
                    sent.append(i)
            return sent
        finally:
            for slot in self.slots:
                slot.lock.release()
            with self._lock:
                self._paused = False
            self._wake.set()

    def leave(self, client: CoordinatorClient | None = None) -> None:
        """Tell the coordinator this island is done for good (best effort)."""
        try:
            (client or self.client).leave(self.island, self.incarnation, run=self.run)
        except Exception as e:
            log.warning("%s/%d could not leave the run: %s", self.island, self.rank, e)

    def finish(
        self, *, leave: bool, take_global: bool, flush: bool, flush_timeout_s: float = 60.0
    ) -> list[int] | None:
        """The end of an island's part (``Learner.close``; every rank calls it): flush (at
        most ``flush_timeout_s``), stop the threads, leave (rank 0, if ``leave``), and take
        the global model (if ``take_global``: returns its versions, or raises RuntimeError
        on every rank with the local values intact).

        A coordinator that does not answer at the end (a health probe gets no answer within
        ``GONE_RETRY_S`` on any rank) is gone for now: queued uploads are not waited for, and leaving and taking
        the global model each try once more, at most ``GONE_RETRY_S``, rather than with
        their full waits (flush, leave and take_global one after the other took 193 s
        through the HF callback, which promised 120; 272 s with a coordinator that hung)."""
        once = self.client.with_limits(timeout_s=GONE_RETRY_S)
        try:
            try:
                if flush:  # leaving for good: the coordinator merges it with the next rounds
                    self.flush(flush_timeout_s, final=leave)
                # Asked now when it matters (after an error: neither, no probe), else the last
                # request's outcome.
                ask = leave or take_global
                gone = not _answers(once) if ask else self.client.unreachable
                if take_global:  # the same waits on every rank (no collective otherwise:
                    gone = self._agree([int(gone)])[1][0] == 1  # after an error not all are here)
            except BaseException:
                # A collective failed (a rank gone): the threads stop here or never, since
                # Learner.close counts as done and its exit hook then leaves them running.
                self.close(timeout=0.0)
                raise
            self.close(timeout=0.0 if gone else 30.0)  # queued uploads would only time out
            if leave and self.rank == 0:
                self.leave(once if gone else None)
            if not take_global:
                return None
            if not gone:
                return self.take_global()
            return self.take_global(timeout_s=GONE_RETRY_S, client=once)
        finally:
            once.close()

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued uploads, then stop the background thread."""
        deadline = time.monotonic() + timeout
        uploader, downloader = self._threads
        while (self._uploads.unfinished_tasks and uploader.is_alive()
               and time.monotonic() < deadline):  # fmt: skip
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if uploader.is_alive():
            self._uploads.put(None)  # wakes it from its wait for the next upload
            uploader.join(timeout=max(0.0, deadline - time.monotonic()))
        # Past the deadline, requests still running are cut short: a rank that returned
        # with a live thread could not take the global model with the others.
        cut_until = deadline + CLOSE_INTERRUPT_S
        while uploader.is_alive() and time.monotonic() < cut_until:  # a stalled upload
            self.client.interrupt(uploader)
            uploader.join(timeout=0.05)
        # The downloader may be in a long poll (up to long_poll_s, at every island's exit
        # and restart): its connection is shut down to wake it, again until it is gone (it
        # may have been about to send one). A download cut short leaves its slot torn,
        # fetched again whole if ever needed.
        while downloader.is_alive() and time.monotonic() < cut_until:
            self.client.interrupt(downloader)
            downloader.join(timeout=0.05)
        with self._lock:
            for slot in self.slots:  # a body left unsent is dropped: a download may write
                slot.sending = False
        self._prefetch.close()  # training is over: take_global applies from the host
