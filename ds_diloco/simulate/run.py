"""Python API: one run (every system on one failure trace) and sweeps over cluster sizes."""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from ds_diloco.simulate.baselines import simulate_dp, simulate_elastic
from ds_diloco.simulate.config import SimConfig
from ds_diloco.simulate.diloco import simulate_diloco
from ds_diloco.simulate.result import SystemResult
from ds_diloco.simulate.trace import failure_trace

_RUNNERS = {"dp": simulate_dp, "elastic": simulate_elastic, "diloco": simulate_diloco}


@dataclass
class Result:
    """Systems side by side; ``rows`` in the order the systems were run."""

    rows: list[SystemResult]
    configs: list[dict] = field(default_factory=list)
    """The configs that produced the rows (one per cluster size, islands as run)."""
    wall_s: float = 0.0
    """Seconds the simulation took on this machine."""

    def get(self, system: str, chips: int | None = None, islands: int | None = None):
        """The one row matching; KeyError if none. ``chips``: the size simulated or the one
        asked for (rows hold whole slices: 150_000 finds the row of 149,760 chips)."""
        sizes = None
        if chips is not None:
            sizes = {chips} | {chips // c["chips_per_slice"] * c["chips_per_slice"]
                               for c in self.configs}  # fmt: skip
        for r in self.rows:
            if r.system != system or islands not in (None, r.islands):
                continue
            if sizes is None or r.chips in sizes:
                return r
        raise KeyError(f"no result for {system} chips={chips} islands={islands}")

    def to_dict(self) -> dict:
        return {
            "rows": [r.to_dict() for r in self.rows],
            "configs": self.configs,
            "wall_s": self.wall_s,
        }


def simulate(cfg: SimConfig) -> Result:
    """Run ``cfg.systems`` on one failure trace drawn from ``cfg``."""
    t0 = time.perf_counter()
    trace = failure_trace(cfg)
    rows = [_RUNNERS[s](cfg, trace) for s in cfg.systems]
    return Result(rows=rows, configs=[cfg.to_dict()], wall_s=time.perf_counter() - t0)


def sweep(
    cfg: SimConfig,
    chips: Iterable[int],
    islands: Iterable[int] = (),
    *,
    chips_per_island: int | None = None,
    quorums: Iterable[int] = (),
    jobs: int = 1,
) -> Result:
    """Every cluster size in ``chips``: the baselines once, DiLoCo once per M in ``islands``
    (or M = chips // ``chips_per_island``; ``cfg.islands`` when neither is given) and per
    quorum K in ``quorums`` up to M (default: ``cfg.min_quorum``), each size on its own
    trace drawn with ``cfg.seed``, so every M and K at one size sees the same failures.

    ``jobs`` > 1 runs the pieces in that many processes; results do not depend on it.
    Every piece is checked (``sweep_configs``) before any is run.
    """
    tasks = sweep_configs(cfg, chips, islands, chips_per_island=chips_per_island, quorums=quorums)
    return run_configs(tasks, jobs=jobs)


def sweep_configs(
    cfg: SimConfig,
    chips: Iterable[int],
    islands: Iterable[int] = (),
    *,
    chips_per_island: int | None = None,
    quorums: Iterable[int] = (),
) -> list[SimConfig]:
    """The pieces ``sweep`` runs, each a checked ``SimConfig`` (ValueError: a size, M or K
    it cannot run, or one over the work caps); nothing is simulated. A quorum over M is
    not run for that M (K <= M); M with no quorum of ``quorums`` at most M is an error."""
    # Each value once, like the quorums: a size or M given twice ran twice (twice the rows).
    chips, islands = tuple(dict.fromkeys(chips)), tuple(dict.fromkeys(islands))
    # The CLI's rule (--chips-per-island): over a size M = 0, under a slice more islands than
    # slices, each refused in other words (a quorum over M, or M over the slices).
    lo = cfg.chips_per_slice
    if chips_per_island is not None and chips and not lo <= chips_per_island <= min(chips):
        raise ValueError(f"chips_per_island must be {lo}..{min(chips)} (one slice, "
                         f"chips_per_slice, to the smallest size), got {chips_per_island}")  # fmt: skip
    quorums = tuple(dict.fromkeys(quorums)) or (cfg.min_quorum,)
    if min(quorums) < 1:
        raise ValueError(f"quorums must be >= 1, got {min(quorums)}")
    tasks: list[SimConfig] = []
    for n in chips:
        base = tuple(s for s in cfg.systems if s != "diloco")
        if base:
            tasks.append(cfg.replace(chips=n, systems=base))
        if "diloco" in cfg.systems:
            ms = (
                (n // chips_per_island,)
                if chips_per_island is not None
                else islands or (cfg.islands,)
            )
            for m in ms:
                ks = [k for k in quorums if k <= m]
                if not ks:
                    raise ValueError(f"no quorum to simulate with M={m} islands at {n} chips: "
                                     f"every K asked for ({list(quorums)}) is over M")  # fmt: skip
                tasks += [
                    cfg.replace(chips=n, islands=m, min_quorum=k, systems=("diloco",)) for k in ks
                ]
    return tasks


def run_configs(tasks: list[SimConfig], *, jobs: int = 1) -> Result:
    """Simulate each config (``simulate``), in ``jobs`` processes if > 1; rows in order."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    t0 = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, max(len(tasks), 1))) as pool:
            parts = list(pool.map(simulate, tasks))
    else:
        parts = [simulate(c) for c in tasks]
    rows = [r for part in parts for r in part.rows]
    configs = [c for part in parts for c in part.configs]
    return Result(rows=rows, configs=configs, wall_s=time.perf_counter() - t0)
