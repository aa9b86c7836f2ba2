"""A small ``ds-diloco bench quality`` in CI: real ZeRO-3 launches of the baseline and of
Decoupled DiLoCo (2 islands, int4 pseudo-gradients), on real text.

Asserted: both methods train the same tokens; Decoupled DiLoCo's held-out loss ends
below the starting loss and within ``TOLERANCE`` of the synchronous ZeRO-3 baseline's
(a few dozen steps on a tiny model: the full benchmark states the 1.02 goal); its
merges happened, the coordinator's merged / dropped counts are reported, and its
uploads are a small share of the all-reduce's bytes. Without launches: the report's
mean over seeds and verdict, and the stale-merge prototype's rounds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ds_diloco import cli, wire
from ds_diloco.bench.quality import (
    BYTES_GOAL,
    FIXED,
    LABELS,
    MAIN,
    Evaluator,
    Method,
    QualityBench,
    Result,
    Setup,
    _runs,
    codec_variants,
    run_bench,
    run_config,
    setup_from_args,
    stale_modes,
)
from ds_diloco.bench.quality_report import format_report, plot
from ds_diloco.bench.stale_merge import StaleMergeCoordinator
from ds_diloco.client import rank_slices
from ds_diloco.compress import CODECS
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.merge import StalenessPolicy
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1.05
"""Decoupled DiLoCo's held-out loss at most this many times the baseline's, at equal tokens.
At the benchmark's tuned outer lr / momentum (0.7 / 0.4), 1.006-1.018 in three runs; the
0.2 this test used to set gave 1.077-1.104 in 14 runs (mean 1.09: 1.10 failed CI)."""


def small_setup(tmp_path, tiny_config_path) -> Setup:
    return Setup(
        model_config=tiny_config_path,
        corpus=str(REPO / "tests" / "data"),
        cache_dir=str(tmp_path / "cache"),
        seq_len=32,
        vocab_size=512,
        heldout_fraction=0.25,  # the sonnets are 11 kB: 37 held-out blocks of 33 tokens
        islands=2,
        steps=30,
        micro_batch=4,
        lr=3e-3,
        warmup_steps=3,
        num_fragments=2,
        sync_every=4,
        # The paper's tau. At the outer lr 0.2 this test then set: at tau = 1 the grace
        # window (0.9 x one 70-100 ms step, less the sync) was shorter than one island's
        # lag behind the other: 13-15 of its 15 uploads were dropped as stale in 5 of 5
        # idle runs, loss ratio 1.082-1.097 (1.109 once under load); at tau = 2 both
        # islands merge: 1.071-1.087 in 3 runs, 1.082 and 1.086 beside a CPU hog.
        tau=2,
        eval_blocks=16,
        points=3,
        seeds=1,
        workdir=str(tmp_path / "bench"),
    )


@pytest.mark.timeout(300)
def test_decoupled_diloco_learns_and_stays_near_the_zero3_baseline(tmp_path, tiny_config_path):
    s = small_setup(tmp_path, tiny_config_path)
    b = run_bench(s, codecs=(), hetero=False, sync=False, stale=())
    assert set(b.results) == {"zero3", "decoupled"}
    assert [len(runs) for runs in b.results.values()] == [1, 1]
    base, dec = b.results["zero3"][0], b.results["decoupled"][0]
    assert base.tokens == dec.tokens == s.tokens  # equal tokens: 30 steps x 2 ranks x 4 x 32
    assert dec.method.codec == "int4" and dec.merges > 0 and dec.bytes_up > 0
    assert math.isfinite(dec.loss) and dec.loss < b.initial_loss - 0.1, (dec.loss, b.initial_loss)
    assert base.loss < b.initial_loss
    assert b.loss_ratio(dec) <= TOLERANCE, (dec.loss, base.loss)
    # int4 uploads of 1 fragment in H/P = 2 steps vs a fp32 all-reduce every step.
    assert 0 < b.bytes_ratio(dec) < 1 / 10, b.bytes_ratio(dec)
    # What the coordinator merged and dropped, per island. An island's schedule sends at
    # the steps whose clock (step + its send phase) is a multiple of H/P = 2: 15 in 30 steps
    # at phase 0; a phase shift (an island that came late sends earlier) moves the clock
    # on, so that the clocks run to 30 + the steps shifted, and passes over the send positions
    # it jumps (shifted_over). Each scheduled send went out or was skipped (its last result
    # came so late that it was applied only at that step, or its base still held the last
    # upload, or a download was writing it). On leaving, the flush sends every fragment with
    # steps since its last apply (at most P = 2). Their steps are those since the island
    # last applied the fragment (summed over the P = 2 fragments: at most 2 x 30). The
    # islands waited for their last contributions: every one sent ended merged or dropped.
    assert sorted(dec.islands) == ["island-0", "island-1"], dec.islands
    for c in dec.islands.values():
        assert c["merged"] + c["dropped"] == c["sent"] > 0, c
        scheduled = c["sent"] - c["flushed"] + c["skipped"] + c["shifted_over"]
        assert scheduled == (s.steps + c["shifted_steps"]) // 2 and 0 <= c["flushed"] <= 2, c
        assert 0 < c["steps_merged"] + c["steps_dropped"] <= 2 * s.steps, c
    assert 0 < dec.merges <= dec.merged == sum(dec.by_staleness.values())
    assert set(dec.by_staleness) == {"0"}  # the paper's rule: only fresh ones are merged
    assert sum(int(k) * v for k, v in dec.by_quorum.items()) == dec.merged
    assert 0 <= dec.steps_dropped_share < 1
    for r in (base, dec):
        tokens = [t for t, _ in r.curve]
        assert r.curve[0] == (0, b.initial_loss) and tokens == sorted(tokens)
        assert tokens[-1] == r.tokens and len(r.curve) >= 3, r.curve
    report = format_report(b)
    assert "goals (Decoupled DiLoCo)" in report and "ZeRO-3 data parallel" in report
    assert f"{dec.sent:5d} {dec.merged:6d} {dec.dropped:7d}" in report  # contributions table
    png = plot(b, tmp_path / "q.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    json.dumps(b.to_json())  # serialisable as it is


def _fake(key: str, kind: str, seed: int, loss: float, merged=0, dropped=0) -> Result:
    islands = {
        "island-0": {
            "merged": merged,
            "dropped": dropped,
            "steps_merged": 12 * merged,
            "steps_dropped": 12 * dropped,
            "sent": merged + dropped + 1,
        }
    }
    islands = islands if kind != "zero3" else {}
    return Result(
        method=Method(key, kind, "int4" if kind != "zero3" else "none", seed=seed),
        loss=loss, tune_loss=None, curve=[(0, 8.0), (100, loss)], tokens=100,
        bytes_up=0 if kind == "zero3" else 10, bytes_down=0, wall_s=1.0, train_s=1.0,
        step_s=[0.1], merges=merged, initial=8.0, islands=islands,
        by_staleness={"0": merged} if merged else {}, by_quorum={"1": merged} if merged else {},
    )  # fmt: skip


def test_report_takes_the_mean_ratio_over_seeds_paired_with_the_same_seeds_baseline():
    s = Setup(seeds=3)
    runs = {
        "zero3": [_fake("zero3", "zero3", i, x) for i, x in enumerate((6.0, 6.2, 5.8))],
        "sync": [_fake("sync", "sync", i, x, 8) for i, x in enumerate((6.06, 6.2, 5.8))],
        # seed ratios 1.01, 1.03, 1.02 (each against its own seed's baseline)
        "decoupled": [
            _fake("decoupled", "decoupled", i, x, 5, 3) for i, x in enumerate((6.06, 6.386, 5.916))
        ],
    }
    b = QualityBench(s, runs, evaluator_params=1000, initial_loss=8.0, grad_bytes=4)
    sm = b.summary("decoupled")
    assert sm["ratios"] == pytest.approx([1.01, 1.03, 1.02])
    assert sm["ratio_mean"] == pytest.approx(1.02) and sm["ratio_sd"] == pytest.approx(0.01)
    assert sm["merged"] == [5, 5, 5] and sm["steps_dropped_share"] == [3 / 8] * 3
    assert sm["sent"] == [9, 9, 9]
    report = format_report(b)
    assert "loss ratio 1.020 (mean of 3 seed(s): 1.010, 1.030, 1.020" in report
    assert "<= 1.02 met" in report
    runs["decoupled"][2] = _fake("decoupled", "decoupled", 2, 5.95, 5, 3)  # 1.0259
    assert "<= 1.02 MISSED" in format_report(b)
    runs[FIXED] = [_fake(FIXED, "decoupled", i, x) for i, x in enumerate((6.0, 6.65, 5.95))]
    assert "with a fixed send phase, paired by seed: 1.010, 0.960, 1.000" in format_report(b)
    json.dumps(b.to_json())


def test_goals_just_past_their_limits_print_with_the_digits_that_show_it():
    # A mean ratio of 1.0204 printed as "1.020 ... <= 1.02 MISSED"; bytes per token 1/99.6 of
    # the all-reduce as "1/100 ... <= 1/100 MISSED": the printed figures said met.
    runs = {
        "zero3": [_fake("zero3", "zero3", 0, 6.0)],
        "decoupled": [_fake("decoupled", "decoupled", 0, 6.0 * 1.0204, 5, 3)],
    }
    b = QualityBench(Setup(seeds=1), runs, evaluator_params=1000, initial_loss=8.0, grad_bytes=4)
    report = format_report(b)
    assert "loss ratio 1.0204 (mean of 1 seed(s)" in report and "<= 1.02 MISSED" in report
    b.grad_bytes *= 99.6 * 0.1 / b.allreduce_bytes_per_token()  # sent: 0.1 B per token
    assert b.bytes_ratio(runs["decoupled"][0]) > BYTES_GOAL
    assert "sent per token 1/99.6 of the all-reduce <= 1/100.0 MISSED" in format_report(b)


def _upload(coord, island, fragment, base, step, tokens=100, steps=4):
    frag = coord.plan.fragments[fragment]
    g = torch.Generator().manual_seed(step * 10 + len(island))
    full = {p.name: torch.randn(p.shape, generator=g) * 1e-3 for p in frag.params}
    h = wire.UploadHeader(island=island, rank=0, world_size=1, fragment=fragment,
                          base_version=base, step=step, tokens=tokens, steps=steps)  # fmt: skip
    reply = coord.upload(wire.encode_upload(h, rank_slices(frag, full, 1, 0)))
    reply["delta"] = full
    return reply


def _stale_cfg(tiny_config_path, tmp_path, lr=0.5, momentum=0.9):
    return CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0),
        state_dir=str(tmp_path / "state"),
        num_fragments=2,
        sync_every=4,
        token="t",
        outer=OuterOptimConfig(lr=lr, momentum=momentum),
        policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        staleness=StalenessPolicy(mode="discount", discount_lambda=1.0),
    )


def test_stale_merge_prototype_rides_a_one_version_stale_contribution_along(
    tiny_config_path, tmp_path
):
    cfg = _stale_cfg(tiny_config_path, tmp_path)
    with pytest.raises(ValueError, match="discount"):
        StaleMergeCoordinator(dataclasses.replace(cfg, staleness=StalenessPolicy(mode="drop")))
    coord = StaleMergeCoordinator(cfg, max_staleness=1)
    for island in ("a", "b", "c"):
        coord.register(island, 1, coord.plan.signature)
    assert _upload(coord, "a", 0, base=0, step=4)["status"] == "accepted"
    assert coord.poll(0).merge and coord.versions()[0] == 1  # K = 1: a alone
    # b and c computed theirs against version 0: kept (weight halved), but they open no round.
    for island in ("b", "c"):
        reply = _upload(coord, island, 0, base=0, step=4)
        assert reply["status"] == "accepted" and reply["complete"], reply
    d = coord.poll(0)
    assert not d.merge and "no contribution yet" in d.reason and coord.versions()[0] == 1
    # a's next (fresh) contribution opens the round; b and c ride along with it.
    _upload(coord, "a", 0, base=1, step=8)
    assert coord.poll(0).merge and coord.versions()[0] == 2
    last = coord.status()["last_merge"]["0"]
    assert last["islands"] == ["a", "b", "c"]
    assert last["weights"]["b"] == pytest.approx(last["weights"]["a"] / 2)  # 1 / (1 + 1 x 1)
    # Two versions stale: dropped, as in the paper.
    assert _upload(coord, "b", 0, base=0, step=12)["status"] == "dropped"
    st = coord.status()
    assert {k: (v["merged"], v["dropped"]) for k, v in st["islands"].items()} == {
        "a": (2, 0),
        "b": (1, 1),
        "c": (1, 0),
    }
    assert st["run"]["by_staleness"] == {0: 2, 1: 2}


def test_setup_refuses_what_cannot_be_compared(tmp_path):
    with pytest.raises(ValueError, match="multiple of ranks x micro_batch"):
        Setup(eval_blocks=60, micro_batch=4, islands=4)
    with pytest.raises(ValueError, match="compression"):
        Setup(compression="int3")
    with pytest.raises(ValueError, match="points"):
        Setup(steps=5, points=5)
    with pytest.raises(ValueError, match="seeds"):
        Setup(seeds=0)


def test_a_corpus_too_small_for_the_held_out_blocks_names_the_corpus_and_how_to_fetch_one(
    tmp_path,
):
    # A fresh clone without .cache/corpus falls back to the sonnets in tests/data.
    small = str(Path(__file__).parent / "data")
    with pytest.raises(ValueError, match=r"eval_blocks 64 needs 128 .*tests/data.*get_corpus\.sh"):
        Evaluator(Setup(corpus=small, cache_dir=str(tmp_path / "cache")))


def test_cli_parses_bench_quality_flags():
    args = cli.build_parser().parse_args(
        ["bench", "quality", "--steps", "17", "--outer-lr", "0.5", "--no-hetero", "--tune",
         "--seeds", "2", "--momentum", "0.8", "--tune-momenta", "0.8,0.9"]
    )  # fmt: skip
    got = (args.what, args.steps, args.outer_lr, args.no_hetero, args.tune, args.preset)
    assert got == ("quality", 17, 0.5, True, True, "tiny") and args.fixed_phase is False
    assert cli.build_parser().parse_args(["bench", "quality", "--fixed-phase"]).fixed_phase
    ab = cli.build_parser().parse_args(["bench", "quality", "--no-sync", "--fixed-phase"])
    assert [k for k in (*MAIN, FIXED) if _runs(k, ab)] == ["zero3", "decoupled", FIXED]
    assert [k for k in (*MAIN, FIXED) if _runs(k, args)] == list(MAIN)  # the header's list
    s = setup_from_args(args)
    assert codec_variants(None) == ("none",) and codec_variants("all") == CODECS
    assert codec_variants("int8", none=True) == () and stale_modes("none") == ()
    assert stale_modes(None) == ("next",) and stale_modes("next,async") == ("next", "async")
    with pytest.raises(ValueError, match="unknown"):
        stale_modes("later")
    assert (s.seeds, s.momentum, s.sync_momentum, s.outer_lr, s.sync_outer_lr) == (
        2,
        0.8,
        0.8,
        0.5,
        0.5,
    )


def test_each_method_gets_its_settings_and_absolute_paths():
    s = Setup()
    cfgs = {k: run_config(s, s.method(k, k, seed=3), Path("relative/dir")) for k in LABELS}
    for cfg in cfgs.values():  # island configs resolve relative paths against themselves
        assert Path(cfg.workdir).is_absolute() and Path(cfg.coordinator.state_dir).is_absolute()
        assert cfg.train.steps == s.steps and cfg.train.lr == s.lr
        assert cfg.train.seed == cfg.model.seed == cfg.coordinator.model.seed == 3
        assert cfg.data.seed == 0  # the held-out split never depends on the seed
    base = cfgs["zero3"]
    assert [i.world_size for i in base.islands] == [s.ranks]
    assert s.ranks * s.micro_batch * base.train.eval_batches == s.eval_blocks
    sync, dec = cfgs["sync"].coordinator, cfgs["decoupled"].coordinator
    assert (sync.policy.min_quorum, sync.policy.grace_gamma) == (s.islands, 0.0)
    assert (dec.policy.min_quorum, dec.policy.grace_gamma) == (1, s.grace_gamma)
    assert (
        dec.compression.name == "int4"
        and [i.world_size for i in cfgs["sync"].islands] == [s.ranks_per_island] * s.islands
    )
    assert sync.staleness.mode == dec.staleness.mode == "drop"
    assert (sync.outer.lr, sync.outer.momentum) == (s.sync_outer_lr, s.sync_momentum)
    assert (dec.outer.lr, dec.outer.momentum) == (s.outer_lr, s.momentum)
    stale = run_config(s, s.method("x", "decoupled", stale="next"), Path("d")).coordinator.staleness
    assert (stale.mode, stale.discount_lambda) == ("discount", s.stale_lambda)
    assert dec.align_phase is True  # the coordinator's default
    fixed = s.method(FIXED, "decoupled", align_phase=False)
    assert run_config(s, fixed, Path("d")).coordinator.align_phase is False
    assert "fixed send phase" in fixed.label and "phase" not in s.method("d", "decoupled").label


def test_stale_merge_prototype_applies_stale_contributions_by_plain_sgd(tiny_config_path, tmp_path):
    lr, beta = 0.5, 0.9
    coord = StaleMergeCoordinator(
        _stale_cfg(tiny_config_path, tmp_path, lr, beta), max_staleness=1, stale_sgd=True
    )
    for island in ("a", "b"):
        coord.register(island, 1, coord.plan.signature)
    names = [p.name for p in coord.plan.fragments[0].params]
    theta0 = {n: t.clone() for n, t in coord.global_tensors().items() if n in names}
    ga1 = _upload(coord, "a", 0, base=0, step=4)["delta"]
    assert coord.poll(0).merge
    gb = _upload(coord, "b", 0, base=0, step=4)["delta"]  # one version stale
    assert not coord.poll(0).merge
    ga2 = _upload(coord, "a", 0, base=1, step=8)["delta"]
    assert coord.poll(0).merge and coord.versions()[0] == 2
    # Nesterov on a's two (buf = g1, then beta g1 + g2), then b's by SGD: -lr gb.
    got = coord.global_tensors()
    for n in names:
        t1 = theta0[n] - lr * (1 + beta) * ga1[n]
        want = t1 - lr * (ga2[n] + beta * (beta * ga1[n] + ga2[n])) - lr * gb[n]
        assert torch.allclose(got[n], want.view(got[n].shape), atol=1e-6), n
    st = coord.status()
    assert st["islands"]["b"]["merged"] == 1 and st["run"]["by_staleness"] == {0: 2, 1: 1}
    assert st["run"]["by_quorum"] == {1: 1, 2: 1}


class _Tuned(Exception):
    """Raised by the stand-in for ``tune``: the flags passed every check."""


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fails a test that gets as far as evaluating or training anything."""

    def ran(*args, **kw):
        raise AssertionError("ran before the flags were checked")

    for name in ("Evaluator", "run_method", "run_bench"):
        monkeypatch.setattr(f"ds_diloco.bench.quality.{name}", ran)

    def tune(s, grid, **kw):
        raise _Tuned(s, grid, kw)

    monkeypatch.setattr("ds_diloco.bench.quality.tune", tune)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--outer-lr", "-1"], "--outer-lr must be a finite number > 0"),
        (["--outer-lr", "nan"], "--outer-lr must be a finite number > 0"),
        (["--sync-outer-lr", "0"], "--sync-outer-lr must be a finite number > 0"),
        (["--momentum", "1"], "--momentum must be in [0, 1)"),
        (["--sync-momentum", "-0.1"], "--sync-momentum must be in [0, 1)"),
        (["--grace-gamma", "1"], "--grace-gamma must be in [0, 1)"),
        (["--tau", "12"], "--tau (12) must be < --sync-every (12)"),
        (["--sync-every", "10"], "--sync-every (10) must be a multiple of --num-fragments"),
        (["--wait-expected", "20"], "--wait-expected must be in [0,"),
        (["--tune", "--outer-lr", "-1"], "--outer-lr must be a finite number > 0"),
        (["--tune", "--tune-lrs", "abc"], "--tune-lrs: 'abc' is not a number"),
        (["--tune", "--tune-lrs", "0.1,-1"], "--tune-lrs: outer lrs must be finite numbers > 0"),
        (["--tune", "--tune-momenta", "1.5"], "--tune-momenta: momenta must be in [0, 1)"),
        (["--tune", "--tune-kinds", "foo"], "--tune-kinds: one or more of"),
        (["--tune", "--tune-kinds", ","], "--tune-kinds: one or more of"),
        (["--tune", "--tune-seeds", "0"], "--tune-seeds must be >= 1, got 0"),
        (["--tune", "--tune-stale", "later"], "--tune-stale must be one of"),
        (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: the folder"),
        (["--tune", "--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json"),
        (["--plot", "/nonexistent-dir/x.png"], "--plot /nonexistent-dir/x.png: the folder"),
    ],
)
def test_bad_flags_are_refused_by_name_before_anything_runs(argv, says, nothing_runs, capsys):
    assert cli.main(["bench", "quality", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1, err


def test_good_tune_flags_reach_the_tuning_runs(nothing_runs, tmp_path):
    argv = ["bench", "quality", "--tune", "--tune-lrs", "0.2,0.4", "--tune-momenta", "0.5",
            "--tune-kinds", "decoupled", "--tune-seeds", "2", "--workdir", str(tmp_path)]  # fmt: skip
    with pytest.raises(_Tuned) as e:
        cli.main(argv)
    _s, grid, kw = e.value.args
    assert grid == [(0.2, 0.5), (0.4, 0.5)]
    assert (kw["kinds"], kw["seeds"], kw["stale"]) == (("decoupled",), 2, "drop")


def test_setup_names_the_outer_settings_by_flag():
    with pytest.raises(ValueError, match="--outer-lr must be a finite number > 0"):
        Setup(outer_lr=-1.0)
    with pytest.raises(ValueError, match=r"--momentum must be in \[0, 1\)"):
        Setup(momentum=1.0)


@pytest.mark.timeout(120)
def test_stale_next_variant_serves_the_stale_merge_prototype(tmp_path, tiny_config_path):
    # bench quality starts a run's coordinator with spawn_coordinator: StaleMergeRun overrode
    # start_coordinator alone, so its variants ran the stock coordinator's discount mode (a
    # stale arrival merged in a round of its own) under the label "stale merged next round".
    import time

    from ds_diloco.bench.stale_merge import StaleMergeRun
    from ds_diloco.fragments import FragmentPlan

    s = small_setup(tmp_path, tiny_config_path)
    cfg = run_config(s, s.method("stale-next", "decoupled", stale="next"), tmp_path / "sn")
    lr = StaleMergeRun(cfg, max_staleness=1)
    lr.spawn_coordinator()
    try:
        client = lr.wait_for_coordinator()
        assert "ds_diloco.bench.stale_merge" in lr.coordinator.args, lr.coordinator.args
        plan = FragmentPlan.from_json(client.plan()["plan"])
        frag = plan.fragments[0]
        for island in ("a", "b"):
            client.register(island, 1, plan.signature)
        delta = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}

        def upload(island: str, base: int) -> dict:
            h = wire.UploadHeader(island=island, rank=0, world_size=1, fragment=0,
                                  base_version=base, step=4, tokens=100, steps=4)  # fmt: skip
            return client.upload(h, rank_slices(frag, delta, 1, 0))

        def version_after(seconds: float, until: int) -> int:
            deadline = time.monotonic() + seconds
            while client.versions()[0] < until and time.monotonic() < deadline:
                time.sleep(0.05)
            return client.versions()[0]

        assert upload("a", 0)["status"] == "accepted" and version_after(10, 1) == 1
        # b's, one version stale: kept for the next fresh round, it opens none of its own.
        assert upload("b", 0)["status"] == "accepted"
        assert version_after(2, 2) == 1
        client.close()
    finally:
        lr.stop()


@pytest.mark.timeout(200)
def test_the_baseline_trains_from_the_seeds_initial_model(tmp_path, tiny_config_path):
    # The ZeRO-3 engine built from the model config draws its weights under zero.Init: other
    # values than the seed's initial model, which the DiLoCo runs start from and the report
    # gives as every method's start (seed 1: held-out 6.2480 against 6.2342 here).
    from ds_diloco.bench.quality import run_method

    s = dataclasses.replace(small_setup(tmp_path, tiny_config_path), steps=6)
    ev = Evaluator(s)
    r = run_method(s, s.method("zero3", "zero3", seed=1), ev, tmp_path / "zero3")
    summary = json.loads((tmp_path / "zero3/islands/zero3/summary-rank0.json").read_text())
    assert summary["heldout_loss_start"] == pytest.approx(ev.initial(1), abs=1e-4)
    assert r.curve[0] == (0, ev.initial(1)) and r.tokens == s.tokens
    assert not (tmp_path / "zero3" / "initial-model").exists()  # a model's size, removed


@pytest.mark.parametrize("visible, want", [(None, ["0,1", "2,3"]), ("4,5,6,7", ["4,5", "6,7"])])
def test_the_islands_on_gpus_are_the_devices_the_job_was_given(monkeypatch, visible, want):
    # An include names the devices' own ids (the launcher sets the ranks'
    # CUDA_VISIBLE_DEVICES to them): a job given GPUs 4-7 ran every island on GPUs 0-3.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    s = dataclasses.replace(Setup(), gpus=4, islands=2, ranks_per_island=2)
    cfg = run_config(s, s.method("d", "decoupled"), Path("d"))
    assert [i.include for i in cfg.islands] == [f"localhost:{w}" for w in want]
    base = run_config(s, s.method("zero3", "zero3"), Path("d"))
    assert [i.include for i in base.islands] == [f"localhost:{want[0]},{want[1]}"]
