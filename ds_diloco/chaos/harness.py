"""``ds-diloco chaos RUNFILE``: a whole local run under scripted faults, and its report.

The same workload (the run file) runs up to three times on this machine:

1. ``reference``: Decoupled DiLoCo without faults (``--no-reference`` skips it);
2. ``chaos``: Decoupled DiLoCo under the schedule. Every island reaches the
   coordinator through its own :class:`ChaosProxy` (network delay and drops),
   ranks are SIGKILLed / SIGSTOPped through their pids, slow-downs go through the
   island's fault files, and the coordinator is SIGKILLed and held down. The
   run's supervisor (``LocalRun.supervise``) restarts what died. A watcher polls
   the coordinator throughout and checks that no version goes backwards and that
   no served (acknowledged) version ever comes back with other values;
3. ``baseline``: what a user would otherwise run, one synchronous DeepSpeed ZeRO-3
   data-parallel job over the same ranks (the island loop in plain mode), which
   checkpoints every ``train.checkpoint_every`` steps and restarts from its last
   checkpoint on any failure, under the same schedule mapped onto its ranks
   (island events hit that island's ranks; network and coordinator events do not
   apply). ``--no-baseline`` skips it.

Goodput is the share of allocated island time spent on steps that ended up in
the model (``ds_diloco.metrics``); for the baseline: steps x median step time
over the time from its first training step to its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from ds_diloco.chaos.proxy import ChaosProxy
from ds_diloco.chaos.schedule import Injector, Schedule
from ds_diloco.client import CoordinatorClient
from ds_diloco.config import IslandSpec, RunConfig
from ds_diloco.run import (
    PROGRESS_EVERY_S,
    CoordinatorStartError,
    LocalRun,
    ProgressPrinter,
    _json_or_none,
    _latest_checkpoint,
    evaluate,
    initial_loss,
    stop_deferred,
)

DEFAULT_CHECKPOINT_EVERY = 20


class RunTarget:
    """The injector's hands on a :class:`LocalRun`: pids, fault files, proxies.

    ``rank_map`` maps (island, rank) of the schedule to (job, rank) of the run: the
    identity for Decoupled DiLoCo, the data-parallel job's ranks for the baseline.
    """

    def __init__(self, lr: LocalRun, proxies: dict[str, ChaosProxy], sizes: dict[str, int],
                 rank_map=None):  # fmt: skip
        self.lr, self.proxies, self.sizes = lr, proxies, sizes  # sizes: the schedule's islands
        self.rank_map = rank_map or (lambda island, rank: (island, rank))

    def _ranks(self, island: str) -> list[tuple[str, int]]:
        return [self.rank_map(island, r) for r in range(self.sizes[island])]

    def _signal(self, island: str, sig, ranks=None) -> None:
        missing = []
        for job, rank in ranks or self._ranks(island):
            pid = self.lr.rank_pids(job).get(rank)
            try:
                if pid is None:
                    raise ProcessLookupError
                os.kill(pid, sig)
            except ProcessLookupError:
                missing.append(rank)
        if missing:  # the injector logs the event as not applied (it was logged as done)
            raise ProcessLookupError(
                f"island {island!r} has no live process for rank(s) {missing} (restarting, "
                f"finished or given up): not signalled"
            )

    def kill_rank(self, island: str, rank: int) -> None:
        self._signal(island, signal.SIGKILL, [self.rank_map(island, rank)])

    def stop_island(self, island: str) -> None:
        self._signal(island, signal.SIGSTOP)

    def cont_island(self, island: str) -> None:
        self._signal(island, signal.SIGCONT)

    def set_slow(self, island: str, extra_s: float) -> None:
        for job, rank in self._ranks(island):
            d = self.lr.island_dir(job) / "faults"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"slow-rank{rank}").write_text(f"{extra_s:g}" if extra_s > 0 else "0")

    def set_net(self, island: str, delay_s: float = 0.0, drop: bool = False) -> None:
        if island in self.proxies:
            self.proxies[island].set(delay_s=delay_s, drop=drop)

    def kill_coordinator(self) -> None:
        c = self.lr.coordinator
        if c is None:  # the baseline has none
            return
        self.lr.coordinator_hold_until = math.inf  # the supervisor waits for restart_coordinator
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.pid, signal.SIGKILL)

    def restart_coordinator(self) -> None:
        self.lr.coordinator_hold_until = 0.0


class Watcher:
    """Polls the coordinator: versions never go backwards, a served version never changes."""

    def __init__(self, url: str, token: str, every_s: float = 0.25, ca_file: str | None = None):
        self.client = CoordinatorClient(url, token, retries=0, timeout_s=5, ca_file=ca_file)
        self.every_s = every_s
        self.max_seen: list[int] | None = None
        self.backwards: list[dict] = []
        self.hashes: dict[tuple[int, int], str] = {}
        self.changed: list[dict] = []  # a served (fragment, version) seen again with other values
        self.advances: list[tuple[float, int]] = []  # (time, fragment) of every version seen
        self.samples: list[dict] = []  # (time, islands' registrations and merges)
        self._recheck = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-watcher", daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last_status = 0.0
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
                if time.monotonic() - last_status >= 1.0:
                    st = self.client.status()
                    self.samples.append({"t": time.monotonic() - self.t0, "islands": {
                        k: {"registrations": v["registrations"], "merged": v["merged"],
                            "live": v["live"]} for k, v in st["islands"].items()},
                        # per fragment, its last merge's pseudo-gradient norm (divergence)
                        "norms": {f: m.get("pseudo_gradient_norm")
                                  for f, m in st.get("last_merge", {}).items()}})  # fmt: skip
                    last_status = time.monotonic()
            except Exception:  # the coordinator is down or restarting: check everything after
                self._recheck = True
                continue

    def poll(self) -> None:
        """Hash a fragment's values when its version changes, and all of them once the
        coordinator answers again after an outage (a restart may serve a seen version)."""
        versions = self.client.versions()
        now = time.monotonic() - self.t0
        if self.max_seen is None:
            self.max_seen = [-1] * len(versions)
            self._last = [-1] * len(versions)
        recheck, self._recheck = self._recheck, False
        for f, v in enumerate(versions):
            if v < self.max_seen[f]:
                self.backwards.append({"t": now, "fragment": f, "was": self.max_seen[f], "now": v})
            if v > self.max_seen[f]:
                if self.max_seen[f] >= 0:
                    self.advances.append((now, f))
                self.max_seen[f] = v
            if recheck or v != self._last[f]:
                self._check_values(f)
                self._last[f] = v

    def _check_values(self, f: int) -> None:
        got = self.client.download(f, 1, 0)
        if got is None:
            return
        version, slices = got
        h = hashlib.sha256()
        for name in sorted(slices):
            h.update(slices[name].numpy().tobytes())
        digest = h.hexdigest()
        old = self.hashes.setdefault((f, version), digest)
        if old != digest:
            self.changed.append({"fragment": f, "version": version})

    def report(self) -> dict:
        return {
            "versions_went_backwards": self.backwards,
            "served_versions_changed": self.changed,
            "served_versions_checked": len(self.hashes),
        }


def island_time(island_dir: Path) -> dict:
    """From an island's progress records: when it first trained, when it finished, steps run.

    Every launch writes a ``started_at`` record; steps run per launch are counted up to
    its last progress record (a killed launch may have run up to ``log_every - 1`` more).
    An island given up (its last launch failed: no summary) ends at its last record, and
    its step time is its records' (the report of a whole chaos run was lost to it).
    """
    lines = (island_dir / "progress.jsonl").read_text(errors="replace").splitlines()
    # A rank killed mid-write leaves a torn line (its next launch appends to it): left out.
    records = [r for r in map(_json_or_none, lines) if isinstance(r, dict)]
    path = island_dir / "summary-rank0.json"
    summary = json.loads(path.read_text()) if path.is_file() else None
    launches: list[list[float]] = []  # [start step, last step seen, started_at, its seconds]
    for r in records:
        if "started_at" in r:
            launches.append([r["step"], r["step"], r["started_at"], 0.0])
        elif "step" in r and launches and r["step"] >= launches[-1][1]:
            launches[-1][1], launches[-1][3] = r["step"], r.get("seconds", launches[-1][3])
    if summary is not None:
        launches[-1][1] = summary["steps"]
    steps_run = sum(b - a for a, b, _, _ in launches)
    first = min(r["started_at"] for r in records if "started_at" in r)
    if summary is not None:
        end = summary["finished_at"]
        # The mean, not the median: an island runs faster while another is down or done.
        step_s = statistics.fmean(summary["step_times_s"])
    else:
        end = launches[-1][2] + launches[-1][3]
        step_s = sum(s for _, _, _, s in launches) / steps_run if steps_run else 0.0
    return {
        "allocated_s": end - first,
        "steps_run": steps_run,
        "launches": len(launches),
        "step_s": step_s,
        "steps": summary["steps"] if summary is not None else launches[-1][1],
    }


def breakdown(times: dict[str, dict], useful_steps: dict[str, float],
              dropped_steps: dict[str, float] | None = None) -> dict:  # fmt: skip
    """Where allocated island time went, as shares of it; ``goodput`` is the useful share.

    ``useful_steps``: per island, steps that ended up in the model (Decoupled DiLoCo: steps
    in merged contributions / P; data parallel: the final step count); ``dropped_steps``:
    in contributions dropped as stale / P. The rest of the training time is "trained, not
    used" (the tau steps between a fragment's send and its overwrite, steps lost in a
    crash or recomputed after one); what is left of the allocation is not training
    (start-up after restarts, stalls, waiting).
    """
    dropped_steps = dropped_steps or {}
    alloc = sum(t["allocated_s"] for t in times.values())
    useful = sum(useful_steps[n] * t["step_s"] for n, t in times.items())
    dropped = sum(dropped_steps.get(n, 0.0) * t["step_s"] for n, t in times.items())
    trained = sum(t["steps_run"] * t["step_s"] for t in times.values())
    return {
        "goodput": min(1.0, useful / alloc),  # from mean step times: an estimate
        "stale_dropped": dropped / alloc,
        "trained_not_used": max(0.0, trained - useful - dropped) / alloc,
        "not_training": max(0.0, alloc - trained) / alloc,
        "allocated_island_s": round(alloc, 1),
    }


def _wait_status(client: CoordinatorClient, timeout_s: float = 120.0) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return client.status()
        except Exception:
            time.sleep(0.5)
    return None


def _until_training(lr: LocalRun, timeout_s: float = 600.0) -> None:
    """Wait until every island trains: schedule times count from there, not from start-up."""
    deadline = time.monotonic() + timeout_s
    while len(lr.island_records()) < len(lr.islands):
        lr.supervise()
        if time.monotonic() > deadline or lr.finished():
            raise RuntimeError(
                f"islands did not start training: see {lr.workdir}/islands/*/log.txt"
            )
        time.sleep(0.2)


def _supervise(lr: LocalRun, label: str, client: CoordinatorClient | None) -> None:
    next_print = time.monotonic()
    show = ProgressPrinter()
    while not lr.finished():
        lr.supervise()
        if time.monotonic() >= next_print:
            line = lr.progress_line(client) if client else _progress(lr)
            show(f"[{label}] {line}")
            next_print += PROGRESS_EVERY_S
        time.sleep(0.2)


def _progress(lr: LocalRun) -> str:
    return " | ".join(f"{n}: step {r.get('step')}" for n, r in sorted(lr.island_records().items()))


def _stop_all(
    lr: LocalRun, injector: Injector | None = None, watcher: Watcher | None = None, proxies=()
) -> None:
    """The faults reverted, then the watcher, every process and the proxies stopped. A stop
    signal that comes meanwhile is raised at the end (``stop_deferred``): raised inside, it
    left the islands or the coordinator running."""
    with stop_deferred():
        if injector is not None:
            injector.stop()
        if watcher is not None:
            watcher.stop()
        lr.stop()
        for p in proxies:
            p.close()


def _with_workdir(cfg: RunConfig, workdir: Path, **train) -> RunConfig:
    coord = dataclasses.replace(cfg.coordinator, state_dir=str(workdir / "state"))
    islands = tuple(  # an island's own train section gets the same changes
        dataclasses.replace(s, train=dataclasses.replace(s.train, **train)) if s.train else s
        for s in cfg.islands
    )
    return dataclasses.replace(cfg, workdir=str(workdir), coordinator=coord, export=True,
                               train=dataclasses.replace(cfg.train, **train), islands=islands)  # fmt: skip


def island_proxies(url: str, islands: list[str]) -> dict[str, ChaosProxy]:
    """A started proxy per island to the coordinator at ``url``: to its host (not always
    127.0.0.1), and listening at its address when it is one, so that the URL the islands
    get names what the coordinator's certificate does."""
    parts = urlsplit(url)
    host = parts.hostname
    try:
        listen = str(ipaddress.ip_address(host))
    except ValueError:  # a name (localhost): it may stand for several addresses
        listen = "127.0.0.1"
    return {name: ChaosProxy(host, parts.port, listen_host=listen, scheme=parts.scheme).start()
            for name in islands}  # fmt: skip


def run_diloco(cfg: RunConfig, schedule: Schedule | None, workdir: Path, heldout) -> dict:
    """One Decoupled DiLoCo run, under ``schedule`` if given; its figures."""
    from ds_diloco.data import section_tokenizer
    from ds_diloco.export import export_model, load_global_tensors

    label = "chaos" if schedule else "reference"
    cfg = _with_workdir(cfg, workdir, checkpoint_every=cfg.train.checkpoint_every
                        or DEFAULT_CHECKPOINT_EVERY)  # fmt: skip
    lr = LocalRun(cfg)
    t0 = time.monotonic()
    proxies: dict[str, ChaosProxy] = {}
    watcher = injector = schedule_t0 = None
    try:  # the islands start up while the coordinator does
        lr.spawn_coordinator()
        proxies = island_proxies(lr.url, [s.name for s in cfg.islands])
        lr.island_urls = {name: p.url for name, p in proxies.items()}
        lr.start_islands()
        client = lr.wait_for_coordinator()
        watcher = Watcher(lr.url, lr.token, ca_file=cfg.coordinator.tls_cert).start()
        if schedule is not None:
            _until_training(lr)
            schedule_t0 = time.monotonic() - watcher.t0
            sizes = {s.name: s.world_size for s in cfg.islands}
            injector = Injector(schedule, RunTarget(lr, proxies, sizes)).start()
        _supervise(lr, label, client)
        if injector is not None:
            injector.stop()
        lr.coordinator_hold_until = 0.0
        lr.supervise()  # a coordinator held down by the last event comes back
        status = _wait_status(client)
    finally:
        _stop_all(lr, injector, watcher, proxies.values())
    wall = time.monotonic() - t0
    times = {s.name: island_time(lr.island_dir(s.name)) for s in cfg.islands}
    n_frag = cfg.coordinator.num_fragments
    isl = status["islands"] if status else {}
    split = breakdown(
        times,
        {n: isl.get(n, {}).get("steps_merged", 0) / n_frag for n in times},
        {n: isl.get(n, {}).get("steps_dropped", 0) / n_frag for n in times},
    )
    config, tensors = load_global_tensors(cfg.coordinator.state_dir)
    finite = all(bool(t.isfinite().all()) for t in tensors.values())
    d = cfg.data
    tok = section_tokenizer(d)
    export = export_model(config, tensors, workdir / "export", tokenizer=tok)
    quality = {**initial_loss(cfg, heldout), **evaluate(cfg, Path(export), heldout)}
    quality.pop("sample", None)
    return {
        "run": label,
        "wall_s": round(wall, 1),
        "goodput": split["goodput"],
        "time_split": split,
        "island_times": times,
        "goodput_live": status["run"]["goodput"] if status else None,  # /metrics' estimate
        "uptime": status["run"]["uptime"] if status else None,
        "merges": status["merges"] if status else None,
        "islands": status["islands"] if status else None,
        "restarts": dict(lr.restarts),
        "coordinator_restarts": lr.coordinator_restarts,
        "given_up": sorted(lr.given_up),
        "supervisor_events": lr.events,
        "injected": injector.log if injector else [],
        "all_finite": finite,
        **watcher.report(),
        "advances": watcher.advances,
        "schedule_t0_s": schedule_t0,  # when the schedule's clock started, in watcher time
        "status_samples": watcher.samples,
        **quality,
    }


def run_baseline(cfg: RunConfig, schedule: Schedule | None, workdir: Path) -> dict:
    """Synchronous ZeRO-3 data parallelism over all the run's ranks, restarting from checkpoints."""
    total = sum(s.world_size for s in cfg.islands)
    sizes = {s.name: s.world_size for s in cfg.islands}
    offsets, o = {}, 0
    for s in cfg.islands:
        offsets[s.name] = o
        o += s.world_size
    every = cfg.train.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
    spec = IslandSpec(name="data-parallel", world_size=total)
    # Restarted on every rank, as such a job is (leaving a slot out would make it elastic).
    cfg = dataclasses.replace(_with_workdir(cfg, workdir, checkpoint_every=every), islands=(spec,),
                              downscale_after=0)  # fmt: skip
    lr = LocalRun(cfg)
    t0 = time.monotonic()
    injector = None
    try:
        lr.start_island(spec, 0, 1, plain=True)
        if schedule is not None:
            _until_training(lr)
            target = RunTarget(lr, {}, sizes, lambda isl, r: (spec.name, offsets[isl] + r))
            injector = Injector(schedule, target).start()
        _supervise(lr, "baseline", None)
    finally:
        _stop_all(lr, injector)
    wall = time.monotonic() - t0
    d = lr.island_dir(spec.name)
    path = d / "summary-rank0.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}  # none if given up
    times = {spec.name: island_time(d)}
    # A job given up keeps the steps of its last checkpoint, all it would restart from.
    steps = summary.get("steps", int(_latest_checkpoint(d).removeprefix("step") or 0))
    # Every rank of the job is allocated (and useful) for the same time: one island's shares.
    split = breakdown(times, {spec.name: steps})
    return {
        "run": "baseline",
        "wall_s": round(wall, 1),
        "ranks": total,
        "checkpoint_every": every,
        "steps": steps,
        "step_s_mean": times[spec.name]["step_s"],
        "goodput": split["goodput"],
        "time_split": split,
        "island_times": times,
        "restarts": dict(lr.restarts),
        "given_up": sorted(lr.given_up),
        "injected": injector.log if injector else [],
        "heldout_loss_island_end": summary.get("heldout_loss_end"),
    }


def run_chaos(cfg: RunConfig, schedule: Schedule, workdir: Path, *, reference: bool = True,
              baseline: bool = True) -> dict:  # fmt: skip
    from ds_diloco.data import as_tensor, heldout_split, prepare_section

    schedule.check_targets({s.name: s.world_size for s in cfg.islands})
    d = cfg.data
    _, blocks = prepare_section(d)
    heldout = as_tensor(heldout_split(blocks, d.heldout_fraction, seed=d.seed)[1][:64])
    report: dict = {"schedule": schedule.to_dict()}

    def save() -> None:  # after each run: a stop or a failure in a later one keeps it
        (workdir / "chaos-report.json").write_text(json.dumps(report, indent=1, default=str))

    report["chaos"] = run_diloco(cfg, schedule, workdir / "chaos", heldout)
    save()
    if reference:
        report["reference"] = run_diloco(cfg, None, workdir / "reference", heldout)
        save()
    if baseline:
        report["baseline"] = run_baseline(cfg, schedule, workdir / "baseline")
        save()
    return report


def print_report(r: dict) -> None:
    c = r["chaos"]
    kinds: dict[str, int] = {}
    for e in c["injected"]:
        if e["action"] == "apply" and e["ok"]:
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    print("\nds-diloco chaos report")
    print(
        f"  events injected: {sum(kinds.values())} ({', '.join(f'{k} x{n}' for k, n in kinds.items())})"
    )
    missed = [e for e in c["injected"] if e["action"] == "apply" and not e["ok"]]
    for e in missed:  # the schedule's event did not happen: not counted above
        print(f"  not injected: {e['kind']} {e['target']} at {e['at_s']:g}s: {e['error']}")
    applied = {e["event"] for e in c["injected"] if e["action"] == "apply"}
    for i, e in enumerate(r["schedule"]["events"]):  # in time order, as the injector's
        if i not in applied:  # the run was over first: the injector stopped before it
            print(f"  not injected: {e['kind']} {e['target']} at {e['at_s']:g}s: the run "
                  "ended before it was due")  # fmt: skip
    print(
        f"  island restarts: {c['restarts'] or 'none'}; coordinator restarts: "
        f"{c['coordinator_restarts']}; given up: {c['given_up'] or 'none'}"
    )
    print(f"  merges per fragment: {c['merges']}")
    print(
        f"  versions went backwards: {len(c['versions_went_backwards'])}; served versions that "
        f"changed: {len(c['served_versions_changed'])} of {c['served_versions_checked']} checked; "
        f"all tensors finite: {c['all_finite']}"
    )
    up = c["uptime"]
    print(
        f"  uptime (share of {'windows'} with a merge): {up:.3f}"
        if up is not None
        else "  uptime: n/a"
    )
    ref = r.get("reference")
    line = f"  held-out loss: initial {c['heldout_loss_initial']:.3f} -> chaos {c['heldout_loss_merged']:.3f}"
    if ref:
        line += f" (no faults: {ref['heldout_loss_merged']:.3f}, wall {ref['wall_s']} s vs {c['wall_s']} s)"
    print(line)
    g = c["goodput"]
    print(f"  goodput Decoupled DiLoCo: {g:.3f}  ({_split(c['time_split'])})")
    if ref:
        print(f"  goodput without faults: {ref['goodput']:.3f}  ({_split(ref['time_split'])})")
    b = r.get("baseline")
    if b:
        print(
            f"  goodput synchronous ZeRO-3 data-parallel ({b['ranks']} ranks, checkpoint every "
            f"{b['checkpoint_every']} steps, restarts {b['restarts'] or 'none'}): {b['goodput']:.3f}"
            f"  ({_split(b['time_split'])})"
        )
        if g is not None and b["goodput"]:
            print(f"  ratio Decoupled DiLoCo / data-parallel: {g / b['goodput']:.2f}")  # fmt: skip


def _split(s: dict) -> str:
    return (f"of allocated island time: stale-dropped {s['stale_dropped']:.3f}, trained but not "
            f"used {s['trained_not_used']:.3f}, not training {s['not_training']:.3f}")  # fmt: skip


def main(args) -> int:
    from ds_diloco.config import load_run_config

    cfg = load_run_config(args.file)
    if args.schedule:
        schedule = Schedule.from_file(args.schedule)
    else:
        # The flags by name ("from_seed: duration_s must be ..." named neither).
        if args.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {args.seed}")
        for flag, value in (("--duration", args.duration), ("--rate", args.rate)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a finite number > 0, got {value}")
        schedule = Schedule.from_seed(
            args.seed, [s.name for s in cfg.islands],
            {s.name: s.world_size for s in cfg.islands}, args.duration,
            rate_per_min=args.rate,
        )  # fmt: skip
        if not schedule.events:  # else three runs of minutes, fault-free, and a ratio
            raise ValueError(
                f"seed {args.seed} drew no fault in --duration {args.duration:g} s at --rate "
                f"{args.rate:g} per minute (faults start after a 10 s warm-up and must end "
                "within the duration): give a longer --duration, a higher --rate or another "
                "--seed"
            )
    workdir = Path(args.workdir or Path(cfg.workdir).with_name(Path(cfg.workdir).name + "-chaos"))
    # Absolute: the island and coordinator files written under it resolve relative paths
    # against their own folder (a relative --workdir nested the runs inside themselves).
    workdir = workdir.resolve()
    try:
        report = run_chaos(cfg, schedule, workdir, reference=not args.no_reference,
                           baseline=not args.no_baseline)  # fmt: skip
    except CoordinatorStartError as e:  # its runs are stopped by now
        print(f"ds-diloco: error: {e}", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    c = report["chaos"]
    ok = not c["versions_went_backwards"] and not c["served_versions_changed"] and c["all_finite"]
    return 0 if ok else 1
