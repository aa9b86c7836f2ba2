"""``ds-diloco bench coordinator``: the coordinator's two hot paths against plain baselines.

(a) Outer step: the work ``Coordinator._merge`` does for one round, with the same
functions and the same memory layout: ``merge.merge_fragment`` over K separate
(F,) fp32 rows (the coordinator's ``BufferPool`` buffers), squared norms precomputed
per segment (the coordinator computes them at ingest), into a preallocated gradient, then
``NesterovSGD.step``. Counted bytes: (K + 2) x F x 4 (K contributions, the
global values, the momentum buffer). Baseline: ``dst.copy_(src)`` of as many
bytes, both tensors preallocated.

(b) Upload: one rank of a world-size-1 island sends a whole fragment to a real
coordinator (``server.ServerThread``) over loopback, timed from
``client.upload_body(body)`` (body pre-encoded) until the JSON reply is in.
Baseline: a raw TCP ``sendall`` of as many bytes to a thread that reads them all
into a preallocated buffer and answers 1 byte (the same request/response shape).
No merge runs while timing: a second island is registered and never uploads,
and ``min_quorum`` is 2, so the round never closes (checked: the version must
not move). The same body sent to ``Coordinator.upload`` in-process splits the
HTTP time into the coordinator's work and the transport's.

(c) Coordinator CPU per round: what a coordinator costs the host it runs on for
one round of the island bench's workload. The coordinator runs as its own
process (``ds-diloco coordinator``, as in production and in ``bench island``);
each of the W ranks of one island (a thread here) uploads its slices of the
fragment and waits for the new version in the long poll that answers with its slices
(read into preallocated tensors), as the syncer does; quorum 1, so every round merges, with
the outer Nesterov step and the durable write. Reported: the process's CPU time
(user + system, from ``/proc``, in 10 ms ticks: so over all rounds) per round,
at the fragment size asked for and at the tiny Llama's (about 2 MiB, 8 fragments
in ``bench island``). No baseline: the figure is what competes with the islands
for the cores.

(d) Coordinator memory: a coordinator in its own process, the model of (a) cut into
P = 8 fragments, M = 4 islands of one rank syncing them in turn, all in every round
(K = M), 2P rounds. Reported: how much its RSS grew from before the coordinator was
made (after building the model once: the imports), against what it must hold: the
global values and the outer momentum (twice the model) and M + 3 buffers of the
largest fragment (a row per island, a merge's output, its new values, the outer-state
copy). Rows kept per fragment (before the shared
``BufferPool``) were M + 2 more copies of the whole model.

The machine is noisy: measured and baseline repetitions are interleaved, in an
order that rotates every round, after one untimed warm-up each, and medians are
compared. The ratios are the result; absolute figures depend on the machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ds_diloco import wire
from ds_diloco.bench import shown
from ds_diloco.client import CoordinatorClient, rank_slices
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.fragments import Fragment, FragmentPlan, ParamSpec, param_specs
from ds_diloco.merge import (
    DEFAULT_PLAIN_PATTERNS,
    Segment,
    fragment_layout,
    merge_fragment,
    segment_sq_norms,
    token_weight,
)
from ds_diloco.outer_optim import OuterOptimConfig, build_outer_optimizer
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread

GOAL = 0.8
"""Both ratios should reach this: the coordinator's paths run near memory/socket speed."""

DEFAULT_KS = (1, 4, 8)
"""Contributions per merge always measured, besides ``--contributions``."""

TOKEN = "bench-token"
_LAYERS = 4
TINY_FRAGMENT_MB = 2.0
"""About one fragment of the tiny Llama in ``bench island`` (16 MiB fp32 in 8 fragments)."""
ROUNDS_PER_REPEAT = 4
"""(c): timed rounds per ``--repeats``: CPU times come in 10 ms ticks."""


# --------------------------------------------------------------------- results
@dataclass
class Timing:
    """One side of a comparison: wall seconds per repetition for ``nbytes`` of work."""

    label: str
    nbytes: int
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.median_s

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "median_s": self.median_s,
            "bytes_per_s": self.bytes_per_s,
        }


@dataclass
class Comparison:
    """A measured path and its baseline over the same bytes; ``phases``: medians of parts."""

    name: str
    measured: Timing
    baseline: Timing
    phases: dict[str, float] = field(default_factory=dict)
    goal: float = GOAL

    @property
    def ratio(self) -> float:
        return self.measured.bytes_per_s / self.baseline.bytes_per_s

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal

    def shown_ratio(self) -> str:
        """The ratio with the decimals that make it compare with the goal as the verdict."""
        return shown(self.ratio, self.goal, self.met, at_most=False, least=2)[0]

    def verdict(self) -> str:
        return f"goal >= {self.goal:g}: {'met' if self.met else 'MISSED'}"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "measured": self.measured.to_json(),
            "baseline": self.baseline.to_json(),
            "ratio": self.ratio,
            "goal": self.goal,
            "met": self.met,
            "phases_median_s": self.phases,
        }


def interleave(
    runs: dict[str, Callable[[], dict[str, float]]], repeats: int
) -> dict[str, dict[str, list[float]]]:
    """One untimed warm-up of each run, then ``repeats`` rounds of all of them.

    The order rotates every round so that no side always follows the same
    other one. Each run times itself and returns seconds per phase, its whole
    time as ``"total"``; returns run -> phase -> seconds per round.
    """
    names = list(runs)
    for name in names:
        runs[name]()
    out: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(repeats):
        i = r % len(names)
        for name in names[i:] + names[:i]:
            for phase, seconds in runs[name]().items():
                out[name].setdefault(phase, []).append(seconds)
    return out


def _medians(phases: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in phases.items() if k != "total"}


# ---------------------------------------------------------------------- model
def _mlp_width(hidden: int) -> int:
    return 64 * math.ceil(8 * hidden / 3 / 64)  # Llama's ~8/3 h, in multiples of 64


def _block_numel(hidden: int) -> int:
    heads = max(1, hidden // 64)
    kv = max(1, heads // 2)
    attn = 2 * hidden * hidden + 2 * hidden * kv * 64  # q, o; k, v (GQA 2:1, head dim 64)
    return attn + 3 * hidden * _mlp_width(hidden) + 2 * hidden  # gate, up, down; 2 norms


def llama_config(fragment_mb: float, layers: int = _LAYERS) -> dict:
    """A Hugging Face Llama config whose parameters are about ``fragment_mb`` MiB of fp32.

    Untied embeddings, head dim 64, GQA 2:1: the widest hidden size whose
    blocks take at most 3/4 of the target, then the vocabulary fills the rest
    (at least 32 tokens, so tiny targets come out somewhat larger).
    """
    if not (math.isfinite(fragment_mb) and fragment_mb > 0):
        raise ValueError(f"--fragment-mb must be a finite number > 0, got {fragment_mb}")
    target = int(fragment_mb * 2**20) // 4
    hidden = 64
    while layers * _block_numel(hidden + 64) <= 0.75 * target:
        hidden += 64
    heads = hidden // 64
    vocab = max(32, (target - layers * _block_numel(hidden) - hidden) // (2 * hidden))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _mlp_width(hidden),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def model_specs(config: dict) -> list[ParamSpec]:
    """Parameter names and shapes of the model ``config`` describes (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return param_specs(model.named_parameters())


def whole_model_layout(specs: Sequence[ParamSpec]) -> tuple[Fragment, list[Segment], list[bool]]:
    """The whole model as one fragment, its segments and RDA flags, as the coordinator sets them."""
    frag = FragmentPlan.build(specs, 1, "balanced").fragments[0]
    segments, rda = fragment_layout(frag, DEFAULT_PLAIN_PATTERNS)
    return frag, segments, rda


# ------------------------------------------------------------ (a) outer step
@dataclass
class OuterStepRun:
    """A finished outer-step comparison and what it computed (for checks)."""

    k: int
    comparison: Comparison
    deltas: list[torch.Tensor]
    """The K (F,) contribution rows that were merged."""
    weights: torch.Tensor
    """(K,) float64 token weights."""
    grad: torch.Tensor
    """The merged pseudo-gradient of the last repetition."""


def outer_step_bytes(fragment_bytes: int, k: int) -> int:
    """What :func:`bench_outer_step` holds for K contributions: K rows, the values,
    gradient and momentum, and the copy baseline's source and destination (K + 2 each)."""
    return fragment_bytes * (k + 3 + 2 * (k + 2))


def check_memory(fragment_mb: float, k: int) -> None:
    """Refuse a fragment size whose outer-step part would not fit in the memory available
    now (it would run the machine out of memory part-way), naming what it would need."""
    import psutil

    need = outer_step_bytes(int(fragment_mb * 2**20), k)
    available = psutil.virtual_memory().available
    if need > available:
        raise ValueError(
            f"--fragment-mb {fragment_mb:g} needs about {need / 2**30:.1f} GiB for the outer "
            f"step with K = {k} ({need // int(fragment_mb * 2**20)} fragment-sized buffers); "
            f"{available / 2**30:.1f} GiB are available"
        )


def bench_outer_step(
    segments: Sequence[Segment], rda: Sequence[bool], k: int, repeats: int, seed: int = 0
) -> OuterStepRun:
    """Time merge_fragment + NesterovSGD.step on K contributions against ``Tensor.copy_``."""
    if k < 1:
        raise ValueError(f"--contributions must be >= 1, got {k}")
    f = sum(s.numel for s in segments)
    gen = torch.Generator().manual_seed(seed)
    # One buffer per contribution, as the coordinator's BufferPool holds them. Pseudo-gradients
    # of ~1e-3, of a different size per island, as islands differ.
    deltas = [torch.empty(f).normal_(generator=gen).mul_(1e-3 * (1 + i)) for i in range(k)]
    sq = torch.stack([segment_sq_norms(row, segments) for row in deltas])  # done at ingest
    tokens = [4096 * (1 + i % 3) for i in range(k)]
    steps = [24 + 8 * (i % 2) for i in range(k)]
    weights = torch.tensor([token_weight(t, s) for t, s in zip(tokens, steps)], dtype=torch.float64)
    values = torch.randn(f, generator=gen).mul_(0.02)
    grad = torch.empty(f)
    opt = build_outer_optimizer(OuterOptimConfig(name="nesterov"))

    n = (k + 2) * f
    src = torch.ones(n)
    dst = torch.empty(n)

    def outer_step() -> dict[str, float]:
        t0 = time.perf_counter()
        g = merge_fragment(deltas, weights, segments, rda, sq_norms=sq, out=grad)
        t1 = time.perf_counter()
        opt.step(values, g)
        t2 = time.perf_counter()
        return {"total": t2 - t0, "merge_fragment": t1 - t0, "nesterov_step": t2 - t1}

    def copy() -> dict[str, float]:
        t0 = time.perf_counter()
        dst.copy_(src)
        return {"total": time.perf_counter() - t0}

    times = interleave({"outer_step": outer_step, "copy": copy}, repeats)
    nbytes = 4 * n
    comparison = Comparison(
        name=f"outer step K={k}",
        measured=Timing("merge_fragment + NesterovSGD.step", nbytes, times["outer_step"]["total"]),
        baseline=Timing("torch copy_", nbytes, times["copy"]["total"]),
        phases=_medians(times["outer_step"]),
    )
    return OuterStepRun(k=k, comparison=comparison, deltas=deltas, weights=weights, grad=grad)


# --------------------------------------------------------------- (b) upload
class _RawSink:
    """Loopback TCP receiver: reads ``nbytes`` per message into one buffer, answers 1 byte."""

    def __init__(self, nbytes: int):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(30)  # a client that never connects must not hang the thread
        self.address = self._listener.getsockname()
        self._buf = bytearray(nbytes)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="raw-sink")
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as aiohttp does
            view = memoryview(self._buf)
            while True:
                got = 0
                while got < len(view):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"\x01")

    def close(self) -> None:
        self._thread.join(timeout=10)
        self._listener.close()


@dataclass
class UploadRun:
    """A finished upload comparison and what the coordinator answered."""

    comparison: Comparison
    fragment_bytes: int
    body_bytes: int
    merges_during_timing: int
    """Version steps of the fragment while timing: 0 unless a merge slipped in."""
    replies: list[dict]


def bench_upload(config: dict, repeats: int, seed: int = 0) -> UploadRun:
    """Time HTTP uploads of a whole fragment to a real coordinator against a raw TCP send."""
    with tempfile.TemporaryDirectory(prefix="ds-diloco-bench-") as tmp:
        path = os.path.join(tmp, "llama.json")
        with open(path, "w") as fh:
            json.dump(config, fh)
        cfg = CoordinatorConfig(
            model=ModelSource(config=path, seed=seed),
            state_dir=os.path.join(tmp, "state"),
            num_fragments=1,
            sync_every=2,
            # Two islands registered, one uploading: the round never reaches its quorum.
            policy=PolicyOptions(min_quorum=2, grace_gamma=0.0, tau=1),
            max_body_mb=1024.0,
            token=TOKEN,
        )
        srv = ServerThread(cfg)
        try:
            return _time_uploads(srv, repeats, seed)
        finally:
            srv.stop(save=False)


def _time_uploads(srv: ServerThread, repeats: int, seed: int) -> UploadRun:
    client = CoordinatorClient(srv.url, TOKEN, retries=0)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    frag = plan.fragments[0]
    for island in ("bench", "idle"):
        client.register(island, 1, plan.signature)
    gen = torch.Generator().manual_seed(seed)
    full = {p.name: torch.randn(p.shape, generator=gen).mul_(1e-3) for p in frag.params}
    slices = rank_slices(frag, full, 1, 0)
    header = dict(island="bench", rank=0, world_size=1, fragment=0, base_version=0, tokens=4096)
    # Every call needs a newer step (replays are refused): encode them all before timing.
    bodies = [
        wire.encode_upload(wire.UploadHeader(**header, step=step, steps=24), slices)
        for step in range(24, 24 + 2 * (repeats + 1))  # steps <= step, as an island's
    ]
    del full, slices
    pending = iter(bodies)
    replies: list[dict] = []

    def http() -> dict[str, float]:
        body = next(pending)
        t0 = time.perf_counter()
        reply = client.upload_body(body)
        t1 = time.perf_counter()
        replies.append(reply)
        return {"total": t1 - t0}

    def in_process() -> dict[str, float]:
        body = next(pending)
        t0 = time.perf_counter()
        reply = srv.coord.upload(body)
        t1 = time.perf_counter()
        replies.append(reply)
        return {"total": t1 - t0}

    payload = bodies[0]
    sink = _RawSink(len(payload))
    sock = socket.create_connection(sink.address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as urllib3 does
    ack = bytearray(1)

    def raw() -> dict[str, float]:
        t0 = time.perf_counter()
        sock.sendall(payload)
        if sock.recv_into(ack) != 1:
            raise ConnectionError("the raw sink closed the connection")
        return {"total": time.perf_counter() - t0}

    try:
        before = srv.coord.versions()
        times = interleave({"http": http, "raw": raw, "in_process": in_process}, repeats)
        merges = sum(a - b for a, b in zip(srv.coord.versions(), before))
    finally:
        sock.close()
        sink.close()
        client.close()  # an open keep-alive connection would hold up the server's stop
    bad = [r for r in replies if r.get("status") != "accepted"]
    if bad:
        raise RuntimeError(f"the coordinator did not accept every upload: {bad[:2]}")
    nbytes = len(payload)
    http_label = "HTTP upload (http.client -> aiohttp -> Coordinator.upload)"
    comparison = Comparison(
        name="upload",
        measured=Timing(http_label, nbytes, times["http"]["total"]),
        baseline=Timing("raw TCP sendall + 1-byte reply", nbytes, times["raw"]["total"]),
        phases={"coordinator_upload_in_process": statistics.median(times["in_process"]["total"])},
    )
    return UploadRun(
        comparison=comparison,
        fragment_bytes=frag.nbytes,
        body_bytes=nbytes,
        merges_during_timing=merges,
        replies=replies,
    )


# ---------------------------------------------------- (c) coordinator CPU per round
@dataclass
class RoundCpuRun:
    """A finished CPU-per-round measurement of a coordinator process."""

    fragment_bytes: int
    world_size: int
    rounds: int
    cpu_s: float
    """Coordinator CPU seconds (user + system) of all timed rounds."""
    wall_s: float
    versions: tuple[int, int]
    """The fragment's version before and after the timed rounds (one merge per round)."""

    @property
    def cpu_s_per_round(self) -> float:
        return self.cpu_s / self.rounds

    def to_json(self) -> dict:
        return {
            "fragment_bytes": self.fragment_bytes,
            "world_size": self.world_size,
            "rounds": self.rounds,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "cpu_s_per_round": self.cpu_s_per_round,
            "versions": list(self.versions),
        }


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process so far, from ``/proc`` (Linux)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_round_cpu(
    config: dict, rounds: int, world_size: int = 2, warmup: int = 2, seed: int = 0
) -> RoundCpuRun:
    """CPU of a coordinator process per round: W uploads, the merge, W downloads."""
    if rounds < 1 or world_size < 1:
        raise ValueError(f"rounds and world_size must be >= 1, got {rounds}, {world_size}")
    with tempfile.TemporaryDirectory(prefix="ds-diloco-bench-cpu-") as tmp:
        model = os.path.join(tmp, "llama.json")
        with open(model, "w") as fh:
            json.dump(config, fh)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        coordinator = {
            "model": {"config": model, "seed": seed},
            "state_dir": os.path.join(tmp, "state"),
            "num_fragments": 1,
            "sync_every": 2,
            "host": "127.0.0.1",
            "port": port,
            "token": TOKEN,
            "policy": {"min_quorum": 1, "grace_gamma": 0.0, "tau": 1},
            "max_body_mb": 1024.0,
            "durable_merges": True,
        }
        path = os.path.join(tmp, "coordinator.json")
        with open(path, "w") as fh:
            json.dump(coordinator, fh)
        with open(os.path.join(tmp, "coordinator.log"), "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ds_diloco.cli", "coordinator", "--config", path],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")},
            )  # fmt: skip
        try:
            return _time_rounds(proc, f"http://127.0.0.1:{port}", rounds, world_size, warmup, seed)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------ (d) memory
_MEMORY_SCRIPT = """
import json, sys, tempfile, torch
from ds_diloco import wire
from ds_diloco.client import rank_slices
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.coordinator import Coordinator
from ds_diloco.round_policy import PolicyOptions

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

model, P, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from ds_diloco.hf_model import build_model
build_model(ModelSource(config=model, seed=0))  # what building imports and keeps, first
with tempfile.TemporaryDirectory() as d:
    start = rss()
    coord = Coordinator(CoordinatorConfig(
        model=ModelSource(config=model, seed=0), state_dir=d, token="t", num_fragments=P,
        sync_every=P, durable_merges=False, save_every_merges=10**9,
        policy=PolicyOptions(min_quorum=M, grace_gamma=0.0, tau=1)))
    islands = [f"i{k}" for k in range(M)]
    for isl in islands:
        coord.register(isl, 1, coord.plan.signature)
    for step in range(1, 2 * P + 1):
        f = (step - 1) % P
        frag = coord.plan.fragments[f]
        delta = {p.name: torch.full(p.shape, 1e-3) for p in frag.params}
        for isl in islands:
            h = wire.UploadHeader(island=isl, rank=0, world_size=1, fragment=f, step=step,
                                  base_version=coord.versions()[f], tokens=64, steps=1)
            coord.upload(wire.encode_upload(h, rank_slices(frag, delta, 1, 0)))
        del delta
        assert coord.poll(f).merge
    sizes = [4 * f.numel for f in coord.plan.fragments]
    print(json.dumps({"grown": rss() - start, "model": sum(sizes), "largest": max(sizes),
                      "buffers": coord.status()["buffers"]}))
"""


@dataclass
class MemoryRun:
    """What a coordinator holds after 2P rounds of M islands syncing P fragments in turn."""

    fragments: int
    islands: int
    grown_bytes: int
    """Its RSS after the rounds over its RSS before the coordinator was made."""
    model_bytes: int
    largest_bytes: int
    """The largest fragment, fp32."""

    @property
    def needed_bytes(self) -> int:
        """The global values and outer momentum, a row per island, a merge's output, its
        new values and the outer-state copy."""
        return 2 * self.model_bytes + (self.islands + 3) * self.largest_bytes

    def to_json(self) -> dict:
        return {"fragments": self.fragments, "islands": self.islands,
                "grown_bytes": self.grown_bytes, "model_bytes": self.model_bytes,
                "largest_bytes": self.largest_bytes, "needed_bytes": self.needed_bytes}  # fmt: skip


def bench_memory(config: dict, fragments: int = 8, islands: int = 4) -> MemoryRun:
    """A coordinator (in its own process) for ``islands`` islands of one rank syncing
    ``fragments`` fragments in turn, all of them in every round (K = M), for 2P rounds."""
    with tempfile.TemporaryDirectory(prefix="ds-diloco-bench-mem-") as tmp:
        model = os.path.join(tmp, "llama.json")
        with open(model, "w") as fh:
            json.dump(config, fh)
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_SCRIPT, model, str(fragments), str(islands)],
            capture_output=True, text=True, timeout=1800,
            env={**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")},
        )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"the memory bench's coordinator failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return MemoryRun(fragments, islands, got["grown"], got["model"], got["largest"])


def _wait_healthy(proc: subprocess.Popen, client: CoordinatorClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {proc.returncode}")
        try:
            client.health()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _time_rounds(
    proc: subprocess.Popen, url: str, rounds: int, world_size: int, warmup: int, seed: int
) -> RoundCpuRun:
    clients = [CoordinatorClient(url, TOKEN, retries=0) for _ in range(world_size)]
    try:
        _wait_healthy(proc, clients[0], timeout_s=300)
        plan = FragmentPlan.from_json(clients[0].plan()["plan"])
        frag = plan.fragments[0]
        clients[0].register("bench", world_size, plan.signature)
        gen = torch.Generator().manual_seed(seed)
        full = {p.name: torch.randn(p.shape, generator=gen).mul_(1e-3) for p in frag.params}
        slices = [
            {n: t.clone() for n, t in rank_slices(frag, full, world_size, r).items()}
            for r in range(world_size)
        ]
        dest = [{n: torch.empty_like(t) for n, t in s.items()} for s in slices]
        del full
        # One thread per rank for the whole run, as an island's transport threads: each
        # keeps its keep-alive connection (a thread per round measured connection set-up).
        total = warmup + rounds
        start = threading.Barrier(world_size + 1, timeout=120)  # a stuck rank fails the run
        done = threading.Barrier(world_size + 1, timeout=120)
        errors: list[BaseException] = []
        bases = [clients[0].versions()[0]]
        versions = [0] * world_size

        def rank(r: int) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):  # the run stopped
                for step in range(1, total + 1):
                    start.wait()
                    one_rank_round(r, step, bases[0])
                    done.wait()

        def one_rank_round(r: int, step: int, base: int) -> None:
            try:
                header = wire.UploadHeader(
                    island="bench", rank=r, world_size=world_size, fragment=0,
                    base_version=base, step=step + 1, tokens=4096, steps=2,
                )  # fmt: skip
                reply = clients[r].upload(header, slices[r])
                if reply["status"] != "accepted":
                    raise RuntimeError(f"upload not accepted: {reply}")
                # As an island's download thread: the long poll that answers with the body.
                got = clients[r].download_next(
                    [base], world_size, r, [dest[r]], lambda i: True, wait=10.0, island="bench"
                )  # fmt: skip
                if got.version is None or got.version <= base:
                    raise RuntimeError(f"rank {r}: no new version after {base}: {got}")
                versions[r] = got.version
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        def one_round() -> None:
            start.wait()
            done.wait()
            if errors:
                raise RuntimeError(f"a rank failed: {errors[0]!r}") from errors[0]
            bases[0] = versions[0]  # the merged version every rank now holds

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        try:
            for _ in range(warmup):
                one_round()
            v0 = clients[0].versions()[0]
            c0, t0 = process_cpu_s(proc.pid), time.perf_counter()
            for _ in range(rounds):
                one_round()
            cpu, wall = process_cpu_s(proc.pid) - c0, time.perf_counter() - t0
            v1 = clients[0].versions()[0]
        finally:
            start.abort()  # a failed round leaves the rank threads at a barrier
            done.abort()
    finally:
        for c in clients:
            c.close()  # an open keep-alive connection would hold up the server's stop
    return RoundCpuRun(frag.nbytes, world_size, rounds, cpu, wall, (v0, v1))


# ------------------------------------------------------------------- report
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def format_report(
    header: str,
    outer: Sequence[Comparison],
    upload: Comparison,
    headline_k: int,
    rounds: Sequence[RoundCpuRun] = (),
    memory: MemoryRun | None = None,
) -> str:
    lines = [header, "(a) outer step (bytes = (K+2) x F x 4) vs torch copy_ of as many bytes"]
    for c in outer:
        p = c.phases
        mark = "  <- --contributions" if c.name == f"outer step K={headline_k}" else ""
        lines.append(
            f"    {c.name.removeprefix('outer step ')}: merge+Nesterov "
            f"{c.measured.bytes_per_s / 1e9:.2f} GB/s ({_ms(c.measured.median_s)}: merge "
            f"{_ms(p['merge_fragment'])} + step {_ms(p['nesterov_step'])})  vs copy "
            f"{c.baseline.bytes_per_s / 1e9:.2f} GB/s ({_ms(c.baseline.median_s)})  "
            f"ratio {c.shown_ratio()}  ({c.verdict()}){mark}"
        )
    inproc = upload.phases["coordinator_upload_in_process"]
    lines += [
        f"(b) upload of {upload.measured.nbytes / 2**20:.1f} MiB over loopback: HTTP "
        f"{upload.measured.bytes_per_s / 1e6:.0f} MB/s ({_ms(upload.measured.median_s)})  vs raw "
        f"socket {upload.baseline.bytes_per_s / 1e6:.0f} MB/s ({_ms(upload.baseline.median_s)})  "
        f"ratio {upload.shown_ratio()}  ({upload.verdict()})",
        f"    same body to Coordinator.upload in-process (decode, validate, copy into its row): "
        f"{_ms(inproc)}; the rest of the HTTP time (client, socket, aiohttp): "
        f"{_ms(upload.measured.median_s - inproc)}",
    ]
    if rounds:
        lines.append(
            f"(c) coordinator process CPU per round ({rounds[0].world_size} ranks upload, merge "
            "with outer step and durable write, the ranks download):"
        )
    for r in rounds:
        lines.append(
            f"    fragment {r.fragment_bytes / 2**20:.1f} MiB: {_ms(r.cpu_s_per_round)} CPU per "
            f"round (over {r.rounds} rounds; wall {_ms(r.wall_s / r.rounds)} per round)"
        )
    if memory is not None:
        m = memory
        lines.append(
            f"(d) coordinator memory, P = {m.fragments} fragments, M = {m.islands} islands, "
            f"K = M, {2 * m.fragments} rounds: RSS +{m.grown_bytes / 2**20:.1f} MiB vs "
            f"{m.needed_bytes / 2**20:.1f} MiB needed (values and momentum 2 x "
            f"{m.model_bytes / 2**20:.1f}, M + 3 buffers of the largest fragment's "
            f"{m.largest_bytes / 2**20:.1f}): {m.grown_bytes / m.needed_bytes:.2f}x"
        )
    return "\n".join(lines)


def main(args) -> int:
    """The CLI's ``bench coordinator``: args.fragment_mb, args.contributions, args.repeats
    and an optional args.json (path of a JSON summary). Every argument is checked first."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.contributions < 1:
        raise ValueError(f"--contributions must be >= 1, got {args.contributions}")
    config = llama_config(args.fragment_mb)
    check_memory(args.fragment_mb, max(*DEFAULT_KS, args.contributions))
    _frag, segments, rda = whole_model_layout(model_specs(config))
    f = sum(s.numel for s in segments)
    outer = []
    for k in sorted({*DEFAULT_KS, args.contributions}):
        outer.append(bench_outer_step(segments, rda, k, args.repeats).comparison)
    upload = bench_upload(config, args.repeats)
    if upload.merges_during_timing:
        raise RuntimeError("a merge ran during the upload timing: the figures are not uploads")
    rounds = []
    if os.path.exists(f"/proc/{os.getpid()}/stat"):  # process CPU times: Linux
        sizes = (
            [args.fragment_mb]
            if args.fragment_mb <= TINY_FRAGMENT_MB
            else [TINY_FRAGMENT_MB, args.fragment_mb]
        )
        for mb in sizes:
            rounds.append(bench_round_cpu(llama_config(mb), ROUNDS_PER_REPEAT * args.repeats))
    memory = None
    if os.path.exists(f"/proc/{os.getpid()}/status"):  # RSS: Linux
        memory = bench_memory(config)
    header = (
        f"ds-diloco bench coordinator  (fragment {4 * f / 2**20:.1f} MiB fp32 = "
        f"{len(segments)} tensors of a {config['num_hidden_layers']}-layer Llama, hidden "
        f"{config['hidden_size']}, vocab {config['vocab_size']}; {torch.get_num_threads()} "
        f"torch threads; median of {args.repeats}, interleaved)"
    )
    print(format_report(header, outer, upload.comparison, args.contributions, rounds, memory),
          flush=True)  # fmt: skip
    path = getattr(args, "json", None)
    if path:
        summary = {
            "fragment_bytes": 4 * f,
            "tensors": len(segments),
            "model": config,
            "torch_threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "contributions": args.contributions,
            "outer_step": [c.to_json() for c in outer],
            "upload": upload.comparison.to_json(),
            "round_cpu": [r.to_json() for r in rounds],
            "memory": None if memory is None else memory.to_json(),
        }
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0
