"""What one simulated system reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    A step's chip-time counts at one chip's mean compute time: waiting for the slowest
    chip, pauses, lost and rolled-back steps, dropped (stale) fragments do not count."""

    uptime: float
    """Share of wall time in which the global model advances, 0..1: the job runs steps
    that are kept (data-parallel), or at least one island trains (DiLoCo)."""

    failures: int
    """Chip failures in the trace (some hit slices already away and change nothing)."""

    stats: dict = field(default_factory=dict)
    """System-specific counters (pauses, restarts, merges, dropped contributions...)."""

    @property
    def label(self) -> str:
        base = LABELS[self.system]
        return f"{base}, M={self.islands}" if self.system == "diloco" else base

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label}
