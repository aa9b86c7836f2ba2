"""Fault schedules for chaos runs, and the injector that plays one against live processes.

A :class:`Schedule` is a list of :class:`Event`\\ s ordered by time, drawn from a seed
(:meth:`Schedule.from_seed`) or read from a file (:meth:`Schedule.from_file`). The
same seed and arguments always draw the same events, and a file replays exactly
what it lists, so a chaos run can be repeated fault for fault.

:class:`Injector` plays a schedule against a :class:`ChaosTarget` (whatever owns the
islands' processes, the coordinator and the proxies) from a background thread,
applies each event at its time, reverts it after its duration, and logs both.
``Injector.stop()`` reverts whatever is still active, so a run always ends with
every island running, undelayed, and a coordinator up.

Schedule file (YAML, or JSON with the same structure; ``to_file`` picks by suffix)::

    version: 1        # optional; 1 is the only format
    seed: 7           # optional; informational: the seed the events were drawn from
    events:           # any order; sorted by at_s on load (ties keep file order)
      - {at_s: 12.5, kind: stall,            target: island-0, duration_s: 8.0}
      - {at_s: 30.0, kind: kill_rank,        target: island-1, rank: 1}
      - {at_s: 41.2, kind: slow,             target: island-0, duration_s: 10.0, extra_s: 0.25}
      - {at_s: 50.0, kind: net_delay,        target: island-1, duration_s: 5.0, delay_s: 0.2}
      - {at_s: 60.0, kind: net_drop,         target: island-0, duration_s: 5.0}
      - {at_s: 70.0, kind: kill_coordinator, target: coordinator, duration_s: 3.0}

Each kind takes exactly the keys shown for it (see ``KEYS``); any other key, or a
missing one, is an error naming the event's index and the key. Times are seconds
from the start of the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
"""The ``target`` of ``kill_coordinator``; reserved: no island may have this name."""

KINDS = ("kill_rank", "stall", "slow", "net_delay", "net_drop", "kill_coordinator")

KEYS: dict[str, tuple[str, ...]] = {
    "kill_rank": ("at_s", "kind", "target", "rank"),
    "stall": ("at_s", "kind", "target", "duration_s"),
    "slow": ("at_s", "kind", "target", "duration_s", "extra_s"),
    "net_delay": ("at_s", "kind", "target", "duration_s", "delay_s"),
    "net_drop": ("at_s", "kind", "target", "duration_s"),
    "kill_coordinator": ("at_s", "kind", "target", "duration_s"),
}
"""The keys an event of each kind has in a schedule file, in the order they are written."""

FORMAT_VERSION = 1


def _number(where: str, value: Any, *, positive: bool) -> float:
    """``value`` as a finite float, >= 0 (or > 0 with ``positive``); ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(
            f"{where} must be a finite number {'>' if positive else '>='} 0, got {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """One fault: what happens to whom, when, and for how long."""

    at_s: float
    """Seconds from the start of the run at which the fault is applied (>= 0)."""
    kind: str
    """One of ``KINDS``:

    - ``kill_rank``: SIGKILL rank ``rank`` of island ``target`` (the supervisor restarts it);
    - ``stall``: SIGSTOP every rank of ``target``, SIGCONT after ``duration_s``;
    - ``slow``: ``target`` spends ``extra_s`` more seconds on each step for ``duration_s``;
    - ``net_delay``: ``target``'s traffic to the coordinator is delayed by ``delay_s``
      (each way) for ``duration_s``;
    - ``net_drop``: ``target``'s connections to the coordinator are cut and refused for
      ``duration_s``;
    - ``kill_coordinator``: SIGKILL the coordinator, restart it after ``duration_s``.
    """
    target: str
    """The island's name, or ``"coordinator"`` for (and only for) ``kill_coordinator``."""
    rank: int | None = None
    """The rank to kill (``kill_rank`` only; 0 <= rank < the island's ranks)."""
    duration_s: float = 0.0
    """How long the fault lasts (> 0), or for ``kill_coordinator`` how long the coordinator
    stays down; 0 for ``kill_rank``, which is instantaneous."""
    extra_s: float | None = None
    """Extra seconds per step (``slow`` only, > 0)."""
    delay_s: float | None = None
    """Added latency in seconds, each direction (``net_delay`` only, > 0)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Event.kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        kind = self.kind
        set_ = object.__setattr__  # frozen: normalise numbers to float once, here
        set_(self, "at_s", _number("Event.at_s", self.at_s, positive=False))
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"Event.target must be a non-empty string, got {self.target!r}")
        if kind == "kill_coordinator" and self.target != COORDINATOR:
            raise ValueError(
                f"Event.target must be {COORDINATOR!r} for kind 'kill_coordinator', "
                f"got {self.target!r}"
            )
        if kind != "kill_coordinator" and self.target == COORDINATOR:
            raise ValueError(
                f"Event.target must name an island for kind {kind!r}; "
                f"{COORDINATOR!r} is only the target of 'kill_coordinator'"
            )
        if kind == "kill_rank":
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
                raise ValueError(
                    f"Event.rank must be an int >= 0 for kind 'kill_rank', got {self.rank!r}"
                )
            if self.duration_s != 0:
                raise ValueError(
                    "Event.duration_s must be 0 (left out) for kind 'kill_rank': a kill is "
                    f"instantaneous and the restart is the supervisor's; got {self.duration_s!r}"
                )
        else:
            if self.rank is not None:
                raise ValueError(
                    f"Event.rank applies only to kind 'kill_rank', got rank={self.rank!r} "
                    f"for kind {kind!r}"
                )
            set_(
                self,
                "duration_s",
                _number(f"Event.duration_s ({kind})", self.duration_s, positive=True),
            )
        for name, owner in (("extra_s", "slow"), ("delay_s", "net_delay")):
            value = getattr(self, name)
            if kind == owner:
                set_(self, name, _number(f"Event.{name} ({kind})", value, positive=True))
            elif value is not None:
                raise ValueError(
                    f"Event.{name} applies only to kind {owner!r}, got {name}={value!r} "
                    f"for kind {kind!r}"
                )

    @property
    def end_s(self) -> float:
        """When the fault is reverted (``at_s`` for ``kill_rank``)."""
        return self.at_s + self.duration_s

    def to_dict(self) -> dict[str, Any]:
        """The event as written in a schedule file: exactly ``KEYS[kind]``."""
        return {k: getattr(self, k) for k in KEYS[self.kind]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "event") -> Event:
        """Build an event from a file's mapping; ValueError prefixed with ``where``."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {data!r}")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{where}: 'kind' must be one of {', '.join(KINDS)}; got {kind!r}")
        allowed = KEYS[kind]
        extra = [str(k) for k in data if k not in allowed]
        if extra:
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(map(repr, sorted(extra)))} for kind "
                f"{kind!r}; its keys are: {', '.join(allowed)}"
            )
        missing = [k for k in allowed if k not in data]
        if missing:
            raise ValueError(
                f"{where}: missing key(s) {', '.join(map(repr, missing))} for kind {kind!r}; "
                f"its keys are: {', '.join(allowed)}"
            )
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Events in time order (stable: events at the same time keep their given order)."""

    events: tuple[Event, ...] = ()
    seed: int | None = dataclasses.field(default=None, kw_only=True)
    """The seed the events were drawn from, if any (informational: files replay events)."""

    def __post_init__(self):
        events = tuple(self.events)
        for i, e in enumerate(events):
            if not isinstance(e, Event):
                raise ValueError(f"Schedule.events[{i}] must be an Event, got {e!r}")
        object.__setattr__(self, "events", tuple(sorted(events, key=lambda e: e.at_s)))
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"Schedule.seed must be an int or None, got {self.seed!r}")

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    @property
    def end_s(self) -> float:
        """When the last fault is reverted (0 for an empty schedule)."""
        return max((e.end_s for e in self.events), default=0.0)

    def check_targets(self, ranks_per_island: Mapping[str, int]) -> None:
        """Raise ValueError if an event names an island or a rank the run does not have.

        The event is named by its kind and time: its place here is its place in time, not
        in the file (``events[2]`` named a file's first event when two came before it)."""
        for e in self.events:
            if e.kind == "kill_coordinator":
                continue
            if e.target not in ranks_per_island:
                raise ValueError(
                    f"event {e.kind} at {e.at_s}s: unknown island {e.target!r}; "
                    f"the run has: {', '.join(ranks_per_island)}"
                )
            if e.kind == "kill_rank" and e.rank >= ranks_per_island[e.target]:
                raise ValueError(
                    f"event kill_rank at {e.at_s}s: island {e.target!r} has ranks "
                    f"0..{ranks_per_island[e.target] - 1}, got rank {e.rank}"
                )

    # ---- files -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": FORMAT_VERSION}
        if self.seed is not None:
            d["seed"] = self.seed
        d["events"] = [e.to_dict() for e in self.events]
        return d

    @classmethod
    def from_dict(cls, data: Any) -> Schedule:
        if not isinstance(data, Mapping):
            raise ValueError(f"schedule: expected a mapping with 'events', got {data!r}")
        unknown = [str(k) for k in data if k not in ("version", "seed", "events")]
        if unknown:
            raise ValueError(
                f"schedule: unknown key(s) {', '.join(map(repr, sorted(unknown)))}; "
                "known: version, seed, events"
            )
        version = data.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"schedule: version must be {FORMAT_VERSION}, got {version!r}")
        if "events" not in data:
            raise ValueError("schedule: missing key 'events' (a list, possibly empty)")
        events = data["events"]
        if not isinstance(events, list):
            raise ValueError(f"schedule: 'events' must be a list, got {events!r}")
        seed = data.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"schedule: 'seed' must be an int, got {seed!r}")
        return cls(
            tuple(Event.from_dict(e, f"events[{i}]") for i, e in enumerate(events)), seed=seed
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_file(self, path: str | os.PathLike) -> None:
        """Write JSON for ``*.json``, YAML for ``*.yaml`` / ``*.yml``."""
        p = Path(path)
        if p.suffix == ".json":
            text = self.to_json() + "\n"
        elif p.suffix in (".yaml", ".yml"):
            text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        else:
            raise ValueError(f"schedule file {str(p)!r}: suffix must be .json, .yaml or .yml")
        p.write_text(text)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Schedule:
        """Read a YAML or JSON schedule (JSON is YAML); errors name the file."""
        from ds_diloco.config import load_file

        # As config files are read: 5e-2 (and to_file's JSON 2e-05) a float, a key given
        # twice refused, a YAML error's problem and place named.
        data = load_file(path, what="schedule file")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"schedule file {str(Path(path))!r}: {e}") from None

    # ---- seeded schedules --------------------------------------------------------------

    @classmethod
    def from_seed(
        cls,
        seed: int,
        islands: Sequence[str],
        ranks_per_island: Mapping[str, int],
        duration_s: float,
        *,
        rate_per_min: float = 2.0,
        kinds: Sequence[str] | Mapping[str, float] = KINDS,
        warmup_s: float = 10.0,
        fault_s: tuple[float, float] = (2.0, 10.0),
        coordinator_down_s: tuple[float, float] = (1.0, 5.0),
        slow_extra_s: tuple[float, float] = (0.05, 0.5),
        net_delay_s: tuple[float, float] = (0.05, 0.5),
        restart_window_s: float = 30.0,
        min_gap_s: float = 5.0,
        max_faulted_islands: int | None = None,
    ) -> Schedule:
        """Draw a reproducible schedule for a run of ``duration_s`` seconds.

        Distribution:

        - Fault arrivals form a Poisson process of ``rate_per_min`` per minute starting at
          ``warmup_s``: exponential gaps of mean ``60 / rate_per_min`` seconds.
        - Each arrival draws its kind from ``kinds`` (a list: uniform; a mapping: weights),
          then its target uniformly among the targets free at that time (islands in the
          given order; ``"coordinator"`` for ``kill_coordinator``), then its parameters
          uniformly: ``rank`` in ``[0, ranks_per_island[target])``, ``duration_s`` in
          ``fault_s`` (``coordinator_down_s`` for ``kill_coordinator``), ``extra_s`` in
          ``slow_extra_s``, ``delay_s`` in ``net_delay_s``. Times are rounded to 1 ms.
        - A target's *fault window* is ``[at_s, end_s)``, plus ``restart_window_s`` after a
          kill (``kill_rank``, ``kill_coordinator``) for the restart. A target is *free*
          once ``min_gap_s`` has passed since its fault window closed, so faults of one
          target never overlap (no stall inside the island's own restart).
        - At most ``max_faulted_islands`` islands (default: all but one, at least 1) are in
          a fault window at once, so some island keeps training.
        - Arrivals with no free target, and faults that would not be reverted by
          ``duration_s``, are skipped: the realised rate is at most ``rate_per_min``.

        Only ``random.Random(seed).random()`` is drawn from (its stream is fixed for an int
        seed across Python versions), so the same seed and arguments give the same events.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"from_seed: seed must be an int >= 0, got {seed!r}")
        islands = list(islands)
        if not islands:
            raise ValueError("from_seed: islands must name at least one island")
        if len(set(islands)) != len(islands):
            raise ValueError(f"from_seed: island names must be unique, got {islands}")
        for name in islands:
            if not isinstance(name, str) or not name or name == COORDINATOR:
                raise ValueError(
                    f"from_seed: island names must be non-empty strings other than "
                    f"{COORDINATOR!r}, got {name!r}"
                )
            n = ranks_per_island.get(name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"from_seed: ranks_per_island[{name!r}] must be an int >= 1, got {n!r}"
                )
        duration_s = _number("from_seed: duration_s", duration_s, positive=True)
        rate = _number("from_seed: rate_per_min", rate_per_min, positive=True)
        warmup_s = _number("from_seed: warmup_s", warmup_s, positive=False)
        restart_window_s = _number("from_seed: restart_window_s", restart_window_s, positive=False)
        min_gap_s = _number("from_seed: min_gap_s", min_gap_s, positive=False)
        ranges = {}
        for name, r in (
            ("fault_s", fault_s),
            ("coordinator_down_s", coordinator_down_s),
            ("slow_extra_s", slow_extra_s),
            ("net_delay_s", net_delay_s),
        ):
            ok = isinstance(r, (tuple, list)) and len(r) == 2
            ok = ok and all(not isinstance(x, bool) and isinstance(x, (int, float)) for x in r)
            if not (ok and math.isfinite(r[1]) and 0 < r[0] <= r[1]):
                raise ValueError(f"from_seed: {name} must be (lo, hi) with 0 < lo <= hi, got {r!r}")
            ranges[name] = (float(r[0]), float(r[1]))
        weights = dict(kinds) if isinstance(kinds, Mapping) else dict.fromkeys(kinds, 1.0)
        for k, w in weights.items():
            if k not in KINDS:
                raise ValueError(
                    f"from_seed: unknown kind {k!r} in kinds; known: {', '.join(KINDS)}"
                )
            _number(f"from_seed: kinds[{k!r}] weight", w, positive=False)
        kind_list = [k for k in KINDS if weights.get(k, 0) > 0]  # fixed order: KINDS'
        if not kind_list:
            raise ValueError("from_seed: kinds must contain at least one kind with weight > 0")
        if max_faulted_islands is None:
            max_faulted_islands = max(1, len(islands) - 1)
        if (
            isinstance(max_faulted_islands, bool)
            or not isinstance(max_faulted_islands, int)
            or max_faulted_islands < 1
        ):
            raise ValueError(
                f"from_seed: max_faulted_islands must be an int >= 1, got {max_faulted_islands!r}"
            )

        rng = random.Random(seed)
        u = rng.random

        def uniform(lo_hi: tuple[float, float]) -> float:
            lo, hi = lo_hi
            return max(round(lo + (hi - lo) * u(), 3), 0.001)

        def pick(n: int) -> int:
            return min(int(u() * n), n - 1)

        total = sum(weights[k] for k in kind_list)
        cumulative, acc = [], 0.0
        for k in kind_list:
            acc += weights[k] / total
            cumulative.append(acc)

        free_at = dict.fromkeys([*islands, COORDINATOR], -math.inf)  # target free from then on
        faulted_until = dict.fromkeys(islands, -math.inf)  # end of an island's fault window
        events = []
        t = warmup_s
        while True:
            t += -math.log(1.0 - u()) * 60.0 / rate
            at = round(t, 3)
            if at >= duration_s:
                break
            x = u()
            kind = next((k for k, c in zip(kind_list, cumulative) if x < c), kind_list[-1])
            if kind == "kill_coordinator":
                candidates = [COORDINATOR] if free_at[COORDINATOR] <= at else []
            elif sum(end > at for end in faulted_until.values()) >= max_faulted_islands:
                candidates = []
            else:
                candidates = [i for i in islands if free_at[i] <= at]
            if not candidates:
                continue
            target = candidates[pick(len(candidates))]
            params: dict[str, Any] = {}
            if kind == "kill_rank":
                params["rank"] = pick(ranks_per_island[target])
            elif kind == "kill_coordinator":
                params["duration_s"] = uniform(ranges["coordinator_down_s"])
            else:
                params["duration_s"] = uniform(ranges["fault_s"])
                if kind == "slow":
                    params["extra_s"] = uniform(ranges["slow_extra_s"])
                elif kind == "net_delay":
                    params["delay_s"] = uniform(ranges["net_delay_s"])
            event = Event(at_s=at, kind=kind, target=target, **params)
            if event.end_s > duration_s:  # it could not be reverted within the run
                continue
            window_end = event.end_s
            if kind in ("kill_rank", "kill_coordinator"):
                window_end += restart_window_s
            free_at[target] = window_end + min_gap_s
            if target != COORDINATOR:
                faulted_until[target] = window_end
            events.append(event)
        return cls(tuple(events), seed=seed)


# ---- the injector -------------------------------------------------------------------------


class ChaosTarget(Protocol):
    """What the injector drives; implemented by whoever owns the run's processes.

    The injector composes overlapping faults itself: it calls ``stop_island`` once when
    an island's first stall begins and ``cont_island`` when its last one ends, and passes
    the effective values (largest active ``extra_s`` / ``delay_s``, drop if any drop is
    active) to ``set_slow`` / ``set_net``. Exceptions are logged, never propagated.
    """

    def kill_rank(self, island: str, rank: int) -> None:
        """SIGKILL rank ``rank`` of ``island`` (its restart is the supervisor's business)."""

    def stop_island(self, island: str) -> None:
        """SIGSTOP every rank of ``island``."""

    def cont_island(self, island: str) -> None:
        """SIGCONT every rank of ``island``."""

    def set_slow(self, island: str, extra_s: float) -> None:
        """Make each step of ``island`` take ``extra_s`` more seconds; 0 restores it."""

    def set_net(self, island: str, delay_s: float = 0.0, drop: bool = False) -> None:
        """Delay (each way) or drop ``island``'s traffic to the coordinator; (0, False) clears."""

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator."""

    def restart_coordinator(self) -> None:
        """Start the coordinator again (it resumes from its durable state)."""


# Faults that share a knob of the target compose: each event adds a value to its
# channel, and the target only ever sees the channel's effective value.
_CHANNEL = {
    "stall": "stall",
    "slow": "slow",
    "net_delay": "net",
    "net_drop": "net",
    "kill_coordinator": "coordinator",
}


@dataclasses.dataclass(frozen=True)
class _Action:
    at_s: float
    event: int  # index into schedule.events
    revert: bool


class Injector:
    """Plays a schedule against a target: each event at its time, reverted after its duration.

    Driven by ``start()`` (a daemon thread) or, in tests, by ``start(background=False)``
    and calls to ``poll()`` with an injected ``clock``. Actions due at the same time run
    reverts first, then in event order. ``log`` records each action: ``t_s`` (when it
    ran, seconds from start), ``at_s`` (when it was due), ``action`` ("apply" or
    "revert"), ``event`` (index), ``kind``, ``target``, ``calls`` (the target calls made:
    none when an overlapping fault already holds the knob), ``ok``, ``error`` (only if a
    call raised) and ``reason`` ("schedule", or "stop" for reverts made by ``stop()``).
    """

    def __init__(
        self,
        schedule: Schedule,
        target: ChaosTarget,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_wait_s: float = 1.0,
    ):
        self.schedule = schedule
        self.target = target
        self.clock = clock
        self.max_wait_s = _number("Injector.max_wait_s", max_wait_s, positive=True)
        actions = []
        for i, e in enumerate(schedule.events):
            actions.append(_Action(e.at_s, i, revert=False))
            if e.kind != "kill_rank":
                actions.append(_Action(e.end_s, i, revert=True))
        self._actions = sorted(actions, key=lambda a: (a.at_s, not a.revert, a.event))
        self._next = 0
        self._t0: float | None = None
        self._active: dict[int, Event] = {}  # applied, not yet reverted, in application order
        self._channels: dict[tuple[str, str], dict[int, Any]] = {}
        self._unsure: set[tuple[str, str]] = set()  # (channel, target) whose last call failed
        self._log: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()
        self._done = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # ---- control -------------------------------------------------------------------------

    def start(self, t0: float | None = None, *, background: bool = True) -> Injector:
        """Start the clock at ``t0`` (default: now) and, with ``background``, the thread."""
        if self._t0 is not None:
            raise RuntimeError("Injector already started")
        self._t0 = self.clock() if t0 is None else t0
        if not self._actions:
            self._done.set()
        if background:
            self._thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)
            self._thread.start()
        return self

    def poll(self) -> int:
        """Run every action due by now; returns how many ran."""
        with self._lock:
            if self._stopped or self._t0 is None:
                return 0
            now = self.elapsed()
            n = 0
            while self._next < len(self._actions) and self._actions[self._next].at_s <= now:
                a = self._actions[self._next]
                self._next += 1
                self._do(a.event, revert=a.revert, due_s=a.at_s, reason="schedule")
                n += 1
            if self._next == len(self._actions):
                self._done.set()
            return n

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and revert every active fault (SIGCONT, undelay, restart...).

        Events not yet applied are never applied. Idempotent.
        """
        self._stop_evt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for idx, e in reversed(list(self._active.items())):
                self._do(idx, revert=True, due_s=e.end_s, reason="stop")
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every action has run (or ``stop()``); False on timeout."""
        return self._done.wait(timeout_s)

    # ---- state ---------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since start (0 before)."""
        return 0.0 if self._t0 is None else self.clock() - self._t0

    @property
    def log(self) -> list[dict[str, Any]]:
        """A copy of the action log (see the class docstring)."""
        with self._lock:
            return [dict(r, calls=list(r["calls"])) for r in self._log]

    @property
    def active(self) -> tuple[Event, ...]:
        """Faults applied and not yet reverted, in the order they were applied."""
        with self._lock:
            return tuple(self._active.values())

    @property
    def pending(self) -> int:
        """Actions (applies and reverts) not yet run."""
        with self._lock:
            return 0 if self._stopped else len(self._actions) - self._next

    def next_due_s(self) -> float | None:
        """When the next action is due (seconds from start), None when there is none."""
        with self._lock:
            if self._stopped or self._next >= len(self._actions):
                return None
            return self._actions[self._next].at_s

    # ---- internals -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop_evt.is_set():
            self.poll()
            due = self.next_due_s()
            if due is None:
                return
            # Bounded waits: the clock is re-read at least every max_wait_s.
            self._stop_evt.wait(min(max(due - self.elapsed(), 0.0), self.max_wait_s))

    def _effective(self, channel: str, target: str) -> Any:
        values = self._channels.get((channel, target), {}).values()
        if channel in ("stall", "coordinator"):
            return bool(values)
        if channel == "slow":
            return max(values, default=0.0)
        return (max((d for d, _ in values), default=0.0), any(drop for _, drop in values))

    def _do(self, idx: int, *, revert: bool, due_s: float, reason: str) -> None:
        e = self.schedule.events[idx]
        calls: list[str] = []
        record: dict[str, Any] = {
            "t_s": round(self.elapsed(), 6),
            "at_s": due_s,
            "action": "revert" if revert else "apply",
            "event": idx,
            "kind": e.kind,
            "target": e.target,
            "calls": calls,
            "ok": True,
            "reason": reason,
        }
        try:
            if e.kind == "kill_rank":
                self._call(calls, "kill_rank", e.target, e.rank)
            else:
                channel = _CHANNEL[e.kind]
                values = self._channels.setdefault((channel, e.target), {})
                before = self._effective(channel, e.target)
                if revert:
                    values.pop(idx, None)
                    self._active.pop(idx, None)
                else:
                    values[idx] = {
                        "slow": e.extra_s,
                        "net_delay": (e.delay_s, False),
                        "net_drop": (0.0, True),
                    }.get(e.kind, True)
                    self._active[idx] = e
                after = self._effective(channel, e.target)
                # A knob whose last call failed is not known to hold its value: set again
                # (an overlapping fault was logged as injected, making no call).
                key = (channel, e.target)
                if after != before or key in self._unsure:
                    self._unsure.add(key)  # until the call returns
                    self._set(calls, channel, e.target, after)
                    self._unsure.discard(key)
        except Exception as exc:  # a failed call must not stop the chaos (or the run)
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("chaos: %s %s %s failed: %s", record["action"], e.kind, e.target, exc)
        else:
            log.info(
                "chaos: %s %s %s at %.3fs (due %.3fs): %s",
                record["action"],
                e.kind,
                e.target,
                record["t_s"],
                due_s,
                ", ".join(calls) or "no call (already in effect)",
            )
        self._log.append(record)

    def _set(self, calls: list[str], channel: str, target: str, value: Any) -> None:
        if channel == "stall":
            self._call(calls, "stop_island" if value else "cont_island", target)
        elif channel == "slow":
            self._call(calls, "set_slow", target, value)
        elif channel == "net":
            self._call(calls, "set_net", target, delay_s=value[0], drop=value[1])
        else:
            self._call(calls, "kill_coordinator" if value else "restart_coordinator")

    def _call(self, calls: list[str], name: str, *args: Any, **kwargs: Any) -> None:
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        calls.append(f"{name}({', '.join(shown)})")
        getattr(self.target, name)(*args, **kwargs)
