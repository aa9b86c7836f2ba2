"""What the goodput simulator is told: the cluster, its failures, and each system's costs.

The defaults marked *calibrated* are not published: they were fitted to the two
baseline rows of the published table (``PUBLISHED``). One simulated week's goodput
moves by up to a point from seed to seed, so the fit is judged on four weeks
(``days=28``; 56-day runs and the mean of eight one-week runs agree within
0.3). Elastic data-parallel comes out within 3 points at every size.
Data-parallel (restart from an in-memory checkpoint taken at Young's interval,
each checkpoint stalling the job ``checkpoint_s``) is within 3 points at 150k, 300k and 1.2M but 4.1 and 3.2
points off at 600k and 2.4M (seed 0's single week, on which the values were
first fitted, said 3.3 and 3.2), and no pair of restart time and checkpoint cost
brings both within 3: with any checkpoint cost from 0 to 8 s, 600k needs a
longer restart than 2.4M allows (``tests/test_simulate.py`` checks it). A
coordinate descent over step time, jitter, detection, downscale, repair,
restart and checkpoint cost on the mean of eight weeks got no closer than 3.4
points; one started from 1 s steps (four weeks, seed 0) went down to sub-second steps
(step_s=0.69, restart_s=56, detect_s=13, repair_s=7050, checkpoint_s=0): worst cell
2.95 / 3.18 / 2.88 points with seeds 0 / 1 / 2 (data-parallel at 600k), at the edge of
the goal like the closed form below says, and with steps that short the DiLoCo
simulation runs 7x the events (over the minute asked at 2.4M chips) and the default
``merge_s`` exceeds tau steps. The published row asks for a cost per failure that
rises and then falls with scale: with free checkpoints every step, the restart time
that reproduces each cell alone is about 48, 54, 61, 48 and 35 s from 150k to 2.4M. What a
restart-from-checkpoint job has cannot give that: a costly checkpoint loses less
per failure at scale (Young's interval shortens) but stalls the job more often,
and the net falls short; a restart that grows with the number of slices, or
begins again when a chip fails during it, widens the gap.

Why, in closed form: take a renewal model of the job. It runs for an exponential time
between failures (rate lambda = chips / chip_mtbi_s); each failure costs a down time D
(detection and restart; failures during it are absorbed) and loses L seconds of work.
Goodput is then A (1 - lambda L) / (1 + lambda D), A the share of chips at work. Fitted
to the published row over A and D, its worst cell is 2.69 points off at L = 0 (A = 0.91,
D = 65 s), 2.87 at L = 0.5 s, 3.06 at L = 1 s and 3.68 at L = 2.5 s (half a 5 s step, what
a failure loses in flight here): the row is within 3 points only if a failure loses
under about 0.9 s of work, i.e. with steps of a second or two at every size.

A fixed global batch (``fixed_batch_chips``: steps shorten as chips are added, so a
failure loses less work in flight at scale) gives the falling cost per failure that
the table asks for. The same descent on eight weeks found ``fixed_batch_chips=150_000,
step_s=5.36, step_cv=0.0065, detect_s=15, downscale_s=upscale_s=1, repair_s=3600,
restart_s=54, checkpoint_s=0``: every cell of the mean within 2.8 points (data-parallel
-1.4, -0.3, +2.8, -0.7, -2.8; elastic -1.6, +0.5, +1.7, -0.9, +1.2; single weeks up to
3.5 off), and 2.9-3.0 on 56-day runs; four-week runs with seeds 0 to 3 put the worst
cell (data-parallel at 600k) 2.9, 3.1, 2.9 and 2.9 points off. It is not the default:
the margin is a tenth of a point, and the paper does not say which batch its
simulation keeps fixed; and with steps that short the default ``merge_s`` (1 s) is
over tau steps (below): at 2.4M chips (0.335 s steps) most uploads come stale, and the
week's Decoupled DiLoCo goodput falls to 34.9 / 21.7 / 11.5 / 5.8 % for M = 2 / 4 / 8 /
16 (at 1.2M: 62.0 / 74.2 / 83.5 / 88.2), a figure about the merge time, which the
paper does not give, more than about the method. Simulated step by step, Decoupled
DiLoCo gets 16x the steps at 2.4M chips: about 5 s per simulated day at 1.2M chips and
M = 8, 6 s at 2.4M and M = 16 (about 40 s a week, inside the one minute asked of the
simulator). Those figures are from before the islands' phase alignment was simulated
(``align_phase``, stop 59): with it, every round there closes on its first upload and
each island shifts about once a cycle; M = 16 at 2.4M then read 5.5 % (5.8 before) and
the week took about 56 s of CPU, just inside the minute. With the earlier seed-0 fit (step_s=6, step_cv=0.005) it predicts Decoupled
DiLoCo at M = 8, 1.2M chips at 83.6 % (published: 88; these defaults: 76.4 %).

Decoupled DiLoCo's own settings are the paper's (P = H = 24, tau = 2, K = 1
with grace window) and the coordinator's defaults (its round policy, and the
islands' phase alignment), never tuned to hit a number; the data-parallel restart
and checkpoint costs do not enter it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from ds_diloco.round_policy import PolicyOptions

YEAR_S = 365.25 * 86400.0
DAY_S = 86400.0

SYSTEMS = ("dp", "elastic", "diloco")
"""Restart-from-checkpoint data-parallel, elastic data-parallel, Decoupled DiLoCo."""

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER_ISLANDS = (2, 4, 8, 16)
PUBLISHED = {
    "dp": dict(zip(PAPER_CHIPS, (72, 57, 38, 27, 18))),
    "elastic": dict(zip(PAPER_CHIPS, (88, 80, 69, 58, 40))),
}
"""Published goodput % by chips (../shared/reference/decoupled-diloco.md)."""
PUBLISHED_DILOCO = {(1_200_000, 8): 88}
"""Published Decoupled DiLoCo goodput %, by (chips, M): only M = 8 at 1.2M is given."""

# What one run may ask of this machine, checked before anything is drawn or simulated
# (``SimConfig.work``). Measured here: a baseline walks about 700k failures a second and
# Decoupled DiLoCo 170-200k island steps a second when most uploads are merged (one
# policy decision each) and about 650k when most are stale. The paper's runs are far
# inside: 2.4M chips for 28 days is 184k failures, and M = 16 at 5 s steps 7.7M island
# steps (a fixed global batch of 150k chips at 2.4M: 31M a week by this estimate, 26M
# simulated, about 40 s).
MAX_FAILURES = 10_000_000
"""Expected chip failures in one trace (chips x (days + repair_s) / chip_mtbi_s): the trace
is held in memory (about 90 bytes a failure while a system walks it: 0.9 GB at the cap) and
every system walks it (about 8 s a system at the cap)."""
MAX_ISLAND_STEPS = 50_000_000
"""Expected Decoupled DiLoCo island steps (M x days / one step), each an event (one to five
minutes at the cap)."""
MAX_SLICES = 10_000_000
"""Slices (chips / chips_per_slice): every system keeps per-slice state."""


@dataclass(kw_only=True)
class SimConfig:
    """One simulated run: every system gets the same chips and the same failure trace."""

    chips: int = 1_200_000
    """Chips in the cluster; whole slices only (a remainder below one slice is not used)."""

    islands: int = 8
    """M, Decoupled DiLoCo's learners; slices are split among them in contiguous blocks."""

    days: float = 7.0
    """Simulated wall-clock time, days."""

    seed: int = 0
    """Seeds the failure trace (shared by all systems) and DiLoCo's step-time draws."""

    chip_mtbi_s: float = YEAR_S
    """Mean time between interruptions of one chip, seconds (inf: no failures).
    The paper's setting: one year per chip, so a cluster of N chips fails every year / N."""

    chips_per_slice: int = 256
    """Chips that fail, are repaired and rejoin together: one failed chip takes its slice
    (its high-bandwidth domain) out. 256: e.g. 32 eight-GPU hosts, or a mid-size TPU slice."""

    step_s: float = 5.0
    """One chip's mean compute time per inner step, seconds: a large dense model at a
    multi-million-token batch takes seconds per step. A failure loses the step in flight,
    so shorter steps lose less; DiLoCo's cost is one event per island and step."""

    step_cv: float = 0.005
    """Chip step-time variance as a coefficient of variation, drawn per chip and step.
    A synchronous group waits for its slowest chip (at 1e5 chips about 4.4 standard
    deviations out); that wait is not goodput. 0.5 %: a well-tuned fleet's jitter."""

    fixed_batch_chips: int = 0
    """0: each chip's batch is fixed (weak scaling): a step takes ``step_s`` at every cluster
    size. N > 0: the global batch is fixed (strong scaling): ``step_s`` is the step time at
    N chips and a cluster of C chips takes ``step_s x N / C`` (more chips, smaller batches
    per chip, shorter steps: a failure loses less work in flight). The calibration assumes
    weak scaling; see the module docstring for what strong scaling does to it."""

    # Failure handling. Calibrated against the published baseline rows (see module doc).
    detect_s: float = 10.0
    """*Calibrated.* From a chip failing to the system knowing it; the step in flight is
    lost. 10 s: a per-host heartbeat a few seconds apart plus a confirmation."""

    downscale_s: float = 2.0
    """*Calibrated.* Re-forming a group without the failed slice (elastic data-parallel and
    each DiLoCo island), after detection. 2 s: state is replicated across slices and the
    program is compiled ahead for each size, so only the collectives are re-formed."""

    upscale_s: float = 2.0
    """*Calibrated.* Re-forming a group when a repaired slice rejoins (at a step boundary,
    so no step is lost); the same mechanism as downscaling, so the same time."""

    repair_s: float = 7200.0
    """*Calibrated.* A failed slice is away this long (reboot or swap the host, re-qualify
    the slice) before it can rejoin. With 256-chip slices and one failure per chip-year,
    256 x 2 h / 1 y = 5.8 % of the chips are away at any time."""

    restart_s: float = 40.0
    """*Calibrated.* Data-parallel restart after detection: re-schedule the job on the healthy
    slices, initialise the runtime and collectives, load the last checkpoint (from host
    memory or from peers, not from remote storage)."""

    checkpoint_s: float = 0.5
    """*Calibrated.* Time one data-parallel checkpoint stalls training: the blocking part of
    an asynchronous in-memory checkpoint (a consistent snapshot of each chip's shard of
    the weights and optimizer state to host memory; writing it out happens in the
    background). 0.5 s: a barrier plus a device-to-host copy of a few GB per chip."""

    checkpoint_every_s: float = 0.0
    """Data-parallel checkpoint interval, seconds of training (rounded to whole steps, at
    least one); a restart loses what was trained since. 0: Young's optimum for the job's
    size, sqrt(2 x checkpoint_s x the job's mean time between failures) -- at the
    calibrated cost every 3 steps at 150k chips, every step from 600k (every step when
    checkpoints are free)."""

    # Decoupled DiLoCo: the paper's settings and the coordinator's policy defaults.
    num_fragments: int = 24
    """P, fragments the model is split into (the paper: 24)."""

    sync_every: int = 24
    """H, inner steps between two syncs of the same fragment (the paper: 24); a multiple of P."""

    overlap: int = 2
    """tau, inner steps between sending a fragment and applying its merged value (paper: 2)."""

    min_quorum: int = 1
    """K, contributions before the coordinator may merge (the paper: 1)."""

    grace_gamma: float = PolicyOptions.grace_gamma
    """Grace-window safety factor (the coordinator's default; 0 disables the grace window)."""

    max_grace_s: float = PolicyOptions.max_grace_s
    """Cap on the grace window, seconds (the coordinator's default)."""

    align_phase: bool = True
    """Phase alignment, the coordinator's default (``CoordinatorConfig.align_phase``): an
    island whose upload comes after its round closed (stale, or replaced by the merged
    version just before its send) moves its send schedule earlier by as many steps as it
    was late, by the islands' own rule (``round_policy.phase_shift``: at most H - tau - 1
    steps, one shift per H steps; the fragments due at the clocks passed over are not sent
    this cycle), and takes the versions merged without it for the fragments with no upload
    waiting. Islands of unequal size wait for their slowest chip unequally and drift
    apart; without it, the later one's uploads come stale round after round (768 chips as
    two islands of 512 and 256, no failures, a week: 38.3 % goodput, 60.2 % of the
    chip-time stale; with it 98.3 %, elastic data-parallel 98.4 %). False: every island
    keeps the schedule's phase (the paper's schedule)."""

    merge_s: float = 1.0
    """Coordinator time to merge and publish one fragment (its xi_sync), seconds. It must
    stay well under tau steps: the grace window is gamma x max(tau x step - (quorum + sync),
    0), so once a merge takes longer than tau steps every round closes on its first upload
    and the other islands' are stale. Seen with a fixed global batch at 2.4M chips (steps
    of 0.33 s, M = 16, 0.3 days): goodput 5.8 % with 79 % of the chip-time dropped as stale
    at 1 s, 85.3 % at 0.1 s."""

    systems: tuple[str, ...] = SYSTEMS
    """Which systems to simulate, a subset of ``SYSTEMS``."""

    def __post_init__(self) -> None:
        def bad(field: str, need: str) -> ValueError:
            return ValueError(f"SimConfig.{field} {need}, got {getattr(self, field)!r}")

        # Typed: a float count (chips=1.2e6) failed deep in the run with a TypeError and a
        # float step count (overlap=2.5) ran; numpy numbers are taken as plain ones (JSON).
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise bad(f.name, "must be True or False")
            if f.type in ("int", "float"):
                kind = numbers.Integral if f.type == "int" else numbers.Real
                if isinstance(v, bool) or not isinstance(v, kind):
                    raise bad(
                        f.name, "must be an integer" if f.type == "int" else "must be a number"
                    )
                setattr(self, f.name, int(v) if f.type == "int" else float(v))
        for name in ("chips", "islands", "chips_per_slice", "num_fragments", "sync_every"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.chips < self.chips_per_slice:
            raise bad("chips", f"must be at least one slice ({self.chips_per_slice} chips)")
        # Only where DiLoCo runs: the baselines have no islands (sweep() runs them in a piece
        # of their own, which kept the default M = 8 whatever M was asked for).
        if "diloco" in self.systems and self.islands > self.slices:
            raise bad("islands", f"must be <= the number of slices ({self.slices}): an island "
                      "holds whole slices; lower islands or chips_per_slice")  # fmt: skip
        if not (math.isfinite(self.days) and self.days > 0):
            raise bad("days", "must be a finite number > 0")
        if self.seed < 0:
            raise bad("seed", "must be >= 0")
        if not self.chip_mtbi_s > 0:
            raise bad("chip_mtbi_s", "must be > 0 seconds (inf disables failures)")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise bad("step_s", "must be a finite number of seconds > 0")
        if self.fixed_batch_chips < 0:
            raise bad("fixed_batch_chips", "must be >= 0 (0: each chip's batch is fixed)")
        for name in ("step_cv", "detect_s", "downscale_s", "upscale_s", "repair_s",
                     "restart_s", "checkpoint_s", "checkpoint_every_s", "merge_s"):  # fmt: skip
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise bad(name, "must be a finite number >= 0")
        # Same rules as fragments.Schedule (tests check both agree); not imported, as that
        # module loads torch and the simulator needs none.
        if self.sync_every % self.num_fragments:
            raise bad("sync_every", f"(H) must be a multiple of num_fragments "
                      f"(P={self.num_fragments}) so that fragments are evenly staggered")  # fmt: skip
        # Both bounds in one message: "in [0, sync_every)" sent a user to 0, then refused it.
        if not 1 <= self.overlap < self.sync_every:
            raise bad("overlap", f"(tau) must be >= 1 for the grace-window policy and < "
                      f"sync_every={self.sync_every}")  # fmt: skip
        self.systems = tuple(dict.fromkeys(self.systems))  # one row each, in order
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise bad("systems", f"must be a non-empty subset of {SYSTEMS}")
        # The policy would cap it to M, the row still saying K; sweep() runs K <= M only.
        if "diloco" in self.systems and self.min_quorum > self.islands:
            raise bad("min_quorum", f"(K) must be <= islands (M={self.islands})")
        try:
            self.policy  # noqa: B018  (validates K, gamma and the cap with the coordinator's rules)
        except ValueError as e:
            raise ValueError(f"SimConfig: {e}") from None
        self._check_work()

    def work(self) -> dict[str, float]:
        """What this run asks of the machine, estimated before anything is drawn: expected
        chip failures in its trace (the run plus the repair time before it, see
        ``trace.failure_trace``), Decoupled DiLoCo island steps (0 if not simulated; an
        upper bound, as jitter only lengthens steps) and slices."""
        rate = self.used_chips / self.chip_mtbi_s  # 0 with inf: no failures
        step = self.chip_step_s
        steps = self.islands * self.duration_s / step if step > 0 else math.inf
        return {
            "failures": rate * (self.duration_s + self.repair_s),
            "island_steps": steps if "diloco" in self.systems else 0.0,
            "slices": self.slices,
        }

    def _check_work(self) -> None:
        """Refuse a run beyond the caps (``MAX_FAILURES``, ``MAX_ISLAND_STEPS``,
        ``MAX_SLICES``) up front, saying what to lower: one past them runs out of memory
        or for hours."""
        w = self.work()
        if w["slices"] > MAX_SLICES:
            raise ValueError(
                f"SimConfig: {self.slices:.3g} slices ({self.chips} chips, "
                f"{self.chips_per_slice} per slice) is over the cap of {MAX_SLICES:.0e}: "
                "lower SimConfig.chips or raise SimConfig.chips_per_slice"
            )
        if not w["failures"] <= MAX_FAILURES:
            # The trace also holds the failures of the repair time before the start (the
            # slices away at time 0): a long repair_s alone can be what is over the cap.
            span = "days" if self.duration_s >= self.repair_s else "repair_s"
            raise ValueError(
                f"SimConfig: about {w['failures']:.3g} chip failures to simulate "
                f"({self.used_chips} chips, {self.days:g} days plus the repair time "
                f"{self.repair_s:g} s before them, a failure per chip every "
                f"{self.chip_mtbi_s:.3g} s) is over the cap of {MAX_FAILURES:.0e}: "
                f"lower SimConfig.{span} or SimConfig.chips, or raise SimConfig.chip_mtbi_s"
            )
        if not w["island_steps"] <= MAX_ISLAND_STEPS:
            raise ValueError(
                f"SimConfig: about {w['island_steps']:.3g} Decoupled DiLoCo island steps to "
                f"simulate ({self.islands} islands, {self.days:g} days, steps of "
                f"{self.chip_step_s:.3g} s) is over the cap of {MAX_ISLAND_STEPS:.0e}: "
                "lower SimConfig.days or SimConfig.islands, or raise SimConfig.step_s "
                "(or SimConfig.fixed_batch_chips)"
            )

    @property
    def chip_step_s(self) -> float:
        """One chip's mean compute time per step at this cluster size (``fixed_batch_chips``)."""
        if not self.fixed_batch_chips:
            return self.step_s
        return self.step_s * self.fixed_batch_chips / self.chips

    @property
    def slices(self) -> int:
        return self.chips // self.chips_per_slice

    @property
    def used_chips(self) -> int:
        """Chips actually simulated: whole slices."""
        return self.slices * self.chips_per_slice

    @property
    def duration_s(self) -> float:
        return self.days * DAY_S

    @property
    def policy(self) -> PolicyOptions:
        """The coordinator's round policy options, as ``round_policy.decide`` takes them."""
        return PolicyOptions(
            min_quorum=self.min_quorum,
            grace_gamma=self.grace_gamma,
            max_grace_s=self.max_grace_s,
            tau=self.overlap,
        )

    def replace(self, **changes) -> SimConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
