"""Goodput, uptime and the Prometheus text of the coordinator's status."""

from __future__ import annotations

import re

import pytest

from ds_diloco.metrics import IslandTime, RunMetrics, goodput, process_stats, prometheus_text

LINE = re.compile(
    r'^(ds_diloco|process)_[a-z_]+(\{([a-z_]+="(?:[^"\\]|\\.)*",?)+\})? -?[0-9.e+-]+$'
)


def test_goodput_is_merged_step_time_over_allocated_time():
    islands = [  # a: 40 steps merged over P=4 fragments = 10 steps of 0.5 s in 10 s allocated
        IslandTime("a", steps_merged=40, step_time_s=0.5, joined_at=0.0),
        IslandTime("b", steps_merged=0, step_time_s=None, joined_at=5.0),  # nothing merged yet
        IslandTime("c", steps_merged=8, step_time_s=1.0, joined_at=0.0, left_at=4.0),
    ]
    # good: a 5 s, b 0, c 2 s; allocated: a 10, b 5, c 4 (it left at 4 s).
    assert goodput(islands, num_fragments=4, now=10.0) == pytest.approx(7 / 19)
    assert goodput([], num_fragments=4, now=10.0) is None


def test_uptime_counts_windows_with_a_merge_and_survives_a_restart():
    m = RunMetrics(window_s=10.0)
    m.start(100.0)
    assert m.uptime(105.0) is None  # the first window is still open and has no merge
    m.merge(101.0, contributors=2, staleness=[0, 1])
    m.merge(102.0, contributors=1, staleness=[0])  # same window: counted once
    m.merge(125.0, contributors=1, staleness=[0])  # window 2; window 1 had none
    assert m.uptime(129.0) == pytest.approx(2 / 3)
    again = RunMetrics.from_dict(m.to_dict(), window_s=10.0)
    assert again.uptime(129.0) == pytest.approx(2 / 3)
    # Restarted with another window: the counts stay in theirs (in 60 s windows: 1.0).
    other = RunMetrics.from_dict(m.to_dict(), window_s=60.0)
    assert other.window_s == 10.0 and other.uptime(129.0) == pytest.approx(2 / 3)
    assert RunMetrics.from_dict(None, window_s=60.0).window_s == 60.0  # a new run's
    assert again.by_quorum == {2: 1, 1: 2} and again.by_staleness == {0: 3, 1: 1}
    with pytest.raises(ValueError, match="window"):
        RunMetrics(window_s=0)


def test_prometheus_text_is_well_formed_and_carries_the_figures():
    status = {
        "versions": [3, 5],
        "merges": [3, 5],
        "merge_failures": [0, 2],
        "islands": {
            'is"land': {"live": True, "registrations": 2, "last_step": 40, "step_time_s": 0.25,
                        "merged": 7, "dropped": 1, "tokens_merged": 700, "steps_merged": 30},
            "b": {"live": False, "registrations": 1, "last_step": 9, "step_time_s": None,
                  "merged": 0, "dropped": 0, "tokens_merged": 0, "steps_merged": 0},
        },
        "run": {"goodput": 0.75, "uptime": 1.0, "by_quorum": {1: 4, 2: 4},
                "by_staleness": {0: 10}},
        "last_merge": {"1": {"pseudo_gradient_norm": 0.5}},
        "traffic": {"upload_bytes": 1000, "download_bytes": 2500, "unchanged_bytes": 4096},
    }  # fmt: skip
    text = prometheus_text(status)
    samples = [ln for ln in text.splitlines() if not ln.startswith("#")]
    bad = [ln for ln in samples if not LINE.match(ln)]
    assert not bad, bad
    assert 'ds_diloco_fragment_version{fragment="1"} 5' in samples
    assert 'ds_diloco_fragment_merge_failures_total{fragment="1"} 2' in samples
    assert 'ds_diloco_island_registrations_total{island="is\\"land"} 2' in samples
    assert "ds_diloco_goodput 0.75" in samples and "ds_diloco_live_islands 1" in samples
    assert 'ds_diloco_merges_by_quorum_total{contributors="2"} 4' in samples
    assert not any(ln.startswith('ds_diloco_island_step_seconds{island="b"}') for ln in samples)
    assert text.count("# TYPE ds_diloco_goodput gauge") == 1
    # Not "(stale)" alone: a contribution replaced, refused or left pending counts too.
    assert ("# HELP ds_diloco_island_contributions_dropped_total Contributions never merged: "
            "stale, replaced by a newer one, over the norm guard, or pending when the island "
            "left, registered again or lost its lease.") in text.splitlines()  # fmt: skip
    assert 'ds_diloco_fragment_pseudo_gradient_norm{fragment="1"} 0.5' in samples
    assert not any('pseudo_gradient_norm{fragment="0"}' in ln for ln in samples)  # no merge
    assert "ds_diloco_upload_bytes_total 1000" in samples
    assert "ds_diloco_download_bytes_total 2500" in samples
    assert "ds_diloco_download_unchanged_bytes_total 4096" in samples


def test_the_process_metrics_are_prometheus_process_collectors_and_this_processs_own():
    import resource

    import psutil

    me = psutil.Process()
    before = sum(me.cpu_times()[:2])  # user + system, as Prometheus's collector counts
    stats = process_stats()
    after = sum(me.cpu_times()[:2])
    # Checked against this process's own figures: "> 0" alone let user - system through,
    # and the hard limit of descriptors for the soft one.
    assert before <= stats["cpu_seconds_total"] <= after, (before, stats, after)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert stats.get("max_fds") == (None if soft == resource.RLIM_INFINITY else soft), stats
    # A soft limit under the hard one (RLIM_INFINITY is -1 here: not a bound).
    lower = min(v for v in (soft, hard, 4096) if v != resource.RLIM_INFINITY) - 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (lower, hard))
    try:
        assert process_stats()["max_fds"] == lower
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert 0.5 < stats["resident_memory_bytes"] / me.memory_info().rss < 2, stats
    assert stats["virtual_memory_bytes"] >= stats["resident_memory_bytes"], stats
    assert stats["cpu_seconds_total"] > 0 and stats["open_fds"] >= 3, stats
    assert abs(stats["start_time_seconds"] - me.create_time()) < 1, stats
    status = {"versions": [], "merges": [], "islands": {}}
    text = prometheus_text(status, {**stats, "resident_memory_bytes": 123456789})
    samples = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert not [ln for ln in samples if not LINE.match(ln)], samples
    assert "process_resident_memory_bytes 123456789" in samples
    assert "# TYPE process_cpu_seconds_total counter" in text
    assert "# TYPE process_open_fds gauge" in text
    assert not any(ln.startswith("process_") for ln in prometheus_text(status).splitlines())
