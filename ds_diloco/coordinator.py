"""The coordinator (the paper's syncer): global fragments, rounds, merges. No sockets.

Per fragment it holds the global values (one flat fp32 buffer, parameters
whole, in the fragment's order), a version that grows by one per merge, the
outer optimizer state, and the contributions of the open round. Uploads are
one rank's ZeRO-3 slices; an island's contribution counts once all its ranks'
slices for the same (fragment, base version, step) are in with agreeing
counters. Rounds close per :func:`round_policy.decide`; merging uses
:mod:`merge` and :mod:`outer_optim`; one fragment's served versions and contribution
rows are :class:`fragment_state.FragmentState`.

Thread model: every public method may be called from any thread (the HTTP
server calls them from an executor). ``_lock`` guards bookkeeping and is never
held during heavy math; each fragment's outer optimizer state is guarded by a
readers-writer lock that a merge takes for writing for its outer step and
durable write. Served values are never written in place: a merge steps a copy
and publishes it, so downloads read them without a lock and without a copy.

A merge is all or nothing: one that fails (merge, outer step, durable write) leaves
the fragment's values, outer state and version as they were, and its contributions
go back into the round, which closes again after a backoff (``Coordinator.poll``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time

import torch

from ds_diloco import compress, wire
from ds_diloco.buffer_pool import BufferPool
from ds_diloco.config import ISLAND_ID_RULE, CoordinatorConfig, valid_island_id
from ds_diloco.fragment_state import Contribution, FragmentState, Ingest
from ds_diloco.fragments import Fragment, FragmentPlan, ParamSpec, Schedule, param_specs
from ds_diloco.island_table import (
    IslandRecord,
    islands_on_disk,
    merged_by_after,
    merges_on_disk,
)
from ds_diloco.merge import (
    merge_fragment,
    norm_outlier,
    sq_norm,
    staleness_weight,
    token_weight,
)
from ds_diloco.metrics import IslandTime, RunMetrics, goodput
from ds_diloco.outer_optim import build_outer_optimizer
from ds_diloco.round_policy import Decision, Ema, RoundState, decide
from ds_diloco.sharding import shard_numel, shard_range
from ds_diloco.state_store import StateStore

log = logging.getLogger(__name__)
STATE_FORMAT = 1
UPLOAD_HEADER_ROOM = 1 << 20
"""Bytes an upload's header may take beside 1 KiB per tensor (``largest_upload_bytes``)."""
VERSION_RESERVE = 16  # version numbers made durable per fsync of versions.json
OPENED_AT_KEPT = 8  # round start times kept per fragment (a stale upload's lateness)
MERGE_RETRY_S = 1.0  # wait after a failed merge, doubled per failure in a row...
MERGE_RETRY_MAX_S = 30.0  # ...up to this
MERGE_ATTEMPTS = 5
"""Failed merges a contribution goes through before it is dropped: a failure that
persists (a contribution that always breaks the merge, a full disk) then costs those
steps, not every later round of the fragment."""


class CoordinatorError(Exception):
    """A refused request: ``status`` is the HTTP status, the message names the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _check_run(what: str, island: str, run: str, run_id: str) -> None:
    """Refuse a request from a process of another run's island of the same name (a process
    left from an earlier run): an upload merged, a leave taking this run's island out of
    every quorum, a download, poll or start keeping its lease alive. It is told it was
    superseded, so that it stops. ``run`` "": not given."""
    if run and run != run_id:
        raise CoordinatorError(
            409,
            f"{what} from run {run!r}, this coordinator's run is {run_id!r}: island "
            f"{island!r} here is another run's (a process of an earlier run still "
            f"sending?): {wire.SUPERSEDED}",
        )


def _check_incarnation(what: str, isl: IslandRecord, incarnation: int) -> None:
    """Refuse an upload or leave from a process an island's later registration superseded."""
    if incarnation > isl.registrations:  # not superseded: the process must not stop
        raise CoordinatorError(
            409,
            f"{what} from incarnation {incarnation} of island {isl.island!r}, which this "
            f"coordinator knows up to incarnation {isl.registrations}",
        )
    if incarnation != isl.registrations:
        raise CoordinatorError(
            409,
            f"{what} from incarnation {incarnation} of island {isl.island!r}, which registered "
            f"again since (incarnation {isl.registrations}): {wire.SUPERSEDED}",
        )


def _check_adoptable(h: wire.UploadHeader) -> None:
    """Refuse an upload that names an island this coordinator cannot take as registered."""
    if not valid_island_id(h.island):
        raise CoordinatorError(400, f"island id must be {ISLAND_ID_RULE}, got {h.island!r}")
    if h.incarnation < 1:  # registrations count from 1: 0 or -7 were adopted as they said
        raise CoordinatorError(
            422, f"counters out of range: incarnation {h.incarnation} must be >= 1"
        )


def _check_base_version(h: wire.UploadHeader, fs: FragmentState) -> None:
    if h.base_version > fs.version:
        raise CoordinatorError(
            409,
            f"base version {h.base_version} of fragment {h.fragment} is from the future: "
            f"the current version is {fs.version}",
        )


def _compressed(meta, names) -> bool:
    """Whether an upload is compressed: ``compress.to_wire`` names its metadata
    "<slice>#<field>" and its scales "<slice>#scales"."""
    return any("#" in k for k in (*meta, *names))


_MAX_CACHED_BODIES = 64
"""Encoded downloads kept per fragment version (by world size, rank and slices left out)."""
MAX_COUNTER = 2**53
"""Upper bound of an upload's counters (step, steps, tokens, versions, incarnation): the
integers a float64 holds exactly. Larger ones overflowed the token weight (tokens^2 /
steps = inf: the round's merge failed and every island's contribution in it was lost),
the step-time EMA and /metrics."""


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, clock=time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.store = StateStore(cfg.state_dir)
        self._lock = threading.Lock()
        self._islands: dict[str, IslandRecord] = {}
        self._xi_quorum = Ema()
        self._xi_sync = Ema()
        # The rounds' clock: (schedule position of the last merged round's fragment, when
        # that round opened); an island that starts late joins in phase (see start()).
        self._round_clock: tuple[int, float] | None = None
        self.send_schedule = Schedule(sync_every=cfg.sync_every, num_fragments=cfg.num_fragments,
                                 overlap=cfg.policy.tau)  # fmt: skip
        self._merges_since_save = 0
        self._versions_lock = threading.Lock()
        self._table_lock = threading.Lock()
        # Fragment-sized buffers shared by all fragments: contributions' rows, merge outputs,
        # the values merges step and the outer state they may put back (see BufferPool).
        # Made with the plan.
        self._buffers: BufferPool | None = None
        self.metrics = RunMetrics(cfg.uptime_window_s)
        # This run's id, made with its state dir and kept in it (a backup put back keeps it):
        # islands send it with their uploads (see _adopt_unknown).
        self.run_id = ""
        # This process's id, in every download: versions are compared (a download that
        # leaves out what did not change since the island's version) only within one.
        # A state put back from a backup serves version numbers again with other values.
        self.epoch = secrets.token_hex(8)
        # Bodies this process took in and served, and the bytes of slices downloads left
        # out as unchanged (``download``); counted on the server's event loop.
        self.traffic = dict.fromkeys(("upload_bytes", "download_bytes", "unchanged_bytes"), 0)
        if self.store.exists():
            self._load()
        else:
            self._init_from_model()

    # ----------------------------------------------------------------- set-up
    def _build_fragments(self, specs: list[ParamSpec]) -> None:
        self.plan = FragmentPlan.build(specs, self.cfg.num_fragments, self.cfg.fragmentation)
        self._frags: list[FragmentState] = []

    def _init_from_model(self) -> None:
        from ds_diloco.hf_model import initial_params

        named = initial_params(self.cfg.model, save_config_to=str(self.store.model_dir))
        self._build_fragments(param_specs(named))
        tensors = dict(named)
        del named
        for frag in self.plan.fragments:
            # Each tensor is let go once copied in: the model and its fragments are never
            # both whole in memory (the peak was twice the model's size).
            values = torch.cat([tensors.pop(p.name).reshape(-1) for p in frag.params])
            self._frags.append(self._new_fragment_state(frag, values))
        log.info("initialised %d fragments from %s", len(self._frags), self.cfg.model)
        self.run_id = secrets.token_hex(8)
        self._reserved = self.versions()
        self.save(all_fragments=True, final=True)

    def _new_fragment_state(
        self, frag: Fragment, values: torch.Tensor, version: int = 0
    ) -> FragmentState:
        opt = build_outer_optimizer(self.cfg.outer)
        if self._buffers is None:
            self._buffers = BufferPool(max(f.numel for f in self.plan.fragments))
        # Model averaging is the plain mean of every tensor: RDA keeps the merged norm at
        # the islands' mean norm, which moved the global model sqrt(M) times further.
        plain = ("",) if self.cfg.outer.name == "average" else self.cfg.plain_patterns
        return FragmentState(
            frag, values, opt, plain, self.cfg.norm_guard.window, version, pool=self._buffers
        )

    def _load(self) -> None:
        state = self.store.read_json("coordinator.json")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"state_dir {self.cfg.state_dir}: unknown format {state.get('format')}"
            )
        plan = FragmentPlan.from_json(state["plan"])
        if len(plan) != self.cfg.num_fragments or plan.strategy != self.cfg.fragmentation:
            raise ValueError(
                f"state_dir {self.cfg.state_dir} was written with {len(plan)} "
                f"{plan.strategy!r} fragments; the config asks for {self.cfg.num_fragments} "
                f"{self.cfg.fragmentation!r}: use a new state_dir or the old settings"
            )
        from ds_diloco.hf_model import model_signature

        if (want := model_signature(self.cfg.model)) != plan.signature:
            raise ValueError(
                f"state_dir {self.cfg.state_dir} was written for another model (parameter "
                f"names or shapes differ: {plan.signature[:12]} there, {want[:12]} for "
                f"{self.cfg.model.pretrained or self.cfg.model.config}): use a new state_dir "
                "or the old model"
            )
        self.plan = plan
        # A state dir from before run ids gets one now (saved before anything is served).
        self.run_id = state.get("run_id") or secrets.token_hex(8)
        self._frags = []
        hwm = self.store.read_json("versions.json") or {}
        for frag in plan.fragments:
            version, values, optim, merged_by = self.store.read_fragment_state(frag.index)
            # Written with durable merges, the file holds the last served version. Otherwise a
            # version may have been served after the last save: never reuse its number.
            # (Either way: the table's durable_merges flag may be older than the last run's.)
            served = max(version, hwm.get(str(frag.index), version))
            fs = self._new_fragment_state(frag, values, served + 1 if served > version else version)
            if optim:
                try:
                    fs.optimizer.load_state_dict(optim)
                except ValueError as e:  # alone, it named neither the file nor the setting
                    o = self.cfg.outer
                    raise ValueError(
                        f"state_dir {self.cfg.state_dir}: fragment {frag.index}'s outer "
                        f"optimizer state does not fit outer {o.name} (momentum {o.momentum:g}, "
                        f"every {o.every}): it was written with another outer optimizer "
                        f"({e}): use a new state_dir or the old outer settings"
                    ) from None
            fs.saved_version = version
            fs.merges = merges_on_disk(state, frag.index, version)
            fs.merges_at = version
            fs.merged_by = merged_by
            self._frags.append(fs)
        self._islands = islands_on_disk(state, [fs.merged_by for fs in self._frags], self.clock())
        self._xi_quorum = Ema.from_dict(state["xi_quorum"])
        self._xi_sync = Ema.from_dict(state["xi_sync"])
        self.metrics = RunMetrics.from_dict(state.get("metrics"), self.cfg.uptime_window_s)
        if self.metrics.window_s != self.cfg.uptime_window_s:
            log.warning("uptime_window_s %g: this state's uptime is counted in windows of %g s, "
                        "which it keeps", self.cfg.uptime_window_s, self.metrics.window_s)  # fmt: skip
        self._reserved = self.versions()
        if not state.get("run_id"):
            self._save_table()
        log.info("resumed from %s at versions %s", self.cfg.state_dir, self.versions())

    # ------------------------------------------------------------- persistence
    def save(self, all_fragments: bool = False, final: bool = False) -> int:
        """Write changed fragments and the island table; returns fragments written.

        ``final``: no merge follows (shutdown), so unused reserved versions are released.
        """
        with self._lock:
            merges = self._merges_since_save
        written = 0
        for fs in self._frags:
            fs.lock.acquire_read()
            try:
                if all_fragments or fs.version != fs.saved_version:
                    self.store.write_fragment(  # the read lock keeps the outer state still
                        fs.fragment.index, fs.version, fs.values,
                        fs.optimizer.state_dict(False), fs.merged_by,
                    )  # fmt: skip
                    fs.saved_version = fs.version
                    written += 1
            finally:
                fs.lock.release_read()
        self._save_table()
        # Counted down here, not by every table save: a registration's took the count back
        # to 0, and with islands registering often, a run without durable merges never
        # saved its fragments (a crash lost every merge since the start). Those made during
        # this save count for the next one; a failed save counts none (the next merge tries).
        with self._lock:
            self._merges_since_save = max(self._merges_since_save - merges, 0)
        if final:
            with self._versions_lock:
                self._reserved = self.versions()
                self.store.write_json(
                    "versions.json", {str(i): v for i, v in enumerate(self._reserved)}
                )
        return written

    def _save_table(self) -> None:
        """coordinator.json: plan, islands, merge counts, EMAs, metrics."""
        with self._table_lock:  # snapshots land in the order they were taken
            self._write_table()

    def _write_table(self) -> None:
        with self._lock:
            state = {
                "format": STATE_FORMAT,
                "run_id": self.run_id,
                "plan": self.plan.to_json(),
                "signature": self.plan.signature,
                "islands": {k: v.to_json() for k, v in self._islands.items()},
                "merges": [fs.merges for fs in self._frags],
                "merges_at": [fs.merges_at for fs in self._frags],  # see _load
                # What /v1/plan serves: an export from the state dir alone names it too.
                "schedule": dataclasses.asdict(self.send_schedule),
                "xi_quorum": self._xi_quorum.to_dict(),
                "xi_sync": self._xi_sync.to_dict(),
                "metrics": self.metrics.to_dict(),
                "durable_merges": self.cfg.durable_merges,
            }
        self.store.write_json("coordinator.json", state)

    # ------------------------------------------------------------------ islands
    def register(self, island: str, world_size: int, signature: str) -> dict:
        if not valid_island_id(island):
            raise CoordinatorError(400, f"island id must be {ISLAND_ID_RULE}, got {island!r}")
        if type(world_size) is not int or not 1 <= world_size <= MAX_COUNTER:  # not a bool
            raise CoordinatorError(
                400, f"world_size must be a positive integer, got {world_size!r}"
            )
        if signature != self.plan.signature:
            raise CoordinatorError(
                409,
                f"parameter signature mismatch: the coordinator's model has signature "
                f"{self.plan.signature[:16]} ({len(self.plan.specs)} tensors), the island sent "
                f"{str(signature)[:16]}: the island's model names or shapes differ",
            )
        now = self.clock()
        with self._lock:
            isl = self._islands.get(island)
            if isl is None:
                isl = self._join(island, world_size, now)
                log.info("island %s joins with world size %d", island, world_size)
            else:  # restarted (or resized): it may count its steps from an earlier checkpoint
                log.info("island %s registers again with world size %d", island, world_size)
                self._drop_pending(island)  # counted while the old registration's marks hold
                isl.new_incarnation(isl.registrations + 1, world_size, now)
        self._save_table()  # a registration is durable before it is acknowledged
        # The island's ranks send it with every upload: a process from before a later
        # registration (a restarted island's old launch, cut off and back) is refused.
        return {"island": island, "world_size": world_size, "incarnation": isl.registrations,
                **self.plan_info()}  # fmt: skip

    def start(self, island: str, run: str = "") -> dict:
        """``island`` is about to take its first inner step: how many of the run's have.

        Islands that start together stay in phase. With K < M a round closes on the
        first upload plus the grace window; an island that began more than that later
        finds each round closed when its upload comes: stale, round after round. So
        every island calls this until ``started`` reaches the run's island count
        (:meth:`ds_diloco.learner.Learner.start_together`). An island that has sent
        anything or left has started too (a restarted coordinator knows those from its
        table, not from a call). ``run``: as :meth:`touch`'s."""
        _check_run("start", island, run, self.run_id)
        with self._lock:
            isl = self._islands.get(island)
            if isl is None:
                raise CoordinatorError(404, f"unknown island {island!r}: register it first")
            now = self.clock()
            isl.started, isl.last_seen = True, now
            started = sum(
                1
                for i in self._islands.values()
                if i.started or i.last_step or i.merged or i.dropped or i.left_at is not None
            )
            return {
                "island": island,
                "started": started,
                "islands": len(self._islands),
                "clock": self._clock_now(now),
            }

    def _clock_now(self, now: float) -> float | None:
        """Where the rounds' schedule is now, in inner steps (mod H; None before any merge).

        The last merged round opened with an upload of its fragment at schedule position
        c (the island's step + phase, mod H: (fragment + 1) x H/P); the fastest island's
        step time says how far the schedule has moved since. An island that begins
        (or begins again, from a checkpoint) sets its phase so that its sends fall at
        this position: with K < M, sends out of phase with the rounds would be stale.
        """
        pace = self._fastest_step_s()
        if self._round_clock is None or pace is None:
            return None
        position, at = self._round_clock
        clock = (position + max(now - at, 0.0) / pace) % self.cfg.sync_every
        return clock if math.isfinite(clock) else None

    def _fastest_step_s(self) -> float | None:
        """The fastest island's inner step time (None before any is measured). Not one that
        left the run: it waits for no result and moves no schedule, and a fast island that
        finished first kept the others' grace window at its own step time."""
        steps = [
            i.step_time.value
            for i in self._islands.values()
            if i.step_time.value and i.left_at is None
        ]
        return min(steps) if steps else None

    def leave(self, island: str, incarnation: int | None = None, run: str = "") -> dict:
        """The island leaves the run for good: it no longer counts as live for any quorum.

        ``incarnation`` (the leaving process's registration): a superseded process's leave
        is refused, as its uploads are. None: whichever incarnation is registered. ``run``
        (its run's id, if given): a process of another run's island of the same name is
        refused, as its uploads are."""
        with self._lock:
            isl = self._islands.get(island)
            if isl is None:
                raise CoordinatorError(404, f"unknown island {island!r}")
            _check_run("leave", island, run, self.run_id)
            if incarnation is not None:
                _check_incarnation("leave", isl, incarnation)
            isl.left_at = time.time()
            self._drop_pending(island, keep_final=True)  # merged with the rounds to come
        self._save_table()
        log.info("island %s left the run", island)
        return {"island": island, "left": True}

    def model_config(self) -> dict:
        """The HF config.json of the global model (for export)."""
        import json

        return json.loads((self.store.model_dir / "config.json").read_text())

    def generation_config(self) -> dict:
        """The global model's generation_config.json, saved with its config.json at start."""
        import json

        path = self.store.model_dir / "generation_config.json"
        if not path.is_file():
            raise CoordinatorError(404, "the state directory has no model/generation_config.json")
        return json.loads(path.read_text())

    def plan_info(self) -> dict:
        return {
            "plan": self.plan.to_json(),
            "signature": self.plan.signature,
            "versions": self.versions(),
            "schedule": dataclasses.asdict(self.send_schedule),
            "compression": dataclasses.asdict(self.cfg.compression),
            "align_phase": self.cfg.align_phase,
            "run": self.run_id,
        }

    def _adopt_unknown(self, h: wire.UploadHeader, now: float) -> IslandRecord:
        """An upload from an island this coordinator has no record of, sent in its own run
        (``_lock`` held): its state is older than the island's first registration (a state
        dir put back from a backup). Refused, the island's uploads would be lost for good
        while it trained on; taken as registered as the upload says. The run id tells it
        from an island that never registered here (refused: register it first)."""
        _check_adoptable(h)
        log.warning(
            "island %s (registration %d, world size %d) is not in this coordinator's state "
            "(older than its registration): taken as registered",
            h.island, h.incarnation, h.world_size,
        )  # fmt: skip
        isl = self._join(h.island, h.world_size, now)
        isl.registrations = h.incarnation
        return isl

    def _join(self, island: str, world_size: int, now: float) -> IslandRecord:
        """A new island in the table, allocated from now on (``_lock`` held)."""
        isl = self._islands[island] = IslandRecord(
            island=island, world_size=world_size, last_seen=now
        )
        self.metrics.start(isl.joined_at)
        return isl

    def _adopt_registration(self, isl: IslandRecord, h: wire.UploadHeader, now: float) -> None:
        """An upload from a registration this coordinator has no record of (``_lock``
        held): its state is older than the island's last registration (a state dir put
        back from a backup). The island is the current one, not a superseded one: taken
        as registered as the upload says (it was refused as superseded, and stopped)."""
        log.warning(
            "island %s sends from registration %d, this coordinator knew %d (its state is "
            "older than that registration): taken as registered, world size %d",
            h.island, h.incarnation, isl.registrations, h.world_size,
        )  # fmt: skip
        self._drop_pending(isl.island)  # counted while the old registration's marks hold
        isl.new_incarnation(h.incarnation, h.world_size, now)

    def _drop_pending(self, island: str, keep_final: bool = False) -> None:
        for fs in self._frags:
            for table in (fs.assembling, fs.complete):
                if keep_final and table is fs.complete and island in table and table[island].final:
                    continue
                c = table.pop(island, None)
                if c is not None:
                    fs.give_row(c.row)
                    self._count_dropped(fs, c)

    def _drop_abandoned(self, fs: FragmentState, now: float) -> None:
        """Drop the partial contributions of islands that lost their lease (``_lock``
        held): the ranks still missing went with it. Each holds a fragment-sized row,
        which was held until the island registered again, for good if it never did."""
        for name, c in list(fs.assembling.items()):
            isl = self._islands.get(name)
            if isl is not None and self._holds_lease(isl, now):
                continue
            del fs.assembling[name]
            fs.give_row(c.row)
            self._count_dropped(fs, c)
            log.warning(
                "fragment %d: dropped island %s's upload of step %d, ranks %s of %d in: the "
                "island lost its lease (nothing heard for %.0f s)", fs.fragment.index, name,
                c.step, sorted(c.ranks), c.world_size, self.cfg.island_timeout_s,
            )  # fmt: skip

    def _count_dropped(self, fs: FragmentState, c: Contribution) -> None:
        isl = self._islands.get(c.island)
        if isl is not None:
            isl.count_dropped(fs.fragment.index, c.step, c.steps)

    def _holds_lease(self, isl: IslandRecord, now: float) -> bool:
        """Heard from within the lease (``island_timeout_s``) and not gone for good."""
        return isl.left_at is None and now - isl.last_seen <= self.cfg.island_timeout_s

    def _is_live(self, isl: IslandRecord, now: float) -> bool:
        """Holds its lease and is not finishing (its final flush under way: no round waits
        for it any more)."""
        return not isl.finishing and self._holds_lease(isl, now)

    def _live_islands(self, now: float) -> int:
        return sum(1 for i in self._islands.values() if self._is_live(i, now))

    def versions(self) -> list[int]:
        return [fs.version for fs in self._frags]

    # ------------------------------------------------------------------ uploads
    def upload(self, body: bytes | bytearray | memoryview) -> dict:
        """Validate and take in one rank's slices from a whole body; refuses with
        CoordinatorError (the server streams large bodies: :meth:`upload_begin`)."""
        try:
            h, slices, meta = wire.decode_upload_with_metadata(body, self._most_tensors())
        except wire.WireError as e:
            raise CoordinatorError(400, str(e)) from None
        fs = self._fragment(h.fragment)
        zeros = self._zero_names(h, fs.fragment, slices)
        slices = self._decompress(h, fs.fragment, slices, meta, zeros)
        self._check_shape(h, fs.fragment, slices, zeros)
        sq = self._check_values(fs, slices, h)  # before any state changes; zeros: 0
        ing = self._begin(h, fs, zeros)
        try:
            for name, t in slices.items():  # every slice but ``zeros`` (checked above)
                ing.parts[name].copy_(t)
            ing.fill_zeros()
        except BaseException:
            self.upload_abort(ing)
            raise
        return self._finish(ing, sq)

    def upload_begin(self, head, body_len: int) -> Ingest | None:
        """Start taking in an upload of ``body_len`` bytes from its head (the first
        ``wire.head_length`` bytes): checked as far as the head tells, and given the place
        in its island's contribution row where the body's data go (``Ingest.write``, then
        :meth:`upload_finish`, or :meth:`upload_abort` if the body does not come whole).
        No copy of the body is made. None: a compressed upload, taken whole (:meth:`upload`).
        """
        try:
            h, entries, meta = wire.decode_upload_head(head, body_len, self._most_tensors())
        except wire.WireError as e:
            raise CoordinatorError(400, str(e)) from None
        if _compressed(meta, [e.name for e in entries]):
            return None
        fs = self._fragment(h.fragment)
        shapes = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
        zeros = self._zero_names(h, fs.fragment, shapes)
        self._check_shape(h, fs.fragment, shapes, zeros)
        ing = self._begin(h, fs, zeros)
        ing.order = [e.name for e in entries]
        return ing

    def upload_finish(self, ing: Ingest) -> dict:
        """Take in an upload of :meth:`upload_begin` whose data were all written."""
        try:
            ing.fill_zeros()
            slices = {n: t for n, t in ing.parts.items() if n not in ing.zeros}
            sq = self._check_values(self._frags[ing.header.fragment], slices, ing.header)
        except BaseException:
            self.upload_abort(ing)
            raise
        return self._finish(ing, sq)

    def upload_abort(self, ing: Ingest) -> None:
        """An upload of :meth:`upload_begin` refused or cut short: nothing of it is kept."""
        with self._lock:
            self._frags[ing.header.fragment].leave(ing.landing, ing.header.rank)

    def _most_tensors(self) -> int:
        """A slice per tensor, and a compressed one's scales: any more is not an upload."""
        return 2 * max(len(fs.fragment.params) for fs in self._frags)

    def _admit(self, h: wire.UploadHeader, fs: FragmentState, now: float, adopt: bool = True):
        """(island, its contribution in assembly) for an upload, or why it is refused
        (``_lock`` held): asked when it starts and again once its body is in.

        ``adopt`` False (a body still to come, which may be refused): an island or
        registration taken as registered from the upload (``_adopt_unknown``,
        ``_adopt_registration``) is only checked for, and (None, None) returned: taken
        before the body was, a refused body had superseded the island's live launch and
        dropped its waiting contributions."""
        isl = self._islands.get(h.island)
        if isl is None and h.run == self.run_id:
            if not adopt:
                _check_adoptable(h)
                _check_base_version(h, fs)
                return None, None
            isl = self._adopt_unknown(h, now)
        elif isl is None:
            raise CoordinatorError(404, f"unknown island {h.island!r}: register it first")
        else:
            _check_run("upload", h.island, h.run, self.run_id)
        if h.incarnation > isl.registrations:
            if not adopt:  # its record starts over then: nothing of the present one applies
                _check_base_version(h, fs)
                return None, None
            self._adopt_registration(isl, h, now)
        if isl.left_at is not None:
            raise CoordinatorError(410, f"island {h.island!r} left the run: register again")
        # First: a superseded launch must hear so (and stop), even with another world size.
        _check_incarnation("upload", isl, h.incarnation)
        if h.world_size != isl.world_size:
            raise CoordinatorError(
                422,
                f"island {h.island!r} registered with world size {isl.world_size}, "
                f"the upload says {h.world_size}",
            )
        last = isl.uploads.get((h.fragment, h.rank))
        if last is not None and h.step <= last:
            raise CoordinatorError(
                409,
                f"replayed upload: island {h.island!r} rank {h.rank} already sent fragment "
                f"{h.fragment} at step {last}; this one is for step {h.step}",
            )
        _check_base_version(h, fs)
        cur = fs.assembling.get(h.island)
        if cur is not None and cur.step == h.step and cur.counters() != self._counters(h):
            raise CoordinatorError(
                409,
                f"counters disagree for island {h.island!r} fragment {h.fragment} step "
                f"{h.step}: (world_size, base_version, tokens, steps, final) = "
                f"{self._counters(h)} but earlier ranks sent {cur.counters()}",
            )
        return isl, cur

    def _begin(self, h: wire.UploadHeader, fs: FragmentState, zeros: set[str]) -> Ingest:
        """Where this rank's slices go: its part of the row its island's ranks' uploads
        for this step land in (the contribution's row once one is taken in)."""
        with self._lock:
            _, cur = self._admit(h, fs, self.clock(), adopt=False)  # adopted once the body is in
            landing = fs.landings.get((h.island, h.incarnation, h.step))
            if landing is not None and h.rank in landing.ranks:
                raise CoordinatorError(
                    409,
                    f"replayed upload: island {h.island!r} rank {h.rank} is sending fragment "
                    f"{h.fragment} for step {h.step} already (that body is still coming in)",
                )
            same = cur is not None and cur.step == h.step
            landing = fs.land(h.island, h.incarnation, h.step, h.rank, cur.row if same else None)
        ranges = self._ranges(fs, h.world_size, h.rank)
        parts = {
            seg.name: landing.row[seg.offset + a : seg.offset + b]
            for seg, (a, b) in zip(fs.segments, ranges)
        }
        return Ingest(h, landing, parts, zeros)

    def _finish(self, ing: Ingest, sq: torch.Tensor) -> dict:
        """Take in an upload whose slices are in place and checked: asked again whether it
        is refused (its island may have left or registered again meanwhile), then counted
        in, or dropped (stale, superseded)."""
        h = ing.header
        fs = self._frags[h.fragment]
        now = self.clock()
        with self._lock:
            try:
                isl, cur = self._admit(h, fs, now)
                # Accepted from here on: nothing below refuses.
                isl.uploads[(h.fragment, h.rank)] = h.step
                isl.last_seen = now
                if h.final:  # done training: no round waits for it, its results are not needed
                    isl.finishing = True
                    self._finishing_contributions(h.island)
                if h.step > isl.last_step:
                    if isl.last_step_at is not None and isl.last_step > 0:
                        isl.step_time.update((now - isl.last_step_at) / (h.step - isl.last_step))
                    isl.last_step, isl.last_step_at = h.step, now
                weight, why = self._weight(h, fs.version)
                if weight == 0.0:
                    isl.count_dropped(h.fragment, h.step, h.steps)
                    opened = fs.opened_at.get(h.base_version + 1)
                    if h.base_version == fs.version - 1 and opened is not None:
                        # One round late: how long after that round's first contribution it
                        # came; the island sends that much earlier from now on, into the
                        # round (FragmentSyncer phase shift). Further behind: no phase to read.
                        late = round(max(now - opened, 0.0), 4)
                        return self._reply("dropped", fs, why, late_s=late)
                    return self._reply("dropped", fs, why)
                if cur is not None and cur.step > h.step:
                    isl.count_dropped(h.fragment, h.step, h.steps)
                    return self._reply(
                        "dropped", fs, f"superseded by step {cur.step} of this island"
                    )
                if cur is None or cur.step < h.step:
                    if cur is not None:  # a newer pseudo-gradient subsumes an unfinished older one
                        fs.give_row(cur.row)
                        isl.count_dropped(h.fragment, cur.step, cur.steps)
                    row = ing.landing.row  # where the ranks' slices were read: no copy
                    if fs.released(row):  # a contribution that held it was dropped meanwhile
                        row = fs.take_row()
                        self._copy_part(fs, h, ing, row)
                    else:
                        ing.landing.adopted = True
                    cur = Contribution(
                        island=h.island,
                        world_size=h.world_size,
                        base_version=h.base_version,
                        step=h.step,
                        tokens=h.tokens,
                        steps=h.steps,
                        row=row,
                        sq_norms=torch.zeros(len(fs.segments), dtype=torch.float64),
                        incarnation=h.incarnation,
                        final=bool(h.final),
                    )
                    fs.assembling[h.island] = cur
                elif cur.row is not ing.landing.row:  # the same: a new row took its place
                    self._copy_part(fs, h, ing, cur.row)
                cur.sq_norms += sq
                cur.ranks.add(h.rank)
                complete = len(cur.ranks) == cur.world_size
                if complete:
                    del fs.assembling[h.island]
                    per_step = cur.norm() / cur.steps
                    outlier = norm_outlier(per_step, fs.recent_norms, self.cfg.norm_guard)
                    if outlier:  # never merged: its steps are lost, as a stale upload's are
                        fs.give_row(cur.row)
                        isl.count_dropped(h.fragment, cur.step, cur.steps)
                        log.warning("island %s fragment %d step %d %s", h.island, h.fragment,
                                    h.step, outlier)  # fmt: skip
                        return self._reply("dropped", fs, outlier)
                    fs.recent_norms.append(per_step)  # the window's oldest falls out
                    cur.complete_at = now
                    cur.final = cur.final or isl.finishing  # sent before its final flush began
                    old = fs.complete.pop(h.island, None)
                    if old is not None:  # the island's newer pseudo-gradient replaces its older one
                        fs.give_row(old.row)
                        isl.count_dropped(h.fragment, old.step, old.steps)
                    fs.complete[h.island] = cur
                return self._reply("accepted", fs, why, complete=complete, weight=weight)
            finally:
                fs.leave(ing.landing, h.rank)

    def _finishing_contributions(self, island: str) -> None:
        """``island``'s contributions waiting in rounds count as its final flush once that
        began (``_lock`` held). The flush does not send a fragment again for a step already
        sent (a replay), so the upload of its last step went out without the flag; it
        closed its round alone once the island counted as finishing, and another island's
        upload for that round came stale."""
        for fs in self._frags:
            c = fs.complete.get(island)
            if c is not None:
                c.final = True

    def _copy_part(self, fs: FragmentState, h: wire.UploadHeader, ing: Ingest, row) -> None:
        """This rank's slices from where they were read into ``row``."""
        for seg, (a, b) in zip(fs.segments, self._ranges(fs, h.world_size, h.rank)):
            row[seg.offset + a : seg.offset + b].copy_(ing.parts[seg.name])

    @staticmethod
    def _counters(h: wire.UploadHeader) -> tuple[int, int, int, int, int]:
        return (h.world_size, h.base_version, h.tokens, h.steps, h.final)

    @staticmethod
    def _reply(status: str, fs: FragmentState, reason: str, **extra) -> dict:
        return {"status": status, "reason": reason, "version": fs.version, **extra}

    def _weight(self, c: wire.UploadHeader | Contribution, version: int) -> tuple[float, str]:
        """Token weight with the staleness policy applied, against ``version``."""
        if c.tokens == 0:
            return 0.0, "no tokens trained since the last sync"
        return staleness_weight(
            token_weight(c.tokens, c.steps), version - c.base_version, self.cfg.staleness
        )

    def _fragment(self, index: int) -> FragmentState:
        if not 0 <= index < len(self._frags):
            raise CoordinatorError(404, f"unknown fragment {index}: there are {len(self._frags)}")
        return self._frags[index]

    @staticmethod
    def _ranges(fs: FragmentState, world_size: int, rank: int):
        return [shard_range(s.numel, world_size, rank) for s in fs.segments]

    @staticmethod
    def _zero_names(h: wire.UploadHeader, frag: Fragment, tensors) -> set[str]:
        """The slices the upload says it left out as all zero (``zeros``), checked."""
        names = h.zero_names()
        unknown = sorted(set(names) - set(frag.names))
        if unknown:
            raise CoordinatorError(
                422, f"'zeros' lists slices that fragment {frag.index} does not have: {unknown[:5]}"
            )
        both = sorted(n for n in names if n in tensors)
        if both or len(set(names)) != len(names):
            raise CoordinatorError(
                422,
                f"'zeros' lists a slice twice, or one the body holds too: {(both or names)[:5]}",
            )
        return set(names)

    def _decompress(
        self, h: wire.UploadHeader, frag: Fragment, tensors, meta, zeros: set[str]
    ) -> dict:
        """The float32 slices of a compressed upload (``compress.to_wire``); plain ones as sent.

        Nothing is decoded before the slices' declared shapes have passed the plan's
        checks, so a body cannot make the coordinator allocate more than a real upload.
        """
        if not _compressed(meta, tensors):
            return tensors
        who = f"island {h.island!r} rank {h.rank} fragment {h.fragment}"
        try:
            encoded = compress.from_wire(tensors, meta)
        except ValueError as e:
            raise CoordinatorError(400, f"malformed compressed upload from {who}: {e}") from None
        shapes = {n: torch.empty(e.shape, device="meta") for n, e in encoded.items()}
        self._check_shape(h, frag, shapes, zeros)
        try:
            return {n: compress.decode(e) for n, e in encoded.items()}
        except ValueError as e:
            raise CoordinatorError(422, f"bad compressed values from {who}: {e}") from None

    def _check_shape(
        self, h: wire.UploadHeader, frag: Fragment, slices, zeros: set[str] = frozenset()
    ) -> None:
        """Counters in range; the body holds every slice of the fragment but ``zeros``, each
        F32 of this rank's length."""
        if not 0 <= h.rank < h.world_size:
            raise CoordinatorError(422, f"rank {h.rank} is outside world size {h.world_size}")
        if h.step < 1 or h.steps < 1 or h.tokens < 0 or h.base_version < 0:
            raise CoordinatorError(
                422,
                f"counters out of range: step {h.step} and steps {h.steps} must be >= 1, "
                f"tokens {h.tokens} and base_version {h.base_version} must be >= 0",
            )
        big = [f"{n} {getattr(h, n)}" for n in ("step", "steps", "tokens", "base_version",
               "incarnation", "world_size") if getattr(h, n) > MAX_COUNTER]  # fmt: skip
        if big:
            raise CoordinatorError(422, f"counters out of range: {', '.join(big)} over 2**53")
        if h.steps > h.step:
            raise CoordinatorError(
                422, f"steps {h.steps} since the last sync exceed the island's step {h.step}"
            )
        names = set(frag.names) - zeros
        missing, extra = sorted(names - set(slices)), sorted(set(slices) - names)
        if missing or extra:
            raise CoordinatorError(
                422,
                f"fragment {frag.index} slices do not match the plan: missing {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}",
            )
        for p in frag.params:
            if p.name in zeros:
                continue
            t = slices[p.name]
            want = shard_numel(p.numel, h.world_size, h.rank)
            if t.dtype != torch.float32:
                raise CoordinatorError(422, f"slice {p.name!r} has dtype {t.dtype}, expected F32")
            if t.dim() != 1 or t.numel() != want:
                raise CoordinatorError(
                    422,
                    f"slice {p.name!r} has shape {list(t.shape)}, expected [{want}] for rank "
                    f"{h.rank} of world size {h.world_size} (no padding)",
                )

    @staticmethod
    def _check_values(fs: FragmentState, slices, h) -> torch.Tensor:
        """Squared norms per tensor slice; a non-finite sum means NaN/Inf somewhere."""
        sq = torch.zeros(len(fs.segments), dtype=torch.float64)
        for i, seg in enumerate(fs.segments):
            if seg.name in slices:  # a slice listed in ``zeros`` is not: its norm is 0
                sq[i] = sq_norm(slices[seg.name])
        if not torch.isfinite(sq).all():
            bad = next(
                s.name
                for s, v in zip(fs.segments, sq.tolist())
                if not torch.isfinite(torch.tensor(v))
            )
            raise CoordinatorError(
                422,
                f"slice {bad!r} from island {h.island!r} rank {h.rank} {wire.NOT_FINITE}, or "
                "values whose squares overflow float32 (|x| > 1.8e19)",
            )
        return sq

    # ---------------------------------------------------------------- downloads
    def opened_ago(self, fragment: int, version: int) -> float | None:
        """Seconds since the round that made ``version`` of ``fragment`` got its first
        contribution; None if not kept (the first version, or an old one)."""
        opened = self._fragment(fragment).opened_at.get(version)
        return None if opened is None else round(max(self.clock() - opened, 0.0), 4)

    def download(
        self,
        fragment: int,
        world_size: int,
        rank: int,
        after: int | None = None,
        keep: str = "",
        epoch: str = "",
    ) -> tuple[int, wire.Body | None]:
        """(version, safetensors body) of the slices that ``rank`` of ``world_size`` owns;
        the body is None if the version is not newer than ``after``.

        ``keep`` (a :func:`wire.keep_mask`): slices the island holds at version ``after``
        of this process (``epoch``) and keeps if they have not changed since: those are
        left out of the body and named in its ``unchanged`` (frozen parameters: most of
        a fine-tuned model may never change).

        The body's parts alias the served values (they never change): send them as
        they are. Cheap enough for the event loop: no lock, no copy of the values.
        """
        fs = self._fragment(fragment)
        if world_size < 1 or not 0 <= rank < world_size:
            raise CoordinatorError(422, f"rank {rank} is outside world size {world_size}")
        try:
            kept = wire.parse_keep_mask(keep, len(fs.segments)) if keep else []
        except wire.WireError as e:
            raise CoordinatorError(400, f"download of fragment {fragment}: {e}") from None
        served = fs.served  # one read: version, values and bodies belong together
        if after is not None and served.version <= after:
            return served.version, None
        if after is None or epoch != self.epoch:
            kept = []  # not this process's version: nothing is known unchanged
        left_out = tuple(i for i in kept if served.changed_at[i] <= after)
        body = served.bodies.get((world_size, rank, left_out))
        if body is None:
            omitted, ranges = set(left_out), self._ranges(fs, world_size, rank)
            slices = {  # cut from served.data: the body keeps the version's buffer alive
                s.name: torch.from_numpy(served.data[s.offset + a : s.offset + b])
                for i, (s, (a, b)) in enumerate(zip(fs.segments, ranges))
                if i not in omitted
            }
            header = wire.FragmentHeader(
                fragment=fragment, version=served.version, world_size=world_size, rank=rank,
                epoch=self.epoch, unchanged=",".join(fs.segments[i].name for i in left_out),
            )  # fmt: skip
            body = wire.fragment_parts(header, slices)
            if len(served.bodies) < _MAX_CACHED_BODIES:  # bounded, whatever clients ask
                served.bodies[(world_size, rank, left_out)] = body
        self.traffic["download_bytes"] += len(body)
        self.traffic["unchanged_bytes"] += 4 * sum(
            shard_numel(fs.segments[i].numel, world_size, rank) for i in left_out
        )
        return served.version, body

    def touch(self, island: str, run: str = "", what: str = "poll") -> None:
        """A download or poll from ``island`` (""; none named) renews its lease. ``run`` (its
        run's id, if given): a process of another run's island of the same name is refused
        (``what``), as its uploads are, and renews nothing."""
        _check_run(what, island, run, self.run_id)
        if not island:
            return
        with self._lock:
            isl = self._islands.get(island)
            if isl is not None:
                isl.last_seen = self.clock()

    # ------------------------------------------------------------------- rounds
    def round_state(self, index: int, now: float) -> RoundState:
        fs = self._frags[index]
        live = self._live_islands(now)
        # The quorum's clock runs on the contributions that may close the round.
        times = sorted(c.complete_at for c in fs.complete.values() if not c.final)
        finals = [c.complete_at for c in fs.complete.values() if c.final]
        finishing = sum(  # their final flush under way, not in this round (yet)
            1 for name, isl in self._islands.items()
            if isl.finishing and name not in fs.complete and self._holds_lease(isl, now)
        )  # fmt: skip
        quorum = max(1, min(self.cfg.policy.min_quorum, live))
        lapsed = sum(  # counted in the quorum, not as live islands in
            1 for name, c in fs.complete.items()
            if not c.final and not self._is_live(self._islands[name], now)
        )  # fmt: skip
        return RoundState(
            live_islands=live,
            contributors=len(fs.complete),
            passive=len(finals),
            lapsed=lapsed,
            finishing=finishing,
            first_final=min(finals, default=None),
            first_arrival=times[0] if times else None,
            quorum_at=times[quorum - 1] if len(times) >= quorum else None,
            xi_step=self._fastest_step_s(),  # the fastest island must not wait
            xi_quorum=self._xi_quorum.value,
            xi_sync=self._xi_sync.value,
            expected=self._expected(fs, now) if self.cfg.policy.wait_expected_steps else (),
        )

    def _expected(self, fs: FragmentState, now: float) -> tuple[float, ...]:
        """When each live island not yet in ``fs``'s round should upload it: its last
        upload of the fragment + H steps, timed from its latest step and step time."""
        out = []
        for name, isl in self._islands.items():
            if name in fs.complete or not self._is_live(isl, now):
                continue
            if name in fs.assembling:  # some of its ranks are in: the rest are on the way
                out.append(now)
                continue
            sent = isl.uploads.get((fs.fragment.index, 0))
            pace = isl.step_time.value
            if sent is None or not pace or isl.last_step_at is None:
                continue  # no pace or schedule known yet: not waited for
            at = isl.last_step_at + (sent + self.cfg.sync_every - isl.last_step) * pace
            if at >= now - pace:  # long overdue: it skipped that send, or stalled
                out.append(at)
        return tuple(out)

    def decide(self, index: int, now: float | None = None) -> Decision:
        now = self.clock() if now is None else now
        with self._lock:
            return self._decide(index, now)

    def _decide(self, index: int, now: float) -> Decision:
        """:meth:`decide` with ``_lock`` held."""
        held = self._held(self._frags[index], now)
        return held or decide(now, self.round_state(index, now), self.cfg.policy)

    @staticmethod
    def _held(fs: FragmentState, now: float) -> Decision | None:
        """Why ``fs``'s round may not close now, whatever the policy says; None: it may."""
        if fs.merging:
            return Decision(False, None, "merge in progress")
        if fs.retry_at is not None and now < fs.retry_at:
            return Decision(False, fs.retry_at,
                            f"backing off after {fs.failures_in_a_row} failed merge(s) in a row")  # fmt: skip
        return None

    def poll(self, index: int, save: bool = True) -> Decision:
        """Merge fragment ``index`` if its round should close now; returns the decision.

        A merge that fails changes nothing (see :meth:`_merge`): its contributions go
        back into the round, which may close again after a backoff (:meth:`_merge_failed`);
        the decision returned then says so. ``save``: then the periodic save, if due
        (:meth:`save_if_due`; the server runs it once the merge's long polls are answered)."""
        fs = self._frags[index]
        now = self.clock()
        with self._lock:
            held = self._held(fs, now)
            if held is not None:
                return held
            state = self.round_state(index, now)
            decision = decide(now, state, self.cfg.policy)
            if not decision.merge:
                return decision
            contribs = list(fs.complete.values())
            fs.complete.clear()
            fs.merging = True
            version = fs.version
        error = None
        try:
            self._merge(fs, contribs, version, state, decision, now)
        except Exception as e:  # taken in below: the round loop must not retry it at once
            if fs.version != version:  # served: taking the contributions again would apply
                raise  # them twice (a bug in the bookkeeping after the publish)
            error = e
        finally:
            with self._lock:
                fs.merging = False
                if error is None:
                    fs.failures_in_a_row, fs.retry_at = 0, None
                    for c in contribs:
                        fs.give_row(c.row)
                else:
                    decision = self._merge_failed(fs, contribs, version, error)
        if error is None and save:
            self.save_if_due()
        return decision

    def save_if_due(self) -> None:
        """The periodic save, once ``save_every_merges`` merges were made since the last."""
        if self._merges_since_save < self.cfg.save_every_merges:
            return
        try:  # the merges are done and served: a failed save is not a failed merge
            self.save()
        except Exception:  # the counter is not reset: the next merge tries again
            log.exception("versions %s merged, but the periodic save failed", self.versions())

    def _merge_failed(self, fs, contribs, version: int, error: Exception) -> Decision:
        """Count a failed merge, put its contributions back into the round and hold the
        round for a backoff (with ``_lock`` held). Back: what the merge would have
        taken had it come now. Dropped: a contribution in ``MERGE_ATTEMPTS`` failed
        merges, and one whose island left, registered again or sent a newer one meanwhile."""
        index = fs.fragment.index
        fs.merge_failures += 1
        fs.failures_in_a_row += 1
        backoff = min(MERGE_RETRY_S * 2 ** (fs.failures_in_a_row - 1), MERGE_RETRY_MAX_S)
        fs.retry_at = self.clock() + backoff
        back, given_up = [], []
        for c in contribs:
            c.failed += 1
            isl = self._islands.get(c.island)
            if (
                isl is None
                # A final flush stays when its island leaves, as in a round (it was lost)
                or (isl.left_at is not None and not c.final)
                or isl.registrations != c.incarnation
                or c.island in fs.complete  # its newer one came meanwhile, and replaces it
                or self._weight(c, version)[0] == 0  # weighed out (counted by _merge)
            ):  # dropped as if it had been waiting in the round
                fs.give_row(c.row)
                self._count_dropped(fs, c)
            elif c.failed >= MERGE_ATTEMPTS:
                fs.give_row(c.row)
                self._count_dropped(fs, c)
                given_up.append(f"{c.island} step {c.step}")
            else:
                fs.complete[c.island] = c
                back.append(c.island)
        why = f"{type(error).__name__}: {error}"
        log.error("fragment %d: merge to v%d of %s failed (%d in a row), nothing changed; "
                  "%s back in the round, next try in %.0f s", index, version + 1,
                  ",".join(sorted(c.island for c in contribs)), fs.failures_in_a_row,
                  ",".join(sorted(back)) or "none", backoff, exc_info=error)  # fmt: skip
        if given_up:
            log.error("fragment %d: dropped after %d failed merges: %s", index, MERGE_ATTEMPTS,
                      ", ".join(sorted(given_up)))  # fmt: skip
        fs.last_failure = {
            "version": version + 1,
            "error": why,
            "in_a_row": fs.failures_in_a_row,
            "islands": sorted(c.island for c in contribs),
            "back": sorted(back),
            "dropped": sorted(given_up),
            "backoff_s": backoff,
        }
        return Decision(False, fs.retry_at, f"merge failed ({why}); next try in {backoff:.0f} s")

    def _merge(self, fs, contribs, version, state: RoundState, decision: Decision, now) -> None:
        t0 = time.perf_counter()
        weighed = [self._weight(c, version) for c in contribs]
        weights = torch.tensor([w for w, _ in weighed], dtype=torch.float64)
        sq = torch.stack([c.sq_norms for c in contribs])
        reasons = {c.island: why for c, (_, why) in zip(contribs, weighed)}
        with self._lock:  # weighed out now (a policy on time or staleness): never merged
            for c, (w, _) in zip(contribs, weighed):
                if w == 0:
                    self._count_dropped(fs, c)
        if weights.sum() <= 0:
            log.info("fragment %d: round closed with only stale contributions", fs.fragment.index)
            return
        counted = [c for c, (w, _) in zip(contribs, weighed) if w > 0]
        # L2 norms (monitoring: an island whose training diverges shows here first). One
        # counted contribution: the merge is its row, whose norm the upload checks computed.
        norms = {c.island: c.norm() for c in contribs}
        # Segments whose merged pseudo-gradient was 0 (frozen everywhere) may not move:
        # downloads leave those out for islands that keep them.
        quiet = (sq[weights > 0].sum(0) == 0).tolist()
        # The merged pseudo-gradient's buffer, for this merge only (one contribution: its row).
        out = fs.take_row() if len(counted) > 1 else None
        try:
            grad = merge_fragment([c.row for c in contribs], weights, fs.segments, fs.rda,
                                  sq_norms=sq, out=out)  # fmt: skip
            merged_norm = (
                norms[counted[0].island] if len(counted) == 1 else math.sqrt(sq_norm(grad))
            )
            self._step_and_publish(fs, version, grad, quiet, merged_by_after(fs.merged_by, counted))
        finally:
            if out is not None:
                fs.give_row(out)
        fs.opened_at[version + 1] = now if state.first_arrival is None else state.first_arrival
        fs.opened_at.pop(version + 1 - OPENED_AT_KEPT, None)
        sync = time.perf_counter() - t0
        reason = decision.reason  # formatted here once (a lazy round_policy.Why), stored and logged
        with self._lock:
            self._round_clock = (
                self.send_schedule.position(fs.fragment.index),
                fs.opened_at[version + 1],
            )
            fs.merges, fs.merges_at = fs.merges + 1, version + 1
            self._merges_since_save += 1
            self._xi_sync.update(sync)
            if state.quorum_at is not None and state.first_arrival is not None:
                self._xi_quorum.update(state.quorum_at - state.first_arrival)
            self.metrics.merge(now_wall=time.time(), contributors=len(counted),
                               staleness=[version - c.base_version for c in counted])  # fmt: skip
            for c in counted:
                isl = self._islands.get(c.island)
                if isl is not None:
                    isl.merged += 1
                    isl.tokens_merged += c.tokens
                    isl.steps_merged += c.steps
            fs.last_merge = {
                "version": version + 1,
                "islands": sorted(c.island for c in contribs),
                "weights": {c.island: w for c, (w, _) in zip(contribs, weighed)},
                "staleness": reasons,
                "reason": reason,
                "seconds": sync,
                "pseudo_gradient_norm": merged_norm,
                "norms": norms,
            }
            if self.cfg.staleness.mode == "drop":  # what arrived during the merge is stale now
                for table in (fs.assembling, fs.complete):
                    for island, c in list(table.items()):
                        if c.base_version < fs.version:
                            del table[island]
                            fs.give_row(c.row)
                            self._count_dropped(fs, c)
        log.info(
            "fragment %d -> v%d from %s (%s) in %.3fs",
            fs.fragment.index,
            version + 1,
            ",".join(sorted(c.island for c in contribs)),
            reason,
            sync,
        )

    def _step_and_publish(self, fs, version: int, grad, quiet: list[bool], merged_by) -> None:
        """The outer step on a copy of the served values, made durable (or its version
        reserved) and published as ``version + 1``: all or nothing."""
        values = fs.copy_values()  # the served values stay as they are for the downloads
        before, lent = self._copy_outer_state(fs)  # the step writes the momentum in place
        fs.lock.acquire_write()
        try:
            try:
                fs.optimizer.step(values, grad)
                changed_at = fs.changed_at(values, version + 1, quiet)
                if self.cfg.durable_merges:  # acknowledged = served = on disk (see _make_durable)
                    self._make_durable(fs, values, version + 1, merged_by)
                else:
                    self._reserve(fs.fragment.index, version + 1)
            except BaseException:  # all or nothing: the outer state as before, nothing served
                fs.optimizer.load_state_dict(before)  # (copies: the lent buffers go back)
                fs._recycle(values)
                raise
            fs.publish(version + 1, values, changed_at)
            fs.merged_by = merged_by
        finally:
            fs.lock.release_write()
            for buf in lent:
                self._buffers.give(buf)

    def largest_upload_bytes(self) -> int:
        """The largest upload body a valid island sends: the largest fragment whole in fp32
        (an island of one rank; compressed uploads are smaller), with room for a header
        (about 100 bytes a tensor; compression adds a few entries per tensor)."""
        return max(
            4 * f.numel + UPLOAD_HEADER_ROOM + 1024 * len(f.params) for f in self.plan.fragments
        )

    def _copy_outer_state(self, fs: FragmentState) -> tuple[dict, list[torch.Tensor]]:
        """A copy of ``fs``'s outer optimizer state, for a failed merge to put back, in
        buffers of the pool (no new pages per merge); and the buffers, to give back."""
        state, lent = {}, []
        for k, v in fs.optimizer.state_dict(False).items():
            if v.dim() == 0:  # counters
                state[k] = v.clone()
                continue
            buf = self._buffers.take_transient(v.numel())  # 1-D fp32, as every state vector
            lent.append(buf)
            state[k] = buf.copy_(v)
        return state, lent

    def _make_durable(
        self, fs: FragmentState, values: torch.Tensor, version: int, merged_by: dict
    ) -> None:
        """Write the merged fragment (values + outer optimizer state) before it is served.

        A version is acknowledged once an island can see it; with this, every
        acknowledged merge survives a crash. A failed write fails the merge, which
        then serves nothing and puts the outer state back (:meth:`_merge`): memory
        never runs ahead of the disk, and the round is tried again.
        """
        try:
            self.store.write_fragment(  # under the write lock: nothing changes while it writes
                fs.fragment.index, version, values, fs.optimizer.state_dict(False), merged_by
            )
        except BaseException:
            # The file may hold this unserved attempt: the next save writes the served state.
            fs.saved_version = -1
            raise
        fs.saved_version = version

    def _reserve(self, index: int, version: int) -> None:
        """Make ``version`` durable as reserved before anyone can see it.

        Versions never go backwards, even after a crash that lost the latest values:
        a restart resumes above every reserved number. Reserving a block at a time
        keeps the fsync off most merges; a clean shutdown gives back the unused rest.
        """
        with self._versions_lock:
            if version <= self._reserved[index]:
                return
            reserved = list(self._reserved)
            reserved[index] = version + VERSION_RESERVE - 1
            self.store.write_json("versions.json", {str(i): v for i, v in enumerate(reserved)})
            self._reserved = reserved  # only once durable: a failed write reserved nothing

    def schedule(self, wait: bool = True) -> tuple[list[int], float | None] | None:
        """The fragments whose round should close now, and the earliest time another
        waiting round may close (None: nothing else waits on a clock).

        ``wait=False``: None at once if the bookkeeping lock is busy, so that the
        event loop can ask without ever blocking on an upload's bookkeeping.
        """
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            now = self.clock()
            due, wake = [], None
            for i, fs in enumerate(self._frags):
                if fs.assembling:
                    self._drop_abandoned(fs, now)
                if not fs.complete:  # no contribution yet: nothing to merge or wait for
                    continue
                d = self._decide(i, now)
                if d.merge:
                    due.append(i)
                elif d.wait_until is not None:
                    wake = d.wait_until if wake is None else min(wake, d.wait_until)
        finally:
            self._lock.release()
        return due, wake

    # -------------------------------------------------------------- inspection
    def global_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the global parameters, full shapes (for tests and export)."""
        out = {}
        for fs in self._frags:
            served = fs.served  # never written in place (and held: not recycled): no lock
            for seg, spec in zip(fs.segments, fs.fragment.params):
                flat = served.values[seg.offset : seg.offset + seg.numel]
                out[seg.name] = flat.clone().view(spec.shape)
        return out

    def status(self) -> dict:
        now = self.clock()
        with self._lock:
            return {
                "versions": self.versions(),
                "merges": [fs.merges for fs in self._frags],
                "merge_failures": [fs.merge_failures for fs in self._frags],
                "num_fragments": len(self._frags),
                "signature": self.plan.signature,
                "islands": {
                    k: {
                        "world_size": v.world_size,
                        "live": self._is_live(v, now),
                        "left": v.left_at is not None,
                        "finishing": v.finishing,
                        "registrations": v.registrations,
                        "steps_merged": v.steps_merged,
                        "steps_dropped": v.steps_dropped,
                        "last_seen_s": round(now - v.last_seen, 3),
                        "last_step": v.last_step,
                        "step_time_s": v.step_time.value,
                        "merged": v.merged,
                        "dropped": v.dropped,
                        "tokens_merged": v.tokens_merged,
                    }
                    for k, v in self._islands.items()
                },
                "pending": {
                    str(i): {
                        "complete": sorted(fs.complete),
                        "assembling": {k: sorted(c.ranks) for k, c in fs.assembling.items()},
                        "receiving": fs.receiving(),
                    }
                    for i, fs in enumerate(self._frags)
                    if fs.complete or fs.assembling or fs.landings
                },
                "last_merge": {
                    str(i): fs.last_merge for i, fs in enumerate(self._frags) if fs.last_merge
                },
                "last_merge_failure": {
                    str(i): fs.last_failure for i, fs in enumerate(self._frags) if fs.last_failure
                },
                "xi_quorum_s": self._xi_quorum.value,
                "xi_sync_s": self._xi_sync.value,
                "traffic": dict(self.traffic),
                "buffers": self._buffers.usage(),
                "run": self._run_metrics(),
            }

    def _run_metrics(self) -> dict:
        """Goodput, uptime and the merge counters (called with ``_lock`` held)."""
        wall = time.time()
        times = [
            IslandTime(k, v.steps_merged, v.step_time.value, v.joined_at, v.left_at)
            for k, v in self._islands.items()
        ]
        return {
            "goodput": goodput(times, len(self._frags), wall),
            "uptime": self.metrics.uptime(wall),
            "by_quorum": dict(self.metrics.by_quorum),
            "by_staleness": dict(self.metrics.by_staleness),
            "uptime_window_s": self.metrics.window_s,
        }
