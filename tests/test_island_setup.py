"""What an island derives from its config before training: DeepSpeed's batch sizes and
the inner learning-rate schedule."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import re

import pytest

from ds_diloco.config import TOKEN_ENV, DataConfig, IslandConfig, ModelSource, TrainConfig
from ds_diloco.island import _launch_failure, deepspeed_config, lr_multiplier


def island(tmp_path, tiny_config_path, ds: dict, **train) -> IslandConfig:
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, **ds}))
    return IslandConfig(
        island="a", coordinator_url="http://127.0.0.1:1", model=ModelSource(config=tiny_config_path),
        deepspeed_config=str(tmp_path / "ds.json"), data=DataConfig(path=str(tmp_path)),
        train=TrainConfig(**train),
    )  # fmt: skip


@pytest.mark.parametrize("given", [{}, {"train_micro_batch_size_per_gpu": "auto",
                                        "gradient_accumulation_steps": "auto"},
                                   {"train_micro_batch_size_per_gpu": 4,
                                    "gradient_accumulation_steps": 3, "train_batch_size": 999}])  # fmt: skip
def test_the_batch_sizes_come_from_train(tmp_path, tiny_config_path, given):
    ds = deepspeed_config(island(tmp_path, tiny_config_path, given, micro_batch=4, grad_accum=3), 2)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 2  # per island: its world size


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps is 8, but train.grad_accum is 2"),
        ({"train_micro_batch_size_per_gpu": 16}, "train_micro_batch_size_per_gpu is 16, but train.micro_batch is 4"),
    ],
)  # fmt: skip
def test_a_batch_size_the_file_sets_otherwise_is_refused_not_replaced(
    tmp_path, tiny_config_path, given, message
):
    cfg = island(tmp_path, tiny_config_path, given, micro_batch=4, grad_accum=2)
    with pytest.raises(ValueError, match=message):
        deepspeed_config(cfg, 1)


@pytest.mark.parametrize(
    ("given", "key"),
    [
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),  # DeepSpeed: off, an fp32 island
        ({"gradient_clipping": "auto"}, "gradient_clipping"),  # a TypeError at the first step
        ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
         "zero_optimization.reduce_bucket_size"),  # DeepSpeed's default, not the Trainer's
    ],
)  # fmt: skip
def test_an_auto_that_only_the_hf_trainer_fills_is_refused_naming_it(
    tmp_path, tiny_config_path, given, key
):
    # Hugging Face's example configs say "auto" throughout; DeepSpeed itself drops an "auto"
    # it meets for its default (bf16 off: the island trained in fp32, silently) or keeps it
    # (gradient_clipping: '>' not supported between 'str' and 'float' in the first step).
    cfg = island(tmp_path, tiny_config_path, given)
    with pytest.raises(ValueError, match=rf'{re.escape(key)} is "auto"'):
        deepspeed_config(cfg, 1)


def test_an_auto_in_the_unused_optimizer_section_is_left_with_it(tmp_path, tiny_config_path):
    sections = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    assert "optimizer" not in deepspeed_config(island(tmp_path, tiny_config_path, sections), 1)


def test_the_files_optimizer_and_scheduler_are_not_used_and_it_is_said(
    tmp_path, tiny_config_path, caplog
):
    sections = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                "scheduler": {"type": "WarmupLR"}}  # fmt: skip
    cfg = island(tmp_path, tiny_config_path, sections)
    with caplog.at_level(logging.WARNING, logger="ds_diloco.island"):
        ds = deepspeed_config(cfg, 1, warn=True)
        assert "optimizer" not in ds and "scheduler" not in ds
        assert "its optimizer and scheduler section(s) are not used" in caplog.text
        caplog.clear()
        deepspeed_config(cfg, 1)  # the other ranks: not said again
        assert caplog.text == ""


def test_the_learning_rate_warms_up_then_stays_or_follows_half_a_cosine(tmp_path):
    constant = TrainConfig(steps=10, lr=1e-3, warmup_steps=4)
    assert [lr_multiplier(constant, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = TrainConfig(steps=10, lr=1e-3, warmup_steps=4, lr_schedule="cosine", min_lr=1e-4)
    got = [lr_multiplier(cosine, s) for s in range(10)]
    assert got[:3] == [0.25, 0.5, 0.75]
    assert got[9] == pytest.approx(0.1)  # min_lr / lr at the last step
    assert all(a > b for a, b in itertools.pairwise(got[3:]))  # decays after the warm-up
    assert got[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    no_warmup = TrainConfig(steps=4, lr=1e-3, lr_schedule="cosine")
    assert [lr_multiplier(no_warmup, s) for s in range(4)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]
    )


def test_a_value_error_while_training_is_a_failure_of_the_launch_not_of_its_input():
    # The CLI answers a ValueError with exit status 2, "config or input error", which
    # `ds-diloco run` does not restart: one raised in the loop gave the island up for good.
    failing = pytest.raises(RuntimeError, match=r"island 'a' rank 1: no median")
    with failing as caught, _launch_failure("a", 1):
        raise ValueError("no median for empty data")
    assert not isinstance(caught.value, ValueError)


def test_a_token_missing_on_some_nodes_is_left_to_the_learner_which_raises_on_every_rank(
    tmp_path, tiny_config_path, monkeypatch
):
    # The deepspeed launcher starts a multi-node island's ranks over ssh with none of the
    # shell's variables: DS_DILOCO_TOKEN may be set on some nodes only. The island asked
    # IslandConfig.resolve_token() first, which raised on the ranks without it alone (exit
    # status 2) while the others waited for them in the Learner's first collective (on gloo
    # "Connection closed by peer"; on NCCL a hang). The Learner agrees on it over the island.
    from ds_diloco import island as island_module

    class Joined(Exception):
        pass

    def learner(engine, url, name, *, token, **kwargs):
        raise Joined(token)

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setattr(island_module.zero, "init_distributed", lambda: (1, 2))
    monkeypatch.setattr(island_module, "load_blocks", lambda cfg, rank: (None, None))
    monkeypatch.setattr(island_module.zero, "build_engine", lambda *args: object())
    monkeypatch.setattr(island_module, "Learner", learner)
    cfg = dataclasses.replace(island(tmp_path, tiny_config_path, {}), workdir=str(tmp_path / "w"))
    with pytest.raises(Joined) as joined:
        island_module.run_island(cfg)
    assert joined.value.args == (None,)  # the Learner looks for $DS_DILOCO_TOKEN itself
    with pytest.raises(Joined) as joined:
        island_module.run_island(dataclasses.replace(cfg, token="from-config"))
    assert joined.value.args == ("from-config",)
