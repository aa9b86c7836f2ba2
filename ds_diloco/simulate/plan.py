"""The planning question: at this cluster size and failure rate, how many islands and what quorum?

``recommend`` is a pure function of simulated rows (one cluster size, one failure
trace): it picks among the Decoupled DiLoCo rows and says why. Goodput is the
simulator's measure; model quality is not simulated, and it favours fewer
learners (each island is a larger synchronous group, and DiLoCo with few
replicas is the closer to data-parallel training). So a plan takes the fewest
islands whose goodput is within ``tolerance`` of the best, then, among that M's
quorums, the best goodput (ties: the larger K, more islands in every merge).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ds_diloco.simulate.result import SystemResult

DEFAULT_TOLERANCE = 0.01
"""Goodput (a share, 0..1) given up for fewer islands: one point."""


@dataclass(frozen=True)
class Plan:
    """The recommended Decoupled DiLoCo setting at one cluster size, and why."""

    chips: int
    islands: int
    min_quorum: int
    goodput: float
    uptime: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def recommend(rows: list[SystemResult], tolerance: float = DEFAULT_TOLERANCE) -> Plan:
    """The setting to run among ``rows``' Decoupled DiLoCo rows (one cluster size).

    ValueError: no Decoupled DiLoCo row, rows of several sizes, or a tolerance that is
    not a share in [0, 1).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a goodput share in [0, 1), got {tolerance}")
    diloco = [r for r in rows if r.system == "diloco"]
    if not diloco:
        raise ValueError("no Decoupled DiLoCo result to plan from (simulate 'diloco')")
    sizes = {r.chips for r in rows}
    if len(sizes) > 1:
        raise ValueError(f"plan one cluster size at a time, got {sorted(sizes)}")
    best = max(diloco, key=lambda r: r.goodput)
    close = [r for r in diloco if r.goodput >= best.goodput - tolerance]
    fewest = min(r.islands for r in close)
    pick = max(
        (r for r in diloco if r.islands == fewest),
        key=lambda r: (r.goodput, r.min_quorum),
    )
    n = len({(r.islands, r.min_quorum) for r in diloco})
    reason = f"{_name(pick)}: goodput {_pct(pick.goodput)}, uptime {_pct(pick.uptime)}; "
    if pick.goodput == best.goodput:
        reason += f"the best of {n} setting(s) simulated"
    else:
        reason += (
            f"within {100 * tolerance:g} point(s) of the best of {n} settings simulated "
            f"({_name(best)}, {_pct(best.goodput)}) with fewer islands: larger synchronous "
            "groups (quality is not simulated)"
        )
    baselines = [r for r in rows if r.system != "diloco"]
    if baselines:
        top = max(baselines, key=lambda r: r.goodput)
        reason += f"; {top.label}: {_pct(top.goodput)} on the same failures"
    return Plan(
        chips=pick.chips,
        islands=pick.islands,
        min_quorum=pick.min_quorum,
        goodput=pick.goodput,
        uptime=pick.uptime,
        reason=reason,
    )


def _name(r: SystemResult) -> str:
    return f"M={r.islands} K={r.min_quorum}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"
