"""Fault schedules (seeded, from files, validated) and the injector on a fake clock."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from ds_diloco.chaos.schedule import COORDINATOR, KINDS, Event, Injector, Schedule

REPO = Path(__file__).resolve().parents[1]

ISLANDS = ["a", "b", "c"]
RANKS = {"a": 2, "b": 2, "c": 4}


def draw(seed, **kw):
    kw.setdefault("rate_per_min", 6.0)
    return Schedule.from_seed(seed, ISLANDS, RANKS, 600.0, **kw)


# ---- seeded schedules --------------------------------------------------------------------


def test_same_seed_same_schedule_different_seed_different():
    s1, s2, s3 = draw(1), draw(1), draw(2)
    assert len(s1) > 10
    assert s1 == s2
    assert s1.to_json() == s2.to_json()
    assert s1 != s3
    assert [e.at_s for e in s1] != [e.at_s for e in s3]
    # Changing an argument changes the draw too (the schedule is a function of all of them).
    assert draw(1, min_gap_s=6.0) != s1


def test_seeded_schedule_is_stable_across_versions():
    # Golden: a change to the draw (or to Python's random stream) breaks replay by seed.
    s = Schedule.from_seed(
        7,
        ["a", "b"],
        {"a": 2, "b": 2},
        120.0,
        rate_per_min=6.0,
        restart_window_s=10.0,
        min_gap_s=2.0,
    )
    assert s.seed == 7
    assert [e.to_dict() for e in s] == [
        {"at_s": 13.913, "kind": "kill_rank", "target": "b", "rank": 0},
        {"at_s": 28.819, "kind": "net_drop", "target": "a", "duration_s": 3.786},
        {"at_s": 38.692, "kind": "kill_coordinator", "target": "coordinator", "duration_s": 2.587},
        {"at_s": 76.096, "kind": "kill_rank", "target": "b", "rank": 0},
        {"at_s": 93.522, "kind": "slow", "target": "b", "duration_s": 2.502, "extra_s": 0.077},
        {"at_s": 101.407, "kind": "stall", "target": "b", "duration_s": 5.625},
    ]


def test_seeded_schedule_respects_its_rules():
    s = draw(3, warmup_s=20.0, restart_window_s=15.0, min_gap_s=4.0, max_faulted_islands=2)
    assert {e.kind for e in s} == set(KINDS)
    assert [e.at_s for e in s] == sorted(e.at_s for e in s)
    windows: dict[str, list[tuple[float, float]]] = {}
    for e in s:
        assert e.at_s >= 20.0 and e.end_s <= 600.0
        if e.kind == "kill_coordinator":
            assert e.target == COORDINATOR and 1.0 <= e.duration_s <= 5.0
        else:
            assert e.target in ISLANDS
        if e.kind == "kill_rank":
            assert 0 <= e.rank < RANKS[e.target]
        if e.kind in ("stall", "slow", "net_delay", "net_drop"):
            assert 2.0 <= e.duration_s <= 10.0
        if e.kind == "slow":
            assert 0.05 <= e.extra_s <= 0.5
        if e.kind == "net_delay":
            assert 0.05 <= e.delay_s <= 0.5
        end = e.end_s + (15.0 if e.kind in ("kill_rank", "kill_coordinator") else 0.0)
        windows.setdefault(e.target, []).append((e.at_s, end))
    for target, ws in windows.items():
        for (_, end), (start, _) in itertools.pairwise(ws):
            assert start >= end + 4.0, f"{target}: next fault {start} within gap of {end}"
    # Never more than max_faulted_islands islands in a fault window at once.
    island_ws = [w for t, ws in windows.items() if t != COORDINATOR for w in ws]
    for start, _ in island_ws:
        assert sum(s0 <= start < e0 for s0, e0 in island_ws) <= 2


def test_seeded_rate_and_kind_choice():
    # One instantaneous kind, no gaps: nothing is skipped, so the count is Poisson(rate x time).
    s = Schedule.from_seed(
        11,
        [f"i{k}" for k in range(8)],
        {f"i{k}": 1 for k in range(8)},
        3600.0,
        rate_per_min=2.0,
        kinds=["kill_rank"],
        warmup_s=0.0,
        restart_window_s=0.0,
        min_gap_s=0.0,
        max_faulted_islands=8,
    )
    assert 90 <= len(s) <= 150  # mean 120, sd ~11
    assert {e.kind for e in s} == {"kill_rank"}
    assert len({e.target for e in s}) == 8
    weighted = draw(4, kinds={"stall": 1.0, "slow": 0.0, "net_drop": 3.0})
    counts = {k: sum(e.kind == k for e in weighted) for k in KINDS}
    assert counts["slow"] == 0 and counts["stall"] > 0
    assert counts["net_drop"] > counts["stall"]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"seed": -1}, "seed must be an int >= 0"),
        ({"islands": []}, "at least one island"),
        ({"islands": ["a", "a"]}, "unique"),
        ({"islands": ["a", "coordinator"]}, "other than 'coordinator'"),
        ({"ranks": {"a": 2}}, "ranks_per_island['b']"),
        ({"duration_s": 0}, "duration_s must be a finite number > 0"),
        ({"rate_per_min": 0.0}, "rate_per_min"),
        ({"kinds": ["stall", "reboot"]}, "unknown kind 'reboot'"),
        ({"kinds": {"stall": 0.0}}, "at least one kind"),
        ({"fault_s": (5.0, 1.0)}, "fault_s must be (lo, hi)"),
        ({"net_delay_s": (0.0, 1.0)}, "net_delay_s must be (lo, hi)"),
        ({"max_faulted_islands": 0}, "max_faulted_islands"),
    ],
)
def test_from_seed_rejects_bad_arguments(kw, message):
    args = {"seed": 0, "islands": ["a", "b"], "ranks": {"a": 1, "b": 1}, "duration_s": 60.0}
    args.update(kw)
    with pytest.raises(ValueError) as e:
        Schedule.from_seed(
            args.pop("seed"), args.pop("islands"), args.pop("ranks"), args.pop("duration_s"), **args
        )
    assert message in str(e.value)


# ---- events and files --------------------------------------------------------------------

ALL_KINDS = [
    Event(at_s=12.5, kind="stall", target="a", duration_s=8),
    Event(at_s=30, kind="kill_rank", target="b", rank=1),
    Event(at_s=41.25, kind="slow", target="a", duration_s=10.0, extra_s=0.25),
    Event(at_s=50.0, kind="net_delay", target="b", duration_s=5.0, delay_s=0.2),
    Event(at_s=60.0, kind="net_drop", target="a", duration_s=5.0),
    Event(at_s=70.0, kind="kill_coordinator", target="coordinator", duration_s=3.0),
]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--duration", "-5"], "--duration must be a finite number > 0, got -5.0"),
        (["--rate", "nan"], "--rate must be a finite number > 0, got nan"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
    ],
)
def test_chaos_names_its_bad_flags(tmp_path, capsys, flags, message):
    """Not the schedule's own 'from_seed: duration_s must be ...'."""
    from ds_diloco.cli import main as cli_main

    run = {"model": {"config": str(REPO / "model_configs" / "tiny-llama.json")},
           "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
           "data": {"path": str(REPO / "tests" / "data")}, "islands": [{"name": "a"}],
           "workdir": str(tmp_path / "run")}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert cli_main(["chaos", str(tmp_path / "run.json"), *flags]) == 2
    assert capsys.readouterr().err == f"ds-diloco: error: {message}\n"
    assert not (tmp_path / "run").exists() and not (tmp_path / "run-chaos").exists()


def test_chaos_refuses_a_seeded_schedule_that_drew_no_fault(tmp_path, capsys, monkeypatch):
    # --duration 30 drew no event for half the seeds (none at all up to the 10 s warm-up):
    # the chaos, reference and baseline runs went on for minutes, fault-free, and the report
    # said "events injected: 0 ()" beside a goodput ratio.
    from ds_diloco.chaos import harness
    from ds_diloco.cli import main as cli_main

    def run_chaos(cfg, schedule, *a, **kw):  # the runs: not started here
        raise AssertionError(f"the runs started under a schedule of {len(schedule)} faults")

    monkeypatch.setattr(harness, "run_chaos", run_chaos)
    run = {"model": {"config": str(REPO / "model_configs" / "tiny-llama.json")},
           "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
           "data": {"path": str(REPO / "tests" / "data")}, "islands": [{"name": "a"}],
           "workdir": str(tmp_path / "run")}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert cli_main(["chaos", str(tmp_path / "run.json"), "--duration", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-diloco: error: seed 0 drew no fault in --duration 10 s") and (
        "--rate" in err
    ), err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_file_round_trip(tmp_path, suffix):
    s = Schedule(tuple(reversed(ALL_KINDS)), seed=5)
    assert [e.at_s for e in s] == [12.5, 30.0, 41.25, 50.0, 60.0, 70.0]  # sorted on build
    path = tmp_path / f"chaos{suffix}"
    s.to_file(path)
    back = Schedule.from_file(path)
    assert back == s and back.seed == 5
    assert back.events[1].rank == 1 and back.events[0].duration_s == 8.0
    drawn = draw(9)
    drawn.to_file(path)
    assert Schedule.from_file(path) == drawn


def test_json_format_is_the_documented_one():
    d = json.loads(Schedule(ALL_KINDS[:2], seed=3).to_json())
    assert d == {
        "version": 1,
        "seed": 3,
        "events": [
            {"at_s": 12.5, "kind": "stall", "target": "a", "duration_s": 8.0},
            {"at_s": 30.0, "kind": "kill_rank", "target": "b", "rank": 1},
        ],
    }


def test_handwritten_yaml_loads(tmp_path):
    path = tmp_path / "s.yml"
    path.write_text(
        "events:\n"
        "  - {at_s: 5, kind: kill_coordinator, target: coordinator, duration_s: 2}\n"
        "  - {at_s: 1, kind: net_delay, target: island-0, duration_s: 3, delay_s: 0.1}\n"
    )
    s = Schedule.from_file(path)
    assert [e.kind for e in s] == ["net_delay", "kill_coordinator"]
    assert s.seed is None and s.end_s == 7.0


def test_a_file_reads_floats_with_exponents_and_refuses_a_key_given_twice(tmp_path):
    # JSON writes 2e-05 for a small float, and people write 5e-2: YAML 1.1 read both as
    # strings, so to_file's own JSON came back refused ("at_s must be a number, got
    # '2e-05'"). A key given twice kept its last value and dropped the other unnamed.
    s = Schedule((Event(at_s=2e-05, kind="net_delay", target="a", duration_s=5, delay_s=1e-3),))
    s.to_file(tmp_path / "s.json")
    assert Schedule.from_file(tmp_path / "s.json") == s
    path = tmp_path / "s.yaml"
    path.write_text(
        "events:\n  - {at_s: 1e1, kind: slow, target: a, duration_s: 5, extra_s: 5e-2}\n"
    )
    assert Schedule.from_file(path).events[0].extra_s == 0.05
    path.write_text(
        "events:\n  - {at_s: 5, kind: stall, target: a, duration_s: 3, duration_s: 30}\n"
    )
    with pytest.raises(ValueError, match=r"s\.yaml.*duplicate key 'duration_s'.*line 2"):
        Schedule.from_file(path)


@pytest.mark.parametrize(
    "events, message",
    [
        ([{"at_s": 1, "kind": "stall", "target": "a", "durations_s": 2}], "'durations_s'"),
        ([{"at_s": 1, "kind": "stall", "target": "a"}], "missing key(s) 'duration_s'"),
        ([{"at_s": 1, "kind": "reboot", "target": "a"}], "'kind' must be one of"),
        ([{"at_s": 1, "kind": "stall", "target": "a", "duration_s": 1, "rank": 0}], "'rank'"),
        ([{"at_s": 1, "kind": "kill_rank", "target": "a", "rank": 1.0}], "rank must be an int"),
        ([{"at_s": -1, "kind": "net_drop", "target": "a", "duration_s": 1}], "at_s"),
        ("not a list", "'events' must be a list"),
    ],
)
def test_bad_files_rejected(tmp_path, events, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"events": events}))
    with pytest.raises(ValueError) as e:
        Schedule.from_file(path)
    assert message in str(e.value)
    assert "bad.json" in str(e.value)
    if isinstance(events, list):
        assert "events[0]" in str(e.value)


def test_bad_top_level_rejected(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"events": [], "sead": 3}))
    with pytest.raises(ValueError, match=r"unknown key.*'sead'"):
        Schedule.from_file(path)
    path.write_text(json.dumps({"version": 2, "events": []}))
    with pytest.raises(ValueError, match="version must be 1"):
        Schedule.from_file(path)
    path.write_text("events: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        Schedule.from_file(path)
    with pytest.raises(ValueError, match="does not exist"):
        Schedule.from_file(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="suffix"):
        Schedule().to_file(tmp_path / "s.txt")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"kind": "reboot", "target": "a"}, "Event.kind must be one of"),
        ({"at_s": float("nan"), "kind": "net_drop", "duration_s": 1}, "Event.at_s"),
        ({"at_s": -0.5, "kind": "net_drop", "duration_s": 1}, "Event.at_s"),
        ({"kind": "kill_rank"}, "Event.rank must be an int >= 0"),
        ({"kind": "kill_rank", "rank": True}, "Event.rank must be an int"),
        ({"kind": "kill_rank", "rank": 0, "duration_s": 3}, "Event.duration_s must be 0"),
        ({"kind": "stall", "duration_s": 0}, "Event.duration_s (stall)"),
        ({"kind": "stall", "duration_s": 1, "rank": 0}, "Event.rank applies only"),
        ({"kind": "slow", "duration_s": 1}, "Event.extra_s (slow)"),
        ({"kind": "slow", "duration_s": 1, "extra_s": -1}, "Event.extra_s (slow)"),
        ({"kind": "net_delay", "duration_s": 1, "extra_s": 1}, "Event.extra_s applies only"),
        ({"kind": "net_delay", "duration_s": 1}, "Event.delay_s (net_delay)"),
        ({"kind": "kill_coordinator", "duration_s": 1}, "must be 'coordinator'"),
        ({"kind": "stall", "target": "coordinator", "duration_s": 1}, "must name an island"),
        ({"kind": "stall", "target": "", "duration_s": 1}, "Event.target"),
    ],
)
def test_bad_events_rejected(kw, message):
    args = {"at_s": 1.0, "target": "a"}
    args.update(kw)
    with pytest.raises(ValueError) as e:
        Event(**args)
    assert message in str(e.value)


def test_check_targets():
    s = Schedule(ALL_KINDS)
    s.check_targets({"a": 1, "b": 2})
    with pytest.raises(ValueError, match="unknown island 'b'"):
        s.check_targets({"a": 1})
    with pytest.raises(ValueError, match=r"has ranks 0\.\.0, got rank 1"):
        s.check_targets({"a": 1, "b": 1})


def test_check_targets_does_not_name_an_event_by_its_place_in_time_as_if_in_the_file(tmp_path):
    path = tmp_path / "s.yaml"  # the bad event is the file's first; two come before it in time
    path.write_text(
        "events:\n"
        "  - {at_s: 50.0, kind: stall, target: nosuch, duration_s: 2.0}\n"
        "  - {at_s: 10.0, kind: stall, target: a, duration_s: 2.0}\n"
        "  - {at_s: 20.0, kind: kill_rank, target: a, rank: 0}\n"
    )
    with pytest.raises(ValueError) as e:
        Schedule.from_file(path).check_targets({"a": 1})
    assert str(e.value) == "event stall at 50.0s: unknown island 'nosuch'; the run has: a"


# ---- the injector ------------------------------------------------------------------------


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Recorder:
    """A ChaosTarget that records each call with the fake time it was made at."""

    def __init__(self, clock, fail: tuple[str, ...] = ()):
        self.clock = clock
        self.calls: list[tuple] = []
        self.fail = fail

    def _rec(self, *call):
        self.calls.append((round(self.clock() - 100.0, 6), *call))
        if call[0] in self.fail:
            raise OSError(f"{call[0]} failed")

    def kill_rank(self, island, rank):
        self._rec("kill_rank", island, rank)

    def stop_island(self, island):
        self._rec("stop_island", island)

    def cont_island(self, island):
        self._rec("cont_island", island)

    def set_slow(self, island, extra_s):
        self._rec("set_slow", island, extra_s)

    def set_net(self, island, delay_s=0.0, drop=False):
        self._rec("set_net", island, delay_s, drop)

    def kill_coordinator(self):
        self._rec("kill_coordinator")

    def restart_coordinator(self):
        self._rec("restart_coordinator")


def run_to(inj, clock, times):
    for t in times:
        clock.t = 100.0 + t
        inj.poll()


def test_injector_applies_and_reverts_in_order():
    clock = FakeClock()
    rec = Recorder(clock)
    s = Schedule(
        (
            Event(at_s=1.0, kind="stall", target="a", duration_s=2.0),
            Event(at_s=2.0, kind="slow", target="b", duration_s=3.0, extra_s=0.5),
            Event(at_s=2.5, kind="kill_rank", target="a", rank=1),
            Event(at_s=4.0, kind="net_delay", target="a", duration_s=1.0, delay_s=0.2),
            Event(at_s=4.5, kind="net_drop", target="a", duration_s=1.0),  # overlaps the delay
            Event(at_s=6.0, kind="kill_coordinator", target=COORDINATOR, duration_s=1.0),
        )
    )
    inj = Injector(s, rec, clock=clock).start(background=False)
    run_to(inj, clock, [0.0, 0.99])
    assert rec.calls == []  # nothing before its time
    run_to(inj, clock, [x / 4 for x in range(4, 33)])
    assert rec.calls == [
        (1.0, "stop_island", "a"),
        (2.0, "set_slow", "b", 0.5),
        (2.5, "kill_rank", "a", 1),
        (3.0, "cont_island", "a"),
        (4.0, "set_net", "a", 0.2, False),
        (4.5, "set_net", "a", 0.2, True),
        (5.0, "set_slow", "b", 0.0),
        (5.0, "set_net", "a", 0.0, True),  # the delay ends, the drop goes on
        (5.5, "set_net", "a", 0.0, False),
        (6.0, "kill_coordinator"),
        (7.0, "restart_coordinator"),
    ]
    assert inj.pending == 0 and inj.wait(0) and inj.active == ()
    log = inj.log
    assert [(r["t_s"], r["action"], r["kind"]) for r in log[:4]] == [
        (1.0, "apply", "stall"),
        (2.0, "apply", "slow"),
        (2.5, "apply", "kill_rank"),
        (3.0, "revert", "stall"),
    ]
    assert all(r["ok"] and r["reason"] == "schedule" for r in log)
    assert log[0]["calls"] == ["stop_island('a')"]


def test_injector_late_poll_runs_everything_due_in_order():
    clock = FakeClock()
    rec = Recorder(clock)
    s = Schedule(
        (
            Event(at_s=1.0, kind="stall", target="a", duration_s=1.0),
            Event(at_s=2.0, kind="stall", target="a", duration_s=1.0),  # back to back
        )
    )
    inj = Injector(s, rec, clock=clock).start(background=False)
    run_to(inj, clock, [10.0])  # one late poll: reverts before applies at t=2
    assert [c[1] for c in rec.calls] == ["stop_island", "cont_island", "stop_island", "cont_island"]
    assert [r["at_s"] for r in inj.log] == [1.0, 2.0, 2.0, 3.0]
    assert [r["action"] for r in inj.log] == ["apply", "revert", "apply", "revert"]


def test_overlapping_stalls_compose():
    clock = FakeClock()
    rec = Recorder(clock)
    s = Schedule(
        (
            Event(at_s=1.0, kind="stall", target="a", duration_s=3.0),
            Event(at_s=2.0, kind="stall", target="a", duration_s=1.0),
            Event(at_s=2.0, kind="slow", target="a", duration_s=1.0, extra_s=0.1),
            Event(at_s=2.5, kind="slow", target="a", duration_s=1.0, extra_s=0.3),
        )
    )
    inj = Injector(s, rec, clock=clock).start(background=False)
    run_to(inj, clock, [x / 2 for x in range(11)])
    assert rec.calls == [
        (1.0, "stop_island", "a"),
        (2.0, "set_slow", "a", 0.1),
        (2.5, "set_slow", "a", 0.3),
        (3.5, "set_slow", "a", 0.0),
        (4.0, "cont_island", "a"),  # only when the last stall ends
    ]
    # The inner stall's apply and revert made no call: the island was already stopped.
    inner = [r for r in inj.log if r["event"] == 1]
    assert [r["calls"] for r in inner] == [[], []]


def test_stop_reverts_active_faults_and_skips_pending():
    clock = FakeClock()
    rec = Recorder(clock)
    s = Schedule(
        (
            Event(at_s=1.0, kind="stall", target="a", duration_s=100.0),
            Event(at_s=1.0, kind="net_delay", target="b", duration_s=100.0, delay_s=0.3),
            Event(at_s=1.5, kind="slow", target="c", duration_s=100.0, extra_s=1.0),
            Event(at_s=2.0, kind="kill_coordinator", target=COORDINATOR, duration_s=100.0),
            Event(at_s=50.0, kind="kill_rank", target="a", rank=0),
        )
    )
    inj = Injector(s, rec, clock=clock).start(background=False)
    run_to(inj, clock, [3.0])
    assert len(inj.active) == 4
    rec.calls.clear()
    clock.t = 103.5
    inj.stop()
    assert sorted(c[1:] for c in rec.calls) == sorted(
        [
            ("restart_coordinator",),
            ("set_slow", "c", 0.0),
            ("set_net", "b", 0.0, False),
            ("cont_island", "a"),
        ]
    )
    assert rec.calls[0][1] == "restart_coordinator"  # last applied, first reverted
    assert inj.active == () and inj.pending == 0
    stops = [r for r in inj.log if r["reason"] == "stop"]
    assert len(stops) == 4 and all(r["t_s"] == 3.5 for r in stops)
    run_to(inj, clock, [60.0])  # stopped: the kill never happens
    inj.stop()  # idempotent
    assert len(rec.calls) == 4


def test_failing_target_call_is_logged_and_chaos_goes_on():
    clock = FakeClock()
    rec = Recorder(clock, fail=("kill_rank",))
    s = Schedule(
        (
            Event(at_s=1.0, kind="kill_rank", target="a", rank=0),
            Event(at_s=2.0, kind="net_drop", target="a", duration_s=1.0),
        )
    )
    inj = Injector(s, rec, clock=clock).start(background=False)
    run_to(inj, clock, [1.0, 2.0, 3.0])
    log = inj.log
    assert not log[0]["ok"] and "OSError: kill_rank failed" in log[0]["error"]
    assert [r["ok"] for r in log[1:]] == [True, True]
    assert [c[1] for c in rec.calls] == ["kill_rank", "set_net", "set_net"]


def test_a_fault_over_one_that_failed_is_applied_not_taken_as_in_effect():
    # A stall that found no live rank (the island restarting) failed; a stall of the same
    # island while the first was due made no call ("already in effect") and was logged as
    # injected: the island never stopped, and the report counted it.
    clock = FakeClock()
    rec = Recorder(clock, fail=("stop_island",))
    s = Schedule(
        (
            Event(at_s=1.0, kind="stall", target="a", duration_s=5.0),
            Event(at_s=2.0, kind="stall", target="a", duration_s=1.0),
        )
    )
    inj = Injector(s, rec, clock=clock).start(background=False)
    run_to(inj, clock, [1.0])
    rec.fail = ()  # the island is back
    run_to(inj, clock, [2.0, 3.0, 6.0])
    log = inj.log
    assert [(r["action"], r["event"], r["ok"]) for r in log] == [
        ("apply", 0, False), ("apply", 1, True), ("revert", 1, True), ("revert", 0, True)
    ]  # fmt: skip
    assert [c[1:] for c in rec.calls] == [
        ("stop_island", "a"), ("stop_island", "a"), ("cont_island", "a")
    ]  # fmt: skip
    assert log[1]["calls"] == ["stop_island('a')"]


def test_injector_thread_on_the_real_clock():
    rec = Recorder(time.monotonic)
    s = Schedule(
        (
            Event(at_s=0.05, kind="stall", target="a", duration_s=0.1),
            Event(at_s=0.1, kind="kill_rank", target="b", rank=0),
            Event(at_s=0.2, kind="net_drop", target="b", duration_s=30.0),
        )
    )
    t0 = time.monotonic()
    inj = Injector(s, rec, max_wait_s=0.05).start()
    deadline = time.monotonic() + 5.0
    while len(rec.calls) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c[1] for c in rec.calls] == ["stop_island", "kill_rank", "cont_island", "set_net"]
    assert not inj.wait(0)  # the drop's revert is 30 s away
    inj.stop()
    assert inj.wait(0)
    assert rec.calls[-1][1:] == ("set_net", "b", 0.0, False)
    log = inj.log
    # Each action ran at (not before, and not long after) its time.
    for r in log[:4]:
        assert r["at_s"] <= r["t_s"] < r["at_s"] + 1.0
    assert time.monotonic() - t0 < 3.0
    assert not inj._thread.is_alive()
