"""Everything that touches DeepSpeed and torch.distributed, in one module.

- :func:`init_distributed`: one ZeRO-3 island's process group (gloo on CPU).
- :func:`build_engine`: an HF causal LM partitioned from the start, with AdamW.
- :class:`ZeroShardAccess`: a rank reads and writes the flat slice of each
  parameter it owns, in the fp32 master partition, without any gather.
- :func:`island_gather`: the intra-island collective with which the ranks
  agree on which merged fragments every one of them holds (and count tokens), on
  gloo even in an NCCL island (:func:`agreement_group`).
- :func:`gather_full_params`: whole tensors, for checks and small exports.
- :func:`shutdown`, :func:`teardown_gloo`: the process group torn down before exit.
- :func:`patient_group`: waits on one rank's long work (tokenising the corpus,
  converting a checkpoint) that outlast the process group's timeout.
- :func:`rank_and_world`, :func:`all_reduce_sum`, :func:`optimizer_zero_stage`,
  :func:`check_deepspeed_config`: what the rest of the package asks of them, so that no
  other module imports either (``tests/test_boundaries.py``). This module imports
  DeepSpeed inside its functions only: a coordinator process never loads it.

No collective here ever crosses islands: the process group is the island.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ds_diloco import agreement, stall_exit
from ds_diloco.config import CONVERT_TIMEOUT_S, ModelSource
from ds_diloco.hf_model import check_freeze
from ds_diloco.merge import sq_norm
from ds_diloco.sharding import shard_numel
from ds_diloco.state_store import atomic_write

LATEST = "latest"
"""The file in a checkpoint folder naming its newest complete checkpoint (DeepSpeed's name)."""
UNIVERSAL = "universal"
"""The subfolder of a checkpoint folder holding its latest checkpoint converted to DeepSpeed's
universal format, for an island resumed with another number of ranks."""

log = logging.getLogger(__name__)


def on_cpu() -> bool:
    return os.environ.get("DS_ACCELERATOR", "") == "cpu" or not torch.cuda.is_available()


def prepare_cpu() -> None:
    """On a machine without CUDA: DeepSpeed's CPU accelerator, without its shm op build.

    The CPU accelerator compiles a shared-memory op at every start (30-50 s cold); it
    only serves inference all-reduce. Call before anything initialises DeepSpeed's
    communication (``init_distributed`` does; with the HF Trainer or accelerate, before
    ``TrainingArguments`` / ``Accelerator``).
    """
    if not on_cpu():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm.torch  # noqa: F401

    # The package attribute of that name is torch itself: reach the module via sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **k: None


def prepare_cpu_accelerate() -> None:
    """On CPU, before ``TrainingArguments`` or ``Accelerator``: accelerate's state with gloo.

    With DeepSpeed and no CUDA, accelerate (and so the HF Trainer) chooses no process
    group backend and then counts one process, whatever the launcher started. This
    sets its shared state up first, DeepSpeed on gloo over all ranks; the Trainer then
    needs ``accelerator_config={"use_configured_state": True}``. Started without a
    launcher (``python script.py``), a world of 1, as :func:`init_distributed`. No-op with CUDA.
    """
    if not on_cpu():
        return
    prepare_cpu()
    if not any(k in os.environ for k in _MPI_WORLD):  # else accelerate reads mpirun's
        _world_of_one()  # `python script.py`: accelerate made no group, torch raised
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


_MPI_WORLD = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _world_of_one() -> None:
    """A single process started without a launcher: the variables of a world of 1 (without
    them DeepSpeed tries MPI, and accelerate makes no process group)."""
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):  # fmt: skip
        os.environ.setdefault(k, v)


def init_distributed() -> tuple[int, int]:
    """(rank, world size) of this island's process group."""
    prepare_cpu()
    import deepspeed

    _world_of_one()
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu() else "nccl")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def build_engine(
    source: ModelSource,
    ds_config: dict,
    lr: float,
    weight_decay: float,
    lr_lambda=None,
    freeze: Sequence[str] = (),
    activation_checkpointing: int = 0,
):
    """A DeepSpeed ZeRO-3 engine over an HF causal LM that is never whole on any rank.

    ``freeze``: regexes of parameter names left out of training (``requires_grad=False``,
    not given to AdamW); each must match a parameter, and some parameter must be left.
    ``activation_checkpointing`` N > 0: every N-th decoder layer recomputes its activations
    in the backward pass (:func:`checkpoint_activations`).
    """
    import deepspeed
    import torch._dynamo.polyfills.tensor
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    stage = ds_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"deepspeed_config: zero_optimization.stage must be 3, got {stage}")
    _quiet_deepspeed_deprecations()
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (must stay alive while the model is built)
    if source.pretrained:
        model = AutoModelForCausalLM.from_pretrained(source.pretrained, dtype=torch.float32)
    else:
        torch.manual_seed(source.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source.config))
    trained = freeze_params(model, freeze)
    if activation_checkpointing:
        checkpoint_activations(model, activation_checkpointing)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda) if lr_lambda else None
    with _compile_on_first_call():  # stage 3 imports its Muon optimizer, whatever the optimizer
        import deepspeed.runtime.zero.muon.muon_optimizer
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return engine


def checkpoint_activations(model: torch.nn.Module, every_n_layers: int) -> None:
    """Every ``every_n_layers``-th decoder layer of ``model`` keeps only its input and
    recomputes the rest in the backward pass. Reentrant checkpointing: its recompute calls
    each submodule again with its hooks, which is where ZeRO-3 gathers a partitioned
    parameter. The non-reentrant kind (Hugging Face's default) recomputes without module
    hooks (a submodule's forward hook was seen not to fire in it) and counts on the
    parameters being at hand; with frozen parameters that was a known ZeRO-3 failure
    (``CheckpointError``, a frozen weight found empty: DeepSpeed issue 4332). Both gave the
    same values in ``tests/test_zero.py``."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"train.activation_checkpointing: {type(model).__name__} does not support it"
        )
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": True}, every_n_layers=every_n_layers
    )
    model.config.use_cache = False  # no key/value cache in training: it would be recomputed


def _quiet_deepspeed_deprecations() -> None:
    """ZeRO-3 gathers and reduces with torch collectives that torch now calls deprecated;
    every rank of every island printed the warnings in its log, and whoever reads it can
    do nothing about them (DeepSpeed's calls). Process-wide, so set where this module
    builds the engine (an island's process), not by the Learner in a user's own loop."""
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
        "deprecated",
        category=FutureWarning,
    )


def freeze_params(model: torch.nn.Module, patterns: Sequence[str]) -> list[torch.nn.Parameter]:
    """Set ``requires_grad=False`` on the parameters whose names match one of ``patterns``
    (``re.search``); returns the parameters left to train. A pattern that matches nothing
    (a typo would silently train everything) or one that leaves nothing is refused."""
    params = list(model.named_parameters())
    check_freeze(patterns, [name for name, _ in params])
    trained = []
    for name, p in params:
        if any(re.search(pattern, name) for pattern in patterns):
            p.requires_grad_(False)
        elif p.requires_grad:
            trained.append(p)
    if not trained:
        raise ValueError(f"train.freeze: {list(patterns)} freezes every parameter")
    return trained


@contextlib.contextmanager
def _compile_on_first_call():
    """``torch.compile`` deferred to a function's first call, for the imports in the block.

    DeepSpeed's ZeRO-3 optimizer imports its Muon optimizer whatever the optimizer, and that
    module wraps its kernels in ``torch.compile`` at import, which loads inductor: 2.7 s of
    CPU in every rank's start-up here (every island launch and restart), for kernels an
    AdamW island never calls. Deferred, they compile as before if they are ever called.
    """
    real = torch.compile

    def lazy(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: lazy(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    torch.compile = lazy
    try:
        yield
    finally:
        torch.compile = real


def trained_without_master(engine) -> list[str]:
    """Parameters that require grad but that no group of the engine's optimizer holds:
    ZeRO-3 keeps no fp32 master of them (DeepSpeed raises a bare KeyError when asked)."""
    from deepspeed.utils import safe_get_local_fp32_param

    out = []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        try:
            master = safe_get_local_fp32_param(p)
        except (KeyError, IndexError, AttributeError):
            master = None
        if master is None:
            out.append(name)
    return out


class ZeroShardAccess:
    """This rank's slices of the model, read from and written to ZeRO-3's partitions.

    Reads come from the fp32 master partition (what the inner optimizer updates).
    A write must reach three places for the next forward pass to use it: the fp32
    master, the compute partition ``ds_tensor`` (a separate tensor, possibly of
    another dtype), and any cached gathered copies, dropped by :meth:`flush`.

    A frozen parameter (``requires_grad=False``: embeddings or layers kept fixed while
    fine-tuning) has no fp32 master -- DeepSpeed gives the optimizer only the trained
    ones -- so it is never read (it does not train: its pseudo-gradient is zero, see
    :meth:`trains`) and a write goes to its compute partition alone.
    """

    def __init__(self, engine):
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        self._get, self._set = safe_get_local_fp32_param, safe_set_local_fp32_param
        self.engine = engine
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.params = dict(engine.module.named_parameters())
        self._written: set[str] = set()  # since the last flush

    def numel(self, name: str) -> int:
        return shard_numel(self.params[name].ds_numel, self.world_size, self.rank)

    def trains(self, name: str) -> bool:
        """Whether the inner optimizer trains this parameter (it has an fp32 master)."""
        return self.params[name].requires_grad

    def read(self, name: str) -> torch.Tensor:
        """A live view of the owned, unpadded fp32 master slice (copy before keeping it)."""
        master = self._get(self.params[name])
        if master is None:  # DeepSpeed's answer for a frozen parameter
            raise ValueError(f"{name} is frozen (requires_grad=False): it has no fp32 master")
        return master[: self.numel(name)]

    @torch.no_grad()
    def write(self, name: str, values: torch.Tensor) -> None:
        p = self.params[name]
        n = self.numel(name)
        if values.numel() != n:
            raise ValueError(f"{name}: {values.numel()} values for a slice of {n}")
        if not p.requires_grad:  # frozen: the compute partition is its only copy
            p.ds_tensor.view(-1)[:n].copy_(values.to(p.ds_tensor.device))
            self._written.add(name)
            return
        master = self._get(p)
        # One copy to the master's device (the base copy is host memory); the compute
        # partition is written from there, converted on that device.
        values = values.to(master.device)
        master[:n].copy_(values)  # a live view: the padding tail keeps its contents
        self._set(p, master)
        p.ds_tensor.view(-1)[:n].copy_(values)
        self._written.add(name)

    def flush(self) -> None:
        """Drop cached gathered parameters so that the next forward uses the new values."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        written, self._written = self._written, set()
        # A written parameter not gathered now (nor on its way) is gathered from its new
        # partition when next used. After a training step ZeRO-3 has released them all
        # (unless persistent), and releasing every parameter again cost 0.5-1.6 ms a step.
        if any(self.params[n].ds_status != ZeroParamStatus.NOT_AVAILABLE for n in written):
            # The ZeRO-3 optimizer's own method: releases and re-partitions every gathered
            # parameter. engine.empty_partition_cache() does the same plus gc.collect(),
            # which costs ~0.2 s a call and would land on every step that applies.
            self.engine.optimizer.empty_partition_cache()


def save_checkpoint(engine, directory: Path, step: int, client_state: dict, keep: int = 2) -> None:
    """A ZeRO-3 checkpoint of every rank's partitions (a collective); keeps the last ``keep``.

    The ``latest`` pointer is written here, atomically, once every rank's files are saved:
    DeepSpeed writes its own in place (open, truncate, write), and an island killed in
    between left it empty, so that every restart failed to load (seen in the chaos test).
    """
    tag = f"step{step}"
    if torch.distributed.get_rank() == 0 and latest_tag(directory) != tag:
        # A launch killed while saving this step left its files here, another number of
        # ranks' among them: DeepSpeed writes beside them, and the universal conversion of
        # a resized island reads every rank's file it finds (a stale or truncated one).
        shutil.rmtree(directory / tag, ignore_errors=True)
    torch.distributed.barrier()
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    torch.distributed.barrier()  # every rank's files are in place
    if torch.distributed.get_rank() == 0:
        atomic_write(directory / LATEST, tag.encode())
        tags = sorted(
            (p for p in directory.glob("step*") if p.is_dir()), key=lambda p: int(p.name[4:])
        )
        # Later steps than this one are of a walk the island went back from (a resized
        # launch whose conversion failed starts over at step 0): kept, they outranked this
        # checkpoint, which was removed as soon as written, and `latest` named nothing (every
        # restart and --resume failed until the island reached those steps again).
        later = [p for p in tags if int(p.name[4:]) > step]
        for old in later + [p for p in tags if p not in later][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(directory / UNIVERSAL, ignore_errors=True)  # older than this one now
    torch.distributed.barrier()


def checkpoint_states(folder: Path) -> dict | None:
    """Rank 0's model states of the ZeRO-3 checkpoint in ``folder`` (None: not there),
    where DeepSpeed itself takes the number of ranks that wrote it (``dp_world_size``;
    counting files would miss a folder a smaller island rewrote over a larger one's
    leftovers) and the schedule's state (``lr_scheduler``, None when saved without one)."""
    model_states = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not model_states.is_file():
        return None  # DeepSpeed says what is missing
    return torch.load(model_states, map_location="cpu", weights_only=False)


def latest_tag(directory: Path) -> str | None:
    """The tag (``step<N>``) that ``directory``'s ``LATEST`` file names; None: no such file."""
    try:
        return (directory / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def load_checkpoint(
    engine, directory: Path, convert_timeout_s: float = CONVERT_TIMEOUT_S
) -> tuple[int, int, int, int | None]:
    """Restore the latest checkpoint in ``directory`` if there is one: (step, tokens,
    micro-batches read by each rank, the island's place in its data: :func:`_resume_point`);
    (0, 0, 0, 0) if none. Checkpoints from before gradient accumulation read one
    micro-batch per step. One written by another number of ranks is loaded through
    DeepSpeed's universal format (:func:`_load_resized`; its conversion given up after
    ``convert_timeout_s``)."""
    pointer, tag = directory / LATEST, latest_tag(directory)
    if tag is None:
        return 0, 0, 0, 0
    if not tag or not (directory / tag).is_dir():
        raise RuntimeError(
            f"{pointer} names no checkpoint in {directory} ({tag!r}): remove the folder to "
            "start the island afresh, or point the file at a complete step* folder"
        )
    states = checkpoint_states(directory / tag) or {}
    _check_trained(engine, states, directory / tag)
    written_by, configured = states.get("dp_world_size"), _hyperparameters(engine)
    # A checkpoint saved without a schedule (a constant rate, no warm-up) has none for one
    # built now (resumed with train.warmup_steps or a cosine): DeepSpeed failed on every
    # launch ("'NoneType' object has no attribute 'pop'"). It starts at the saved step.
    scheduler = engine.lr_scheduler
    unscheduled = scheduler is not None and bool(states) and states.get("lr_scheduler") is None
    if unscheduled:
        engine.lr_scheduler = None
    try:
        if written_by is not None and written_by != engine.dp_world_size:
            resumed = _load_resized(engine, directory, tag, written_by, convert_timeout_s)
        else:
            path, client_state = engine.load_checkpoint(str(directory), tag=tag)
            if path is None:
                raise RuntimeError(f"could not load checkpoint {tag} named in {pointer}")
            resumed = _resume_point(client_state)
    finally:
        engine.lr_scheduler = scheduler
    if unscheduled:
        scheduler.last_epoch = engine.global_steps  # one scheduler step per optimizer step
    _keep_hyperparameters(engine, configured)
    return resumed


def _check_trained(engine, states: dict, folder: Path) -> None:
    """Refuse a checkpoint that trained other parameters than the engine does (``train.freeze``
    edited for a resumed run): its AdamW state is one flat partition of exactly those, and
    DeepSpeed failed on every launch with a bare KeyError naming a parameter."""
    if "param_shapes" not in states:
        return  # DeepSpeed says what is missing
    saved = {name for group in states["param_shapes"] for name in group}
    now = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    if saved != now:
        more, fewer = sorted(now - saved), sorted(saved - now)
        raise ValueError(
            f"checkpoint {folder} trained other parameters than this island (here "
            f"{len(more)} more, {len(fewer)} fewer, e.g. {(more or fewer)[0]!r}): train.freeze "
            f"changed since it was saved; set it back, or remove {folder.parent} to start the "
            "island's inner loop afresh"
        )


def _hyperparameters(engine) -> tuple[list[float], list[float]]:
    """The inner optimizer's base learning rate and weight decay of each group, as the
    engine was built (the run's ``train.lr`` and ``train.weight_decay``)."""
    groups, scheduler = engine.optimizer.param_groups, engine.lr_scheduler
    base = list(scheduler.base_lrs) if scheduler is not None else [g["lr"] for g in groups]
    return base, [g["weight_decay"] for g in groups]


def _keep_hyperparameters(engine, configured: tuple[list[float], list[float]]) -> None:
    """Put back the run's learning rate and weight decay after a checkpoint was loaded:
    DeepSpeed restores the optimizer's groups and the schedule's base rates as saved, so a
    run resumed with another ``train.lr`` or ``train.weight_decay`` trained on with the old
    ones, silently. The schedule's position (its step) stays the checkpoint's."""
    (base, decays), scheduler = configured, engine.lr_scheduler
    groups = engine.optimizer.param_groups
    saved = _hyperparameters(engine)
    for i, (group, lr, decay) in enumerate(zip(groups, base, decays)):
        group["weight_decay"] = decay
        if scheduler is None:
            group["lr"] = lr
        else:  # the rate the schedule gives its next step, from the new base
            group["initial_lr"] = lr
            group["lr"] = lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    if scheduler is not None:
        scheduler.base_lrs = list(base)
        scheduler._last_lr = [g["lr"] for g in groups]
    if saved != configured and torch.distributed.get_rank() == 0:
        log.info("checkpoint saved with learning rate %s and weight decay %s: going on with "
                 "the run's %s and %s", saved[0], saved[1], base, decays)  # fmt: skip


def _resume_point(
    client_state: dict, read_by: int = 1, now: int = 1
) -> tuple[int, int, int, int | None]:
    """(step, tokens, micro-batches each rank has read, the island's place in its data
    walk): the ``read_by`` ranks' micro-batches, each, are counted for ``now`` ranks; the
    place (``data.BlockLoader.rows``) is None in a checkpoint from before it was kept."""
    step = int(client_state["step"])
    batches = int(client_state.get("batches", step)) * read_by // now
    rows = client_state.get("rows")
    return step, int(client_state["tokens"]), batches, None if rows is None else int(rows)


def _load_resized(
    engine, directory: Path, tag: str, written_by: int, convert_timeout_s: float
) -> tuple[int, int, int, int | None]:
    """An island resized between launches (a node lost, or added back) resumes its AdamW
    state, schedule and place in its data like any restart. DeepSpeed refuses a ZeRO
    checkpoint written by another number of ranks; rank 0 converts it to the universal
    format (one file per tensor and state, whole) once, and every rank loads its new
    partitions from that. Its place in its data (``rows``) is the island's, whatever its
    number of ranks. Where the conversion fails or a rank cannot see its output, the
    island starts from the global model as one without a checkpoint, and says why."""
    world = engine.dp_world_size
    converted = directory / UNIVERSAL / tag
    problem = converted_everywhere(directory / tag, converted, convert_timeout_s)
    if problem is not None:
        if torch.distributed.get_rank() == 0:
            log.warning(
                "checkpoint %s was written with world size %d, this island has world size %d, "
                "and %s: starting from the global model; its AdamW state is not carried over",
                directory / tag, written_by, world, problem,
            )  # fmt: skip
        return 0, 0, 0, 0
    engine._config.load_universal_checkpoint = True  # DeepSpeed reads it only while loading
    try:
        path, client_state = engine.load_checkpoint(str(directory / UNIVERSAL), tag=tag)
    finally:
        engine._config.load_universal_checkpoint = False
    if path is None:
        raise RuntimeError(f"could not load the universal checkpoint {converted}")
    if torch.distributed.get_rank() == 0:
        log.info(
            "checkpoint %s was written with world size %d, this island has world size %d: "
            "loaded from its universal form %s (AdamW state, schedule and data position "
            "carried over)", directory / tag, written_by, world, converted,
        )  # fmt: skip
    return _resume_point(client_state, written_by, world)


def converted_everywhere(source: Path, target: Path, timeout_s: float) -> str | None:
    """Rank 0 converts ``source`` into ``target`` (:func:`_convert_to_universal`) while
    the others wait, as long as it takes up to ``timeout_s`` (a large model's checkpoint
    is read and written whole: the process group's 30 min ended the wait, the island was
    restarted and the conversion began again, for ever); then every rank checks that it
    sees ``target``. None, or what went wrong (the same on every rank)."""
    rank = torch.distributed.get_rank()
    with patient_group(timeout_s + 60) as group:  # rank 0 gives up at timeout_s itself
        problem = _convert_to_universal(source, target, timeout_s) if rank == 0 else None
        problem = _all_gather_object(problem, group)[0]
    if problem is None:
        there = _all_gather_object(target.is_dir())
        problem = next(
            (f"rank {r} does not see {target} (checkpoints must be on a filesystem every "
             "rank of the island sees)" for r, seen in enumerate(there) if not seen),
            None,
        )  # fmt: skip
    return problem


def _convert_to_universal(source: Path, target: Path, timeout_s: float) -> str | None:
    """DeepSpeed's ``ds_to_universal`` of the checkpoint folder ``source`` into ``target``,
    in a process of its own (it runs worker pools), given up after ``timeout_s``;
    ``target`` is complete or absent. None, or what went wrong. A folder an earlier
    launch converted is used as it is."""
    if target.is_dir():
        return None
    tmp = target.with_name(f".{target.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(source), "--output_folder", str(tmp)]  # fmt: skip
    t0 = time.perf_counter()
    # In the rank's process group, so that whatever stops the island stops it too.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as done:  # fmt: skip
        try:
            out, err = done.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # given up: it goes with the worker pools it started
            _kill_tree(done.pid)
            done.communicate()
            shutil.rmtree(tmp, ignore_errors=True)
            return (f"its conversion to DeepSpeed's universal format took over {timeout_s:g} s "
                    "(train.convert_timeout_s)")  # fmt: skip
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (err.strip() or out.strip() or "no output").splitlines()[-1]
        return f"its conversion to DeepSpeed's universal format failed (exit {done.returncode}: {last})"
    os.replace(tmp, target)
    log.info(
        "converted checkpoint %s to universal format in %.1f s", source, time.perf_counter() - t0
    )
    return None


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every process it started."""
    import psutil  # DeepSpeed's dependency too

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                p.kill()


AGREEMENT_ENV = "DS_DILOCO_GLOO_AGREEMENT"
"""Set to 0 to keep an NCCL island's agreement on NCCL (see :func:`agreement_group`)."""


def agreement_group():
    """What the syncer's agreement runs on, every inner step (every rank calls this at the
    same point): sockets of the island's own between its ranks (:mod:`ds_diloco.agreement`),
    and where those cannot be opened, the process group: None (the default group) when the
    island is on gloo or has one rank (then no collective at all, see :func:`island_gather`);
    on NCCL a gloo group of the same ranks, made now.

    NCCL gathers GPU tensors only: the agreement's few integers would be copied to the
    GPU and read back with ``tolist``, which waits for everything queued on it, on every
    inner step, so the training loop could never run ahead of the GPU. Over gloo they
    go between the ranks' CPUs beside the GPU's work. Gloo finds its network interface
    from the host name; where that is the wrong one, set ``GLOO_SOCKET_IFNAME`` (or
    ``DS_DILOCO_GLOO_AGREEMENT=0`` to stay on NCCL)."""
    dist = torch.distributed
    if dist.get_world_size() == 1:
        return None
    mesh = agreement.open_mesh(dist.get_rank(), dist.get_world_size(), _all_gather_object)
    if mesh is not None:
        return mesh
    if dist.get_backend() == "gloo":
        return None
    if os.environ.get(AGREEMENT_ENV, "1") == "0":
        return None
    return dist.new_group(backend="gloo")


def island_gather(values: list[int], group=None) -> list[list[int]]:
    """Every rank's ``values``, by rank (one small all-gather within the island; on
    ``group``, default: the island's process group). A rank alone gets its own.

    The syncer's agreement: from the rows each rank takes the minimum and maximum
    version held and the island's sum of token counts, the same on every rank.
    """
    if isinstance(group, agreement.SocketAgreement):
        return group.gather(values)
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return [list(values)]
    nccl = torch.distributed.get_backend(group) == "nccl"  # NCCL gathers GPU tensors only
    t = torch.tensor(values, dtype=torch.int64, device="cuda" if nccl else "cpu")
    rows = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(rows, t, group=group)
    return [r.tolist() for r in rows]


def destroy_group(group) -> None:
    """Tear down a group of :func:`agreement_group` (None: nothing) once every rank is done
    with it: left to interpreter exit, a gloo group's threads can abort the process (see
    :func:`teardown_gloo`)."""
    if isinstance(group, agreement.SocketAgreement):
        group.close()
    elif group is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group(group)


def _all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj``, by rank (pickled through the island's process group)."""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def model_finite(engine) -> bool:
    """Every rank's fp32 master partition is finite and so is each tensor's sum of squares
    (the coordinator's test of a pseudo-gradient: no NaN or Inf, no value past 1.8e19); the
    same answer on every rank (a collective). Checked before a checkpoint is saved, so that
    a restart never resumes a diverged inner state. DeepSpeed skips a step whose gradients
    are not finite, so a diverged model is more often huge than NaN."""
    access = ZeroShardAccess(engine)
    trained = [name for name in access.params if access.trains(name)]  # frozen: written only
    # detach: a master partition may require grad, and float() of one warns in every log
    ok = all(math.isfinite(sq_norm(access.read(name).detach())) for name in trained)
    return min(row[0] for row in island_gather([int(ok)])) == 1


def barrier(group=None) -> None:
    torch.distributed.barrier(group=group)


@contextlib.contextmanager
def patient_group(timeout_s: float):
    """A group of all the island's ranks whose collectives wait up to ``timeout_s`` for
    the last rank: the default group's end at its timeout (30 min), too soon for one
    rank's long work while the others wait (tokenising a large corpus, converting a large
    checkpoint). On the island's own backend, not a gloo group beside NCCL (which needs an
    interface gloo can find), so that an island that starts on NCCL alone still does.
    Every rank enters this together; torn down after. The rank's stall watch (its start-up's,
    ``train.startup_stall_s``) is off meanwhile: ``timeout_s`` is the bound here."""
    import datetime

    group = torch.distributed.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with stall_exit.unwatched():
            yield group
    finally:
        torch.distributed.destroy_process_group(group)


def initialized() -> bool:
    """A process group is up (the island's, or one the user's launcher made)."""
    return torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) in the island's process group."""
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def all_reduce_sum(t: torch.Tensor) -> None:
    """Sum ``t`` over the island's ranks, in place (a collective: all ranks call it)."""
    torch.distributed.all_reduce(t)


def optimizer_zero_stage(opt) -> int:
    """The ZeRO stage of the optimizer a training loop really runs: 3, 2 or 1 for DeepSpeed's
    ZeRO optimizers, 0 for anything else (DeepSpeed without ZeRO, or no DeepSpeed)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return 3
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return 2 if opt.partition_gradients else 1
    return 0


def check_deepspeed_config(ds_config: dict) -> None:
    """DeepSpeed's own schema check of a config (as ``deepspeed.initialize`` would run it),
    before any rank starts: ValueError with the first lines of what it refused."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(ds_config)
    except Exception as e:  # pydantic's ValidationError, DeepSpeed's own asserts
        first = str(e).strip().splitlines()
        raise ValueError("; ".join(line.strip() for line in first[:4])) from None


def shutdown() -> None:
    """Tear the island's process group down before the process exits.

    Left to interpreter exit, its threads (gloo's, the store's) are torn down in no
    set order; a rank once aborted there ("terminate called without an active
    exception") after finishing its work, failing the launch. It still did now and then,
    so ``ds-diloco island`` then leaves without teardown (:func:`exit_without_teardown`).
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_without_teardown(code: int = 0) -> None:
    """Flush what the process wrote (stdout, stderr, logging) and exit with ``code``
    without the interpreter's teardown; for a script whose work is done.

    At teardown the C++ objects still alive (gloo's and the rendezvous store's threads)
    are destroyed in no set order, and a thread still joinable aborts the process
    ("terminate called without an active exception", SIGABRT), even after
    ``destroy_process_group`` (their groups outlive it). The launcher then fails a job
    that had finished: seen in ``ds-diloco island`` and in the examples' e2e tests.
    atexit handlers do not run: close the Learner and save everything first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def teardown_gloo() -> None:
    """Destroy a gloo process group the script left up (for an interpreter exit hook).

    Torch asks every script to call ``destroy_process_group`` before it exits; many
    (ours once) do not. Left to interpreter teardown, a gloo worker thread still
    releasing the last collective's tensors needs the GIL after finalization began, and
    the process aborts ("terminate called without an active exception"): measured here,
    2 ranks on gloo that exit right after a collective, with a third process busy on the
    2 cores, aborted 18 times in 120 rank exits; destroying the group first, 0 in 120.
    Call it only once every rank is done with collectives: a gloo teardown with work
    still pending waits for the other ranks. NCCL's is not left to an exit hook."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        shutdown()


def gather_full_params(engine) -> dict[str, torch.Tensor]:
    """Whole fp32 copies of every parameter on every rank (a collective: all ranks call it)."""
    import deepspeed

    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            out[name] = p.detach().float().clone()
    return out
