from __future__ import annotations

import pytest
import torch

from ds_diloco import outer_optim
from ds_diloco.outer_optim import (
    Averaging,
    DelayedNesterov,
    NesterovSGD,
    OuterOptimConfig,
    build_outer_optimizer,
)

N = 1000


def _grads(n_steps: int, seed: int = 0, scale: float = 0.01) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(N, generator=gen) for _ in range(n_steps)]


def _param(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fused", [True, False])
def test_nesterov_matches_torch_sgd(fused, monkeypatch):
    # Also cover the path for torch builds without a fused SGD kernel for the device.
    monkeypatch.setattr(outer_optim, "_use_fused", fused)
    p0 = _param()
    ref = torch.nn.Parameter(p0.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours, opt = p0.clone(), NesterovSGD(0.7, 0.9)
    for g in _grads(120):
        ref.grad = g.clone()
        ref_opt.step()
        opt.step(ours, g)
    assert opt.num_steps == 120
    torch.testing.assert_close(ours, ref.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(ours, p0)
    assert outer_optim._use_fused is fused  # the fused kernel exists here: no silent fallback


def test_averaging_gives_weighted_average_of_locals():
    base = _param()
    locals_ = [base + torch.randn(N) for _ in range(3)]
    w = torch.tensor([1.0, 2.0, 5.0])
    # Merged plain pseudo-gradient: weighted mean of base - local.
    grad = sum(wk * (base - lk) for wk, lk in zip(w, locals_, strict=True)) / w.sum()
    param, opt = base.clone(), Averaging()
    opt.step(param, grad)
    want = sum(wk * lk for wk, lk in zip(w, locals_, strict=True)) / w.sum()
    torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-5)
    assert opt.num_steps == 1


def test_delayed_nesterov_every_1_is_nesterov():
    p0 = _param()
    a, b = p0.clone(), p0.clone()
    nest, delayed = NesterovSGD(0.7, 0.9), DelayedNesterov(0.7, 0.9, every=1)
    for g in _grads(50):
        nest.step(a, g)
        delayed.step(b, g)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_delayed_nesterov_every_3_by_hand():
    lr, mom = 0.5, 0.8
    g1, g2, g3, g4, g5, g6 = (torch.full((2,), v) for v in (1.0, 2.0, 3.0, -1.0, 0.5, 4.0))
    p, opt = torch.zeros(2), DelayedNesterov(lr, mom, every=3)
    opt.step(p, g1)
    torch.testing.assert_close(p, -lr * g1)  # plain SGD
    opt.step(p, g2)
    torch.testing.assert_close(p, -lr * (g1 + g2))
    opt.step(p, g3)  # momentum step: buf = (g1 + g2 + g3) / 3 = 2
    buf = (g1 + g2 + g3) / 3
    want = -lr * (g1 + g2) - lr * (g3 + mom * buf)
    torch.testing.assert_close(p, want)
    for g in (g4, g5):
        opt.step(p, g)
        want = want - lr * g
    torch.testing.assert_close(p, want)
    opt.step(p, g6)  # buf = mom * buf + (g4 + g5 + g6) / 3
    buf = mom * buf + (g4 + g5 + g6) / 3
    want = want - lr * (g6 + mom * buf)
    torch.testing.assert_close(p, want)
    assert opt.num_steps == 6


@pytest.mark.parametrize(
    "make",
    [
        lambda: NesterovSGD(0.7, 0.9),
        lambda: Averaging(),
        lambda: DelayedNesterov(0.7, 0.9, every=3),
        lambda: DelayedNesterov(0.7, 0.9, every=1),
    ],
)
@pytest.mark.parametrize("k", [0, 1, 4, 5])
def test_state_dict_round_trip_continues_identically(make, k):
    grads = _grads(10, seed=3)
    p, opt = _param(), make()
    for g in grads[:k]:
        opt.step(p, g)
    state = opt.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    p2, opt2 = p.clone(), make()
    opt2.load_state_dict(state)
    assert opt2.num_steps == k
    # The saved tensors must be copies: stepping on must not change the saved state.
    saved = {name: v.clone() for name, v in state.items()}
    for g in grads[k:]:
        opt.step(p, g)
        opt2.step(p2, g)
    assert torch.equal(p, p2)
    for name, v in state.items():
        assert torch.equal(v, saved[name]), name


def test_load_state_dict_errors():
    opt = NesterovSGD(0.7, 0.9)
    opt.step(torch.zeros(4), torch.ones(4))
    good = opt.state_dict()
    with pytest.raises(ValueError, match="missing key 'momentum_buffer'"):
        NesterovSGD(0.7, 0.9).load_state_dict({"num_steps": good["num_steps"]})
    with pytest.raises(ValueError, match="missing key 'num_steps'"):
        NesterovSGD(0.7, 0.9).load_state_dict({"momentum_buffer": good["momentum_buffer"]})
    with pytest.raises(ValueError, match="unexpected key"):
        NesterovSGD(0.7, 0.9).load_state_dict({**good, "foo": torch.tensor(1)})
    with pytest.raises(ValueError, match=r"momentum_buffer.*1-D float32"):
        NesterovSGD(0.7, 0.9).load_state_dict({**good, "momentum_buffer": torch.ones(2, 2)})
    with pytest.raises(ValueError, match=r"num_steps.*0-d integer"):
        NesterovSGD(0.7, 0.9).load_state_dict({**good, "num_steps": torch.tensor(1.0)})

    # A buffer of the wrong size is caught at the next step, naming the mismatch.
    wrong = NesterovSGD(0.7, 0.9)
    wrong.load_state_dict(good)
    with pytest.raises(ValueError, match="different fragment"):
        wrong.step(torch.zeros(5), torch.ones(5))

    d = DelayedNesterov(0.7, 0.9, every=3)
    for _ in range(4):
        d.step(torch.zeros(4), torch.ones(4))
    dstate = d.state_dict()
    with pytest.raises(ValueError, match="every"):
        DelayedNesterov(0.7, 0.9, every=2).load_state_dict(dstate)
    no_acc = {k: v for k, v in dstate.items() if k != "accumulator"}
    with pytest.raises(ValueError, match="missing key 'accumulator'"):
        DelayedNesterov(0.7, 0.9, every=3).load_state_dict(no_acc)
    with pytest.raises(ValueError, match=r"accumulator.*3 elements, expected 4"):
        DelayedNesterov(0.7, 0.9, every=3).load_state_dict({**dstate, "accumulator": torch.ones(3)})


@pytest.mark.parametrize("opt", [NesterovSGD(0.7, 0.9), Averaging(), DelayedNesterov(0.7, 0.9, 2)])
def test_step_rejects_bad_args(opt):
    with pytest.raises(ValueError, match="float32"):
        opt.step(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="same shape"):
        opt.step(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        opt.step(torch.zeros(2, 2), torch.zeros(2, 2))
    assert opt.num_steps == 0


def test_config_and_builder():
    assert isinstance(build_outer_optimizer(OuterOptimConfig()), NesterovSGD)
    assert isinstance(build_outer_optimizer(OuterOptimConfig(name="average")), Averaging)
    d = build_outer_optimizer(OuterOptimConfig(name="delayed_nesterov", lr=0.5, every=2))
    assert isinstance(d, DelayedNesterov) and d.every == 2 and d.lr == 0.5
    n = build_outer_optimizer(OuterOptimConfig(lr=0.3, momentum=0.5))
    assert (n.lr, n.momentum) == (0.3, 0.5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "adam"}, "name"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"every": 0}, "every"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"OuterOptimConfig.{field}"):
        OuterOptimConfig(**kwargs)
