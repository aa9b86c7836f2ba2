"""One rank of an island: ``ds-diloco island --config FILE``, run by the deepspeed launcher.

Every rank of the island runs this: build the ZeRO-3 engine (the model is
partitioned from the start), take its own shard of the island's data, join
the run (:class:`~ds_diloco.learner.Learner`, the same public API a user's own
loop would use: it takes the global fragments), then train with AdamW and call
``learner.step`` after each inner step.

Rank 0 writes progress records (``progress.jsonl``) and every rank a summary
(``summary-rank<r>.json``) into the island's workdir.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from ds_diloco import gc_tuning, zero
from ds_diloco.config import IslandConfig, TrainConfig, learner_steps_at
from ds_diloco.data import (
    BlockLoader,
    Blocks,
    eval_blocks,
    heldout_split,
    prepare_section,
    split_blocks,
)
from ds_diloco.hf_model import check_sequence_fits, check_tokenizer_fits, lm_loss, model_specs
from ds_diloco.learner import Learner
from ds_diloco.sharding import shard_numel
from ds_diloco.stall_exit import StallExit
from ds_diloco.syncer import Diverged

log = logging.getLogger(__name__)


def preparation_turn(rank: int, local_rank: int) -> int:
    """When a rank prepares the corpus (0, 1, 2: the island's ranks take turns, with a
    barrier between turns): rank 0 first, which fills a shared cache for everyone; then
    the first rank of every other node, for a cache on the node's own disk; then the rest,
    which find it filled. Without the middle turn, every rank of another node tokenised
    the whole corpus at once into a node-local cache."""
    return 0 if rank == 0 else 1 if local_rank == 0 else 2


def load_blocks(cfg: IslandConfig, rank: int) -> tuple[Blocks, Blocks]:
    """(the island's training blocks, held-out blocks), views of the memory-mapped cached
    tokens (no copy of the corpus per rank); see :func:`preparation_turn` for who fills
    the cache. Its ranks walk the training blocks together (``data.BlockLoader``)."""
    d = cfg.data
    turn = preparation_turn(rank, int(os.environ.get("LOCAL_RANK", rank)))
    with zero.patient_group(d.prepare_timeout_s) as group:  # as long as tokenising takes
        for phase in range(3):
            if phase == turn:
                tokenizer, blocks = prepare_section(d)
            if phase < 2:
                zero.barrier(group)
    # `ds-diloco run` checks them before it starts islands; one launched alone, here.
    check_tokenizer_fits(tokenizer, cfg.model, d.tokenizer)
    check_sequence_fits(model_specs(cfg.model), d.seq_len)
    train, heldout = heldout_split(blocks, d.heldout_fraction, seed=d.seed)
    try:
        island = split_blocks(train, cfg.num_shards, cfg.shard)
        world = zero.rank_and_world()[1]
        if len(island) < world:
            raise ValueError(f"{len(island)} blocks cannot give {world} ranks one each")
        return island, heldout
    except ValueError as e:  # say whose shard: the bare message named no island
        raise ValueError(
            f"island {cfg.island!r} (shard {cfg.shard} of {cfg.num_shards}) rank {rank}: {e}; "
            "use more text, a smaller data.seq_len, or fewer islands or ranks"
        ) from None


def deepspeed_config(cfg: IslandConfig, world_size: int, warn: bool = False) -> dict:
    """The island's DeepSpeed config: the file's, with the batch sizes of ``train``.

    A micro-batch or accumulation count the file sets to a number that ``train``
    contradicts is refused (it would be silently replaced); ``auto`` or a matching number
    is fine. ``train_batch_size`` is always their product with ``world_size``. Its
    optimizer and scheduler sections are not used (the inner optimizer is ours: torch
    AdamW with ``train.lr``, ``train.lr_schedule``): ``warn`` logs that they are there.
    """
    ds = json.loads(Path(cfg.deepspeed_config).read_text())
    t = cfg.train
    for key, name, value in (("train_micro_batch_size_per_gpu", "micro_batch", t.micro_batch),
                             ("gradient_accumulation_steps", "grad_accum", t.grad_accum)):  # fmt: skip
        got = ds.get(key, "auto")
        if got != "auto" and got != value:
            raise ValueError(
                f"deepspeed_config {cfg.deepspeed_config}: {key} is {got!r}, but train.{name} "
                f'is {value}: set it in the run\'s train section (or "auto" in the file)'
            )
        ds[key] = value
    ds["train_batch_size"] = t.micro_batch * t.grad_accum * world_size
    unused = [k for k in ("optimizer", "scheduler") if ds.pop(k, None) is not None]
    if unused and warn:
        log.warning("deepspeed_config %s: its %s section(s) are not used: the inner optimizer "
                    "is AdamW with train.lr, train.weight_decay, train.warmup_steps and "
                    "train.lr_schedule", cfg.deepspeed_config, " and ".join(unused))  # fmt: skip
    # Any other "auto" is the HF Trainer's to fill: DeepSpeed drops one for its default
    # (bf16.enabled: off, an fp32 island) or keeps the string (gradient_clipping: a
    # TypeError at the first step).
    auto = next(_autos(ds), None)
    if auto is not None:
        raise ValueError(
            f'deepspeed_config {cfg.deepspeed_config}: {auto} is "auto", which only the Hugging '
            "Face Trainer fills (ds_diloco fills the batch sizes alone, from train): give it a value"
        )
    return ds


def _autos(section: dict, where: str = ""):
    """The dotted keys of ``section`` whose value is "auto"."""
    for key, value in section.items():
        if value == "auto":
            yield f"{where}{key}"
        elif isinstance(value, dict):
            yield from _autos(value, f"{where}{key}.")


def lr_multiplier(t: TrainConfig, step: int) -> float:
    """The inner learning rate at optimizer step ``step`` (from 0), as a share of ``t.lr``:
    a linear warm-up over ``t.warmup_steps``, then constant or a cosine down to ``t.min_lr``
    at the last step."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    done = min(1.0, (step - t.warmup_steps + 1) / max(1, t.steps - t.warmup_steps))
    low = t.min_lr / t.lr
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * done))


@torch.no_grad()
def heldout_loss(engine, heldout: Blocks, micro_batch: int, batches: int) -> float:
    """Mean held-out loss over the island (each rank its ``eval_blocks``; one all-reduce)."""
    rank, world = zero.rank_and_world()
    mine = eval_blocks(heldout, rank, world, micro_batch * batches)
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # NCCL: on the GPU
    for b in mine.to(engine.device).split(micro_batch):
        total[0] += lm_loss(engine, b[:, :-1], b[:, 1:]).item() * len(b)
        total[1] += len(b)
    engine.train()
    zero.all_reduce_sum(total)
    return float(total[0] / total[1])


class _FaultHook:
    """Chaos testing: extra seconds per step, read from ``faults/slow[-rank<r>]`` if present.

    ``ds-diloco chaos`` writes these files to slow an island (or one rank) down; a
    missing file costs one ``stat`` per step.
    """

    def __init__(self, workdir: Path, rank: int):
        self.paths = (workdir / "faults" / f"slow-rank{rank}", workdir / "faults" / "slow")

    def wait(self) -> None:
        for path in self.paths:
            try:
                delay = float(path.read_text() or 0)
            except (OSError, ValueError):
                continue
            if delay > 0:
                time.sleep(delay)
            return


class _NoSync:
    """Stands in for the learner in plain mode: the same loop, no outer optimisation."""

    stats = None

    def step(self, tokens: int, sync: bool = True) -> list[int]:
        return []

    def versions(self) -> list[int]:
        return []

    def close(self, leave: bool = True) -> None:
        pass

    def keep_lease(self):
        return contextlib.nullcontext()


IN_LOOP_STATS = ("agree_s", "send_s", "apply_s", "cache_s")
"""The syncer's training-thread timers that the loop's sync part (``sync_s``) holds; the
same timers also run in the end-of-training flush (its sends), outside that part."""


def _in_loop(learner) -> dict[str, float]:
    stats = learner.stats
    return {k: getattr(stats, k) for k in IN_LOOP_STATS} if stats else {}


def _resident_mb() -> tuple[float | None, float | None]:
    """This process's resident memory now and, of it, the anonymous part, MiB (None, None
    without /proc). Anonymous pages are the process's own data (heap, stacks, tensors);
    the rest is file-backed, mostly shared libraries' code, which a host holds once though
    every rank's ``ru_maxrss`` counts it. Unlike private pages, the anonymous ones do not
    depend on which other processes (a co-located coordinator) map the same libraries."""
    try:
        with open("/proc/self/statm") as f:
            resident, shared = (int(x) for x in f.read().split()[1:3])
        page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
        return round(resident * page_mb, 2), round((resident - shared) * page_mb, 2)
    except (OSError, ValueError):
        return None, None


@contextlib.contextmanager
def _launch_failure(island: str, rank: int):
    """A ValueError raised while training is a failure of this launch, not of its input: the
    CLI's one line and exit status 2 for a ValueError ("config or input error") had
    ``ds-diloco run`` give the island up for good, where a restart goes on."""
    try:
        yield
    except ValueError as e:
        raise RuntimeError(f"island {island!r} rank {rank}: {e}") from e


def run_island(cfg: IslandConfig, plain: bool = False) -> dict:
    """Train one rank; ``plain`` runs the same loop as plain ZeRO-3 (the benchmark's baseline)."""
    # A rank stuck in one phase of its start-up exits, its stacks in the log: nothing else
    # stops a one-rank island, or every rank of one, held by a dead disk.
    with StallExit(cfg.train.startup_stall_s) as startup:
        rank, world = zero.init_distributed()
        startup.beat()
        if startup.armed and rank == 0:  # what a "Timeout (...)!" before the first step means
            log.info("island %s: a rank that spends over %g s in one phase of its start-up "
                     "(train.startup_stall_s) writes its stacks here and exits",
                     cfg.island, cfg.train.startup_stall_s)  # fmt: skip
        workdir = Path(cfg.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        train_blocks, heldout = load_blocks(cfg, rank)  # unwatched: data.prepare_timeout_s
        startup.beat()
        t = cfg.train
        scheduled = t.warmup_steps or t.lr_schedule != "constant"
        lr_lambda = functools.partial(lr_multiplier, t) if scheduled else None
        ds_config = deepspeed_config(cfg, world, warn=rank == 0)
        engine = zero.build_engine(cfg.model, ds_config, t.lr, t.weight_decay, lr_lambda,
                                   t.freeze, t.activation_checkpointing)  # fmt: skip
        startup.beat()
        # A restarted island resumes its inner loop (AdamW state, schedule, data position) from
        # its last checkpoint, then takes the current global fragments like any island.
        ckpt_dir = workdir / "checkpoints"
        start_step, tokens, batches, rows = (
            zero.load_checkpoint(engine, ckpt_dir, t.convert_timeout_s)
            if t.checkpoint_every
            else (0, 0, 0, 0)
        )  # a conversion is unwatched: train.convert_timeout_s
        startup.beat()
        modules_before = set(sys.modules)  # what the syncer imports shows below (bench island)
        if plain:
            learner = _NoSync()
        else:  # joins the run: registers, checks the model, takes the global fragments
            # cfg.token, else $DS_DILOCO_TOKEN, read by the Learner: one missing on some nodes
            # only (the launcher passes them none of the shell's variables) raises on every
            # rank, not on theirs alone while the others wait for them in a collective.
            learner = Learner(
                engine, cfg.coordinator_url, cfg.island, token=cfg.token,
                alpha=cfg.train.blend_alpha, keep_local_steps=cfg.train.keep_local_steps,
                connect_timeout_s=cfg.connect_timeout_s, ca_file=cfg.coordinator_ca,
            )  # fmt: skip
        startup.beat()
        start_loss = heldout_loss(engine, heldout, t.micro_batch, t.eval_batches)
        startup.beat()
        # Step 1 with the run's other islands; a restarted one joins the running rounds in phase.
        waited_s = 0.0 if plain else learner.start_together(cfg.start_together, cfg.start_timeout_s)

    # The island's ranks walk one order of its blocks together, so that a relaunch on
    # another number of ranks (or micro-batch) goes on exactly where the island stopped.
    loader = BlockLoader(train_blocks, t.micro_batch, seed=t.seed * 7919 + cfg.shard * 101,
                         rank=rank, world=world)  # fmt: skip
    # A checkpoint from before the walk was kept: the micro-batches each rank had read.
    loader.seek(rows if rows is not None else batches * world * t.micro_batch)
    progress = (workdir / "progress.jsonl").open("a") if rank == 0 else None
    if progress:  # when this launch's training began (goodput: allocated time), and where
        started = {"island": cfg.island, "step": start_step, "tokens": tokens,
                   "started_at": time.time(), "resumed": start_step > 0}  # fmt: skip
        progress.write(json.dumps(started) + "\n")
        progress.flush()
    sync_s, sync_max_s, step_s = 0.0, 0.0, 0.0
    step_times = []  # whole steps, sync included: what the benchmark compares
    setup_rss_mb, setup_anon_mb = _resident_mb()  # where a rank's memory goes (bench island)
    step_rss_mb, step_anon_mb = [], []
    slow = _FaultHook(workdir, rank)
    gc_tuning.resume_after_setup()  # the same in both modes, before the first timed step
    # From here a ValueError is this launch failing, not its config: restarted, not given up.
    with _launch_failure(cfg.island, rank):
        # A rank stuck from here to the last step exits, its stacks in the log (a frozen peer
        # holds every rank in the next collective, so each one's watch sees it).
        with StallExit(t.stall_exit_s) as stall:
            if stall.armed and rank == 0:  # what a "Timeout (...)!" further down this log means
                log.info("island %s: a rank whose step takes over %g s (train.stall_exit_s) writes "
                         "its stacks here and exits", cfg.island, t.stall_exit_s)  # fmt: skip
            t_start, loop_start = time.perf_counter(), _in_loop(learner)
            for step in range(start_step + 1, t.steps + 1):
                stall.beat()
                t0 = time.perf_counter()
                slow.wait()
                losses = []
                for _ in range(t.grad_accum):  # DeepSpeed steps AdamW after the last one
                    input_ids, labels = (x.to(engine.device) for x in next(loader))
                    loss = lm_loss(engine, input_ids, labels)
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.detach())
                batches += t.grad_accum
                loss = sum(losses) / len(losses)  # the step's mean, for the progress records
                if t.step_delay_s:
                    time.sleep(t.step_delay_s)
                t1 = time.perf_counter()
                mine = input_ids.numel() * t.grad_accum  # fixed-size blocks: the same on every rank
                tokens += mine * world
                on = learner_steps_at(step, t.sync_blocks, t.sync_blocks_off_first)
                applied = learner.step(tokens=mine, sync=on)
                t2 = time.perf_counter()
                step_s += t1 - t0
                sync_s += t2 - t1
                sync_max_s = max(sync_max_s, t2 - t1)
                step_times.append(t2 - t0)
                rss_mb, anon_mb = _resident_mb()
                step_rss_mb.append(rss_mb)
                step_anon_mb.append(anon_mb)
                record = None
                evaluate = t.eval_every and step % t.eval_every == 0
                if step % t.log_every == 0 or step == t.steps or evaluate:  # a whole record each
                    record = {"island": cfg.island, "step": step, "loss": round(loss.item(), 4),
                              "tokens": tokens, "versions": learner.versions(), "applied": applied,
                              "seconds": round(time.perf_counter() - t_start, 2)}  # fmt: skip
                if evaluate:
                    record["heldout_loss"] = heldout_loss(
                        engine, heldout, t.micro_batch, t.eval_batches
                    )
                if record and progress:
                    progress.write(json.dumps(record) + "\n")
                    progress.flush()
                # The last step too: a finished run resumed with more steps goes on from its end
                # (it repeated the steps after its last periodic checkpoint).
                if t.checkpoint_every and (step % t.checkpoint_every == 0 or step == t.steps):
                    if not zero.model_finite(engine):  # a restart must not resume a diverged state
                        raise Diverged(
                            f"island {cfg.island!r} rank {rank}: its model is not finite (NaN, Inf or "
                            f"values whose squares overflow float32) at step {step}: not checkpointed "
                            "(a restart resumes the last checkpoint, saved while it was, and takes "
                            "the global model)"
                        )
                    state = {
                        "step": step,
                        "tokens": tokens,
                        "batches": batches,
                        "rows": loader.rows,
                    }
                    with stall.paused(), learner.keep_lease():  # as long as the disk takes
                        zero.save_checkpoint(engine, ckpt_dir, step, state)
        wall = time.perf_counter() - t_start
        loop_stats = {k: v - loop_start[k] for k, v in _in_loop(learner).items()}
        learner.close(leave=True)  # done for good: no quorum should count on this island now
        end_loss = heldout_loss(engine, heldout, t.micro_batch, t.eval_batches)
        summary = {
            "island": cfg.island,
            "rank": rank,
            "world_size": world,
            "steps": t.steps,
            "start_step": start_step,
            "optimizer_steps": engine.global_steps,  # one per inner step, whatever grad_accum
            "lr_end": engine.get_lr()[0],  # the schedule's last value
            "tokens": tokens,
            "batches": batches,  # micro-batches this rank's data has given, resumed launches included
            "data_rows": loader.rows,  # the island's place in its data walk (blocks all ranks took)
            "wall_s": round(wall, 2),
            "start_wait_s": round(waited_s, 3),
            "train_s": round(step_s, 3),
            "sync_s": round(sync_s, 4),
            "sync_max_s": round(sync_max_s, 4),
            "versions": learner.versions(),
            # None for a launch that trained no step: one restarted from its last step's
            # checkpoint (its summary lost with a rank in the final flush) only leaves.
            "step_s_median": statistics.median(step_times) if step_times else None,
            "step_times_s": [round(s, 5) for s in step_times],  # the benchmark drops warm-up steps
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "setup_rss_mb": setup_rss_mb,  # before the first step: engine, data, syncer built
            "setup_anon_mb": setup_anon_mb,  # of it, anonymous: the process's own data
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "step_rss_mb": step_rss_mb,  # after each step
            "step_anon_mb": step_anon_mb,
            # Imported once the engine was built: bench island compares the two modes' lists (a
            # module that only the syncer's path loads is memory that plain ZeRO-3 does not hold).
            "modules_loaded": sorted(set(sys.modules) - modules_before),
            "peak_gpu_mb": (
                round(torch.cuda.max_memory_allocated() / 2**20, 1)
                if engine.device.type == "cuda"
                else None
            ),
            "shard_fp32_mb": round(
                sum(4 * shard_numel(p.ds_numel, world, rank) for p in engine.module.parameters())
                / 2**20,
                3,
            ),
            "finished_at": time.time(),
            "heldout_loss_start": start_loss,
            "heldout_loss_end": end_loss,
            "stats": vars(learner.stats) if learner.stats else None,
            # Of those timers, what ran inside the loop's sync part: the breakdown of sync_s.
            "loop_stats": loop_stats or None,
            "plain": plain,
            "sync_blocks": t.sync_blocks,  # bench island's paired launches
            "sync_blocks_off_first": t.sync_blocks_off_first,
        }
        (workdir / f"summary-rank{rank}.json").write_text(json.dumps(summary, indent=1))
        if progress:
            progress.write(json.dumps({"island": cfg.island, "done": True, **summary}) + "\n")
            progress.close()
        zero.barrier()
        zero.shutdown()
        return summary
