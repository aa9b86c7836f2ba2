"""Goodput simulator: data-parallel vs elastic data-parallel vs Decoupled DiLoCo at scale.

A discrete-event simulation of one training run on a cluster whose chips fail
at random (cluster-wide Poisson process), with every system on the same
failure trace:

- ``config``    SimConfig: cluster, failures, costs (calibrated defaults), DiLoCo settings
- ``trace``     the failure trace and the synchronous step time (slowest chip)
- ``baselines`` data-parallel restart-from-checkpoint, elastic data-parallel
- ``diloco``    Decoupled DiLoCo: M islands, rounds closed by ``round_policy.decide``
- ``run``       ``simulate(cfg)`` and ``sweep(cfg, chips, islands, quorums=...)``
- ``plan``      ``recommend(rows)``: which M and K to run at one cluster size, and why
- ``report``    ``ds-diloco simulate``: tables, PNG plot, JSON, ``--plan``
"""

from ds_diloco.simulate.config import PAPER_CHIPS, PAPER_ISLANDS, PUBLISHED, SYSTEMS, SimConfig
from ds_diloco.simulate.plan import Plan, recommend
from ds_diloco.simulate.report import add_arguments, main
from ds_diloco.simulate.result import SystemResult
from ds_diloco.simulate.run import Result, simulate, sweep
from ds_diloco.simulate.trace import Trace, failure_trace

__all__ = [
    "PAPER_CHIPS",
    "PAPER_ISLANDS",
    "PUBLISHED",
    "SYSTEMS",
    "Plan",
    "Result",
    "SimConfig",
    "SystemResult",
    "Trace",
    "add_arguments",
    "failure_trace",
    "main",
    "recommend",
    "simulate",
    "sweep",
]
