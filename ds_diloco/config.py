"""Typed configs that validate themselves, loaded from YAML or JSON files.

Every config is a ``kw_only`` dataclass with a docstring under each field;
``__post_init__`` raises ``ValueError`` naming the field and the fix. Files are
mapped onto the dataclasses by :func:`from_dict`, which rejects unknown keys
with their dotted path, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ds_diloco.compress import Codec
from ds_diloco.merge import DEFAULT_PLAIN_PATTERNS, NormGuard, StalenessPolicy
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions

TOKEN_ENV = "DS_DILOCO_TOKEN"
# An island's name goes into URLs and file paths as it is; the coordinator's
# registration applies the same rule.
ISLAND_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
ISLAND_ID_RULE = "1-128 of A-Z a-z 0-9 . _ - (not . or ..)"


def _finite(x: float, at_least: float = 0.0, strict: bool = False) -> bool:
    """x is a finite number >= at_least (> at_least when strict): NaN fails every comparison."""
    return math.isfinite(x) and (x > at_least if strict else x >= at_least)


def valid_island_id(name) -> bool:
    """Config and coordinator registration alike: ``ISLAND_ID_RULE``."""
    return isinstance(name, str) and bool(ISLAND_ID.fullmatch(name)) and name not in (".", "..")


def _check_port(where: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{where} must be in 0..65535, got {port}")


def parse_include(include: str) -> dict[str, list[int] | None]:
    """The deepspeed launcher's ``--include`` ('host:0,1@host2:0,1') as {host: slots}, parsed
    as the launcher does (``deepspeed.launcher.runner.parse_node_config_list``); a bare host
    (all of its slots, from the hostfile) maps to None. A slot or host given twice is refused:
    the launcher would merge them silently, and the slots are counted against world_size."""
    hosts: dict[str, list[int] | None] = {}
    for node in include.split("@"):
        host, colon, slots = node.partition(":")
        if not host or ":" in slots or host in hosts:
            raise ValueError(
                f"expected 'host:slot,slot[@host:slot,...]' with each host once, got {include!r}"
            )
        try:
            ids = [int(x) for x in slots.split(",")] if colon else None
        except ValueError:
            where = "" if node == include else f" in {include!r}"
            raise ValueError(f"slots must be integers, got {node!r}{where}") from None
        if ids is not None and (min(ids) < 0 or len(set(ids)) != len(ids)):
            raise ValueError(f"slots must be distinct and >= 0, got {node!r}")
        hosts[host] = ids
    return hosts


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where the initial global model comes from: a pretrained folder or a config + seed."""

    pretrained: str | None = None
    """A Hugging Face model folder (config.json + safetensors) to start from."""
    config: str | None = None
    """A Hugging Face config.json (or a folder holding one) to initialise from scratch."""
    seed: int = 0
    """Seed of the from-scratch initialisation (ignored with ``pretrained``)."""

    def __post_init__(self):
        if (self.pretrained is None) == (self.config is None):
            raise ValueError("model: set exactly one of 'pretrained' (a model folder) or 'config'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """The outer loop's service: model, fragments, merge rules, durability, limits."""

    model: ModelSource
    """The initial global model (used only when ``state_dir`` holds no state yet)."""
    state_dir: str
    """Durable state: global fragments, versions, outer optimizer state, island table."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 0
    """Port to bind; 0 picks a free one (the bound address is logged and reported)."""
    num_fragments: int = 24
    """P: fragments the model is split into (the paper uses 24)."""
    fragmentation: str = "balanced"
    """'balanced' (greedy bin-packing by bytes) or 'layer' (contiguous blocks)."""
    sync_every: int = 24
    """H: inner steps between two syncs of the same fragment (told to the islands)."""
    outer: OuterOptimConfig = dataclasses.field(default_factory=OuterOptimConfig)
    """Outer optimizer (Nesterov SGD by default: lr 0.7, momentum 0.9)."""
    policy: PolicyOptions = dataclasses.field(default_factory=PolicyOptions)
    """When a round closes: minimum quorum K, grace window, and tau (the overlap the
    islands use: inner steps between sending a fragment and applying its result)."""
    staleness: StalenessPolicy = dataclasses.field(default_factory=StalenessPolicy)
    """What happens to a pseudo-gradient computed against an older version."""
    norm_guard: NormGuard = dataclasses.field(default_factory=NormGuard)
    """Refuse pseudo-gradients far above the fragment's recent ones (off by default)."""
    align_phase: bool = True
    """Islands whose uploads come back stale move their send schedule earlier by as many
    steps as they were late (the stale reply says by how much), so that their sends fall
    into the other islands' rounds instead of missing every one (K < M): islands drift
    apart (a few % of speed is steps of lag within minutes) and the grace window covers
    under tau steps. Fragments with no upload waiting take the versions merged without
    the island, so no base stays a version behind. Served at registration, like
    ``compression``. Measured (``bench quality --seeds 3 --fixed-phase --no-sync``, tiny
    Llama, 4 single-rank islands on 2 cores): island steps dropped as stale 2 / 1 / 4 %
    by seed against 30 / 36 / 4 % with a fixed phase, held-out loss 1.021 x ZeRO-3's
    against 1.028 (lower in every seed: 0.993, 0.988, 0.997). An island whose sends come
    after the round closed but whose base follows the merged version sends nothing stale;
    downloads say when the version's round opened, so a send from a fragment following
    one measures the island's lateness the same way (steps overwritten, bench quality's
    ``ovw``, 50 % -> 9 % in a seed-0 run). False: every island keeps the schedule's phase
    (the paper's schedule)."""
    plain_patterns: tuple[str, ...] = DEFAULT_PLAIN_PATTERNS
    """Regexes of tensor names merged by plain averaging (embeddings); the rest use RDA
    (with ``outer.name`` average, every tensor is merged by plain averaging)."""
    compression: Codec = dataclasses.field(default_factory=Codec)
    """How islands compress pseudo-gradients on the wire, e.g. ``{name: int4, block: 256}``
    (``name``: none, bf16, int8 or int4; see ``ds_diloco/compress.py``), with error
    feedback. Served with the plan at registration, so every island uses the run's
    setting; the coordinator decodes whatever codec an upload names. Error feedback keeps
    each rank's quantisation residuals: one more fp32 copy of its shard in host memory
    (two in all with the base copy), filled as fragments are first sent (llama-1b on one
    H200, int4: peak RSS 10.7 GB per rank against 3.4 GB plain ZeRO-3, shard 4.0 GB);
    ``residual: bfloat16`` keeps them in half of that."""
    save_every_merges: int = 10
    """Write changed fragments to ``state_dir`` after this many merges (and on SIGTERM)."""
    max_body_mb: float | None = None
    """Largest accepted request body, in MiB. None: the largest upload a valid island can
    send (an island of one rank: the largest fragment in fp32, plus its header), e.g.
    64 MiB for the 125M Llama with P = 8 and 1.1 GiB for a 7B one with P = 24. A value
    below that is a warning at start: such uploads are refused (413) whenever they come."""
    island_timeout_s: float = 20.0
    """Lease: an island not heard from for this long no longer counts as live for the
    quorum (islands send a heartbeat every few seconds, see ``syncer.HEARTBEAT_S``)."""
    durable_merges: bool = True
    """Write every merged fragment to ``state_dir`` before serving its version, so that no
    acknowledged (served) merge is lost in a crash. False: only every ``save_every_merges``
    (a crash then resumes at older values, under a higher version number)."""
    uptime_window_s: float = 10.0
    """Uptime is the share of windows of this many seconds in which some fragment advanced
    (a state dir keeps the window its uptime was counted in)."""
    stall_exit_s: float = 120.0
    """A coordinator process whose event loop does not come round for this long (a
    deadlock: nothing it does holds the loop for more than moments) writes every thread's
    stack to its log and exits (status 1), for its supervisor (``ds-diloco run``, systemd,
    Kubernetes) to restart it: merges are on disk before they are served. Not while it
    starts or saves at shutdown. 0: never."""
    token: str | None = None
    """Bearer token; default: $DS_DILOCO_TOKEN, else a random one written to state_dir/token."""
    tls_cert: str | None = None
    """Serve HTTPS with this PEM certificate (chain) and ``tls_key``: islands on networks the
    run does not own, where the token and the model must not travel in clear text. Islands
    trust it through their ``coordinator_ca`` (``ds_diloco/tls.py``); ``ds-diloco run``'s
    own islands trust this file."""
    tls_key: str | None = None
    """The private key (PEM, unencrypted) of ``tls_cert``."""

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {self.num_fragments}")
        if self.sync_every < 1:  # before the rules below, whose messages would mislead
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        if self.fragmentation not in ("balanced", "layer"):
            raise ValueError(
                f"fragmentation must be 'balanced' or 'layer', got {self.fragmentation!r}"
            )
        if self.sync_every % self.num_fragments:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be a multiple of num_fragments "
                f"({self.num_fragments}) so that one fragment is sent every H/P steps"
            )
        if self.policy.tau >= self.sync_every:
            raise ValueError(
                f"policy.tau ({self.policy.tau}) must be < sync_every ({self.sync_every}): "
                "a fragment's result must be applied before the fragment is sent again"
            )
        if self.policy.wait_expected_steps > self.sync_every - self.policy.tau - 1:
            raise ValueError(
                f"policy.wait_expected_steps ({self.policy.wait_expected_steps:g}) must be <= "
                f"sync_every - tau - 1 ({self.sync_every - self.policy.tau - 1}): a result "
                "later than that comes after its fragment is due again"
            )
        if self.save_every_merges < 1:
            raise ValueError(f"save_every_merges must be >= 1, got {self.save_every_merges}")
        for name in ("max_body_mb", "island_timeout_s", "uptime_window_s"):
            if name == "max_body_mb" and self.max_body_mb is None:
                continue
            if not _finite(getattr(self, name), 0, strict=True):
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if not _finite(self.stall_exit_s):
            raise ValueError(
                f"stall_exit_s must be >= 0 (0: never) and finite, got {self.stall_exit_s}"
            )
        _check_port("port", self.port)
        for pattern in self.plain_patterns:  # a bad one would fail at the first merge
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"plain_patterns: {pattern!r} is not a regex: {e}") from None

    def url_at(self, host: str, port: int) -> str:
        """This coordinator's URL when it listens at ``host:port``."""
        if ":" in host:  # IPv6: http://::1:8470 is no URL (a run's islands were refused it)
            host = f"[{host}]"
        return f"{'https' if self.tls_cert else 'http'}://{host}:{port}"

    def resolve_token(self) -> str:
        """The bearer token: config, then environment, then state_dir/token (created)."""
        if self.token:
            return self.token
        if os.environ.get(TOKEN_ENV):
            return os.environ[TOKEN_ENV]
        path = Path(self.state_dir) / "token"
        if not path.exists():
            import secrets
            import tempfile

            # Written whole, then linked into place: never an empty file, and of two
            # processes creating it at once, the second one reads the first one's token.
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".token.")  # mode 0600
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32))
                    f.flush()
                    os.fsync(f.fileno())
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)
            finally:
                os.unlink(tmp)
        token = path.read_text().strip()
        if not token:  # an empty token would admit any request that sends "Bearer "
            raise ValueError(f"token file {str(path)!r} is empty: delete it or set {TOKEN_ENV}")
        return token


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """An island's text: where it comes from, how it becomes fixed-length token blocks."""

    path: str
    """Text file or folder (its *.txt files, else its .json/.jsonl/.ndjson/.parquet files; hidden
    entries and our caches skipped, linked folders followed), a saved dataset, or a
    ``load_dataset`` name. Text is UTF-8 (else cp1252), or UTF-16/32 with a byte-order
    mark; several Gutenberg books in one file each lose their licence."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer folder; None trains a byte-level BPE on the corpus (cached)."""
    vocab_size: int = 4096
    """Vocabulary of the trained tokenizer (ignored with ``tokenizer``)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    text_field: str = "text"
    """Column holding the text in json/parquet/hub datasets."""
    split: str = "train"
    """The split of a dataset that has several (a saved ``DatasetDict``, a hub dataset), or
    of a folder whose file or folder names name them as ``datasets`` reads them
    (``train.jsonl``/``test.jsonl``, ``valid/``: files naming none are left out)."""
    subset: str | None = None
    """The configuration of a hub dataset that has several (``datasets.load_dataset``'s
    second argument: wikitext's ``wikitext-103-raw-v1``); ignored for local files."""
    heldout_fraction: float = 0.02
    """Share of blocks held out for evaluation (the same blocks on every island)."""
    cache_dir: str = ".cache/ds_diloco"
    """Tokenizer and packed blocks are cached here, keyed by the corpus fingerprint."""
    seed: int = 0
    """Seed of the held-out split (the same blocks held out on every island; the order an
    island walks its blocks in follows ``train.seed``)."""
    prepare_timeout_s: float = 6 * 3600.0
    """How long an island's ranks wait for the one that tokenises the corpus into the cache
    (once per corpus and tokenizer: later launches find it filled). Their process group's
    own timeout (30 min) ended the wait on a large corpus. ``ds-diloco prepare-data`` fills
    the cache ahead of a launch."""

    def __post_init__(self):
        if not _finite(self.prepare_timeout_s, 0, strict=True):
            raise ValueError(
                f"data.prepare_timeout_s must be > 0 and finite, got {self.prepare_timeout_s}"
            )
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(
                f"data.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )
        if self.vocab_size < 259:
            raise ValueError(
                f"data.vocab_size must be >= 259 (bytes + 3 specials), got {self.vocab_size}"
            )
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")


CONVERT_TIMEOUT_S = 6 * 3600.0
"""``train.convert_timeout_s``'s default."""

LR_SCHEDULES = ("constant", "cosine")
"""``train.lr_schedule``: the inner learning rate after the warm-up."""


def learner_steps_at(step: int, sync_blocks: int, off_first: bool = False) -> bool:
    """Whether the learner steps at inner step ``step`` (from 1) of a loop whose syncer is
    on only in every other block of ``sync_blocks`` steps (``TrainConfig.sync_blocks``; 0:
    on at every step), the first block off if ``off_first``. The same on every rank."""
    if not sync_blocks:
        return True
    return ((step - 1) // sync_blocks + int(off_first)) % 2 == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The inner loop of one island."""

    steps: int = 200
    """Inner steps to run (each: ``grad_accum`` micro-batches per rank, then an AdamW step)."""
    micro_batch: int = 4
    """Sequences per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per inner step: their gradients are summed (DeepSpeed's
    ``gradient_accumulation_steps``) before the AdamW step, so an island's batch is
    micro_batch x grad_accum x its ranks. Every count in steps (warm-up, H, checkpoints,
    logs) is one of these inner steps."""
    lr: float = 1e-3
    """AdamW learning rate (the peak, with a warm-up or a decay)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in inner steps."""
    lr_schedule: str = "constant"
    """After the warm-up: ``constant`` (lr), or ``cosine``: from lr down to ``min_lr`` at
    the last of ``steps`` (half a cosine)."""
    min_lr: float = 0.0
    """``cosine``'s learning rate at the last step."""
    blend_alpha: float = 0.0
    """Applying a merged fragment: local = alpha * local + (1 - alpha) * global (0: overwrite)."""
    keep_local_steps: bool = False
    """Applying a merged fragment: local = global + (local now - local at its upload), so
    the steps trained while the result was on the way (tau or more) are kept and go into
    the next upload, instead of being overwritten. Costs a copy of the slices in flight."""
    log_every: int = 10
    """Write a progress record every this many steps."""
    eval_every: int = 0
    """Evaluate the island's model on held-out blocks every this many steps (0: never)."""
    eval_batches: int = 4
    """Held-out micro-batches per evaluation."""
    seed: int = 0
    """Seed of the island's (non-global) randomness."""
    step_delay_s: float = 0.0
    """Sleep this long after every inner step (benchmarks: a slower island)."""
    sync_blocks: int = 0
    """Measurement aid (``bench island``'s paired launches): the learner steps only in every
    other block of this many inner steps, starting with the first (the second with
    ``sync_blocks_off_first``); in the blocks between, the loop is plain ZeRO-3 (nothing
    sent or applied). 0: in every step."""
    sync_blocks_off_first: bool = False
    """With ``sync_blocks``: the first block is the plain one, the learner steps from the
    second (the bench alternates the two orders, so that a launch's own warm-up weighs
    on both sides alike)."""
    stall_exit_s: float = 600.0
    """A rank whose training loop has not come round for this long (a peer frozen in a
    collective, a deadlock, a dead disk) writes every thread's stack to the island's log
    and exits (status 1); its launcher then stops the other ranks and ``ds-diloco run``
    (or whatever restarts the job) restarts the island, which resumes from its last
    checkpoint. Watched from the first step to the last, checkpoint saves left out (the
    final flush has bounded waits of its own): it must cover one inner step and the
    ``eval_every`` evaluation after it. Far below the process group's timeout (30 min),
    after which a collective would fail. 0: never."""
    startup_stall_s: float = 3600.0
    """The same watch over a rank's start-up, before its first step: a rank that spends
    longer than this in one phase (joining the process group, building or loading the
    model, loading its checkpoint, reaching the coordinator and taking the global model,
    the first held-out loss, waiting for the run's other islands) writes its stacks and
    exits. The process group's timeout (30 min) catches a rank whose peers wait for it in
    a collective, but nothing caught a one-rank island, or every rank of one, stuck on a
    dead disk. The corpus wait and a checkpoint's conversion have bounds of their own
    (``data.prepare_timeout_s``, ``convert_timeout_s``). It must cover the longest phase
    (a large model read from a slow filesystem, the global model downloaded). 0: never."""
    checkpoint_every: int = 0
    """Save a DeepSpeed checkpoint (inner optimizer state, step, data position) every this
    many steps, and at the last step, into the island's workdir; a restarted island resumes
    from it, a finished one resumed with more steps from its end (0: never)."""
    convert_timeout_s: float = CONVERT_TIMEOUT_S
    """An island relaunched with another number of ranks converts its checkpoint to
    DeepSpeed's universal format (rank 0, the others waiting): given up after this long,
    the island starts from the global model without its AdamW state. The process group's
    timeout (30 min) ended the wait before, and every relaunch began the conversion again."""
    freeze: tuple[str, ...] = ()
    """Regexes (``re.search``) of parameter names the island does not train, e.g.
    ``[embed_tokens, 'layers\\.[0-3]\\.']`` to fine-tune with the embeddings and the first
    layers kept fixed: no AdamW state, no fp32 master, and a pseudo-gradient of 0 (they
    still take every merged global value). Each must match some parameter."""
    activation_checkpointing: int = 0
    """Recompute every N-th decoder layer's activations in the backward pass instead of
    keeping them (Hugging Face's ``activation_checkpointing_enable(every_n_layers=N)``): a
    layer keeps only its input, for one more forward of it (about a third more compute at
    N = 1). What lets a 1B or 7B model's long sequences fit on a GPU; the loss and the
    gradients are the same. 0: off; 1: every layer."""

    def __post_init__(self):
        for pattern in self.freeze:  # a bad one would fail in every rank's start-up
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"train.freeze: {pattern!r} is not a regex: {e}") from None
        if self.checkpoint_every < 0:
            raise ValueError(f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.activation_checkpointing < 0:
            raise ValueError(
                "train.activation_checkpointing must be >= 0 (0: off, N: every N-th layer), "
                f"got {self.activation_checkpointing}"
            )
        if self.sync_blocks < 0:
            raise ValueError(f"train.sync_blocks must be >= 0, got {self.sync_blocks}")
        if self.sync_blocks_off_first and not self.sync_blocks:
            raise ValueError("train.sync_blocks_off_first needs train.sync_blocks > 0")
        for name in ("steps", "micro_batch", "grad_accum", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not _finite(self.lr, 0, strict=True):
            raise ValueError(f"train.lr must be > 0 and finite, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"train.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if not (_finite(self.min_lr) and self.min_lr <= self.lr):
            raise ValueError(
                f"train.min_lr must be in [0, train.lr = {self.lr}], got {self.min_lr}"
            )
        if not _finite(self.weight_decay):
            raise ValueError(f"train.weight_decay must be >= 0 and finite, got {self.weight_decay}")
        if not _finite(self.stall_exit_s):
            raise ValueError(
                f"train.stall_exit_s must be >= 0 (0: never) and finite, got {self.stall_exit_s}"
            )
        if not _finite(self.startup_stall_s):
            raise ValueError(
                f"train.startup_stall_s must be >= 0 (0: never) and finite, got {self.startup_stall_s}"
            )
        if not _finite(self.step_delay_s):
            raise ValueError(f"train.step_delay_s must be >= 0 and finite, got {self.step_delay_s}")
        if not _finite(self.convert_timeout_s, 0, strict=True):
            raise ValueError(
                f"train.convert_timeout_s must be > 0 and finite, got {self.convert_timeout_s}"
            )
        if self.seed < 0:
            raise ValueError(f"train.seed must be >= 0, got {self.seed}")
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ValueError("train.warmup_steps and train.eval_every must be >= 0")
        if not 0.0 <= self.blend_alpha < 1.0:
            raise ValueError(f"train.blend_alpha must be in [0, 1), got {self.blend_alpha}")
        if self.keep_local_steps and self.blend_alpha > 0:
            raise ValueError("train.keep_local_steps and train.blend_alpha > 0 exclude each other")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IslandConfig:
    """What every rank of one island runs (``ds-diloco island --config FILE``)."""

    island: str
    """The island's id at the coordinator."""
    coordinator_url: str
    """Where the coordinator listens, e.g. http://10.0.0.1:8470."""
    model: ModelSource
    """The model to build (its values are replaced by the coordinator's at start)."""
    deepspeed_config: str
    """A DeepSpeed ZeRO-3 config (JSON); batch sizes are set from ``train``."""
    data: DataConfig
    """The text and its tokenisation."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Inner-loop settings."""
    shard: int = 0
    """This island's data shard ..."""
    num_shards: int = 1
    """... of this many (islands train on disjoint shards)."""
    workdir: str = "runs/island"
    """Progress records (progress.jsonl) and the summary go here."""
    token: str | None = None
    """Bearer token; default: $DS_DILOCO_TOKEN."""
    coordinator_ca: str | None = None
    """A PEM file of certificates trusted for an https:// coordinator's (its own self-signed
    one, or its CA); default: $DS_DILOCO_CA_FILE, else the system's CAs."""
    start_together: int = 0
    """Before step 1, wait until this many islands of the run are ready too, so that they
    start in phase (``Learner.start_together``; ``ds-diloco run`` sets it to the run's
    island count). 0 or 1: start at once."""
    start_timeout_s: float = 120.0
    """Longest wait for the others (an island that fails to start holds no one longer)."""
    connect_timeout_s: float = 30.0
    """How long the ranks try to reach the coordinator at start before giving up.
    ``ds-diloco run`` starts its islands while the coordinator is still starting, and
    sets this to cover the coordinator's start-up."""

    def __post_init__(self):
        if not valid_island_id(self.island):
            raise ValueError(f"island must be {ISLAND_ID_RULE}, got {self.island!r}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.start_together < 0:
            raise ValueError(f"start_together must be >= 0, got {self.start_together}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(
                f"shard must be in [0, num_shards={self.num_shards}), got {self.shard}"
            )
        url = urlsplit(self.coordinator_url)
        if not self.coordinator_url.startswith(("http://", "https://")) or not url.hostname:
            raise ValueError(
                f"coordinator_url must be http(s)://host:port, got {self.coordinator_url!r}"
            )
        try:  # checked here, not in every rank as it reaches the coordinator
            _ = url.port
        except ValueError as e:  # 'Port out of range 0-65535'
            raise ValueError(f"coordinator_url {self.coordinator_url!r}: {e}") from None
        if self.coordinator_ca and not self.coordinator_url.startswith("https://"):
            raise ValueError(
                f"coordinator_ca is set but coordinator_url {self.coordinator_url!r} is not "
                "https://: the certificate would never be checked"
            )
        object.__setattr__(self, "data", with_model_tokenizer(self.data, self.model.pretrained))

    def resolve_token(self) -> str:
        token = self.token or os.environ.get(TOKEN_ENV)
        if not token:
            raise ValueError(f"island {self.island!r}: no token (set 'token' or ${TOKEN_ENV})")
        return token


@dataclasses.dataclass(frozen=True, kw_only=True)
class IslandSpec:
    """One island of a local run."""

    name: str
    """Island id."""
    world_size: int = 1
    """ZeRO-3 ranks (processes) of this island."""
    master_port: int | None = None
    """torch.distributed port of this island (default: picked free)."""

    include: str | None = None
    """GPU machines: the deepspeed launcher's --include, e.g. 'localhost:0,1'. Unset, on a
    host with CUDA devices: devices of its own, after the previous islands' (in the file's
    order), where all islands fit; else its first world_size devices."""
    train: TrainConfig | None = None
    """This island's inner loop. In a run file, keys given here override the run's
    ``train`` section for this island alone (islands on other hardware: a larger
    micro-batch, more accumulation, a learning rate to match); None: the run's."""

    def __post_init__(self):
        if not valid_island_id(self.name):
            raise ValueError(f"islands[].name must be {ISLAND_ID_RULE}, got {self.name!r}")
        if self.world_size < 1:
            raise ValueError(f"islands[{self.name}].world_size must be >= 1, got {self.world_size}")
        if self.master_port is not None:
            _check_port(f"islands[{self.name}].master_port", self.master_port)
        if self.include is not None:
            try:
                hosts = parse_include(self.include).values()
            except ValueError as e:
                raise ValueError(f"islands[{self.name}].include: {e}") from None
            # The launcher starts one rank per slot (a bare host's are in the hostfile).
            slots = None if None in hosts else sum(len(s) for s in hosts)
            if slots is not None and slots != self.world_size:
                raise ValueError(
                    f"islands[{self.name}].include {self.include!r} lists {slots} slot(s) but "
                    f"world_size is {self.world_size}: one rank runs per slot"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole local run: the coordinator, the islands, their model, data and training."""

    model: ModelSource
    """The model every island trains (and the coordinator's initial global model)."""
    deepspeed_config: str
    """The islands' DeepSpeed ZeRO-3 config."""
    data: DataConfig
    """The text; islands train on disjoint shards of it. With ``model.pretrained`` and no
    ``data.tokenizer``, the pretrained folder's own tokenizer is used."""
    islands: tuple[IslandSpec, ...]
    """The islands and their world sizes."""
    coordinator: CoordinatorConfig
    """Outer settings (its model and state_dir default to the run's)."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Inner-loop settings of every island but those with their own (``islands[].train``)."""
    workdir: str = "runs/run"
    """Coordinator state, island logs and progress, the export and the summary."""
    export: bool = True
    """Export the merged model as a Hugging Face folder at the end (workdir/export)."""
    prompt: str = "ROMEO:"
    """Prompt of the sample generated from the exported model."""
    export_every_merges: int = 0
    """While the run goes on, export the live global model (one consistent set of served
    versions, with a model card) every this many merges, summed over fragments, into
    ``workdir/exports/merges-<n>``; 0: never."""
    eval_every_merges: int = 0
    """While the run goes on, compute the held-out loss of the live global model (the
    run's held-out blocks, in the run's own process, on its CPU) every this many merges,
    summed over fragments, and once more at the end: printed, on TensorBoard
    (``global/heldout_loss``) and in summary.json (``global_evals``); 0: never. The
    islands' losses are their local models'; this is the merged model's."""
    push_to_hub: str | None = None
    """A Hugging Face Hub repo the final export (with the run's model card) and each periodic
    export are pushed to, one commit each; the token is checked before the run starts."""
    max_restarts: int = 5
    """An island whose rank dies is torn down and restarted at most this many times (then
    given up; the run goes on without it; one stopped by a config or input error, exit
    status 2, is given up at once); a coordinator that dies, too (then the run stops
    with an error naming its log). Faults a chaos schedule injects on purpose into the
    coordinator do not count."""
    restart_backoff_s: float = 1.0
    """Wait before the first restart; doubles per restart of the same process, up to 30 s."""
    downscale_after: int = 2
    """An island on this host whose rank of the same slot (a GPU; on CPU a process place)
    is the first to die in this many launches in a row is restarted without that slot,
    with one rank fewer, and goes on from its checkpoint (converted for the new number of
    ranks); its last slot is never left out. 0: never (restarted on every slot)."""
    slot_quarantine_s: float = 1800.0
    """A slot left out (``downscale_after``) comes back after this long (its repair time):
    the smaller launch is stopped right after its next checkpoint and the island goes on
    from it on every slot (at its next launch, if that comes first)."""
    coordinator_hang_s: float = 60.0
    """A coordinator that answered its health check and then stops answering it for this
    long is hung (a deadlock, a stuck disk: its process lives, so it never exits): it is
    killed and restarted as a death (``max_restarts``, ``restart_backoff_s``). The check
    is answered on its event loop, which no merge, upload or durable write holds up;
    one that is still starting is never killed. 0: never."""

    def train_of(self, spec: IslandSpec) -> TrainConfig:
        """The inner-loop settings island ``spec`` runs with."""
        return spec.train or self.train

    def __post_init__(self):
        if not self.islands:
            raise ValueError("islands: a run needs at least one island")
        names = [i.name for i in self.islands]
        if len(set(names)) != len(names):
            raise ValueError(f"islands: names must be unique, got {names}")
        for name in ("export_every_merges", "eval_every_merges"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.push_to_hub is not None and not self.push_to_hub.strip():
            raise ValueError("push_to_hub: empty; name a Hub repo (OWNER/NAME) or leave it out")
        if self.max_restarts < 0 or not _finite(self.restart_backoff_s):
            raise ValueError(
                "max_restarts and restart_backoff_s must be >= 0 (and finite), got "
                f"{self.max_restarts} and {self.restart_backoff_s}"
            )
        if self.downscale_after < 0 or not _finite(self.slot_quarantine_s):
            raise ValueError(
                "downscale_after and slot_quarantine_s must be >= 0 (and finite), got "
                f"{self.downscale_after} and {self.slot_quarantine_s}"
            )
        if not _finite(self.coordinator_hang_s):
            raise ValueError(
                f"coordinator_hang_s must be >= 0 (0: never) and finite, got "
                f"{self.coordinator_hang_s}"
            )
        if not _same_model(self.coordinator.model, self.model):
            # The islands build `model`: a coordinator starting from another would refuse
            # them (signature) or, worse, merge into values they never started from.
            raise ValueError(
                f"coordinator.model {_model_str(self.coordinator.model)} differs from model "
                f"{_model_str(self.model)}: the islands build the run's model; leave "
                "coordinator.model out (it defaults to model)"
            )
        if self.coordinator.model != self.model:  # the same model, written another way
            coordinator = dataclasses.replace(self.coordinator, model=self.model)
            object.__setattr__(self, "coordinator", coordinator)
        ports = {}  # port -> who binds it; 0 and None pick a free one
        if self.coordinator.port:
            ports[self.coordinator.port] = "coordinator.port"
        for spec in self.islands:
            if spec.master_port:
                if spec.master_port in ports:
                    raise ValueError(
                        f"islands[{spec.name}].master_port {spec.master_port} is also "
                        f"{ports[spec.master_port]}: each island needs a port of its own"
                    )
                ports[spec.master_port] = f"islands[{spec.name}].master_port"
        data, workdir = Path(self.data.path).resolve(), Path(self.workdir).resolve()
        if data == workdir or data in workdir.parents:
            # The corpus is every *.txt below data.path: the islands' log.txt would join it
            # while the run writes them, and the tokenizer's key would move under it.
            raise ValueError(
                f"workdir {self.workdir!r} is inside data.path {self.data.path!r}: the run's "
                "logs would become part of the corpus; put the workdir elsewhere"
            )
        object.__setattr__(self, "data", with_model_tokenizer(self.data, self.model.pretrained))


def with_model_tokenizer(data: DataConfig, pretrained: str | None) -> DataConfig:
    """``data`` with a pretrained model's own tokenizer where it names none: a pretrained
    model reads its own token ids, not those of a BPE trained anew on the corpus. Run
    files, island files and ``ds-diloco eval --data`` alike (the last two trained a BPE
    and fed its ids to the model, with no error: every id is in its vocabulary)."""
    if pretrained and data.tokenizer is None:
        return dataclasses.replace(data, tokenizer=pretrained)
    return data


def _same_model(a: ModelSource, b: ModelSource) -> bool:
    """The same model, however its paths are written ('x/../m.json' and 'm.json')."""

    def key(m: ModelSource) -> tuple:
        paths = (m.pretrained, m.config)
        return (*(p and os.path.normpath(os.path.abspath(p)) for p in paths), m.seed)

    return key(a) == key(b)


def _model_str(m: ModelSource) -> str:
    return (
        f"{{pretrained: {m.pretrained!r}}}"
        if m.pretrained
        else f"{{config: {m.config!r}, seed: {m.seed}}}"
    )


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass ``cls`` from nested dicts, rejecting unknown keys by dotted path."""
    if not isinstance(data, dict):
        what = where.rstrip(".") or cls.__name__
        raise ValueError(f"{what}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in names)  # YAML keys may be ints or bools
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(repr(where + k) for k in unknown)}; "
            f"known: {', '.join(sorted(names))}"
        )
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # fmt: skip
    if missing:  # named by dotted path, not as the dataclass's __init__ arguments
        raise ValueError(f"missing key(s) {', '.join(repr(where + k) for k in missing)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{where}{name}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a rule comparing what it cannot: one line all the same
        raise ValueError(f"{where or cls.__name__}: {e}") from None
    except ValueError as e:
        # A nested section's own rule (PolicyOptions.tau, ...): say where it sits in the
        # file, unless the message already starts with that section's name (data.seq_len).
        path = where.rstrip(".")
        root = re.split(r"[.\[]", path, maxsplit=1)[0]
        if not where.endswith(".") or re.match(rf"{re.escape(root)}[.:\[ ]", str(e)):
            raise
        raise ValueError(f"{path}: {e}") from None


def _convert(hint, value, where: str):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return tuple(_convert(args[0], v, where) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    if hint is int and isinstance(value, bool):
        raise ValueError(f"{where}: expected int, got {value!r}")
    return value


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``3e-05`` (what ``json.dumps`` writes for small floats, and how a
    learning rate is usually written) as a string; YAML 1.2 and JSON read a float.
    A key given twice in one mapping is refused (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class refuses it
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_file(path: str | os.PathLike, what: str = "config file") -> dict:
    """Read a YAML or JSON config file into a dict (JSON is YAML; ``1e-5`` is a float);
    errors name it as ``what`` (a chaos schedule's: "schedule file")."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a folder, not a file")
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} does not exist")
    try:
        text = p.read_text()
    except OSError as e:  # unreadable (permissions, I/O): one line, not a traceback
        raise ValueError(f"{what} {str(p)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {str(p)!r} is not UTF-8 text: {e}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except yaml.YAMLError as e:  # a ValueError reaches the CLI as one clear line
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ValueError(f"{what} {str(p)!r} is not valid YAML: {problem}{at}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {str(p)!r} must hold a mapping at the top level")
    return data


def load_coordinator_config(path: str | os.PathLike) -> CoordinatorConfig:
    data = load_file(path)
    data = data.get("coordinator", data)
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r}: 'coordinator' must hold a mapping")
    base = Path(path).resolve().parent
    data = dict(data)
    # Paths in a file are relative to the file; anything not a string is left to from_dict,
    # which refuses it naming the field.
    if isinstance(data.get("model"), dict):
        model = dict(data["model"])
        for key in ("pretrained", "config"):
            if model.get(key) == "":
                raise ValueError(f"model.{key}: an empty path; leave the key out")
            if _relative(model.get(key)):
                model[key] = str(base / model[key])
        data["model"] = model
    if data.get("state_dir") == "":  # not the working directory
        raise ValueError("state_dir: an empty path; give the folder for the coordinator's state")
    if _relative(data.get("state_dir")):
        data["state_dir"] = str(base / data["state_dir"])
    data = _resolve_paths(data, base, ("tls_cert", "tls_key"))
    cfg = from_dict(CoordinatorConfig, data)
    _check_model(cfg.model, "model")
    _check_state_dir(cfg.state_dir, "state_dir")
    _check_tls(cfg, "")
    return cfg


def _check_tls(cfg: CoordinatorConfig, where: str) -> None:
    """The certificate and key load (a typo fails here, not after the islands started)."""
    if cfg.tls_cert is not None:
        from ds_diloco.tls import server_context

        try:
            server_context(cfg.tls_cert, cfg.tls_key)
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None


def _check_state_dir(state_dir: str, where: str) -> None:
    if Path(state_dir).exists() and not Path(state_dir).is_dir():
        raise ValueError(f"{where} {state_dir!r} is a file, not a folder")


def _relative(value) -> bool:
    return isinstance(value, str) and bool(value) and not Path(value).is_absolute()


def _resolve_paths(data: dict, base: Path, keys: tuple[str, ...], where: str = "") -> dict:
    """Dotted ``keys`` of ``data`` that hold relative paths, made relative to ``base``."""
    data = dict(data)
    for key in keys:
        head, _, rest = key.partition(".")
        if rest:
            if isinstance(data.get(head), dict):
                data[head] = _resolve_paths(data[head], base, (rest,), f"{where}{head}.")
            continue
        if data.get(head) == "":
            # Not the working directory: a fresh run clears its workdir's state/, islands/...
            raise ValueError(f"{where}{head}: an empty path; leave the key out for its default")
        if isinstance(data.get(head), str) and data[head].startswith("~"):
            data[head] = os.path.expanduser(data[head])  # else a folder named '~' in the cwd
        if _relative(data.get(head)) and (
            head in _ALWAYS or data[head].startswith(("./", "../")) or (base / data[head]).exists()
        ):
            # Not existing and not written as a relative path: a dataset or Hub name, say.
            data[head] = str(base / data[head])
    return data


# Paths resolved against the config file even when they do not exist yet: outputs, and
# the DeepSpeed config (a file, never a name, checked at load where the file says).
_ALWAYS = ("workdir", "cache_dir", "state_dir", "deepspeed_config", "coordinator_ca",
           "tls_cert", "tls_key")  # fmt: skip
# Paths that island configs and run files give relative to the file.
FILE_PATHS = ("model.pretrained", "model.config", "deepspeed_config", "data.path",
              "data.tokenizer", "data.cache_dir", "workdir", "coordinator_ca")  # fmt: skip


def _check_model(model: ModelSource, where: str, contents: bool = False) -> None:
    """A pretrained model is a folder (else loading it fails later, in every process).
    ``contents`` (what islands load): the folder holds a model's config.json, and a model
    config written as a path is one (else every rank fails in a transformers traceback)."""
    if contents and model.config is not None and os.path.isabs(model.config):  # else a name
        _check_model_config(Path(model.config), f"{where}.config")
    if model.pretrained is None:
        return
    if Path(model.pretrained).is_dir():
        if contents:
            _check_model_config(Path(model.pretrained), f"{where}.pretrained")
            check_model_weights(Path(model.pretrained), f"{where}.pretrained")
        return
    path = os.path.normpath(model.pretrained)
    if "smollm2" in path.lower():  # launch/finetune-smollm2.yaml's model (launch/finetune.sh)
        hint = f"make it with `ds-diloco convert-gguf --smollm2 --out {path}`"
    else:
        hint = "a GGUF checkpoint is converted to one with `ds-diloco convert-gguf`"
    raise ValueError(
        f"{where}.pretrained {path!r} is not a folder (a Hugging Face model folder: "
        f"config.json + safetensors); {hint}"
    )


def _check_model_config(path: Path, where: str) -> None:
    """``path`` (a config.json, or a folder holding one) is a Hugging Face model config."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        what = "holds no config.json" if path.is_dir() else "does not exist"
        raise ValueError(f"{where} {str(path)!r} {what}")
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(
            f"{where}: {str(file)!r} is not a Hugging Face model config (no model_type); "
            "model configs are in model_configs/"
        )


def check_model_weights(folder: Path, where: str) -> None:
    """The weight files of a pretrained ``folder`` open: a git-lfs pointer (a model repo
    cloned without git-lfs) or a file cut short (an interrupted copy) failed in the
    coordinator, after the data was prepared, as a SafetensorError naming neither the file
    nor the folder ("header too large", "file not fully covered")."""
    from safetensors import safe_open

    for file in _weight_files(folder):
        with open(file, "rb") as f:
            if f.read(64).startswith(b"version https://git-lfs"):
                raise ValueError(
                    f"{where} {str(folder)!r}: {file.name} is a git-lfs pointer, not the "
                    "weights: fetch them (`git lfs pull` in the model's clone)"
                )
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), "pt"):
                    pass
            except Exception as e:  # safetensors' SafetensorError, from its Rust module
                raise ValueError(
                    f"{where} {str(folder)!r}: {file.name} cannot be read ({e}): an "
                    "incomplete copy or download?"
                ) from None


def _weight_files(folder: Path) -> list[Path]:
    """The weight files ``from_pretrained`` reads from ``folder``, in its order of preference
    (others, such as a Mistral repo's consolidated.safetensors, are not its to read)."""
    for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json"):  # fmt: skip
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".json"):
            return [path]
        try:
            shards = set(json.loads(path.read_text())["weight_map"].values())
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            return []  # from_pretrained names what is wrong with the index
        return [folder / s for s in sorted(shards) if (folder / s).is_file()]
    return []


def _model_vocab_size(model: ModelSource) -> int | None:
    """vocab_size of model.config (a config.json, or a folder holding one), if it says."""
    path = Path(model.config) if model.config else None
    if path is not None and path.is_dir():
        path = path / "config.json"
    if path is None or not path.is_file():
        return None  # from_pretrained names what is missing
    try:
        vocab = json.loads(path.read_text()).get("vocab_size")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"model.config {str(path)!r} is not a JSON object: {e}") from None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _check_files(cfg: IslandConfig | RunConfig) -> None:
    """What the islands open, checked once at load instead of failing in every rank."""
    _check_model(cfg.model, "model", contents=True)
    if Path(cfg.workdir).exists() and not Path(cfg.workdir).is_dir():
        raise ValueError(f"workdir {cfg.workdir!r} is a file, not a folder")
    if Path(cfg.data.cache_dir).is_file():  # else a FileExistsError traceback in every rank
        raise ValueError(f"data.cache_dir {cfg.data.cache_dir!r} is a file, not a folder")
    vocab = _model_vocab_size(cfg.model)
    if cfg.data.tokenizer is None and vocab is not None and cfg.data.vocab_size > vocab:
        # Token ids >= the embedding's rows: an IndexError at the first forward.
        raise ValueError(
            f"data.vocab_size ({cfg.data.vocab_size}) is above the vocab_size of model.config "
            f"{cfg.model.config!r} ({vocab}): lower data.vocab_size or enlarge the model's"
        )
    ds = Path(cfg.deepspeed_config)
    if not ds.is_file():
        what = "is a folder, not a JSON file" if ds.is_dir() else "does not exist"
        raise ValueError(f"deepspeed_config {str(ds)!r} {what}")
    try:
        stage = json.loads(ds.read_text())["zero_optimization"]["stage"]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"deepspeed_config {str(ds)!r} is not valid JSON: {e}") from None
    except (KeyError, TypeError):
        stage = None
    if stage != 3:  # the islands partition parameters with ZeRO-3 (zero.Init, gather)
        raise ValueError(
            f"deepspeed_config {str(ds)!r}: zero_optimization.stage must be 3 (ZeRO-3), "
            f"got {stage!r}"
        )
    if cfg.data.tokenizer is not None and not Path(cfg.data.tokenizer).is_dir():
        raise ValueError(
            f"data.tokenizer {cfg.data.tokenizer!r} is not a folder (a Hugging Face "
            "tokenizer folder); leave it out to train a BPE tokenizer on the corpus"
        )


def load_island_config(path: str | os.PathLike) -> IslandConfig:
    base = Path(path).resolve().parent
    cfg = from_dict(IslandConfig, _resolve_paths(load_file(path), base, FILE_PATHS))
    _check_files(cfg)
    _check_workdir_island(cfg)
    if cfg.coordinator_ca is not None:
        from ds_diloco.tls import client_context

        try:
            client_context(cfg.coordinator_ca)
        except ValueError as e:
            raise ValueError(f"coordinator_ca: {e}") from None
    return cfg


def _check_workdir_island(cfg: IslandConfig) -> None:
    """The island's workdir is no other island's (its progress.jsonl names the island that
    began it). An island file copied for another island with its workdir left as it was
    resumed the other's checkpoint (its AdamW state and its shard's data position) and
    saved its own over it, silently."""
    try:
        with (Path(cfg.workdir) / "progress.jsonl").open() as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):  # none yet, or unreadable: nothing to compare
        return
    other = first.get("island") if isinstance(first, dict) else None
    if isinstance(other, str) and other != cfg.island:
        raise ValueError(
            f"workdir {cfg.workdir!r} belongs to island {other!r} (its progress.jsonl names "
            f"it; its checkpoints are there): island {cfg.island!r} would resume and overwrite "
            "them; give each island a workdir of its own"
        )


def _island_train(islands, train):
    """The run file's islands, each ``train`` override on top of the run's section (keys
    it does not give are the run's); the rest is checked when the configs are built."""
    if not isinstance(islands, list) or not isinstance(train, dict):
        return islands
    out = []
    for spec in islands:
        if isinstance(spec, dict) and isinstance(spec.get("train"), dict):
            spec = {**spec, "train": {**train, **spec["train"]}}
        out.append(spec)
    return out


def _default(cls, name: str):
    return cls.__dataclass_fields__[name].default


def load_data_config(path: str | os.PathLike) -> DataConfig:
    """The ``data`` section of a run or island file (its paths relative to the file)."""
    data = _resolve_paths(load_file(path), Path(path).resolve().parent, FILE_PATHS)
    if not isinstance(data.get("data"), dict):
        raise ValueError(f"{str(path)!r} has no data section (a run or island file has one)")
    model = data.get("model")
    pretrained = model.get("pretrained") if isinstance(model, dict) else None
    return with_model_tokenizer(from_dict(DataConfig, data["data"], "data."), pretrained)


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """A run file; the coordinator section takes the run's model and workdir/state by default."""
    base = Path(path).resolve().parent
    data = _resolve_paths(load_file(path), base, FILE_PATHS)
    if "model" not in data:  # else the coordinator's default model would be named
        raise ValueError("model: missing; a run needs model.pretrained or model.config")
    # Outputs the file leaves out go to their defaults in the working directory, written
    # absolute: the islands' and the coordinator's own files (island.json, coordinator.json)
    # take relative paths from their own folders (islands/a/runs/run/islands/a/...).
    data.setdefault("workdir", str(Path(_default(RunConfig, "workdir")).resolve()))
    if isinstance(data.get("data"), dict) and "cache_dir" not in data["data"]:
        cache = str(Path(_default(DataConfig, "cache_dir")).resolve())
        data["data"] = {**data["data"], "cache_dir": cache}
    workdir = data["workdir"]
    if not isinstance(workdir, str):
        raise ValueError(f"workdir: expected str, got {workdir!r}")
    coord = data.get("coordinator", {})
    if not isinstance(coord, dict):
        raise ValueError("coordinator: expected a mapping")
    # Its model is the run's (refused if it differs), resolved like the run's.
    coord = _resolve_paths(
        coord, base, ("state_dir", "model.pretrained", "model.config", "tls_cert", "tls_key"),
        "coordinator.",
    )  # fmt: skip
    coord.setdefault("model", data["model"])
    coord.setdefault("state_dir", str(Path(workdir) / "state"))
    data = {**data, "islands": _island_train(data.get("islands"), data.get("train", {}))}
    # The run's model first: its errors are named 'model', not 'coordinator.model'.
    cfg = from_dict(RunConfig, {"model": data["model"], **data, "coordinator": coord})
    _check_files(cfg)
    _check_state_dir(cfg.coordinator.state_dir, "coordinator.state_dir")
    _check_tls(cfg.coordinator, "coordinator.")
    return cfg
