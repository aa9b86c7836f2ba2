"""Learner and DiLoCoCallback misuse that is caught before any process group or socket."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from ds_diloco.hf_callback import DiLoCoCallback
from ds_diloco.learner import Learner, LearnerError, zero_stage
from ds_diloco.run import free_port


def test_a_model_that_is_not_a_deepspeed_engine_is_refused_by_type():
    with pytest.raises(TypeError, match=r"needs a DeepSpeed engine .*got Linear"):
        Learner(torch.nn.Linear(2, 2), "http://127.0.0.1:1", "a", token="t")


class FakeEngine:  # only what the stage check reads: the check comes before anything else
    module = torch.nn.Linear(2, 2)

    def __init__(self, stage):
        self.stage = stage

    def zero_optimization_stage(self):
        return self.stage


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_engine_below_zero_stage_3_is_refused_with_its_stage(stage):
    assert zero_stage(FakeEngine(stage)) == stage
    with pytest.raises(LearnerError, match=rf"needs a ZeRO stage 3 engine .* is stage {stage}"):
        Learner(FakeEngine(stage), "http://127.0.0.1:1", "a", token="t")


def test_no_token_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv("DS_DILOCO_TOKEN", raising=False)
    with pytest.raises(LearnerError, match="DS_DILOCO_TOKEN"):
        Learner(FakeEngine(3), "http://127.0.0.1:1", "a")


def test_alpha_out_of_range_is_refused():
    with pytest.raises(LearnerError, match=r"alpha .* \[0, 1\)"):
        Learner(FakeEngine(3), "http://127.0.0.1:1", "a", token="t", alpha=1.0)


def args(**kw):
    base = {"include_num_input_tokens_seen": "all", "deepspeed": {"zero_optimization": {}}}
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("counting", ["no", False, None])
def test_the_callback_needs_token_counts(counting):
    # transformers 4.x's default is False: it passed, and every upload carried 0 tokens
    # (weighed out: the island never counted in a merge, and nothing said so).
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    with pytest.raises(LearnerError, match="include_num_input_tokens_seen=True"):
        cb.on_train_begin(args(include_num_input_tokens_seen=counting), None, None)


def test_the_callback_needs_deepspeed():
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    with pytest.raises(LearnerError, match="TrainingArguments\\(deepspeed=CONFIG\\)"):
        cb.on_train_begin(args(deepspeed=None), None, None)


def test_a_second_train_of_a_zero3_trainer_is_named_as_such():
    # trainer.train() again in the same process (a notebook): the Trainer trains on with its
    # first call's ZeRO-3 engine but gives callbacks a fresh plain AdamW; it was refused as
    # "needs the Trainer to run DeepSpeed ZeRO-3", which it did.
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.ds_id = 0  # what DeepSpeed's ZeRO-3 partitioning leaves on every parameter
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    with pytest.raises(LearnerError, match=r"partitioned by DeepSpeed ZeRO-3, .*a second "
                       r"train\(\) in one process: train again in a new process"):  # fmt: skip
        cb.on_train_begin(args(), None, None, model=model,
                          optimizer=torch.optim.AdamW(model.parameters()))  # fmt: skip
    assert cb.learner is None


def _optimizer(kind: str, **attrs):
    """An instance of DeepSpeed's own ZeRO optimizer class (not built: only its type and
    the attributes the callback reads matter here)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    cls = {"zero3": DeepSpeedZeroOptimizer_Stage3, "zero12": DeepSpeedZeroOptimizer}[kind]
    opt = object.__new__(cls)
    opt.__dict__.update(attrs)
    return opt


@pytest.mark.parametrize(
    ("optimizer", "stage"),
    [
        (lambda: _optimizer("zero3"), 3),
        # accelerate wraps it: DeepSpeedOptimizerWrapper.optimizer
        (lambda: types.SimpleNamespace(optimizer=_optimizer("zero3")), 3),
        (lambda: _optimizer("zero12", partition_gradients=True), 2),
        (lambda: _optimizer("zero12", partition_gradients=False), 1),
        (lambda: torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), 0),
    ],
)
def test_the_callback_reads_the_zero_stage_from_the_optimizer_the_trainer_runs(optimizer, stage):
    # Not from TrainingArguments.deepspeed, unset under `accelerate launch --use_deepspeed`
    # (a ZeRO-3 Trainer was refused); and stage 2 was reported as stage 0.
    from ds_diloco.hf_callback import _TrainerEngine

    assert (
        _TrainerEngine(torch.nn.Linear(2, 2), optimizer(), None).zero_optimization_stage() == stage
    )


def test_the_callback_names_the_zero_stage_it_got():
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    zero2 = _optimizer("zero12", partition_gradients=True)
    with pytest.raises(LearnerError, match=r"needs a ZeRO stage 3 engine .* is stage 2"):
        cb.on_train_begin(args(deepspeed=None), None, None, model=torch.nn.Linear(2, 2),
                          optimizer=zero2)  # fmt: skip


def test_the_callback_joins_a_zero3_trainer_that_accelerate_launched(monkeypatch):
    # `accelerate launch --use_deepspeed --zero_stage 3`: TrainingArguments.deepspeed is
    # None, the optimizer is ZeRO-3's. Refused before; now the learner is made.
    from ds_diloco import hf_callback

    made = []

    class Joined:  # stands in for the Learner (needs a process group and a coordinator)
        def __init__(self, engine, *a, **kw):
            made.append((engine.zero_optimization_stage(), kw["ca_file"]))

        def start_together(self, n):
            pass

    monkeypatch.setattr(hf_callback, "Learner", Joined)
    cb = DiLoCoCallback("https://127.0.0.1:1", island="a", token="t", ca_file="ca.pem")
    state = types.SimpleNamespace(num_input_tokens_seen=0)
    wrapped = types.SimpleNamespace(optimizer=_optimizer("zero3"))  # accelerate's wrapper
    cb.on_train_begin(args(deepspeed=None), state, None, model=torch.nn.Linear(2, 2),
                      optimizer=wrapped)  # fmt: skip
    assert made == [(3, "ca.pem")]  # the CA an https:// coordinator is checked against


@pytest.mark.parametrize(
    ("best", "loaded"), [(False, None), (True, "out/checkpoint-8"), (True, None)]
)
def test_the_callback_sends_no_last_steps_after_the_trainer_loaded_its_best_checkpoint(
    best, loaded
):
    # load_best_model_at_end: the Trainer loads that checkpoint before on_train_end; the
    # flush then uploaded global - checkpoint (a pull back towards it), and it was merged.
    from types import SimpleNamespace

    from ds_diloco.hf_callback import DiLoCoCallback

    class Closing:  # what the callback asks of its Learner at the end
        def close(self, **kw):
            self.kw = kw
            return [1]

    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", tokens_per_step=1)
    cb.learner = Closing()
    state = SimpleNamespace(best_model_checkpoint=loaded)  # None: no evaluation ran, none loaded
    cb.on_train_end(SimpleNamespace(load_best_model_at_end=best), state, None)
    assert cb.learner.kw["flush"] is (loaded is None) and cb.learner.kw["leave"] is True


def test_the_errors_a_learner_step_raises_are_public():
    import ds_diloco
    from ds_diloco import syncer

    assert ds_diloco.Superseded is syncer.Superseded and ds_diloco.Diverged is syncer.Diverged
    assert {"Diverged", "Superseded"} <= set(ds_diloco.__all__)


def test_the_callbacks_micro_batches_keep_the_islands_lease():
    # Only optimizer steps counted: a Trainer's long accumulation let the lease lapse.
    from types import SimpleNamespace

    alive = []
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", tokens_per_step=1)
    cb.on_substep_end(None, None, None)  # not joined yet: nothing to keep
    cb.learner = SimpleNamespace(syncer=SimpleNamespace(alive=lambda: alive.append(1)))
    cb.on_substep_end(None, None, None)
    assert alive == [1]


def test_the_callback_keeps_the_lease_over_the_trainers_saves_and_evaluations(monkeypatch):
    # The Trainer saves and evaluates after on_step_end: no step, no micro-batch meanwhile,
    # and a save of a large model's ZeRO-3 checkpoint (minutes) lost the island its lease
    # ("no training step for ... s: heartbeats stop"): quorums closed without it.
    import contextlib
    import time
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import DefaultFlowCallback
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    from ds_diloco import hf_callback

    kept = []  # keep_lease() contexts open

    @contextlib.contextmanager
    def keep_lease():
        kept.append(1)
        try:
            yield
        finally:
            kept.pop()

    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", tokens_per_step=1)
    cb.learner = SimpleNamespace(step=lambda tokens: [], keep_lease=keep_lease,
                                 close=lambda **kw: [1])  # fmt: skip
    args = SimpleNamespace(logging_first_step=False, logging_strategy=IntervalStrategy.NO,
                           eval_strategy=IntervalStrategy.STEPS, eval_delay=0,
                           save_strategy=SaveStrategy.STEPS, load_best_model_at_end=False)  # fmt: skip
    state = TrainerState(max_steps=4, eval_steps=3, save_steps=2)
    control, flow, held = TrainerControl(), DefaultFlowCallback(), []
    for step in range(1, 5):  # the Trainer's order of calls
        cb.on_step_begin(args, state, control)
        held.append(len(kept))  # training went on: released
        state.global_step = step
        flow.on_step_end(args, state, control)  # the Trainer's own callback comes first
        cb.on_step_end(args, state, control)
        held.append(len(kept))  # over _maybe_log_save_evaluate
        control.should_save = control.should_evaluate = False
    cb.on_train_end(args, state, control)
    assert held == [0, 0, 0, 1, 0, 1, 0, 1] and kept == []  # saved at 2 and 4, evaluated at 3
    # An epoch's save, and a save that never returns (train() raised) lets go in time.
    # 1 s, not 0.1 s: the lease must still be held at the next line however late it runs,
    # and the release is waited for, not slept for (0.5 s: a late timer thread failed it).
    monkeypatch.setattr(hf_callback, "LEASE_HOLD_S", 1.0)
    cb.on_epoch_end(args, state, TrainerControl(should_save=True))
    assert kept == [1]
    deadline = time.monotonic() + 20
    while kept and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kept == []


def test_accelerate_on_cpu_without_a_launcher_is_a_world_of_one():
    # `python examples/hf_trainer.py`: accelerate made no process group and torch raised
    # "Default process group has not been initialized" from inside PartialState.
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(DS_ACCELERATOR="cpu", DS_DILOCO_TEST_PORT=str(free_port()))
    script = (
        "import os; os.environ['MASTER_PORT'] = os.environ['DS_DILOCO_TEST_PORT']\n"
        "from ds_diloco import zero\n"
        "zero.prepare_cpu_accelerate()\n"
        "from accelerate import PartialState\n"
        "print('processes', PartialState().num_processes)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "processes 1" in proc.stdout, proc.stderr[-2000:]


def test_the_modules_the_readme_names_are_reached_from_import_ds_diloco():
    # README: `ds_diloco.zero.prepare_cpu_accelerate()`, `ds_diloco.stall_exit.StallExit(600)`;
    # after a bare `import ds_diloco` both raised AttributeError (a fresh interpreter: here
    # the test's own imports have loaded them).
    script = (
        "import ds_diloco\n"
        "print(ds_diloco.zero.prepare_cpu_accelerate.__name__, ds_diloco.stall_exit.StallExit.__name__)\n"
        "try:\n    ds_diloco.no_such_module\nexcept AttributeError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prepare_cpu_accelerate StallExit" in proc.stdout, proc.stdout
    assert "has no attribute 'no_such_module'" in proc.stdout, proc.stdout


def test_the_callback_refuses_a_trainer_that_counts_another_number_of_processes(monkeypatch):
    # On CPU without use_configured_state the Trainer counted 1 process on each of 2 ranks:
    # both read the same batches as "main process", or its token gather failed in gloo
    # ("invalid output tensor list"), after the island had joined the run.
    from ds_diloco import hf_callback

    monkeypatch.setattr(hf_callback.zero, "initialized", lambda: True)
    monkeypatch.setattr(hf_callback.zero, "rank_and_world", lambda: (0, 2))
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    with pytest.raises(LearnerError, match=r"counts 1 process\(es\), the process group has 2"):
        cb.on_train_begin(args(world_size=1), None, None, model=torch.nn.Linear(2, 2),
                          optimizer=_optimizer("zero3"))  # fmt: skip
    assert cb.learner is None
