"""Run metrics: goodput, uptime, quorum sizes and staleness; Prometheus text at ``/metrics``.

Goodput is the share of allocated island time spent on inner steps whose
pseudo-gradients ended up in a merge. Every step trains all P fragments; for
fragment p it counts once p's contribution holding it is merged (the
contribution's ``steps`` counter), so an island's good time is
``steps_merged / P * step_time``. Allocated time runs from an island's first
registration to now (or until it leaves; from a leave to its next registration is not
allocated), crashes, restarts, stalls and waits included. Steps lost to a crash, stale
drops, and the tau steps between a fragment's send and its overwrite are not goodput.

Uptime is the share of wall-time windows (``window_s``) since the first island
joined in which some fragment advanced.

``/metrics`` also carries the coordinator process's own memory, CPU time and file
descriptors under the names Prometheus's process collector gives them
(``process_resident_memory_bytes``, ...), which dashboards and alerts already know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
from collections import Counter
from typing import Any

import psutil  # DeepSpeed's dependency too


@dataclasses.dataclass
class IslandTime:
    """What goodput needs of one island."""

    name: str
    steps_merged: int
    step_time_s: float | None
    joined_at: float
    left_at: float | None = None

    def allocated_s(self, now: float) -> float:
        return max(0.0, (self.left_at if self.left_at is not None else now) - self.joined_at)

    def good_s(self, num_fragments: int) -> float:
        return self.steps_merged / num_fragments * (self.step_time_s or 0.0)


def goodput(islands: list[IslandTime], num_fragments: int, now: float) -> float | None:
    """Good island-seconds over allocated island-seconds (None before any allocation)."""
    allocated = sum(i.allocated_s(now) for i in islands)
    if allocated <= 0:
        return None
    return min(1.0, sum(i.good_s(num_fragments) for i in islands) / allocated)


class RunMetrics:
    """Counters the coordinator keeps across merges (and restarts: ``to_dict``)."""

    def __init__(self, window_s: float = 10.0):
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"uptime window must be > 0 seconds, got {window_s}")
        self.window_s = window_s
        self.started_at: float | None = None  # wall time the first island joined
        self.windows_advanced = 0
        self.last_window: int | None = None
        self.by_quorum: Counter[int] = Counter()
        self.by_staleness: Counter[int] = Counter()

    def start(self, now_wall: float) -> None:
        if self.started_at is None:
            self.started_at = now_wall

    def merge(self, now_wall: float, contributors: int, staleness: list[int]) -> None:
        self.start(now_wall)
        window = int((now_wall - self.started_at) // self.window_s)
        if window != self.last_window:
            self.windows_advanced += 1
            self.last_window = window
        self.by_quorum[contributors] += 1
        self.by_staleness.update(staleness)

    def uptime(self, now_wall: float) -> float | None:
        """Share of windows with a merge; the current window counts only once it has one."""
        if self.started_at is None:
            return None
        current = int((now_wall - self.started_at) // self.window_s)
        elapsed = current + (1 if self.last_window == current else 0)
        if elapsed <= 0:
            return None
        return min(1.0, self.windows_advanced / elapsed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "started_at": self.started_at,
            "windows_advanced": self.windows_advanced,
            "last_window": self.last_window,
            "by_quorum": {str(k): v for k, v in self.by_quorum.items()},
            "by_staleness": {str(k): v for k, v in self.by_staleness.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, window_s: float) -> RunMetrics:
        """The saved counters (None: a new run's, in windows of ``window_s``). They keep the
        windows they were counted in: read in other ones, an uptime of 0.5 in 10 s windows
        was 1.0 in 60 s windows."""
        m = cls(d.get("window_s", window_s) if d else window_s)
        if d:
            m.started_at = d.get("started_at")
            m.windows_advanced = int(d.get("windows_advanced", 0))
            m.last_window = d.get("last_window")
            m.by_quorum = Counter({int(k): v for k, v in d.get("by_quorum", {}).items()})
            m.by_staleness = Counter({int(k): v for k, v in d.get("by_staleness", {}).items()})
        return m


PROCESS_METRICS = {  # name (after process_) -> (kind, help)
    "resident_memory_bytes": ("gauge", "Resident memory size in bytes."),
    "virtual_memory_bytes": ("gauge", "Virtual memory size in bytes."),
    "cpu_seconds_total": ("counter", "Total user and system CPU time spent in seconds."),
    "open_fds": ("gauge", "Number of open file descriptors."),
    "max_fds": ("gauge", "Maximum number of open file descriptors."),
    "start_time_seconds": ("gauge", "Start time of the process since unix epoch in seconds."),
}
"""Prometheus's process collector's metrics (its client libraries export them by default)."""


def process_stats() -> dict[str, float]:
    """This process's ``PROCESS_METRICS`` (those the platform has)."""
    p = psutil.Process()
    with p.oneshot():
        mem, cpu = p.memory_info(), p.cpu_times()
        out = {"resident_memory_bytes": mem.rss, "virtual_memory_bytes": mem.vms,
               "cpu_seconds_total": cpu.user + cpu.system, "start_time_seconds": p.create_time()}  # fmt: skip
        with contextlib.suppress(AttributeError, psutil.Error):  # no descriptors on Windows
            out["open_fds"] = p.num_fds()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        out["max_fds"] = soft
    return out


def prometheus_text(status: dict[str, Any], process: dict[str, float] | None = None) -> str:
    """The coordinator's status (``Coordinator.status()``) in Prometheus text format 0.0.4,
    and its ``process_stats()``, if given."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples, prefix: str = "ds_diloco_") -> None:
        lines.append(f"# HELP {prefix}{name} {help_}")
        lines.append(f"# TYPE {prefix}{name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{prefix}{name}{{{lab}}} {float(value):.10g}" if lab
                         else f"{prefix}{name} {float(value):.10g}")  # fmt: skip

    frags = range(len(status["versions"]))
    metric("fragment_version", "gauge", "Global version of each fragment.",
           [({"fragment": i}, status["versions"][i]) for i in frags])  # fmt: skip
    metric("fragment_merges_total", "counter", "Merges of each fragment.",
           [({"fragment": i}, status["merges"][i]) for i in frags])  # fmt: skip
    failures = status.get("merge_failures", [])
    metric("fragment_merge_failures_total", "counter",
           "Merges of each fragment that failed and changed nothing (contributions kept).",
           [({"fragment": i}, failures[i]) for i in frags if i < len(failures)])  # fmt: skip
    last = status.get("last_merge", {})
    metric("fragment_pseudo_gradient_norm", "gauge",
           "L2 norm of the pseudo-gradient the fragment's last merge applied.",
           [({"fragment": i}, last.get(str(i), {}).get("pseudo_gradient_norm")) for i in frags])  # fmt: skip
    isl = status["islands"]
    per_island = [
        ("island_live", "gauge", "1 if the island counts for quorums: a live lease, not finishing.", lambda v: int(v["live"])),
        ("island_registrations_total", "counter", "Registrations (restarts + 1).",
         lambda v: v["registrations"]),
        ("island_last_step", "gauge", "Last inner step the island reported.",
         lambda v: v["last_step"]),
        ("island_step_seconds", "gauge", "EMA of the island's inner step time.",
         lambda v: v["step_time_s"]),
        ("island_contributions_merged_total", "counter", "Contributions merged.",
         lambda v: v["merged"]),
        ("island_contributions_dropped_total", "counter", "Contributions never merged: stale, "
         "replaced by a newer one, over the norm guard, or pending when the island left, "
         "registered again or lost its lease.", lambda v: v["dropped"]),
        ("island_tokens_merged_total", "counter", "Tokens in merged contributions, all fragments.",
         lambda v: v["tokens_merged"]),
        ("island_steps_merged_total", "counter", "Inner steps in merged contributions, summed "
         "over fragments.", lambda v: v["steps_merged"]),
    ]  # fmt: skip
    for name, kind, help_, get in per_island:
        metric(name, kind, help_, [({"island": k}, get(v)) for k, v in sorted(isl.items())])
    run = status.get("run", {})
    metric("merges_by_quorum_total", "counter", "Merges by number of counted contributions.",
           [({"contributors": k}, v) for k, v in sorted(run.get("by_quorum", {}).items())])  # fmt: skip
    metric("contributions_by_staleness_total", "counter",
           "Merged contributions by staleness (versions behind).",
           [({"staleness": k}, v) for k, v in sorted(run.get("by_staleness", {}).items())])  # fmt: skip
    metric("goodput", "gauge", "Share of allocated island time spent on steps that were merged.",
           [({}, run.get("goodput"))])  # fmt: skip
    metric("uptime", "gauge", "Share of wall-time windows in which some fragment advanced.",
           [({}, run.get("uptime"))])  # fmt: skip
    traffic = status.get("traffic", {})
    metric("upload_bytes_total", "counter", "Upload bodies taken in (accepted or not).",
           [({}, traffic.get("upload_bytes"))])  # fmt: skip
    metric("download_bytes_total", "counter", "Download bodies served.",
           [({}, traffic.get("download_bytes"))])  # fmt: skip
    metric("download_unchanged_bytes_total", "counter",
           "Bytes of frozen slices downloads left out: unchanged since the island's version.",
           [({}, traffic.get("unchanged_bytes"))])  # fmt: skip
    buffers = status.get("buffers", {})
    metric("fragment_buffer_bytes", "gauge",
           "Memory in fragment-sized buffers: served values, contributions' rows, merges' "
           "work; as many as were in use at once lately.", [({}, buffers.get("bytes"))])  # fmt: skip
    metric("fragment_buffers_in_use", "gauge", "Fragment-sized buffers in use now.",
           [({}, buffers.get("in_use"))])  # fmt: skip
    metric("live_islands", "gauge",
           "Islands holding a live lease and still training (not those whose final flush came).",
           [({}, sum(1 for v in isl.values() if v["live"]))])  # fmt: skip
    for name, value in (process or {}).items():
        kind, help_ = PROCESS_METRICS[name]
        metric(name, kind, help_, [({}, value)], prefix="process_")
    return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
