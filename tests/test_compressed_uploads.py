"""Compressed pseudo-gradients end to end: syncer -> wire -> coordinator, on a real port.

The coordinator's config picks the codec and serves it with the plan; the
syncer compresses each slice with error feedback; the coordinator decodes
before its shape and value checks. A malformed compressed body is refused with
a message naming the problem, and nothing of the coordinator's state changes.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ds_diloco import compress, wire
from ds_diloco.client import CoordinatorClient, RefusedError, rank_slices
from ds_diloco.compress import Codec
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.fragments import FragmentPlan, Schedule
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread
from ds_diloco.syncer import FragmentSyncer, ModelShardAccess

pytestmark = pytest.mark.timeout(120)
OUTER = 0.7 * (1 + 0.9)  # Nesterov's first step: lr x (g + momentum x g)
INT4 = Codec(name="int4", block=64)


def config(tiny_config_path, tmp_path, codec=INT4) -> CoordinatorConfig:
    return CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0), state_dir=str(tmp_path / "s"),
        num_fragments=2, sync_every=2, policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        compression=codec, token="t",
    )  # fmt: skip


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("residual", ["float32", "bfloat16"])
def test_int4_island_merges_what_it_sent_and_carries_the_residual(
    tiny_config_path, tmp_path, residual
):
    codec = dataclasses.replace(INT4, residual=residual)
    # A bfloat16 residual is rounded when kept: what was sent is known up to that rounding.
    tol = 0.0 if residual == "float32" else 2.0**-8
    with ServerThread(config(tiny_config_path, tmp_path, codec)) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0)
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_config_path))
        info = client.register("isl", 2, srv.coord.plan.signature)
        # The run's setting reaches the island with the plan.
        assert info["compression"] == {
            "name": "int4", "block": 64, "rounding": "nearest", "residual": residual
        }  # fmt: skip
        plan = FragmentPlan.from_json(info["plan"])
        ranks = [
            FragmentSyncer(
                client, "isl", plan, Schedule(**info["schedule"]), ModelShardAccess(model, 2, r),
                world_size=2, rank=r, codec=Codec(**info["compression"]),
            )
            for r in range(2)
        ]  # fmt: skip
        decoded = {}  # (rank, fragment, step) -> what the coordinator decoded
        decompress = srv.coord._decompress

        def spy(h, frag, tensors, meta, zeros):
            out = decompress(h, frag, tensors, meta, zeros)
            decoded[(h.rank, h.fragment, h.step)] = {n: t.clone() for n, t in out.items()}
            return out

        srv.coord._decompress = spy
        for s in ranks:
            s.bootstrap()
        frag0 = plan.fragments[0]
        glob = srv.coord.global_tensors()

        perturb(model, seed=1)  # round 1 of fragment 0: every parameter moves a little
        true1 = [rank_slices(frag0, {n: glob[n] - p.detach() for n, p in model.named_parameters()},
                             2, r) for r in range(2)]  # fmt: skip
        for s in ranks:
            s.on_step(1, tokens=64)
        wait_for(lambda: srv.coord.versions()[0] == 1)
        residual1 = []
        for r, s in enumerate(ranks):
            res = {n: s.feedback.residual((0, n)).clone() for n in frag0.names}
            residual1.append(res)
            for n in frag0.names:
                sent = true1[r][n] - res[n]  # what error feedback says it sent
                atol = 1e-7 + tol * float(res[n].abs().max())
                assert torch.allclose(decoded[(r, 0, 1)][n], sent, rtol=0, atol=atol), n
                assert res[n].dtype == getattr(torch, residual)  # served at registration
            # Quantised for real: the residual is the rounding, at most half a scale.
            assert any(res[n].abs().max() > 0 for n in frag0.names)
            fp32 = 4 * sum(t.numel() for t in true1[r].values())
            assert 0 < s.stats.bytes_sent < fp32 / 5, (s.stats.bytes_sent, fp32)
        full = {
            n: torch.cat([decoded[(r, 0, 1)][n] for r in range(2)]).view(glob[n].shape)
            for n in frag0.names
        }
        got = srv.coord.global_tensors()
        for n in frag0.names:  # one island: the merge is its pseudo-gradient, as decoded
            assert torch.allclose(got[n], glob[n] - OUTER * full[n], atol=1e-6), n

        wait_for(lambda: all(s.slots[0].arrived for s in ranks))
        perturb(model, seed=2)
        for s in ranks:  # step 2: fragment 0 applied (local = global v1), fragment 1 sent
            assert s.on_step(2, tokens=64) == [0]
        wait_for(lambda: srv.coord.versions()[1] == 1)
        wait_for(lambda: all(s.slots[1].arrived for s in ranks))
        perturb(model, seed=3)
        true2 = [{n: s.slots[0].base[n] - s.access.read(n) for n in frag0.names} for s in ranks]
        for s in ranks:  # step 3: fragment 0's next round
            s.on_step(3, tokens=64)
        wait_for(lambda: srv.coord.versions()[0] == 2)
        for r, s in enumerate(ranks):
            for n in frag0.names:  # error feedback: round 1's residual went out in round 2
                res2 = s.feedback.residual((0, n))
                sent = true2[r][n] + residual1[r][n] - res2
                atol = 1e-6 + tol * float(res2.abs().max())
                assert torch.allclose(decoded[(r, 0, 3)][n], sent, rtol=0, atol=atol), n
        for s in ranks:
            s.close()
        assert all(s.stats.failed == s.stats.refused == s.stats.dropped == 0 for s in ranks)
        assert srv.coord.status()["merges"] == [2, 1]


def _snapshot(srv):
    st = srv.coord.status()
    islands = {k: (v["last_step"], v["merged"], v["dropped"]) for k, v in st["islands"].items()}
    return srv.coord.versions(), srv.coord.global_tensors(), st["pending"], islands


def test_malformed_compressed_uploads_are_refused_and_change_nothing(tiny_config_path, tmp_path):
    with ServerThread(config(tiny_config_path, tmp_path)) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        client.register("a", 1, plan.signature)
        frag = plan.fragments[1]
        glob = srv.coord.global_tensors()
        g = torch.Generator().manual_seed(0)
        delta = {n: 1e-3 * torch.randn(glob[n].shape, generator=g) for n in frag.names}
        first = frag.params[0].name
        header = wire.UploadHeader(
            island="a", rank=0, world_size=1, fragment=1, base_version=0, step=2, tokens=64,
            steps=2,
        )  # fmt: skip

        def parts(codec=INT4):
            enc = {n: compress.encode(t.reshape(-1), codec) for n, t in delta.items()}
            return compress.to_wire(enc)

        def body(tensors, meta):
            return bytes(wire.upload_parts(header, tensors, meta))

        before = _snapshot(srv)

        def refused(status, text, tensors, meta):
            with pytest.raises(RefusedError) as e:
                client.upload_body(body(tensors, meta))
            assert e.value.status == status, e.value
            assert text in e.value.message, e.value.message
            now = _snapshot(srv)
            assert now[0] == before[0] and now[2] == before[2] and now[3] == before[3]
            assert all(torch.equal(now[1][n], before[1][n]) for n in now[1])

        t, m = parts()
        nan_scale = dict(t)
        nan_scale[first + "#scales"] = t[first + "#scales"].clone()
        nan_scale[first + "#scales"][0] = float("nan")
        refused(422, "scales must be finite", nan_scale, m)
        short = dict(t)
        short[first] = t[first][:-1]
        refused(400, "malformed compressed upload", short, m)
        refused(400, "unknown codec 'int3'", t, {**m, first + "#codec": "int3"})
        no_scales = {k: v for k, v in t.items() if k != first + "#scales"}
        refused(400, "needs a", no_scales, m)
        refused(400, "unknown compression metadata", t, {**m, first + "#zero_point": "0"})
        refused(400, "block", t, {**m, first + "#block": "-1"})
        # Self-consistent, but not the slice the plan expects: checked before decoding.
        n_first = glob[first].numel()
        wrong = compress.to_wire({first: compress.encode(torch.zeros(n_first + 1), INT4)})
        tw, mw = {**t, **wrong[0]}, {**m, **wrong[1]}
        refused(422, f"expected [{n_first}]", tw, mw)

        # A good compressed upload still goes through and merges (K = 1), as decoded.
        reply = client.upload_body(body(*parts()))
        assert reply["status"] == "accepted" and reply["complete"], reply
        wait_for(lambda: srv.coord.versions()[1] == 1)
        got = srv.coord.global_tensors()
        for n in frag.names:
            sent = compress.decode(compress.encode(delta[n].reshape(-1), INT4)).view(glob[n].shape)
            assert torch.allclose(got[n], glob[n] - OUTER * sent, atol=1e-6), n


def test_plain_uploads_still_work_with_compression_configured(tiny_config_path, tmp_path):
    """The codec is what islands are told to use; the coordinator reads whatever is sent."""
    with ServerThread(config(tiny_config_path, tmp_path)) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        client.register("a", 1, plan.signature)
        glob = srv.coord.global_tensors()
        delta = {n: torch.full_like(t, 1e-3) for n, t in glob.items()}
        header = wire.UploadHeader(
            island="a", rank=0, world_size=1, fragment=0, base_version=0, step=1, tokens=64,
            steps=1,
        )  # fmt: skip
        reply = client.upload(header, rank_slices(plan.fragments[0], delta, 1, 0))
        assert reply["status"] == "accepted"
        wait_for(lambda: srv.coord.versions()[0] == 1)


def test_a_frozen_parameter_is_left_out_of_a_compressed_upload(tiny_config_path, tmp_path):
    with ServerThread(config(tiny_config_path, tmp_path, INT4)) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_config_path))
        info = client.register("isl", 1, srv.coord.plan.signature)
        plan = FragmentPlan.from_json(info["plan"])
        frozen = plan.fragments[0].names[0]
        dict(model.named_parameters())[frozen].requires_grad_(False)
        s = FragmentSyncer(client, "isl", plan, Schedule(**info["schedule"]),
                           ModelShardAccess(model), codec=Codec(**info["compression"]))  # fmt: skip
        s.bootstrap()
        glob = srv.coord.global_tensors()
        perturb(model, seed=1)  # the frozen one too: still nothing of it is sent
        s.on_step(1, tokens=64)
        wait_for(lambda: srv.coord.versions()[0] == 1)
        got = srv.coord.global_tensors()
        assert torch.equal(got[frozen], glob[frozen])
        assert all(not torch.equal(got[n], glob[n]) for n in plan.fragments[0].names[1:])
        assert s.feedback.residual((0, frozen)) is None  # never compressed
        s.close()


def test_an_upload_that_fails_puts_back_the_residuals_it_took(tiny_config_path, tmp_path):
    """Its progress goes out again with the next upload; the residuals from before it are
    still owed. Forgotten, each failed upload lost one rounding error per value for good."""
    with ServerThread(config(tiny_config_path, tmp_path)) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_config_path))
        info = client.register("isl", 1, srv.coord.plan.signature)
        plan = FragmentPlan.from_json(info["plan"])
        s = FragmentSyncer(client, "isl", plan, Schedule(**info["schedule"]),
                           ModelShardAccess(model), codec=Codec(**info["compression"]))  # fmt: skip
        s.bootstrap()
        frag0 = plan.fragments[0]
        perturb(model, seed=1)
        s.on_step(1, tokens=64)  # fragment 0 goes out and is merged
        wait_for(lambda: srv.coord.versions()[0] == 1)
        before = {n: s.feedback.residual((0, n)).clone() for n in frag0.names}
        assert any(r.abs().max() > 0 for r in before.values())
        wait_for(lambda: s.slots[0].arrived)
        assert s.on_step(2, tokens=64) == [0]  # fragment 0 applied, fragment 1 sent
        wait_for(lambda: srv.coord.versions()[1] == 1 and s.slots[1].arrived)

        def unreachable(*a, **kw):
            raise ConnectionError("coordinator unreachable")

        client.upload_body = unreachable
        perturb(model, seed=2)
        s.on_step(3, tokens=64)  # fragment 0's next upload fails
        s._uploads.join()
        assert s.stats.failed == 1
        for n in frag0.names:
            assert torch.equal(s.feedback.residual((0, n)), before[n]), n
        s.close()
