"""Benchmarks that measure a ds_diloco path side by side with a plain baseline."""

from __future__ import annotations

import operator


def shown(
    value: float, goal: float, met: bool, at_most: bool = True, least: int = 3, sign: str = ""
) -> tuple[str, str]:
    """``value`` and ``goal`` printed with the fewest decimals (at least ``least``) at which
    the printed numbers compare (``<=`` if ``at_most``, else ``>=``) as the verdict ``met``
    says: a ratio of 1.0204 against 1.02 prints as 1.0204, not as 1.020 beside MISSED."""
    holds = operator.le if at_most else operator.ge
    for d in range(least, 18):  # 17 decimals tell apart any two floats of the benches' sizes
        v, g = f"{value:{sign}.{d}f}", f"{goal:.{d}f}"
        if holds(float(v), float(g)) == met:
            break
    return v, g
