"""The rank-side syncer against a real coordinator: ZeRO-3 slices of a plain HF model."""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ds_diloco.client import CoordinatorClient
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.fragments import FragmentPlan, Schedule
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread
from ds_diloco.syncer import FragmentSyncer, ModelShardAccess


def model_from(config_path, seed):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_two_rank_island_syncs_its_slices_and_applies_after_tau(tiny_config_path, tmp_path):
    cfg = CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0), state_dir=str(tmp_path / "s"),
        num_fragments=2, sync_every=2, policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        token="t",
    )  # fmt: skip
    with ServerThread(cfg) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0)
        model = model_from(tiny_config_path, seed=7)  # different init: bootstrap must replace it
        info = client.register("isl", 2, srv.coord.plan.signature)
        plan, schedule = FragmentPlan.from_json(info["plan"]), Schedule(**info["schedule"])
        ranks = [
            FragmentSyncer(
                client, "isl", plan, schedule, ModelShardAccess(model, 2, r), world_size=2, rank=r
            )
            for r in range(2)
        ]
        for s in ranks:
            s.bootstrap()
        glob = srv.coord.global_tensors()
        assert all(torch.equal(p.detach(), glob[n]) for n, p in model.named_parameters())

        with torch.no_grad():  # one "inner step": every parameter moves by -0.01
            for p in model.parameters():
                p.sub_(0.01)
        for s in ranks:  # step 1: fragment 0 is due (H/P = 1)
            assert s.on_step(1, tokens=64) == []
        wait_for(lambda: srv.coord.versions()[0] == 1)
        # Outer Nesterov on the first merge: theta - lr * (g + m * g) with g = +0.01.
        expected = {n: glob[n] - 0.7 * (0.01 + 0.9 * 0.01) for n in plan.fragments[0].names}
        got = srv.coord.global_tensors()
        assert all(torch.allclose(got[n], expected[n], atol=1e-6) for n in expected)
        wait_for(lambda: all(s.slots[0].ready is not None for s in ranks))
        for s in ranks:  # step 2 = 1 + tau: both ranks apply fragment 0, fragment 1 is sent
            assert s.on_step(2, tokens=64) == [0]
            assert s.versions()[0] == 1 and s.slots[0].tokens == 0
        params = dict(model.named_parameters())
        for n in expected:
            assert torch.allclose(params[n].detach(), expected[n], atol=1e-6), n
        for s in ranks:
            s.close()
        assert all(s.stats.uploads == 2 and s.stats.failed == 0 for s in ranks)
        assert all(s.stats.network_calls_in_loop == 0 for s in ranks)


def test_training_goes_on_while_the_coordinator_is_unreachable(tiny_config_path, tmp_path):
    cfg = CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0), state_dir=str(tmp_path / "s"),
        num_fragments=2, sync_every=2, policy=PolicyOptions(min_quorum=1, tau=1), token="t",
    )  # fmt: skip
    srv = ServerThread(cfg)
    client = CoordinatorClient(srv.url, "t", retries=2, backoff_s=0.05)
    model = model_from(tiny_config_path, seed=0)
    info = client.register("isl", 1, srv.coord.plan.signature)
    s = FragmentSyncer(
        client, "isl", FragmentPlan.from_json(info["plan"]), Schedule(**info["schedule"]),
        ModelShardAccess(model),
    )  # fmt: skip
    s.bootstrap()
    srv.stop()
    t0 = time.perf_counter()
    for step in range(1, 7):
        s.on_step(step, tokens=10)
    assert time.perf_counter() - t0 < 1.0, "on_step must never wait for the network"
    wait_for(lambda: s.stats.failed >= 1)
    s.close(timeout=5)
