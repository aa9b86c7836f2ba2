"""Join a ds_diloco run from your own DeepSpeed ZeRO-3 training loop.

::

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)  # stage 3
    learner = ds_diloco.Learner(engine, coordinator="http://host:8470", island="a")
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        learner.step(tokens=batch["input_ids"].numel())  # this rank's tokens
    learner.close()  # sends the last steps, leaves; or: with ds_diloco.Learner(...) as l: ...

Every rank of the island (the engine's whole process group) makes a Learner
with the same arguments. Construction registers the island, checks the model
against the run's, and replaces the local model by the current global one;
:meth:`Learner.step` then does the outer loop's part of an inner step: it
sends the due fragment's pseudo-gradient of this rank's shard and applies
merged fragments on every rank at the same step, with the network work in a
background thread. The model, data, loss, schedule and logging stay yours.

Inner steps are counted from ``engine.global_steps``: with gradient
accumulation, calls between optimizer steps only add their tokens, and an
engine restored from a checkpoint continues the fragment schedule where it was.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import sys
import time
import weakref

from ds_diloco import zero
from ds_diloco.client import TRANSPORT_ERRORS, CoordinatorClient, RefusedError, TLSError
from ds_diloco.compress import Codec
from ds_diloco.config import TOKEN_ENV
from ds_diloco.fragments import FragmentPlan, Schedule, param_specs, signature, spec_difference
from ds_diloco.syncer import FragmentSyncer, SyncStats

log = logging.getLogger(__name__)


class LearnerError(RuntimeError):
    """This engine cannot join the run: the message says why (raised on every rank)."""

    exit_code = 5
    """``ds-diloco island``'s exit status: a failure that ``ds-diloco run`` restarts (the
    coordinator may be back by then). Its own (not 1): every rank stops together, so the
    rank seen exiting first is no failed slot's, and none is blamed for it (two such
    deaths in a row had a healthy slot left out: ``downscale_after``)."""


class SetupError(LearnerError):
    """Joining failed for a reason in the island's own set-up, the same on a restart (its
    model is not the run's, the coordinator's certificate is not trusted)."""

    exit_code = 2  # cli.INPUT_ERROR_EXIT: given up, not restarted


def zero_stage(engine) -> int:
    """The ZeRO stage of a DeepSpeed engine; TypeError for anything else."""
    stage = getattr(engine, "zero_optimization_stage", None)
    if not callable(stage) or not hasattr(engine, "module"):
        raise TypeError(
            f"ds_diloco.Learner needs a DeepSpeed engine (deepspeed.initialize), "
            f"got {type(engine).__name__}"
        )
    return int(stage())


def _at_exit(ref: weakref.ref, state: dict) -> None:
    """At interpreter exit, before teardown.

    A Learner never closed (the user's loop raised): stop its transport threads. Left
    running, one caught inside torch there aborted the process ("terminate called without
    an active exception", exit 134 instead of the error's 1) in 3 of 4 runs. No flush, no
    collective, no teardown that could wait on a rank: the ranks may not all be here.

    Then tear a gloo group the script left up down (:func:`zero.teardown_gloo`) if this
    rank is alone in it, or if the Learner was closed at the end of the loop (on every
    rank) and no error ended the script since: after an error, a collective of the
    script's may still be pending, and the teardown would wait on the other ranks.
    """
    learner = ref()
    if learner is not None and not learner._closed:
        learner._closed = True
        learner.syncer.close(timeout=0)
    crashed = hasattr(sys, "last_exc") or hasattr(sys, "last_value")  # set for an unhandled one
    if state["alone"] or (state["closed"] and not crashed):
        zero.teardown_gloo()


class Learner:
    """One rank's membership of a ds_diloco run, around a DeepSpeed ZeRO-3 engine.

    Args:
        engine: the DeepSpeed engine, ZeRO stage 3, its model the run's model.
        coordinator: the coordinator's URL, e.g. ``http://10.0.0.1:8470``.
        island: this island's name in the run (the same on all its ranks).
        token: the run's bearer token; default: ``$DS_DILOCO_TOKEN``.
        alpha: blend of the local values into an applied global fragment (0: overwrite).
        keep_local_steps: on applying a merged fragment, keep the steps trained since its
            upload (global + local now - local at the upload) instead of overwriting them.
        connect_timeout_s: how long to try reaching the coordinator before giving up.
    """

    def __init__(
        self,
        engine,
        coordinator: str,
        island: str,
        *,
        token: str | None = None,
        alpha: float = 0.0,
        keep_local_steps: bool = False,
        connect_timeout_s: float = 30.0,
        ca_file: str | None = None,
    ):
        stage = zero_stage(engine)
        if stage != 3:
            raise LearnerError(
                f"island {island!r}: ds_diloco needs a ZeRO stage 3 engine "
                f"(zero_optimization.stage: 3 in the DeepSpeed config), this one is stage {stage}"
            )
        if not 0.0 <= alpha < 1.0:
            raise LearnerError(f"alpha (blend of local into global) must be in [0, 1), got {alpha}")
        if keep_local_steps and alpha > 0.0:
            raise LearnerError("keep_local_steps and alpha > 0 are two ways to apply: pick one")
        self.engine, self.island = engine, island
        token = token or os.environ.get(TOKEN_ENV)

        def need_token():  # the variable may be set on some nodes only: every rank raises
            if not token:
                raise LearnerError(f"no token: pass token= or set {TOKEN_ENV}")

        if zero.initialized():
            self._all(need_token)
            self._same_island_everywhere(island)
        else:
            need_token()
        self.rank, self.world_size = zero.rank_and_world()
        # https: the coordinator's certificate is checked against ca_file, else
        # $DS_DILOCO_CA_FILE, else the system's CAs.
        self.client = CoordinatorClient(coordinator, token, ca_file=ca_file)
        specs = param_specs(engine.module.named_parameters())
        sig = signature(specs)
        # Every failure below is agreed on by the whole island before anyone raises, so a
        # rank never waits forever in a collective that a failed rank will not join.
        probe = self.client.with_limits(timeout_s=10.0)
        info = self._all(lambda: self._reach(probe, connect_timeout_s))
        plan = FragmentPlan.from_json(info["plan"])
        if info["signature"] != sig:  # the same plan on every rank: they all raise
            raise SetupError(
                f"island {island!r}: parameter signature mismatch: the run's model has "
                f"signature {info['signature'][:16]}, this engine's is {sig[:16]}: "
                f"{spec_difference(specs, plan.specs)}"
            )
        self._all(lambda: self._check_masters(engine))
        register = lambda: self.client.register(island, self.world_size, sig)  # noqa: E731
        reply = self._all(register if self.rank == 0 else lambda: None)  # one per island
        # Rank 0's registration number, on every rank: each rank's uploads carry it.
        (incarnation,), *_ = zero.island_gather([reply["incarnation"] if reply else 0])
        self._agree_group = zero.agreement_group()  # the per-step agreement: off the GPU
        agree = functools.partial(zero.island_gather, group=self._agree_group)
        self.syncer = FragmentSyncer(
            self.client, island, plan,
            Schedule(**info["schedule"]), zero.ZeroShardAccess(engine),
            world_size=self.world_size, rank=self.rank, alpha=alpha, agree=agree,
            keep_local_steps=keep_local_steps,
            codec=Codec(**info.get("compression", {})),  # the run's setting, from the coordinator
            align_phase=bool(info.get("align_phase", False)), incarnation=incarnation,
            run=str(info.get("run", "")),
        )  # fmt: skip
        try:
            self.syncer.bootstrap()  # every rank now holds the global model, the same versions
        except RuntimeError as e:  # on every rank together: close what it opened, then raise
            self.syncer.close(timeout=0.0)
            zero.destroy_group(self._agree_group)
            raise LearnerError(f"island {island!r}: {e}") from e
        self._seen_step = engine.global_steps
        self._first = True  # the next optimizer step must be the engine's next
        self._tokens = 0
        self._closed = False
        # Tear a gloo group down at exit: alone, always; else once close() returned on the
        # normal path (on every rank, so no collective is left half-way).
        self._exit_state = {"alone": self.world_size == 1, "closed": False}
        atexit.register(_at_exit, weakref.ref(self), self._exit_state)

    @staticmethod
    def _same_island_everywhere(island: str) -> None:
        """Every rank names the same island. A rank with another name (``island=`` a host
        name, on an island of two nodes) sent its shards as an island of their own: no
        upload of either was ever whole, nothing merged, and no error said so."""
        digest = int.from_bytes(hashlib.sha256(island.encode()).digest()[:7], "big")
        if len({row[0] for row in zero.island_gather([digest])}) > 1:  # the same on every rank
            raise LearnerError(
                f"island {island!r}: the ranks of this process group name different islands; "
                "every rank of an island passes the same island="
            )

    def _reach(self, probe: CoordinatorClient, timeout_s: float) -> dict:
        """The run's plan, retrying an unreachable coordinator for ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = probe.plan()
            except ValueError as e:  # an answer, not JSON: another service at that address
                raise LearnerError(
                    f"island {self.island!r}: {probe.url} answered, but not as a ds_diloco "
                    f"coordinator ({e})"
                ) from None
            except TLSError as e:  # waiting would not change it
                raise SetupError(f"island {self.island!r}: {e}") from None
            except TRANSPORT_ERRORS as e:
                if time.monotonic() >= deadline:
                    hint = ""
                    if probe.url.startswith("http://") and isinstance(e, ConnectionResetError):
                        hint = " (a coordinator serving TLS closes http:// connections: https?)"
                    raise LearnerError(
                        f"island {self.island!r}: coordinator {probe.url} not reachable "
                        f"after {timeout_s:g} s: {e}{hint}"
                    ) from e
                time.sleep(0.5)
                continue
            if not (isinstance(info, dict) and {"plan", "signature", "schedule"} <= info.keys()):
                raise LearnerError(
                    f"island {self.island!r}: {probe.url} answered, but not as a ds_diloco "
                    f"coordinator (no plan in its answer)"
                )
            return info

    def _check_masters(self, engine) -> None:
        """Every trained parameter has an fp32 master: one that requires grad but that the
        optimizer was not given has none, and its pseudo-gradient cannot be computed (a
        bare KeyError from DeepSpeed, once the island had registered)."""
        if missing := zero.trained_without_master(engine):
            raise SetupError(
                f"island {self.island!r}: {len(missing)} parameter(s) require grad but are in "
                f"no optimizer group, so ZeRO-3 keeps no fp32 master of them "
                f"({', '.join(missing[:3])}): give them to the optimizer, or "
                "requires_grad_(False) them to keep them frozen"
            )

    def _all(self, fn):
        """Run ``fn`` on this rank; if it failed on any rank of the island, raise on all."""
        result, error = None, None
        try:
            result = fn()
        except RefusedError as e:
            error = LearnerError(f"island {self.island!r}: the coordinator refused: {e.message}")
        except (LearnerError, *TRANSPORT_ERRORS) as e:
            error = e if isinstance(e, LearnerError) else LearnerError(f"{self.island!r}: {e}")
        rows = zero.island_gather([0 if error is None else 1])
        if error is not None:
            raise error
        failed = [r for r, (bad,) in enumerate(rows) if bad]
        if failed:
            raise LearnerError(f"island {self.island!r}: could not join the run on ranks {failed}")
        return result

    def start_together(self, islands: int, timeout_s: float = 120.0, poll_s: float = 0.05) -> float:
        """Wait until ``islands`` islands of the run are ready for their first step.

        Call once, right before the first inner step, on every rank. Islands launched
        together still take seconds apart to build their engines and load data; with
        K < M a round closes on the first upload plus the grace window, and an island
        that starts later than that finds every round closed before its upload comes
        (stale, dropped, round after round). Starting together keeps them in phase.
        Never waits more than ``timeout_s`` (an island that failed to start does not hold
        the others), nor at all once the others are running (a restarted island).

        An island that starts while others already train (a late one, or one restarted
        from a checkpoint) moves its send schedule into phase with the run's rounds (the
        coordinator says where they are): otherwise, with K < M, its sends would fall
        between the rounds and come back stale, round after round.
        Returns the seconds waited.
        """
        t0 = time.monotonic()
        phase = 0
        if self.rank == 0:
            started, deadline = 0, t0 + timeout_s
            while True:
                try:
                    reply = self.client.start(self.island, run=self.syncer.run)
                except (RefusedError, *TRANSPORT_ERRORS) as e:
                    log.warning("%s: start together: %s; starting now", self.island, e)
                    break
                started, clock = int(reply["started"]), reply.get("clock")
                if clock is not None:  # the next step's send lands at the rounds' next one
                    phase = self.syncer.schedule.join_phase(clock, self._seen_step)
                if started >= islands:
                    break
                if time.monotonic() >= deadline:
                    log.warning(
                        "%s: %d of %d islands ready after %.0f s; starting without the rest",
                        self.island, started, islands, timeout_s,
                    )  # fmt: skip
                    break
                time.sleep(poll_s)
        (phase,), *_ = zero.island_gather([phase])  # every rank takes rank 0's, then starts
        self.syncer.set_phase(phase)
        if self.syncer.phase:
            log.info("%s/%d joins the rounds in phase: sends %d step(s) early", self.island,
                     self.rank, self.syncer.phase)  # fmt: skip
        return time.monotonic() - t0

    # ------------------------------------------------------------------ loop
    def step(self, tokens: int, sync: bool = True) -> list[int]:
        """Call after every ``engine.step()`` with the tokens this rank trained on in it.

        Between optimizer steps (gradient accumulation) it only counts the tokens.
        ``sync=False`` (the same on every rank): the step is noted and nothing else, no
        send, no apply, its tokens not counted (``bench island``'s syncer-off blocks).
        Returns the fragments applied at this step (the same list on every rank). Raises
        :class:`ds_diloco.Superseded` on every rank at the same step once the island has
        registered again elsewhere (this launch's uploads are refused from then on).
        """
        if self._closed:
            raise LearnerError("step() after close()")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._tokens += int(tokens)
        step = self.engine.global_steps
        if step == self._seen_step:  # not an optimizer step: a micro-batch of an accumulation
            self.syncer.alive()  # training goes on: the island keeps its lease
            return []
        if step < self._seen_step or (self._first and step != self._seen_step + 1):
            # The same on every rank (their engines step together). Unnoticed, the next
            # upload would carry global - checkpoint: a pull back towards an older model.
            raise LearnerError(
                f"island {self.island!r}: engine.global_steps went from {self._seen_step} to "
                f"{step}: a checkpoint loaded after the Learner was built? Load it first: the "
                "Learner takes the global model over the engine's weights when it joins"
            )
        self._first = False
        self._seen_step = step
        tokens, self._tokens = self._tokens, 0
        return self.syncer.on_step(step, tokens) if sync else []

    def keep_lease(self):
        """``with learner.keep_lease():`` around work between steps that may take minutes (a
        checkpoint save of a large model): the island stays live for the coordinator's
        quorums meanwhile (a rank silent for two minutes, or four times its longest step,
        stops its heartbeats: see ``syncer.IDLE_LEASE_S``)."""
        return self.syncer.keep_lease()

    def versions(self) -> list[int]:
        """The global version each fragment's local values started from."""
        return self.syncer.versions()

    @property
    def stats(self) -> SyncStats:
        return self.syncer.stats

    def close(
        self,
        leave: bool = True,
        take_global: bool = False,
        flush: bool = True,
        flush_timeout_s: float = 60.0,
    ) -> list[int] | None:
        """Send what is queued and stop; every rank calls it.

        ``leave``: this island is done for good (False for one that will come back,
        e.g. stopping to restart from a checkpoint: its lease then runs out).
        ``flush`` (default True): first send every fragment's steps since its last
        apply and wait, at most ``flush_timeout_s``, until they are merged
        (:meth:`FragmentSyncer.flush`), so the global model has the island's last
        steps. With ``leave`` they are sent as the island's final flush: merged with
        the next round of each fragment that closes (with other islands still training,
        possibly after this wait, and then not in what ``take_global`` loads), never
        closing a round on their own (that made the others' uploads stale).
        An island that comes back gets them only this way: a new Learner starts
        from the global model (a DeepSpeed checkpoint brings back AdamW state, step and
        data position; its weights are overwritten). ``__exit__`` after an error does
        not flush (the ranks may not all be here).
        ``take_global``: then load the current global model into the engine on every
        rank (to evaluate or save the merged model) and return its versions.
        A coordinator found gone at the end (no connection) is tried once more, for at
        most ``syncer.GONE_RETRY_S``, to leave and to take the global model.
        """
        if self._closed:
            return None
        self._closed = True
        try:  # leave: no quorum should count on this island any more
            versions = self.syncer.finish(
                leave=leave, take_global=take_global, flush_timeout_s=flush_timeout_s,
                flush=flush,
            )  # fmt: skip
        except RuntimeError as e:  # raised on every rank together; the local model is intact
            zero.destroy_group(self._agree_group)  # on every rank: a second close() returns
            self._agree_group = None
            raise LearnerError(f"island {self.island!r}: {e}") from e
        self._exit_state["closed"] = True  # on the normal path: every rank got here
        zero.destroy_group(self._agree_group)  # done with it on every rank (not left to exit)
        self._agree_group = None
        return versions

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # After an error the ranks may not all get here: no flush (it is collective).
        self.close(leave=exc_type is None, flush=exc_type is None)
        if exc_type is not None:  # the other ranks may be anywhere: no teardown at exit
            self._exit_state["closed"] = False
