"""``ds-diloco bench quality``: held-out loss and bytes sent, against synchronous ZeRO-3.

The same Hugging Face model trains on the same real text, with the same total
number of tokens and the same inner optimiser (AdamW: learning rate, warm-up,
micro-batch, steps per rank), three ways:

- ``zero3``: one synchronous DeepSpeed ZeRO-3 data-parallel job over all M x R
  ranks (``ds-diloco island --plain``: the island loop without a coordinator);
- ``sync``: synchronous DiLoCo, M islands of R ranks, quorum K = M, no grace window;
- ``decoupled``: Decoupled DiLoCo, K = 1 plus the adaptive grace window.

Both DiLoCo runs share everything else: token weighting, RDA per tensor
(embeddings by plain mean), stale contributions dropped (the paper's rule),
outer Nesterov, H, P, tau and the pseudo-gradient codec; each has its own tuned
outer learning rate and momentum. Our islands never block on the coordinator,
so with K = M a fragment waits for every island's upload while training goes on.

Held-out text. ``data.heldout_split`` holds out blocks no island trains on. Its
first ``eval_blocks`` are the reported evaluation; the next ``eval_blocks`` are
the tuning split, read only by ``--tune`` (which compares outer learning rates
and momenta, trained with seeds 100, 101, ... that the reported runs never use),
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

Seeds. One run of a method is noisy: which island's upload closes a K = 1 round
depends on how the islands happen to be out of phase, and so does how many
contributions are dropped as stale. The three methods therefore run with
``seeds`` seeds (model initialisation and every rank's batch order; the
held-out split stays the same), and the loss ratio reported is the mean over
seeds of each seed's ratio to the baseline of the same seed, with its spread.
The variants run seed 0 only. Every DiLoCo run reports what the coordinator
merged and dropped: contributions per island, the inner steps in them, and the
staleness of the merged ones.

Stale contributions. With K = 1 an island whose uploads arrive after the
grace window loses them (and the inner steps in them): a round closes on the
first island's upload, and the others' are then one version stale. The islands
here drift apart (four processes on two cores) by steps within a run; phase
alignment (the coordinator's default, see ``CoordinatorConfig.align_phase``) moves
a late island's sends earlier, and ``--fixed-phase`` runs Decoupled DiLoCo without
it beside each seed (2 / 1 / 4 % of steps dropped with it, 30 / 36 / 4 % without,
in one 3-seed run). Besides the paper's rule (dropped), the variant ``stale-next``
(``--stale``) runs the
prototype of ``stale_merge.py``: a contribution one version stale rides along
with the fragment's next round (see ``STALE`` for the other modes tried).

End of training. An island that has done its steps sends every fragment's steps
since its last apply and waits until they are merged before it leaves
(``Learner.close``, see ``FragmentSyncer.flush``), so the global model evaluated
holds every island's last steps: about H/2 steps per fragment, and with K = M the
last rounds, that an island leaving first used to cut short. Each such fragment
then takes one more outer step (sync DiLoCo: 89 merges instead of 80) and about
10% more bytes. Measured with 3 seeds it did not help: sync DiLoCo's loss went
from 6.234 to 6.267 (every seed worse), Decoupled's from 6.401 to 6.483 (stale
drops, 52 / 0 / 68% of steps before, 38 / 56 / 53% after, decide that one). A
likely cause: the outer step that a flush adds is mostly Nesterov look-ahead
(lr x momentum x buffer), and no training follows to correct it.

Size: the defaults (tiny Llama, 80 steps, 3 seeds of the three methods, then
stale-next, codec none and the heterogeneous variant: 12 runs) took 27 minutes
(1647 s) on 2 CPU cores that other jobs kept busy (steps of about 0.6 s instead
of 0.4 s); at the 80 s a run of the earlier 7-run bench on idle cores, about 16
minutes.
``--codecs all`` adds int8 and
bf16; ``--steps`` scales the budget, ``--preset 125m`` moves to GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import statistics
import time
from pathlib import Path

import torch

from ds_diloco.compress import CODECS, RESIDUALS, Codec
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
from ds_diloco.run import LocalRun, device_ids, visible_devices

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
    """HF config.json of the model (initialised with the run's seed, the same for every method)."""
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
    outer_lr: float = 0.7
    """Decoupled DiLoCo's outer Nesterov learning rate, picked with ``momentum`` by ``--tune``
    on the tuning split (never on the reported blocks). At momentum 0.9, 0.4 beat 0.1, 0.2
    and 0.7 (loss 6.449, 6.260, 6.234, 6.513; one seed), and 0.4 / 0.9 beat 0.7 / 0.8 and
    1.0 / 0.6 (mean of tuning seeds 100, 101 at grace gamma 0.9: 6.252, 6.356, 6.553). With
    lower momenta (seeds 100, 101, grace gamma 0.9; same order): 0.7 / 0.4 6.076, 0.5 / 0.4
    6.102, 1.0 / 0 6.107, 0.7 / 0 6.127, 1.0 / 0.2 6.135, 0.5 / 0.6 6.142, 0.7 / 0.2 6.161,
    0.4 / 0.9 6.245, 0.7 / 0.6 6.283: 0.7 / 0.4. With about 7 outer steps per fragment in
    80 inner steps, a momentum of 0.9 (a memory of about 10 steps) never settles. One run
    varies by about 0.05 with the share of steps dropped as stale (4-62% here)."""
    sync_outer_lr: float = 0.7
    """Synchronous DiLoCo's outer learning rate, picked the same way: 0.4 at momentum 0.9
    (6.433, 6.238, 6.184, 6.430 at 0.1, 0.2, 0.4, 0.7), then 0.4 / 0.9 over 0.7 / 0.8 and
    1.0 / 0.6 (seeds 100, 101: 6.243, 6.253, 6.481); then 0.7 / 0.4 6.097 and 0.5 / 0.4
    6.123 over 0.4 / 0.9: 0.7 / 0.4."""
    momentum: float = 0.4
    """Decoupled DiLoCo's outer Nesterov momentum (tuned with ``outer_lr``)."""
    sync_momentum: float = 0.4
    """Synchronous DiLoCo's outer Nesterov momentum (tuned with ``sync_outer_lr``)."""
    stale_lambda: float = 1.0
    """Stale modes other than ``drop``: a contribution s versions stale weighs its token
    weight / (1 + stale_lambda x s)."""
    seeds: int = 3
    """Seeds of the three main methods (model initialisation and batch order 0, 1, ...):
    their losses and loss ratios are reported as mean and spread over seeds."""
    num_fragments: int = 12
    """P."""
    sync_every: int = 12
    """H: a fragment is sent every H steps; one fragment every H / P steps. 12 (with P = 12)
    over 10 (P = 10, 1.2x the bytes): on the tuning split (seeds 100, 101, outer lr 0.7,
    momentum 0.4, run one after the other) sync DiLoCo 6.111 at H = 12 and 6.127 at H = 10,
    Decoupled 6.101 and 6.127. The same H = 12 setting had given 6.097 and 6.076 in an earlier
    run: about 0.02 of it is run-to-run noise (which uploads turn stale)."""
    tau: int = 2
    grace_gamma: float = 0.9
    """Decoupled DiLoCo's grace-window safety factor (sync DiLoCo: 0). 0.9, tuned: the grace
    window, gamma x (tau x step - quorum - merge time), decides how many islands' uploads
    make a K = 1 round before it closes and the rest turn stale; on the tuning split (seeds
    100-102, lr 0.4, momentum 0.9) 0.5 lost 25%, 36%, 60% of the island steps (loss 6.196,
    6.280, 6.550), 0.9 lost 23%, 33%, 33% (6.270, 6.233, 6.256)."""
    wait_expected_steps: float = 0.0
    """Decoupled DiLoCo's ``policy.wait_expected_steps`` (0: the paper's rule)."""
    keep_local_steps: bool = False
    """Both DiLoCo runs' ``train.keep_local_steps`` (False: overwrite, the paper's rule)."""
    compression: str = "int4"
    """Codec of both DiLoCo runs' pseudo-gradients (the variants table tries all)."""
    block: int = 256
    """Values per quantisation scale."""
    residual: str = "float32"
    """How the DiLoCo runs' islands keep error-feedback residuals (float32 or bfloat16)."""
    eval_blocks: int = 64
    """Held-out blocks reported; as many more form the tuning split."""
    points: int = 5
    """Held-out evaluations along each run (the curve), the last at the end."""
    gpus: int = 0
    """GPUs to spread the ranks over (0: CPU)."""
    workdir: str = "runs/bench-quality"

    def __post_init__(self):
        """Checks what ``bench quality`` would otherwise find wrong only when the method
        using it starts (after the baseline's runs); errors name the CLI flag."""
        flag = _flag
        for name in ("islands", "ranks_per_island", "steps", "micro_batch", "points", "seeds",
                     "num_fragments", "sync_every", "tau"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.compression not in CODECS:
            raise ValueError(
                f"{flag('compression')} must be one of {CODECS}, got {self.compression!r}"
            )
        if self.residual not in RESIDUALS:
            raise ValueError(
                f"{flag('residual')} must be one of {RESIDUALS}, got {self.residual!r}"
            )
        # The outer optimizer's and the round policy's rules (OuterOptimConfig, PolicyOptions,
        # CoordinatorConfig), named by flag; ``check_runs`` builds the run configs as well.
        for name in ("outer_lr", "sync_outer_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(
                    f"{flag(name)} must be a finite number > 0 (DiLoCo uses 0.7), "
                    f"got {getattr(self, name)}"
                )
        for name in ("momentum", "sync_momentum", "grace_gamma"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.sync_every % self.num_fragments:
            raise ValueError(
                f"{flag('sync_every')} ({self.sync_every}) must be a multiple of "
                f"{flag('num_fragments')} ({self.num_fragments})"
            )
        if self.tau >= self.sync_every:
            raise ValueError(
                f"{flag('tau')} ({self.tau}) must be < {flag('sync_every')} ({self.sync_every}): "
                "a fragment's result must be applied before the fragment is sent again"
            )
        limit = self.sync_every - self.tau - 1
        if not (math.isfinite(self.wait_expected_steps) and 0 <= self.wait_expected_steps <= limit):
            raise ValueError(
                f"{flag('wait_expected_steps')} must be in [0, {flag('sync_every')} - "
                f"{flag('tau')} - 1 = {limit}], got {self.wait_expected_steps:g}"
            )
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
        if kind == "sync":
            return f"Nesterov lr {self.sync_outer_lr:g} momentum {self.sync_momentum:g}"
        return f"Nesterov lr {self.outer_lr:g} momentum {self.momentum:g}"

    def method(self, key: str, kind: str, **kw) -> Method:
        """A method with this setup's outer settings for its kind (``kw`` overrides)."""
        if kind != "zero3":
            sync = kind == "sync"
            kw.setdefault("codec", self.compression)
            kw.setdefault("outer_lr", self.sync_outer_lr if sync else self.outer_lr)
            kw.setdefault("momentum", self.sync_momentum if sync else self.momentum)
        return Method(key, kind, **kw)


_FLAGS = {
    "steps": "--steps",
    "islands": "--islands",
    "ranks_per_island": "--ranks-per-island",
    "sync_every": "--sync-every",
    "num_fragments": "--num-fragments",
    "outer_lr": "--outer-lr",
    "sync_outer_lr": "--sync-outer-lr",
    "momentum": "--momentum",
    "sync_momentum": "--sync-momentum",
    "seeds": "--seeds",
    "compression": "--compression",
    "residual": "--residual",
    "grace_gamma": "--grace-gamma",
    "tau": "--tau",
    "wait_expected_steps": "--wait-expected",
}
"""``bench quality``'s flag of each Setup field it sets (``setup_from_args``)."""


def _flag(name: str) -> str:
    """How an error names a Setup field: its flag, else ``Setup.<name>``."""
    return _FLAGS.get(name, f"Setup.{name}")


@dataclasses.dataclass(frozen=True)
class Method:
    """One training run of the comparison."""

    key: str
    kind: str
    """``zero3``, ``sync`` or ``decoupled``."""
    codec: str = "none"
    outer_lr: float = 0.7
    momentum: float = 0.9
    slow_s: float = 0.0
    """Island 0's sleep after each step (heterogeneous variant); it then trains half the steps."""
    seed: int = 0
    """Model initialisation and batch order of every rank."""
    stale: str = "drop"
    """What becomes of a contribution computed against an older version (``STALE``)."""
    outer: str = "nesterov"
    """Outer optimizer: ``nesterov`` or ``delayed_nesterov`` (momentum every M merges)."""
    align_phase: bool = True
    """Islands move their send phase after stale uploads (``CoordinatorConfig.align_phase``,
    the coordinator's default); False: every island keeps the schedule's phase."""

    def __post_init__(self):
        if self.stale not in STALE:
            raise ValueError(f"stale must be one of {tuple(STALE)}, got {self.stale!r}")

    @property
    def label(self) -> str:
        extra = f", {self.codec}" if self.kind != "zero3" else ""
        stale = f", {STALE[self.stale]}" if self.stale != "drop" else ""
        outer = ", delayed Nesterov" if self.outer == "delayed_nesterov" else ""
        slow = ", island 0 at half speed" if self.slow_s else ""
        fixed = ", fixed send phase" if not self.align_phase and self.kind != "zero3" else ""
        return f"{LABELS[self.kind]}{extra}{stale}{outer}{fixed}{slow}"


STALE = {
    "drop": "stale dropped",
    "next": "stale merged next round",
    "next-sgd": "stale merged next round by SGD",
    "async": "stale merged on arrival",
}
"""Stale contributions: ``drop`` (weight 0, the paper); ``next``: one version stale, they
ride along with the fragment's next round (``stale_merge.py``); ``next-sgd``: the same,
applied by plain SGD after the round's outer step; ``async``: the coordinator's
``staleness: discount`` mode, in which a stale arrival opens a round of its own."""


def run_config(s: Setup, m: Method, workdir: Path, init: str | None = None) -> RunConfig:
    """The run file of one method (``workdir`` absolute: island configs are read from it).

    ``init``: the baseline's model, a folder holding the seed's initial model (see
    :func:`save_initial`); the tokenizer stays the one trained on the corpus."""
    workdir = workdir.resolve()
    model = ModelSource(config=s.model_config, seed=m.seed)
    tokenizer = None
    if init is not None and m.kind == "zero3":
        from ds_diloco.data import tokenizer_dir

        model = ModelSource(pretrained=init)
        tokenizer = str(tokenizer_dir(s.cache_dir, s.corpus, s.vocab_size))
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
        outer=OuterOptimConfig(name=m.outer, lr=m.outer_lr, momentum=m.momentum, every=s.islands),
        policy=PolicyOptions(
            min_quorum=s.islands if sync else 1,
            grace_gamma=0.0 if sync else s.grace_gamma,
            tau=s.tau,
            wait_expected_steps=0.0 if sync else s.wait_expected_steps,
        ),
        staleness=(
            StalenessPolicy(mode="discount", discount_lambda=s.stale_lambda)
            if m.stale != "drop"
            else StalenessPolicy(mode="drop")
        ),
        compression=Codec(name=m.codec, block=s.block, residual=s.residual),
        align_phase=m.align_phase,
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
            tokenizer=tokenizer,
        ),
        train=TrainConfig(
            steps=s.steps,
            micro_batch=s.micro_batch,
            lr=s.lr,
            warmup_steps=s.warmup_steps,
            log_every=max(1, min(5, every)),
            eval_every=eval_every,
            eval_batches=eval_batches,
            seed=m.seed,
            keep_local_steps=s.keep_local_steps and m.kind != "zero3",
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
    if count > s.gpus:  # a slot listed once starts one rank: the island would be smaller
        raise ValueError(f"bench quality: an island of {count} ranks needs {count} GPUs, "
                         f"this machine has {s.gpus}; lower the ranks per island")  # fmt: skip
    slots = sorted({(first + i) % s.gpus for i in range(count)})
    # An include names the devices' own ids: given GPUs 4-7 (CUDA_VISIBLE_DEVICES, a Slurm
    # job's), slots 0-3 as ids ran every island on GPUs 0-3.
    ids = device_ids(slots, visible_devices())
    return "localhost:" + ",".join(map(str, ids))


# ------------------------------------------------------------------- evaluation
class Evaluator:
    """The held-out and tuning blocks, and the model to evaluate global values with."""

    def __init__(self, s: Setup):
        from ds_diloco.data import as_tensor, heldout_split, prepare_corpus
        from ds_diloco.hf_model import build_model

        _, blocks = prepare_corpus(s.corpus, s.cache_dir, s.vocab_size, s.seq_len)
        _, heldout = heldout_split(blocks, s.heldout_fraction, seed=0)
        if len(heldout) < 2 * s.eval_blocks:
            raise ValueError(
                f"the held-out split has {len(heldout)} blocks; eval_blocks {s.eval_blocks} "
                f"needs {2 * s.eval_blocks} (evaluation + tuning) from corpus {s.corpus}: raise "
                "heldout_fraction, or fetch the Shakespeare corpus first "
                "(bash launch/get_corpus.sh .cache/corpus .venv/bin/python)"
            )
        self.eval = as_tensor(heldout[: s.eval_blocks])
        self.tune = as_tensor(heldout[s.eval_blocks : 2 * s.eval_blocks])
        self.batch = 32  # per forward: larger batches evaluate several times faster on CPU
        self.model_config = s.model_config
        self.model = build_model(ModelSource(config=s.model_config, seed=0))
        self.params = sum(p.numel() for p in self.model.parameters())
        self._initial: dict[int, float] = {}

    def initial(self, seed: int = 0) -> float:
        """Held-out loss of the initial model of ``seed`` (every method starts from it)."""
        from ds_diloco.hf_model import build_model

        if seed not in self._initial:
            init = build_model(ModelSource(config=self.model_config, seed=seed))
            self._initial[seed] = self.loss(dict(init.named_parameters()))
        return self._initial[seed]

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


def save_initial(s: Setup, seed: int, path: Path) -> str:
    """The initial model of ``seed`` (``build_model``: the DiLoCo runs' and the evaluator's),
    saved as a pretrained folder at ``path``."""
    from ds_diloco.hf_model import build_model

    build_model(ModelSource(config=s.model_config, seed=seed)).save_pretrained(path)
    return str(path.resolve())


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
    initial: float = float("nan")
    """Held-out loss of this seed's initial model."""
    islands: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """DiLoCo, per island as the coordinator counted: ``merged`` and ``dropped``
    contributions, ``steps_merged`` and ``steps_dropped`` (inner steps in them); and
    ``sent``, the contributions the island uploaded, and ``skipped``, the scheduled sends
    it skipped (its syncer's counts). merged + dropped = sent once no island waits."""
    by_staleness: dict[str, int] = dataclasses.field(default_factory=dict)
    """DiLoCo: merged contributions by versions of staleness (0: fresh)."""
    by_quorum: dict[str, int] = dataclasses.field(default_factory=dict)
    """DiLoCo: merges by number of contributions merged."""

    @property
    def merged(self) -> int:
        return sum(i["merged"] for i in self.islands.values())

    @property
    def dropped(self) -> int:
        return sum(i["dropped"] for i in self.islands.values())

    @property
    def sent(self) -> int:
        return sum(i.get("sent", 0) for i in self.islands.values())

    @property
    def steps_dropped_share(self) -> float:
        """Share of the inner steps in finished contributions that were dropped as stale."""
        kept = sum(i["steps_merged"] for i in self.islands.values())
        lost = sum(i["steps_dropped"] for i in self.islands.values())
        return lost / (kept + lost) if kept + lost else float("nan")

    @property
    def steps_overwritten_share(self) -> float:
        """Share of the inner steps that a version merged without their island overwrote
        (phase alignment: fragments with no upload waiting take it), of those and the
        steps in finished contributions."""
        kept = sum(i["steps_merged"] + i["steps_dropped"] for i in self.islands.values())
        lost = sum(i.get("steps_overwritten", 0) for i in self.islands.values())
        return lost / (kept + lost) if kept + lost else float("nan")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.method.label}


def run_method(s: Setup, m: Method, ev: Evaluator, workdir: Path, echo=None) -> Result:
    """Train one method from its seed's initial model; evaluate it on the held-out blocks."""
    from ds_diloco.bench.stale_merge import StaleMergeRun
    from ds_diloco.export import load_global_tensors
    from ds_diloco.fragments import FragmentPlan

    # The baseline's ZeRO-3 engine built from the config draws its initial weights under
    # zero.Init: other values than the seed's model, which the DiLoCo runs start from (their
    # coordinator builds it; the islands take it). It is given that model as a folder.
    init = save_initial(s, m.seed, workdir / "initial-model") if m.kind == "zero3" else None
    cfg = run_config(s, m, workdir, init)
    if m.stale in ("next", "next-sgd"):
        lr = StaleMergeRun(cfg, max_staleness=1, stale_sgd=m.stale == "next-sgd")
    else:
        lr = LocalRun(cfg)
    snaps: list[tuple[int, dict]] = []
    status = None
    try:
        if m.kind != "zero3":
            lr.spawn_coordinator()  # it starts up while the islands do
        t0 = time.monotonic()
        for shard, spec in enumerate(cfg.islands):
            if shard == 0 and m.slow_s:  # the slow island: a train section of its own
                slow = dataclasses.replace(cfg.train, step_delay_s=m.slow_s, steps=s.steps // 2)
                spec = dataclasses.replace(spec, train=slow)
            lr.start_island(spec, shard, len(cfg.islands), plain=m.kind == "zero3")
        client = None if m.kind == "zero3" else lr.wait_for_coordinator()
        plan = client and FragmentPlan.from_json(client.plan()["plan"])
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
        if init:  # read at the start (and by a restart): a model's size in every run's folder
            shutil.rmtree(init, ignore_errors=True)
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
    counts: dict[str, dict[str, int]] = {}
    by_staleness: dict[str, int] = {}
    by_quorum: dict[str, int] = {}
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
        fields = ("merged", "dropped", "steps_merged", "steps_dropped")
        counts = {
            name: {f: int(isl.get(f, 0)) for f in fields}
            for name, isl in sorted(status["islands"].items())
        }
        for name, rs in per_island.items():  # contributions uploaded (each rank: its slices)
            if name in counts:
                counts[name]["sent"] = min(r["stats"]["uploads"] for r in rs)
                counts[name]["skipped"] = min(r["stats"]["skipped"] for r in rs)
                for f in ("shifted_over", "shifted_steps", "steps_overwritten", "flushed"):
                    counts[name][f] = min(r["stats"].get(f, 0) for r in rs)
                # never answered (coordinator unreachable) or refused
                for f in ("failed", "refused"):
                    counts[name][f] = max(r["stats"][f] for r in rs)
        run = status.get("run", {})
        by_staleness = {str(k): int(v) for k, v in sorted(run.get("by_staleness", {}).items())}
        by_quorum = {str(k): int(v) for k, v in sorted(run.get("by_quorum", {}).items())}
    result = Result(
        method=m,
        loss=loss,
        tune_loss=tune_loss,
        curve=[(0, ev.initial(m.seed)), *curve],
        tokens=tokens,
        bytes_up=up,
        bytes_down=down,
        wall_s=round(wall, 1),
        train_s=round(train_s, 1),
        step_s=step_s,
        merges=merges,
        initial=ev.initial(m.seed),
        islands=counts,
        by_staleness=by_staleness,
        by_quorum=by_quorum,
    )
    if echo:
        echo(run_line(result))
    return result


def run_line(r: Result) -> str:
    """One line about a finished run (printed as the benchmark goes)."""
    line = (
        f"    {r.method.key} seed {r.method.seed}: held-out loss {r.loss:.4f}, {r.tokens} tokens, "
        f"wall {r.wall_s} s (training {r.train_s} s), uploads {r.bytes_up} B, merges {r.merges}"
    )
    if r.islands:
        share = r.steps_dropped_share
        line += (
            f"; contributions merged {r.merged}, dropped {r.dropped} ({share:.0%} of steps; "
            f"steps overwritten by rounds without their island {r.steps_overwritten_share:.0%})"
        )
    return line


def _tokens_so_far(lr: LocalRun) -> int:
    return sum(r.get("tokens", 0) for r in lr.island_records().values())


def _progress(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


# ---------------------------------------------------------------- the benchmark
MAIN = ("zero3", "sync", "decoupled")
"""Method keys run with every seed; the others (variants) with seed 0."""
FIXED = "decoupled-fixed-phase"
"""``--fixed-phase``: Decoupled DiLoCo without phase alignment, every seed (paired A/B)."""


def _runs(key: str, args) -> bool:
    """Whether ``bench quality``'s ``args`` run the method ``key`` with every seed."""
    return {"sync": not args.no_sync, FIXED: args.fixed_phase}.get(key, True)


DEFAULT_STALE_VARIANTS = ("next",)
"""The stale modes run as variants by default (``--stale``)."""
DEFAULT_CODEC_VARIANTS = ("none",)
"""The codecs run as variants by default (``--codecs``; ``all``: every codec): the
uncompressed pseudo-gradients beside the main runs' int4. One run each costs as much as a
seed of a main method; int8 and bf16 are left to ``--codecs all``."""


@dataclasses.dataclass
class QualityBench:
    setup: Setup
    results: dict[str, list[Result]]
    """By method key (zero3, sync, decoupled, stale-decoupled, codec-<name>,
    hetero-decoupled, hetero-sync), its runs by seed (the variants: seed 0 only)."""
    evaluator_params: int
    initial_loss: float
    """Held-out loss of the initial model of seed 0."""
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

    def baseline(self, seed: int) -> Result:
        return next(r for r in self.results["zero3"] if r.method.seed == seed)

    def loss_ratio(self, r: Result) -> float:
        """Held-out loss over the baseline's of the same seed."""
        return r.loss / self.baseline(r.method.seed).loss

    def ratios(self, key: str) -> list[float]:
        """Per-seed loss ratios of a method to the baseline."""
        return [self.loss_ratio(r) for r in self.results[key]]

    def summary(self, key: str) -> dict:
        runs = self.results[key]
        loss, loss_sd = mean_sd([r.loss for r in runs])
        ratio, ratio_sd = mean_sd(self.ratios(key))
        return {
            "seeds": [r.method.seed for r in runs],
            "loss_mean": loss,
            "loss_sd": loss_sd,
            "ratio_mean": ratio,
            "ratio_sd": ratio_sd,
            "ratio_se": ratio_sd / len(runs) ** 0.5,
            "ratios": self.ratios(key),
            "sent": [r.sent for r in runs],
            "merged": [r.merged for r in runs],
            "dropped": [r.dropped for r in runs],
            "steps_dropped_share": [r.steps_dropped_share for r in runs],
        }

    def to_json(self) -> dict:
        return {
            "setup": dataclasses.asdict(self.setup),
            "params": self.evaluator_params,
            "initial_loss": self.initial_loss,
            "grad_bytes": self.grad_bytes,
            "allreduce_bytes_per_token": self.allreduce_bytes_per_token(),
            "summary": {k: self.summary(k) for k in self.results},
            "results": {k: [r.to_json() for r in rs] for k, rs in self.results.items()},
        }


def grad_bytes(deepspeed_config: str) -> int:
    ds = json.loads(Path(deepspeed_config).read_text())
    half = any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16"))
    return 2 if half else 4


def run_bench(
    s: Setup,
    *,
    codecs: tuple[str, ...] = DEFAULT_CODEC_VARIANTS,
    hetero: bool = True,
    hetero_sync: bool = False,
    sync: bool = True,
    stale: tuple[str, ...] | None = None,
    hetero_stale: str | None = None,
    fixed_phase: bool = False,
    echo=None,
) -> QualityBench:
    """The three methods with every seed, then the variants (seed 0): Decoupled DiLoCo with
    the ``stale`` modes (see ``STALE``; None: ``DEFAULT_STALE_VARIANTS``), with the codecs,
    with heterogeneous islands (and with the ``hetero_stale`` mode too)."""
    root = Path(s.workdir).resolve()  # island configs resolve relative paths against themselves
    stale = DEFAULT_STALE_VARIANTS if stale is None else stale
    ev = Evaluator(s)
    out: dict[str, list[Result]] = {}

    def go(m: Method) -> Result:
        if echo:
            echo(f"  running {m.key} seed {m.seed}: {m.label} ...")
        workdir = root / (m.key if m.seed == 0 else f"{m.key}-seed{m.seed}")
        r = run_method(s, m, ev, workdir, echo)
        out.setdefault(m.key, []).append(r)
        return r

    for seed in range(s.seeds):  # seed by seed: an interrupted bench still pairs its runs
        go(s.method("zero3", "zero3", seed=seed))
        if sync:
            go(s.method("sync", "sync", seed=seed))
        go(s.method("decoupled", "decoupled", seed=seed))
        if fixed_phase:  # paired by seed: what phase alignment does
            go(s.method(FIXED, "decoupled", seed=seed, align_phase=False))
    main = out["decoupled"][0]
    for mode in stale:
        go(s.method(f"stale-{mode}", "decoupled", stale=mode))
    for c in codecs:
        if c != s.compression:
            go(s.method(f"codec-{c}", "decoupled", codec=c))
    if hetero:
        delay = round(statistics.median(main.step_s), 4)  # island 0 at about half speed
        go(s.method("hetero-decoupled", "decoupled", slow_s=delay))
        if hetero_stale:
            go(
                s.method(
                    f"hetero-stale-{hetero_stale}", "decoupled", slow_s=delay, stale=hetero_stale
                )
            )
        if sync and hetero_sync:
            go(s.method("hetero-sync", "sync", slow_s=delay))
    return QualityBench(s, out, ev.params, ev.initial(0), grad_bytes(s.deepspeed_config))


TUNE_SEEDS = 100
"""``--tune`` trains with seeds 100, 101, ...: not the reported runs' seeds."""


def tune(
    s: Setup,
    grid: list[tuple[float, float]],
    *,
    kinds: tuple[str, ...] = ("sync", "decoupled"),
    seeds: int = 1,
    stale: str = "drop",
    echo=None,
) -> dict[str, dict[tuple[float, float], list[float]]]:
    """Tuning-split losses of each DiLoCo method at each (outer lr, momentum) of ``grid``,
    with seeds TUNE_SEEDS, TUNE_SEEDS + 1, ...: the reported blocks are never read.
    Decoupled DiLoCo runs with ``s.grace_gamma`` and stale contributions as ``stale``."""
    ev = Evaluator(s)
    out: dict[str, dict[tuple[float, float], list[float]]] = {k: {} for k in kinds}
    for kind in kinds:
        for lr_, mom in grid:
            for seed in range(TUNE_SEEDS, TUNE_SEEDS + seeds):
                extra = f"-g{s.grace_gamma:g}-{stale}" if kind == "decoupled" else ""
                key = f"tune-{kind}{extra}-{lr_:g}-{mom:g}-seed{seed}"
                mode = stale if kind == "decoupled" else "drop"
                m = s.method(key, kind, outer_lr=lr_, momentum=mom, seed=seed, stale=mode)
                if echo:
                    echo(f"  tuning {kind}: outer lr {lr_:g} momentum {mom:g} seed {seed} ...")
                r = run_method(s, m, ev, Path(s.workdir).resolve() / "tune" / key)
                out[kind].setdefault((lr_, mom), []).append(r.tune_loss)
                if echo:
                    echo(
                        f"    tuning-split loss {r.tune_loss:.4f} ({r.merges} merges; "
                        f"contributions merged {r.merged}, dropped {r.dropped}: "
                        f"{r.steps_dropped_share:.0%} of steps; {r.wall_s} s)"
                    )
    return out


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
    for field in ("steps", "islands", "ranks_per_island", "outer_lr", "sync_outer_lr",
                  "momentum", "sync_momentum", "grace_gamma", "compression", "sync_every",
                  "num_fragments", "seeds", "workdir", "wait_expected_steps", "tau",
                  "keep_local_steps", "residual"):  # fmt: skip
        value = getattr(args, field, None)
        if value is not None:
            kw[field] = value
    if args.outer_lr is not None and args.sync_outer_lr is None:
        kw["sync_outer_lr"] = args.outer_lr
    if getattr(args, "momentum", None) is not None and getattr(args, "sync_momentum", None) is None:
        kw["sync_momentum"] = args.momentum
    return Setup(**kw)


def stale_modes(text: str | None) -> tuple[str, ...]:
    """``--stale``: comma-separated modes of ``STALE`` (None: the default variant; "none")."""
    if text is None:
        return DEFAULT_STALE_VARIANTS
    modes = tuple(m for m in text.split(",") if m and m != "none")
    bad = [m for m in modes if m not in STALE]
    if bad:
        raise ValueError(f"--stale: unknown mode(s) {bad}; one of {tuple(STALE)} or 'none'")
    return modes


def codec_variants(text: str | None, none: bool = False) -> tuple[str, ...]:
    """``--codecs``: comma-separated codecs, or "all" (None: ``DEFAULT_CODEC_VARIANTS``)."""
    if none:
        return ()
    if text is None:
        return DEFAULT_CODEC_VARIANTS
    codecs = CODECS if text == "all" else tuple(c for c in text.split(",") if c)
    bad = [c for c in codecs if c not in CODECS]
    if bad:
        raise ValueError(f"--codecs: unknown codec(s) {bad}; one of {CODECS} or 'all'")
    return codecs


def _floats(text: str, flag: str = "a list") -> tuple[float, ...]:
    """Comma-separated numbers; ValueError naming ``flag`` for anything else."""
    out = []
    for x in text.split(","):
        try:
            out.append(float(x))
        except ValueError:
            raise ValueError(f"{flag}: {x.strip()!r} is not a number ({flag} takes "
                             "comma-separated numbers, e.g. 0.2,0.4)") from None  # fmt: skip
    return tuple(out)


TUNE_KINDS = ("sync", "decoupled")


def tune_options(args, s: Setup) -> tuple[tuple[float, ...], tuple[float, ...], int, tuple, str]:
    """``--tune``'s (outer lrs, momenta, seeds, kinds, stale mode), checked by flag."""
    lrs = _floats(args.tune_lrs, "--tune-lrs")
    moms = _floats(args.tune_momenta or str(s.momentum), "--tune-momenta")
    bad = [x for x in lrs if not (math.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"--tune-lrs: outer lrs must be finite numbers > 0, got {bad}")
    bad = [x for x in moms if not 0 <= x < 1]
    if bad:
        raise ValueError(f"--tune-momenta: momenta must be in [0, 1), got {bad}")
    seeds = args.tune_seeds
    if seeds < 1:
        raise ValueError(f"--tune-seeds must be >= 1, got {seeds}")
    kinds = tuple(dict.fromkeys(k.strip() for k in args.tune_kinds.split(",") if k.strip()))
    bad = [k for k in kinds if k not in TUNE_KINDS]
    if bad or not kinds:
        raise ValueError(f"--tune-kinds: one or more of {TUNE_KINDS}, got {args.tune_kinds!r}")
    stale = args.tune_stale
    if stale not in STALE:
        raise ValueError(f"--tune-stale must be one of {tuple(STALE)}, got {stale!r}")
    return lrs, moms, seeds, kinds, stale


def check_runs(s: Setup, methods: list[Method]) -> None:
    """Build each method's run config (nothing is written or started): whatever the run
    files refuse is found before the first run, not after the baseline's."""
    for m in methods:
        try:
            run_config(s, m, Path(s.workdir) / m.key)
        except ValueError as e:
            raise ValueError(f"bench quality: {m.label}: {e}") from None


def main(args) -> int:
    """The CLI's ``bench quality``. Every flag is checked before anything runs."""
    from ds_diloco.bench.quality_report import format_report, format_tune, plot

    logging.getLogger("ds_diloco.export").setLevel(logging.WARNING)  # a line per run otherwise
    s = setup_from_args(args)
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if args.tune:
        lrs, moms, seeds, kinds, stale = tune_options(args, s)
        check_runs(s, [
            s.method(k, k, outer_lr=x, momentum=m, stale=stale if k == "decoupled" else "drop")
            for k in kinds for m in moms for x in lrs
        ])  # fmt: skip
        echo(
            f"bench quality --tune: {', '.join(kinds)} (Decoupled: grace gamma "
            f"{s.grace_gamma:g}, {STALE[stale]}); outer lr in {lrs}, momentum in {moms}, seeds "
            f"{TUNE_SEEDS}..{TUNE_SEEDS + seeds - 1}, {s.steps} steps; tuning split only"
        )
        grid = [(x, m) for m in moms for x in lrs]
        picks = tune(s, grid, kinds=kinds, seeds=seeds, stale=stale, echo=echo)
        for line in format_tune(picks, seeds):
            echo(line)
        if args.json:
            out = {
                "setup": dataclasses.asdict(s),
                "seeds": list(range(TUNE_SEEDS, TUNE_SEEDS + seeds)),
                "stale": stale,
                "tuning_loss": {
                    k: {f"{x:g}/{m:g}": v for (x, m), v in losses.items()}
                    for k, losses in picks.items()
                },
            }
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    codecs = codec_variants(args.codecs, args.no_codecs)
    stale = stale_modes(args.stale)
    hetero = 0 if args.no_hetero else 1 + bool(args.hetero_stale) + args.hetero_sync
    if args.hetero_stale and args.hetero_stale not in STALE:
        raise ValueError(f"--hetero-stale must be one of {tuple(STALE)}")
    check_runs(s, [
        *(s.method(k, k) for k in MAIN),
        *(s.method(f"stale-{mode}", "decoupled", stale=mode) for mode in stale),
        *(s.method(f"codec-{c}", "decoupled", codec=c) for c in codecs),
    ])  # fmt: skip
    echo(
        f"bench quality: {s.tokens:,} tokens per method; runs: "
        f"{', '.join(k for k in (*MAIN, FIXED) if _runs(k, args))} x "
        f"{s.seeds} seed(s), {len(stale)} stale-mode variant(s), "
        f"{len([c for c in codecs if c != s.compression])} codec variant(s), "
        f"{hetero} heterogeneous"
    )
    t0 = time.monotonic()
    b = run_bench(
        s,
        codecs=codecs,
        hetero=not args.no_hetero,
        hetero_sync=args.hetero_sync,
        stale=stale,
        hetero_stale=args.hetero_stale,
        fixed_phase=args.fixed_phase,
        sync=not args.no_sync,
        echo=echo,
    )
    png = plot(b, Path(args.plot or Path(s.workdir) / "quality.png"))
    echo(format_report(b))
    echo(f"  plot: {png}; benchmark wall time {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(b.to_json(), indent=1))
    return 0
