"""The failure trace every system sees, and how long a synchronous step takes.

Failures are rare per chip, so they are drawn from the cluster-wide Poisson
process (rate = chips / chip MTBI) instead of ticking each chip: a week at
2.4M chips is about 46,000 draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ds_diloco.simulate.config import SimConfig

EULER_GAMMA = 0.5772156649015329


@dataclass(frozen=True)
class Trace:
    """Chip failures over the run, in time order, and the slices away when it starts."""

    times: np.ndarray
    """Failure times, seconds, ascending."""

    slices: np.ndarray
    """Slice of the failed chip (a chip drawn uniformly among all chips)."""

    away: tuple[tuple[float, int], ...] = ()
    """(return time, slice) of the slices already away for repair at time 0, by return
    time: the run starts in steady state, not with every slice healthy."""

    def __len__(self) -> int:
        return len(self.times)


def failure_trace(cfg: SimConfig) -> Trace:
    """Poisson failures over ``cfg.duration_s``; depends only on chips, slices, MTBI,
    repair time and seed (not on the system or M).

    A failure that hits a slice already away for repair changes nothing (that chip
    is not running); each system applies that rule itself.
    """
    rng = np.random.default_rng(cfg.seed)
    rate = cfg.used_chips / cfg.chip_mtbi_s  # per second, cluster-wide
    times, chips = _poisson(rng, rate, cfg.duration_s, cfg.used_chips)
    # Failures in the repair time before the start are still away at time 0.
    before, chips_before = _poisson(rng, rate, cfg.repair_s, cfg.used_chips)
    away: dict[int, float] = {}
    for t, chip in zip((before - cfg.repair_s).tolist(), chips_before.tolist()):
        away.setdefault(chip // cfg.chips_per_slice, t + cfg.repair_s)
    return Trace(
        times=times,
        slices=chips // cfg.chips_per_slice,
        away=tuple(sorted((t, j) for j, t in away.items())),
    )


def _poisson(rng, rate: float, span: float, chips: int) -> tuple[np.ndarray, np.ndarray]:
    """Times in [0, span) and chips of a Poisson process of ``rate`` per second."""
    n = int(rng.poisson(rate * span)) if rate > 0 and span > 0 else 0
    # Given their number, Poisson arrivals are uniform order statistics.
    return np.sort(rng.uniform(0.0, span, n)), rng.integers(0, chips, n)


def slowest_chip(n: int) -> tuple[float, float]:
    """(mean, scale) of the max of ``n`` standard normals, by its Gumbel limit.

    A group of n chips, each taking step_s x (1 + cv x Z), steps at the pace of the
    slowest: step_s x (1 + cv x max Z). Sample the max as mean + scale x (G - gamma)
    with G a standard Gumbel draw.
    """
    if n < 2:
        return 0.0, math.sqrt(6) / math.pi  # one chip: the normal itself (std 1)
    r = math.sqrt(2 * math.log(n))
    loc = r - (math.log(math.log(n)) + math.log(4 * math.pi)) / (2 * r)
    return loc + EULER_GAMMA / r, 1 / r


def mean_step_s(cfg: SimConfig, chips: int) -> float:
    """Mean wall time of one synchronous step of ``chips`` chips."""
    return cfg.chip_step_s * (1 + cfg.step_cv * slowest_chip(chips)[0])
