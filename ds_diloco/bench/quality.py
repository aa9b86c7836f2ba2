"""``ds-diloco bench quality``: held-out loss and bytes sent, against synchronous ZeRO-3.

The same Hugging Face model trains on the same real text, with the same total
number of tokens and the same inner optimiser (AdamW: learning rate, warm-up,
micro-batch, steps per rank), three ways:

- ``zero3``: one synchronous DeepSpeed ZeRO-3 data-parallel job over all M x R
  ranks (``ds-diloco island --plain``: the island loop without a coordinator);
- ``sync``: synchronous DiLoCo, M islands of R ranks, quorum K = M, no grace window;
- ``decoupled``: Decoupled DiLoCo, K = 1 plus the adaptive grace window.

Both DiLoCo runs share everything else: token weighting, RDA per tensor
(embeddings by plain mean), stale contributions dropped, outer Nesterov, H, P,
tau and the pseudo-gradient codec. Our islands never block on the coordinator,
so with K = M a fragment waits for every island's upload while training goes on.

Held-out text. ``data.heldout_split`` holds out blocks no island trains on. Its
first ``eval_blocks`` are the reported evaluation; the next ``eval_blocks`` are
the tuning split, read only by ``--tune`` (which picks the outer learning rate),
so the outer settings are never chosen on the figures reported. The baseline is
evaluated by its ZeRO-3 engine on exactly those blocks (rank r takes every W-th
from r); a DiLoCo run by its global model (the coordinator's), loaded here,
with the same loss function. Curves: the baseline evaluates every
``steps / points`` steps; a DiLoCo run's global model is downloaded when the
islands together have trained the same share of the tokens, and evaluated
after the run (so evaluation never competes with training for the cores).

Bytes sent per trained token. DiLoCo: every rank's upload bodies (pseudo-
gradients as encoded on the wire, scales and header included; counted by the
syncer) over all tokens trained. Baseline: a ring all-reduce of the gradients,
in which each of N ranks sends ``2 (N - 1) / N x params x b`` bytes per step
(b = 4 for fp32 gradients, 2 for bf16), over its ``micro_batch x seq_len``
tokens: the least that plain data parallelism sends (ZeRO-3 sends about 1.5x
that: two all-gathers of the parameters and one reduce-scatter of the
gradients per step). Downloads (merged fragments, fp32) are shown beside,
estimated from the fragments each rank applied; an all-reduce receives as much
as it sends.

Heterogeneous islands: island 0 sleeps after each step for as long as a step
of the homogeneous Decoupled run took (its median), so it runs at about half
speed, and trains half the steps: every island gets the same wall-clock budget.
A lock-step job would instead slow every step to the slowest rank's; its time
is estimated as the baseline's training time + steps x the delay
(``--hetero-sync`` also runs synchronous DiLoCo with the slow island).

Size: the defaults (tiny Llama, 80 steps, 7 runs) took 9.5 minutes on 2 shared CPU
cores; ``--steps`` scales the budget, ``--preset 125m`` moves to GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from ds_diloco.compress import CODECS, Codec
from ds_diloco.config import (
    CoordinatorConfig,
    DataConfig,
    IslandSpec,
    ModelSource,
    RunConfig,
    TrainConfig,
)
from ds_diloco.merge import StalenessPolicy
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.run import LocalRun

REPO = Path(__file__).resolve().parents[2]
LOSS_GOAL = 1.02
"""Decoupled DiLoCo's held-out loss may be at most this many times the baseline's."""
BYTES_GOAL = 1 / 100
"""Decoupled DiLoCo's bytes sent per token, at most this share of the all-reduce's."""
LABELS = {"zero3": "ZeRO-3 data parallel", "sync": "sync DiLoCo", "decoupled": "Decoupled DiLoCo"}


def default_corpus() -> str:
    """The Shakespeare of launch/get_corpus.sh in .cache/corpus, else the sonnets in tests/data."""
    corpus = REPO / ".cache" / "corpus"
    return str(corpus if any(corpus.rglob("*.txt")) else REPO / "tests" / "data")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What every method shares, and the DiLoCo runs' outer settings."""

    model_config: str = str(REPO / "model_configs" / "tiny-llama.json")
    """HF config.json of the model (initialised with seed 0, the same for every method)."""
    deepspeed_config: str = str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json")
    """ZeRO-3 config of every job (baseline and islands)."""
    corpus: str = dataclasses.field(default_factory=default_corpus)
    """Real text: a folder of *.txt files (see ``DataConfig.path``)."""
    cache_dir: str = str(REPO / ".cache" / "ds_diloco")
    """Tokenizer and packed blocks, cached."""
    seq_len: int = 128
    vocab_size: int = 4096
    heldout_fraction: float = 0.02
    islands: int = 4
    """M."""
    ranks_per_island: int = 1
    """R: ZeRO-3 ranks per island (the baseline has M x R)."""
    steps: int = 80
    """Inner steps of every rank (the same tokens for every method)."""
    micro_batch: int = 2
    lr: float = 2e-3
    warmup_steps: int = 10
    outer_lr: float = 0.4
    """Decoupled DiLoCo's outer Nesterov learning rate. 0.4: what ``--tune`` picked on the
    tuning split at these defaults (loss 6.449, 6.260, 6.234, 6.513 at 0.1, 0.2, 0.4, 0.7)."""
    sync_outer_lr: float = 0.4
    """Synchronous DiLoCo's outer learning rate; ``--tune`` picked 0.4 too (6.433, 6.238,
    6.184, 6.430)."""
    momentum: float = 0.9
    num_fragments: int = 12
    """P."""
    sync_every: int = 12
    """H: a fragment is sent every H steps; one fragment every H / P steps."""
    tau: int = 2
    grace_gamma: float = 0.5
    """Decoupled DiLoCo's grace-window safety factor (sync DiLoCo: 0)."""
    compression: str = "int4"
    """Codec of both DiLoCo runs' pseudo-gradients (the variants table tries all)."""
    block: int = 256
    """Values per quantisation scale."""
    eval_blocks: int = 64
    """Held-out blocks reported; as many more form the tuning split."""
    points: int = 5
    """Held-out evaluations along each run (the curve), the last at the end."""
    gpus: int = 0
    """GPUs to spread the ranks over (0: CPU)."""
    workdir: str = "runs/bench-quality"

    def __post_init__(self):
        for name in ("islands", "ranks_per_island", "steps", "micro_batch", "points"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.compression not in CODECS:
            raise ValueError(f"compression must be one of {CODECS}, got {self.compression!r}")
        if self.eval_blocks % (self.ranks * self.micro_batch):
            raise ValueError(
                f"eval_blocks ({self.eval_blocks}) must be a multiple of ranks x micro_batch "
                f"({self.ranks} x {self.micro_batch}): the baseline's ranks split them evenly"
            )
        if self.steps < 2 * self.points:
            raise ValueError(f"steps ({self.steps}) must be >= 2 x points ({self.points})")

    @property
    def ranks(self) -> int:
        return self.islands * self.ranks_per_island

    @property
    def tokens(self) -> int:
        """Tokens every method trains on (predicted tokens, as the islands count them)."""
        return self.steps * self.ranks * self.micro_batch * self.seq_len

    def outer(self, kind: str) -> str:
        c = f"Nesterov lr {self.sync_outer_lr if kind == 'sync' else self.outer_lr:g}"
        return f"{c} momentum {self.momentum:g}"


@dataclasses.dataclass(frozen=True)
class Method:
    """One training run of the comparison."""

    key: str
    kind: str
    """``zero3``, ``sync`` or ``decoupled``."""
    codec: str = "none"
    outer_lr: float = 0.7
    slow_s: float = 0.0
    """Island 0's sleep after each step (heterogeneous variant); it then trains half the steps."""

    @property
    def label(self) -> str:
        extra = f", {self.codec}" if self.kind != "zero3" else ""
        slow = ", island 0 at half speed" if self.slow_s else ""
        return f"{LABELS[self.kind]}{extra}{slow}"


def run_config(s: Setup, m: Method, workdir: Path) -> RunConfig:
    """The run file of one method (``workdir`` absolute: island configs are read from it)."""
    workdir = workdir.resolve()
    model = ModelSource(config=s.model_config, seed=0)
    every = max(1, s.steps // s.points)
    if m.kind == "zero3":
        islands = (IslandSpec(name="zero3", world_size=s.ranks, include=_gpus(s, 0, s.ranks)),)
        eval_batches, eval_every = s.eval_blocks // (s.ranks * s.micro_batch), every
    else:
        r = s.ranks_per_island
        islands = tuple(
            IslandSpec(name=f"island-{i}", world_size=r, include=_gpus(s, i * r, r))
            for i in range(s.islands)
        )
        eval_batches, eval_every = 1, 0  # the global model is evaluated here instead
    sync = m.kind == "sync"
    coordinator = CoordinatorConfig(
        model=model,
        state_dir=str(workdir / "state"),
        num_fragments=s.num_fragments,
        sync_every=s.sync_every,
        outer=OuterOptimConfig(name="nesterov", lr=m.outer_lr, momentum=s.momentum),
        policy=PolicyOptions(
            min_quorum=s.islands if sync else 1,
            grace_gamma=0.0 if sync else s.grace_gamma,
            tau=s.tau,
        ),
        staleness=StalenessPolicy(mode="drop"),
        compression=Codec(name=m.codec, block=s.block),
    )
    return RunConfig(
        model=model,
        deepspeed_config=s.deepspeed_config,
        data=DataConfig(
            path=s.corpus,
            vocab_size=s.vocab_size,
            seq_len=s.seq_len,
            cache_dir=s.cache_dir,
            heldout_fraction=s.heldout_fraction,
        ),
        train=TrainConfig(
            steps=s.steps,
            micro_batch=s.micro_batch,
            lr=s.lr,
            warmup_steps=s.warmup_steps,
            log_every=max(1, min(5, every)),
            eval_every=eval_every,
            eval_batches=eval_batches,
        ),
        islands=islands,
        coordinator=coordinator,
        workdir=str(workdir),
        export=False,
    )


def _gpus(s: Setup, first: int, count: int) -> str | None:
    """The deepspeed launcher's --include for ranks [first, first + count), wrapped on the GPUs."""
    if not s.gpus:
        return None
    ids = sorted({(first + i) % s.gpus for i in range(count)})
    return "localhost:" + ",".join(map(str, ids))


# ------------------------------------------------------------------- evaluation
class Evaluator:
    """The held-out and tuning blocks, and the model to evaluate global values with."""

    def __init__(self, s: Setup):
        from ds_diloco.data import heldout_split, prepare_corpus
        from ds_diloco.hf_model import build_model

        _, blocks = prepare_corpus(s.corpus, s.cache_dir, s.vocab_size, s.seq_len)
        _, heldout = heldout_split(blocks, s.heldout_fraction, seed=0)
        if len(heldout) < 2 * s.eval_blocks:
            raise ValueError(
                f"the held-out split has {len(heldout)} blocks; eval_blocks {s.eval_blocks} "
                f"needs {2 * s.eval_blocks} (evaluation + tuning): raise heldout_fraction"
            )
        self.eval, self.tune = heldout[: s.eval_blocks], heldout[s.eval_blocks : 2 * s.eval_blocks]
        self.batch = 32  # per forward: larger batches evaluate several times faster on CPU
        self.model = build_model(ModelSource(config=s.model_config, seed=0))
        self.params = sum(p.numel() for p in self.model.parameters())
        self.initial = self.loss()
        self.initial_tune = self.loss(tune=True)

    @torch.no_grad()
    def loss(self, values: dict[str, torch.Tensor] | None = None, tune: bool = False) -> float:
        """Mean next-token loss per block (as the islands' engines compute it)."""
        from ds_diloco.hf_model import lm_loss

        if values is not None:
            for name, p in self.model.named_parameters():
                p.copy_(values[name].reshape(p.shape))
        self.model.eval()
        blocks = self.tune if tune else self.eval
        total = sum(
            lm_loss(self.model, b[:, :-1], b[:, 1:]).item() * len(b)
            for b in blocks.split(self.batch)
        )
        return total / len(blocks)


def _snapshot(client, plan) -> dict[str, torch.Tensor]:
    """The global model now, fragment by fragment (each at its latest version)."""
    out = {}
    for frag in plan.fragments:
        _, slices = client.download(frag.index, world_size=1, rank=0)
        out.update({n: t.clone() for n, t in slices.items()})
    return out


# ----------------------------------------------------------------------- runs
@dataclasses.dataclass
class Result:
    method: Method
    loss: float
    """Held-out loss at the end (baseline: its engine's; DiLoCo: the global model's)."""
    tune_loss: float | None
    """DiLoCo: the global model's loss on the tuning split."""
    curve: list[tuple[int, float]]
    """(tokens trained, held-out loss), from (0, initial loss)."""
    tokens: int
    bytes_up: int
    """Upload bodies of every rank (DiLoCo); 0 for the baseline (see all-reduce)."""
    bytes_down: int
    """DiLoCo: fragments applied x their fp32 bytes, per rank (an estimate)."""
    wall_s: float
    """From starting the islands until the last exited (start-up and evaluations included)."""
    train_s: float
    """The slowest rank's time in training steps (sum of its step times)."""
    step_s: list[float]
    """Median step time of each island (baseline: of its slowest rank)."""
    merges: int

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.method.label}


def run_method(s: Setup, m: Method, ev: Evaluator, workdir: Path, echo=None) -> Result:
    """Train one method from the initial model; evaluate it on the held-out blocks."""
    from ds_diloco.export import load_global_tensors
    from ds_diloco.fragments import FragmentPlan

    cfg = run_config(s, m, workdir)
    lr = LocalRun(cfg)
    snaps: list[tuple[int, dict]] = []
    status = None
    try:
        client = None if m.kind == "zero3" else lr.start_coordinator()
        plan = client and FragmentPlan.from_json(client.plan()["plan"])
        t0 = time.monotonic()
        for shard, spec in enumerate(cfg.islands):
            if shard == 0 and m.slow_s:  # LocalRun builds every island from cfg.train
                slow = dataclasses.replace(cfg.train, step_delay_s=m.slow_s, steps=s.steps // 2)
                lr.cfg = dataclasses.replace(cfg, train=slow)
            lr.start_island(spec, shard, len(cfg.islands), plain=m.kind == "zero3")
            lr.cfg = cfg
        targets = [s.tokens * k // s.points for k in range(1, s.points)]
        deadline = t0 + 600 + 30 * s.steps  # a stuck launch fails the benchmark, not hangs it
        while any(p.poll() is None for p in lr.islands.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{m.key}: islands still running after {deadline - t0:.0f} s")
            done = _tokens_so_far(lr) if client else 0
            if targets and done >= targets[0]:
                snaps.append((done, _snapshot(client, plan)))
                while targets and done >= targets[0]:
                    targets.pop(0)
            time.sleep(0.5)
        wall = time.monotonic() - t0
        failed = {n: p.returncode for n, p in lr.islands.items() if p.returncode}
        if failed:
            name = next(iter(failed))
            log = (lr.workdir / "islands" / name / "log.txt").read_text(errors="replace")
            raise RuntimeError(f"{m.key}: islands failed {failed}; {name}'s log:\n{log[-3000:]}")
        if client:
            status = client.status()
    finally:
        lr.stop()
    ranks = [
        json.loads((lr.workdir / "islands" / spec.name / f"summary-rank{r}.json").read_text())
        for spec in cfg.islands
        for r in range(spec.world_size)
    ]
    per_island: dict[str, list[dict]] = {}
    for r in ranks:
        per_island.setdefault(r["island"], []).append(r)
    step_s = [
        statistics.median(max(t) for t in zip(*(r["step_times_s"] for r in rs)))
        for rs in per_island.values()
    ]
    tokens = sum(rs[0]["tokens"] for rs in per_island.values())
    train_s = max(sum(r["step_times_s"]) for r in ranks)
    if m.kind == "zero3":
        recs = _progress(lr.workdir / "islands" / "zero3" / "progress.jsonl")
        per_step = s.ranks * s.micro_batch * s.seq_len
        curve = [(r["step"] * per_step, r["heldout_loss"]) for r in recs if "heldout_loss" in r]
        if not curve or curve[-1][0] != tokens:
            curve.append((tokens, ranks[0]["heldout_loss_end"]))
        loss, tune_loss, up, down, merges = curve[-1][1], None, 0, 0, 0
    else:
        curve = [(t, ev.loss(v)) for t, v in snaps]
        _, final = load_global_tensors(cfg.coordinator.state_dir)
        tune_loss = ev.loss(final, tune=True)
        loss = ev.loss(final)
        curve.append((tokens, loss))
        up = sum(r["stats"]["bytes_sent"] for r in ranks)
        p = s.num_fragments  # bootstrap applies every fragment once: not a download per token
        down = sum(
            max(0, r["stats"]["applied"] - p) * 4 * ev.params // (p * r["world_size"])
            for r in ranks
        )
        merges = sum(status["merges"])
    result = Result(
        method=m,
        loss=loss,
        tune_loss=tune_loss,
        curve=[(0, ev.initial), *curve],
        tokens=tokens,
        bytes_up=up,
        bytes_down=down,
        wall_s=round(wall, 1),
        train_s=round(train_s, 1),
        step_s=step_s,
        merges=merges,
    )
    if echo:
        echo(_run_line(result))
    return result


def _tokens_so_far(lr: LocalRun) -> int:
    return sum(r.get("tokens", 0) for r in lr.island_records().values())


def _progress(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- the benchmark
@dataclasses.dataclass
class QualityBench:
    setup: Setup
    results: dict[str, Result]
    """By method key: zero3, sync, decoupled, codec-<name>, hetero-decoupled, hetero-sync."""
    evaluator_params: int
    initial_loss: float
    grad_bytes: int
    """Bytes per gradient value in the baseline's all-reduce (4 fp32, 2 bf16)."""

    def allreduce_bytes_per_token(self) -> float:
        """Ring all-reduce: 2 (N - 1) / N x params x b bytes sent per rank per step."""
        s, n = self.setup, self.setup.ranks
        per_rank_step = 2 * (n - 1) / n * self.evaluator_params * self.grad_bytes
        return per_rank_step / (s.micro_batch * s.seq_len)

    def bytes_ratio(self, r: Result, down: bool = False) -> float:
        sent = r.bytes_down if down else r.bytes_up
        base = self.allreduce_bytes_per_token()
        return sent / max(r.tokens, 1) / base if base else float("nan")

    def loss_ratio(self, r: Result) -> float:
        return r.loss / self.results["zero3"].loss

    def to_json(self) -> dict:
        return {
            "setup": dataclasses.asdict(self.setup),
            "params": self.evaluator_params,
            "initial_loss": self.initial_loss,
            "grad_bytes": self.grad_bytes,
            "allreduce_bytes_per_token": self.allreduce_bytes_per_token(),
            "results": {k: r.to_json() for k, r in self.results.items()},
        }


def grad_bytes(deepspeed_config: str) -> int:
    ds = json.loads(Path(deepspeed_config).read_text())
    half = any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16"))
    return 2 if half else 4


def run_bench(
    s: Setup,
    *,
    codecs: tuple[str, ...] = CODECS,
    hetero: bool = True,
    hetero_sync: bool = False,
    sync: bool = True,
    echo=None,
) -> QualityBench:
    """The three methods, then the codec variants and the heterogeneous variant."""
    root = Path(s.workdir).resolve()  # island configs resolve relative paths against themselves
    ev = Evaluator(s)
    out: dict[str, Result] = {}

    def go(m: Method) -> Result:
        if echo:
            echo(f"  running {m.key}: {m.label} ...")
        out[m.key] = run_method(s, m, ev, root / m.key, echo)
        return out[m.key]

    go(Method("zero3", "zero3"))
    if sync:
        go(Method("sync", "sync", s.compression, s.sync_outer_lr))
    main = go(Method("decoupled", "decoupled", s.compression, s.outer_lr))
    for c in codecs:
        if c != s.compression:
            go(Method(f"codec-{c}", "decoupled", c, s.outer_lr))
    if hetero:
        delay = round(statistics.median(main.step_s), 4)  # island 0 at about half speed
        go(Method("hetero-decoupled", "decoupled", s.compression, s.outer_lr, slow_s=delay))
        if sync and hetero_sync:
            go(Method("hetero-sync", "sync", s.compression, s.sync_outer_lr, slow_s=delay))
    return QualityBench(s, out, ev.params, ev.initial, grad_bytes(s.deepspeed_config))


def tune(s: Setup, lrs: tuple[float, ...], echo=None) -> dict[str, dict[float, float]]:
    """Outer learning rate of each DiLoCo method, picked on the tuning split only."""
    ev = Evaluator(s)
    picks: dict[str, dict[float, float]] = {"sync": {}, "decoupled": {}}
    for kind in picks:
        for x in lrs:
            m = Method(f"tune-{kind}-{x:g}", kind, s.compression, x)
            if echo:
                echo(f"  tuning {kind}: outer lr {x:g} ...")
            r = run_method(s, m, ev, Path(s.workdir).resolve() / m.key)  # held-out loss unused
            picks[kind][x] = r.tune_loss
            if echo:
                echo(f"    tuning-split loss {r.tune_loss:.4f} ({r.merges} merges, {r.wall_s} s)")
    return picks


# --------------------------------------------------------------------- report
def _kb(x: float) -> str:
    return f"{x / 1e3:.2f} kB" if x >= 1e3 else f"{x:.1f} B"


def _run_line(r: Result) -> str:
    return (
        f"    {r.method.key}: held-out loss {r.loss:.4f}, {r.tokens} tokens, wall {r.wall_s} s "
        f"(training {r.train_s} s), uploads {r.bytes_up} B, merges {r.merges}"
    )


def format_report(b: QualityBench, argv: str = "ds-diloco bench quality") -> str:
    s, res = b.setup, b.results
    base = res["zero3"]
    cpu = "CPU" if not s.gpus else f"{s.gpus} GPU(s)"
    lines = [
        f"{argv}",
        f"  model {Path(s.model_config).name} ({b.evaluator_params:,} parameters), "
        f"{Path(s.deepspeed_config).name}, on {cpu}; text {s.corpus}, seq_len {s.seq_len}",
        f"  every method: {s.tokens:,} tokens = {s.steps} steps x {s.ranks} ranks x micro_batch "
        f"{s.micro_batch} x {s.seq_len}; inner AdamW lr {s.lr:g}, warm-up {s.warmup_steps}",
        f"  baseline: one ZeRO-3 job of {s.ranks} ranks; DiLoCo: M = {s.islands} islands x "
        f"{s.ranks_per_island} rank(s) (every process one rank: this machine has few cores)",
        f"  outer: P = {s.num_fragments}, H = {s.sync_every}, tau = {s.tau}, token weights, "
        f"RDA (embeddings plain), stale dropped; sync: K = {s.islands}, no grace, "
        f"{s.outer('sync')}; decoupled: K = 1, grace gamma {s.grace_gamma:g}, "
        f"{s.outer('decoupled')}; pseudo-gradients {s.compression} (block {s.block})",
        f"  held-out: {s.eval_blocks} blocks ({s.eval_blocks * s.seq_len:,} tokens) never "
        f"trained on; outer lr tuned (--tune) on the next {s.eval_blocks}, not these",
        f"  all-reduce reference: 2(N-1)/N x {b.evaluator_params:,} params x {b.grad_bytes} B "
        f"per rank per step, N = {s.ranks} -> {_kb(b.allreduce_bytes_per_token())} per token",
        "",
        f"  {'method':44s} {'loss':>7s} {'/base':>6s} {'sent/token':>11s} {'/allred':>8s} "
        f"{'recv/token':>11s} {'wall s':>7s} {'train s':>8s} {'merges':>6s}",
    ]

    def row(r: Result, name: str | None = None) -> str:
        tok = max(r.tokens, 1)
        if r.method.kind == "zero3":
            sent = recv = b.allreduce_bytes_per_token()
            ratio = "1"
        else:
            sent, recv = r.bytes_up / tok, r.bytes_down / tok
            ratio = f"1/{1 / b.bytes_ratio(r):.0f}" if r.bytes_up else "-"
        return (
            f"  {name or r.method.label:44s} {r.loss:7.4f} {b.loss_ratio(r):6.3f} "
            f"{_kb(sent):>11s} {ratio:>8s} {_kb(recv):>11s} {r.wall_s:7.1f} {r.train_s:8.1f} "
            f"{r.merges:6d}"
        )

    lines.append(f"  {'initial model':44s} {b.initial_loss:7.4f} {b.initial_loss / base.loss:6.3f}")
    for key in ("zero3", "sync", "decoupled"):
        if key in res:
            lines.append(row(res[key]))
    main = res["decoupled"]
    lr_, br = b.loss_ratio(main), b.bytes_ratio(main)
    lines.append(
        f"  goals (Decoupled DiLoCo): loss ratio {lr_:.3f} <= {LOSS_GOAL} "
        f"{'met' if lr_ <= LOSS_GOAL else 'MISSED'}; sent per token 1/{1 / br:.0f} of the "
        f"all-reduce <= 1/{1 / BYTES_GOAL:.0f} {'met' if br <= BYTES_GOAL else 'MISSED'}"
    )
    codecs = [main] + [res[k] for k in res if k.startswith("codec-")]
    if len(codecs) > 1:
        lines += ["", "  pseudo-gradient compression (Decoupled DiLoCo, error feedback):"]
        for r in sorted(codecs, key=lambda r: CODECS.index(r.method.codec)):
            lines.append(row(r, f"    {r.method.codec}"))
    if "hetero-decoupled" in res:
        h = res["hetero-decoupled"]
        fast = statistics.median(h.step_s[1:]) if len(h.step_s) > 1 else float("nan")
        lines += [
            "",
            f"  heterogeneous: island 0 sleeps {h.method.slow_s * 1e3:.0f} ms after each step "
            f"(median step {h.step_s[0] * 1e3:.0f} ms vs {fast * 1e3:.0f} ms for the others) "
            f"and trains {s.steps // 2} steps; the others {s.steps}",
        ]
        lines.append(row(h, "    Decoupled DiLoCo"))
        lines.append(
            f"    {'':42s} loss / homogeneous Decoupled {h.loss / main.loss:.3f}, wall "
            f"{h.wall_s:.0f} s vs {main.wall_s:.0f} s, {h.tokens:,} tokens"
        )
        if "hetero-sync" in res:
            hs = res["hetero-sync"]
            lines.append(row(hs, "    sync DiLoCo (merges wait for island 0)"))
        lock = base.train_s + s.steps * h.method.slow_s
        lines.append(
            f"    lock-step ZeRO-3 with that rank (estimate): every step waits for it: "
            f"training {base.train_s:.0f} s + {s.steps} x {h.method.slow_s * 1e3:.0f} ms = "
            f"{lock:.0f} s for the baseline's {base.tokens:,} tokens"
        )
    return "\n".join(lines)


def plot(b: QualityBench, path: Path) -> Path:
    """Held-out loss against tokens for the three methods (and the variants, dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, r in b.results.items():
        main = key in ("zero3", "sync", "decoupled")
        x, y = zip(*r.curve)
        ax.plot(x, y, "-o" if main else "--", ms=3, lw=2 if main else 1, label=r.method.label)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("held-out loss")
    s = b.setup
    ax.set_title(
        f"{Path(s.model_config).stem}: M={s.islands}, H={s.sync_every}, P={s.num_fragments}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


PRESETS = {
    "tiny": {},
    "125m": {
        "model_config": str(REPO / "model_configs" / "llama-125m.json"),
        "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_gpu.json"),
        "seq_len": 512,
        "steps": 2000,
        "micro_batch": 8,
        "lr": 6e-4,
        "warmup_steps": 100,
        "num_fragments": 24,
        "sync_every": 96,
        "eval_blocks": 256,
        "points": 10,
    },
}
"""``--preset``: tiny (2 CPU cores, ~15 min), 125m (GPUs: one rank per GPU)."""


def setup_from_args(args) -> Setup:
    kw = dict(PRESETS[args.preset])
    if args.preset != "tiny":
        kw["gpus"] = torch.cuda.device_count()
        if not kw["gpus"]:
            raise ValueError(f"--preset {args.preset} needs CUDA GPUs; none is visible")
    for flag, field in (("steps", "steps"), ("islands", "islands"),
                        ("ranks_per_island", "ranks_per_island"), ("outer_lr", "outer_lr"),
                        ("sync_outer_lr", "sync_outer_lr"), ("compression", "compression"),
                        ("sync_every", "sync_every"), ("num_fragments", "num_fragments"),
                        ("workdir", "workdir")):  # fmt: skip
        value = getattr(args, flag, None)
        if value is not None:
            kw[field] = value
    if args.outer_lr is not None and args.sync_outer_lr is None:
        kw["sync_outer_lr"] = args.outer_lr
    return Setup(**kw)


def main(args) -> int:
    """The CLI's ``bench quality``."""
    logging.getLogger("ds_diloco.export").setLevel(logging.WARNING)  # a line per run otherwise
    s = setup_from_args(args)
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if args.tune:
        lrs = tuple(float(x) for x in args.tune_lrs.split(","))
        echo(f"bench quality --tune: outer lr in {lrs}, {s.steps} steps, tuning split only")
        picks = tune(s, lrs, echo)
        best = {kind: min(losses, key=losses.get) for kind, losses in picks.items()}
        for kind, losses in picks.items():
            cells = ", ".join(f"{x:g}: {v:.4f}" for x, v in losses.items())
            echo(f"  {LABELS[kind]}: tuning-split loss by outer lr {cells} -> {best[kind]:g}")
        echo(
            f"  use: ds-diloco bench quality --outer-lr {best['decoupled']:g} "
            f"--sync-outer-lr {best['sync']:g}"
        )
        if args.json:
            tuned = {k: {str(x): v for x, v in losses.items()} for k, losses in picks.items()}
            out = {"setup": dataclasses.asdict(s), "tuning_loss": tuned, "picked": best}
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    codecs = CODECS if not args.no_codecs else (s.compression,)
    echo(
        f"bench quality: {s.tokens:,} tokens per method; runs: zero3, sync, decoupled, "
        f"{len(codecs) - 1} codec variants, "
        f"{0 if args.no_hetero else 1 + args.hetero_sync} heterogeneous"
    )
    t0 = time.monotonic()
    b = run_bench(
        s, codecs=codecs, hetero=not args.no_hetero, hetero_sync=args.hetero_sync, echo=echo
    )
    png = plot(b, Path(args.plot or Path(s.workdir) / "quality.png"))
    echo(format_report(b))
    echo(f"  plot: {png}; benchmark wall time {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(b.to_json(), indent=1))
    return 0
