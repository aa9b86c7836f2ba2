"""The Hugging Face Trainer joins a ds_diloco run as an island: :class:`DiLoCoCallback`.

::

    args = TrainingArguments(..., deepspeed="ds_config.json",   # zero_optimization.stage 3
                             include_num_input_tokens_seen=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ds_diloco.DiLoCoCallback("http://host:8470", island="a")])
    trainer.train()          # launched with the deepspeed launcher, as usual

The callback makes a :class:`~ds_diloco.learner.Learner` when training begins
and calls it after every optimizer step. The Trainer keeps the DeepSpeed engine
to itself; callbacks see the model and the optimizer, which with ZeRO-3 are all
the learner needs (the engine's module and its ZeRO-3 optimizer), and the
Trainer's step counter.
"""

from __future__ import annotations

import logging
import threading

from transformers import TrainerCallback

from ds_diloco import zero
from ds_diloco.learner import Learner, LearnerError

log = logging.getLogger(__name__)

LEASE_HOLD_S = 3600.0
"""The longest the callback keeps the lease over one save or evaluation of the Trainer: one
that raised never lets training go on, and a process that lives on (a notebook) must not
keep an island that no longer trains in the quorums."""


class _TrainerEngine:
    """What :class:`Learner` uses of a DeepSpeed engine, from what a callback is given."""

    def __init__(self, model, optimizer, state):
        self.module = model
        # accelerate wraps DeepSpeed's optimizer (DeepSpeedOptimizerWrapper.optimizer)
        self.optimizer = opt = getattr(optimizer, "optimizer", optimizer)
        self._state = state
        # From the optimizer the Trainer really runs, not from TrainingArguments.deepspeed:
        # `accelerate launch --use_deepspeed` runs ZeRO-3 with that argument unset.
        self.stage = zero.optimizer_zero_stage(opt)

    def zero_optimization_stage(self) -> int:
        return self.stage

    @property
    def global_steps(self) -> int:
        return self._state.global_step


class DiLoCoCallback(TrainerCallback):
    """Makes the Trainer's DeepSpeed ZeRO-3 job an island of a ds_diloco run.

    Args:
        coordinator, island, token, alpha, keep_local_steps, connect_timeout_s, ca_file: as
            for :class:`Learner` (``ca_file``: the CA file that an https:// coordinator's
            certificate is checked against, else ``$DS_DILOCO_CA_FILE``).
        start_together: wait (at most 120 s) before the first step until this many
            islands of the run are ready (:meth:`Learner.start_together`); 0: start at once.
        tokens_per_step: tokens one rank trains on per optimizer step, if the Trainer
            does not count them (``include_num_input_tokens_seen``, which it then
            must); the merge weights islands by these counts.
        take_global_at_end: when training ends, load the merged global model into the
            Trainer's model (so that ``trainer.save_model()`` saves the run's model). If
            the coordinator cannot be reached then, the error is logged and the model
            keeps the island's own weights (``versions`` stays None).

    A ``train()`` that raises never reaches ``on_train_end``: the island does not leave,
    but its lease lapses once it has not stepped for ``syncer.IDLE_LEASE_S``, so no
    quorum waits for it.
    """

    def __init__(
        self,
        coordinator: str,
        island: str,
        *,
        token: str | None = None,
        alpha: float = 0.0,
        keep_local_steps: bool = False,
        connect_timeout_s: float = 30.0,
        tokens_per_step: int | None = None,
        take_global_at_end: bool = True,
        start_together: int = 0,
        ca_file: str | None = None,
    ):
        self.coordinator, self.island, self.token = coordinator, island, token
        self.ca_file = ca_file
        self.alpha, self.connect_timeout_s = alpha, connect_timeout_s
        self.keep_local_steps, self.start_together = keep_local_steps, start_together
        self.tokens_per_step, self.take_global_at_end = tokens_per_step, take_global_at_end
        self.learner: Learner | None = None
        self.versions: list[int] | None = None  # of the global model taken at the end
        self._seen_tokens = 0
        self._lease = None  # keep_lease() held over the Trainer's save and evaluation
        self._lease_lock = threading.Lock()  # released by training or by a timer

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # transformers 5 says "no"/"all"/...; 4.x a bool: False (its default) or None counts none
        counting = getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False, None)
        if self.tokens_per_step is None and not counting:
            raise LearnerError(
                "DiLoCoCallback needs token counts for the merge weights: set "
                "TrainingArguments(include_num_input_tokens_seen=True) or pass tokens_per_step"
            )
        engine = _TrainerEngine(model, optimizer, state)
        if (
            engine.stage == 0
            and model is not None
            and any(hasattr(p, "ds_id") for p in model.parameters())
        ):
            # A second train() of the Trainer in this process: it trains on with its first
            # call's ZeRO-3 engine but gives callbacks a fresh plain optimizer, not that
            # engine's (it was refused as "needs the Trainer to run DeepSpeed ZeRO-3").
            raise LearnerError(
                "DiLoCoCallback: the Trainer's model is partitioned by DeepSpeed ZeRO-3, but "
                "the Trainer gives callbacks no ZeRO-3 optimizer, as in a second train() in "
                "one process: train again in a new process (resume_from_checkpoint=... resumes "
                "the Trainer's own checkpoint)"
            )
        if engine.stage == 0:  # stages 1 and 2 are named by the Learner's own check
            raise LearnerError(
                "DiLoCoCallback needs the Trainer to run DeepSpeed ZeRO-3: "
                "TrainingArguments(deepspeed=CONFIG) with zero_optimization.stage 3, or "
                "`accelerate launch --use_deepspeed --zero_stage 3`"
            )
        # On CPU a Trainer without use_configured_state set accelerate's state up again with
        # no process group backend: each rank counted one process and took itself for the
        # main one (the same batches on every rank, or a gloo error in the token count's
        # gather), once the island had joined the run.
        world = zero.rank_and_world()[1] if zero.initialized() else None
        counted = getattr(args, "world_size", world)
        if world is not None and counted != world:
            raise LearnerError(
                f"the Trainer counts {counted} process(es), the process group has {world}: "
                "on CPU call ds_diloco.zero.prepare_cpu_accelerate() before TrainingArguments and "
                'pass TrainingArguments(accelerator_config={"use_configured_state": True})'
            )
        self.learner = Learner(
            engine, self.coordinator, self.island, token=self.token, alpha=self.alpha,
            keep_local_steps=self.keep_local_steps, connect_timeout_s=self.connect_timeout_s,
            ca_file=self.ca_file,
        )  # fmt: skip
        self.learner.start_together(self.start_together)
        self._seen_tokens = state.num_input_tokens_seen

    def _hold_lease_if(self, control) -> None:
        """The Trainer saves a checkpoint and evaluates after ``on_step_end``/``on_epoch_end``
        (its DefaultFlowCallback, called first, has set ``control``): minutes for a large
        model, and the island's lease lapsed meanwhile (the island CLI keeps it over its
        saves too). Held until training goes on."""
        if self.learner is None or control is None:
            return
        if not (control.should_save or control.should_evaluate):
            return
        with self._lease_lock:
            if self._lease is not None:
                return
            lease = self.learner.keep_lease()
            lease.__enter__()
            timer = threading.Timer(LEASE_HOLD_S, self._release_lease, args=(lease,))
            timer.daemon = True
            self._lease = (lease, timer)
        timer.start()

    def _release_lease(self, only=None) -> None:
        """Training went on (or the timer, ``only`` its own lease, ran out)."""
        with self._lease_lock:
            if self._lease is None or (only is not None and self._lease[0] is not only):
                return
            (lease, timer), self._lease = self._lease, None
        timer.cancel()
        lease.__exit__(None, None, None)

    def on_step_begin(self, args, state, control, **kwargs):
        self._release_lease()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._release_lease()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._hold_lease_if(control)

    def on_substep_end(self, args, state, control, **kwargs):
        """A micro-batch of a gradient accumulation: training goes on (the island's lease)."""
        if self.learner is not None:
            self.learner.syncer.alive()

    def on_step_end(self, args, state, control, **kwargs):
        if self.tokens_per_step is not None:
            tokens = self.tokens_per_step
        else:
            # The Trainer's count is the island's (summed over ranks, the same on every
            # rank); the learner sums its ranks' shares, so each passes its share.
            island = state.num_input_tokens_seen - self._seen_tokens
            self._seen_tokens = state.num_input_tokens_seen
            world, rank = self.learner.world_size, self.learner.rank
            tokens = island // world + (island % world if rank == 0 else 0)
        self.learner.step(tokens=int(tokens))
        self._hold_lease_if(control)

    def on_train_end(self, args, state, control, **kwargs):
        self._release_lease()
        if self.learner is None:
            return
        # load_best_model_at_end: the Trainer has loaded its best checkpoint into the engine
        # by now; flushed, the last steps' pseudo-gradients would be global - that checkpoint
        # (a pull back towards it, merged). Those steps are left out instead.
        # Only when it loaded one: with no evaluation run (max_steps < eval_steps) it has none,
        # and the engine holds the trained weights.
        best = getattr(state, "best_model_checkpoint", None) if state is not None else None
        flush = not (getattr(args, "load_best_model_at_end", False) and best is not None)
        if not flush:
            log.warning("load_best_model_at_end: the steps since each fragment's last send "
                        "are not sent (the Trainer replaced the weights with its best checkpoint)")  # fmt: skip
        try:
            self.versions = self.learner.close(
                leave=True, take_global=self.take_global_at_end, flush=flush
            )
        except LearnerError as e:  # raised, it would lose the trained model with train()
            log.error("%s; the Trainer's model keeps this island's own weights", e)
