from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time

import numpy as np
import pytest

from ds_diloco import round_policy
from ds_diloco.cli import main as cli_main
from ds_diloco.fragments import Schedule
from ds_diloco.simulate import PAPER_CHIPS, PUBLISHED, SimConfig, failure_trace, simulate
from ds_diloco.simulate.baselines import simulate_dp, simulate_elastic
from ds_diloco.simulate.plan import recommend
from ds_diloco.simulate.report import parse_count
from ds_diloco.simulate.result import CHIP_TIME, SystemResult
from ds_diloco.simulate.run import sweep, sweep_configs
from ds_diloco.simulate.trace import slowest_chip

# Small and short: every test below runs in well under a second.
SMALL = {"chips": 150_000, "islands": 4, "days": 0.1}


def _goodput(result) -> dict[str, float]:
    return {r.system: r.goodput for r in result.rows}


def test_no_failures_no_jitter_is_full_goodput_for_every_system():
    cfg = SimConfig(**SMALL, chip_mtbi_s=math.inf, step_cv=0.0)
    result = simulate(cfg)
    assert [r.system for r in result.rows] == ["dp", "elastic", "diloco"]
    # Only the step cut off by the end of the run is missing.
    tol = 1.5 * cfg.step_s / cfg.duration_s
    for r in result.rows:
        assert r.failures == 0
        assert r.goodput == pytest.approx(1.0, abs=tol), r.system
        assert r.uptime == pytest.approx(1.0, abs=tol), r.system


def test_no_failures_with_jitter_costs_every_system_the_slowest_chip():
    # Waiting for the slowest chip is not goodput; DiLoCo's smaller groups wait a bit less.
    result = simulate(SimConfig(**SMALL, chip_mtbi_s=math.inf, step_cv=0.01))
    g = _goodput(result)
    assert 0.9 < g["dp"] < 0.97
    assert g["dp"] == pytest.approx(g["elastic"], abs=1e-3)
    assert g["dp"] < g["diloco"] < g["dp"] + 0.01


def test_one_island_without_quorum_wait_behaves_like_elastic_data_parallel():
    cfg = SimConfig(chips=600_000, islands=1, days=0.5, grace_gamma=0.0)
    result = simulate(cfg)
    elastic, diloco = result.get("elastic"), result.get("diloco")
    assert elastic.goodput < 0.8  # failures do matter at this size
    assert diloco.goodput == pytest.approx(elastic.goodput, abs=0.002)
    assert diloco.uptime == pytest.approx(elastic.uptime, abs=0.002)
    # Same failures, same pauses (a step's jitter can move a failure into or out of a pause).
    assert abs(diloco.stats["downscales"] - elastic.stats["downscales"]) <= 3
    assert diloco.stats["stale"] == 0
    # Its chip-time goes where elastic data-parallel's goes; alone, nothing is merged
    # without it, so it never idles to rejoin the fleet or has its work overwritten.
    for k in ("away", "paused", "straggler", "lost"):
        assert diloco.chip_time[k] == pytest.approx(elastic.chip_time[k], abs=0.003), k
    assert diloco.chip_time["idle"] == diloco.chip_time["overwritten"] == 0.0


def test_chip_time_categories_are_each_measured_and_add_up_to_the_whole():
    # Failures, jitter and costly checkpoints: every category is in use somewhere.
    cfg = SimConfig(chips=600_000, islands=8, days=0.2, step_cv=0.01, checkpoint_s=2.0)
    result = simulate(cfg)
    for r in result.rows:
        assert set(r.chip_time) == set(CHIP_TIME), r.system
        assert sum(r.chip_time.values()) == pytest.approx(1.0, abs=1e-9), r.system
        assert r.chip_time["useful"] == pytest.approx(r.goodput, abs=1e-12)
        assert min(r.chip_time.values()) > -1e-9, (r.system, r.chip_time)
    dp, elastic, diloco = (result.get(s).chip_time for s in ("dp", "elastic", "diloco"))
    assert dp["checkpoint"] > 0.01 and elastic["checkpoint"] == diloco["checkpoint"] == 0
    assert diloco["overwritten"] > 0.005 and diloco["idle"] > 0.001
    assert dp["paused"] > elastic["paused"] > diloco["paused"] > 0.01
    # The slices away are the trace's: a slice fails at rate S / MTBI and is away repair_s,
    # so r R / (1 + r R) of them are away (data-parallel keeps repaired ones out longer:
    # until its next restart).
    r_repair = cfg.chips_per_slice / cfg.chip_mtbi_s * cfg.repair_s
    expected = r_repair / (1 + r_repair)
    assert elastic["away"] == pytest.approx(expected, abs=0.01)
    assert diloco["away"] == pytest.approx(elastic["away"], abs=0.002)
    assert dp["away"] >= elastic["away"] - 0.002


def test_goodput_is_a_share_with_islands_of_one_chip():
    # One chip has no slowest chip to wait for: its steps come under the mean as often as
    # over it. Counted at the mean, a run of short ones read 100.7 % goodput (seed 1).
    cfg = SimConfig(chips=2, chips_per_slice=1, islands=2, days=0.01, step_cv=0.3,
                    systems=("diloco",))  # fmt: skip
    for seed in range(8):
        for islands in (1, 2):
            r = simulate(cfg.replace(seed=seed, islands=islands, chips=islands)).rows[0]
            assert 0 <= r.goodput <= 1 and 0 <= r.uptime <= 1, (seed, islands, r.goodput)
            assert min(r.chip_time.values()) >= 0, (seed, islands, r.chip_time)
            assert sum(r.chip_time.values()) == pytest.approx(1.0, abs=1e-9)
    # Nor is it under 1 for long: a lone chip waits for no one (counted at its own time when
    # shorter than the mean, a day at this jitter read 88.4 %).
    day = simulate(cfg.replace(chips=1, islands=1, days=1, chip_mtbi_s=math.inf)).rows[0]
    assert day.goodput > 0.99 and day.chip_time["straggler"] < 0.01, day.chip_time


def test_without_failures_the_chip_time_is_useful_or_waits_for_the_slowest_chip():
    cfg = SimConfig(**SMALL, chip_mtbi_s=math.inf, step_cv=0.01)
    cut_off = 1.5 * cfg.step_s / cfg.duration_s  # the step in flight at the end
    for r in simulate(cfg).rows:
        ct = r.chip_time
        assert ct["lost"] < cut_off, r.system
        assert ct["useful"] + ct["straggler"] == pytest.approx(1.0, abs=cut_off), r.system
        groups = r.islands if r.system == "diloco" else 1
        wait = cfg.step_cv * slowest_chip(cfg.used_chips // groups)[0]  # mean, per step
        assert ct["straggler"] / ct["useful"] == pytest.approx(wait, rel=0.05), r.system
        assert ct["away"] == ct["paused"] == ct["overwritten"] == ct["stale"] == 0.0


def test_goodput_falls_monotonically_with_the_failure_rate():
    year = 365.25 * 86400
    rows = [
        _goodput(simulate(SimConfig(**SMALL, chip_mtbi_s=mtbi)))
        for mtbi in (math.inf, 4 * year, year, year / 4, year / 16)
    ]
    for system in ("dp", "elastic", "diloco"):
        series = [r[system] for r in rows]
        assert all(a > b for a, b in itertools.pairwise(series)), (system, series)


def test_fixed_seed_reproduces_the_trace_and_the_results():
    cfg = SimConfig(**SMALL)
    a, b = failure_trace(cfg), failure_trace(cfg)
    assert len(a) > 0
    np.testing.assert_array_equal(a.times, b.times)
    np.testing.assert_array_equal(a.slices, b.slices)
    assert a.away == b.away and len(a.away) > 0
    other = failure_trace(cfg.replace(seed=1))
    assert len(other) != len(a) or not np.array_equal(other.times, a.times)
    assert simulate(cfg).to_dict()["rows"] == simulate(cfg).to_dict()["rows"]


def test_an_island_step_costs_about_the_same_with_thousands_of_islands():
    # The work caps count island steps: one must not cost more with more islands. Asking
    # whether an island was in a round by scanning the round's islands made a step at
    # M = 4096 cost 13.7x one at M = 32 (CPU time, same number of island steps).
    def cpu_per_step(m: int, steps: int = 50_000) -> float:
        cfg = SimConfig(chips=8 * m, chips_per_slice=8, islands=m, chip_mtbi_s=math.inf,
                        days=steps * 5.0 / m / 86400, systems=("diloco",))  # fmt: skip
        t0 = time.process_time()
        simulate(cfg)
        return (time.process_time() - t0) / steps

    ratio = cpu_per_step(4096) / cpu_per_step(32)
    assert ratio < 6, ratio  # 2.9 measured


def test_diloco_step_times_do_not_depend_on_the_draw_block(monkeypatch):
    # Step times are drawn in blocks, taken one at a time in event order by the hot loop
    # (inline) and by rejoins (_draw): blocks of 7 cross a block at every few steps, and
    # a draw skipped or taken twice there would change the run.
    from ds_diloco.simulate import diloco

    cfg = SimConfig(
        chips=20_000, chips_per_slice=64, islands=4, days=0.05, chip_mtbi_s=3e5,
        systems=("diloco",),
    )  # fmt: skip
    trace = failure_trace(cfg)
    ref = diloco.simulate_diloco(cfg, trace)
    assert ref.stats["rejoins"] > 10
    monkeypatch.setattr(diloco, "DRAW_BLOCK", 7)
    assert diloco.simulate_diloco(cfg, trace) == ref


def test_failure_trace_is_cluster_wide_poisson():
    cfg = SimConfig(chips=1_200_000, days=1.0)
    trace = failure_trace(cfg)
    expected = cfg.used_chips / cfg.chip_mtbi_s * cfg.duration_s  # about 3,300
    assert abs(len(trace) - expected) < 4 * math.sqrt(expected)
    assert np.all(np.diff(trace.times) >= 0)
    assert trace.slices.min() >= 0 and trace.slices.max() < cfg.slices


def test_rounds_are_closed_by_the_coordinators_policy(monkeypatch):
    calls = []
    real = round_policy.decide

    def spy(now, state, opts):
        calls.append((state, opts))
        return real(now, state, opts)

    monkeypatch.setattr(round_policy, "decide", spy)
    cfg = SimConfig(**SMALL)
    result = simulate(cfg.replace(systems=("diloco",)))
    assert len(calls) >= result.rows[0].stats["merges"] > 0
    assert all(opts == cfg.policy for _, opts in calls)
    assert {s.live_islands for s, _ in calls} <= set(range(cfg.islands + 1))

    # A policy that merges on the first arrival leaves the other islands' uploads stale, or
    # (phase alignment) their fragments taken from the merged version instead of sent.
    monkeypatch.setattr(
        round_policy, "decide", lambda now, state, opts: round_policy.Decision(True, None, "now")
    )
    eager = simulate(cfg.replace(systems=("diloco",))).rows[0]
    assert eager.stats["islands_per_merge"] < 1.5
    assert eager.goodput < result.rows[0].goodput - 0.3

    def dropped(r: SystemResult) -> float:
        return r.chip_time["stale"] + r.chip_time["overwritten"]

    assert dropped(eager) > dropped(result.rows[0]) + 0.3
    assert eager.chip_time["stale"] > result.rows[0].chip_time["stale"] + 0.1


def test_grace_window_picks_up_islands_that_arrive_after_the_first():
    # With chip jitter the islands' uploads land milliseconds apart: K=1 without grace
    # merges the first alone and the rest are stale; the grace window keeps them.
    cfg = SimConfig(**SMALL, systems=("diloco",), step_cv=0.01)
    with_grace = simulate(cfg).rows[0]
    without = simulate(cfg.replace(grace_gamma=0.0)).rows[0]
    assert with_grace.stats["islands_per_merge"] > cfg.islands - 1
    assert without.stats["islands_per_merge"] < 1.5
    assert with_grace.goodput > without.goodput + 0.3


def test_a_dead_island_does_not_hold_up_the_rounds_it_has_not_sent_to():
    # Two one-slice islands, K = 2: island 1's slice fails for good at 1000 s. Once it is
    # not live the policy caps K to 1, so the rounds island 0 sent to while island 1 was
    # re-forming must close too; left open, island 0 never takes their merged values and
    # its uploads of every other fragment come stale from then on.
    from ds_diloco.simulate.diloco import simulate_diloco
    from ds_diloco.simulate.trace import Trace

    cfg = SimConfig(chips=512, chips_per_slice=256, islands=2, days=0.1, step_cv=0.0,
                    repair_s=1e6, systems=("diloco",))  # fmt: skip
    trace = Trace(times=np.array([1000.0]), slices=np.array([1]))
    k1 = simulate_diloco(cfg, trace)
    k2 = simulate_diloco(cfg.replace(min_quorum=2), trace)
    assert k2.stats["stale"] == k1.stats["stale"] == 0
    assert k2.goodput == pytest.approx(k1.goodput, abs=1e-3)


def test_send_schedule_matches_the_islands_fragment_schedule():
    cfg = SimConfig(num_fragments=4, sync_every=8, overlap=2)
    sched = Schedule(sync_every=8, num_fragments=4, overlap=2)
    stride = cfg.sync_every // cfg.num_fragments
    for s in range(1, 50):
        mine = (s // stride - 1) % cfg.num_fragments if s % stride == 0 else None
        assert mine == sched.due(s)


# ------------------------------------------------------------------ phase alignment
@pytest.mark.parametrize(
    ("chips", "islands", "step_cv", "days", "off_below"),
    [(768, 2, 0.002, 0.5, 0.6),  # 3 slices: islands of 512 and 256 chips
     (16_384, 3, SimConfig.step_cv, 1.0, 0.95)],  # 64 slices as 21 + 21 + 22
)  # fmt: skip
def test_unequal_islands_without_failures_stay_in_phase_with_alignment(
    chips, islands, step_cv, days, off_below
):
    # A larger island waits longer for its slowest chip every step and falls behind. With
    # the paper's fixed schedule its uploads come stale round after round once it is
    # later than the grace window; with phase alignment (the coordinator's default) it
    # sends as many steps earlier as it was late, as the real islands do.
    cfg = SimConfig(chips=chips, islands=islands, days=days, chip_mtbi_s=math.inf,
                    step_cv=step_cv, systems=("diloco",))  # fmt: skip
    assert cfg.align_phase  # the default, as CoordinatorConfig's
    on = simulate(cfg).rows[0]
    off = simulate(cfg.replace(align_phase=False)).rows[0]
    # No failures: all of the chip-time is useful but each step's wait for the slowest chip.
    assert on.goodput >= 0.99 * (1 - on.chip_time["straggler"]), on.chip_time
    assert on.chip_time["stale"] < 0.002 and on.stats["phase_shifts"] >= 1
    if step_cv < SimConfig.step_cv:
        assert on.goodput >= 0.99
    assert off.stats["phase_shifts"] == 0
    assert off.goodput < min(off_below, on.goodput - 0.03) and off.chip_time["stale"] > 0.03


def test_phase_shift_is_the_islands_rule():
    # The cases of tests/test_syncer.py (H = P = 4, tau = 1: the cap is H - tau - 1 = 2), in
    # milliseconds as the island's ranks agree on them.
    kw = {"sync_every": 4, "overlap": 1}
    # "b" sent fragment 0 at step 1, 0.3 s after the round's first upload; steps take 1 s:
    # at step 2 it sends one step earlier, passing over clock 3 (fragment 2), and acts on
    # no late upload sent before step 6.
    shift = round_policy.phase_shift(2, 1, 300, 1000, 0, **kw)
    assert shift == round_policy.PhaseShift(steps=1, next_at=6)
    assert list(shift.passed_over(2, 0)) == [3]
    assert Schedule(sync_every=4, num_fragments=4, overlap=1).due(3) == 2
    for late_step in (2, 3, 5):  # replies to uploads sent before the next cycle: ignored
        assert round_policy.phase_shift(late_step + 1, late_step, 900, 1000, 6, **kw) is None
    assert round_policy.phase_shift(6, 6, 300, 1000, 6, **kw).steps == 1  # a cycle on
    # Followed late by 0.15 s and 0.45 s with 0.3 s steps: one and two steps (ceil).
    assert round_policy.phase_shift(2, 2, 150, 300, 0, **kw).steps == 1
    assert round_policy.phase_shift(2, 2, 450, 300, 0, **kw).steps == 2
    h24 = {"sync_every": 24, "overlap": 2}
    assert round_policy.phase_shift(2, 2, 600, 300, 0, **h24).steps == 2  # exactly two
    assert round_policy.phase_shift(2, 2, 601, 300, 0, **h24).steps == 3
    # Capped at H - tau - 1, so a result is applied before its fragment is sent again.
    assert round_policy.phase_shift(2, 2, 10_000, 300, 0, **kw).steps == 2
    assert round_policy.phase_shift(9, 8, 1e6, 5.0, 0, **h24).steps == 21
    assert round_policy.acts_on(6, 6) and not round_policy.acts_on(5, 6)
    assert round_policy.acts_on(1, 0) and not round_policy.acts_on(0, 0)
    # No step time yet: no shift, but the cycle's wait starts; nothing late yet: nothing.
    assert round_policy.phase_shift(2, 1, 300, 0, 0, **kw) == round_policy.PhaseShift(0, 6)
    assert round_policy.phase_shift(2, 0, 0, 1000, 0, **kw) is None
    # A send following a merged version is late only within H/2 steps of its round opening.
    assert round_policy.followed_late(0.15, 0.3, 4) == 0.15
    assert round_policy.followed_late(0.6, 0.3, 4) == 0.6
    assert round_policy.followed_late(0.61, 0.3, 4) is None


def test_simulated_islands_shift_by_the_islands_rule(monkeypatch):
    # The simulator calls round_policy.phase_shift (looked up at call time), not a copy:
    # an island that never shifts drifts out of phase as without alignment.
    calls = []
    real = round_policy.phase_shift

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    cfg = SimConfig(chips=768, islands=2, days=0.3, chip_mtbi_s=math.inf, systems=("diloco",))
    monkeypatch.setattr(round_policy, "phase_shift", spy)
    aligned = simulate(cfg).rows[0]
    assert len(calls) >= aligned.stats["phase_shifts"] >= 1
    assert all(kw == {"sync_every": cfg.sync_every, "overlap": cfg.overlap} for _, kw in calls)
    monkeypatch.setattr(round_policy, "phase_shift", lambda *a, **kw: None)
    never = simulate(cfg).rows[0]
    assert never.stats["phase_shifts"] == 0
    assert never.goodput < aligned.goodput - 0.3


def test_without_phase_alignment_the_paper_schedule_is_kept_and_the_flag_says_so(capsys):
    cfg = SimConfig(**SMALL, systems=("diloco",))
    row = simulate(cfg.replace(align_phase=False)).rows[0]
    assert row.stats["phase_shifts"] == row.stats["shifted_steps"] == 0
    argv = ["simulate", "--chips", "768", "--islands", "2", "--days", "0.3", "--chip-mtbi-s",
            "inf", "--systems", "diloco", "--json", "-"]  # fmt: skip
    goodput = {}
    for flag in ("--align-phase", "--no-align-phase"):
        assert cli_main([*argv, flag]) == 0
        goodput[flag] = json.loads(capsys.readouterr().out)["rows"][0]["goodput"]
    assert goodput["--align-phase"] > goodput["--no-align-phase"] + 0.3
    with pytest.raises(ValueError, match=r"SimConfig\.align_phase must be True or False"):
        SimConfig(align_phase=1)


# The goal is 3 points on every published cell, judged on four simulated weeks: one week's
# goodput moves by up to a point from seed to seed (seed 0's week put data-parallel at 600k
# 3.3 points over, four weeks 4.1). Data-parallel at 600k and 2.4M misses it (4.1 and 3.2
# points off): a known miss, kept visible as a strict xfail (the next test shows why no
# restart time and checkpoint cost fit both).
DP_MISSED = {600_000, 2_400_000}


@pytest.mark.parametrize(
    ("system", "n"),
    [
        pytest.param(system, n, marks=pytest.mark.xfail(
            strict=True, reason="goal missed: 3.2-4.1 points off, see the next test"))
        if system == "dp" and n in DP_MISSED else (system, n)
        for system in ("dp", "elastic")
        for n in PAPER_CHIPS
    ],
)  # fmt: skip
def test_calibrated_baselines_are_within_3_points_of_the_published_table(system, n):
    cfg = SimConfig(chips=n, days=28)  # the calibrated defaults, four simulated weeks
    trace = failure_trace(cfg)
    run = simulate_dp if system == "dp" else simulate_elastic
    got = 100 * run(cfg, trace).goodput
    assert abs(got - PUBLISHED[system][n]) <= 3.0, (system, n, got)


# For each checkpoint cost, a restart time at which 600k is still more than 3 points above
# the published row and 2.4M already more than 3 below it.
CROSSING_RESTART_S = {0.0: 50.0, 0.25: 44.0, 0.5: 40.0, 1.0: 35.0, 2.0: 25.0, 4.0: 14.0, 8.0: 1.0}


@pytest.mark.parametrize("checkpoint_s", sorted(CROSSING_RESTART_S))
def test_no_restart_time_puts_data_parallel_within_3_points_at_both_600k_and_2_4m(
    checkpoint_s,
):
    # The published row falls less from 600k (38) to 2.4M (18) than a fixed cost per
    # failure allows. Goodput falls with the restart time, so at a shorter restart 600k is
    # higher still and at a longer one 2.4M lower still: for this checkpoint cost (the
    # interval is Young's optimum) no restart time puts both within 3 points.
    restart = CROSSING_RESTART_S[checkpoint_s]
    errors = {}
    for n in (600_000, 2_400_000):
        cfg = SimConfig(chips=n, restart_s=restart, checkpoint_s=checkpoint_s)
        errors[n] = 100 * simulate_dp(cfg, failure_trace(cfg)).goodput - PUBLISHED["dp"][n]
    assert errors[600_000] > 3.0 and errors[2_400_000] < -3.0, errors


def test_a_fixed_global_batch_shortens_steps_and_the_work_a_failure_loses():
    # Strong scaling: at 16x the chips of the reference a step takes 1/16 of step_s, so
    # a failure loses 16x less work in flight; at the reference size nothing changes.
    # (Free checkpoints: a checkpoint's stall does not shrink with the step.)
    run = {"chips": 2_400_000, "days": 1.0, "systems": ("dp", "elastic"), "checkpoint_s": 0.0}
    weak, strong = SimConfig(**run), SimConfig(**run, fixed_batch_chips=150_000)
    assert strong.chip_step_s == pytest.approx(weak.step_s / 16)
    weak_g, strong_g = _goodput(simulate(weak)), _goodput(simulate(strong))
    for system in ("dp", "elastic"):
        assert strong_g[system] > weak_g[system] + 0.01, (system, weak_g, strong_g)
    same = SimConfig(**{**SMALL, "fixed_batch_chips": SMALL["chips"]})
    assert _goodput(simulate(same)) == _goodput(simulate(SimConfig(**SMALL)))


def test_young_checkpoint_interval_beats_much_shorter_and_much_longer_ones():
    # A costly checkpoint: every step stalls the job too often, every 40 steps loses too
    # much per failure; Young's sqrt(2 x cost x MTBF) (here about 7 steps) beats both.
    cfg = SimConfig(chips=300_000, days=1.0, checkpoint_s=5.0)
    trace = failure_trace(cfg)
    young = simulate_dp(cfg, trace)
    assert 5 <= young.stats["checkpoint_every"] <= 9
    for every_s in (cfg.step_s, 40 * cfg.step_s):
        other = simulate_dp(cfg.replace(checkpoint_every_s=every_s), trace)
        assert other.goodput < young.goodput - 0.02, (every_s, other.goodput, young.goodput)


def test_free_checkpoints_are_taken_every_step():
    cfg = SimConfig(**SMALL, checkpoint_s=0.0)
    result = simulate_dp(cfg, failure_trace(cfg))
    assert result.stats["checkpoint_every"] == 1
    # A failure loses only the step in flight: no completed step is rolled back.
    assert result.stats["restarts"] > 0
    assert result.stats["rolled_back_steps"] == 0


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"islands": 0}, "islands"),
        ({"chips": 100, "chips_per_slice": 256}, "chips"),
        ({"chips": 2048, "islands": 9}, "islands"),
        ({"sync_every": 25}, "sync_every"),
        ({"overlap": 24}, "overlap"),
        ({"detect_s": -1.0}, "detect_s"),
        ({"checkpoint_s": -0.5}, "checkpoint_s"),
        ({"step_s": 0.0}, "step_s"),
        ({"fixed_batch_chips": -1}, "fixed_batch_chips"),
        ({"systems": ("dp", "ring")}, "systems"),
        ({"grace_gamma": 1.0}, "grace_gamma"),
        ({"seed": -1}, "seed"),
        ({"islands": 2, "min_quorum": 3}, "min_quorum"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        SimConfig(**changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"chips": 1.2e6}, "chips"), ({"islands": 2.0}, "islands"), ({"overlap": 2.5}, "overlap"),
     ({"min_quorum": True}, "min_quorum"), ({"seed": 1.5}, "seed"), ({"step_s": "5"}, "step_s")],
)  # fmt: skip
def test_config_refuses_a_value_of_the_wrong_type_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"SimConfig\.{field} must be an? (integer|number)"):
        SimConfig(**{"days": 0.01, **changes})


def test_config_takes_numpy_numbers_as_plain_ones():
    cfg = SimConfig(chips=np.int64(150_000), islands=np.int32(2), days=np.float64(0.01))
    assert type(cfg.chips) is int and type(cfg.days) is float
    json.dumps(cfg.to_dict())  # what --json writes
    assert SimConfig(days=1).days == 1.0 and type(SimConfig(days=1).days) is float


def test_parse_count():
    assert parse_count("150k") == 150_000
    assert parse_count("1.2M") == 1_200_000
    assert parse_count("4096") == 4096
    assert parse_count("4.1M") == 4_100_000 and parse_count("1e3") == 1000  # 4.1 x 1e6 is not
    for bad in ("many", "inf", "1e400", "-inf", "nan", "infk"):  # inf: OverflowError in round
        with pytest.raises(ValueError, match="not a count"):
            parse_count(bad)
    for bad in ("2.5", "1.2345678M", "0.0001k"):  # rounded, --islands 2.5 ran M = 2
        with pytest.raises(ValueError, match="not a whole number"):
            parse_count(bad)


@pytest.mark.parametrize(
    "flag", ["--chips", "--islands", "--min-quorum", "--chips-per-island", "--chips-per-slice"]
)
def test_cli_refuses_a_count_that_is_not_whole_naming_the_flag(flag, no_simulation, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["simulate", "--chips", "150k", "--days", "0.01", flag, "2.5"])
    assert e.value.code == 2
    assert f"argument {flag}: not a count: '2.5' is not a whole number" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--chips", "--fixed-batch-chips", "--chips-per-slice"])
@pytest.mark.parametrize("value", ["inf", "1e400"])
def test_cli_refuses_a_count_that_is_not_finite_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["simulate", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: not a count: '{value}'" in capsys.readouterr().err


@pytest.fixture
def no_simulation(monkeypatch):
    """Fails a test that gets as far as drawing a failure trace."""

    def drawn(cfg):
        raise AssertionError("simulated before the inputs were checked")

    monkeypatch.setattr("ds_diloco.simulate.run.failure_trace", drawn)


def test_work_beyond_the_caps_is_refused_up_front_and_paper_scale_is_well_within():
    from ds_diloco.simulate import config as simconfig

    # The paper's largest runs (and the 28-day calibration) use a fraction of each cap.
    w = SimConfig(chips=2_400_000, islands=16, days=28).work()
    assert w["failures"] < simconfig.MAX_FAILURES / 20
    assert w["island_steps"] < simconfig.MAX_ISLAND_STEPS / 5
    assert w["slices"] < simconfig.MAX_SLICES / 100
    assert SimConfig().work()["island_steps"] == 8 * 7 * 86400 / 5
    assert SimConfig(systems=("dp",)).work()["island_steps"] == 0
    assert SimConfig(chip_mtbi_s=math.inf).work()["failures"] == 0
    with pytest.raises(ValueError, match=r"chip failures .* over the cap .*lower SimConfig\.days"):
        SimConfig(days=1e7, systems=("dp",))  # 30 GiB of trace
    with pytest.raises(ValueError, match=r"chip failures .* raise SimConfig\.chip_mtbi_s"):
        SimConfig(chip_mtbi_s=1.0)
    # A day's run with a repair time of 30 years: the repair time is what to lower.
    with pytest.raises(ValueError, match=r"chip failures .* lower SimConfig\.repair_s or"):
        SimConfig(days=1, repair_s=1e9, systems=("dp",))
    with pytest.raises(ValueError, match=r"island steps .* raise SimConfig\.step_s"):
        SimConfig(chips=150_000, islands=2, days=1, step_s=1e-6, systems=("diloco",))
    with pytest.raises(ValueError, match=r"island steps"):  # a fixed global batch: short steps
        SimConfig(chips=2_400_000, islands=16, days=7, fixed_batch_chips=1_000)
    with pytest.raises(ValueError, match=r"slices .* over the cap"):
        SimConfig(chips=10**12, chips_per_slice=1, days=1e-6, chip_mtbi_s=math.inf)


def test_cli_refuses_work_beyond_the_caps_before_simulating(no_simulation, capsys):
    assert cli_main(["simulate", "--days", "1e7", "--systems", "dp"]) == 2
    err = capsys.readouterr().err
    assert "chip failures" in err and "lower --days or --chips, or raise --chip-mtbi-s" in err
    argv = ["simulate", "--days", "1", "--systems", "diloco", "--islands", "2", "--chips", "150k"]
    assert cli_main([*argv, "--step-s", "1e-6"]) == 2
    err = capsys.readouterr().err
    assert "island steps" in err and "raise --step-s" in err and len(err.splitlines()) == 1
    # Checked for every M of the sweep, not only the one the flags were checked with.
    assert cli_main([*argv[:-4], "--islands", "2,16", "--chips", "2.4M", "--days", "200"]) == 2
    assert "16 islands" in capsys.readouterr().err


def test_cli_names_the_seed_flag(no_simulation, capsys):
    assert cli_main(["simulate", "--chips", "150k", "--days", "0.01", "--seed", "-1"]) == 2
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_cli_checks_output_paths_before_simulating(flag, tmp_path, no_simulation, capsys):
    argv = ["simulate", "--chips", "150k", "--islands", "2", "--days", "0.01"]
    a_file = tmp_path / "file"
    a_file.write_text("")
    for path, says in ((tmp_path / "missing" / "out", "does not exist"),
                       (a_file / "out", "is not a folder"),
                       (tmp_path, "is a folder")):  # fmt: skip
        assert cli_main([*argv, flag, str(path)]) == 2, path
        err = capsys.readouterr().err
        assert f"{flag} {path}: " in err and says in err and len(err.splitlines()) == 1, err


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = cli_main(
        ["simulate", "--chips", "150k,300k", "--islands", "2,4", "--days", "0.05",
         "--json", str(out), "--plot", str(png), "--detect-s", "12",
         "--fixed-batch-chips", "150k", "--breakdown"]
    )  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "Decoupled DiLoCo, M=4" in table and "[72]" in table and "uptime %" in table
    assert "where the chip-time went at 150k chips" in table
    assert "where the chip-time went at 300k chips" in table
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 2 * (2 + 2)  # 2 sizes x (2 baselines + 2 DiLoCo)
    assert {c["detect_s"] for c in doc["configs"]} == {12.0}
    assert {c["fixed_batch_chips"] for c in doc["configs"]} == {150_000}
    assert doc["published"]["dp"]["150000"] == 72
    assert all(sum(r["chip_time"].values()) == pytest.approx(1.0) for r in doc["rows"])
    # One size asked for: its breakdown is shown without the flag; two: only with it.
    assert cli_main(["simulate", "--chips", "150k", "--islands", "2", "--days", "0.02"]) == 0
    assert "where the chip-time went at 150k chips" in capsys.readouterr().out
    assert cli_main(["simulate", "--chips", "150k,300k", "--islands", "2", "--days", "0.02"]) == 0
    assert "where the chip-time went" not in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["goodput", "goodput.xyz", "goodput.pdf"])
def test_cli_plot_is_a_png_at_the_path_given(name, tmp_path, capsys):
    png = tmp_path / name
    argv = ["simulate", "--chips", "150k", "--islands", "2", "--days", "0.01", "--plot", str(png)]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_cli_json_is_strict_json_without_failures(tmp_path, capsys):
    # --chip-mtbi-s inf (no failures) is allowed; JSON has no Infinity for it.
    out = tmp_path / "sim.json"
    argv = ["simulate", "--chips", "512", "--islands", "2", "--days", "0.01",
            "--chip-mtbi-s", "inf"]  # fmt: skip

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))

    assert cli_main([*argv, "--json", str(out)]) == 0
    doc = strict(out.read_text())
    assert {c["chip_mtbi_s"] for c in doc["configs"]} == {"inf"}
    capsys.readouterr()
    assert cli_main([*argv, "--json", "-"]) == 0
    assert strict(capsys.readouterr().out)["rows"] == doc["rows"]


def test_cli_rejects_a_bad_parameter_with_one_line(capsys):
    assert cli_main(["simulate", "--chips", "150k", "--days", "-1"]) == 2
    assert "--days must be a finite number > 0" in capsys.readouterr().err  # named by flag
    assert cli_main(["simulate", "--chips", "150k", "--overlap", "0"]) == 2
    assert "--overlap (tau) must be >= 1" in capsys.readouterr().err
    # Over H: the message named [0, H), and 0 was then refused.
    assert cli_main(["simulate", "--chips", "150k", "--overlap", "24"]) == 2
    err = capsys.readouterr().err
    assert "--overlap (tau) must be >= 1 for the grace-window policy and < sync_every=24" in err
    assert cli_main(["simulate", "--chips", "150k", "--grace-gamma", "1"]) == 2
    assert "--grace-gamma must be in [0, 1)" in capsys.readouterr().err
    assert cli_main(["simulate", "--chips", "150k", "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
    # M comes from --islands / --chips-per-island, not from the default M = 8 (3 slices here).
    argv = ["simulate", "--chips", "1000", "--days", "0.01", "--systems", "diloco", "--json", "-"]
    assert cli_main([*argv, "--islands", "2"]) == 0
    assert [r["islands"] for r in json.loads(capsys.readouterr().out)["rows"]] == [2]
    assert cli_main([*argv, "--chips-per-island", "500"]) == 0
    assert [r["islands"] for r in json.loads(capsys.readouterr().out)["rows"]] == [2]
    for bad, says in ((["--chips-per-island", "0"], "--chips-per-island must be 256..1000"),
                      (["--chips-per-island", "5000"], "--chips-per-island must be 256..1000"),
                      # under a slice: more islands than slices, not a flag not given
                      (["--chips-per-island", "100"], "--chips-per-island must be 256..1000"),
                      (["--chips-per-island", "100", "--chips-per-slice", "50"], None),
                      (["--chips", ","], "--chips: give at least one")):  # fmt: skip
        if says is None:
            assert cli_main([*argv, *bad]) == 0, capsys.readouterr().err
            assert [r["islands"] for r in json.loads(capsys.readouterr().out)["rows"]] == [10]
            continue
        assert cli_main([*argv, *bad]) == 2, bad
        assert says in capsys.readouterr().err, bad


# --------------------------------------------------------------- planning (plan.py)
def _row(islands: int, k: int, goodput: float, system: str = "diloco") -> SystemResult:
    return SystemResult(system=system, chips=149_760, islands=islands, min_quorum=k,
                        goodput=goodput, uptime=1.0, failures=0)  # fmt: skip


def test_plan_takes_the_fewest_islands_within_tolerance_then_that_ms_best_quorum():
    rows = [_row(2, 1, 0.80), _row(4, 1, 0.845), _row(4, 2, 0.848), _row(8, 1, 0.85),
            _row(16, 1, 0.851), _row(1, 1, 0.70, system="elastic")]  # fmt: skip
    plan = recommend(rows, tolerance=0.01)
    # M = 2 is 5 points off; M = 4 is within a point of M = 16's 85.1 %, and K = 2 is its best.
    assert (plan.islands, plan.min_quorum) == (4, 2)
    assert plan.goodput == 0.848
    assert "M=16 K=1, 85.1 %" in plan.reason and "elastic data-parallel: 70.0 %" in plan.reason
    # No tolerance: the best goodput wins; on a tie the larger quorum.
    assert (recommend(rows, 0.0).islands, recommend(rows, 0.0).min_quorum) == (16, 1)
    tie = recommend([_row(8, 1, 0.9), _row(8, 2, 0.9)], 0.0)
    assert tie.min_quorum == 2 and "the best of 2 setting(s)" in tie.reason


def test_plan_refuses_what_it_cannot_plan_from():
    with pytest.raises(ValueError, match="no Decoupled DiLoCo result"):
        recommend([_row(1, 1, 0.5, system="dp")])
    other_size = dataclasses.replace(_row(4, 1, 0.8), chips=299_776)
    with pytest.raises(ValueError, match="one cluster size at a time"):
        recommend([_row(2, 1, 0.8), other_size])
    with pytest.raises(ValueError, match="tolerance"):
        recommend([_row(2, 1, 0.8)], tolerance=1.5)


def test_a_row_is_found_by_the_size_asked_for():
    # Rows hold whole slices (149,760 chips for 150k): get(chips=150_000) was a KeyError.
    cfg = SimConfig(days=0.01, systems=("elastic", "diloco"))
    result = sweep(cfg, [150_000, 300_000], [2])
    assert result.get("elastic", chips=150_000).chips == 149_760
    assert result.get("diloco", chips=300_000, islands=2).chips == 299_776
    assert result.get("elastic", chips=149_760) is result.get("elastic", chips=150_000)
    with pytest.raises(KeyError, match="chips=600000"):
        result.get("elastic", chips=600_000)


def test_the_default_m_does_not_refuse_baselines_or_the_ms_a_sweep_asks_for():
    # M = 8 (DiLoCo's default) over the slices refused a baseline-only config, and a sweep
    # of M = 2 at three slices (its baselines' piece kept M = 8).
    assert SimConfig(chips=512, days=0.01, systems=("dp",)).islands == 8
    result = sweep(SimConfig(days=0.01), [1000], [2])
    assert [(r.system, r.islands) for r in result.rows] == [
        ("dp", 1), ("elastic", 1), ("diloco", 2)
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"islands must be <= the number of slices \(2\)"):
        SimConfig(chips=512, days=0.01)  # DiLoCo with M = 8 on two slices


def test_sweep_names_chips_per_island_when_it_cannot_make_islands_of_it():
    # Over a size it made M = 0 ("no quorum to simulate with M=0 islands"); under a slice,
    # more islands than slices ("islands must be <= the number of slices").
    cfg = SimConfig(days=0.01)
    for cpi in (2000, 100):
        with pytest.raises(ValueError, match=rf"chips_per_island must be 256\.\.1000 .*{cpi}"):
            sweep_configs(cfg, [1000, 150_000], chips_per_island=cpi)
    assert [c.islands for c in sweep_configs(cfg, [1000], chips_per_island=500)][-1] == 2


def test_sweep_runs_every_quorum_up_to_each_m():
    cfg = SimConfig(**SMALL, systems=("diloco",))
    tasks = sweep_configs(cfg, [150_000], [2, 4], quorums=[1, 3, 1])
    assert [(c.islands, c.min_quorum) for c in tasks] == [(2, 1), (4, 1), (4, 3)]
    with pytest.raises(ValueError, match=r"M=2 islands .* every K asked for \(\[3\]\) is over M"):
        sweep_configs(cfg, [150_000], [2], quorums=[3])


def test_cli_runs_a_value_given_twice_once(capsys):
    argv = ["simulate", "--chips", "150k,150k", "--islands", "2,2", "--min-quorum", "1,1",
            "--systems", "elastic,diloco,elastic", "--days", "0.01", "--json", "-"]  # fmt: skip
    assert cli_main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["system"], r["islands"]) for r in rows] == [("elastic", 1), ("diloco", 2)]
    assert cli_main([*argv[:3], "--islands", ",", "--days", "0.01"]) == 2
    assert "--islands: give at least one M" in capsys.readouterr().err


def test_published_diloco_cell_is_shown_for_the_papers_quorum_only(capsys):
    argv = ["simulate", "--chips", "1.2M", "--islands", "8", "--min-quorum", "1,2",
            "--systems", "diloco", "--days", "0.002"]  # fmt: skip
    assert cli_main(argv) == 0
    goodput = capsys.readouterr().out.split("uptime %")[0]
    assert "M=8  " in goodput and "M=8, K=2" in goodput
    assert goodput.count("[88]") == 1  # published with K = 1, the paper's


def test_cli_plan_sweeps_quorums_and_recommends_per_size(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["simulate", "--chips", "150k,300k", "--islands", "2,4", "--min-quorum", "1,2",
            "--days", "0.1", "--systems", "elastic,diloco", "--plan", "--json", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "Decoupled DiLoCo, M=2, K=2" in text and "Decoupled DiLoCo, M=4\n" not in text
    assert "plan at 150k chips: M=" in text and "plan at 300k chips: M=" in text
    doc = json.loads(out.read_text())
    rows = [r for r in doc["rows"] if r["system"] == "diloco"]
    assert sorted((r["chips"], r["islands"], r["min_quorum"]) for r in rows) == [
        (n, m, k) for n in (149_760, 299_776) for m in (2, 4) for k in (1, 2)
    ]
    # K reaches the simulation, not only the label: two islands that must both send
    # merge differently from one that may merge alone.
    by = {(r["chips"], r["islands"], r["min_quorum"]): r for r in rows}
    assert by[(149_760, 2, 1)]["stats"] != by[(149_760, 2, 2)]["stats"]
    assert len(doc["plan"]) == 2
    for plan in doc["plan"]:
        here = [r for r in rows if r["chips"] == plan["chips"]]
        best = max(r["goodput"] for r in here)
        assert plan["goodput"] >= best - 0.01
        assert not any(r["islands"] < plan["islands"] and r["goodput"] >= best - 0.01
                       for r in here)  # fmt: skip
    assert cli_main([*argv[:-2], "--systems", "dp,elastic"]) == 2
    assert "--plan: recommends Decoupled DiLoCo settings" in capsys.readouterr().err


def test_the_cli_says_what_each_size_asked_for_is_simulated_as(capsys):
    # 1000 chips ran as 768 (whole slices) under the heading "1k", and --chips-per-island 500
    # as islands of 256 and 512 chips, and nothing said so.
    argv = ["simulate", "--chips", "1000,1024", "--days", "0.01", "--systems", "elastic,diloco"]
    assert cli_main([*argv, "--islands", "2"]) == 0
    out = capsys.readouterr().out
    assert "simulated as (whole slices of 256 chips, --chips-per-slice):" in out, out
    assert "  1k: 768 chips (3 slice(s); 232 below a whole slice, not used)\n" in out, out
    assert "1024:" not in out, out  # simulated as asked: no line
    assert cli_main([*argv, "--chips-per-island", "500"]) == 0
    out = capsys.readouterr().out
    assert (
        "  1k: 768 chips (3 slice(s); 232 below a whole slice, not used), M = 2 islands of 1-2 "
        "slice(s), 256-512 chips each (not 500)\n" in out
    ), out
    assert (
        "  1024: 1,024 chips (4 slice(s)), M = 2 islands of 2 slice(s), 512 chips each (not 500)"
        in out
    )
    # No DiLoCo: no islands to speak of.
    assert cli_main([*argv[:-1], "elastic", "--chips-per-island", "500"]) == 0
    assert (
        "  1k: 768 chips (3 slice(s); 232 below a whole slice, not used)\n"
        in (out := capsys.readouterr().out)
        and "islands" not in out
    ), out
    # Whole slices and islands as asked: nothing to say.
    assert (
        cli_main(["simulate", "--chips", "1024", "--days", "0.01", "--chips-per-island", "512"])
        == 0
    )
    assert "simulated as" not in capsys.readouterr().out
