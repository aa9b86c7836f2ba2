from __future__ import annotations

import json
import random
from itertools import pairwise

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_diloco.fragments import (
    Fragment,
    FragmentPlan,
    ParamSpec,
    Schedule,
    param_specs,
    signature,
)


def _llama_specs(tie: bool = True) -> list[ParamSpec]:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return param_specs(LlamaForCausalLM(config).named_parameters())


@pytest.fixture(scope="module")
def llama() -> list[ParamSpec]:
    return _llama_specs(tie=True)


def _specs(*pairs: tuple[str, tuple[int, ...]]) -> list[ParamSpec]:
    return [ParamSpec(n, s) for n, s in pairs]


def _membership(plan: FragmentPlan) -> dict[str, int]:
    return {s.name: plan.fragment_of(s.name) for s in plan.specs}


# -- specs and signature --------------------------------------------------------


def test_param_specs_reads_ds_shape_of_partitioned_params():
    t = torch.empty(0)
    t.ds_shape = (3, 4)  # what ZeRO-3 leaves on a partitioned parameter
    specs = param_specs([("a", t), ("b", torch.zeros(5, 2))])
    assert specs == [ParamSpec("a", (3, 4)), ParamSpec("b", (5, 2))]
    assert specs[0].numel == 12 and specs[0].nbytes == 48


def test_param_specs_rejects_duplicate_names():
    with pytest.raises(ValueError, match="duplicate"):
        param_specs([("a", torch.zeros(1)), ("a", torch.zeros(2))])


def test_param_spec_normalises_shape_to_int_tuple():
    assert ParamSpec("a", torch.Size([2, 3])) == ParamSpec("a", [2, 3])  # type: ignore[arg-type]
    assert ParamSpec("s", ()).numel == 1  # a scalar has one element


def test_signature_changes_with_name_shape_and_order():
    base = _specs(("a", (2, 3)), ("b", (4,)))
    sig = signature(base)
    assert signature(_specs(("a", (2, 3)), ("b", (4,)))) == sig
    assert signature(_specs(("a", (3, 2)), ("b", (4,)))) != sig
    assert signature(_specs(("a", (2, 3)), ("c", (4,)))) != sig
    assert signature(_specs(("b", (4,)), ("a", (2, 3)))) != sig
    # Pinned (sha256 of "a:2x3\nb:4"): islands and coordinators of different builds
    # must agree on the format.
    assert sig == "2e29c23908f3674ead8a4dca9108b63d7b3bf872789eed0362b5f341a471a40b"


# -- fragments and balanced plans -------------------------------------------------


def test_fragment_offsets_follow_params_in_order():
    f = Fragment(0, tuple(_specs(("a", (2, 3)), ("b", (4,)), ("c", (1, 1)))))
    assert f.offsets == (0, 6, 10)
    assert f.numel == 11 and f.names == ("a", "b", "c")


def test_balanced_follows_greedy_rule_on_hand_example():
    # LPT: 5->f0, 4->f1, 3(c)->f1 (4<5), 3(d)->f0 (5<7), 2->f1 (8>7).
    specs = _specs(("e", (2,)), ("a", (5,)), ("c", (3,)), ("b", (4,)), ("d", (3,)))
    plan = FragmentPlan.balanced(specs, 2)
    assert [f.names for f in plan.fragments] == [("a", "d"), ("e", "c", "b")]  # model order
    assert [f.numel for f in plan.fragments] == [8, 9]
    # Equal loads go to the lowest index.
    plan = FragmentPlan.balanced(_specs(("x", (1,)), ("y", (1,)), ("z", (1,))), 3)
    assert [f.names for f in plan.fragments] == [("x",), ("y",), ("z",)]


@pytest.mark.parametrize("num_fragments", [2, 4, 8])
def test_balanced_llama_partition_and_balance(llama, num_fragments):
    plan = FragmentPlan.balanced(llama, num_fragments)
    assert len(plan) == num_fragments
    names = [n for f in plan.fragments for n in f.names]
    assert sorted(names) == sorted(s.name for s in llama)  # every tensor exactly once
    assert all(f.params for f in plan.fragments)
    for f in plan.fragments:  # inside a fragment, params stay in model order
        pos = [[s.name for s in llama].index(n) for n in f.names]
        assert pos == sorted(pos)

    sizes = [f.nbytes for f in plan.fragments]
    mean = sum(sizes) / num_fragments
    largest = max(s.nbytes for s in llama)
    # Greedy bound: the heaviest fragment's last tensor went into the lightest bin,
    # whose load was then <= mean.
    assert max(sizes) <= mean + largest
    # Graham's LPT bound, against the lower bound max(mean, largest) on the optimum.
    assert max(sizes) <= (4 / 3 - 1 / (3 * num_fragments)) * max(mean, largest)
    assert plan.max_imbalance == pytest.approx(max(sizes) / mean)

    # Naive contiguous split with equal tensor counts is much burstier.
    n = len(llama)
    chunks = [
        llama[i * n // num_fragments : (i + 1) * n // num_fragments] for i in range(num_fragments)
    ]
    naive = [sum(s.nbytes for s in c) for c in chunks]
    assert plan.max_imbalance < max(naive) / mean


def test_balanced_llama_p8_is_optimal(llama):
    # The embedding (128 KiB) is larger than the mean fragment, so no plan beats it.
    plan = FragmentPlan.balanced(llama, 8)
    assert max(f.nbytes for f in plan.fragments) == max(s.nbytes for s in llama)


def test_balanced_depends_only_on_names_and_shapes(llama):
    plan = FragmentPlan.balanced(llama, 4)
    assert FragmentPlan.balanced(llama, 4).to_json() == plan.to_json()
    shuffled = list(llama)
    random.Random(0).shuffle(shuffled)
    other = FragmentPlan.balanced(shuffled, 4)
    # Llama has many equal-sized tensors: ties must not be broken by model order.
    assert _membership(other) == _membership(plan)
    assert other.specs == tuple(shuffled)  # but the model order is the caller's
    assert other.signature != plan.signature


def test_balanced_errors(llama):
    for bad in (0, len(llama) + 1):
        with pytest.raises(ValueError, match=rf"num_fragments.*{len(llama)} tensors"):
            FragmentPlan.balanced(llama, bad)
    assert len(FragmentPlan.balanced(llama, len(llama))) == len(llama)
    with pytest.raises(ValueError, match="duplicate"):
        FragmentPlan.balanced(_specs(("a", (1,)), ("a", (2,))), 1)


# -- layer plans ------------------------------------------------------------------


def test_by_layer_llama_groups_whole_blocks(llama):
    plan = FragmentPlan.by_layer(llama, 2)
    assert plan.fragment_of("model.embed_tokens.weight") == 0
    assert plan.fragment_of("model.norm.weight") == 1
    for s in llama:
        if ".layers." in s.name:
            block = int(s.name.split(".")[2])
            assert plan.fragment_of(s.name) == block // 2
    untied = FragmentPlan.by_layer(_llama_specs(tie=False), 4)
    assert untied.fragment_of("lm_head.weight") == 3
    assert untied.fragment_of("model.norm.weight") == 3
    assert untied.fragment_of("model.embed_tokens.weight") == 0


@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4, 5])
def test_by_layer_contiguous_near_equal_groups(num_fragments):
    specs = [ParamSpec("transformer.wte.weight", (10, 4))]
    for i in range(5):
        specs += _specs((f"transformer.h.{i}.attn.w", (4, 4)), (f"transformer.h.{i}.mlp.w", (4, 8)))
    specs += _specs(("transformer.ln_f.weight", (4,)), ("lm_head.weight", (10, 4)))
    plan = FragmentPlan.build(specs, num_fragments, "layer")
    groups = [sorted({int(n.split(".")[2]) for n in f.names if ".h." in n}) for f in plan.fragments]
    assert [b for g in groups for b in g] == list(range(5))  # contiguous, in order
    counts = [len(g) for g in groups]
    assert max(counts) - min(counts) <= 1
    assert plan.fragment_of("transformer.wte.weight") == 0
    assert plan.fragment_of("transformer.ln_f.weight") == num_fragments - 1
    assert plan.fragment_of("lm_head.weight") == num_fragments - 1


def test_by_layer_errors(llama):
    with pytest.raises(ValueError, match=r"num_fragments.*4 blocks"):
        FragmentPlan.by_layer(llama, 5)
    with pytest.raises(ValueError, match="num_fragments"):
        FragmentPlan.by_layer(llama, 0)
    with pytest.raises(ValueError, match="no transformer blocks"):
        FragmentPlan.by_layer(_specs(("fc1.weight", (2, 2)), ("fc2.weight", (2, 2))), 1)
    with pytest.raises(ValueError, match="strategy"):
        FragmentPlan.build(llama, 2, "random")


# -- plan object ------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["balanced", "layer"])
def test_plan_json_round_trip(llama, strategy):
    shuffled = list(llama)
    random.Random(1).shuffle(shuffled)  # model order differs from fragment order
    for specs in (llama, shuffled):
        plan = FragmentPlan.build(specs, 4, strategy)
        back = FragmentPlan.from_json(json.loads(json.dumps(plan.to_json())))
        assert back == plan
        assert back.specs == tuple(specs) and back.signature == signature(specs)
        assert [f.offsets for f in back.fragments] == [f.offsets for f in plan.fragments]


def test_plan_from_json_rejects_tampering(llama):
    d = FragmentPlan.balanced(llama, 2).to_json()
    bad_sig = {
        **d,
        "params": [[n, [*s, 1]] if i == 0 else [n, s] for i, (n, s) in enumerate(d["params"])],
    }
    with pytest.raises(ValueError, match="signature"):
        FragmentPlan.from_json(bad_sig)
    with pytest.raises(ValueError, match="unknown parameter"):
        FragmentPlan.from_json(
            {**d, "fragments": [[*d["fragments"][0], "ghost"], d["fragments"][1]]}
        )
    with pytest.raises(ValueError, match="exactly once"):
        FragmentPlan.from_json({**d, "fragments": [d["fragments"][0], d["fragments"][1][1:]]})
    # Refused by the plan itself (build's own check, tested above, is not reached here).
    with pytest.raises(ValueError, match=r"^strategy must be one of .*, got 'random'"):
        FragmentPlan.from_json({**d, "strategy": "random"})


def test_plan_fragment_of_unknown_name(llama):
    with pytest.raises(KeyError, match="ghost"):
        FragmentPlan.balanced(llama, 2).fragment_of("ghost")


# -- schedule ---------------------------------------------------------------------


def test_schedule_h_equals_p_round_robin():
    sched = Schedule(sync_every=24, num_fragments=24, overlap=2)
    assert sched.stride == 1
    assert [sched.due(s) for s in range(1, 49)] == list(range(24)) * 2
    assert sched.apply_at(5) == 7


def test_schedule_staggered():
    sched = Schedule(sync_every=8, num_fragments=4, overlap=1)
    assert sched.stride == 2
    assert [sched.due(s) for s in range(1, 11)] == [None, 0, None, 1, None, 2, None, 3, None, 0]
    assert sched.sends_between(0, 10) == [(2, 0), (4, 1), (6, 2), (8, 3), (10, 0)]
    assert sched.sends_between(3, 7) == [(4, 1), (6, 2)]
    assert sched.sends_between(5, 5) == []
    assert sched.apply_at(10) == 11
    with pytest.raises(ValueError, match="step"):
        sched.due(0)


@pytest.mark.parametrize(("h", "p"), [(24, 24), (8, 4), (12, 3), (5, 1), (30, 6)])
def test_schedule_every_fragment_exactly_h_apart(h, p):
    sched = Schedule(sync_every=h, num_fragments=p, overlap=h - 1)
    sends = sched.sends_between(0, 5 * h)
    assert sends == [(s, sched.due(s)) for s in range(1, 5 * h + 1) if sched.due(s) is not None]
    for frag in range(p):
        steps = [s for s, f in sends if f == frag]
        assert len(steps) == 5
        assert steps[0] == (frag + 1) * (h // p)
        assert all(b - a == h for a, b in pairwise(steps))
        # The result is applied before the same fragment is sent again.
        assert all(sched.apply_at(a) < b for a, b in pairwise(steps))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sync_every": 0, "num_fragments": 1, "overlap": 0}, "sync_every"),
        ({"sync_every": 8, "num_fragments": 0, "overlap": 0}, "num_fragments"),
        ({"sync_every": 8, "num_fragments": 3, "overlap": 0}, "multiple of num_fragments"),
        ({"sync_every": 8, "num_fragments": 4, "overlap": 8}, "overlap"),
        ({"sync_every": 8, "num_fragments": 4, "overlap": -1}, "overlap"),
    ],
)
def test_schedule_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Schedule(**kwargs)


def test_schedule_is_keyword_only():
    with pytest.raises(TypeError):
        Schedule(8, 4, 1)  # type: ignore[misc]
    assert Schedule(sync_every=8, num_fragments=4, overlap=7).overlap == 7


def test_join_phase_sends_with_the_rounds_after_a_restart():
    s = Schedule(sync_every=24, num_fragments=24, overlap=2)
    # The rounds are 5.4 steps past position 0 (fragment 23's send); this island resumes
    # at step 60 (it would send fragment 11 after step 61): in phase it sends fragment 5,
    # the rounds' next one, and then follows them step by step.
    phase = s.join_phase(clock=5.4, last_step=60)
    assert 0 <= phase < 24
    assert (
        [s.due(step + phase) for step in (61, 62, 63)]
        == [s.due(6), s.due(7), s.due(8)]
        == [5, 6, 7]
    )
    assert s.join_phase(clock=5.4, last_step=5) == 0  # already in phase
    s8 = Schedule(sync_every=8, num_fragments=4, overlap=2)
    assert [s8.due(s8.position(f) or 8) for f in range(4)] == [0, 1, 2, 3]  # due's inverse
    s2 = Schedule(sync_every=8, num_fragments=4, overlap=2)  # a send every 2 steps
    phase = s2.join_phase(clock=3.2, last_step=10)
    assert [s2.due(step + phase) for step in (11, 12)] == [s2.due(4), s2.due(5)] == [1, None]


def test_a_signature_mismatch_is_said_in_parameters():
    # The Learner's refusal gave two hash prefixes only: a wrapped or PEFT model, or one
    # extra tensor, could not be told from them.
    from ds_diloco.fragments import ParamSpec, spec_difference

    run = [ParamSpec("embed.weight", (8, 4)), ParamSpec("a.weight", (4, 4)), ParamSpec("b", (4,))]
    here = [
        ParamSpec("embed.weight", (8, 4)),
        ParamSpec("a.weight", (4, 2)),
        ParamSpec("lora", (2,)),
    ]
    said = spec_difference(here, run)
    assert "1 of the run's missing here (b)" in said and "1 not in the run's (lora)" in said
    assert "1 of another shape (a.weight [4, 2] here, [4, 4] in the run)" in said
    assert spec_difference(run[::-1], run) == "the same parameters in another order (from b)"
