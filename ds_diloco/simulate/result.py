"""What one simulated system reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

CHIP_TIME = {
    "useful": "steps that end up in the model (the goodput)",
    "away": "slices away for repair, or repaired and not yet back in a group",
    "paused": "detecting a failure, restarting, re-forming a group (down- and upscaling)",
    "idle": "a rejoined island idle until the fleet's next step boundary (DiLoCo)",
    "straggler": "each step's wait for its slowest chip",
    "checkpoint": "writing checkpoints (data-parallel)",
    "lost": "steps cut off by a failure or the run's end, or rolled back to a checkpoint",
    "stale": "contributions dropped as stale (DiLoCo)",
    "overwritten": "local work replaced by a fragment merged without the island (DiLoCo)",
}
"""Where the allocated chip-time goes: ``SystemResult.chip_time`` has these keys."""

LABELS = {
    "dp": "data-parallel, restart on failure",
    "elastic": "elastic data-parallel",
    "diloco": "Decoupled DiLoCo",
}


@dataclass
class SystemResult:
    """Goodput and uptime of one system on one failure trace."""

    system: str
    """One of ``config.SYSTEMS``."""

    chips: int
    """Chips simulated (whole slices)."""

    islands: int
    """Learners: M for Decoupled DiLoCo, 1 for the data-parallel systems."""

    goodput: float
    """Share of the allocated chip-time spent on steps that end up in the model, 0..1.
    A step's chip-time counts at one chip's mean compute time (a shorter one only makes up
    for earlier waits): waiting for the slowest chip, pauses, lost and rolled-back steps,
    dropped (stale) fragments do not count."""

    uptime: float
    """Share of wall time in which the global model advances, 0..1: the job runs steps
    that are kept (data-parallel), or at least one island trains (DiLoCo)."""

    failures: int
    """Chip failures in the trace (some hit slices already away and change nothing)."""

    stats: dict = field(default_factory=dict)
    """System-specific counters (pauses, restarts, merges, dropped contributions...)."""

    chip_time: dict[str, float] = field(default_factory=dict)
    """Shares of the allocated chip-time by ``CHIP_TIME`` category; they add up to 1 and
    ``chip_time["useful"]`` is the goodput. Each is measured on its own, not as a rest."""

    min_quorum: int = 1
    """K, Decoupled DiLoCo's minimum quorum (1 for the data-parallel systems)."""

    @property
    def label(self) -> str:
        base = LABELS[self.system]
        if self.system != "diloco":
            return base
        # K = 1 is the paper's setting: named only when another was simulated.
        return f"{base}, M={self.islands}" + (
            f", K={self.min_quorum}" if self.min_quorum != 1 else ""
        )

    def __post_init__(self) -> None:
        unknown = set(self.chip_time) - set(CHIP_TIME)
        if unknown:
            raise ValueError(f"unknown chip-time categories {sorted(unknown)}")
        self.chip_time = {k: self.chip_time.get(k, 0.0) for k in CHIP_TIME}

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label}
