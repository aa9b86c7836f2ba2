"""``ds-diloco bench island``: one island's step time and memory against plain ZeRO-3.

The same island job runs in two modes, each a fresh launch through the deepspeed
launcher (``ds-diloco island [--plain]``), with the same model, data, DeepSpeed
config and training settings:

- ``plain``: DeepSpeed ZeRO-3 alone (``run_island(plain=True)``: the same loop,
  no coordinator, no syncer);
- ``ds_diloco``: the same loop with the syncer, against a coordinator started
  as its own process for every launch (fresh state: every launch starts from
  the same global model).

Launches alternate (plain, ds_diloco, plain, ...) ``repeats`` times. From each
rank's summary: its per-step times (whole steps, sync work included) after the
first ``warmup`` steps, its peak RSS (``ru_maxrss``) and the fp32 size of its own
shard. The island's step time is, per step, the slowest rank's (the ranks meet
in every step's collectives), then the median over steps. Medians over launches
are compared:

- step time ratio ds_diloco / plain, goal <= 1.02;
- peak RSS ds_diloco - plain, goal: at most one fp32 copy of the rank's own
  shard (island-wide: of all the island's shards, i.e. one fp32 model).

On this machine the same plain launch's median step moves by 5-20 % from launch to
launch (450-560 ms within one run), more than the goal. ``paired`` launches (``--paired``,
after the timed ones) put both sides in one launch: the learner steps only in every other
block of ``--paired-blocks`` inner steps, and the blocks between run the plain ZeRO-3
loop (nothing sent or applied; the syncer's threads wait idle). Every other paired launch
starts with a syncer-off block: a launch's first timed steps are slower in plain launches
too (its own warm-up: about 4 ms a step over steps 4-10 here), and with the syncer always
on first they weighed on its side alone; the report gives both orders' medians apart,
the syncer's own start-up (first sends, merges, applies) stays in its first on-block
whichever comes first. Each block's first tau + 1
steps are dropped on both sides (the other side's downloads, merges and catch-up applies
still running), then the island's median step in the syncer-on blocks is divided by the
median in the off blocks, per launch. The process is the same on both sides (the base
copy is held throughout), so this measures time, not memory. It takes out the drift
between launches, not bursts within one: the first run (3 + 3 launches) gave 1.069, 0.731
and 1.033 (median 1.033) while the separate launches gave 1.100.

Memory is judged on launches of their own (``memory_repeats``, after the timed
ones), run with ``EXACT_MEMORY_ENV``: with glibc's default, a rank's peak RSS
moves by 20-60 MB between launches of the same plain job (freed tensors stay
resident for reuse, by timing), far more than a small model's shard; with the
allocator's mmap threshold fixed, it is the peak of the live memory, the same
within 1-2 MB from launch to launch. Those launches also give each rank's
resident memory before the first step (the syncer's base copy is in it) and
after every step (what the sends and applies hold), so the extra can be told
apart: the base copy, and what is in flight. Each reading also gives the anonymous part
(the rank's own data: heap, stacks, tensors): the code pages of shared libraries that
only the syncer runs are in every rank's ``ru_maxrss`` though a host holds them once.
The anonymous extra is shown beside; the verdict stays on ``ru_maxrss``.

Where the overhead goes: the syncer's work inside the step (``sync_s``), of it
the ranks' agreement collective (``stats.agree_s``), the training part's
slowdown, and the CPU time the coordinator process used during the job (read
from ``/proc/<pid>/stat`` before it is stopped). In production the coordinator
runs on another host; on a small machine it competes with the ranks for the
same cores. It is started at nice ``coordinator_nice`` (default +10, the
syncer's transport threads' own offset), the nearest stand-in for a host of its
own that one machine offers: it still takes the cores whenever the ranks leave
them (collective waits) and its CPU time is reported; ``--coordinator-nice 0``
measures it co-located at the ranks' priority.

What the extra time is, from the training thread's /proc schedstat in two launches
(tiny Llama on 2 cores, plain 305 ms a step): of ds_diloco's +24 ms, +8 ms were its
own CPU (the sync part and more), +7 ms waiting for a core while runnable (the
coordinator and the transport threads had it), +9 ms blocked in collectives on the
peer rank, held up the same way. Tried, none beyond the launch-to-launch noise (1-2 %):
the coordinator at nice +19, the transport threads at SCHED_IDLE, a 0.5 ms GIL switch
interval in the ranks, the coordinator without durable merges (0.85 ms CPU a merge).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds_diloco.bench import shown
from ds_diloco.config import (
    CoordinatorConfig,
    DataConfig,
    IslandSpec,
    ModelSource,
    RunConfig,
    TrainConfig,
    learner_steps_at,
    load_run_config,
)
from ds_diloco.merge import StalenessPolicy
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.run import LocalRun, plain_dict

STEP_GOAL = 1.02
"""ds_diloco's island step time may be at most this many times plain ZeRO-3's."""

WARMUP_STEPS = 5
"""Steps dropped at the start of every launch (first-step tracing, allocations)."""

DEFAULT_STEPS = 60
COORDINATOR_NICE = 10
"""The coordinator's nice offset here (see the module docstring): it stands in for a host of its own."""
MODES = ("plain", "ds_diloco")
PAIRED = "paired"
"""A ds_diloco launch whose learner steps only in every other block of inner steps
(``train.sync_blocks``): both sides of the comparison in one launch, step by step."""
PAIRED_BLOCK_STEPS = 10
"""``--paired``: inner steps per block; blocks alternate, syncer on and off (every other
launch starts with the off one)."""
EXACT_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc: every allocation of 128 KiB or more is a mapping of its own, returned to the
system when freed. By default the threshold adapts upwards (to 32 MiB) and freed
blocks stay resident in the heap for reuse, so a rank's peak RSS (about 900 MB here)
varies by 20-60 MB between launches of the same job: more than the fp32 shard the
memory goal is about. With the threshold fixed, peak RSS is the peak of the live
memory, within 1-2 MB from launch to launch; steps are slower (page faults), so these
launches are for memory only."""
REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------- workload
def default_run_config(steps: int = DEFAULT_STEPS, workdir: str = "runs/bench-island") -> RunConfig:
    """The tiny Llama, ZeRO-3 on CPU, one island of 2 ranks, coordinator as in launch/demo.yaml.

    Data: the Shakespeare corpus in .cache/corpus (launch/get_corpus.sh) if it is
    there, else the sonnets in tests/data.
    """
    corpus = REPO / ".cache" / "corpus"
    if not any(corpus.rglob("*.txt")):
        corpus = REPO / "tests" / "data"
    model = ModelSource(config=str(REPO / "model_configs" / "tiny-llama.json"), seed=0)
    return RunConfig(
        model=model,
        deepspeed_config=str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        data=DataConfig(
            path=str(corpus),
            vocab_size=4096,
            seq_len=128,
            cache_dir=str(REPO / ".cache" / "ds_diloco"),
        ),
        train=TrainConfig(steps=steps, micro_batch=4, lr=0.002, warmup_steps=10, log_every=10),
        islands=(IslandSpec(name="island", world_size=2),),
        coordinator=CoordinatorConfig(
            model=model,
            state_dir=str(Path(workdir) / "state"),
            num_fragments=8,  # P
            sync_every=8,  # H: one fragment every H/P = 1 inner step
            outer=OuterOptimConfig(name="nesterov", lr=0.7, momentum=0.9),
            policy=PolicyOptions(min_quorum=1, grace_gamma=0.5, tau=2),
            staleness=StalenessPolicy(mode="drop"),
        ),
        workdir=workdir,
        export=False,
    )


def one_island(cfg: RunConfig, steps: int | None = None) -> RunConfig:
    """``cfg`` cut to its first island (plain ZeRO-3 runs one job), with that island's
    ``train`` as the run's, ``steps`` if given."""
    first = cfg.islands[0]
    train = cfg.train_of(first)
    train = train if steps is None else dataclasses.replace(train, steps=steps)
    island = dataclasses.replace(first, train=None)
    return dataclasses.replace(cfg, islands=(island,), train=train, export=False)


# ------------------------------------------------------------------ launches
@dataclasses.dataclass
class Launch:
    """One fresh launch of the island in one mode, and what its ranks reported."""

    mode: str
    repeat: int
    ranks: list[dict]
    """The ranks' ``summary-rank<r>.json``, by rank."""
    warmup: int
    """Steps dropped at the start."""
    launch_s: float
    """From starting the launcher until it exited (imports, engine build, loop, evals)."""
    coordinator_versions: list[int] | None = None
    """The coordinator's fragment versions at the end (ds_diloco only)."""
    island_cpu_s: float | None = None
    """CPU seconds (user + system) of the launcher and the ranks, the whole launch."""
    coordinator_cpu_s: float | None = None
    """CPU seconds (user + system) the coordinator used while the island ran."""
    exact_memory: bool = False
    """A memory launch (``EXACT_MEMORY_ENV``): its memory figures count, not its times."""
    blocks: int = 0
    """A paired launch: inner steps per block (syncer on, off, on, ...; off first where
    ``off_first``)."""
    settle: int = 0
    """A paired launch: steps dropped at the start of every block (the other side's
    background work still running: downloads and merges of the last sends)."""
    off_first: bool = False
    """A paired launch whose first block is the syncer-off one (every other paired launch:
    the launch's own warm-up then weighs on both sides alike)."""

    def block_step_s(self, on: bool) -> float:
        """A paired launch: median island step time in its syncer-on (or -off) blocks,
        after warm-up and each block's first ``settle`` steps."""
        times = self._island_times()
        picked = [
            t for i, t in enumerate(times)
            if i >= self.warmup and i % self.blocks >= self.settle
            and learner_steps_at(i + 1, self.blocks, self.off_first) == on
        ]  # fmt: skip
        return statistics.median(picked)

    def _island_times(self) -> list[float]:
        """Per step, the slowest rank's time (the ranks meet in every step's collectives:
        the slowest sets the pace), warm-up included."""
        return [max(s) for s in zip(*(r["step_times_s"] for r in self.ranks))]

    def summaries(self, rank: int) -> list[dict]:
        """One rank's summary, or (``rank`` -1) every rank's."""
        return self.ranks if rank < 0 else [self.ranks[rank]]

    def step_times(self, rank: int) -> list[float]:
        """Step times after warm-up: of one rank, or (``rank`` -1) per step the slowest rank's."""
        times = self._island_times() if rank < 0 else self.ranks[rank]["step_times_s"]
        return times[self.warmup :] if len(times) > self.warmup else times

    def step_s(self, rank: int = -1) -> float:
        """Median step time after warm-up (``rank`` -1: the island's)."""
        return statistics.median(self.step_times(rank))

    @property
    def island_step_s(self) -> float:
        return self.step_s(-1)

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "repeat": self.repeat,
            "launch_s": self.launch_s,
            "island_step_s": self.island_step_s,
            "island_step_mean_s": statistics.fmean(self.step_times(-1)),
            "rank_step_s": [self.step_s(r) for r in range(len(self.ranks))],
            "coordinator_versions": self.coordinator_versions,
            "island_cpu_s": self.island_cpu_s,
            "coordinator_cpu_s": self.coordinator_cpu_s,
            "exact_memory": self.exact_memory,
            "blocks": self.blocks,
            "settle": self.settle,
            "off_first": self.off_first,
            "ranks": self.ranks,
        }


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process, from /proc (None where unreadable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the name may hold spaces; fields from 3 on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's waited-for children (and theirs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _renice(pid: int, nice: int) -> None:
    """Lower process ``pid``'s CPU priority by ``nice``, as far as this kernel applies it.

    Linux keeps a nice value per thread, and with autogroup scheduling (a common
    default) it weighs only threads of the same session against each other:
    sessions share the cores by their group's own nice. The coordinator leads its
    own session, so both are raised: every thread's, and its group's.
    """
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [pid]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    group = Path(f"/proc/{pid}/autogroup")  # "/autogroup-N nice K"
    with contextlib.suppress(OSError, ValueError, IndexError):
        if os.getsid(pid) == pid:  # its own group: other processes are not touched
            group.write_text(str(min(19, int(group.read_text().split()[-1]) + nice)))


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


def launch(
    cfg: RunConfig,
    mode: str,
    workdir: Path,
    repeat: int = 0,
    warmup: int = WARMUP_STEPS,
    timeout_s: float | None = None,
    coordinator_nice: int = 0,
    exact_memory: bool = False,
    blocks: int = PAIRED_BLOCK_STEPS,
    off_first: bool = False,
) -> Launch:
    """Run ``cfg``'s first island once in ``mode`` (``plain``, ``ds_diloco`` or ``paired``:
    ds_diloco with the learner stepping in every other block of ``blocks`` steps), fresh.

    ``exact_memory``: the ranks run with ``EXACT_MEMORY_ENV`` (their resident memory
    follows their live memory; for the memory figures, not the timing).
    """
    if mode not in (*MODES, PAIRED):
        raise ValueError(f"mode must be one of {(*MODES, PAIRED)}, got {mode!r}")
    plain = mode == "plain"
    if mode == PAIRED:
        train = dataclasses.replace(cfg.train, sync_blocks=blocks, sync_blocks_off_first=off_first)
        cfg = dataclasses.replace(cfg, train=train)
    spec = cfg.islands[0]
    cfg = dataclasses.replace(
        cfg,
        workdir=str(workdir),
        coordinator=dataclasses.replace(cfg.coordinator, state_dir=str(workdir / "state")),
    )
    lr = LocalRun(cfg)
    if exact_memory:
        lr.env.update(EXACT_MEMORY_ENV)
    timeout_s = timeout_s or 300 + 10 * cfg.train.steps
    try:
        if not plain:  # plain: no coordinator, never contacted
            lr.spawn_coordinator()  # it starts up while the island does
        d = workdir / "islands" / spec.name
        # The launcher waits for the ranks, so once it is waited for, its children's CPU
        # counts here too; the coordinator is waited for only later, in lr.stop().
        children0 = _children_cpu_seconds()
        t0 = time.perf_counter()
        proc = lr.start_island(spec, 0, 1, plain=plain)
        if not plain:
            client = lr.wait_for_coordinator()
            if coordinator_nice:  # its threads run by now; the ones it starts later inherit
                _renice(lr.coordinator.pid, coordinator_nice)
        cpu0 = None if plain else _cpu_seconds(lr.coordinator.pid)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{mode} launch {repeat} did not finish in {timeout_s:.0f} s; log:\n"
                + _tail(d / "log.txt")
            ) from None
        launch_s = time.perf_counter() - t0
        island_cpu_s = _children_cpu_seconds() - children0
        versions = cpu_s = None
        if not plain:
            cpu1 = _cpu_seconds(lr.coordinator.pid)  # before stopping: it saves on SIGTERM
            cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
            versions = client.status()["versions"]
            client.close()
        paths = [d / f"summary-rank{r}.json" for r in range(spec.world_size)]
        if proc.returncode != 0 or not all(p.exists() for p in paths):
            raise RuntimeError(
                f"{mode} launch {repeat} failed (exit {proc.returncode}); log:\n"
                + _tail(d / "log.txt")
            )
        ranks = [json.loads(p.read_text()) for p in paths]
    finally:
        lr.stop()
    return Launch(
        mode=mode,
        repeat=repeat,
        ranks=ranks,
        warmup=warmup,
        launch_s=launch_s,
        island_cpu_s=island_cpu_s,
        coordinator_versions=versions,
        coordinator_cpu_s=cpu_s,
        exact_memory=exact_memory,
        blocks=blocks if mode == PAIRED else 0,
        settle=_settle(blocks, cfg) if mode == PAIRED else 0,
        off_first=off_first and mode == PAIRED,
    )


def _settle(blocks: int, cfg: RunConfig) -> int:
    """A paired launch's steps dropped at the start of each block: the syncer's work of
    the block before still lands in them (an apply comes tau steps after its send)."""
    return min(blocks - 1, cfg.coordinator.policy.tau + 1)


def _check_paired_steps(cfg: RunConfig, warmup: int, blocks: int) -> None:
    """Each paired launch (either block first) must time steps on both sides: else the
    report failed after every launch had run ("no median for empty data")."""
    steps, settle = cfg.train.steps, _settle(blocks, cfg)
    for off_first in (False, True):
        for on in (True, False):
            if not any(i >= warmup and i % blocks >= settle
                       and learner_steps_at(i + 1, blocks, off_first) == on
                       for i in range(steps)):  # fmt: skip
                raise ValueError(
                    f"--steps {steps} leaves a paired launch no timed step with the syncer "
                    f"{'on' if on else 'off'} (the first {warmup} steps are warm-up, the first "
                    f"{settle} of each {blocks}-step block settle): raise --steps or lower "
                    "--paired-blocks"
                )


# ------------------------------------------------------------------- results
@dataclasses.dataclass
class Side:
    """One mode's figures for a rank or the island: medians over launches."""

    step_s: float
    step_mean_s: float
    peak_rss_mb: float
    train_per_step_s: float
    """Mean time of a step's training part (forward, backward, optimizer), all steps."""
    sync_per_step_s: float
    """Mean time of a step's sync part (``syncer.on_step``), all steps."""
    agree_per_step_s: float
    """Of the sync part: the ranks' agreement collective."""
    transport_cpu_per_step_s: float = 0.0
    """CPU time of a rank's syncer transport threads (uploads, downloads) per step."""
    send_per_step_s: float = 0.0
    """Of the sync part: reading the local values of the fragments sent."""
    apply_per_step_s: float = 0.0
    """Of the sync part: writing merged fragments into the shard and dropping ZeRO-3's
    gathered copies."""


@dataclasses.dataclass
class Row:
    """A rank (``rank`` >= 0) or the whole island (``rank`` = -1): plain against ds_diloco."""

    rank: int
    plain: Side
    ds_diloco: Side
    shard_fp32_mb: float
    """fp32 MiB of the rank's own shard (the island: of all its ranks' shards)."""
    step_goal: float = STEP_GOAL

    @property
    def name(self) -> str:
        return "island" if self.rank < 0 else f"rank {self.rank}"

    @property
    def step_ratio(self) -> float:
        return self.ds_diloco.step_s / self.plain.step_s

    @property
    def rss_extra_mb(self) -> float:
        return self.ds_diloco.peak_rss_mb - self.plain.peak_rss_mb

    @property
    def step_met(self) -> bool:
        return self.step_ratio <= self.step_goal

    @property
    def rss_met(self) -> bool:
        return self.rss_extra_mb <= self.shard_fp32_mb

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "plain": dataclasses.asdict(self.plain),
            "ds_diloco": dataclasses.asdict(self.ds_diloco),
            "shard_fp32_mb": self.shard_fp32_mb,
            "step_ratio": self.step_ratio,
            "step_goal": self.step_goal,
            "step_met": self.step_met,
            "rss_extra_mb": self.rss_extra_mb,
            "rss_goal_mb": self.shard_fp32_mb,
            "rss_met": self.rss_met,
        }


def _listed(value) -> list:
    """A summary's reading as a list: per-step readings as they are, one reading alone."""
    return value if isinstance(value, list) else [value]


def _anon(extra_mb: float | None) -> str:
    return "" if extra_mb is None else f" (anonymous {extra_mb:+.1f} MB)"


@dataclasses.dataclass
class MemorySide:
    """One mode's resident memory in the memory launches, MiB (medians over launches)."""

    peak_rss_mb: float
    setup_rss_mb: float
    """Before the first step: engine, data and (ds_diloco) the syncer with its base copy."""
    step_rss_mb: float
    """After a step (median over the steps after warm-up)."""
    setup_anon_mb: float | None = None
    """Of ``setup_rss_mb``, the anonymous pages (None: not read). The rest is file-backed,
    mostly libraries' code: one copy per host, yet in every rank's ``ru_maxrss``."""
    step_anon_mb: float | None = None
    """Of ``step_rss_mb``, the anonymous pages (None: not read)."""


@dataclasses.dataclass
class MemoryRow:
    """A rank (``rank`` >= 0) or the island (-1): peak memory, plain against ds_diloco."""

    rank: int
    plain: MemorySide
    ds_diloco: MemorySide
    shard_fp32_mb: float
    base_copy_mb: float = 0.0
    """The syncer's base copy (``SyncStats.base_bytes``): the shard's trained slices in fp32."""

    @property
    def name(self) -> str:
        return "island" if self.rank < 0 else f"rank {self.rank}"

    def extra_mb(self, key: str = "peak_rss_mb") -> float:
        return getattr(self.ds_diloco, key) - getattr(self.plain, key)

    def anon_extra_mb(self, key: str = "setup_anon_mb") -> float | None:
        """ds_diloco's extra in anonymous pages (None: not read)."""
        a, b = getattr(self.ds_diloco, key), getattr(self.plain, key)
        return None if a is None or b is None else a - b

    @property
    def met(self) -> bool:
        return self.extra_mb() <= self.shard_fp32_mb

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "plain": dataclasses.asdict(self.plain),
            "ds_diloco": dataclasses.asdict(self.ds_diloco),
            "shard_fp32_mb": self.shard_fp32_mb,
            "base_copy_mb": self.base_copy_mb,
            "extra_mb": self.extra_mb(),
            "setup_extra_mb": self.extra_mb("setup_rss_mb"),
            "setup_anon_extra_mb": self.anon_extra_mb("setup_anon_mb"),
            "step_extra_mb": self.extra_mb("step_rss_mb"),
            "step_anon_extra_mb": self.anon_extra_mb("step_anon_mb"),
            "met": self.met,
        }


@dataclasses.dataclass
class IslandBench:
    """Every launch, in the order run, and the comparison rows they give."""

    launches: list[Launch]
    world_size: int
    steps: int
    warmup: int
    coordinator_nice: int = 0

    def of(self, mode: str) -> list[Launch]:
        """The timed launches of ``mode``."""
        return [x for x in self.launches if x.mode == mode and not x.exact_memory]

    def paired(self) -> dict | None:
        """The paired launches' figures (None if none ran): per launch, the island's median
        step with the syncer on and off in its blocks, their ratio; medians over launches."""
        runs = self.of(PAIRED)
        if not runs:
            return None
        on, off = [x.block_step_s(True) for x in runs], [x.block_step_s(False) for x in runs]
        ratios = [a / b for a, b in zip(on, off)]
        ratio = statistics.median(ratios)

        def by_order(off_first: bool) -> float | None:  # the order effect, shown apart
            picked = [r for r, x in zip(ratios, runs) if x.off_first == off_first]
            return statistics.median(picked) if picked else None

        return {
            "launches": len(runs),
            "blocks": runs[0].blocks,
            "settle": runs[0].settle,
            "on_s": statistics.median(on),
            "off_s": statistics.median(off),
            "ratio": ratio,
            "ratios": ratios,
            "off_first": [x.off_first for x in runs],
            "ratio_on_first": by_order(False),
            "ratio_off_first": by_order(True),
            "met": ratio <= STEP_GOAL,
        }

    def memory_of(self, mode: str) -> list[Launch]:
        """The memory launches of ``mode`` (``EXACT_MEMORY_ENV``)."""
        return [x for x in self.launches if x.mode == mode and x.exact_memory]

    def _memory_side(self, mode: str, rank: int) -> MemorySide:
        runs = self.memory_of(mode)

        def med(key: str, pick=lambda v: v) -> float:
            return statistics.median(sum(pick(r[key]) for r in x.summaries(rank)) for x in runs)

        def med_or_none(key: str, pick=lambda v: v) -> float | None:  # None: no /proc
            summaries = [r for x in runs for r in x.summaries(rank)]
            values = [v for r in summaries for v in _listed(r.get(key))]
            return None if not values or None in values else med(key, pick)

        def steady(values: list[float]) -> float:  # after warm-up, per step
            return statistics.median(values[self.warmup :] or values)

        return MemorySide(
            peak_rss_mb=med("peak_rss_mb"),
            setup_rss_mb=med("setup_rss_mb"),
            step_rss_mb=med("step_rss_mb", steady),
            setup_anon_mb=med_or_none("setup_anon_mb"),
            step_anon_mb=med_or_none("step_anon_mb", steady),
        )

    def memory_rows(self) -> list[MemoryRow]:
        """Rank by rank and the island, from the memory launches ([] if none ran)."""
        if not self.memory_of("plain") or not self.memory_of("ds_diloco"):
            return []
        first = self.memory_of("ds_diloco")[0].ranks
        shard = [r["shard_fp32_mb"] for r in first]
        base = [(r.get("stats") or {}).get("base_bytes", 0) / 2**20 for r in first]
        return [
            MemoryRow(
                rank=r,
                plain=self._memory_side("plain", r),
                ds_diloco=self._memory_side("ds_diloco", r),
                shard_fp32_mb=sum(shard) if r < 0 else shard[r],
                base_copy_mb=sum(base) if r < 0 else base[r],
            )
            for r in [*range(self.world_size), -1]
        ]

    def _side(self, mode: str, rank: int) -> Side:
        runs = self.of(mode)

        def med(f) -> float:
            return statistics.median(f(x) for x in runs)

        def per_step(key: str):
            return lambda x: statistics.fmean(r[key] / r["steps"] for r in x.summaries(rank))

        def stat(key: str, of: str = "stats"):  # a syncer counter per step, mean over ranks
            return lambda x: statistics.fmean(
                (r.get(of) or {}).get(key, 0.0) / r["steps"] for r in x.summaries(rank)
            )

        def in_loop(key: str):  # the share of the sync part (not the final flush's sends)
            return stat(key, "loop_stats")

        return Side(
            step_s=med(lambda x: x.step_s(rank)),
            step_mean_s=med(lambda x: statistics.fmean(x.step_times(rank))),
            peak_rss_mb=med(lambda x: sum(r["peak_rss_mb"] for r in x.summaries(rank))),
            train_per_step_s=med(per_step("train_s")),
            sync_per_step_s=med(per_step("sync_s")),
            agree_per_step_s=med(in_loop("agree_s")),
            transport_cpu_per_step_s=med(stat("transport_cpu_s")),
            send_per_step_s=med(in_loop("send_s")),
            apply_per_step_s=med(lambda x: in_loop("apply_s")(x) + in_loop("cache_s")(x)),
        )

    def rows(self) -> list[Row]:
        first = self.of("ds_diloco")[0].ranks
        out = [
            Row(
                rank=r,
                plain=self._side("plain", r),
                ds_diloco=self._side("ds_diloco", r),
                shard_fp32_mb=first[r]["shard_fp32_mb"],
            )
            for r in range(self.world_size)
        ]
        island = Row(
            rank=-1,
            plain=self._side("plain", -1),
            ds_diloco=self._side("ds_diloco", -1),
            shard_fp32_mb=sum(r["shard_fp32_mb"] for r in first),
        )
        return [*out, island]

    @property
    def coordinator_cpu_s(self) -> float | None:
        cpu = [x.coordinator_cpu_s for x in self.of("ds_diloco")]
        return None if None in cpu else statistics.median(cpu)

    def island_cpu_s(self, mode: str) -> float:
        """Median CPU seconds of a whole launch's processes (launcher and ranks)."""
        return statistics.median(x.island_cpu_s for x in self.of(mode))

    def spread(self, mode: str) -> tuple[float, float, float, float]:
        """(lowest, highest) island step time and island peak RSS over ``mode``'s launches."""
        steps = [x.island_step_s for x in self.of(mode)]
        rss = [sum(r["peak_rss_mb"] for r in x.ranks) for x in self.of(mode)]
        return min(steps), max(steps), min(rss), max(rss)

    @property
    def launch_s(self) -> float:
        """Median wall time of the ds_diloco launches (launcher start to exit)."""
        return statistics.median(x.launch_s for x in self.of("ds_diloco"))


def run_bench(
    cfg: RunConfig,
    repeats: int,
    warmup: int = WARMUP_STEPS,
    workdir: Path | None = None,
    echo=None,
    coordinator_nice: int = COORDINATOR_NICE,
    memory_repeats: int = 1,
    paired: int = 0,
    paired_blocks: int = PAIRED_BLOCK_STEPS,
) -> IslandBench:
    """``repeats`` rounds of (plain, ds_diloco) timed launches of ``cfg``'s first island,
    then ``paired`` paired launches (blocks of ``paired_blocks`` steps, syncer on and off),
    then ``memory_repeats`` rounds of memory launches (``EXACT_MEMORY_ENV``)."""
    if paired < 0:
        raise ValueError(f"--paired must be >= 0, got {paired}")
    if paired_blocks < 1:  # before the timed launches, not minutes into the run
        raise ValueError(f"--paired-blocks must be >= 1, got {paired_blocks}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if memory_repeats < 0:
        raise ValueError(f"--memory-repeats must be >= 0, got {memory_repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not 0 <= coordinator_nice <= 19:
        raise ValueError(f"--coordinator-nice must be in 0..19, got {coordinator_nice}")
    cfg = one_island(cfg)
    if paired:
        _check_paired_steps(cfg, warmup, paired_blocks)
    _prepare_data(cfg)  # tokenizer and blocks cached once, outside every timed launch
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="ds-diloco-bench-island-")) if own else Path(workdir)
    launches = []
    try:
        rounds = [(r, False, MODES) for r in range(repeats)]
        rounds += [(r, False, (PAIRED,)) for r in range(paired)]
        rounds += [(r, True, MODES) for r in range(memory_repeats)]
        for r, exact, modes in rounds:
            for mode in modes:
                x = launch(
                    cfg, mode, root / f"{r}-{mode}{'-memory' if exact else ''}", repeat=r,
                    warmup=warmup, coordinator_nice=coordinator_nice, exact_memory=exact,
                    blocks=paired_blocks, off_first=mode == PAIRED and r % 2 == 1,
                )  # fmt: skip
                launches.append(x)
                if echo:
                    echo(_launch_line(x))
    except BaseException:
        if own:
            print(f"bench island: launch directories kept in {root}", file=sys.stderr)
        raise
    if own:
        shutil.rmtree(root, ignore_errors=True)
    return IslandBench(
        launches=launches,
        world_size=cfg.islands[0].world_size,
        steps=cfg.train.steps,
        warmup=warmup,
        coordinator_nice=coordinator_nice,
    )


def _prepare_data(cfg: RunConfig) -> None:
    from ds_diloco.data import prepare_section

    prepare_section(cfg.data)


# -------------------------------------------------------------------- report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _launch_line(x: Launch) -> str:
    ranks = "  ".join(
        f"r{r['rank']} {_ms(x.step_s(i))} rss {r['peak_rss_mb']:.0f} MB"
        for i, r in enumerate(x.ranks)
    )
    extra = ""
    if x.mode != "plain":
        v = x.coordinator_versions or [0]
        cpu = "?" if x.coordinator_cpu_s is None else f"{x.coordinator_cpu_s:.1f} s"
        extra = f"  coordinator versions {min(v)}..{max(v)}, cpu {cpu}"
    if x.exact_memory:
        extra += "  (memory launch)"
    return (
        f"  [{x.repeat + 1}] {x.mode:9s} island step {_ms(x.island_step_s)}  ({ranks})  "
        f"launch {x.launch_s:.1f} s{extra}"
    )


def _memory_lines(bench: IslandBench, rows: list[Row]) -> list[str]:
    plain, ds = bench.spread("plain"), bench.spread("ds_diloco")
    goal = "goal ds_diloco - plain <= one fp32 copy of the own shard"
    lines = []
    mem = bench.memory_rows()
    if mem:
        env = " ".join(f"{k}={v}" for k, v in EXACT_MEMORY_ENV.items())
        n = len(bench.memory_of("plain"))
        lines.append(
            f"peak host memory (ru_maxrss; island = sum over ranks; {n} memory launch(es) per "
            f"mode with {env}, so that resident memory follows live memory), {goal}:"
        )
        for m in mem:
            setup, step = (_anon(m.anon_extra_mb(k)) for k in ("setup_anon_mb", "step_anon_mb"))
            extra, shard = shown(m.extra_mb(), m.shard_fp32_mb, m.met, least=1, sign="+")
            lines.append(
                f"    {m.name:7s} plain {m.plain.peak_rss_mb:.1f} MB  ds_diloco "
                f"{m.ds_diloco.peak_rss_mb:.1f} MB  extra {extra} MB  vs shard fp32 "
                f"{shard} MB  ({'met' if m.met else 'MISSED'}); extra before "
                f"the first step {m.extra_mb('setup_rss_mb'):+.1f} MB{setup}, after a step "
                f"{m.extra_mb('step_rss_mb'):+.1f} MB{step}; of the peak's, the base copy "
                f"{m.base_copy_mb:.1f} MB and the rest {m.extra_mb() - m.base_copy_mb:+.1f} MB"
            )
        lines.append(
            "    (anonymous: the rank's own data, heap, stacks and tensors; the rest of its "
            "resident memory is file-backed, mostly libraries' code, one copy per host, yet "
            "counted by every rank's ru_maxrss: the verdict stays on ru_maxrss)"
        )
        lines.append(
            "  with the default allocator (the timed launches; no verdict: see the spread):"
        )
    else:
        lines.append(f"peak host memory (ru_maxrss; island = sum over ranks), {goal}:")
    for row in rows:
        verdict = "" if mem else f"  ({'met' if row.rss_met else 'MISSED'})"
        extra, shard = shown(row.rss_extra_mb, row.shard_fp32_mb, row.rss_met, least=1, sign="+")
        lines.append(
            f"    {row.name:7s} plain {row.plain.peak_rss_mb:.1f} MB  ds_diloco "
            f"{row.ds_diloco.peak_rss_mb:.1f} MB  extra {extra} MB  vs shard "
            f"fp32 {shard} MB{verdict}"
        )
    lines.append(
        f"    (island peak RSS over launches: plain {plain[2]:.0f}..{plain[3]:.0f} MB, "
        f"ds_diloco {ds[2]:.0f}..{ds[3]:.0f} MB)"
    )
    return lines


def format_report(bench: IslandBench, cfg: RunConfig) -> str:
    c, t, d = cfg.coordinator, cfg.train, cfg.data
    cores = os.cpu_count()
    lines = [
        f"ds-diloco bench island  (one island of {bench.world_size} ZeRO-3 ranks vs the same "
        f"job as plain ZeRO-3; model {cfg.model.config or cfg.model.pretrained}; "
        f"data {d.path}, seq_len {d.seq_len}, micro_batch {t.micro_batch}; {bench.steps} steps, "
        f"first {bench.warmup if bench.steps > bench.warmup else 0} dropped; P={c.num_fragments} H={c.sync_every} "
        f"K={c.policy.min_quorum} tau={c.policy.tau}; median of {len(bench.of('plain'))} "
        f"launches per mode, alternated, plain first)",
        f"  note: the coordinator is a separate process, as in production where it runs on "
        f"another host; on this {cores}-core machine it shares the cores with the "
        f"{bench.world_size} ranks and their syncer threads (nice +10), at nice "
        f"+{bench.coordinator_nice} (--coordinator-nice; 0: the ranks' priority).",
        f"step time (whole step, sync included; island = per step the slowest rank), "
        f"goal ds_diloco / plain <= {STEP_GOAL:g}:",
    ]
    rows = bench.rows()
    for row in rows:
        lines.append(
            f"    {row.name:7s} plain {_ms(row.plain.step_s)}  ds_diloco "
            f"{_ms(row.ds_diloco.step_s)}  ratio "
            f"{shown(row.step_ratio, row.step_goal, row.step_met)[0]}  "
            f"({'met' if row.step_met else 'MISSED'})   [means: {_ms(row.plain.step_mean_s)} vs "
            f"{_ms(row.ds_diloco.step_mean_s)}, ratio "
            f"{row.ds_diloco.step_mean_s / row.plain.step_mean_s:.3f}]"
        )
    plain, ds = bench.spread("plain"), bench.spread("ds_diloco")
    lines.append(
        f"    (island step over launches: plain {_ms(plain[0])}..{_ms(plain[1])}, ds_diloco "
        f"{_ms(ds[0])}..{_ms(ds[1])})"
    )
    pr = bench.paired()
    if pr:
        lines.append(
            f"  paired ({pr['launches']} ds_diloco launch(es) whose learner steps only in every "
            f"other block of {pr['blocks']} inner steps, the blocks between plain ZeRO-3; first "
            f"{pr['settle']} steps of each block dropped; both sides in one launch: drift "
            f"between launches cancels, bursts within one do not):"
        )
        lines.append(
            f"    island  syncer off {_ms(pr['off_s'])}  on {_ms(pr['on_s'])} (medians over "
            f"launches)  ratio on / off, median of the launches' own: "
            f"{shown(pr['ratio'], STEP_GOAL, pr['met'])[0]}  "
            f"({'met' if pr['met'] else 'MISSED'})  [per launch: "
            + ", ".join(
                f"{r:.3f}{' (off first)' if o else ''}"
                for r, o in zip(pr["ratios"], pr["off_first"])
            )
            + "]"
        )
        if pr["ratio_on_first"] is not None and pr["ratio_off_first"] is not None:
            lines.append(
                f"    by the order of the blocks (every other launch starts with the syncer off, "
                f"so that the launch's own warm-up weighs on both sides): syncer on first "
                f"{pr['ratio_on_first']:.3f}, off first {pr['ratio_off_first']:.3f} (medians)"
            )
    lines.extend(_memory_lines(bench, rows))
    lines.append(
        "where the overhead goes (means per step over all steps, warm-up included; medians "
        "over launches):"
    )
    for row in rows:
        p, s = row.plain, row.ds_diloco
        total = s.train_per_step_s + s.sync_per_step_s
        slower_ms = (s.train_per_step_s - p.train_per_step_s) * 1e3
        lines.append(
            f"    {row.name:7s} train part plain {_ms(p.train_per_step_s)} -> ds_diloco "
            f"{_ms(s.train_per_step_s)} ({slower_ms:+.1f} ms); sync "
            f"part {_ms(s.sync_per_step_s)} = {100 * s.sync_per_step_s / total:.1f}% of the "
            f"step, of it agreement collective {_ms(s.agree_per_step_s)}, sends "
            f"{_ms(s.send_per_step_s)}, applies {_ms(s.apply_per_step_s)}; transport threads "
            f"{_ms(s.transport_cpu_per_step_s)} CPU per step"
        )
    pc, dc = bench.island_cpu_s("plain"), bench.island_cpu_s("ds_diloco")
    lines.append(
        f"    island processes (launcher + ranks, whole launch incl. start-up): CPU plain "
        f"{pc:.1f} s, ds_diloco {dc:.1f} s ({dc - pc:+.1f} s = {_ms((dc - pc) / bench.steps)} "
        f"per inner step)"
    )
    cpu = bench.coordinator_cpu_s
    if cpu is None:
        lines.append("    coordinator process CPU time: not readable here (no /proc)")
    else:
        wall = bench.launch_s
        lines.append(
            f"    coordinator process: {cpu:.1f} CPU s while the island ran (launcher start to "
            f"exit, {wall:.1f} s: {100 * cpu / wall:.0f}% of one core; {_ms(cpu / bench.steps)} "
            f"per inner step)"
        )
    return "\n".join(lines)


def to_json(bench: IslandBench, cfg: RunConfig) -> dict:
    rows, mem = [r.to_json() for r in bench.rows()], bench.memory_rows()
    if mem:  # the verdict is the memory launches' (memory_rows), as in the report: none here
        for r in rows:
            r["rss_met"] = None
    return {
        "settings": {
            "model": plain_dict(cfg.model),
            "deepspeed_config": cfg.deepspeed_config,
            "data": plain_dict(cfg.data),
            "train": plain_dict(cfg.train),
            "coordinator": {
                "num_fragments": cfg.coordinator.num_fragments,
                "sync_every": cfg.coordinator.sync_every,
                "policy": dataclasses.asdict(cfg.coordinator.policy),
            },
            "world_size": bench.world_size,
            "steps": bench.steps,
            "warmup": bench.warmup,
            "repeats": len(bench.of("plain")),
            "memory_repeats": len(bench.memory_of("plain")),
            "exact_memory_env": EXACT_MEMORY_ENV,
            "cpu_count": os.cpu_count(),
            "coordinator_nice": bench.coordinator_nice,
        },
        "rows": rows,
        "memory_rows": [m.to_json() for m in mem],
        "paired": bench.paired(),
        "coordinator_cpu_s": bench.coordinator_cpu_s,
        "island_cpu_s": {m: bench.island_cpu_s(m) for m in MODES},
        "launches": [x.to_json() for x in bench.launches],
    }


def _check_devices(cfg: RunConfig, run_file: str) -> None:
    """A run file whose DeepSpeed config computes in 16 bits is a GPU's
    (launch/bench-island-gpu.yaml): without CUDA its launches ran that on the CPU (a 125M
    model in bf16: 6 GB per rank, minutes a step), figures of no GPU, and said nothing."""
    import torch

    if torch.cuda.is_available():
        return
    ds = json.loads(Path(cfg.deepspeed_config).read_text())
    half = [k for k in ("bf16", "bfloat16", "fp16")
            if isinstance(ds.get(k), dict) and ds[k].get("enabled") is True]  # fmt: skip
    if half:
        raise ValueError(
            f"{run_file}: its deepspeed_config {cfg.deepspeed_config!r} computes in {half[0]}, "
            "for CUDA GPUs, and there is no CUDA device here; on the CPU: no --run (the tiny "
            "Llama) or --run launch/bench-island-125m.yaml (fp32)"
        )


def main(args) -> int:
    """The CLI's ``bench island``: args.run (a run file or None), args.steps, args.repeats,
    args.json."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.run:
        full = load_run_config(args.run)
        _check_devices(full, args.run)
        cfg = one_island(full, args.steps)
        if len(full.islands) > 1:
            print(
                f"bench island: {args.run} has {len(full.islands)} islands; benchmarking "
                f"the first ({cfg.islands[0].name}) alone",
                flush=True,
            )
    else:
        cfg = default_run_config(args.steps or DEFAULT_STEPS)
    print(
        f"bench island: {args.repeats} x (plain, ds_diloco) timed launches and "
        f"{getattr(args, 'paired', 0)} paired and {getattr(args, 'memory_repeats', 1)} x memory "
        f"launches of {cfg.train.steps} steps ...",
        flush=True,
    )
    bench = run_bench(
        cfg, args.repeats, echo=lambda line: print(line, flush=True),
        coordinator_nice=getattr(args, "coordinator_nice", COORDINATOR_NICE),
        memory_repeats=getattr(args, "memory_repeats", 1), paired=getattr(args, "paired", 0),
        paired_blocks=getattr(args, "paired_blocks", PAIRED_BLOCK_STEPS),
    )  # fmt: skip
    print(format_report(bench, cfg), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(bench, cfg), indent=2))
    return 0
