"""Round closing, liveness and crash durability of the coordinator, on a controlled clock."""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from ds_diloco import wire
from ds_diloco.buffer_pool import BufferPool, size_class
from ds_diloco.client import CoordinatorClient, rank_slices
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.coordinator import Coordinator, CoordinatorError
from ds_diloco.merge import NormGuard, StalenessPolicy
from ds_diloco.metrics import prometheus_text
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread
from ds_diloco.status_view import render


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make(config_path, state_dir, clock=None, **kw):
    cfg = CoordinatorConfig(
        model=ModelSource(config=config_path, seed=0),
        state_dir=str(state_dir),
        token="t",
        **{"num_fragments": 2, "sync_every": 2, **kw},
    )
    return Coordinator(cfg, clock=clock) if clock else cfg


def send(
    coord,
    island,
    fragment,
    step,
    *,
    world_size=1,
    tokens=100,
    steps=None,
    scale=1e-3,
    incarnation=1,
    run="",
    final=0,
):
    steps = min(2, step) if steps is None else steps  # an island's first sends come early
    frag = coord.plan.fragments[fragment]
    g = torch.Generator().manual_seed(hash((island, fragment, step)) % 2**31)
    full = {p.name: torch.randn(p.shape, generator=g) * scale for p in frag.params}
    base = coord.versions()[fragment]
    replies = []
    for rank in range(world_size):
        header = wire.UploadHeader(
            island=island, rank=rank, world_size=world_size, fragment=fragment,
            base_version=base, step=step, tokens=tokens, steps=steps, incarnation=incarnation,
            run=run, final=final,
        )  # fmt: skip
        replies.append(
            coord.upload(wire.encode_upload(header, rank_slices(frag, full, world_size, rank)))
        )
    return replies[-1]


def test_quorum_then_grace_window_then_merge(tiny_config_path, tmp_path):
    clock = Clock()
    policy = PolicyOptions(min_quorum=2, grace_gamma=0.5, max_grace_s=10.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy)
    sig = coord.plan.signature
    for island in ("a", "b", "c"):
        coord.register(island, 1, sig)
    # Step-time estimates: "a" and "b" take 2 s per inner step (uploads at steps 2 and 4).
    for island in ("a", "b"):
        send(coord, island, 1, step=2)
    clock.now += 4.0
    for island in ("a", "b"):
        send(coord, island, 1, step=4)
    d = coord.poll(1)  # quorum 2/2 with "c" silent: the grace window is 0.5 x (1 x 2 s) = 1 s
    assert not d.merge and d.wait_until == clock.now + 1.0, d
    clock.now = d.wait_until
    assert coord.poll(1).merge
    for island in ("a", "b", "c"):
        coord.touch(island)

    assert send(coord, "a", 0, step=4)["complete"]
    d = coord.decide(0)
    assert not d.merge and d.wait_until is None and "quorum 1/2 (K=2)" in d.reason
    clock.now += 0.5
    send(coord, "b", 0, step=4)
    d = coord.decide(0)
    # slack = tau * xi_step - (xi_quorum + xi_sync) ~ 2 s -> grace ~ gamma * 2 s = ~1 s
    assert not d.merge and "waiting" in d.reason and "2/3 live islands in" in d.reason
    grace = d.wait_until - clock.now
    assert 0.8 < grace < 1.05, (grace, d.reason)
    assert coord.poll(0).merge is False and coord.versions()[0] == 0
    clock.now = d.wait_until
    d = coord.poll(0)
    assert d.merge and "grace over" in d.reason
    assert coord.versions()[0] == 1
    assert coord.status()["last_merge"]["0"]["islands"] == ["a", "b"]


def test_the_grace_window_follows_the_fastest_island_still_in_the_run(tiny_config_path, tmp_path):
    # A fast island that finished first and left kept the grace window at its step time:
    # the islands still training lost their stragglers' uploads to rounds closed early.
    clock = Clock()
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.5, max_grace_s=10.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy)
    for island in ("a", "b", "c"):
        coord.register(island, 1, coord.plan.signature)
    for island in ("a", "b", "c"):
        send(coord, island, 1, step=2)
    clock.now += 2.0
    send(coord, "a", 1, step=4)  # "a": a step a second
    clock.now += 2.0
    for island in ("b", "c"):  # two seconds a step
        send(coord, island, 1, step=4)
    assert coord.poll(1).merge
    coord.leave("a")
    for island in ("b", "c"):
        coord.touch(island)
    send(coord, "b", 0, step=4)
    d = coord.decide(0)
    # grace = gamma x (tau x 2 s - (quorum + sync)): ~1 s, not ~0.5 s from a's step time
    assert not d.merge and "step 2.000s" in d.reason, d.reason
    assert 0.5 < d.wait_until - clock.now <= 1.0, d  # (less the merge time measured)


def test_synchronous_k_equals_m_waits_for_every_island(tiny_config_path, tmp_path):
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=PolicyOptions(min_quorum=3, tau=1))
    for island in ("a", "b", "c"):
        coord.register(island, 2, coord.plan.signature)
    send(coord, "a", 0, step=2, world_size=2)
    send(coord, "b", 0, step=2, world_size=2)
    clock.now += 60.0  # however long: K = M never closes without the third island
    for island in ("a", "b", "c"):
        coord.touch(island)
    assert not coord.poll(0).merge and coord.versions()[0] == 0
    send(coord, "c", 0, step=2, world_size=2)
    d = coord.poll(0)
    assert d.merge and "all 3 live islands in" in d.reason and coord.versions()[0] == 1


def test_incomplete_island_does_not_count_until_all_its_ranks_are_in(tiny_config_path, tmp_path):
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=PolicyOptions(min_quorum=1, tau=1))
    coord.register("a", 3, coord.plan.signature)
    frag = coord.plan.fragments[0]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    for rank in (0, 2):
        h = wire.UploadHeader(island="a", rank=rank, world_size=3, fragment=0, base_version=0,
                              step=2, tokens=10, steps=2)  # fmt: skip
        assert not coord.upload(wire.encode_upload(h, rank_slices(frag, full, 3, rank)))["complete"]
    assert not coord.poll(0).merge
    h = wire.UploadHeader(island="a", rank=1, world_size=3, fragment=0, base_version=0,
                          step=2, tokens=10, steps=2)  # fmt: skip
    assert coord.upload(wire.encode_upload(h, rank_slices(frag, full, 3, 1)))["complete"]
    assert coord.poll(0).merge and coord.versions()[0] == 1


def test_dead_island_stops_holding_the_quorum(tiny_config_path, tmp_path):
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=3, grace_gamma=0.0, tau=1), island_timeout_s=10.0,
    )  # fmt: skip
    for island in ("a", "b", "c"):
        coord.register(island, 1, coord.plan.signature)
    clock.now += 9.0
    send(coord, "a", 0, step=2)
    send(coord, "b", 0, step=2)
    d = coord.poll(0)
    assert not d.merge and "quorum 2/3" in d.reason
    clock.now += 1.5  # "c" has not been heard from for 10.5 s: no longer live
    d = coord.poll(0)
    assert d.merge and "capped" not in d.reason and "all 2 live islands in" in d.reason
    assert coord.status()["islands"]["c"]["live"] is False


def test_a_dead_islands_half_sent_upload_is_dropped_and_its_row_given_back(
    tiny_config_path, tmp_path
):
    # Rank 0 of two sent its slices, then the island died: once its lease is over, the
    # round loop's next look drops the half contribution (the row it held goes back).
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=1, tau=1), island_timeout_s=10.0,
    )  # fmt: skip
    coord.register("a", 2, coord.plan.signature)
    in_use = coord.status()["buffers"]["in_use"]
    frag = coord.plan.fragments[0]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    h = wire.UploadHeader(island="a", rank=0, world_size=2, fragment=0, base_version=0,
                          step=2, tokens=10, steps=2)  # fmt: skip
    assert not coord.upload(wire.encode_upload(h, rank_slices(frag, full, 2, 0)))["complete"]
    assert coord.status()["buffers"]["in_use"] == in_use + 1
    clock.now += 9.0  # within the lease: the other rank may still come
    assert coord.schedule() == ([], None)
    assert coord.status()["pending"]["0"]["assembling"] == {"a": [0]}
    clock.now += 1.5
    assert coord.schedule() == ([], None)
    status = coord.status()
    assert status["buffers"]["in_use"] == in_use
    assert status["pending"] == {}
    assert status["islands"]["a"]["dropped"] == 1
    assert coord.versions() == [0, 0]


def _head(body: bytes) -> bytes:
    return body[: wire.head_length(body, len(body))]


def _write(ing, body: bytes, upto: int | None = None) -> None:
    """A streamed body's data as the server gets them: in pieces (``upto``: cut there)."""
    for i in range(len(_head(body)), len(body) if upto is None else upto, 1000):
        ing.write(body[i : min(i + 1000, len(body) if upto is None else upto)])


def _bodies(coord, island, world_size, step, full, fragment=0, **over):
    frag = coord.plan.fragments[fragment]
    return [
        wire.encode_upload(
            wire.UploadHeader(**{
                "island": island, "rank": r, "world_size": world_size, "fragment": fragment,
                "base_version": coord.versions()[fragment], "step": step, "tokens": 10,
                "steps": 2, **over,
            }),
            rank_slices(frag, full, world_size, r),
        )
        for r in range(world_size)
    ]  # fmt: skip


def test_streamed_uploads_of_an_islands_ranks_land_in_one_row_and_merge_as_whole_ones(
    tiny_config_path, tmp_path
):
    # The server reads a large body straight into its island's contribution row: the ranks
    # that send at once share it, nothing is copied after, and the merge is the same.
    opts = {"policy": PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)}
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **opts)
    ref = make(tiny_config_path, tmp_path / "r", Clock(), **opts)
    for c in (coord, ref):
        c.register("a", 2, c.plan.signature)
    frag = coord.plan.fragments[0]
    g = torch.Generator().manual_seed(0)
    full = {p.name: torch.randn(p.shape, generator=g) * 1e-3 for p in frag.params}
    bodies = _bodies(coord, "a", 2, 2, full)
    in_use = coord.status()["buffers"]["in_use"]
    ings = [coord.upload_begin(_head(b), len(b)) for b in bodies]  # both before any data
    assert ings[0].landing is ings[1].landing
    assert coord.status()["buffers"]["in_use"] == in_use + 1  # one row for the island
    pending = coord.status()["pending"]  # what an operator sees meanwhile
    assert pending == {"0": {"complete": [], "assembling": {}, "receiving": {"a": [0, 1]}}}
    assert "round open, fragment 0: a is sending ranks [0, 1]" in render(coord.status())
    for ing, b in reversed(list(zip(ings, bodies))):  # rank 1's data first
        _write(ing, b)
    replies = [coord.upload_finish(ing) for ing in ings]
    assert [r["status"] for r in replies] == ["accepted"] * 2 and replies[1]["complete"]
    assert coord.status()["buffers"]["in_use"] == in_use + 1  # the row is the contribution's
    assert coord.status()["pending"]["0"] == {"complete": ["a"], "assembling": {}, "receiving": {}}
    for b in bodies:
        ref.upload(b)
    assert coord.poll(0).merge and ref.poll(0).merge
    got, want = coord.global_tensors(), ref.global_tensors()
    assert coord.versions() == ref.versions() == [1, 0]
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert coord.status()["buffers"]["in_use"] == ref.status()["buffers"]["in_use"]


def test_a_streamed_upload_cut_short_not_finite_or_sent_twice_keeps_nothing(
    tiny_config_path, tmp_path
):
    coord = make(
        tiny_config_path, tmp_path / "s", Clock(), policy=PolicyOptions(min_quorum=1, tau=1)
    )
    coord.register("a", 1, coord.plan.signature)
    frag = coord.plan.fragments[0]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    (body,) = _bodies(coord, "a", 1, 2, full)
    bad = {n: t.clone() for n, t in full.items()}
    bad[frag.params[-1].name].view(-1)[-1] = float("nan")  # in the last bytes streamed
    (nan_body,) = _bodies(coord, "a", 1, 2, bad)
    before = (coord.status()["buffers"]["in_use"], coord.versions(), coord.global_tensors())

    def unchanged():
        st = coord.status()
        assert st["buffers"]["in_use"] == before[0] and st["pending"] == {}
        assert coord.versions() == before[1] and st["islands"]["a"]["dropped"] == 0
        now = coord.global_tensors()
        assert all(torch.equal(now[n], before[2][n]) for n in now)

    ing = coord.upload_begin(_head(body), len(body))  # the connection drops half-way
    _write(ing, body, upto=len(body) // 2)
    coord.upload_abort(ing)
    unchanged()
    ing = coord.upload_begin(_head(nan_body), len(nan_body))
    _write(ing, nan_body)
    with pytest.raises(CoordinatorError) as e:
        coord.upload_finish(ing)
    assert e.value.status == 422 and wire.NOT_FINITE in str(e.value)
    unchanged()
    ing = coord.upload_begin(_head(body), len(body))  # the same rank again while it comes
    with pytest.raises(CoordinatorError) as e:
        coord.upload_begin(_head(body), len(body))
    assert e.value.status == 409 and "still coming in" in str(e.value)
    _write(ing, body)
    assert coord.upload_finish(ing)["complete"]  # the first is taken whole
    assert coord.poll(0).merge


def test_a_row_dropped_while_a_rank_still_streams_into_it_waits_for_that_rank(
    tiny_config_path, tmp_path
):
    # Rank 0's slices are in; rank 1's are coming when the island registers again, which
    # drops the contribution. Its row must not go back to the pool (and to the next
    # upload) while rank 1's data are still written into it.
    coord = make(
        tiny_config_path, tmp_path / "s", Clock(), policy=PolicyOptions(min_quorum=1, tau=1)
    )
    coord.register("a", 2, coord.plan.signature)
    frag = coord.plan.fragments[0]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    bodies = _bodies(coord, "a", 2, 2, full)
    in_use = coord.status()["buffers"]["in_use"]
    assert coord.upload(bodies[0])["status"] == "accepted"
    ing = coord.upload_begin(_head(bodies[1]), len(bodies[1]))
    assert ing.landing.row is coord._frags[0].assembling["a"].row
    coord.register("a", 2, coord.plan.signature)  # incarnation 2: the contribution goes
    sending = {"0": {"complete": [], "assembling": {}, "receiving": {"a": [1]}}}
    assert coord.status()["pending"] == sending  # the contribution is gone, rank 1 sends on
    assert coord.status()["buffers"]["in_use"] == in_use + 1  # still written into
    _write(ing, bodies[1])
    with pytest.raises(CoordinatorError) as e:  # from incarnation 1: superseded
        coord.upload_finish(ing)
    assert e.value.status == 409 and wire.SUPERSEDED in str(e.value)
    assert coord.status()["buffers"]["in_use"] == in_use  # given back by the last writer


def test_a_restarted_islands_uploads_never_land_in_the_row_its_old_launch_still_sends_into(
    tiny_config_path, tmp_path
):
    # Rank 1 of the island's first launch (2 ranks) is still sending step 2 when the island
    # registers again with 1 rank and sends step 2 too. Its upload shared the old launch's
    # row: complete at once, then the old rank 1's data overwrote half of it (the merge took
    # them), and a new rank 1 would have been refused as "still coming in".
    opts = {"policy": PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)}
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **opts)
    ref = make(tiny_config_path, tmp_path / "r", Clock(), **opts)
    frag = coord.plan.fragments[0]
    coord.register("a", 2, coord.plan.signature)
    old = _bodies(coord, "a", 2, 2, {p.name: torch.full(p.shape, 5.0) for p in frag.params})
    ing = coord.upload_begin(_head(old[1]), len(old[1]))
    for c in (coord, ref):
        c.register("a", 1, c.plan.signature)
    ref.register("a", 1, ref.plan.signature)  # the same incarnation (2) as at ``coord``
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    (new,) = _bodies(coord, "a", 1, 2, full, incarnation=2)
    assert coord.upload(new)["complete"] and ref.upload(new)["complete"]
    _write(ing, old[1])
    with pytest.raises(CoordinatorError) as e:
        coord.upload_finish(ing)
    assert e.value.status == 409 and wire.SUPERSEDED in str(e.value)
    assert coord.poll(0).merge and ref.poll(0).merge
    got, want = coord.global_tensors(), ref.global_tensors()
    assert all(torch.equal(got[n], want[n]) for n in want)
    # The same world size: every rank of the new launch is taken beside the old one's.
    coord.register("a", 2, coord.plan.signature)  # incarnation 3
    old = _bodies(coord, "a", 2, 4, full, incarnation=3)
    ing = coord.upload_begin(_head(old[1]), len(old[1]))
    coord.register("a", 2, coord.plan.signature)  # incarnation 4
    replies = [coord.upload(b) for b in _bodies(coord, "a", 2, 4, full, incarnation=4)]
    assert [r["status"] for r in replies] == ["accepted"] * 2 and replies[1]["complete"]
    coord.upload_abort(ing)
    assert coord.status()["pending"] == {
        "0": {"complete": ["a"], "assembling": {}, "receiving": {}}
    }


def test_an_upload_whose_contribution_was_dropped_while_it_came_starts_one_on_a_new_row(
    tiny_config_path, tmp_path
):
    # The island went silent past its lease while rank 1's body came: its half
    # contribution (rank 0's) was dropped, its row given back once rank 1 is done. Rank 1's
    # upload is then taken into a contribution of its own, which must not keep that row.
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=1, tau=1), island_timeout_s=10.0,
    )  # fmt: skip
    coord.register("a", 2, coord.plan.signature)
    frag = coord.plan.fragments[0]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    bodies = _bodies(coord, "a", 2, 2, full)
    in_use = coord.status()["buffers"]["in_use"]
    assert coord.upload(bodies[0])["status"] == "accepted"
    ing = coord.upload_begin(_head(bodies[1]), len(bodies[1]))
    clock.now += 11.0
    coord.schedule()  # drops rank 0's contribution: the island lost its lease
    sending = {"0": {"complete": [], "assembling": {}, "receiving": {"a": [1]}}}
    assert coord.status()["pending"] == sending and coord.status()["islands"]["a"]["dropped"] == 1
    _write(ing, bodies[1])
    assert coord.upload_finish(ing)["status"] == "accepted"
    held = coord._frags[0].assembling["a"].row
    assert coord.status()["buffers"]["in_use"] == in_use + 1  # its own row, and only that
    expect = rank_slices(frag, full, 2, 1)
    for seg, (a, b) in zip(coord._frags[0].segments, coord._ranges(coord._frags[0], 2, 1)):
        assert torch.equal(held[seg.offset + a : seg.offset + b], expect[seg.name])


def test_an_island_that_leaves_never_holds_a_round_and_may_come_back(tiny_config_path, tmp_path):
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=3, grace_gamma=0.0, tau=1), island_timeout_s=1000.0,
    )  # fmt: skip
    for island in ("a", "b", "c"):
        coord.register(island, 1, coord.plan.signature)
    send(coord, "a", 0, step=2)
    send(coord, "b", 0, step=2)
    assert not coord.poll(0).merge  # K=3: waits for "c", whose lease is long
    coord.leave("c")  # done for good: at once, no lease to run out
    d = coord.poll(0)
    assert d.merge and "all 2 live islands in" in d.reason
    with pytest.raises(CoordinatorError, match="left the run") as e:
        send(coord, "c", 1, step=2)
    assert e.value.status == 410
    st = coord.status()["islands"]["c"]
    assert st["live"] is False and st["left"] is True
    reply = coord.register("c", 1, coord.plan.signature)  # an island may join again (elastic)
    assert reply["incarnation"] == 2
    assert send(coord, "c", 1, step=2, incarnation=2)["status"] == "accepted"
    assert coord.status()["islands"]["c"]["registrations"] == 2


def test_an_upload_sent_before_an_islands_final_flush_waits_like_the_flush(
    tiny_config_path, tmp_path
):
    """The flush does not send a fragment again for a step already sent (a replay): the
    upload of an island's last step goes out without the final flag. Once the island
    finished, it closed its round alone, and the other island's upload for that round
    came stale; it now waits for that upload, as the flush does."""
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=2, grace_gamma=0.5, max_grace_s=10.0, tau=1),
        island_timeout_s=100.0,
    )  # fmt: skip
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    assert send(coord, "a", 1, step=4)["status"] == "accepted"  # its last step's send
    assert not coord.poll(1).merge  # K = 2: waits for b
    assert send(coord, "a", 0, step=4, final=1)["status"] == "accepted"  # the final flush
    d = coord.poll(1)
    assert not d.merge and "only final contributions (1)" in d.reason, d.reason
    coord.leave("a")  # it stays, as the flush does
    clock.now += 1.0
    assert send(coord, "b", 1, step=2)["status"] == "accepted"  # base version 0: not stale
    d = coord.poll(1)
    assert d.merge and "all 1 live islands in + 1 final" in d.reason, d.reason
    assert coord._frags[1].merged_by.keys() == {"a", "b"}
    st = coord.status()["islands"]
    assert (st["a"]["dropped"], st["b"]["dropped"]) == (0, 0)


@pytest.mark.parametrize("k", [1, 2])
def test_a_final_flush_waits_for_the_next_round_and_outlives_its_islands_leave(
    tiny_config_path, tmp_path, k
):
    """An island's final flush (it leaves for good) closes no round: it is merged with the
    next round of an island still training, whose upload, based on the same version,
    is therefore not stale; once no island trains any more, it is merged alone."""
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=k, grace_gamma=0.5, max_grace_s=10.0, tau=1),
        island_timeout_s=100.0,
    )  # fmt: skip
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    for frag in (0, 1):
        assert send(coord, "a", frag, step=5, final=1)["status"] == "accepted"
        d = coord.poll(frag)
        assert not d.merge and "only final contributions (1)" in d.reason, d.reason
    st = coord.status()["islands"]["a"]
    assert st["finishing"] is True and st["live"] is False
    coord.leave("a")  # a left: its final contributions stay
    assert not coord.poll(0).merge
    clock.now += 1.0
    assert send(coord, "b", 0, step=2)["status"] == "accepted"  # base version 0: not stale
    d = coord.poll(0)
    assert d.merge and "all 1 live islands in + 1 final" in d.reason, d.reason
    assert coord.versions() == [1, 0]
    assert coord._frags[0].merged_by.keys() == {"a", "b"}
    coord.leave("b")  # no island trains any more: fragment 1 merges a's flush alone
    d = coord.poll(1)
    assert d.merge and "no live island left" in d.reason, d.reason
    assert coord.versions() == [1, 1] and coord._frags[1].merged_by.keys() == {"a"}
    st = coord.status()["islands"]
    assert (st["a"]["merged"], st["a"]["dropped"], st["b"]["merged"]) == (2, 0, 1)
    coord.register("a", 1, coord.plan.signature)  # back: live again, a round waits for it
    assert coord.status()["islands"]["a"]["finishing"] is False
    assert coord.status()["islands"]["a"]["live"] is True


def test_the_final_flushes_of_islands_that_finish_together_are_merged_together(
    tiny_config_path, tmp_path
):
    """No island trains any more, but b's flush is still under way: a round holding a's
    final upload waits for b's (at most the grace window's cap), so that b's, based on
    the same version, does not come stale; a round b sends nothing to merges at the cap."""
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=1, max_grace_s=5.0, tau=1), island_timeout_s=100.0,
    )  # fmt: skip
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    send(coord, "a", 0, step=5, final=1)
    send(coord, "a", 1, step=5, final=1)
    send(coord, "b", 1, step=5, final=1)  # b finishing too: nobody is live
    assert coord.poll(1).merge  # both in
    d = coord.poll(0)
    assert not d.merge and d.wait_until == clock.now + 5.0, d.reason
    clock.now += 2.0
    send(coord, "b", 0, step=6, final=1)  # based on version 0 too: not stale
    d = coord.poll(0)
    assert d.merge and "no live island left" in d.reason, d.reason
    assert coord.versions() == [1, 1]
    assert coord._frags[0].merged_by.keys() == {"a", "b"} == coord._frags[1].merged_by.keys()
    assert all(v["dropped"] == 0 for v in coord.status()["islands"].values())


def test_uploads_of_a_superseded_incarnation_are_refused_and_change_nothing(
    tiny_config_path, tmp_path
):
    # Island "a" restarted (registered again) while a process of its first launch, cut off,
    # still runs: that process's uploads are refused by name, whatever their step, and do
    # not take the steps the new launch counts from (it may restart from step 1).
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=PolicyOptions(tau=1))
    assert coord.register("a", 1, coord.plan.signature)["incarnation"] == 1
    assert send(coord, "a", 0, step=4)["status"] == "accepted"
    assert coord.register("a", 1, coord.plan.signature)["incarnation"] == 2
    before = coord.status()
    with pytest.raises(CoordinatorError, match=r"incarnation 1 of island 'a'.*superseded") as e:
        send(coord, "a", 0, step=50)
    assert e.value.status == 409
    after = coord.status()
    assert after["islands"]["a"] == before["islands"]["a"] and after["pending"] == before["pending"]
    assert send(coord, "a", 0, step=2, incarnation=2)["status"] == "accepted"
    with pytest.raises(CoordinatorError, match="leave from incarnation 1") as e:
        coord.leave("a", incarnation=1)  # nor can it take the new launch out of the run
    assert e.value.status == 409 and coord.status()["islands"]["a"]["left"] is False
    assert coord.leave("a", incarnation=2)["left"]


def test_islands_start_together_counts_the_ready_and_those_already_running(
    tiny_config_path, tmp_path
):
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=PolicyOptions(tau=1))
    with pytest.raises(CoordinatorError, match="unknown island 'a'") as e:
        coord.start("a")
    assert e.value.status == 404
    for island in ("a", "b", "c", "d"):
        coord.register(island, 1, coord.plan.signature)
    assert coord.start("a")["started"] == 1
    assert coord.start("a")["started"] == 1  # asking again (polling) counts it once
    send(coord, "b", 0, step=2)  # "b" runs already (a restarted coordinator: no start call)
    coord.leave("c")  # "c" came and went
    assert coord.start("d") == {"island": "d", "started": 4, "islands": 4, "clock": None}


def test_start_tells_a_late_island_where_the_rounds_schedule_is(tiny_config_path, tmp_path):
    clock = Clock()
    # H = 4, P = 2: fragment 0 goes at schedule positions 2, 6, ..., fragment 1 at 4, 8, ...
    policy = PolicyOptions(tau=1, grace_gamma=0.0)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, sync_every=4)
    for island in ("a", "late"):
        coord.register(island, 1, coord.plan.signature)
    assert coord.start("a")["clock"] is None  # no round yet: nothing to be in phase with
    send(coord, "a", 0, step=2)
    clock.now += 2.0
    send(coord, "a", 1, step=4)  # "a" steps once a second
    assert coord.poll(1).merge  # fragment 1's round opened at t = 1002 (position 4 = 0)
    clock.now += 1.5
    reply = coord.start("late")
    assert reply["clock"] == pytest.approx(1.5)  # 1.5 steps after position 0 (mod 4)


def test_a_round_waits_for_an_island_expected_from_its_pace(tiny_config_path, tmp_path):
    clock = Clock()
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1, wait_expected_steps=2)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, sync_every=4)
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    # Both step once a second, "b" 0.5 s behind "a"; fragment 0 at steps 1, 5, fragment 1 at 3.
    for step, fragment in ((1, 0), (3, 1)):
        send(coord, "a", fragment, step=step)
        clock.now += 0.5
        send(coord, "b", fragment, step=step)
        assert coord.poll(fragment).merge  # both in
        clock.now += 1.5
    assert coord.versions() == [1, 1]
    send(coord, "a", 0, step=5)  # "b" is expected 0.5 s later, within 2 steps
    d = coord.poll(0)
    assert not d.merge and "1 live island(s) expected within 2 x step 1.000s" in d.reason, d
    clock.now += 0.5
    assert send(coord, "b", 0, step=5)["status"] == "accepted"  # fresh: in the same round
    d = coord.poll(0)
    assert d.merge and "all 2 live islands in" in d.reason
    clock.now += 1.5
    send(coord, "a", 1, step=7)  # "b" stops sending: closed 2 steps after the first upload
    assert not coord.poll(1).merge
    clock.now += 2.0
    assert coord.poll(1).merge
    with pytest.raises(
        ValueError, match=r"wait_expected_steps \(3\) must be <= sync_every - tau - 1"
    ):
        make(tiny_config_path, tmp_path / "t", policy=PolicyOptions(tau=1, wait_expected_steps=3),
             sync_every=4)  # fmt: skip


def test_a_new_island_joins_a_running_run(tiny_config_path, tmp_path):
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock,
                 policy=PolicyOptions(min_quorum=2, grace_gamma=0.0, tau=1))  # fmt: skip
    coord.register("a", 1, coord.plan.signature)
    send(coord, "a", 0, step=2)
    assert coord.poll(0).merge  # K = 2 capped to the one live island
    info = coord.register("c", 2, coord.plan.signature)  # elastic: joins at version 1
    assert info["versions"] == [1, 0]
    send(coord, "a", 0, step=4)
    d = coord.poll(0)
    assert not d.merge and "quorum 1/2" in d.reason  # the newcomer now counts for the quorum
    send(coord, "c", 0, step=2, world_size=2)
    d = coord.poll(0)
    assert d.merge and coord.status()["last_merge"]["0"]["islands"] == ["a", "c"]


def test_a_stalled_islands_late_contribution_follows_the_staleness_policy(
    tiny_config_path, tmp_path
):
    clock = Clock()
    coord = make(
        tiny_config_path, tmp_path / "s", clock,
        policy=PolicyOptions(min_quorum=2, grace_gamma=0.0, tau=1), island_timeout_s=10.0,
    )  # fmt: skip
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    base = coord.versions()[0]
    send(coord, "a", 0, step=2)
    clock.now += 11.0  # "b" stalls (SIGSTOP): its lease runs out, the round closes without it
    assert coord.poll(0).merge and coord.versions()[0] == base + 1
    clock.now += 2.5
    frag = coord.plan.fragments[0]  # "b" wakes up and sends against the old version
    header = wire.UploadHeader(island="b", rank=0, world_size=1, fragment=0, base_version=base,
                               step=2, tokens=100, steps=2)  # fmt: skip
    full = {p.name: torch.ones(p.shape) for p in frag.params}
    reply = coord.upload(wire.encode_upload(header, rank_slices(frag, full, 1, 0)))
    assert reply["status"] == "dropped" and "stale" in reply["reason"]
    assert reply["late_s"] == 13.5  # after the first contribution of the round it missed
    send(coord, "a", 0, step=4)
    clock.now += 11.0  # "b" stalls again
    assert coord.poll(0).merge and coord.versions()[0] == base + 2
    header = dataclasses.replace(header, step=3)  # two versions behind: no phase to read
    reply = coord.upload(wire.encode_upload(header, rank_slices(frag, full, 1, 0)))
    assert reply["status"] == "dropped" and "late_s" not in reply
    assert coord.status()["islands"]["b"]["live"] is True  # heard from again


def test_a_restarted_islands_drop_at_the_step_of_its_last_launchs_drop_is_counted(
    tiny_config_path, tmp_path
):
    """A restarted island counts its steps again from its checkpoint: a contribution of it
    dropped at the step where its last launch had one dropped was not counted (merged +
    dropped fell short of the contributions sent; steps_dropped too)."""
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock,
                 policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))  # fmt: skip
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    base = coord.versions()[0]
    send(coord, "a", 0, step=2)
    assert coord.poll(0).merge
    frag = coord.plan.fragments[0]
    full = {p.name: torch.ones(p.shape) for p in frag.params}
    for incarnation in (1, 2):  # "b" against the old version, then again after its restart
        if incarnation == 2:
            assert coord.register("b", 1, coord.plan.signature)["incarnation"] == 2
        header = wire.UploadHeader(island="b", rank=0, world_size=1, fragment=0,
                                   base_version=base, step=2, tokens=100, steps=2,
                                   incarnation=incarnation)  # fmt: skip
        reply = coord.upload(wire.encode_upload(header, rank_slices(frag, full, 1, 0)))
        assert reply["status"] == "dropped" and "stale" in reply["reason"], reply
    b = coord.status()["islands"]["b"]
    assert (b["dropped"], b["steps_dropped"]) == (2, 4)


def test_goodput_counts_merged_steps_and_uptime_counts_windows_with_a_merge(
    tiny_config_path, tmp_path, monkeypatch
):
    import ds_diloco.coordinator as coordinator_mod

    wall = Clock()  # goodput and uptime use wall time, which survives restarts
    monkeypatch.setattr(coordinator_mod.time, "time", wall)
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock, uptime_window_s=10.0,
                 policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))  # fmt: skip
    coord.register("a", 1, coord.plan.signature)
    for step in (2, 4, 6):  # one upload every 2 s of 1 s steps... step time = 1 s
        clock.now += 2.0
        wall.now += 2.0
        send(coord, "a", step % 4 // 2, step=step, steps=2)
        assert coord.poll(step % 4 // 2).merge
    run = coord.status()["run"]
    # Merged: 3 contributions x 2 steps over P = 2 fragments = 3 steps of 1 s, in 6 s.
    assert run["goodput"] == pytest.approx(3 * 1.0 / 6.0)
    assert run["uptime"] == 1.0 and run["by_quorum"] == {1: 3}
    wall.now += 25.0  # two whole windows without a merge, a third one under way
    assert coord.status()["run"]["uptime"] == pytest.approx(1 / 3)


def test_the_time_between_an_islands_leave_and_its_next_registration_is_not_allocated(
    tiny_config_path, tmp_path, monkeypatch
):
    """A finished run resumed with more steps registers its islands again: the days in
    between counted as their allocated time, and goodput fell to nothing."""
    import ds_diloco.coordinator as coordinator_mod

    wall = Clock()
    monkeypatch.setattr(coordinator_mod.time, "time", wall)
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock,
                 policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))  # fmt: skip
    coord.register("a", 1, coord.plan.signature)
    for step in (2, 4, 6):  # 3 steps of 1 s merged in 6 s, as above
        clock.now += 2.0
        wall.now += 2.0
        send(coord, "a", step % 4 // 2, step=step, steps=2)
        assert coord.poll(step % 4 // 2).merge
    coord.leave("a")
    wall.now += 86400.0  # a day later
    coord.register("a", 1, coord.plan.signature)
    wall.now += 2.0  # 2 s allocated since, nothing merged yet
    assert coord.status()["run"]["goodput"] == pytest.approx(3 * 1.0 / 8.0)


def test_newer_step_replaces_an_islands_waiting_contribution(tiny_config_path, tmp_path):
    clock = Clock()
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=PolicyOptions(min_quorum=2, tau=1))
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    send(coord, "a", 0, step=2, tokens=10)
    send(coord, "a", 0, step=4, tokens=20)
    assert coord.status()["pending"]["0"]["complete"] == ["a"]
    send(coord, "b", 0, step=2, tokens=10)
    assert coord.poll(0).merge
    weights = coord.status()["last_merge"]["0"]["weights"]
    assert weights == {"a": 20**2 / 2, "b": 10**2 / 2}


def test_crash_without_save_never_reuses_a_served_version(tiny_config_path, tmp_path):
    clock = Clock()
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1), save_every_merges=100,
              durable_merges=False)  # fmt: skip
    coord = make(tiny_config_path, tmp_path / "s", clock, **kw)
    coord.register("a", 1, coord.plan.signature)
    initial = coord.global_tensors()
    send(coord, "a", 0, step=2)
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    served = coord.global_tensors()
    # SIGKILL: no save. A new process on the same state directory:
    again = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    assert again.versions()[0] > 1, "a version number that was served must never come back"
    assert again.versions()[1] == 0
    got = again.global_tensors()
    # The merge was not durable yet, so the values are the last saved ones.
    assert all(torch.equal(got[n], initial[n]) for n in got)
    assert any(not torch.equal(served[n], initial[n]) for n in served)


def test_with_durable_merges_a_crash_loses_no_served_merge(tiny_config_path, tmp_path):
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1), save_every_merges=100)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    coord.register("a", 1, coord.plan.signature)
    for step in (2, 4):
        send(coord, "a", 0, step=step, scale=1e-3 * step)
        assert coord.poll(0).merge
    assert coord.versions() == [2, 0]
    served = coord.global_tensors()
    # SIGKILL right after the merge (no save): a new process on the same state directory
    # comes back at exactly the served version and values, outer momentum included.
    again = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    assert again.versions() == [2, 0]
    got = again.global_tensors()
    assert all(torch.equal(got[n], served[n]) for n in served)
    for c in (coord, again):
        inc = c.register("a", 1, c.plan.signature)["incarnation"]
        send(c, "a", 0, step=6, scale=5e-3, incarnation=inc)
        assert c.poll(0).merge
    a, b = coord.global_tensors(), again.global_tensors()
    assert all(torch.equal(a[n], b[n]) for n in a), "the outer momentum must survive the crash"


def test_requests_are_served_while_a_fragment_is_being_written(tiny_config_path, tmp_path):
    cfg = make(tiny_config_path, tmp_path / "s", policy=PolicyOptions(tau=1))
    with ServerThread(cfg) as srv:
        client = CoordinatorClient(srv.url, "t", retries=0, timeout_s=10)
        fs = srv.coord._frags[0]
        fs.lock.acquire_write()  # what a merge holds during its outer step
        try:
            t0 = time.perf_counter()
            assert requests.get(srv.url + "/healthz", timeout=5).json()["ok"]
            assert client.status()["versions"] == [0, 0]
            assert client.download(1, 1, 0)[0] == 0  # another fragment: not blocked
            # The fragment being merged: its served version, whole (a merge steps a copy).
            version, slices = client.download(0, 1, 0)
            assert version == 0
            served = srv.coord.global_tensors()
            frag = srv.coord.plan.fragments[0]
            assert all(torch.equal(slices[p.name], served[p.name].reshape(-1)) for p in frag.params)
            assert time.perf_counter() - t0 < 5
        finally:
            fs.lock.release_write()


def _download_bytes(coord, fragment, world_size, rank):
    version, body = coord.download(fragment, world_size, rank)
    return version, body, bytes(body)


def _fresh_encoding(coord, fragment, world_size, rank):
    """What a download must hold: the global values' slices, encoded from scratch."""
    frag = coord.plan.fragments[fragment]
    full = coord.global_tensors()
    header = wire.FragmentHeader(
        fragment=fragment, version=coord.versions()[fragment], world_size=world_size, rank=rank,
        epoch=coord.epoch,
    )  # fmt: skip
    return wire.encode_fragment(header, rank_slices(frag, full, world_size, rank))


def test_download_bodies_are_cached_per_version_and_equal_a_fresh_encoding(
    tiny_config_path, tmp_path
):
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    coord.register("a", 2, coord.plan.signature)
    v0, body0, raw0 = _download_bytes(coord, 0, 2, 1)
    assert v0 == 0 and raw0 == _fresh_encoding(coord, 0, 2, 1)
    assert coord.download(0, 2, 1)[1] is body0  # another island of world size 2: no new encoding
    assert coord.download(0, 2, 1, after=0) == (0, None)  # not newer: nothing to send
    other = coord.download(0, 2, 0)[1]
    assert other is not body0 and bytes(other) == _fresh_encoding(coord, 0, 2, 0)

    before = coord.global_tensors()
    send(coord, "a", 0, step=2, world_size=2, scale=1e-2)
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    v1, body1, raw1 = _download_bytes(coord, 0, 2, 1)
    assert v1 == 1 and body1 is not body0  # a new version: encoded again
    assert raw1 == _fresh_encoding(coord, 0, 2, 1) and raw1 != raw0
    assert coord.download(0, 2, 1, after=0)[1] is body1
    # The old body aliased the values of version 0: the merge stepped a copy, so a
    # download still being sent goes out whole and unchanged.
    assert bytes(body0) == raw0
    header, slices = wire.decode_fragment(bytes(body0))
    assert header.version == 0
    want = rank_slices(coord.plan.fragments[0], before, 2, 1)
    assert all(torch.equal(slices[n], t) for n, t in want.items())


def test_download_cache_is_bounded(tiny_config_path, tmp_path):
    from ds_diloco import coordinator as coordinator_mod

    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=PolicyOptions(tau=1))
    n = coordinator_mod._MAX_CACHED_BODIES
    for rank in range(n + 5):
        assert coord.download(1, n + 5, rank)[0] == 0
    assert len(coord._frags[1].served.bodies) == n
    last = coord.download(1, n + 5, n + 4)[1]  # served, encoded each time, still right
    assert bytes(last) == _fresh_encoding(coord, 1, n + 5, n + 4)


def test_versions_stay_above_every_served_one_across_reservation_blocks(tiny_config_path, tmp_path):
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1), save_every_merges=1000,
              durable_merges=False)  # fmt: skip
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    coord.register("a", 1, coord.plan.signature)
    for step in range(2, 2 * 40 + 1, 2):  # 40 merges of fragment 0: several reservation blocks
        send(coord, "a", 0, step=step)
        assert coord.poll(0).merge
    assert coord.versions()[0] == 40
    again = make(tiny_config_path, tmp_path / "s", Clock(), **kw)  # after a SIGKILL
    assert again.versions()[0] > 40
    again.save(final=True)  # a clean stop releases what was reserved and not used
    third = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    assert third.versions() == again.versions()


def test_a_merge_reuses_the_buffer_of_a_version_no_download_holds_any_more(
    tiny_config_path, tmp_path
):
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    coord.register("a", 1, coord.plan.signature)
    fs = coord._frags[0]
    step = 0

    def merge():
        nonlocal step
        step += 2
        send(coord, "a", 0, step=step, scale=1e-2)
        assert coord.poll(0).merge
        return fs.values.data_ptr()

    v0 = fs.values
    merge()
    assert not coord._buffers.owns(v0)  # the values made at start are let go, not kept
    merge()
    _, held = coord.download(0, 1, 0)  # a body of version 2, still being sent, say
    raw, v2 = bytes(held), fs.values.data_ptr()
    for _ in range(4):
        assert merge() != v2, "a buffer a body still aliases must never be written"
        assert bytes(held) == raw
    del held  # sent: version 2's buffer goes back to the pool
    made = coord.status()["buffers"]["held"]
    for _ in range(4):
        merge()
    # Steady state: the served values, a row, the outer-state copy and the next values
    # take turns in the same buffers (a fifth held version 2 while its body was out); only
    # the served values stay in use.
    assert coord.status()["buffers"]["held"] == made == 5
    assert coord.status()["buffers"]["in_use"] == 1


def test_a_version_the_garbage_collector_frees_inside_the_pool_goes_back_without_a_deadlock(
    tiny_config_path, tmp_path
):
    # Seen in the suite: a coordinator froze for good mid-run (no merge, no reply, not even
    # to SIGTERM). A download cut short by its client left its body in a reference cycle
    # (the exception's traceback); the cyclic collector freed it later, at an allocation
    # inside a pool call on another thread, with the pool's lock held; the version's
    # finaliser asked the pool for that lock again (not caught live: the cause that fits).
    # A thread that holds the bookkeeping lock meanwhile (``_finish`` gives rows back under
    # it) stops the event loop too, which takes that lock on every long poll.
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    coord.register("a", 1, coord.plan.signature)
    pool, steps = coord._buffers, iter(range(2, 100, 2))

    def merge():
        send(coord, "a", 0, step=next(steps), scale=1e-2)
        assert coord.poll(0).merge

    merge()
    merge()
    _, body = coord.download(0, 1, 0)  # version 2, being sent when its client goes away
    cycle = [body]
    cycle.append(cycle)  # freed by the collector only, as a traceback's frames are
    del body
    merge()  # version 3 is served: version 2's buffer goes back once the body is freed
    in_use = pool.usage()["in_use"]
    del cycle

    def collect_inside_the_pool():
        with pool._lock:  # where any pool call is when the collector runs in it
            gc.collect()

    worker = threading.Thread(target=collect_inside_the_pool, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the finaliser waited for the pool's lock its thread held"
    assert pool.usage()["in_use"] == in_use - 1  # version 2's buffer is free again
    merge()  # and the coordinator goes on


def test_after_a_restart_the_first_merge_never_writes_the_served_buffer(tiny_config_path, tmp_path):
    # Seen in the chaos test: a restarted coordinator served version 53 of a fragment with
    # other values than before the kill. Resuming published the loaded values twice (as
    # version 0, then as the saved version); dropping the first publication recycled the
    # buffer still served as the second, and the next merge stepped it in place.
    kw = dict(policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1))
    coord = make(tiny_config_path, tmp_path / "s", Clock(), **kw)
    coord.register("a", 1, coord.plan.signature)
    send(coord, "a", 0, step=2, scale=1e-2)
    assert coord.poll(0).merge and coord.versions()[0] == 1
    again = make(tiny_config_path, tmp_path / "s", Clock(), **kw)  # resumed (durable merges)
    assert again.versions()[0] == 1
    assert again.status()["buffers"]["held"] == 0, "loaded values are not the pool's to reuse"
    version, held = again.download(0, 1, 0)  # a body of version 1, being sent, say
    assert version == 1
    raw, served = bytes(held), again.global_tensors()
    inc = again.register("a", 1, again.plan.signature)["incarnation"]
    send(again, "a", 0, step=4, scale=1e-2, incarnation=inc)
    assert again.poll(0).merge and again.versions()[0] == 2
    assert bytes(held) == raw, "a served version's values changed under its download"
    after = again.global_tensors()
    assert any(not torch.equal(after[n], served[n]) for n in coord.plan.fragments[0].names)


def test_norm_guard_drops_a_pseudo_gradient_far_above_the_fragments_recent_ones(
    tiny_config_path, tmp_path
):
    clock = Clock()
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    guard = NormGuard(max_ratio=10.0, window=8, min_history=4)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, norm_guard=guard)
    coord.register("a", 1, coord.plan.signature)
    for i in range(4):  # the history: four ordinary contributions, each merged
        assert send(coord, "a", 0, step=2 + 2 * i, scale=1e-3)["status"] == "accepted"
        assert coord.poll(0).merge
    before, versions = coord.global_tensors(), coord.versions()
    reply = send(coord, "a", 0, step=20, scale=1.0)  # 1000x: an island diverging
    assert reply["status"] == "dropped" and "norm_guard.max_ratio 10" in reply["reason"], reply
    assert not coord.poll(0).merge and coord.versions() == versions
    assert all(torch.equal(before[n], t) for n, t in coord.global_tensors().items())
    assert coord.status()["islands"]["a"]["dropped"] == 1
    # Covering 3 x the steps at 3 x the size: the same per step, taken.
    assert send(coord, "a", 0, step=22, scale=3e-3, steps=6)["status"] == "accepted"
    assert coord.poll(0).merge
    # Off by default (the paper): the same 1000x contribution is merged.
    plain = make(tiny_config_path, tmp_path / "p", clock, policy=policy)
    plain.register("a", 1, plain.plan.signature)
    for i in range(4):
        send(plain, "a", 0, step=2 + 2 * i)
        plain.poll(0)
    assert send(plain, "a", 0, step=20, scale=1.0)["status"] == "accepted"


def _upload_whole(coord, island, fragment, step, full, *, tokens, steps):
    """One rank-0-of-1 upload of ``full`` (name -> tensor) against the current version."""
    frag = coord.plan.fragments[fragment]
    header = wire.UploadHeader(
        island=island, rank=0, world_size=1, fragment=fragment,
        base_version=coord.versions()[fragment], step=step, tokens=tokens, steps=steps,
    )  # fmt: skip
    return coord.upload(wire.encode_upload(header, rank_slices(frag, full, 1, 0)))


def test_outer_averaging_makes_the_global_model_the_weighted_average_of_the_islands(
    tiny_config_path, tmp_path
):
    # "average" is documented as plain model averaging, but the tensors outside
    # plain_patterns were merged by RDA: with 2 islands the global model moved 1.4x as
    # far as the average of their models (sqrt(M) for M nearly orthogonal updates).
    policy = PolicyOptions(min_quorum=2, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy,
                 outer=OuterOptimConfig(name="average"))  # fmt: skip
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    frag = coord.plan.fragments[0]
    before = coord.global_tensors()
    g = torch.Generator().manual_seed(0)
    deltas = [{p.name: torch.randn(p.shape, generator=g) * 1e-2 for p in frag.params}
              for _ in range(2)]  # fmt: skip
    tokens, steps = (100, 300), (2, 4)
    for island, d, t, s in zip("ab", deltas, tokens, steps):
        assert _upload_whole(coord, island, 0, 4, d, tokens=t, steps=s)["status"] == "accepted"
    assert coord.poll(0).merge
    got = coord.global_tensors()
    w = [t * t / s for t, s in zip(tokens, steps)]
    for p in frag.params:  # the token-weighted mean of the islands' local values
        locals_ = [before[p.name].double() - d[p.name].double() for d in deltas]
        want = (w[0] * locals_[0] + w[1] * locals_[1]) / sum(w)
        assert torch.allclose(got[p.name].double(), want, rtol=1e-5, atol=1e-7), p.name


def test_merged_values_equal_a_reference_over_mixed_world_sizes_frozen_slices_and_staleness(
    tiny_config_path, tmp_path
):
    """Three rounds of three islands of world sizes 1, 2 and 3, tokens 10^5 against 7, one
    island leaving a tensor out as frozen (``zeros``) and, in the last round, sending one
    version stale (policy discount): the served values equal the oracle merge of the
    whole tensors followed by Nesterov, both written out here in float64."""
    from ds_diloco.merge import is_plain_tensor, merge_reference

    policy = PolicyOptions(min_quorum=3, grace_gamma=0.0, tau=1)
    stale_policy = StalenessPolicy(mode="discount", discount_lambda=0.5)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, staleness=stale_policy)
    for island, world in (("a", 1), ("b", 2), ("c", 3)):
        coord.register(island, world, coord.plan.signature)
    frag = next(f for f in coord.plan.fragments if len(f.names) >= 3)
    frozen = frag.names[1]
    assert any(is_plain_tensor(n, coord.cfg.plain_patterns) for n in frag.names)  # both kinds
    assert not all(is_plain_tensor(n, coord.cfg.plain_patterns) for n in frag.names)
    theta = {n: coord.global_tensors()[n].double() for n in frag.names}
    others = {n: t for n, t in coord.global_tensors().items() if n not in theta}
    lr, mu = coord.cfg.outer.lr, coord.cfg.outer.momentum
    g = torch.Generator().manual_seed(0)
    buf: dict[str, torch.Tensor] = {}
    for rnd in range(3):
        deltas, weights = [], []
        # island, world size, tokens, steps, scale, frozen slices, versions stale
        for island, world, tokens, steps, scale, zeros, stale in (
            ("a", 1, 100_000, 2, 1e-3, (), 0),
            ("b", 2, 7, 3, 1e-1, (), 0),
            ("c", 3, 5_000, 5, 1e-2, (frozen,), 1 if rnd == 2 else 0),
        ):
            full = {p.name: torch.randn(p.shape, generator=g) * scale for p in frag.params}
            for n in zeros:
                full[n] = torch.zeros_like(full[n])
            for rank in range(world):
                header = wire.UploadHeader(
                    island=island, rank=rank, world_size=world, fragment=frag.index,
                    base_version=coord.versions()[frag.index] - stale, step=10 * (rnd + 1),
                    tokens=tokens, steps=steps, zeros=",".join(zeros),
                )  # fmt: skip
                sl = {
                    n: t for n, t in rank_slices(frag, full, world, rank).items() if n not in zeros
                }
                reply = coord.upload(wire.encode_upload(header, sl))
                assert reply["status"] == "accepted", reply
            deltas.append(full)
            weights.append(tokens * tokens / steps / (1 + 0.5 * stale))
        assert coord.poll(frag.index).merge
        merged = merge_reference(
            deltas, weights, lambda n: is_plain_tensor(n, coord.cfg.plain_patterns)
        )
        for n in frag.names:  # m <- mu m + D (m = D at first); theta <- theta - lr (D + mu m)
            buf[n] = merged[n] if n not in buf else mu * buf[n] + merged[n]
            theta[n] = theta[n] - lr * (merged[n] + mu * buf[n])
        got = coord.global_tensors()
        for n in frag.names:
            assert torch.allclose(got[n].double(), theta[n], rtol=1e-5, atol=1e-6), (rnd, n)
        assert all(torch.equal(got[n], t) for n, t in others.items())  # other fragments


def test_a_failed_merge_changes_nothing_and_its_contributions_merge_next_round(
    tiny_config_path, tmp_path, monkeypatch
):
    from ds_diloco import coordinator as coordinator_mod
    from ds_diloco.merge import is_plain_tensor, merge_reference

    clock = Clock()
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy)
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    send(coord, "a", 0, step=2, scale=1e-2)  # a first merge: the outer momentum is not zero
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    fs, frag = coord._frags[0], coord.plan.fragments[0]
    before, momentum = coord.global_tensors(), fs.optimizer.state_dict()
    real_step, calls = fs.optimizer.step, []

    def step_then_fail(param, grad):  # fails once the momentum and the values are written
        real_step(param, grad)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected outer step failure")

    monkeypatch.setattr(fs.optimizer, "step", step_then_fail)
    g = torch.Generator().manual_seed(7)
    da = {p.name: torch.randn(p.shape, generator=g) * 1e-2 for p in frag.params}
    db = {p.name: torch.randn(p.shape, generator=g) * 1e-2 for p in frag.params}
    assert _upload_whole(coord, "a", 0, 4, da, tokens=100, steps=2)["status"] == "accepted"
    d = coord.poll(0)
    assert not d.merge and "injected outer step failure" in d.reason, d.reason
    assert d.wait_until == clock.now + coordinator_mod.MERGE_RETRY_S  # no tight retry loop
    # Nothing changed: version, served values, outer momentum (the step wrote it in place).
    assert coord.versions() == [1, 0]
    assert all(torch.equal(t, before[n]) for n, t in coord.global_tensors().items())
    now = fs.optimizer.state_dict()
    assert now.keys() == momentum.keys() and all(torch.equal(now[k], momentum[k]) for k in now)
    st = coord.status()
    assert st["merge_failures"] == [1, 0]
    assert st["last_merge_failure"]["0"]["back"] == ["a"]
    assert st["pending"]["0"]["complete"] == ["a"]  # kept for the next attempt
    assert st["islands"]["a"]["dropped"] == 0 and st["islands"]["a"]["merged"] == 1
    # A new contribution joins the kept one; the round waits out the backoff first.
    assert _upload_whole(coord, "b", 0, 4, db, tokens=300, steps=4)["status"] == "accepted"
    assert not coord.poll(0).merge and coord.versions() == [1, 0]
    clock.now = d.wait_until
    d = coord.poll(0)
    assert d.merge and coord.versions() == [2, 0], d.reason
    assert coord.status()["last_merge"]["0"]["islands"] == ["a", "b"]
    # Expected, independently: the oracle merge of a and b, then Nesterov (lr 0.7, momentum
    # 0.9) from the values and momentum from before the failed attempt, in float64.
    lr, mu = coord.cfg.outer.lr, coord.cfg.outer.momentum
    merged = merge_reference(
        [da, db], [100**2 / 2, 300**2 / 4], lambda n: is_plain_tensor(n, coord.cfg.plain_patterns)
    )
    got = coord.global_tensors()
    buf0 = momentum["momentum_buffer"].double()
    for p, off in zip(frag.params, frag.offsets):
        grad = merged[p.name].reshape(-1)
        buf = mu * buf0[off : off + p.numel] + grad
        want = before[p.name].double().reshape(-1) - lr * (grad + mu * buf)
        assert torch.allclose(got[p.name].double().reshape(-1), want, rtol=1e-5, atol=1e-7), p.name
    st = coord.status()
    assert st["merge_failures"] == [1, 0] and st["pending"] == {}
    assert {k: (v["merged"], v["dropped"]) for k, v in st["islands"].items()} == {
        "a": (2, 0),
        "b": (1, 0),
    }


def test_a_merge_failing_again_and_again_backs_off_then_drops_its_contributions(
    tiny_config_path, tmp_path
):
    import errno

    from ds_diloco import coordinator as coordinator_mod

    clock = Clock()
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, durable_merges=False)
    coord.register("a", 1, coord.plan.signature)
    before = coord.global_tensors()
    real_write, disk_full = coord.store.write_json, [True]

    def write_json(name, obj):  # the version reservation is what the disk refuses
        if name == "versions.json" and disk_full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(name, obj)

    coord.store.write_json = write_json
    send(coord, "a", 0, step=2)
    waits = []
    for attempt in range(1, coordinator_mod.MERGE_ATTEMPTS + 1):
        d = coord.poll(0)
        assert not d.merge and "No space left" in d.reason, (attempt, d.reason)
        assert coord.versions() == [0, 0], "a version must not be served unreserved"
        assert not coord.poll(0).merge  # at once again: held
        waits.append(d.wait_until - clock.now)
        clock.now = d.wait_until
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0]  # doubling, never a tight loop
    st = coord.status()
    assert st["merge_failures"] == [coordinator_mod.MERGE_ATTEMPTS, 0]
    assert st["last_merge_failure"]["0"]["dropped"] == ["a step 2"]
    assert st["pending"] == {} and st["islands"]["a"]["dropped"] == 1  # given up: counted
    assert all(torch.equal(t, before[n]) for n, t in coord.global_tensors().items())
    disk_full[0] = False
    send(coord, "a", 0, step=4)
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    assert coord.store.read_json("versions.json")["0"] >= 1  # reserved on disk before served
    st = coord.status()
    assert st["islands"]["a"]["merged"] == 1 and st["islands"]["a"]["dropped"] == 1
    d = coord.decide(0)
    assert "backing off" not in d.reason  # a merge that works ends the backoff


def test_a_failed_merge_keeps_the_final_flush_of_an_island_that_left(tiny_config_path, tmp_path):
    # A final flush is kept when its island leaves, merged with the next round; a failed
    # merge of that round dropped it for good, as if its island had left mid-round.
    import errno

    clock = Clock()
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, durable_merges=False)
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    assert send(coord, "a", 0, step=4, final=1)["status"] == "accepted"
    coord.leave("a")
    real_write, disk_full = coord.store.write_json, [True]

    def write_json(name, obj):
        if name == "versions.json" and disk_full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(name, obj)

    coord.store.write_json = write_json
    assert send(coord, "b", 0, step=4)["status"] == "accepted"
    d = coord.poll(0)
    assert not d.merge and "No space left" in d.reason, d.reason
    failure = coord.status()["last_merge_failure"]["0"]
    assert (sorted(failure["back"]), failure["dropped"]) == (["a", "b"], []), failure
    disk_full[0] = False
    clock.now = d.wait_until
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    assert coord.status()["last_merge"]["0"]["islands"] == ["a", "b"]
    st = coord.status()["islands"]
    assert (st["a"]["merged"], st["a"]["dropped"]) == (1, 0)


def test_registrations_do_not_put_off_the_periodic_save_of_the_fragments(
    tiny_config_path, tmp_path
):
    # Without durable merges, fragments are saved every save_every_merges merges. Every save
    # of the island table (each registration and leave) counted as one and started the
    # count again: with islands registering often, the fragments were never saved.
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy,
                 durable_merges=False, save_every_merges=2)  # fmt: skip
    coord.register("a", 1, coord.plan.signature)
    send(coord, "a", 0, step=2)
    assert coord.poll(0).merge
    coord.register("b", 1, coord.plan.signature)  # the table is saved, not the fragments
    send(coord, "a", 1, step=4)
    assert coord.poll(1).merge and coord.versions() == [1, 1]
    assert [coord.store.read_fragment(i)[0] for i in range(2)] == [1, 1]  # the 2nd merge saved


def test_a_failed_periodic_save_after_a_merge_is_not_a_failed_merge(tiny_config_path, tmp_path):
    # The merge is served when the periodic save runs: its failure is logged, the merge
    # stands (no failure counted, no exception for the round loop to log as a failed
    # merge), and the next merge saves again.
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, save_every_merges=1)
    coord.register("a", 1, coord.plan.signature)
    real, calls = coord._save_table, []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        real()

    coord._save_table = fail_once
    send(coord, "a", 0, step=2, scale=1e-2)
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    assert coord.status()["merge_failures"] == [0, 0] and calls == [1]
    send(coord, "a", 1, step=4, scale=1e-2)
    assert coord.poll(1).merge and coord.versions() == [1, 1] and calls == [1, 1]


def test_a_state_written_for_another_model_is_refused(tiny_config_path, tmp_path):
    # A resume with another model was taken: every island then failed on the first
    # fragment's size, was restarted and given up (exit 1 after 97 s).
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    other = json.loads(Path(tiny_config_path).read_text())
    other["intermediate_size"] += 64
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="was written for another model"):
        make(str(other_path), tmp_path / "s", Clock(), policy=policy)
    assert make(tiny_config_path, tmp_path / "s", Clock(), policy=policy).versions() == [
        0,
        0,
    ]  # the same: fine


@pytest.mark.parametrize(
    "before, after",
    [
        (OuterOptimConfig(), OuterOptimConfig(name="average")),
        (OuterOptimConfig(momentum=0.0), OuterOptimConfig(momentum=0.4)),
        (OuterOptimConfig(), OuterOptimConfig(name="delayed_nesterov")),
    ],
)
def test_a_state_written_with_another_outer_optimizer_is_refused_naming_the_setting(
    tiny_config_path, tmp_path, before, after
):
    # A resume with another outer optimizer said only "ds-diloco: error: outer optimizer
    # state has unexpected key(s) ['momentum_buffer']": not which file, nor which setting.
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, outer=before)
    coord.register("a", 1, coord.plan.signature)
    send(coord, "a", 0, step=2)
    assert coord.poll(0).merge
    coord.save(final=True)
    with pytest.raises(ValueError) as e:
        make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, outer=after)
    message = str(e.value)
    assert str(tmp_path / "s") in message and "fragment 0" in message, message
    assert "another outer optimizer" in message and "use a new state_dir or the old" in message
    # The state is untouched: the old settings resume it.
    again = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, outer=before)
    assert again.versions() == [1, 0]
    # Other lr and momentum values are no other optimizer: they resume.
    if before.momentum:
        changed = dataclasses.replace(before, lr=0.3, momentum=0.5)
        assert make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, outer=changed)


def test_merge_counts_made_durable_after_the_last_table_save_survive_a_crash(
    tiny_config_path, tmp_path
):
    # After a SIGKILL the counts came from the periodic table, behind the durable versions
    # for good (versions [14, 13, 15, 15], merges [12, 11, 12, 13] at the end of a run).
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, save_every_merges=100)
    coord.register("a", 1, coord.plan.signature)
    for step in (2, 4, 6):
        send(coord, "a", 0, step=step)
        assert coord.poll(0).merge
    assert coord.versions() == [3, 0] and coord.status()["merges"] == [3, 0]
    del coord  # a crash: no save
    again = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    assert again.versions() == [3, 0] and again.status()["merges"] == [3, 0]


DISCOUNT = StalenessPolicy(mode="discount")


def test_an_upload_merged_before_a_crash_is_a_replay_after_it(tiny_config_path, tmp_path):
    # The replay marks and the island's counts reached disk only with the table (every 10
    # merges): after a SIGKILL the same upload sent again was merged a second time (a
    # discounted stale contribution: version 1 -> 2), and the island's merges read 0.
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, staleness=DISCOUNT)
    coord.register("a", 2, coord.plan.signature)
    send(coord, "a", 0, step=2, world_size=2, tokens=300, steps=2)
    assert coord.poll(0).merge and coord.versions() == [1, 0]
    del coord  # a crash: no save
    again = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, staleness=DISCOUNT)
    before = again.global_tensors()
    for rank in (0, 1):
        with pytest.raises(CoordinatorError, match="replayed upload") as e:
            replay = again.plan.fragments[0]
            header = wire.UploadHeader(
                island="a", rank=rank, world_size=2, fragment=0, base_version=0, step=2,
                tokens=300, steps=2, incarnation=1,
            )  # fmt: skip
            full = {p.name: torch.ones(p.shape) * 1e-3 for p in replay.params}
            again.upload(wire.encode_upload(header, rank_slices(replay, full, 2, rank)))
        assert e.value.status == 409
    assert not again.poll(0).merge and again.versions() == [1, 0]
    after = again.global_tensors()
    assert all(torch.equal(before[n], after[n]) for n in before)
    island = again.status()["islands"]["a"]
    assert (island["merged"], island["tokens_merged"], island["dropped"]) == (1, 300, 0), island
    # Its next step is new; and registered again (a restart from a checkpoint) it may count
    # its steps from 1 again.
    assert send(again, "a", 0, step=4, world_size=2)["status"] == "accepted"
    again.register("a", 2, again.plan.signature)
    assert send(again, "a", 1, step=2, world_size=2, incarnation=2)["status"] == "accepted"


def test_a_registration_the_state_lost_is_taken_from_the_upload_not_called_superseded(
    tiny_config_path, tmp_path
):
    # A state dir put back from a backup older than the island's last registration: the
    # island's uploads (incarnation 2, the coordinator knew 1) were refused as superseded,
    # and the island stopped for good.
    import shutil

    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    coord.register("a", 1, coord.plan.signature)
    coord.save()
    shutil.copytree(tmp_path / "s", tmp_path / "backup")
    assert coord.register("a", 2, coord.plan.signature)["incarnation"] == 2  # resized
    del coord
    back = make(tiny_config_path, tmp_path / "backup", Clock(), policy=policy)
    reply = send(back, "a", 0, step=2, world_size=2, incarnation=2)
    assert reply["status"] == "accepted" and reply["complete"], reply
    assert back.poll(0).merge and back.versions() == [1, 0]
    with pytest.raises(CoordinatorError) as e:  # the launch before it is the superseded one
        send(back, "a", 1, step=2, world_size=1, incarnation=1)
    assert e.value.status == 409 and wire.SUPERSEDED in str(e.value), e.value
    with pytest.raises(CoordinatorError) as e:  # a leave from the future is not "superseded"
        back.leave("a", 3)
    assert e.value.status == 409 and wire.SUPERSEDED not in str(e.value), e.value
    # A crash now: the merge is on disk, the adopted registration only in memory. The same
    # upload again is still a replay (it was adopted from its mark and merged twice).
    del back
    again = make(tiny_config_path, tmp_path / "backup", Clock(), policy=policy)
    with pytest.raises(CoordinatorError, match="replayed upload"):
        send(again, "a", 0, step=2, world_size=2, incarnation=2)
    assert again.status()["islands"]["a"]["merged"] == 1 and again.versions() == [1, 0]


def test_an_island_the_state_has_no_record_of_is_taken_from_its_upload_only_in_its_run(
    tiny_config_path, tmp_path
):
    # A state dir put back from a backup older than the island's first registration: its
    # uploads were refused as from an unknown island (404) while it trained on, for good.
    import shutil

    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    run = coord.plan_info()["run"]
    assert len(run) == 16 and coord.register("a", 1, coord.plan.signature)["run"] == run
    shutil.copytree(tmp_path / "s", tmp_path / "backup")  # before b registered
    coord.register("b", 2, coord.plan.signature)
    del coord
    back = make(tiny_config_path, tmp_path / "backup", Clock(), policy=policy)
    assert back.plan_info()["run"] == run  # the run id is the state dir's: a backup keeps it
    # Without the run id (an island from before them), or another run's: refused, unchanged.
    for other in ("", "0123456789abcdef"):
        with pytest.raises(CoordinatorError, match="unknown island 'b': register it first") as e:
            send(back, "b", 0, step=2, world_size=2, run=other)
        assert e.value.status == 404 and "b" not in back.status()["islands"]
    reply = send(back, "b", 0, step=2, world_size=2, run=run)
    assert reply["status"] == "accepted" and reply["complete"], reply
    assert back.poll(0).merge and back.versions() == [1, 0]
    island = back.status()["islands"]["b"]
    assert (island["world_size"], island["merged"]) == (2, 1), island
    with pytest.raises(CoordinatorError) as e:  # its registration is the upload's
        send(back, "b", 1, step=2, world_size=2, incarnation=0, run=run)
    assert e.value.status == 409 and wire.SUPERSEDED in str(e.value), e.value
    # A crash before the table's next save: the island is back from the fragment's merge
    # marks, and the same upload is a replay (the table had no b: merged a second time).
    del back
    back = make(tiny_config_path, tmp_path / "backup", Clock(), policy=policy)
    with pytest.raises(CoordinatorError, match="replayed upload"):
        send(back, "b", 0, step=2, world_size=2, run=run)
    island = back.status()["islands"]["b"]
    assert (island["world_size"], island["merged"], back.versions()) == (2, 1, [1, 0]), island
    # A state dir from before run ids gets one on load, kept from then on.
    state = json.loads((tmp_path / "backup" / "coordinator.json").read_text())
    del state["run_id"]
    (tmp_path / "backup" / "coordinator.json").write_text(json.dumps(state))
    given = make(tiny_config_path, tmp_path / "backup", Clock(), policy=policy).run_id
    assert given and given != run
    assert make(tiny_config_path, tmp_path / "backup", Clock(), policy=policy).run_id == given
    # A new state dir is a new run.
    fresh = make(tiny_config_path, tmp_path / "new", Clock(), policy=policy)
    assert fresh.plan_info()["run"] != run


def test_a_superseded_launch_is_told_so_whatever_its_world_size(tiny_config_path, tmp_path):
    # Relaunched with another world size, the old launch's uploads were refused for their
    # world size (422): never told it was superseded, it trained to the end for nothing.
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    coord.register("a", 1, coord.plan.signature)
    assert coord.register("a", 2, coord.plan.signature)["incarnation"] == 2
    with pytest.raises(CoordinatorError) as e:
        send(coord, "a", 0, step=2, world_size=1, incarnation=1)
    assert e.value.status == 409 and wire.SUPERSEDED in str(e.value), e.value


def _send_rank(coord, island, fragment, step, rank, world_size, base, steps=2):
    frag = coord.plan.fragments[fragment]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    header = wire.UploadHeader(
        island=island, rank=rank, world_size=world_size, fragment=fragment, base_version=base,
        step=step, tokens=100, steps=steps, incarnation=1,
    )  # fmt: skip
    return coord.upload(wire.encode_upload(header, rank_slices(frag, full, world_size, rank)))


def test_what_a_crash_leaves_on_disk_is_read_back_the_same_by_the_coordinator_and_export(
    tiny_config_path, tmp_path
):
    # Merge counts and island counts made durable with the fragments after the table's last
    # save: the coordinator counted them on load, an export from the state dir did not (its
    # model card said 0 merges). And a contribution whose ranks were dropped on both sides
    # of a restart counted as two drops (the marks of the last drop were not saved).
    from ds_diloco.export import load_global

    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, save_every_merges=100)
    coord.register("a", 1, coord.plan.signature)
    coord.register("b", 2, coord.plan.signature)
    _send_rank(coord, "b", 0, step=2, rank=0, world_size=2, base=0)  # half of b's contribution
    send(coord, "a", 0, step=2)
    assert coord.poll(0).merge  # b's half is stale now: dropped, once
    coord.save()
    for step in (4, 6):
        send(coord, "a", 0, step=step)
        assert coord.poll(0).merge
    assert coord.status()["islands"]["b"]["dropped"] == 1
    del coord  # a crash: the table holds 1 merge, the fragment file 3
    exported = load_global(tmp_path / "s")
    assert exported.merges == [3, 0] and exported.islands["a"]["merged"] == 3, exported.islands
    again = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    assert again.status()["merges"] == [3, 0]
    assert again.status()["islands"]["a"]["merged"] == 3
    reply = _send_rank(again, "b", 0, step=2, rank=1, world_size=2, base=0)  # the other half
    assert reply["status"] == "dropped", reply
    assert again.status()["islands"]["b"]["dropped"] == 1  # the same contribution


def test_a_download_leaves_out_the_kept_slices_that_did_not_change(tiny_config_path, tmp_path):
    """Slices frozen everywhere keep their values merge after merge: a download after the
    island's version leaves out those it offers to keep (``keep``, same ``epoch``)."""
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    coord.register("a", 1, coord.plan.signature)
    frag = next(f for f in coord.plan.fragments if len(f.names) >= 3)
    frozen, moved, *rest = frag.names
    everything = wire.keep_mask(frag.names, frag.names)

    def merge(step, zeros):
        header = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=frag.index,
                                   base_version=coord.versions()[frag.index], step=step,
                                   tokens=10, steps=2, zeros=",".join(zeros))  # fmt: skip
        body = {p.name: torch.full((p.numel,), 1e-3) for p in frag.params if p.name not in zeros}
        assert coord.upload(wire.encode_upload(header, body))["status"] == "accepted"
        assert coord.poll(frag.index).merge

    served = {"download_bytes": 0, "unchanged_bytes": 0}

    def left_out(after, keep=everything, epoch=None):
        version, body = coord.download(frag.index, 1, 0, after, keep, epoch or coord.epoch)
        header, tensors = wire.decode_fragment(bytes(body))
        served["download_bytes"] += len(body)
        numel = {p.name: p.numel for p in frag.params}
        served["unchanged_bytes"] += 4 * sum(numel[n] for n in header.unchanged_names())
        glob = coord.global_tensors()
        assert set(tensors) == set(frag.names) - set(header.unchanged_names())
        assert all(torch.equal(t, glob[n].reshape(-1)) for n, t in tensors.items())
        assert header.epoch == coord.epoch and header.version == version
        return header.unchanged_names()

    merge(2, zeros=[frozen])  # v1: the frozen slice merged as 0, all others moved
    merge(4, zeros=[frozen, moved])  # v2: ``moved`` gets 0 too, but its momentum moves it
    assert left_out(after=1) == [frozen]
    assert left_out(after=0) == [frozen]  # never changed: not since v0 either
    assert left_out(after=1, keep=wire.keep_mask(frag.names, rest)) == []  # not offered
    assert left_out(after=None) == []  # no version held: everything
    assert left_out(after=1, epoch="another-process") == []  # versions of another coordinator
    traffic = coord.status()["traffic"]  # the bytes served and saved (/metrics counters)
    assert {k: traffic[k] for k in served} == served and served["unchanged_bytes"] > 0
    for bad, message in [("zz", "hexadecimal"), (format(1 << len(frag.names), "x"), "has")]:
        with pytest.raises(CoordinatorError, match=message):
            coord.download(frag.index, 1, 0, 1, bad, coord.epoch)


def test_versions_never_go_back_when_durable_merges_was_turned_off(tiny_config_path, tmp_path):
    # The table said durable_merges (from a run that had it on); the next run, with it off,
    # served versions 1-3 from reserved numbers and was killed before saving its table: the
    # restart took the file's version 0 and served version 1 again with other values.
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    coord.register("a", 1, coord.plan.signature)
    coord.save()
    del coord
    off = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, durable_merges=False)
    for step in (2, 4, 6):
        send(off, "a", 0, step=step)
        assert off.poll(0).merge
    assert off.versions()[0] == 3
    del off  # a crash before any save
    again = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy, durable_merges=False)
    assert again.versions()[0] > 3, again.versions()


def test_slices_left_out_as_zeros_merge_as_zeros_and_bad_lists_change_nothing(
    tiny_config_path, tmp_path
):
    """An island's frozen parameters (``zeros``): not in the body, merged as 0."""
    policy = PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", Clock(), policy=policy)
    coord.register("a", 2, coord.plan.signature)
    frag = next(f for f in coord.plan.fragments if len(f.names) >= 2)
    frozen, *trained = frag.names
    before = coord.global_tensors()
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}

    def upload(rank, zeros, names):
        header = wire.UploadHeader(
            island="a", rank=rank, world_size=2, fragment=frag.index, base_version=0, step=2,
            tokens=10, steps=2, zeros=zeros,
        )  # fmt: skip
        slices = rank_slices(frag, full, 2, rank)
        return coord.upload(wire.encode_upload(header, {n: slices[n] for n in names}))

    bad = [
        ("nope", trained, r"'zeros' lists slices that fragment \d+ does not have: \['nope'\]"),
        (frozen, frag.names, "'zeros' lists a slice twice, or one the body holds too"),
        (f"{frozen},{frozen}", trained, "'zeros' lists a slice twice"),
        ("", trained, "slices do not match the plan: missing"),  # left out, not listed
    ]
    for zeros, names, message in bad:
        with pytest.raises(CoordinatorError, match=message):
            upload(0, zeros, names)
    assert coord.status()["islands"]["a"]["last_step"] == 0  # nothing of them was taken
    for rank in range(2):
        assert upload(rank, frozen, trained)["status"] == "accepted"
    assert coord.poll(frag.index).merge
    after = coord.global_tensors()
    assert torch.equal(after[frozen], before[frozen])
    assert all(not torch.equal(after[n], before[n]) for n in trained)


def test_fragment_sized_buffers_are_shared_by_the_fragments(tiny_config_path, tmp_path):
    # 4 islands of 2 ranks sync 8 fragments in turn, all 4 in every round (K = 4). In use:
    # each fragment's served values once it merged (those made at start are let go), a row
    # per contribution from its first upload until its merge (4 at once), and a merge's
    # output, new values and outer-state copy. The 8 fragments fall in 4 size classes:
    # the embedding's alone (the largest: rows, outputs and copies are of its class), the
    # others in 3. Made for good: 7 served values and a spare for each of their 3 classes,
    # and 8 of the largest class (its served values, 4 rows, an output, the next values
    # and a copy of the momentum, in use together while it merges): 18, where buffers kept
    # per fragment were 8 x (4 rows, an output, a spare of the values) + the values: 56.
    clock = Clock()
    policy = PolicyOptions(min_quorum=4, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, num_fragments=8,
                 sync_every=8, durable_merges=False)  # fmt: skip
    sizes = [f.numel for f in coord.plan.fragments]
    assert [size_class(n) for n in sizes].count(size_class(max(sizes))) == 1
    assert len({size_class(n) for n in sizes}) == 4
    islands = ("a", "b", "c", "d")
    for island in islands:
        coord.register(island, 2, coord.plan.signature)
    for step in range(1, 25):
        fragment = (step - 1) % 8
        for island in islands:
            send(coord, island, fragment, step, world_size=2)
        assert coord.status()["buffers"]["in_use"] == min(step - 1, 8) + 4
        assert coord.poll(fragment).merge
        assert coord.status()["buffers"]["in_use"] == min(step, 8)
        if step == 16:
            two_cycles = coord.status()["buffers"]
    assert coord.versions() == [3] * 8
    made = {k: two_cycles[k] for k in ("held", "bytes")}
    assert made["held"] == 18
    assert coord.status()["buffers"] == {**made, "in_use": 8}  # the third cycle made none
    # One island's half-sent contribution holds one row; dropped, it gives it back.
    frag = coord.plan.fragments[0]
    full = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    header = wire.UploadHeader(island="a", rank=0, world_size=2, fragment=0, base_version=3,
                               step=25, tokens=100, steps=1)  # fmt: skip
    coord.upload(wire.encode_upload(header, rank_slices(frag, full, 2, 0)))
    assert coord.status()["buffers"]["in_use"] == 9
    again = coord.register("a", 2, coord.plan.signature)  # registers again: its pending ones go
    assert coord.status()["buffers"] == {**made, "in_use": 8}
    text = prometheus_text(coord.status())
    assert f"ds_diloco_fragment_buffer_bytes {made['bytes']}\n" in text
    # A failed merge gives back what it took: the values it stepped, the outer-state copy.
    for island in islands:
        inc = again["incarnation"] if island == "a" else 1
        send(coord, island, 1, 26, world_size=2, incarnation=inc)
    opt = coord._frags[1].optimizer
    real_step = opt.step

    def step_then_fail(param, grad):
        real_step(param, grad)
        raise RuntimeError("injected outer step failure")

    opt.step = step_then_fail
    assert not coord.poll(1).merge
    opt.step = real_step
    assert coord.versions()[1] == 3
    assert coord.status()["buffers"] == {**made, "in_use": 8 + 4}  # the rows wait for a retry


def test_buffer_pool_reuses_its_buffers_by_size_class_and_refuses_misuse():
    assert [size_class(n) for n in (1, 16, 17, 100, 1000, 2**20 + 1)] == [
        1, 16, 18, 104, 1024, 2**20 + 2**17]  # fmt: skip
    assert all(n <= size_class(n) <= n * 9 / 8 for n in range(1, 5000))
    pool = BufferPool(largest=3000)
    a = pool.take(1000)
    assert a.shape == (1000,) and pool.usage() == {"held": 1, "in_use": 1, "bytes": 4096}
    b = pool.take(2000)
    pool.give(a)
    assert pool.take(1000).data_ptr() == a.data_ptr()  # the same pages, not new ones
    assert pool.usage() == {"held": 2, "in_use": 2, "bytes": 4096 + 8192}
    pool.give(b)
    assert pool.take(3000).data_ptr() != b.data_ptr()  # another class: a new buffer
    assert pool.take(1990).data_ptr() == b.data_ptr()  # its class: the free one
    assert pool.owns(b) and not pool.owns(torch.zeros(10)) and not pool.owns(b.clone())
    pool.give(b)
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give(b)
    assert pool.take_transient(10).untyped_storage().nbytes() == 4 * size_class(3000)
    with pytest.raises(ValueError, match="a buffer of 0 elements"):
        pool.take(0)
    with pytest.raises(
        ValueError, match=r"a buffer of 3001 elements \(the largest fragment: 3000\)"
    ):
        pool.take_transient(3001)


def test_buffer_pool_takes_back_what_finalisers_give_at_its_next_call(caplog):
    pool = BufferPool(largest=1000)
    a, b = pool.take(1000), pool.take(1000)
    pool.give_soon(a)  # (a finaliser's: no lock taken)
    pool.give_soon(torch.zeros(10))  # values the pool never made: let go
    assert pool.usage() == {"held": 2, "in_use": 1, "bytes": 2 * 4096}
    assert pool.take(1000).data_ptr() == a.data_ptr()
    pool.give(b)
    pool.give_soon(b)  # free already: a bug named in the log, not raised in a caller
    assert pool.usage()["in_use"] == 1 and "free already" in caplog.text


def test_buffer_pool_lets_go_of_buffers_idle_for_a_while():
    # A burst (islands' final flushes hold a row per fragment) takes many buffers; the
    # rounds after it reuse the last given back, and the rest go after idle_free_s.
    now = [0.0]
    pool = BufferPool(largest=1000, idle_free_s=60.0, clock=lambda: now[0])
    burst = [pool.take_transient(1000) for _ in range(6)]
    for b in burst:
        pool.give(b)
    assert pool.usage() == {"held": 6, "in_use": 0, "bytes": 6 * 4096}
    for _ in range(10):  # rounds every 10 s: two buffers at once, the same two each time
        now[0] += 10.0
        a, b = pool.take_transient(1000), pool.take_transient(900)
        pool.give(b)
        pool.give(a)
    assert pool.usage() == {"held": 2, "in_use": 0, "bytes": 2 * 4096}
    assert {a.data_ptr(), b.data_ptr()} <= {x.data_ptr() for x in burst}  # reused, not new


def test_a_refused_streamed_upload_from_a_new_registration_or_island_changes_nothing(
    tiny_config_path, tmp_path
):
    # A streamed upload's head from a later registration (or, in this run, an island with
    # no record) was taken as registered when its body started: refused then (NaN), it had
    # dropped the live launch's waiting contribution and superseded that launch anyway.
    coord = make(
        tiny_config_path, tmp_path / "s", Clock(), policy=PolicyOptions(min_quorum=2, tau=1)
    )
    run = coord.run_id
    coord.register("a", 1, coord.plan.signature)
    coord.register("c", 1, coord.plan.signature)
    assert send(coord, "a", 0, step=2)["complete"]  # waits in the round (quorum 2)
    frag = coord.plan.fragments[0]
    bad = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    bad[frag.params[-1].name].view(-1)[-1] = float("nan")  # in the last bytes streamed
    before = coord.status()

    def unchanged():
        st = coord.status()
        for k in ("islands", "pending", "versions"):
            assert st[k] == before[k], (k, st[k], before[k])
        assert st["buffers"]["in_use"] == before["buffers"]["in_use"]  # its row went back

    for island, over in (("a", {"incarnation": 2, "world_size": 2}), ("b", {"run": run})):
        for body in _bodies(coord, island, over.pop("world_size", 1), 4, bad, **over)[-1:]:
            ing = coord.upload_begin(_head(body), len(body))
            _write(ing, body)
            with pytest.raises(CoordinatorError) as e:
                coord.upload_finish(ing)
            assert e.value.status == 422 and wire.NOT_FINITE in str(e.value)
            unchanged()
    # The old launch goes on; a good upload of the new one is still taken as registered.
    assert send(coord, "a", 1, step=4)["status"] == "accepted"
    good = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
    for body in _bodies(coord, "a", 2, 6, good, incarnation=2):
        ing = coord.upload_begin(_head(body), len(body))
        _write(ing, body)
        reply = coord.upload_finish(ing)
    assert reply["complete"], reply
    island = coord.status()["islands"]["a"]
    assert (island["registrations"], island["world_size"]) == (2, 2), island


def test_a_contribution_whose_island_lost_its_lease_does_not_make_all_live_islands_in(
    tiny_config_path, tmp_path
):
    # "c" sent, then went silent past its lease: its contribution still counts (quorum),
    # but with it "a"'s made 2 of 2 live islands "in", and the round closed at once with
    # "b" live and not in (no grace window: b's upload came stale).
    clock = Clock()
    policy = PolicyOptions(min_quorum=2, grace_gamma=0.5, max_grace_s=10.0, tau=1)
    coord = make(tiny_config_path, tmp_path / "s", clock, policy=policy, island_timeout_s=10.0)
    for island in ("a", "b", "c"):
        coord.register(island, 1, coord.plan.signature)
    for island in ("a", "b"):  # step times: 2 s
        send(coord, island, 1, step=2)
    clock.now += 4.0
    for island in ("a", "b", "c"):
        send(coord, island, 1, step=4)
    assert coord.poll(1).merge
    send(coord, "c", 0, step=4)
    clock.now += 10.5
    for island in ("a", "b"):
        coord.touch(island)
    send(coord, "a", 0, step=4)
    assert coord.status()["islands"]["c"]["live"] is False
    d = coord.poll(0)
    assert not d.merge and "1/2 live islands in" in d.reason and "stragglers" in d.reason, d
    clock.now = d.wait_until
    d = coord.poll(0)
    assert d.merge and "grace over" in d.reason, d
    assert coord.status()["last_merge"]["0"]["islands"] == ["a", "c"]
