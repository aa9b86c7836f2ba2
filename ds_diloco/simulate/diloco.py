"""Decoupled DiLoCo with M islands: every inner step of every island is an event.

Each island is an elastic data-parallel group of whole slices (the same pause
costs as the elastic baseline) that never waits for the others. After inner
step s it sends fragment (k / stride - 1) mod P if its clock k = s + phase is a
multiple of stride = H/P, as ``fragments.Schedule.due(s + phase)`` says (phase: 0
unless phase alignment moved it, below). The coordinator closes each fragment's
round by calling ``round_policy.decide`` -- the coordinator's own function, looked
up at call time -- at every counted arrival and at every deadline it asks for.

Accounting (goodput):
- An island's step adds live chips x chip_step_s chip-seconds (a shorter step: only as
  much as makes up for the island's earlier waits for its slowest chip), 1/P to each
  fragment.
  A contribution carries what its fragment gathered since the island last sent
  it, and counts once merged. With H = P the sends tile every step, so a run
  without failures or jitter is 100 % goodput; the tau-step overlap is a
  question of model quality, not of chip-time.
- A contribution whose base version is older than the fragment's current one is
  stale and dropped (the paper's rule).
- An island that resumes after a pause takes the global value of every fragment
  merged meanwhile (its own work on those is lost) and rejoins the fleet's
  schedule at the leading island's next step boundary (it idles until then), so
  its uploads land in the same rounds as the others'.
- The rest of the chip-time is counted where it goes (``SystemResult.chip_time``):
  slices away, pauses, idling to rejoin, waits for the slowest chip, steps cut off,
  stale contributions, and work overwritten by fragments merged without the island
  -- which, a fragment missed being one with up to H steps of work on it, costs
  more than the pause that caused it.

Phase alignment (``SimConfig.align_phase``, the coordinator's default): island m sends
the fragment due at its clock s + phase[m]. An upload that comes one round late (stale,
its base the version before the current one) is timed as the coordinator times it,
from the first contribution of the round it missed; a send of a fragment that follows
a version merged without the island is timed from that version's round, as the
island's downloads say (if under H/2 steps). At the island's next agreement (a step
that sends or is due a result) ``round_policy.phase_shift`` -- the islands' own rule
-- says how many steps earlier it sends from then on; the fragments due at the clocks
passed over are not sent this cycle. A version merged without an island is out
``merge_s`` after the merge, and the island takes it if no upload of that fragment
waits for a result: its work on the fragment since its last send is overwritten. The
island applies it at its next agreement, overwriting the step in flight too; here it
is taken when out, so that step's work on the fragment is kept (1/P of a step per
version taken). If the fragment is due to be sent at the end of that step, it is
taken instead of sent.

Liveness: the coordinator counts an island as live while it holds a lease
(``island_timeout_s``, 20 s, renewed by heartbeats). A re-forming island keeps
heartbeating, so it stays live and a round it misses closes when its grace
window ends; only an island left without a healthy slice stops being live.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque

import numpy as np

from ds_diloco import round_policy
from ds_diloco.round_policy import Ema, PhaseShift, RoundState
from ds_diloco.simulate.config import SimConfig
from ds_diloco.simulate.result import CHIP_TIME, SystemResult
from ds_diloco.simulate.trace import EULER_GAMMA, Trace, slowest_chip

IN, AWAY, BACK = 0, 1, 2  # slice: in its island / away for repair / repaired, not yet rejoined
RUN, PAUSE, WAIT, DEAD = 0, 1, 2, 3  # island: training / re-forming / idle until the fleet's
# next step boundary / no healthy slice left
RESUME, START, DEADLINE, PUBLISH = 1, 2, 3, 4  # events in _Sim.heap (step ends are in
# _Sim.steps); deadlines and publishes are taken in the hot loop, the others in run()
DRAW_BLOCK = 1 << 16  # step-time draws taken from the generator at a time
_NO_EVENT = (math.inf, math.inf, -1, -1)  # after every event: an empty queue
_NO_SEGMENT = (math.inf, -math.inf)  # holds no time: no step has completed yet


def simulate_diloco(cfg: SimConfig, trace: Trace) -> SystemResult:
    sim = _Sim(cfg, trace)
    sim.run(trace)
    return sim.result(len(trace))


class _Sim:
    def __init__(self, cfg: SimConfig, trace: Trace) -> None:
        self.cfg = cfg
        M, P, n = cfg.islands, cfg.num_fragments, cfg.slices
        self.M, self.P, self.S = M, P, cfg.chips_per_slice
        self.step_s = cfg.chip_step_s  # one chip's mean step at this size (read per step)
        self.cv = cfg.step_cv
        self.stride = cfg.sync_every // P
        self.opts = cfg.policy
        self.island_of = [j * M // n for j in range(n)]  # contiguous blocks of slices
        self.state = bytearray(n)
        self.back: list[set[int]] = [set() for _ in range(M)]
        self.returns: deque[tuple[float, int]] = deque(trace.away)  # equal repair times: FIFO
        self.live = [0] * M  # chips in each island's group
        for m in self.island_of:
            self.live[m] += self.S
        for _, j in trace.away:
            self.state[j] = AWAY
            self.live[self.island_of[j]] -= self.S
        self.mode = [RUN] * M
        self.gen = [0] * M  # bumped to cancel an island's scheduled events
        self.idx = [1] * M  # the step in flight (RUN) or the next one (otherwise)
        self.start = [0.0] * M
        self.end = [0.0] * M
        self.upscale = [False] * M
        self.target = [0] * M  # WAIT: the step to start at the fleet's boundary
        self.wait_at = [0.0] * M  # WAIT: when it starts
        self.cum = [0.0] * M  # chip-seconds trained by each island
        self.waited = [0.0] * M  # each island's straggler chip-seconds (>= 0, see _steps)
        self.mark = [[0.0] * P for _ in range(M)]  # cum at the last send (or refresh) of p
        self.base = [[0] * P for _ in range(M)]  # version of p the island trains on
        self.applyq: list[deque[tuple[int, int]]] = [deque() for _ in range(M)]
        self.pending: list[list[tuple[int, int]]] = [[] for _ in range(M)]  # (p, round id)
        self.step_ema = [Ema() for _ in range(M)]
        self.ema_update = [e.update for e in self.step_ema]
        self.ema_val = [math.inf] * M  # their values (inf: none yet), for xi_step
        self.version = [0] * P
        # Each open round's islands, by their place in it (r_cov, r_t): a dict, as every send
        # asks whether its island is in; a list's scan made a step cost O(M) (13x at M = 4096).
        self.r_isl: list[dict[int, int]] = [{} for _ in range(P)]
        self.r_cov: list[list[float]] = [[] for _ in range(P)]
        self.r_t: list[list[float]] = [[] for _ in range(P)]
        self.r_id = [0] * P
        self.r_deadline: list[float | None] = [None] * P
        self.xi_quorum, self.xi_sync = Ema(), Ema()
        self.xi_quorum_value: float | None = None  # their values, read at every decision
        self.xi_sync_value: float | None = None
        self._xi_step: float | None = None
        self._xi_at = -math.inf
        # Events by (time, push order): each island's step end, and the rest in a heap.
        # Steps end nearly in the order they start, so a sorted deque takes them cheaply.
        self.steps: deque[tuple[float, int, int, int]] = deque()  # (t, seq, island, gen)
        self.heap: list[tuple[float, int, int, int, int]] = []  # (t, seq, kind, a, b)
        self.seq = itertools.count()
        self.rng = np.random.default_rng([cfg.seed, 1])  # not the trace's stream
        self.draws: list[float] = []
        self.di = 0
        self.ls = [slowest_chip(n) for n in self.live]  # each island's slowest chip
        self.n_dead = 0  # islands without a healthy slice (not live for the coordinator)
        self.covered: list[list[float]] = []  # union of completed steps' [start, end]
        self.useful = 0.0
        # Phase alignment (see the module doc): each island's clock is its step + phase.
        self.align, self.H = cfg.align_phase, cfg.sync_every
        self.phase = [0] * M
        self.target_phase = [0] * M  # WAIT: the phase to start with at the fleet's boundary
        self.late: list[tuple[int, float] | None] = [None] * M  # (step, s) of a late upload
        self.shifted_at = [0] * M  # late uploads sent before this step predate the last shift
        # The last shift (its step, the phase before it, the shift): the fragments it
        # passed over miss the round held meanwhile, so the first upload of each since says
        # nothing of the phase (_passed_over).
        self.last_shift: list[tuple[int, int, PhaseShift] | None] = [None] * M
        # The version of each fragment the island last took without contributing to it (-1:
        # none), when, and when that version's round opened: a send from it is timed.
        self.took = [[-1] * P for _ in range(M)]
        self.took_t = [[0.0] * P for _ in range(M)]
        self.took_opened = [[0.0] * P for _ in range(M)]
        self.opened = [0.0] * P  # first contribution of the round that made version[p]
        self.pubs: deque[tuple[int, int, float, dict[int, int]]] = deque()  # merged, not out yet:
        # (p, version, its round's opening, its islands), out in this order (merge_s after)
        self.stats = dict.fromkeys(
            ("merges", "contributions", "stale", "downscales", "upscales", "rejoins",
             "phase_shifts", "shifted_steps"), 0,
        )  # fmt: skip
        self.spent = dict.fromkeys(CHIP_TIME, 0.0)  # chip-seconds by category, but useful
        self.sum_live, self.t_away = sum(self.live), 0.0  # chips in a group; counted up to
        self.t_mode = [0.0] * M  # each island's live chips counted by mode up to here
        for m in range(M):
            if self.live[m]:
                self._schedule_step(m, 0.0)
            else:
                self.mode[m] = DEAD
                self.n_dead += 1

    # ------------------------------------------------------------- chip-time
    def _tick(self, m: int, t: float) -> None:
        """Count island m's live chips since the last tick by its mode (a step's time is
        counted when it ends or is cut off), and the chips in no group. Called before
        every change of an island's mode or live chips."""
        mode = self.mode[m]
        if mode in (PAUSE, WAIT):
            self.spent["paused" if mode == PAUSE else "idle"] += self.live[m] * (t - self.t_mode[m])
        self.t_mode[m] = t
        self.spent["away"] += (self.cfg.used_chips - self.sum_live) * (t - self.t_away)
        self.t_away = t

    def _set_live(self, m: int, chips: int) -> None:
        self.sum_live += chips - self.live[m]
        self.live[m] = chips
        self.ls[m] = slowest_chip(chips)

    # ------------------------------------------------------------- time base
    def _draw(self, m: int) -> float:
        """Wall time of island m's next step: its slowest chip's (Gumbel limit). The hot
        loop (``_steps``) inlines this; both take the draws in one order."""
        if self.di == len(self.draws):
            self.draws, self.di = self._more_draws(), 0
        x = self.draws[self.di]
        self.di += 1
        l0, l1 = self.ls[m]
        y = 1 + self.cv * (l0 + l1 * x)
        return self.step_s * (y if y > 0.01 else 0.01)

    def _more_draws(self) -> list[float]:
        """The next block of standard Gumbel draws, less Euler's gamma (G - gamma)."""
        return (self.rng.gumbel(size=DRAW_BLOCK) - EULER_GAMMA).tolist()

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, a, b))

    def _schedule_step(self, m: int, t: float) -> None:
        self.start[m] = t
        e = self.end[m] = t + self._draw(m)
        bisect.insort(self.steps, (e, next(self.seq), m, self.gen[m]))

    # ---------------------------------------------------------------- rounds
    def _decide(self, p: int, now: float) -> None:
        times = self.r_t[p]
        c, live, k = len(times), self.M - self.n_dead, self.opts.min_quorum
        q = k if k < live else (live or 1)  # max(1, min(k, live)), as the policy caps it
        if now - self._xi_at >= self.step_s:
            # The coordinator's xi_step: the fastest island's step-time EMA. Refreshed
            # once a step of simulated time, not per call: it moves slowly.
            xi = min(self.ema_val)
            self._xi_step, self._xi_at = (xi if xi < math.inf else None), now
        state = RoundState(
            live_islands=live,
            contributors=c,
            first_arrival=times[0] if c else None,
            quorum_at=times[q - 1] if c >= q else None,
            xi_step=self._xi_step,
            xi_quorum=self.xi_quorum_value,
            xi_sync=self.xi_sync_value,
        )
        d = round_policy.decide(now, state, self.opts)
        if d.merge:
            self._merge(p, state, now)
        elif d.wait_until is not None and d.wait_until != self.r_deadline[p]:
            self.r_deadline[p] = d.wait_until
            self._push(d.wait_until, DEADLINE, p, self.r_id[p])

    def _merge(self, p: int, state: RoundState, now: float) -> None:
        self.useful += sum(self.r_cov[p])
        self.stats["merges"] += 1
        self.stats["contributions"] += len(self.r_cov[p])
        self.version[p] += 1
        if self.align and self.r_t[p]:  # the other islands take it once out (_publish)
            self.opened[p] = self.r_t[p][0]
            self.pubs.append((p, self.version[p], self.r_t[p][0], self.r_isl[p]))
            self._push(now + self.cfg.merge_s, PUBLISH, p, 0)
        self.xi_sync_value = self.xi_sync.update(self.cfg.merge_s)
        if state.quorum_at is not None and state.first_arrival is not None:
            self.xi_quorum_value = self.xi_quorum.update(state.quorum_at - state.first_arrival)
        self.r_isl[p], self.r_cov[p], self.r_t[p] = {}, [], []
        self.r_id[p] += 1
        self.r_deadline[p] = None

    # --------------------------------------------------------------- islands
    def _steps(self, until: float, horizon: float) -> None:
        """Take island steps and round deadlines in (time, push) order while they come no
        later than ``until`` (the next failure or repair: ``run`` takes a queued event
        first on a tie) and before ``horizon``; stop at a resume or a start (``run``'s).

        Every inner step of every island is one pass of this loop, so the step's
        bookkeeping is written out inline over locals: a method call or attribute
        lookup per line would cost more than the step's own arithmetic. The sums only
        this loop adds to (straggler, stale) are kept in locals, in the same order.
        """
        steps, heap, gen, live, ls, start, end, cum = (
            self.steps, self.heap, self.gen, self.live, self.ls, self.start, self.end, self.cum
        )  # fmt: skip
        idx, mark, base, applyq, pending, upscale = (
            self.idx, self.mark, self.base, self.applyq, self.pending, self.upscale
        )  # fmt: skip
        version, r_isl, r_cov, r_t, r_id = (
            self.version, self.r_isl, self.r_cov, self.r_t, self.r_id
        )  # fmt: skip
        ema, ema_val, seq, cov, waited = (
            self.ema_update, self.ema_val, self.seq, self.covered, self.waited
        )  # fmt: skip
        align, phase, late, took, took_t, took_opened, opened, shifted_at = (
            self.align, self.phase, self.late, self.took, self.took_t, self.took_opened,
            self.opened, self.shifted_at,
        )  # fmt: skip
        followed_late, H = round_policy.followed_late, self.H
        step_s, cv, P, stride, tau = self.step_s, self.cv, self.P, self.stride, self.cfg.overlap
        popleft, insort = steps.popleft, bisect.insort
        draws, di = self.draws, self.di
        straggler, stale, n_stale = (
            self.spent["straggler"],
            self.spent["stale"],
            self.stats["stale"],
        )
        last = until if until < horizon else math.nextafter(horizon, -math.inf)
        seg = cov[-1] if cov else _NO_SEGMENT
        queued = heap[0] if heap else _NO_EVENT  # the heap's next event, kept up to date
        while True:
            ev = steps[0] if steps else _NO_EVENT
            if queued < ev:  # a deadline, publish, resume or start comes first
                t, _, kind, p, rid = queued
                if t > last or kind < DEADLINE:
                    break
                heapq.heappop(heap)
                if kind == PUBLISH:
                    self._publish(t)
                elif rid == r_id[p]:  # fragment p's round is still the one that asked
                    self.r_deadline[p] = None
                    self._decide(p, t)
                queued = heap[0] if heap else _NO_EVENT
                continue
            t, _, m, g = ev
            if t > last:  # t > until or t >= horizon
                break
            popleft()
            if g != gen[m]:
                continue  # cancelled by a failure or a newer pause
            # Island m ends step s.
            a = start[m]
            ema_val[m] = ema[m](t - a)
            n = live[m]
            # A step counts at one chip's mean time; a group too small to wait for a slowest
            # chip (one chip) steps under the mean as often as over it, and a short step
            # makes up for the island's waits so far, never more: counted at the mean
            # whatever came before, a run of short steps put goodput over 1.
            x = n * (t - a - step_s)
            lag = waited[m] + x
            if lag >= 0:
                c = cum[m] = cum[m] + n * step_s
                straggler += x
                waited[m] = lag
            else:
                c = cum[m] = cum[m] + n * step_s + lag
                straggler -= waited[m]
                waited[m] = 0.0
            s = idx[m]
            if pending[m]:
                self._catch_up(m)
            q, bm = applyq[m], base[m]
            k = s + phase[m]  # the island's send clock (phase: 0 without alignment)
            if k % stride:
                p = -1
                due = q and q[0][0] <= s  # no send, a result due: the island agrees
            else:
                p = (k // stride - 1) % P  # the fragment it sends (due: not read)
            while q and q[0][0] <= s:  # self._apply(m, s)
                f = q[0][1]
                if m in r_isl[f]:
                    break
                q.popleft()
                bm[f] = version[f]
            if (
                align
                and (
                    late[m] is not None
                    or (  # a send from a version merged without it: taken now, or late?
                        p >= 0
                        and took[m][p] == bm[p]
                        and (
                            took_t[m][p] > a
                            or followed_late(t - took_opened[m][p], ema_val[m], H) is not None
                        )
                    )
                )
                and (p >= 0 or due)  # the island agrees at this step
                and self._align(m, s, t, p)
            ):
                p = -1  # taken at this step instead of sent
            if p >= 0:  # it sends fragment p
                mk = mark[m]
                sent = (c - mk[p]) / P
                mk[p] = c
                if bm[p] != version[p]:
                    n_stale += 1
                    stale += sent
                    # One round late: the coordinator says how long after the first
                    # contribution of the round it missed (the reply's late_s). Unless the
                    # last shift passed p over: its first upload since (sent by shifted_at,
                    # the first step the shift acts on again: round_policy.acts_on, inlined
                    # as at every stale send) misses the round held meanwhile.
                    if (
                        align
                        and s >= shifted_at[m]
                        and bm[p] == version[p] - 1
                        and (s > shifted_at[m] or not self._passed_over(m, p))
                    ):
                        late[m] = (s, max(t - opened[p], 0.0))
                elif m in r_isl[p]:  # sent again before its last send merged (after a jump)
                    r_cov[p][r_isl[p][m]] += sent
                else:
                    r_isl[p][m] = len(r_cov[p])
                    r_cov[p].append(sent)
                    r_t[p].append(t)
                    self._decide(p, t)
                    queued = heap[0] if heap else _NO_EVENT
                q.append((s + tau, p))
            idx[m] = s + 1
            if seg[0] <= a <= seg[1]:
                seg[1] = t  # self._cover(a, t), when it extends the newest segment
            else:
                self._cover(a, t)
                seg = cov[-1]
            if upscale[m]:
                self.stats["upscales"] += 1
                self._tick(m, t)
                self._pause(m, t, self.cfg.upscale_s)
                queued = heap[0]
                continue
            # self._schedule_step(m, t)
            start[m] = t
            if di == len(draws):
                draws, di = self._more_draws(), 0
            l0, l1 = ls[m]
            y = 1 + cv * (l0 + l1 * draws[di])
            di += 1
            e = end[m] = t + step_s * (y if y > 0.01 else 0.01)
            if not steps or e >= steps[-1][0]:
                steps.append((e, next(seq), m, g))  # the usual case: it ends last
            else:
                insort(steps, (e, next(seq), m, g))
        self.draws, self.di = draws, di
        self.spent["straggler"], self.spent["stale"], self.stats["stale"] = (
            straggler,
            stale,
            n_stale,
        )

    def _publish(self, t: float) -> None:
        """A merged version is out (``merge_s`` after its merge): every training island
        that did not contribute to it and has no upload of the fragment waiting for a
        result takes it (its work on the fragment since its last send is overwritten), as
        it would at its next agreement. One re-forming or idle takes every version merged
        meanwhile when it rejoins (``_begin``)."""
        p, v, opened, isl = self.pubs.popleft()
        mode, applyq, lost = self.mode, self.applyq, 0.0
        for m, bm in enumerate(self.base):
            if bm[p] >= v or m in isl or mode[m] != RUN:
                continue
            for _, f in applyq[m]:
                if f == p:
                    break  # its result brings the version
            else:  # self._refresh(m, p), and the island follows version v
                c, mk = self.cum[m], self.mark[m]
                lost += c - mk[p]
                mk[p], bm[p] = c, v
                self.took[m][p], self.took_t[m][p], self.took_opened[m][p] = v, t, opened
        if lost:
            self.spent["overwritten"] += lost / self.P

    def _align(self, m: int, s: int, t: float, p: int) -> bool:
        """Island m's agreement after step s (at t) with something late: a stale upload
        the coordinator timed, or the send of fragment p (-1: none) from a version merged
        without the island, timed from that version's round (``followed_late``). Moves
        the phase by ``phase_shift``, the islands' own rule. True: p's version came in
        during this step, so it is taken instead of sent."""
        taken_now = False
        late_step, late_s = self.late[m] or (0, 0.0)
        self.late[m] = None  # acted on now, or never (it predates the last shift)
        step_s = self.ema_val[m]
        if p >= 0 and self.took[m][p] == self.base[m][p]:
            taken_now = self.took_t[m][p] > self.start[m]  # out during this step
            opened_at = self.took_opened[m][p]
            followed = round_policy.followed_late(max(t - opened_at, 0.0), step_s, self.H)
            if followed is not None:
                late_step, late_s = s, followed
        if late_step:  # (nothing late: phase_shift would say None)
            shift = round_policy.phase_shift(
                s, late_step, late_s, step_s, self.shifted_at[m],
                sync_every=self.H, overlap=self.cfg.overlap,
            )  # fmt: skip
            if shift is not None:
                self.shifted_at[m] = shift.next_at
                if shift.steps:
                    self.last_shift[m] = (s, self.phase[m], shift)
                    self.phase[m] = (self.phase[m] + shift.steps) % self.H
                    self.stats["phase_shifts"] += 1
                    self.stats["shifted_steps"] += shift.steps
        return taken_now

    def _passed_over(self, m: int, p: int) -> bool:
        """Whether island m's last shift passed over a send of fragment p."""
        if self.last_shift[m] is None:
            return False
        s, phase, shift = self.last_shift[m]
        stride, P = self.stride, self.P
        return any(
            clock % stride == 0 and (clock // stride - 1) % P == p
            for clock in shift.passed_over(s, phase)
        )

    def _catch_up(self, m: int) -> None:
        """Take the rounds that were open when island m rejoined and have merged since."""
        keep = []
        for p, rid in self.pending[m]:
            if self.r_id[p] != rid:
                if self.base[m][p] != self.version[p]:  # (not taken when out: _publish)
                    self._refresh(m, p)
            else:
                keep.append((p, rid))
        self.pending[m] = keep

    def _apply(self, m: int, s: int) -> None:
        """Overwrite the fragments sent tau steps before step s with their merged values."""
        q, base = self.applyq[m], self.base[m]
        while q and q[0][0] <= s:
            p = q[0][1]
            if m in self.r_isl[p]:
                break  # its merged value is not out yet: apply it when it is
            q.popleft()
            base[p] = self.version[p]

    def _pause(self, m: int, t: float, seconds: float) -> None:
        self.mode[m] = PAUSE
        self.upscale[m] = False  # slices back by then join at the resume
        self.gen[m] += 1
        self._push(t + seconds, RESUME, m, self.gen[m])

    def _cover(self, a: float, b: float) -> None:
        """Add a completed step [a, b] to the time in which the global model advanced.
        Steps complete in time order, so only the newest segments can overlap."""
        cov = self.covered
        while cov and cov[-1][1] >= a:
            a = min(a, cov.pop()[0])
        cov.append([a, b])

    def _resume(self, m: int, t: float) -> None:
        self._tick(m, t)
        for j in self.back[m]:
            self.state[j] = IN
        self._set_live(m, self.live[m] + len(self.back[m]) * self.S)
        self.back[m].clear()
        if self.live[m] == 0:
            self.mode[m] = DEAD
            self.n_dead += 1
            # The coordinator's schedule loop re-decides every open round: one waiting for
            # this island's upload (K capped by the live islands) would otherwise wait for
            # an arrival that never comes, its islands' later sends of it included.
            for p in range(self.P):
                if self.r_isl[p]:
                    self._decide(p, t)
            return
        lead = self._leader()
        waiting = [k for k in range(self.M) if self.mode[k] == WAIT]
        if lead >= 0:  # the next step boundary of the island furthest ahead
            at, idx, phase = self.end[lead], self.idx[lead] + 1, self.phase[lead]
        elif waiting:  # nobody trains: start with the next island due to
            k = min(waiting, key=lambda k: self.wait_at[k])
            at, idx, phase = self.wait_at[k], self.target[k], self.target_phase[k]
        else:  # alone: carry on with its own schedule
            at, idx, phase = t, self.idx[m], self.phase[m]
        if at > t:
            self.mode[m] = WAIT
            self.wait_at[m], self.target[m], self.target_phase[m] = at, idx, phase
            self._push(at, START, m, self.gen[m])
        else:
            self._begin(m, t, idx, phase)

    def _leader(self) -> int:
        """The training island furthest ahead in the schedule, or -1."""
        lead = -1
        for k in range(self.M):
            if self.mode[k] == RUN and (lead < 0 or self.idx[k] > self.idx[lead]):
                lead = k
        return lead

    def _begin(self, m: int, t: float, idx: int, phase: int) -> None:
        """Rejoin: take every fragment merged without this island, then train from step idx
        with send phase ``phase`` (the fleet's clock: that of the island it rejoins at).

        A fragment whose round is still open (the fleet just sent it) is taken once that
        round merges, as an island waits for the merge of its own sends. Its phase
        alignment starts over, as a relaunched island's does.
        """
        self._tick(m, t)
        self.stats["rejoins"] += 1
        self._apply(m, math.inf)  # merged values of its own sends
        for p in range(self.P):
            if m in self.r_isl[p]:
                continue  # its own contribution: applied after the merge, as usual
            if self.r_isl[p]:
                self.pending[m].append((p, self.r_id[p]))
            elif self.base[m][p] != self.version[p]:
                self._refresh(m, p)
        self.idx[m], self.phase[m] = idx, phase
        self.late[m], self.shifted_at[m] = None, 0
        self.last_shift[m] = None
        self.took[m] = [-1] * self.P
        self.mode[m] = RUN
        self._schedule_step(m, t)

    def _refresh(self, m: int, p: int) -> None:
        """Island m overwrites fragment p with the global value: its work on p since its
        last send is lost."""
        c = self.cum[m]
        self.spent["overwritten"] += (c - self.mark[m][p]) / self.P
        self.mark[m][p], self.base[m][p] = c, self.version[p]

    def _fail(self, t: float, j: int) -> None:
        s = self.state[j]
        if s == AWAY:
            return  # not running: cannot fail again
        self.state[j] = AWAY
        self.returns.append((t + self.cfg.repair_s, j))
        m = self.island_of[j]
        if s == BACK:
            self.back[m].discard(j)
            return
        self._tick(m, t)
        if self.mode[m] == RUN:
            self.spent["lost"] += self.live[m] * (t - self.start[m])
        self._set_live(m, self.live[m] - self.S)
        if self.mode[m] in (RUN, WAIT):  # RUN: the step in flight is lost
            self.stats["downscales"] += 1
            self._pause(m, t, self.cfg.detect_s + self.cfg.downscale_s)
        # PAUSE: the pause under way handles this slice too

    def _return(self, t: float, j: int) -> None:
        m = self.island_of[j]
        self.state[j] = BACK
        self.back[m].add(j)
        if self.mode[m] in (RUN, WAIT):
            self.upscale[m] = True  # at its next step boundary
        elif self.mode[m] == DEAD:
            self.n_dead -= 1
            self._tick(m, t)
            self._pause(m, t, self.cfg.upscale_s)

    # ------------------------------------------------------------------ loop
    def run(self, trace: Trace) -> None:
        times, slices = trace.times.tolist(), trace.slices.tolist()
        i, nf, horizon, heap, inf = 0, len(times), self.cfg.duration_s, self.heap, math.inf
        returns, gen = self.returns, self.gen
        while True:
            tf = times[i] if i < nf else inf
            tr = returns[0][0] if returns else inf
            self._steps(min(tf, tr), horizon)  # steps and deadlines up to the next of these
            th = heap[0][0] if heap else inf
            if th <= tf and th <= tr:
                if th >= horizon:
                    break
                t, _, kind, a, b = heapq.heappop(heap)  # a resume or a start
                if b != gen[a]:
                    continue  # cancelled by a failure or a newer pause
                elif kind == RESUME:
                    self._resume(a, t)
                else:
                    self._begin(a, t, self.target[a], self.target_phase[a])
            elif tf <= tr:
                if tf >= horizon:
                    break
                i += 1
                self._fail(tf, slices[i - 1])
            else:
                if tr >= horizon:
                    break
                self._return(tr, returns.popleft()[1])
        self._finish(horizon)

    def _finish(self, horizon: float) -> None:
        # Work still on its way into the model counts: open rounds will merge, and
        # fresh local progress will be sent at its fragment's next turn. Progress on a
        # fragment already merged without the island will be overwritten; progress since
        # a send whose round is still open is cut off by the end, like a step in flight.
        for p in range(self.P):
            self.useful += sum(self.r_cov[p])
        for m in range(self.M):
            self._tick(m, horizon)
            if self.mode[m] == RUN:
                self.spent["lost"] += self.live[m] * (horizon - self.start[m])
            self._apply(m, math.inf)  # merged values it has not applied yet
            for p in range(self.P):
                local = (self.cum[m] - self.mark[m][p]) / self.P
                if m in self.r_isl[p]:
                    self.spent["lost"] += local
                elif self.base[m][p] == self.version[p]:
                    self.useful += local
                else:
                    self.spent["overwritten"] += local

    def result(self, failures: int) -> SystemResult:
        cfg = self.cfg
        total = cfg.used_chips * cfg.duration_s
        stats = dict(self.stats)
        merges = max(1, stats["merges"])
        stats["islands_per_merge"] = stats["contributions"] / merges
        return SystemResult(
            system="diloco",
            chips=cfg.used_chips,
            islands=cfg.islands,
            min_quorum=cfg.min_quorum,
            goodput=self.useful / total,
            uptime=sum(b - a for a, b in self.covered) / cfg.duration_s,
            failures=failures,
            stats=stats,
            chip_time={"useful": self.useful / total}
            | {k: v / total for k, v in self.spent.items() if k != "useful"},
        )
