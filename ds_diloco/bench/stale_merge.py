"""Prototype, benchmarks only: a stale contribution rides along with the fragment's next round.

With K = 1 and the paper's rule (a contribution computed against an older version
than the current one is dropped), an island that runs a little behind the
fastest one, by more than the grace window, loses every contribution: the
fastest island's upload opens and closes each round before it arrives, so its
pseudo-gradient is always one version stale, and its local progress is then
overwritten by a global value that never contained it. ``ds-diloco bench
quality`` measured this (the coordinator's per-island ``merged`` / ``dropped``).

The remedy prototyped here (the coordinator itself is left unchanged):

- only **fresh** contributions (computed against the current version) open a
  round, count towards its quorum K and start its grace window;
- a contribution at most ``max_staleness`` versions stale is kept and merged
  with the fragment's **next** round, weighted by the staleness policy
  (``mode: discount``: token weight / (1 + lambda x staleness)); staler ones
  are dropped as before.

So a lagging island's work reaches the global model one round late instead of
never, while the number of outer steps (one per round) and their size (RDA keeps
the merged norm) stay as in the paper. It needs ``staleness.mode: discount``
(else stale uploads are refused at arrival). Without the first rule, the
discount mode alone lets every stale arrival open a round of its own and take a
full outer (Nesterov) step: M times the outer steps, the divergence seen in a
chaos run.

``python -m ds_diloco.bench.stale_merge --config coordinator.json --max-staleness 1``
serves it like ``ds-diloco coordinator``; :class:`StaleMergeRun` is a
:class:`~ds_diloco.run.LocalRun` that starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import torch

from ds_diloco.coordinator import Coordinator
from ds_diloco.merge import merge_fragment, staleness_weight, token_weight
from ds_diloco.round_policy import RoundState
from ds_diloco.run import LocalRun


class _SplitStep:
    """A fragment's outer optimizer, plus a plain SGD step for the stale contributions.

    ``step(param, grad)``: the optimizer's own step with the fresh contributions' merged
    pseudo-gradient, then ``param -= lr * stale`` with the stale ones' (set just before by
    the coordinator; momentum never sees them). Everything else is the optimizer's.
    """

    def __init__(self, inner, lr: float):
        self.inner, self.lr = inner, lr
        self.stale: torch.Tensor | None = None

    def step(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.inner.step(param, grad)
        if self.stale is not None:
            with torch.no_grad():
                param.add_(self.stale, alpha=-self.lr)
            self.stale = None

    def __getattr__(self, name):
        return getattr(self.inner, name)


class StaleMergeCoordinator(Coordinator):
    """Rounds opened by fresh contributions only; stale ones (<= max_staleness) ride along.

    ``stale_sgd``: the stale ones of a round are merged apart and applied by plain SGD
    (outer lr, no momentum) after the fresh ones' outer step, instead of being merged
    with them (and so carried by the momentum).
    """

    def __init__(self, cfg, max_staleness: int = 1, stale_sgd: bool = False, **kw):
        if cfg.staleness.mode != "discount":
            raise ValueError("stale contributions ride along only with staleness mode discount")
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self.max_staleness, self.stale_sgd = max_staleness, stale_sgd
        super().__init__(cfg, **kw)
        if stale_sgd:
            for fs in self._frags:
                fs.optimizer = _SplitStep(fs.optimizer, cfg.outer.lr)

    def _merge(self, fs, contribs, version, state, decision, now) -> None:
        fresh = [c for c in contribs if c.base_version == version]
        if not self.stale_sgd or not fresh:
            return super()._merge(fs, contribs, version, state, decision, now)
        stale = [c for c in contribs if c.base_version != version and self._weight(c, version)[0]]
        if stale:
            weights = [self._weight(c, version)[0] for c in stale]
            sq = torch.stack([c.sq_norms for c in stale])
            g = merge_fragment([c.row for c in stale], weights, fs.segments, fs.rda, sq_norms=sq)
            fs.optimizer.stale = g.clone()
        super()._merge(fs, fresh, version, state, decision, now)
        fs.optimizer.stale = None
        if stale and fs.version == version + 1:
            with self._lock:  # the base class counted the fresh ones only
                self.metrics.by_quorum[len(fresh)] -= 1
                self.metrics.by_quorum[len(fresh) + len(stale)] += 1
                self.metrics.by_staleness.update(version - c.base_version for c in stale)
                for c in stale:
                    isl = self._islands.get(c.island)
                    if isl is not None:
                        isl.merged += 1
                        isl.tokens_merged += c.tokens
                        isl.steps_merged += c.steps

    def round_state(self, index: int, now: float) -> RoundState:
        fs = self._frags[index]
        live = self._live_islands(now)
        # Only contributions against the current version open the round and count.
        times = sorted(c.complete_at for c in fs.complete.values() if c.base_version == fs.version)
        quorum = max(1, min(self.cfg.policy.min_quorum, live))
        steps = [i.step_time.value for i in self._islands.values() if i.step_time.value]
        return RoundState(
            live_islands=live,
            contributors=len(times),
            first_arrival=times[0] if times else None,
            quorum_at=times[quorum - 1] if len(times) >= quorum else None,
            xi_step=min(steps) if steps else None,
            xi_quorum=self._xi_quorum.value,
            xi_sync=self._xi_sync.value,
        )

    def _weight(self, c, version: int) -> tuple[float, str]:
        stale = version - c.base_version
        if c.tokens == 0:
            return 0.0, "no tokens trained since the last sync"
        if stale > self.max_staleness:
            return (
                0.0,
                f"dropped: {stale} version(s) stale (rides along up to {self.max_staleness})",
            )
        return staleness_weight(token_weight(c.tokens, c.steps), stale, self.cfg.staleness)


def serve(config: str, max_staleness: int, stale_sgd: bool = False) -> None:
    """``ds-diloco coordinator`` with :class:`StaleMergeCoordinator` (until SIGTERM/SIGINT)."""
    from ds_diloco.config import load_coordinator_config
    from ds_diloco.server import CoordinatorServer, body_limit

    cfg = load_coordinator_config(config)

    async def main():
        coord = StaleMergeCoordinator(cfg, max_staleness, stale_sgd)
        server = CoordinatorServer(coord, cfg.resolve_token(), body_limit(cfg, coord))
        await server.start(cfg.host, cfg.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(save=True)

    asyncio.run(main())


class StaleMergeRun(LocalRun):
    """A local run whose coordinator is :class:`StaleMergeCoordinator`."""

    def __init__(self, cfg, max_staleness: int = 1, stale_sgd: bool = False):
        super().__init__(cfg)
        self.max_staleness, self.stale_sgd = max_staleness, stale_sgd

    def coordinator_command(self, config) -> list[str]:
        # LocalRun's spawn (every start, bench quality's included) with this module's server.
        # Overriding start_coordinator alone left spawn_coordinator, which bench quality
        # calls, serving the stock coordinator: the stale-next variants ran its discount mode.
        return [sys.executable, "-m", __name__, "--config", str(config),
                "--max-staleness", str(self.max_staleness), *["--stale-sgd"] * self.stale_sgd]  # fmt: skip


if __name__ == "__main__":
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--stale-sgd", action="store_true")
    a = p.parse_args()
    serve(a.config, a.max_staleness, a.stale_sgd)
