"""``ds-diloco run FILE``: a whole run on this machine.

Starts the coordinator (``ds-diloco coordinator``) and every island through the
deepspeed launcher (each island its own process group and master port), shows
progress, stops everything cleanly on Ctrl-C or SIGTERM, and at the end exports the
merged model and compares it with the initial one on held-out text.

Layout of the run's workdir::

    coordinator.json      the coordinator's config, as started
    state/                the coordinator's durable state
    islands/<name>/       island.json, log.txt, progress.jsonl, summary-rank<r>.json
    export/               the merged model as a Hugging Face folder
    summary.json          what the run did

``ds-diloco run FILE --resume`` continues a stopped run from ``state/`` (the coordinator
resumes at its served versions, merges and outer momentum) and each island's last
DeepSpeed checkpoint (``islands/<name>/checkpoints``, written every
``train.checkpoint_every`` steps: AdamW state, step, tokens, data position); islands
that had finished are not started again.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ds_diloco import orphan_exit
from ds_diloco.cli import INPUT_ERROR_EXIT
from ds_diloco.client import CoordinatorClient, RefusedError, TLSError
from ds_diloco.config import TOKEN_ENV, IslandConfig, RunConfig, parse_include
from ds_diloco.global_eval import HELDOUT_BLOCKS
from ds_diloco.learner import LearnerError
from ds_diloco.live_model import PeriodicEval, PeriodicExport
from ds_diloco.rank_watch import RankWatch, local_rank
from ds_diloco.slot_policy import SlotState, after_death, launch_slots
from ds_diloco.state_store import atomic_write, spare_path
from ds_diloco.syncer import Diverged, Superseded

ISLANDS_FAILED = 1
"""``ds-diloco run``'s exit status when islands were given up: the others' merged model is
still exported and evaluated (it was not: an island of eight given up lost the export)."""
PROGRESS_EVERY_S = 5.0
QUIET_REPEAT_S = 60.0
"""An unchanged progress line is printed again only this often: alive, nothing new."""
RATE_WINDOW_S = 60.0
"""The progress line's tokens per second and time left are over this much of the past."""
COORDINATOR_START_S = 120.0
"""Longest wait for a started coordinator to answer (loading a large pretrained model)."""
ISLAND_CONNECT_S = COORDINATOR_START_S + 30.0
"""How long a run's islands try to reach the coordinator at start: they are started while
it is still starting, so they wait out its start-up, and a coordinator restart."""
MAX_BACKOFF_S = 30.0
HEALTH_EVERY_S = 5.0
"""How often supervision asks a live coordinator whether it answers (``coordinator_hang_s``)."""
HEALTH_TIMEOUT_S = 2.0
STALL_DUMP_S = 1.0
"""An island whose rank wrote that its watch stopped it is killed this long after that is
seen (its ranks' stacks written by then), if its launcher has not exited already."""
HANG_DUMP_S = 1.0
"""How long a hung coordinator is given to write its threads' stacks before it is killed."""


class CoordinatorStartError(RuntimeError):
    """The run's coordinator exited, or did not answer, before it served; or it died more
    than ``max_restarts`` times and is not started again."""


def check_islands_inputs(cfg: RunConfig, tokenizer=None) -> None:
    """What only the coordinator or the ranks would find, checked before any island starts
    (found there, it came after every island's ranks had been launched, or in each rank's
    log, restarted up to max_restarts times): the fragment plan against the model, each
    island's ``train.freeze``, the tokenizer's ids and the sequence length against the
    model's tables, and the DeepSpeed config against DeepSpeed's own schema."""
    from ds_diloco.fragments import FragmentPlan
    from ds_diloco.hf_model import (
        check_freeze,
        check_sequence_fits,
        check_tokenizer_fits,
        model_specs,
    )
    from ds_diloco.island import deepspeed_config

    c = cfg.coordinator
    specs = model_specs(cfg.model)
    try:
        FragmentPlan.build(specs, c.num_fragments, c.fragmentation)
    except ValueError as e:
        raise ValueError(f"coordinator: {e}") from None
    for spec in cfg.islands:
        try:
            check_freeze(cfg.train_of(spec).freeze, [s.name for s in specs])
        except ValueError as e:
            raise ValueError(f"islands[{spec.name}]: {e}" if spec.train else str(e)) from None
    check_sequence_fits(specs, cfg.data.seq_len)
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, cfg.model, cfg.data.tokenizer)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the ranks get it (_env)
    from ds_diloco.zero import check_deepspeed_config

    for i, spec in enumerate(cfg.islands):  # one file; batch sizes by island (world size 1)
        island = IslandConfig(island=spec.name, coordinator_url="http://127.0.0.1:1",
                              model=cfg.model, deepspeed_config=cfg.deepspeed_config,
                              data=cfg.data, train=cfg.train_of(spec))  # fmt: skip
        try:  # its own errors say what to change; this says which island's settings
            ds = deepspeed_config(island, 1, warn=i == 0)
        except ValueError as e:
            raise ValueError(f"islands[{spec.name}]: {e}" if spec.train else str(e)) from None
        try:
            check_deepspeed_config(ds)
        except ValueError as e:
            raise ValueError(
                f"deepspeed_config {cfg.deepspeed_config!r} is refused by DeepSpeed: {e}"
            ) from None


_PORTS_GIVEN: set[int] = set()
PORTS_ENV = "DS_DILOCO_PORTS"
"""``LOW-HIGH``: the ports :func:`free_port` hands out (the coordinator's and each island's
master port where the run file names none): a firewall's open range, or, in the tests, a
range per pytest-xdist worker. Unset: whichever the kernel offers."""


def port_range() -> tuple[int, int] | None:
    """``PORTS_ENV``'s range, None where it is unset; ValueError naming it where it is bad."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if not text:
        return None
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"{PORTS_ENV}={text!r}: want LOW-HIGH, e.g. 20000-20999") from None
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORTS_ENV}={text!r}: want 1024 <= LOW <= HIGH <= 65535")
    return low, high


def _unbound_port() -> int:
    span = port_range()
    if span is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low, high = span
    start = secrets.randbelow(high - low + 1)  # from anywhere in it: a port just given is in use
    for i in range(high - low + 1):
        port = low + (start + i) % (high - low + 1)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(
        f"no free port: every port of {PORTS_ENV}={low}-{high} is in use or handed out"
    )


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before.

    The port is free only until someone binds it: the coordinator and a launcher's rank 0
    bind theirs seconds later (imports first), and the kernel may hand the same unbound
    port out again in between. A rank's TCPStore then met the coordinator's HTTP server
    ("Ping failed ... Got: 1347703880", b"HTTP"), so a port is never handed out twice.
    Another process may still pick it in that window: processes that start runs side by
    side (the tests' workers) give each one its own range (``PORTS_ENV``)."""
    for _ in range(100):
        port = _unbound_port()
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError(
        f"no free port: the ports offered had all been handed out ({len(_PORTS_GIVEN)} so far)"
    )


def _env(token: str, ranks: int) -> dict:
    env = {**os.environ, TOKEN_ENV: token, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           **orphan_exit.run_env()}  # fmt: skip
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        # The run's ranks share this host's cores: an OMP_NUM_THREADS meant for one process
        # (or torch's default, every core) in each of them oversubscribes the cores, and
        # OpenMP's spinning threads then slow every rank several times over.
        env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(ranks))
    return env


def cpu_threads_per_rank(ranks: int) -> int:
    """This process's cores (its CPU affinity) shared out among ``ranks`` processes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(ranks, 1))


def plain_dict(obj) -> dict:
    """A config dataclass as a dict for JSON, unset (None) fields left out."""
    return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None}


def launcher_cmd(
    spec, port: int, slots: Sequence[int] | None = None, devices: Sequence | None = None
) -> list[str]:
    """The deepspeed launcher command line for one island, up to the script.

    A local island goes straight to ``deepspeed.launcher.launch`` (the per-node launcher the
    ``deepspeed`` runner would exec for it) with the same world info the runner would
    build: the runner's own start-up (a second deepspeed import, ~3 s of CPU) buys nothing
    on one host. An ``include`` naming other hosts keeps the runner and its ssh/pdsh path.
    ``slots``: a local island's slots for this launch (default: all of them). ``devices``:
    the host's visible devices (:func:`visible_devices`), which the slots of an island
    without ``include`` index, as the runner takes them (an explicit include is the
    devices' own ids, there too).
    """
    slots = list(slots) if slots is not None else local_slots(spec)
    if slots is None:
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port),
                "--include", spec.include]  # fmt: skip
    ids = slots if spec.include else device_ids(slots, devices)
    info = base64.urlsafe_b64encode(json.dumps({"localhost": ids}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}",
            "--master_addr=127.0.0.1", f"--master_port={port}"]  # fmt: skip


def local_slots(spec) -> list[int] | None:
    """The local device slots of an island, or None when its ``include`` names other hosts."""
    if not spec.include:
        return list(range(spec.world_size))
    hosts = parse_include(spec.include)  # checked at load
    return hosts["localhost"] if list(hosts) == ["localhost"] else None


def visible_devices() -> list | None:
    """The CUDA devices this process was given (``CUDA_VISIBLE_DEVICES``: a Slurm job's, a
    user's), None where it is unset or there is no CUDA. The launcher sets each rank's
    CUDA_VISIBLE_DEVICES to its world info's ids: slots 0..n-1 as ids put the islands on
    GPUs 0..n-1 whatever the variable said (the runner maps its slots through it)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not text or not torch.cuda.is_available():
        return None
    return [int(d) if d.strip().isdigit() else d.strip() for d in text.split(",") if d.strip()]


def device_ids(slots: Sequence[int], devices: Sequence | None) -> list:
    """The devices' own ids of ``slots``, indices into ``devices`` (:func:`visible_devices`),
    as the launcher's world info and an include name them; the slots themselves where no
    devices are given, or too few."""
    if devices and max(slots, default=-1) < len(devices):
        return [devices[s] for s in slots]
    return list(slots)


def gpu_slots(islands, gpus: int, devices: Sequence | None = None) -> dict[str, list[int]]:
    """On a host with ``gpus`` CUDA devices, the devices of each local island that names no
    ``include``: devices of its own, in the file's order, beside those other islands'
    ``include`` names, where they all fit; else none ({}: each island on its first
    world_size devices, as on the CPU). Without it two islands of 4 on 8 GPUs both ran on
    GPUs 0-3 (the launcher's CUDA_VISIBLE_DEVICES), sharing them, and 4-7 stayed idle.
    ``devices``: the ids the slots stand for (:func:`visible_devices`; default: the slots)."""
    taken: set[int] = set()
    for spec in islands:
        if spec.include:
            hosts = parse_include(spec.include)
            if "localhost" in hosts and hosts["localhost"] is None:
                return {}  # every device of this host (the hostfile's slots)
            taken.update(hosts.get("localhost") or ())
    ids = device_ids(range(gpus), devices)
    free = [g for g in range(gpus) if ids[g] not in taken]
    bare = [spec for spec in islands if not spec.include]
    if sum(spec.world_size for spec in bare) > len(free):
        return {}
    out = {}
    for spec in bare:
        out[spec.name], free = free[: spec.world_size], free[spec.world_size :]
    return out


def _read_token(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class LocalRun:
    def __init__(self, cfg: RunConfig, fresh: bool = True):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir)
        if fresh:  # a run starts from the initial model; keep the corpus cache
            _refuse_foreign_state(cfg)
            # And none of an earlier run's outputs stays to pass for this one's; but an
            # export this run starts from (model.pretrained, data.tokenizer) stays.
            inputs = [Path(x).resolve() for x in (cfg.model.pretrained, cfg.data.tokenizer) if x]
            for out in ("state", "islands", "tensorboard", "export", "exports"):
                path = (self.workdir / out).resolve()
                if not any(x == path or path in x.parents for x in inputs):
                    shutil.rmtree(path, ignore_errors=True)
            (self.workdir / "summary.json").unlink(missing_ok=True)
        self._state_was_there = Path(cfg.coordinator.state_dir).exists()  # (discard_state)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A token of the run's own making is written as state_dir/token (0600, as a
        # standalone coordinator writes its own) once the coordinator starts, for
        # `ds-diloco status --token-file`; a resumed run keeps it. One given (the run
        # file, the environment) is not written anywhere.
        self.token_file: Path | None = None
        given = cfg.coordinator.token or os.environ.get(TOKEN_ENV)
        if given:
            self.token = given
        else:
            self.token_file = Path(cfg.coordinator.state_dir) / "token"
            kept = None if fresh else _read_token(self.token_file)
            self.token = kept or secrets.token_urlsafe(24)
        self.env = _env(self.token, sum(i.world_size for i in cfg.islands))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self._devices = visible_devices()  # what the slots index
        self._gpu_slots = gpu_slots(cfg.islands, gpus, self._devices)  # GPUs of their own
        self.coordinator: subprocess.Popen | None = None
        self.islands: dict[str, subprocess.Popen] = {}
        self.url = ""
        # Supervision (see supervise): how to start each island again, restarts, what happened.
        self._island_args: dict[str, tuple] = {}
        self._island_ports: dict[str, int] = {}  # master ports picked free, kept for restarts
        self.restarts: dict[str, int] = {}
        self._restart_at: dict[str, float] = {}
        self._log_at: dict[str, int] = {}  # per island, its log's size when its launch began
        self._log_read: dict[str, int] = {}  # ... and how far it was searched for a stall
        self._stall_seen: dict[str, tuple[str, float]] = {}  # ... a rank's stall seen there:
        # (how long, when seen)
        self.given_up: set[str] = set()
        self.superseded: set[str] = set()  # of given_up: a later launch of the island took over
        self.coordinator_restarts = 0
        self._coordinator_deaths = 0  # exits not caused on purpose: max_restarts counts these
        self._coordinator_restart_at: float | None = None
        self.coordinator_hold_until = 0.0  # chaos: keep a killed coordinator down until then
        # The hang watch (coordinator_hang_s): when this coordinator process last answered
        # its health check (None: not yet, still starting) and when to ask it next.
        self._answered_at: float | None = None
        self._health_at = 0.0
        self._health: CoordinatorClient | None = None
        # Downscaling around a failed slot (slot_policy): per local island, its slots'
        # record and the slots of its current launch; which rank died first (rank_watch).
        self.slot_states: dict[str, SlotState] = {}
        self._launched_slots: dict[str, tuple[int, ...]] = {}
        self._upscale_from: dict[str, str] = {}  # its checkpoint when a slot came back
        self.rank_watch = RankWatch()
        self.rates = IslandRates()  # the progress line's tokens per second and time left
        self.events: list[dict] = []
        self.island_urls: dict[str, str] = {}  # per island, another way to the coordinator
        self._t0 = time.monotonic()
        self.startup: dict[str, float] = {}
        """Seconds from the start of the run to its first coordinator process started,
        its islands started, and the coordinator answering (the two start-ups overlap)."""
        self._stopping = False

    # ------------------------------------------------------------ processes
    def start_coordinator(self) -> CoordinatorClient:
        """Start the coordinator and wait until it answers."""
        self.spawn_coordinator()
        return self.wait_for_coordinator()

    def spawn_coordinator(self) -> None:
        """Start the coordinator process without waiting for it: its start-up (imports,
        building or loading the model) can overlap the data preparation and the islands'
        own start-up, which reach it when they are ready (``ISLAND_CONNECT_S``)."""
        c = self.cfg.coordinator
        # A restarted coordinator must come back where the islands look for it.
        port = self._port = getattr(self, "_port", None) or c.port or free_port()
        path = self.write_coordinator_config(port)
        if self.token_file is not None and _read_token(self.token_file) != self.token:
            atomic_write(self.token_file, self.token.encode())  # mode 0600 (mkstemp)
        # Appended: a restart (or --resume) must not erase why the last one died.
        log = (self.workdir / "coordinator.log").open("a")
        log.write(f"--- coordinator started {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
        log.flush()
        with stop_deferred():
            self.coordinator = subprocess.Popen(
                self.coordinator_command(path),
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        host = "127.0.0.1" if c.host in ("0.0.0.0", "") else c.host
        self.url = c.url_at(host, port)
        self._answered_at, self._health_at = None, 0.0
        self._health = CoordinatorClient(self.url, self.token, retries=0,
                                         timeout_s=HEALTH_TIMEOUT_S, ca_file=c.tls_cert)  # fmt: skip
        self._mark("coordinator_spawned_s")

    def coordinator_command(self, config: Path) -> list[str]:
        """The coordinator process's argv, its config at ``config`` (a subclass serving
        another coordinator, e.g. bench quality's stale-merge prototype, changes it here:
        every start and restart goes through :meth:`spawn_coordinator`)."""
        return [sys.executable, "-m", "ds_diloco.cli", "coordinator", "--config", str(config)]

    def wait_for_coordinator(self) -> CoordinatorClient:
        """A client once the spawned coordinator answers (at most ``COORDINATOR_START_S``)."""
        client = CoordinatorClient(
            self.url, self.token, retries=0, timeout_s=10, ca_file=self.cfg.coordinator.tls_cert
        )
        deadline = time.monotonic() + COORDINATOR_START_S
        while time.monotonic() < deadline:
            if self.coordinator.poll() is not None:
                log = self.workdir / "coordinator.log"
                raise CoordinatorStartError(
                    f"the coordinator exited with code {self.coordinator.returncode} before "
                    f"it answered: {_last_line(log)} (log: {log})"
                )
            try:
                client.health()
                self._mark("coordinator_up_s")
                return client
            except TLSError as e:  # it answers, its certificate refused: waiting changes nothing
                raise CoordinatorStartError(str(e)) from None
            except Exception:
                time.sleep(0.1)
        raise CoordinatorStartError(
            f"the coordinator did not answer at {self.url} within {COORDINATOR_START_S:g} s "
            f"(log: {self.workdir / 'coordinator.log'})"
        )

    def start_islands(self, skip: set[str] | frozenset[str] = frozenset()) -> None:
        """Every island of the run but those named in ``skip`` (finished ones, resuming)."""
        for shard, spec in enumerate(self.cfg.islands):
            if spec.name not in skip:
                self.start_island(spec, shard, len(self.cfg.islands))
        self._mark("islands_started_s")

    def _mark(self, what: str) -> None:
        self.startup.setdefault(what, round(time.monotonic() - self._t0, 2))

    @property
    def ca_file(self) -> str | None:
        """The certificate the run's own clients trust (an https:// coordinator)."""
        return self.cfg.coordinator.tls_cert if self.url.startswith("https://") else None

    def _coordinator_ca(self, island: str) -> str | None:
        """The coordinator's own certificate, trusted by the islands of its run."""
        url = self.island_urls.get(island, self.url)
        return self.cfg.coordinator.tls_cert if url.startswith("https://") else None

    def write_coordinator_config(self, port: int) -> Path:
        """The coordinator's config as it is started: workdir/coordinator.json, its paths
        absolute, as for the islands (the file's relative paths are its folder's)."""
        c = self.cfg.coordinator
        coord = {**plain_dict(c), "port": port, "token": None}
        coord.pop("token")
        coord["state_dir"] = str(Path(c.state_dir).resolve())
        for key in ("pretrained", "config"):  # a path here, not a Hub name
            if isinstance(path := coord["model"].get(key), str) and os.path.exists(path):
                coord["model"][key] = str(Path(path).resolve())
        path = self.workdir / "coordinator.json"
        path.write_text(json.dumps(coord, indent=1))
        return path

    def write_island_config(self, spec, shard: int, num_shards: int, plain: bool) -> Path:
        """The island's config, written as islands/NAME/island.json (what its ranks load).

        Its paths absolute: an island file's relative paths are taken from the file's folder,
        and the run's defaults are relative to the working directory (a run file without
        ``workdir`` or ``data.cache_dir`` had its islands write their summaries, and
        tokenise the corpus, under islands/NAME/runs/run/... and islands/NAME/.cache/...)."""
        d = (self.workdir / "islands" / spec.name).resolve()
        d.mkdir(parents=True, exist_ok=True)
        data = dataclasses.replace(
            self.cfg.data, cache_dir=str(Path(self.cfg.data.cache_dir).resolve())
        )
        icfg = IslandConfig(
            island=spec.name,
            coordinator_url=self.island_urls.get(spec.name, self.url or "http://127.0.0.1:9"),
            model=self.cfg.model, deepspeed_config=str(Path(self.cfg.deepspeed_config).resolve()),
            data=data, train=self.cfg.train_of(spec), shard=shard, num_shards=num_shards,
            workdir=str(d), start_together=0 if plain else len(self.cfg.islands),
            connect_timeout_s=ISLAND_CONNECT_S, coordinator_ca=self._coordinator_ca(spec.name),
        )  # fmt: skip
        (d / "island.json").write_text(json.dumps(plain_dict(icfg), indent=1))
        return d / "island.json"

    def start_island(self, spec, shard: int, num_shards: int, plain: bool = False):
        """One island through the deepspeed launcher, in its own process group.

        ``plain`` runs the same job as plain ZeRO-3, without the coordinator (benchmarks).
        """
        d = self.write_island_config(spec, shard, num_shards, plain).parent
        # The same port for each launch, as a master_port the file names: a new one each
        # restart used up a DS_DILOCO_PORTS range (ports handed out are not given again),
        # and the run ended with "no free port" where it would have restarted the island.
        port = spec.master_port or self._island_ports.get(spec.name)
        if not port:
            port = self._island_ports[spec.name] = free_port()
        slots = self._slots_for_launch(spec)
        cmd = [*launcher_cmd(spec, port, slots, self._devices), "--module", "ds_diloco.cli",
               "island"]  # fmt: skip
        cmd += [*(["--plain"] if plain else []), "--config", str(d / "island.json")]
        with stop_deferred(), (d / "log.txt").open("a") as log:  # restarts append to the same log
            self._log_at[spec.name] = self._log_read[spec.name] = log.tell()  # this launch's
            self._stall_seen.pop(spec.name, None)  # lines begin here
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.islands[spec.name] = proc
            self._island_args[spec.name] = (spec, shard, num_shards, plain)
        if slots is not None:
            self._launched_slots[spec.name] = slots
            self.rank_watch.watch(spec.name, proc.pid, len(slots))
        return proc

    def _slots_for_launch(self, spec) -> tuple[int, ...] | None:
        """A local island's slots for its next launch (None: on other hosts, all of them)."""
        every = self._gpu_slots.get(spec.name) or local_slots(spec)
        if every is None:
            return None
        state = self.slot_states.setdefault(spec.name, SlotState(tuple(every)))
        state, slots, back = launch_slots(state, time.monotonic())
        self.slot_states[spec.name] = state
        self._upscale_from.pop(spec.name, None)
        if back:
            self.event("island upscaled", island=spec.name, slots_back=list(back),
                       slots=list(slots), why="slot_quarantine_s is over")  # fmt: skip
        return slots

    def _upscale_due(self, name: str, now: float) -> bool:
        """A downscaled island whose left-out slot's quarantine is over, and that has written
        a checkpoint since it was (the checkpoint named by ``latest`` changed)."""
        launched, state = self._launched_slots.get(name), self.slot_states.get(name)
        spec = self._island_args[name][0]
        if launched is None or not self.cfg.train_of(spec).checkpoint_every:
            return False
        if len(launch_slots(state, now)[1]) <= len(launched):
            self._upscale_from.pop(name, None)
            return False
        tag = _latest_checkpoint(self.island_dir(name))
        if tag == f"step{self.cfg.train_of(spec).steps}":
            return False  # its last step: it is flushing and leaving, not to be stopped
        return self._upscale_from.setdefault(name, tag) != tag

    def _blame_slot(self, name: str, first_dead: int | None) -> None:
        """After a launch died (``first_dead``: its rank seen dying first): leave out the
        slot whose rank keeps dying first."""
        launched = self._launched_slots.get(name)
        if launched is None:
            return
        state, out, why = after_death(
            self.slot_states[name], launched, first_dead, self.cfg.downscale_after,
            self.cfg.slot_quarantine_s, time.monotonic(),
        )  # fmt: skip
        self.slot_states[name] = state
        if out is not None:
            left = [s for s in launched if s != out]
            self.event("island downscaled", island=name, slot_out=out, slots=left, why=why,
                       back_in_s=self.cfg.slot_quarantine_s)  # fmt: skip

    def island_dir(self, name: str) -> Path:
        return self.workdir / "islands" / name

    def rank_pids(self, name: str) -> dict[int, int]:
        """The live rank processes of an island's current launch, by rank."""
        import psutil

        out = {}
        try:
            procs = psutil.Process(self.islands[name].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for p in procs:
            try:
                rank = local_rank(p.cmdline())
            except psutil.NoSuchProcess:
                continue
            if rank is not None:
                out[rank] = p.pid
        return out

    # ----------------------------------------------------------- supervision
    def event(self, what: str, **info) -> None:
        self.events.append({"t": round(time.monotonic() - self._t0, 2), "event": what, **info})
        print(f"[supervisor] {what} {info or ''}".rstrip(), flush=True)

    def supervise(self) -> None:
        """Restart what died: an island whose launcher exited non-zero (a ZeRO-3 island cannot
        go on without a rank), and a coordinator that exited, each after a bounded backoff."""
        now = time.monotonic()
        for name, proc in list(self.islands.items()):
            _group_done(proc)  # noted as soon as seen: its pid may be anyone's later
            if name in self._restart_at:
                if now >= self._restart_at[name]:
                    del self._restart_at[name]
                    self.start_island(*self._island_args[name])
                    self.event("island restarted", island=name, restart=self.restarts[name])
                continue
            rc = proc.poll()
            watched = rc != 0 and name not in self.given_up
            stall = self._look_for_stall(name, now) if watched else None
            if rc is None and not stall and self._upscale_due(name, now):
                # Its left-out slot is repaired and it has just checkpointed: stopped now, it
                # loses only the steps since, and goes on with every slot (not a death).
                _signal_group(proc, signal.SIGTERM)
                _wait(proc, 30)
                self.start_island(*self._island_args[name])
                continue
            if rc is None and stall and now - stall[1] >= STALL_DUMP_S:
                # A rank's watch (train.stall_exit_s, train.startup_stall_s) stopped it: the
                # launch cannot go on (ZeRO-3 without a rank), and its launcher would wait
                # 30 s for a frozen rank's SIGTERM before its SIGKILL. Killed once every
                # rank's stacks had STALL_DUMP_S to be written.
                _wait(proc, 0.0)
                rc = proc.poll()
            if rc is None or rc == 0 or name in self.given_up:
                continue
            _signal_group(proc, signal.SIGKILL)  # ranks the launcher left behind (if any)
            if rc == Superseded.exit_code:  # a restart would take the island back: ping-pong
                self.given_up.add(name)
                self.superseded.add(name)
                self.event("island superseded", island=name, exit=rc)
                continue
            if rc == INPUT_ERROR_EXIT:  # its config or input: a restart fails the same way
                self.given_up.add(name)
                error = _error_line(self.workdir / "islands" / name / "log.txt")
                self.event("island given up", island=name, exit=rc, why="config or input error",
                           **({"error": error} if error else {}))  # fmt: skip
                continue
            n = self.restarts.get(name, 0)
            if n >= self.cfg.max_restarts:
                self.given_up.add(name)
                self.event("island given up", island=name, exit=rc, restarts=n)
                continue
            self.restarts[name] = n + 1
            delay = self._backoff(n)
            self._restart_at[name] = now + delay
            what = "island diverged" if rc == Diverged.exit_code else "island died"
            why = {}
            if stall:  # a rank's own watch stopped it
                train = self.cfg.train_of(self._island_args[name][0])
                why["why"] = stall_reason(stall[0], train.stall_exit_s, train.startup_stall_s)
            # Read once: the event and the blame name the same rank (the watch's thread
            # may decide between two reads).
            first = self.rank_watch.first_dead(name)
            if first is not None:  # while the others ran: the launcher stopped those
                why["first_to_die"] = f"rank {first}"
            self.event(what, island=name, exit=rc, restart_in_s=delay, **why)
            # Neither a diverged model, nor a stall, nor a failure every rank raised together
            # (LearnerError: could not reach the coordinator, ...) is a dead slot's doing (in
            # a stall the ranks that exit first are the ones left waiting for a frozen peer).
            if rc not in (Diverged.exit_code, LearnerError.exit_code) and not stall:
                self._blame_slot(name, first)
        self._supervise_coordinator(now)

    def _look_for_stall(self, name: str, now: float) -> tuple[str, float] | None:
        """(how long, when first seen) if a rank of island ``name``'s launch wrote that its
        watch stopped it (``_stall_line``), else None. Asked every supervision round of a
        launch that has not exited cleanly: only the log's new bytes are read."""
        if name not in self._stall_seen:
            log = self.island_dir(name) / "log.txt"
            try:
                size = log.stat().st_size
            except FileNotFoundError:
                return None
            read = self._log_read.get(name, 0)
            if size <= read:
                return None
            # From a little before: the line may have been cut between two reads.
            found = _stall_line(log, max(self._log_at.get(name, 0), read - 64))
            if found is not None:
                self._stall_seen[name] = (found, now)
            self._log_read[name] = size
        return self._stall_seen.get(name)

    def _backoff(self, restarts: int) -> float:
        """The wait before restarting a process restarted ``restarts`` times already."""
        return min(self.cfg.restart_backoff_s * 2**restarts, MAX_BACKOFF_S)

    def _supervise_coordinator(self, now: float) -> None:
        """Restart a coordinator that exited (or hung: ``_hung``) as an island is
        (``max_restarts``, ``_backoff``), and not before ``coordinator_hold_until``; past
        ``max_restarts`` the run stops (restarted at once and without end, a coordinator
        that crashed whenever it served kept the run going round that loop). The new one
        is spawned, not waited for: the islands reach it when it is up, supervision goes on
        meanwhile, and one that exits while starting is one more death (waited for, one
        that exited before it answered stopped the run at once, and supervision stood
        still for up to 120 s)."""
        c = self.coordinator
        if c is None or self._stopping or (c.poll() is None and not self._hung(c, now)):
            return
        _group_done(c)  # noted as soon as seen: its pid may be anyone's later
        if self._coordinator_restart_at is None:  # newly dead
            delay = 0.0
            if now >= self.coordinator_hold_until:  # not killed on purpose (chaos): a death
                n = self._coordinator_deaths
                if n >= self.cfg.max_restarts:
                    self.event("coordinator given up", exit=c.returncode, restarts=n)
                    log = self.workdir / "coordinator.log"
                    raise CoordinatorStartError(
                        f"the coordinator died {n + 1} times, more than max_restarts "
                        f"({self.cfg.max_restarts}) allows; the last time with exit status "
                        f"{c.returncode} (log: {log}, last line: {_last_line(log)})"
                    )
                self._coordinator_deaths, delay = n + 1, self._backoff(n)
            self.coordinator_restarts += 1
            self._coordinator_restart_at = now + delay
            self.event("coordinator died", exit=c.returncode, restart_in_s=delay)
        if now >= max(self._coordinator_restart_at, self.coordinator_hold_until):
            self._coordinator_restart_at = None
            self.spawn_coordinator()
            self.event("coordinator restarted", restart=self.coordinator_restarts)

    def _hung(self, c: subprocess.Popen, now: float) -> bool:
        """Whether the live coordinator ``c`` answered once and has not answered its health
        check for ``coordinator_hang_s`` since; then it is killed (it would not hear a
        SIGTERM: its event loop is stuck), and its death restarts it. Asked every
        ``HEALTH_EVERY_S``: on a hung one each ask waits ``HEALTH_TIMEOUT_S``. Before the
        kill, SIGUSR1 has it write every thread's stack into its log."""
        hang = self.cfg.coordinator_hang_s
        if hang <= 0 or now < self._health_at:
            return False
        self._health_at = now + HEALTH_EVERY_S
        try:
            self._health.health()
            self._answered_at = time.monotonic()
            return False
        except Exception:  # no answer (or not a coordinator's): counted below
            pass
        if self._answered_at is None:  # still starting (or never up): not a hang
            return False
        silent = time.monotonic() - self._answered_at
        if silent < hang:
            return False
        self.event("coordinator hung", silent_s=round(silent, 1), coordinator_hang_s=hang,
                   log=str(self.workdir / "coordinator.log"))  # fmt: skip
        # Its threads' stacks into its log first (faulthandler, which needs no GIL and no
        # event loop: see server.serve_forever): what it hung on is kept for a fix.
        with contextlib.suppress(ProcessLookupError):
            os.kill(c.pid, signal.SIGUSR1)
        _wait(c, HANG_DUMP_S)  # then SIGKILL, and its group gone
        return True

    def finished(self) -> bool:
        """Every island exited cleanly or was given up, and none waits for a restart."""
        if self._restart_at:
            return False
        return all(
            p.poll() is not None and (p.returncode == 0 or n in self.given_up)
            for n, p in self.islands.items()
        )

    def failed_islands(self) -> dict[str, int]:
        return {n: self.islands[n].returncode for n in sorted(self.given_up)}

    def stop(self) -> None:
        """Islands first (their process groups), then the coordinator, which saves. A stop
        signal that comes meanwhile is raised once all are stopped (``stop_deferred``)."""
        with stop_deferred():
            self._stopping = True
            self._restart_at.clear()
            for p in self.islands.values():
                _signal_group(p, signal.SIGTERM)
            for p in self.islands.values():
                _wait(p, 30)
            self._leave_stopped()
            if self.coordinator is not None:
                _signal_group(self.coordinator, signal.SIGTERM)
                _wait(self.coordinator, 60)
            self.rank_watch.close()

    def _leave_stopped(self) -> None:
        """Tell the coordinator that the islands stopped here (or given up) left the run, as
        a finished island does itself: killed, they could not, and the time until a
        ``--resume`` registers them again counted as allocated to them (goodput). Not a
        finished one (its leave is when it finished) nor a superseded one (another launch
        of it is the island now)."""
        names = [
            n for n, p in self.islands.items() if p.returncode != 0 and n not in self.superseded
        ]
        if not names or self.coordinator is None or self.coordinator.poll() is not None:
            return
        for name in names:
            try:
                self._health.leave(name)  # the watch's client: HEALTH_TIMEOUT_S, no retries
            except RefusedError:  # never registered (stopped while starting)
                continue
            except Exception:  # unreachable or hung: its state stays as it is
                return

    def discard_state(self) -> None:
        """After ``stop``: the coordinator state of a fresh run stopped before its islands
        started (its set-up refused an input). A ``coordinator.state_dir`` outside the
        workdir keeps it, and the next fresh run took it for an earlier run's and refused
        to start (``_refuse_foreign_state``). The folder goes if this run made it, else
        what the coordinator writes there."""
        state = Path(self.cfg.coordinator.state_dir)
        if not self._state_was_there:
            shutil.rmtree(state, ignore_errors=True)
            return
        for name in ("coordinator.json", "versions.json"):
            (state / name).unlink(missing_ok=True)
            spare_path(state / name).unlink(missing_ok=True)
        for name in ("fragments", "model"):
            shutil.rmtree(state / name, ignore_errors=True)

    # ------------------------------------------------------------- progress
    def island_records(self) -> dict[str, dict]:
        out = {}
        for spec in self.cfg.islands:
            record = _last_record(self.workdir / "islands" / spec.name / "progress.jsonl")
            if record is not None:
                out[spec.name] = record
        return out

    def progress_line(self, client: CoordinatorClient) -> str:
        cells, left = [], []
        steps = {s.name: self.cfg.train_of(s).steps for s in self.cfg.islands}
        for name, r in sorted(self.island_records().items()):
            if r.get("done"):
                cells.append(f"{name}: done ({r['steps']} steps)")
                continue
            loss = f"{r['loss']:.3f}" if "loss" in r else "-"  # none before the first step
            step, tokens = r.get("step", 0), r.get("tokens", 0)
            # One given up trains no more: its last rate and its time left would stand still.
            if name in self.given_up:
                what = "superseded" if name in self.superseded else "given up"
                cells.append(f"{name}: {what} at step {step}/{steps[name]} loss {loss}")
                continue
            cell = f"{name}: step {step}/{steps[name]} loss {loss} tok {tokens}"
            rate = self.rates.add(name, r.get("seconds"), step, tokens)
            if rate is not None:
                tok_s, step_s = rate
                cell += f" ({tok_s:,.0f} tok/s)"
                if step_s > 0:
                    left.append((steps[name] - step) / step_s)
            cells.append(cell)
        try:
            st = client.status()
            v, m = st["versions"], st["merges"]
            coord = (
                f"versions {min(v)}..{max(v)}  merges/fragment {min(m)}..{max(m)} (total {sum(m)})"
            )
        except Exception as e:  # the coordinator may be restarting
            coord = f"coordinator unreachable ({type(e).__name__})"
        eta = f"  left ~{duration_text(max(left))}" if left else ""  # the slowest island's
        return f"[{' | '.join(cells) or 'starting'}]  {coord}{eta}"


class IslandRates:
    """Each island's tokens and steps per second over the last ``window_s`` of its
    training, from its progress records (``seconds``: since its launch's first step)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._seen: dict[str, list[tuple[float, int, int]]] = {}  # (seconds, step, tokens)

    def add(self, name: str, seconds: float | None, step: int, tokens: int):
        """Take a record's reading (``seconds`` None: a record without it, e.g. an
        evaluation's); (tokens/s, steps/s) over the window, or None before two readings
        of one launch. A relaunched island (its clock or its step back) starts over."""
        seen = self._seen.setdefault(name, [])
        if seconds is not None and (not seen or seconds != seen[-1][0]):
            if seen and (seconds < seen[-1][0] or step < seen[-1][1]):
                seen.clear()
            seen.append((seconds, step, tokens))
            while len(seen) > 2 and seconds - seen[1][0] >= self.window_s:  # keep one older
                seen.pop(0)
        if len(seen) < 2:
            return None
        (t0, step0, tok0), (t1, step1, tok1) = seen[0], seen[-1]  # t1 > t0: kept in order
        return (tok1 - tok0) / (t1 - t0), (step1 - step0) / (t1 - t0)


def duration_text(seconds: float) -> str:
    """45s, 3m05s, 2h10m."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressPrinter:
    """Prints a progress line when it changed, and an unchanged one again only after
    ``quiet_s`` (a run waiting on its islands' start-up said ``[starting]`` every 5 s)."""

    def __init__(self, quiet_s: float = QUIET_REPEAT_S, clock=time.monotonic, out=print):
        self.quiet_s, self.clock, self.out = quiet_s, clock, out
        self.last: str | None = None
        self.printed_at = -math.inf

    def __call__(self, line: str) -> bool:
        """Print ``line`` if it is news or the last print is ``quiet_s`` old; True if printed."""
        now = self.clock()
        if line == self.last and now - self.printed_at < self.quiet_s:
            return False
        self.out(line, flush=True)
        self.last, self.printed_at = line, now
        return True


class Stopped(KeyboardInterrupt):
    """The run was told to stop by a signal: SIGINT (Ctrl-C), SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


@contextlib.contextmanager
def stop_on_signals():
    """Inside, SIGINT and SIGTERM raise :class:`Stopped` in the main thread, whatever the
    process inherited: the islands and the coordinator live in process groups of their
    own, so a run killed outright would leave them all running (``kill PID``, a scheduler's
    stop), and a run started in the background by a shell inherits SIGINT ignored. So does
    SIGHUP (its terminal closed, its ssh session dropped), unless ignored: ``nohup`` asks
    the run to outlive its terminal. (A run SIGKILLed: ``orphan_exit``.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    stopping = False

    def raise_stopped(signum, _frame):
        nonlocal stopping
        if stopping:  # the stop under way has bounded waits, then kills: let it finish
            print(f"{signal.Signals(signum).name}: already stopping", flush=True)
            return
        stopping = True
        if _deferred["depth"]:  # see stop_deferred
            _deferred["pending"] = signum
            return
        raise Stopped(signum)

    signals = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signals.append(signal.SIGHUP)
    old = {s: signal.signal(s, raise_stopped) for s in signals}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


_deferred = {"depth": 0, "pending": None}
"""Blocks inside ``stop_deferred``; a stop signal that came meanwhile."""


@contextlib.contextmanager
def stop_deferred():
    """Inside, a stop signal (``stop_on_signals``) is acted on, :class:`Stopped` raised, only
    once the block is done, even if it failed. For starting a process and recording it:
    raised between fork and ``Popen`` returning, a Stopped left the new launcher running,
    never recorded, so ``stop`` did not stop it (60 of 150 signals timed into a start here).
    For stopping: raised mid-stop, it left the processes not yet stopped running."""
    _deferred["depth"] += 1
    try:
        yield
    finally:
        _deferred["depth"] -= 1
        signum = None
        if _deferred["depth"] == 0:
            signum, _deferred["pending"] = _deferred["pending"], None
        if signum is not None:
            raise Stopped(signum)


def _status_or_none(client: CoordinatorClient) -> dict | None:
    try:
        return client.status()
    except Exception:  # restarting: the next round has it
        return None


class Board:
    """TensorBoard scalars of a run: each island's loss (every progress record), goodput,
    uptime and merges (at every progress print)."""

    def __init__(self, logdir: Path, islands_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(logdir))
        self.lock = threading.Lock()  # the run's loop and its background evaluations write
        self.islands_dir = islands_dir
        self.read: dict[str, int] = {}  # bytes of each progress.jsonl already written
        self.t0 = time.monotonic()

    def _new_records(self):
        for path in sorted(self.islands_dir.glob("*/progress.jsonl")):
            name = path.parent.name
            with path.open("rb") as f:
                f.seek(self.read.get(name, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only
            self.read[name] = self.read.get(name, 0) + end
            for line in data[:end].splitlines():
                record = _json_or_none(line)
                if isinstance(record, dict):
                    yield name, record

    def scalar(self, tag: str, value: float, step: int) -> None:
        with self.lock:
            self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def write(self, status: dict | None) -> None:
        with self.lock:
            self._write(status)

    def _write(self, status: dict | None) -> None:
        t = time.monotonic() - self.t0
        for name, r in self._new_records():
            if "loss" in r and "step" in r:
                self.writer.add_scalar(f"loss/{name}", r["loss"], r["step"])
            if "heldout_loss" in r:
                self.writer.add_scalar(f"heldout_loss/{name}", r["heldout_loss"], r["step"])
        if status:
            step = int(t)
            for key in ("goodput", "uptime"):
                if status["run"].get(key) is not None:
                    self.writer.add_scalar(f"run/{key}", status["run"][key], step)
            self.writer.add_scalar("run/merges", sum(status["merges"]), step)
        self.writer.flush()

    def close(self) -> None:
        with self.lock:
            self.writer.close()


def _signal_group(p: subprocess.Popen, sig) -> None:
    """Signal ``p``'s process group: also after ``p`` itself exited, while its children live;
    not once the group was seen empty (``_group_done``)."""
    if getattr(p, "group_done", False):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)


def _group_done(p: subprocess.Popen) -> bool:
    """Whether ``p`` exited and its process group emptied, noted on ``p`` when first seen.

    From then on the pid is free for the system to give out again, and a new group leader
    with it would be signalled as ``p``'s group (``stop`` SIGKILLed an unrelated job so).
    While a process of the group lives, the kernel keeps its pgid from being reused."""
    if not getattr(p, "group_done", False) and p.poll() is not None and not _group_alive(p.pid):
        p.group_done = True
    return getattr(p, "group_done", False)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is still in the process group ``pgid``: the
    launcher's children can outlive it (its ``launch.py`` waits for the ranks it stops)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)"
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether the process group ``pgid`` empties within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _wait(p: subprocess.Popen, timeout: float) -> None:
    """Until ``p`` and every process of its group are gone; SIGKILL the group after
    ``timeout`` s."""
    if getattr(p, "group_done", False):
        return
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=timeout)
    if p.poll() is None or not _group_gone(p.pid, deadline - time.monotonic()):
        _signal_group(p, signal.SIGKILL)
        p.wait(timeout=10)
        _group_gone(p.pid, 10)
    p.group_done = True


def _last_line(log: Path) -> str:
    """The last line of a process's log, as the reason it exited."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return lines[-1] if lines else "(no output)"


def _error_line(log: Path) -> str | None:
    """The island's own error line in its log (``ds-diloco: error: ...``, every rank's the
    same; the launcher's lines come after it), without the prefix; None if there is none."""
    prefix = "ds-diloco: error: "
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((ln[len(prefix) :] for ln in reversed(lines) if ln.startswith(prefix)), None)


def _read_end(path: Path, since: int, tail_bytes: int) -> str | None:
    """A growing file's text from ``since``, at most its last ``tail_bytes``; None if the
    file is not there."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(since, size - tail_bytes))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def stall_reason(timeout: str, loop_s: float, startup_s: float) -> str:
    """Why an island stopped whose rank's watch fired after ``timeout`` (faulthandler's
    ``H:MM:SS``): the training loop's (``train.stall_exit_s``, ``loop_s``) or the start-up's
    (``train.startup_stall_s``, ``startup_s``), told apart by their limits."""
    h, m, s = timeout.split(":")
    fired_s = int(h) * 3600 + int(m) * 60 + float(s)
    loop, startup = (bool(x) and abs(fired_s - x) < 0.5 for x in (loop_s, startup_s))
    if startup and not loop:
        what = f"a rank spent train.startup_stall_s ({timeout}) in one phase of its start-up"
    elif loop and not startup:
        what = f"a rank's training loop did not come round for train.stall_exit_s ({timeout})"
    else:
        what = (f"a rank's start-up or training loop did not get on for {timeout} "
                "(train.startup_stall_s, train.stall_exit_s)")  # fmt: skip
    return f"stalled: {what}; the ranks' stacks are in its log"


def _stall_line(log: Path, since: int, tail_bytes: int = 1 << 20) -> str | None:
    """How long a rank of the launch whose lines begin at ``since`` went without a step
    before its watch stopped it (faulthandler's ``Timeout (0:10:00)!``, ``StallExit``), or
    None if none did."""
    text = _read_end(log, since, tail_bytes)
    if text is None:
        return None
    found = re.search(r"Timeout \((\d+:\d\d:\d\d(?:\.\d+)?)\)!", text)  # ranks' lines may mix
    return found.group(1) if found else None


def _last_record(path: Path, tail_bytes: int = 1 << 16) -> dict | None:
    """The last whole record of a progress file, reading only its end: the file grows
    by a record every few steps for the whole run, and this is read every few seconds.
    An end without one is read again, twice as long: an island's last record lists each
    step's time and memory (over 64 KiB past about 2,500 steps), and was not found."""
    while True:
        text = _read_end(path, 0, tail_bytes)
        if text is None:
            return None
        for line in reversed(text.splitlines()):  # a crash can cut the last line short
            record = _json_or_none(line)
            if isinstance(record, dict):
                return record
        try:
            if path.stat().st_size <= tail_bytes:  # the whole file was read
                return None
        except FileNotFoundError:
            return None
        tail_bytes *= 2


def _latest_checkpoint(island_dir: Path) -> str:
    """The tag (``step<N>``) of an island's newest complete checkpoint; "" if none."""
    from ds_diloco.zero import latest_tag

    try:
        return latest_tag(island_dir / "checkpoints") or ""
    except OSError:
        return ""


def _json_or_none(text: str):
    """A JSON document, or None for a torn one (a crash mid-write, a full disk)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _refuse_foreign_state(cfg: RunConfig) -> None:
    """A fresh run clears its own ``workdir/state``; a ``coordinator.state_dir`` set
    elsewhere is not deleted, and the coordinator would continue from what it holds
    (versions, outer momentum, islands) instead of the initial model."""
    from ds_diloco.state_store import StateStore

    state = Path(cfg.coordinator.state_dir)
    if state.resolve() != (Path(cfg.workdir) / "state").resolve() and StateStore(state).exists():
        raise ValueError(
            f"coordinator.state_dir {str(state)!r} holds an earlier run's state "
            "(coordinator.json): add --resume to continue that run, or remove it or set "
            "another state_dir to start afresh"
        )


def resume_point(cfg: RunConfig) -> dict:
    """What ``--resume`` continues from, per island: ``{"done": True}`` (finished: not
    started again) or ``{"step": N}`` (its last checkpoint, whatever number of ranks wrote
    it; 0: none, its inner loop starts over from the current global model). Raises
    ValueError when there is nothing to resume."""
    from ds_diloco.state_store import StateStore

    state_dir = Path(cfg.coordinator.state_dir)
    if not StateStore(state_dir).exists():
        raise ValueError(
            f"nothing to resume: {str(state_dir)!r} holds no coordinator state (coordinator.json); "
            "start the run without --resume"
        )
    out = {}
    for spec in cfg.islands:
        d = Path(cfg.workdir) / "islands" / spec.name
        done = d / "summary-rank0.json"
        summary = _json_or_none(done.read_text()) if done.is_file() else None
        if isinstance(summary, dict) and summary.get("steps", 0) >= cfg.train_of(spec).steps:
            out[spec.name] = {"done": True}
            continue
        tag = _latest_checkpoint(d)
        out[spec.name] = {"step": int(tag[4:]) if tag.startswith("step") else 0}
    return out


def resumed_starts(workdir: Path, point: dict, since: float) -> dict:
    """``point`` (:func:`resume_point`, the plan) with, per island started again, the step
    its first launch since ``since`` (wall clock) really started from (``started_step``,
    from its ``progress.jsonl``; None if it never began training): a resized island whose
    checkpoint could not be converted starts from the global model at step 0, not from
    the planned checkpoint."""
    out = {}
    for name, plan in point.items():
        out[name] = dict(plan)
        if plan.get("done"):
            continue
        path = workdir / "islands" / name / "progress.jsonl"
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        starts = (r for r in map(_json_or_none, lines)
                  if isinstance(r, dict) and r.get("started_at", -1) >= since)  # fmt: skip
        out[name]["started_step"] = next((r.get("step") for r in starts), None)
    return out


def island_summaries(workdir: Path, names: list[str], point: dict | None, since: float) -> dict:
    """Each island's rank-0 summary for the run's ``summary.json``: those written since
    ``since`` (wall clock), and a finished one's that ``point`` (a resume's plan) did not
    start again. An island a resume started again and that did not finish (stopped, given
    up) left its earlier launch's: that launch's steps and tokens, not where it is now."""
    out = {}
    for name in names:
        path = workdir / "islands" / name / "summary-rank0.json"
        island = _json_or_none(path.read_text()) if path.is_file() else None  # torn: left out
        done = point is not None and point.get(name, {}).get("done")
        if isinstance(island, dict) and (done or island.get("finished_at", since) >= since):
            out[name] = island
    return out


def initial_loss(cfg: RunConfig, heldout: torch.Tensor) -> dict:
    """Held-out loss of the model the run started from (built again from ``cfg.model``)."""
    from ds_diloco.hf_model import build_model, mean_loss

    return {"heldout_loss_initial": mean_loss(build_model(cfg.model), heldout)}


def evaluate(cfg: RunConfig, export_dir: Path | None, heldout: torch.Tensor) -> dict:
    """Held-out loss of the merged model, and a sample from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_diloco.hf_model import mean_loss

    out = {}
    if export_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        out["heldout_loss_merged"] = mean_loss(model, heldout)
        tok = AutoTokenizer.from_pretrained(export_dir)
        ids = tok(cfg.prompt, return_tensors="pt").input_ids
        torch.manual_seed(0)
        try:
            # At least 40 new tokens: the demo's merged model, seed 0, ended "ROMEO:" with an
            # EOS at once and the sample printed was the prompt alone.
            gen = model.generate(ids, max_new_tokens=60, min_new_tokens=40, do_sample=True,
                                 top_k=40, temperature=0.8, pad_token_id=tok.pad_token_id)  # fmt: skip
            out["sample"] = tok.decode(gen[0], skip_special_tokens=True)
        except RuntimeError as e:
            # Logits that are not finite (weights blown up by a diverged island, say): the
            # run ended with a traceback here, after its export, and wrote no summary.
            out["sample"] = None
            print(f"no sample from the merged model (held-out loss "
                  f"{out['heldout_loss_merged']:.4g}): {e}", flush=True)  # fmt: skip
    return out


def _drive(
    cfg: RunConfig, lr: LocalRun, point: dict | None, heldout: torch.Tensor
) -> tuple[int, dict | None, list[dict]]:
    """Start the islands (or resume them at ``point``) with the spawned coordinator,
    supervise them until every island is done, and return (exit code, the coordinator's
    last status, the periodic evaluations of the global model).

    A fresh run starts its islands while the coordinator starts up. A resumed one first
    reads where the coordinator resumed: islands already training could merge before
    that status is read."""
    if point is None and lr.coordinator.poll() is None:  # exited already: said just below
        lr.start_islands()
    client = lr.wait_for_coordinator()
    print(f"coordinator at {lr.url} (state {cfg.coordinator.state_dir})", flush=True)
    if lr.token_file is not None:
        ca = f" --ca-file {cfg.coordinator.tls_cert}" if cfg.coordinator.tls_cert else ""
        print(f"  watch it: ds-diloco status {lr.url} --token-file {lr.token_file}{ca}", flush=True)
    board = Board(lr.workdir / "tensorboard", lr.workdir / "islands")
    exports = PeriodicExport(cfg, lr)
    evals = PeriodicEval(cfg, lr, heldout, board)
    if point is not None:
        st = client.status()
        lr.start_islands(skip={n for n, p in point.items() if p.get("done")})
        where = {n: "finished" if p.get("done") else f"from step {p['step']}"
                 for n, p in point.items()}  # fmt: skip
        print(f"resuming at versions {st['versions']} (merges {st['merges']}); "
              f"islands {where}", flush=True)  # fmt: skip
        for periodic in (exports, evals):  # the next ones after the merges made already
            periodic.resume_at(sum(st["merges"]))
        board.read = {p.parent.name: p.stat().st_size  # records already on the board
                      for p in (lr.workdir / "islands").glob("*/progress.jsonl")}  # fmt: skip
    sizes = ", ".join(f"{s.name} x{s.world_size}" for s in cfg.islands)
    print(f"islands: {sizes}; logs in {lr.workdir / 'islands'}", flush=True)
    next_print = time.monotonic()
    show = ProgressPrinter()
    while not lr.finished():
        lr.supervise()
        if time.monotonic() >= next_print:
            show(lr.progress_line(client))
            status = _status_or_none(client)
            board.write(status)
            exports.maybe(status)
            evals.maybe(status)
            next_print += PROGRESS_EVERY_S
        time.sleep(0.2)
    show(lr.progress_line(client))
    final_status = _status_or_none(client)
    exports.maybe(final_status)  # a short run may cross its first export only at the end
    exports.join()
    evals.finish(final_status)  # the last point of the curve: the final global model
    board.write(final_status)
    board.close()
    failed = lr.failed_islands()
    if lr.superseded:
        print(f"islands superseded (another launch of each registered with the coordinator "
              f"since; not restarted): {sorted(lr.superseded)}", flush=True)  # fmt: skip
    others = {n: rc for n, rc in failed.items() if n not in lr.superseded}
    if others:
        print(f"islands failed: {others} (see their log.txt)", flush=True)
    return (ISLANDS_FAILED if failed else 0), final_status, evals.records


def run(cfg: RunConfig, resume: bool = False) -> int:
    """A whole run; ``resume`` continues a stopped one (see the module docstring)."""
    from ds_diloco.data import (
        as_tensor,
        check_shards,
        check_source,
        heldout_split,
        prepare_section,
        section_tokenizer,
    )  # fmt: skip
    from ds_diloco.export import check_out_folder, export

    if cfg.push_to_hub:  # before the run, not after it
        from ds_diloco.hub import resolve_token

        resolve_token(cfg.push_to_hub)
    if cfg.export:
        check_out_folder(Path(cfg.workdir) / "export")
    check_source(cfg.data.path)  # before a fresh run clears the last one's outputs
    point = resume_point(cfg) if resume else None
    earlier = _earlier_summary(Path(cfg.workdir)) if resume else {}
    began = time.time()  # this run's progress records are the ones written from now on
    lr = LocalRun(cfg, fresh=not resume)
    d = cfg.data
    t0 = time.monotonic()
    code, final_status, stopped_by, global_evals = 0, None, None, []
    set_up = False  # until then, nothing trained: a fresh run's state is not kept
    with stop_on_signals():
        try:
            lr.spawn_coordinator()  # it starts up while the data is prepared
            print(f"preparing data from {d.path} ...", flush=True)
            tokenizer, blocks = prepare_section(d)
            train, heldout = heldout_split(blocks, d.heldout_fraction, seed=d.seed)
            check_shards(len(train), {s.name: s.world_size for s in cfg.islands})
            check_islands_inputs(cfg, tokenizer)
            heldout = as_tensor(heldout[:HELDOUT_BLOCKS])
            set_up = True
            code, final_status, global_evals = _drive(cfg, lr, point, heldout)
        except Stopped as e:
            print(f"\ninterrupted ({e}): stopping islands and coordinator ...", flush=True)
            code, stopped_by = e.exit_code, str(e)
        finally:
            try:
                lr.stop()
            except Stopped as e:  # came while a finished run stopped; the stop is done
                print(f"\ninterrupted ({e}) while stopping", flush=True)
                code, stopped_by = e.exit_code, str(e)
            if not set_up and not resume:
                lr.discard_state()
    wall = time.monotonic() - t0
    summary = {"wall_s": round(wall, 1), "islands": {}, "exit": code, "events": lr.events,
               "restarts": lr.restarts, "coordinator_restarts": lr.coordinator_restarts,
               "startup": lr.startup, **card_settings(cfg)}  # fmt: skip
    if point is not None:  # the plan, and where each island's first launch really started
        summary["resumed_from"] = resumed_starts(lr.workdir, point, began)
    if earlier:  # the launches before this resume: their figures are the run's too
        summary["wall_s_total"] = round(
            earlier.get("wall_s_total", earlier.get("wall_s", 0)) + wall, 1
        )
        first = global_evals[0]["merges"] if global_evals else float("inf")
        global_evals = [
            e for e in earlier.get("global_evals", []) if e["merges"] < first
        ] + global_evals
    if global_evals:
        summary["global_evals"] = global_evals
    if stopped_by:
        summary["stopped_by"] = stopped_by
    if code < 128 and final_status is not None:  # not stopped by a signal
        summary["goodput"] = final_status["run"]["goodput"]
        summary["uptime"] = final_status["run"]["uptime"]
        summary["coordinator"] = final_status
    summary["islands"] = island_summaries(lr.workdir, [s.name for s in cfg.islands], point, began)
    state = Path(cfg.coordinator.state_dir) / "coordinator.json"  # none if stopped starting
    summary["merges"] = json.loads(state.read_text())["merges"] if state.exists() else []
    export_dir = g = None
    # Before the export: a run started from its own workdir's export (model.pretrained:
    # runs/<run>/export) replaces that folder, and its "initial" loss was the merged one.
    ended = code in (0, ISLANDS_FAILED)  # not stopped: the coordinator's model is the run's
    initial = initial_loss(cfg, heldout) if ended else {}
    if cfg.export and ended:  # from the state dir: its generation config comes along
        tok = section_tokenizer(d)
        export_dir = lr.workdir / "export"
        g = export(cfg.coordinator.state_dir, export_dir, tokenizer=tok, repo=cfg.push_to_hub)
        summary["export"] = str(export_dir)
        # The export's: with the merges made durable after the table's last save (a crashed
        # coordinator's), which the card would take for another model's figures.
        summary["merges"] = g.merges
    if ended:
        summary.update({**initial, **evaluate(cfg, export_dir, heldout)})
    (lr.workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    _print_summary(summary)
    if g is not None:
        _publish(cfg, g, export_dir, summary)
    return code


def _earlier_summary(workdir: Path) -> dict:
    """What the run's last launch wrote in ``summary.json`` ({} if none or torn): a resume
    rewrites the file, and its held-out losses by merges and time were lost with it."""
    path = workdir / "summary.json"
    earlier = _json_or_none(path.read_text()) if path.is_file() else None
    return earlier if isinstance(earlier, dict) else {}


def _publish(cfg: RunConfig, g, export_dir: Path, summary: dict) -> None:
    """The final export's model card with the run's own figures (held-out losses, islands,
    goodput) and settings (base model, data, outer optimizer, schedule), then, with
    ``push_to_hub``, the folder to the Hub."""
    from ds_diloco.model_card import RunSummary, model_card

    repo = cfg.push_to_hub
    title = repo.split("/")[-1] if repo else Path(cfg.workdir).resolve().name
    card = model_card(g, RunSummary.from_json(summary), title=title, tokenizer=True, repo=repo)
    (export_dir / "README.md").write_text(card)
    if repo:
        from ds_diloco.hub import push_folder

        try:
            url = push_folder(export_dir, repo)
            print(f"pushed {export_dir} to {repo}: {url}", flush=True)
        except Exception as e:  # the run and its export are done: say so, do not lose them
            print(f"[export] pushing {export_dir} to {repo} failed: {e}", flush=True)


def card_settings(cfg: RunConfig) -> dict:
    """The run file's settings, under :class:`RunSummary`'s keys: without them the card said
    "not given" for the base model, data, outer optimizer, H, tau and K, which the
    coordinator's state does not hold (``summary.json`` carries them for
    ``ds-diloco export --run-summary``)."""
    m, c = cfg.model, cfg.coordinator
    o = c.outer
    lr, momentum = (1.0, 0.0) if o.name == "average" else (o.lr, o.momentum)  # what it applies
    return {
        "base_model": m.pretrained or f"none: from scratch ({m.config}, seed {m.seed})",
        "data": cfg.data.path,
        "outer": {"name": o.name, "lr": lr, "momentum": momentum, "H": c.sync_every,
                  "P": c.num_fragments, "tau": c.policy.tau, "K": c.policy.min_quorum},
    }  # fmt: skip


def _print_summary(s: dict) -> None:
    toks = sum(i.get("tokens", 0) for i in s["islands"].values())
    how = f"stopped by {s['stopped_by']} after" if "stopped_by" in s else "finished in"
    total = f" ({s['wall_s_total']} s with the launches it resumed)" if "wall_s_total" in s else ""
    print(f"\nrun {how} {s['wall_s']} s{total}: {toks} tokens over {len(s['islands'])} islands; "
          f"merges per fragment {s['merges']}")  # fmt: skip
    for name, i in s["islands"].items():
        print(f"  {name}: {i['steps']} steps, {i['tokens']} tokens, sync time {i['sync_s']} s "
              f"(max {i['sync_max_s']} s per step), uploads {i['stats']['uploads']}, "
              f"dropped {i['stats']['dropped']}, failed {i['stats']['failed']}, results applied "
              f"late {i['stats'].get('applied_late', 0)} ({i['stats'].get('steps_late', 0)} "
              "steps past tau in all)")  # fmt: skip
    for name, r in s.get("resumed_from", {}).items():  # a resume that did not go as planned
        if not r.get("done") and r.get("started_step") != r["step"]:
            began, ckpt = r.get("started_step"), f"step-{r['step']} checkpoint"
            how = (f"did not begin training (planned: its {ckpt})" if began is None
                   else f"resumed at step {began}, not from its {ckpt}")  # fmt: skip
            print(f"  {name}: {how}; its log.txt says why")
    traffic = (s.get("coordinator") or {}).get("traffic")
    if traffic:  # the coordinator's last launch (a restart counts from 0 again)
        from ds_diloco.status_view import traffic_text

        print(f"coordinator traffic: {traffic_text(traffic)}")
    if "heldout_loss_initial" in s:
        line = f"held-out loss: initial {s['heldout_loss_initial']:.3f}"
        if "heldout_loss_merged" in s:
            line += f" -> merged {s['heldout_loss_merged']:.3f}"
        print(line)
    if s.get("global_evals"):  # the merged model as the run went (eval_every_merges)
        steps = ", ".join(f"{e['heldout_loss']:.3f} ({e['merges']})" for e in s["global_evals"])
        print(f"merged model's held-out loss by merges: {steps}")
    if "export" in s:
        print(f"merged model: {s['export']} (AutoModelForCausalLM.from_pretrained loads it)")
    if s.get("sample") is not None:
        print(f"sample: {s['sample']!r}")
