"""When a fragment's round closes: a pure function of (now, state, options).

Like torchft's ``quorum_compute``, ``decide`` returns the decision and a
reason string, and touches no clock, socket or lock, so the coordinator's
timing rules are unit-tested directly.

Rule (Decoupled DiLoCo): merge once the minimum quorum K of islands has
contributed, after an adaptive grace window that picks up more islands only
while no island would have to wait for the result; merge at once when every
live island is in. The final contributions of islands that finished training
are merged with whichever round closes next, and never close one.

The islands' side of the rounds is here too: ``phase_shift``, how far an island whose
uploads come late moves its send schedule (phase alignment), pure like ``decide`` so
that the islands and the goodput simulator follow the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple


class Ema:
    """Exponential moving average: value <- alpha * x + (1 - alpha) * value.

    The first sample is taken as is, so there is no bias towards a made-up start.
    """

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"Ema alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._value: float | None = None

    @property
    def value(self) -> float | None:
        """None until the first sample."""
        return self._value

    def update(self, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError(f"Ema sample must be finite, got {x}")
        if self._value is None:
            self._value = float(x)
        else:
            self._value = self.alpha * x + (1 - self.alpha) * self._value
        return self._value

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "value": self._value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ema:
        ema = cls(float(d["alpha"]))
        value = d.get("value")
        ema._value = None if value is None else float(value)
        return ema


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    """How long a fragment's round stays open."""

    min_quorum: int = 1
    """K, contributions needed before a merge; K = number of islands gives synchronous DiLoCo."""

    grace_gamma: float = 0.5
    """Safety factor on the slack, 0 <= gamma < 1; 0 disables the grace window."""

    max_grace_s: float = 5.0
    """Cap on the grace window, seconds (>= 0)."""

    tau: int = 2
    """Inner steps between an island sending a fragment and applying its merged result."""

    wait_expected_steps: float = 0.0
    """After the grace window, keep the round open for live islands whose upload of the
    fragment is expected (from their step times) within this many inner steps of the
    round's first contribution; 0: never (the paper's rule). Islands that drift a few
    steps apart then stay in each other's rounds instead of the later one's uploads
    being dropped as stale every round; the price is a result later than tau steps for
    the islands already in (their steps past tau on that fragment are overwritten)."""

    def __post_init__(self) -> None:
        if self.min_quorum < 1:
            raise ValueError(f"PolicyOptions.min_quorum must be >= 1, got {self.min_quorum}")
        if not 0 <= self.grace_gamma < 1:
            raise ValueError(
                f"PolicyOptions.grace_gamma must be in [0, 1) (0 disables grace), "
                f"got {self.grace_gamma}"
            )
        if not (math.isfinite(self.max_grace_s) and self.max_grace_s >= 0):
            raise ValueError(f"PolicyOptions.max_grace_s must be >= 0, got {self.max_grace_s}")
        if self.tau < 1:
            raise ValueError(f"PolicyOptions.tau must be >= 1 inner step, got {self.tau}")
        if not (math.isfinite(self.wait_expected_steps) and self.wait_expected_steps >= 0):
            raise ValueError(
                f"PolicyOptions.wait_expected_steps must be >= 0, got {self.wait_expected_steps}"
            )


# Not frozen: a frozen dataclass's __init__ sets each field with object.__setattr__, three
# times the cost, and the simulator builds one per decision (millions a run).
@dataclass(kw_only=True, slots=True)
class RoundState:
    """What the coordinator knows about one fragment's open round."""

    live_islands: int
    """Registered islands that may still contribute to this round."""

    contributors: int
    """Islands with a complete, counted contribution in the open round."""

    passive: int = 0
    """Of the contributors, islands that finished training (their final flush): they wait
    for no result, so their contributions neither make the quorum nor close the round;
    they are merged with it when it closes. Not counted in ``live_islands``."""

    lapsed: int = 0
    """Of the contributors (not passive), islands that lost their lease since: their
    contributions make the quorum, but they are not live islands in (``live_islands``
    does not count them), so they never make the round "all live islands in"."""

    finishing: int = 0
    """Islands that finished training and have not left yet (their final flush under way)
    with no contribution in this round: a round of final contributions alone waits a
    little for theirs (see :func:`decide`)."""

    first_final: float | None = None
    """Time of the round's first final contribution (None: none)."""

    first_arrival: float | None = None
    """Time of the round's first contribution (None before it)."""

    quorum_at: float | None = None
    """Time the quorum min(K, live) was first reached (None before it)."""

    xi_step: float | None = None
    """EMA of one inner step, seconds (None until measured)."""

    xi_quorum: float | None = None
    """EMA of the time from a round's first contribution to its quorum, seconds."""

    xi_sync: float | None = None
    """EMA of one merge + publish, seconds."""

    expected: tuple[float, ...] = ()
    """When the live islands not in the round are expected to upload this fragment
    (predicted from their last steps and step times; only ``wait_expected_steps`` uses it)."""

    def __post_init__(self) -> None:
        if self.live_islands < 0 or self.contributors < 0:
            raise ValueError(
                "RoundState.live_islands and contributors must be >= 0, got "
                f"{self.live_islands} and {self.contributors}"
            )
        if not 0 <= self.passive <= self.contributors:
            raise ValueError(
                f"RoundState.passive must be in [0, contributors={self.contributors}], "
                f"got {self.passive}"
            )
        if not 0 <= self.lapsed <= self.contributors - self.passive:
            raise ValueError(
                f"RoundState.lapsed must be in [0, contributors - passive = "
                f"{self.contributors - self.passive}], got {self.lapsed}"
            )


Why = str | tuple
"""A reason: a str, or a tuple ``(fmt, *args)`` formatted only when read, as
``fmt.format(*args)`` with each tuple arg formatted the same way first.

The simulator asks for millions of decisions and reads none of their reasons:
formatting the floats in them was a third of its time, and an object per part of a
reason most of what was left of ``decide``'s; a tuple is the cheapest thing to build.
"""


def _text(why: Any) -> Any:
    """A reason's text (a tuple's args are formatted first); any other value as it is."""
    if isinstance(why, tuple):
        return why[0].format(*map(_text, why[1:]))
    return why


class Decision:
    """Merge now, or wait until ``wait_until`` (None: until the next arrival); and why."""

    __slots__ = ("_why", "merge", "wait_until")

    def __init__(self, merge: bool, wait_until: float | None, reason: Why) -> None:
        self.merge, self.wait_until, self._why = merge, wait_until, reason

    @property
    def reason(self) -> str:
        return _text(self._why)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        return (self.merge, self.wait_until, self.reason) == (
            other.merge, other.wait_until, other.reason
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"Decision(merge={self.merge}, wait_until={self.wait_until}, reason={self.reason!r})"


def grace_window(state: RoundState, opts: PolicyOptions) -> tuple[float, str]:
    """Extra wait after quorum that costs no island a step: gamma * max(slack, 0), capped.

    slack = tau * xi_step - (xi_quorum + xi_sync) is the time left before the
    result is needed; unknown quorum or sync times count as 0.
    """
    grace, why = _grace_window(state, opts)
    return grace, _text(why)


def _grace_window(state: RoundState, opts: PolicyOptions) -> tuple[float, Why]:
    if opts.grace_gamma == 0:
        return 0.0, "grace disabled (gamma=0)"
    if state.xi_step is None:
        return 0.0, "no step-time estimate yet"
    xq = state.xi_quorum or 0.0
    xs = state.xi_sync or 0.0
    slack = opts.tau * state.xi_step - (xq + xs)
    grace = opts.grace_gamma * (0.0 if slack < 0 else slack)  # max(slack, 0.0), 3x faster
    why = (
        "gamma {:g} x max({} x step {:.3f}s - (quorum {:.3f}s + sync {:.3f}s), 0)",
        opts.grace_gamma, opts.tau, state.xi_step, xq, xs,
    )  # fmt: skip
    if grace > opts.max_grace_s:
        capped = ("grace {:.3f}s (capped; {} = {:.3f}s)", opts.max_grace_s, why, grace)
        return opts.max_grace_s, capped
    return grace, ("grace {:.3f}s = {}", grace, why)


def expected_wait(state: RoundState, opts: PolicyOptions) -> tuple[float | None, str]:
    """Until when the round waits for islands expected soon (None: for none), and why.

    Bounded by ``wait_expected_steps`` inner steps after the first contribution: an
    island predicted later than that is not waited for (it will be stale).
    """
    until, why = _expected_wait(state, opts)
    return until, _text(why)


def _expected_wait(state: RoundState, opts: PolicyOptions) -> tuple[float | None, Why]:
    if opts.wait_expected_steps == 0:
        return None, "no wait for expected islands"
    if state.xi_step is None or state.first_arrival is None:
        return None, "no step-time estimate yet"
    limit = state.first_arrival + opts.wait_expected_steps * state.xi_step
    soon = [t for t in state.expected if t <= limit]
    window = ("{:g} x step {:.3f}s", opts.wait_expected_steps, state.xi_step)
    if not soon:
        return None, ("no live island expected within {}", window)
    return limit, ("{} live island(s) expected within {}", len(soon), window)


def decide(now: float, state: RoundState, opts: PolicyOptions) -> Decision:
    """Merge now, or wait (until ``wait_until``, or until the next arrival when None)."""
    c, live, k = state.contributors - state.passive, state.live_islands, opts.min_quorum
    if c == 0:
        if state.passive == 0:
            return Decision(False, None, "no contribution yet")
        # A finished island's last steps are merged with the next round of an island still
        # training: closed now, that island's upload of this round would come stale.
        if live > 0:
            return Decision(False, None, ("only final contributions ({}): waiting for one "
                                          "of the {} live islands", state.passive, live))  # fmt: skip
        if state.finishing == 0:
            return Decision(True, None, ("only final contributions ({}), no live island left",
                                         state.passive))  # fmt: skip
        # Islands that finish together flush one fragment after another: merged before
        # another one's final upload of this fragment came, that one would come stale.
        until = (now if state.first_final is None else state.first_final) + opts.max_grace_s
        if now < until:
            return Decision(False, until, ("only final contributions ({}): waiting {:.3f}s "
                                           "for {} finishing island(s)", state.passive,
                                           until - now, state.finishing))  # fmt: skip
        return Decision(True, None, ("only final contributions ({}); {} finishing island(s) "
                                     "sent none within {:g}s", state.passive,
                                     state.finishing, opts.max_grace_s))  # fmt: skip
    # A dead island must never make the others wait: the quorum is capped by the live ones.
    quorum = k if k < live else (live or 1)  # max(1, min(k, live)), without the slow builtins
    k_desc = ("K={}", k) if quorum == k else ("K={} capped to {} live islands", k, quorum)
    if c < quorum:
        return Decision(False, None, ("quorum {}/{} ({})", c, quorum, k_desc))
    # A lapsed island's contribution is not a live island in: counted, the round closed
    # at once (no grace window) while a live island had not sent.
    live_in = c - state.lapsed
    if live_in >= live:
        extra = f" ({c} contributions)" if c != live else ""
        extra += f" + {state.passive} final" if state.passive else ""
        return Decision(True, None, ("all {} live islands in{}", live, extra))
    grace, grace_why = _grace_window(state, opts)
    quorum_at = now if state.quorum_at is None else state.quorum_at
    deadline = quorum_at + grace
    head = ("quorum {}/{} ({}) reached, {}/{} live islands in", c, quorum, k_desc, live_in, live)
    if now >= deadline:
        until, why = _expected_wait(state, opts)
        if until is not None and now < until:
            return Decision(False, until, ("{}; grace over, waiting {:.3f}s more: {}",
                                           head, until - now, why))  # fmt: skip
        if opts.wait_expected_steps:
            return Decision(True, None, ("{}; grace over: {}; {}", head, grace_why, why))
        return Decision(True, None, ("{}; grace over: {}", head, grace_why))
    return Decision(
        False, deadline,
        ("{}; waiting {:.3f}s more for stragglers: {}", head, deadline - now, grace_why),
    )  # fmt: skip


# ------------------------------------------------------------- phase alignment
# The island's side of the rounds (``CoordinatorConfig.align_phase``): an island whose
# uploads come after their rounds closed moves its send schedule earlier. Decided here,
# as a pure function, so that the islands (``syncer.FragmentSyncer``) and the goodput
# simulator (``simulate.diloco``) shift by the same rule.


class PhaseShift(NamedTuple):
    """An island's decision to move its send schedule earlier (see :func:`phase_shift`).
    A named tuple: the simulator makes one per shift, millions a run."""

    steps: int
    """How many steps earlier the island sends from the next step on, 0..H - tau - 1 (0: it
    measured no lateness worth a step; the wait for the next shift starts all the same)."""

    next_at: int
    """Late uploads sent before this step are not acted on: they predate the shift."""

    def passed_over(self, step: int, phase: int) -> range:
        """The send clocks the shift passes over, made after step ``step`` with phase
        ``phase`` (before the shift): the fragments due at these clocks are not sent this
        cycle (the next step's clock is ``step + 1 + phase + steps``)."""
        return range(step + 1 + phase, step + 1 + phase + self.steps)


def phase_shift(
    step: int,
    late_step: int,
    late: float,
    step_time: float,
    shifted_at: int,
    *,
    sync_every: int,
    overlap: int,
) -> PhaseShift | None:
    """Whether, and by how many steps, an island moves its send schedule earlier after
    inner step ``step``. None: nothing to act on.

    ``late_step``: the step of its latest upload that came after its round's first
    contribution (a stale upload the coordinator timed, or a send that followed a version
    merged without the island), ``late`` how long after (0: none yet); ``step_time``: the
    island's step time, in the unit of ``late`` (the islands use milliseconds, the
    simulator seconds); ``shifted_at``: the last shift's ``next_at`` (0 before any).

    It sends ceil(late / step_time) steps earlier, capped at H - tau - 1 (``sync_every``
    minus ``overlap`` minus one) so that a fragment's result is still applied before the
    fragment is sent again, and it shifts once per H steps: the uploads of the next H
    steps show whether the shift was enough.
    """
    if not acts_on(late_step, shifted_at):
        return None
    cap = sync_every - overlap - 1
    shift = min(math.ceil(late / step_time), cap) if step_time > 0 else 0
    return PhaseShift(shift, step + sync_every)


def acts_on(late_step: int, shifted_at: int) -> bool:
    """Whether an upload sent after step ``late_step`` that came late may move the phase
    (:func:`phase_shift`): not if it was sent before ``shifted_at`` (the last shift's
    ``next_at``: it predates the shift's effect), nor if there is none (step 0)."""
    return late_step >= max(shifted_at, 1)


def followed_late(late: float, step_time: float, sync_every: int) -> float | None:
    """How late an island's send is, ``late`` after the round of the version merged
    without it that the fragment follows opened: ``late`` itself, or None when that round
    opened over H/2 steps of ``step_time`` ago (the previous cycle's: the island is early,
    or missed a round for another reason, and its phase says nothing)."""
    return late if late <= sync_every / 2 * step_time else None
