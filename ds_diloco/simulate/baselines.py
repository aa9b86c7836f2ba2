"""The two data-parallel baselines: one synchronous job over every healthy slice.

Both walk the failure trace event by event (failures, repaired slices coming
back, the end of a pause); steps between events are counted, not simulated, so
a week at 2.4M chips takes a fraction of a second. A step lasts the slowest
chip's time (``trace.mean_step_s``) but counts as goodput at one chip's mean.

- Restart on failure: the job checkpoints every k steps, each checkpoint
  stalling it ``checkpoint_s`` (k from Young's formula unless set). On a
  failure it stops, detects, restarts on the healthy slices from its last
  completed checkpoint (losing the steps since, and a checkpoint being
  written); failures during the restart are handled by the same restart
  (the new job is formed without them); repaired slices join at the next
  restart.
- Elastic: the job loses the step in flight, pauses to detect and downscale,
  and continues without the slice; a repaired slice joins at the next step
  boundary with an upscale pause. Failures and returns during a pause are
  handled by that pause.
"""

from __future__ import annotations

import math
from collections import deque

from ds_diloco.simulate.config import SimConfig
from ds_diloco.simulate.result import CHIP_TIME, SystemResult
from ds_diloco.simulate.trace import Trace, mean_step_s

IN, AWAY, BACK = 0, 1, 2  # slice is in the job / away for repair / repaired, not yet rejoined
_EPS = 1e-9  # a step boundary that lands exactly on an event counts as done


class _Group:
    """One synchronous data-parallel job over the healthy slices."""

    def __init__(self, cfg: SimConfig, trace: Trace) -> None:
        self.cfg = cfg
        self.state = bytearray(cfg.slices)
        self.back: set[int] = set()
        self.returns: deque[tuple[float, int]] = deque(trace.away)  # equal repair times: FIFO
        for _, j in trace.away:
            self.state[j] = AWAY
        self.live = cfg.slices - len(trace.away)
        self.running = self.live > 0
        self.seg = 0.0  # start of the running segment, on a step boundary
        self.step = mean_step_s(cfg, self.live * cfg.chips_per_slice)
        self.pause_end = math.inf  # while paused; inf: no live slice, wait for one
        self.up = 0.0  # seconds
        self.spent = dict.fromkeys(CHIP_TIME, 0.0)  # chip-seconds by category
        self.t = 0.0  # time up to which "away" and "paused" are counted (tick)

    @property
    def chips(self) -> int:
        return self.live * self.cfg.chips_per_slice

    def tick(self, t: float) -> None:
        """Count [self.t, t] of the slices out of the job, and of the live ones if paused
        (running time is counted by ``end_segment``). Called before every change."""
        dt, S = t - self.t, self.cfg.chips_per_slice
        self.spent["away"] += (self.cfg.slices - self.live) * S * dt
        if not self.running:
            self.spent["paused"] += self.chips * dt
        self.t = t

    def steps_until(self, t: float) -> int:
        return math.floor((t - self.seg) / self.step + _EPS)

    def end_segment(self, t: float, steps: int, checkpoints: int = 0) -> None:
        """The running segment [seg, t] ends: ``steps`` of it are kept, after
        ``checkpoints`` checkpoints; the rest of its time is lost."""
        chips, mean, spent = self.chips, self.cfg.chip_step_s, self.spent
        spent["useful"] += steps * mean * chips
        spent["straggler"] += steps * (self.step - mean) * chips
        spent["checkpoint"] += checkpoints * self.cfg.checkpoint_s * chips
        spent["lost"] += (
            t - self.seg - steps * self.step - checkpoints * self.cfg.checkpoint_s
        ) * chips
        self.up += steps * self.step
        self.seg = t

    def fail(self, t: float, j: int) -> bool:
        """Slice ``j`` fails at ``t``; True if it was in the job (the caller reacts)."""
        s = self.state[j]
        if s == AWAY:
            return False  # not running, cannot fail again
        self.state[j] = AWAY
        self.returns.append((t + self.cfg.repair_s, j))
        if s == BACK:
            self.back.discard(j)
            return False
        return True

    def rejoin(self, t: float) -> None:
        """End of a pause: slices back from repair join, the job runs again."""
        for j in self.back:
            self.state[j] = IN
        self.live += len(self.back)
        self.back.clear()
        if self.live == 0:
            self.pause_end = math.inf
            return
        self.running = True
        self.seg = t
        self.step = mean_step_s(self.cfg, self.live * self.cfg.chips_per_slice)

    def result(self, system: str, failures: int, stats: dict) -> SystemResult:
        cfg = self.cfg
        self.tick(cfg.duration_s)
        total = cfg.used_chips * cfg.duration_s
        return SystemResult(
            system=system,
            chips=cfg.used_chips,
            islands=1,
            goodput=self.spent["useful"] / total,
            uptime=self.up / cfg.duration_s,
            failures=failures,
            stats=stats,
            chip_time={k: v / total for k, v in self.spent.items()},
        )


def _events(cfg: SimConfig, trace: Trace, g: _Group, next_action):
    """Yield (time, kind, slice) in time order until the horizon: kind is 'fail',
    'return' or 'action' (``next_action()`` gives the time of the system's own next event)."""
    times, slices = trace.times.tolist(), trace.slices.tolist()
    i, n, horizon = 0, len(times), cfg.duration_s
    while True:
        tf = times[i] if i < n else math.inf
        tr = g.returns[0][0] if g.returns else math.inf
        ta = next_action()
        t = min(tf, tr, ta)
        if t >= horizon:
            return
        if ta == t:
            yield t, "action", -1
        elif tf == t:
            i += 1
            yield t, "fail", slices[i - 1]
        else:
            yield t, "return", g.returns.popleft()[1]


def simulate_elastic(cfg: SimConfig, trace: Trace) -> SystemResult:
    g = _Group(cfg, trace)
    upscale_at = math.inf  # next step boundary once a repaired slice is back
    pauses = upscales = 0

    def next_action() -> float:
        return upscale_at if g.running else g.pause_end

    for t, kind, j in _events(cfg, trace, g, next_action):
        g.tick(t)
        if kind == "action":
            if g.running:  # upscale at a step boundary: no step lost
                g.end_segment(t, g.steps_until(t))
                g.running, g.pause_end, upscale_at = False, t + cfg.upscale_s, math.inf
                upscales += 1
            else:
                g.rejoin(t)
        elif kind == "fail":
            if g.fail(t, j):
                if g.running:  # the step in flight is lost
                    g.end_segment(t, g.steps_until(t))
                    g.running, upscale_at = False, math.inf
                    g.pause_end = t + cfg.detect_s + cfg.downscale_s
                    pauses += 1
                g.live -= 1
        else:
            g.state[j] = BACK
            g.back.add(j)
            if g.running and upscale_at == math.inf:
                upscale_at = g.seg + math.ceil((t - g.seg) / g.step - _EPS) * g.step
            elif not g.running and g.pause_end == math.inf:  # no slice was left
                g.pause_end = t + cfg.upscale_s
    if g.running:
        g.end_segment(cfg.duration_s, g.steps_until(cfg.duration_s))
    return g.result("elastic", len(trace), {"downscales": pauses, "upscales": upscales})


def checkpoint_every_steps(cfg: SimConfig, live_chips: int, step: float) -> int:
    """Data-parallel checkpoint interval, whole steps (at least one).

    ``cfg.checkpoint_every_s`` when set; else Young's optimum sqrt(2 x checkpoint cost x
    the job's mean time between failures) (J. W. Young, CACM 17(9), 1974), what an
    operator picks for a job of this size: a checkpoint every C seconds costs
    checkpoint_s / C of the time, a failure loses C / 2 on average. Free checkpoints
    are taken every step; without failures, costly ones only at the end of the run.
    """
    if cfg.checkpoint_every_s > 0:
        every = cfg.checkpoint_every_s
    elif cfg.checkpoint_s == 0:
        every = 0.0  # free: every step
    else:
        mtbf = cfg.chip_mtbi_s / max(live_chips, 1)
        every = math.sqrt(2 * cfg.checkpoint_s * mtbf)
    every = min(every, cfg.duration_s)  # inf (no failures): never before the end
    return max(1, round(every / step))


def simulate_dp(cfg: SimConfig, trace: Trace) -> SystemResult:
    g = _Group(cfg, trace)
    restarts = rolled_back = 0

    def plan() -> tuple[int, float]:  # (steps per checkpoint, seconds per checkpoint period)
        k = checkpoint_every_steps(cfg, g.live * cfg.chips_per_slice, g.step)
        return k, k * g.step + cfg.checkpoint_s

    def done(t: float) -> tuple[int, int]:
        """(checkpoints completed, steps after the last) since ``g.seg``."""
        e = t - g.seg
        periods = math.floor(e / period + _EPS)
        rest = e - periods * period  # a checkpoint still being written is not saved
        return periods, min(k, math.floor(rest / g.step + _EPS))

    k, period = plan()
    for t, kind, j in _events(cfg, trace, g, lambda: math.inf if g.running else g.pause_end):
        g.tick(t)
        if kind == "action":
            g.rejoin(t)
            k, period = plan()
        elif kind == "fail":
            if g.fail(t, j):
                if g.running:  # back to the last checkpoint
                    saved, lost = done(t)
                    g.end_segment(t, saved * k, saved)
                    rolled_back += lost
                    g.running = False
                    g.pause_end = t + cfg.detect_s + cfg.restart_s
                    restarts += 1
                g.live -= 1
        else:
            g.state[j] = BACK  # joins at the next restart
            g.back.add(j)
            if not g.running and g.pause_end == math.inf:
                g.pause_end = t + cfg.restart_s
    if g.running:  # the run ends with a checkpoint (its time is after the end)
        saved, after = done(cfg.duration_s)
        g.end_segment(cfg.duration_s, saved * k + after, saved)
    stats = {"restarts": restarts, "rolled_back_steps": rolled_back, "checkpoint_every": k}
    return g.result("dp", len(trace), stats)
