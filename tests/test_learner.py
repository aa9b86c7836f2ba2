"""Learner and DiLoCoCallback misuse that is caught before any process group or socket."""

from __future__ import annotations

import types

import pytest
import torch

from ds_diloco.hf_callback import DiLoCoCallback
from ds_diloco.learner import Learner, LearnerError, zero_stage


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


def test_the_callback_needs_token_counts():
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    with pytest.raises(LearnerError, match="include_num_input_tokens_seen=True"):
        cb.on_train_begin(args(include_num_input_tokens_seen="no"), None, None)


def test_the_callback_needs_deepspeed():
    cb = DiLoCoCallback("http://127.0.0.1:1", island="a", token="t")
    with pytest.raises(LearnerError, match="TrainingArguments\\(deepspeed=CONFIG\\)"):
        cb.on_train_begin(args(deepspeed=None), None, None)
