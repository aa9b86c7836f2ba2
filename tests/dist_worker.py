"""One rank of a two-rank ZeRO-3 island on CPU (gloo), started by ``tests/test_zero.py``.

    python tests/dist_worker.py SPEC.json OUT_DIR   (RANK, WORLD_SIZE, MASTER_* in the env)

Runs the scenarios named in the spec, in order, each on an engine of its own,
and writes what this rank saw to ``OUT_DIR/<scenario>-rank<r>.pt``. A scenario
that raises leaves its traceback in ``<scenario>-rank<r>.error`` and ends the
rank. The test process does the asserting.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from ds_diloco import agreement, zero
from ds_diloco.config import DataConfig, IslandConfig, ModelSource, TrainConfig
from ds_diloco.hf_model import build_model, lm_loss
from ds_diloco.island import deepspeed_config
from ds_diloco.sharding import shard_slice

MICRO_BATCH, SEQ = 2, 16


def engine_for(
    spec: dict, seed: int, model: ModelSource | None = None, freeze=(), checkpointing: int = 0,
    ds_config: str | None = None,
):  # fmt: skip
    """A ZeRO-3 engine built as an island builds it (the project's DeepSpeed config file)."""
    cfg = IslandConfig(
        island="test", coordinator_url="http://127.0.0.1:1",
        model=model or ModelSource(config=spec["model_config"], seed=seed),
        deepspeed_config=ds_config or spec["deepspeed_config"], data=DataConfig(path="unused"),
        train=TrainConfig(micro_batch=MICRO_BATCH, lr=spec["lr"], weight_decay=spec["weight_decay"],
                          freeze=tuple(freeze), activation_checkpointing=checkpointing),
    )  # fmt: skip
    ds = deepspeed_config(cfg, torch.distributed.get_world_size())
    t = cfg.train
    return zero.build_engine(cfg.model, ds, t.lr, t.weight_decay, freeze=t.freeze,
                             activation_checkpointing=t.activation_checkpointing)  # fmt: skip


def batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.randint(
        0, vocab, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed)
    )
    return b[:, :-1], b[:, 1:]


def train_step(engine, ids, labels) -> float:
    loss = lm_loss(engine, ids, labels)
    engine.backward(loss)
    engine.step()
    return loss.item()


@torch.no_grad()
def logits(engine, ids) -> torch.Tensor:
    return engine(input_ids=ids).logits.float().clone()


def reads(access) -> dict[str, torch.Tensor]:
    """This rank's fp32 master slices of the trained parameters (frozen ones have none)."""
    return {n: access.read(n).clone() for n, p in access.params.items() if p.requires_grad}


# ------------------------------------------------------------------ scenarios
def scenario_minmax(spec, rank, world):
    """The agreement's gather over the island's own sockets, on the island's group and on a
    gloo group of its own (what an NCCL island agrees on where the sockets cannot be
    opened: made here on gloo), each torn down after."""
    mesh = zero.agreement_group()  # the ranks' sockets
    os.environ[agreement.ENV] = "0"
    fallback = zero.agreement_group()  # None on gloo: the island's own group
    del os.environ[agreement.ENV]
    own = torch.distributed.new_group(backend="gloo")
    # Both groups are gloo over the same ranks here, so the rows alone cannot tell them
    # apart: which group each all-gather ran on is recorded.
    gathered_on, all_gather = [], torch.distributed.all_gather

    def recording(rows, t, group=None, **kw):
        gathered_on.append("own" if group is own else repr(group))
        return all_gather(rows, t, group=group, **kw)

    torch.distributed.all_gather = recording
    try:
        rows_group = zero.island_gather(list(reversed(spec["minmax"][rank])), group=own)
        rows = zero.island_gather(spec["minmax"][rank])
        rows_mesh = [zero.island_gather([rank, k, -k], group=mesh) for k in range(3)]
    finally:
        torch.distributed.all_gather = all_gather
    zero.destroy_group(own)
    zero.destroy_group(mesh)
    return {"rows": rows, "rows_group": rows_group, "rows_mesh": rows_mesh,
            "mesh": type(mesh).__name__, "fallback": fallback,
            "gathered_on": gathered_on}  # fmt: skip


def scenario_shards(spec, rank, world):
    """Own slices read without gathering, against whole gathered tensors."""
    engine = engine_for(spec, seed=0)
    access = zero.ZeroShardAccess(engine)
    for s in range(2):  # master values move away from the initialisation
        train_step(engine, *batch(100 * rank + s, spec["vocab"]))
    read0, full0 = reads(access), zero.gather_full_params(engine)
    for s in range(2, 5):
        train_step(engine, *batch(100 * rank + s, spec["vocab"]))
    read1, full1 = reads(access), zero.gather_full_params(engine)
    # The syncer's pseudo-gradient: base (the rank's slice of whole tensors) - local.
    pseudo = {n: shard_slice(full0[n].flatten(), world, rank) - access.read(n) for n in full0}
    return {"read0": read0, "full0": full0, "read1": read1, "full1": full1, "pseudo": pseudo}


def scenario_write(spec, rank, world):
    """New global values written slice by slice reach the forward pass and the optimizer."""
    from deepspeed.utils import safe_get_full_optimizer_state, safe_set_local_fp32_param

    engine = engine_for(spec, seed=0)
    access = zero.ZeroShardAccess(engine)
    for s in range(2):  # AdamW state exists and is kept through the write
        train_step(engine, *batch(100 * rank + s, spec["vocab"]))
    adam = {
        n: {k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")}
        for n, p in access.params.items()
    }
    adam_step = [float(st["step"]) for st in engine.optimizer.optimizer.state.values()]
    ids, labels = batch(spec["write_batch_seed"], spec["vocab"])  # the same batch on every rank
    target = build_model(ModelSource(config=spec["model_config"], seed=spec["write_seed"]))
    new = {n: shard_slice(p.detach().flatten(), world, rank) for n, p in target.named_parameters()}
    out = {"adam": adam, "adam_step": adam_step, "ids": ids, "labels": labels}

    out["before"] = logits(engine, ids)  # a no-grad forward leaves the gathered params cached
    # The fp32 master alone, as safe_set_local_fp32_param sets it (padding included). Zeros,
    # not the new values, so that the write below must overwrite the master too.
    for p in access.params.values():
        safe_set_local_fp32_param(p, torch.zeros(p.ds_tensor.numel()))
    engine.optimizer.empty_partition_cache()
    out["master_only"] = logits(engine, ids)
    for n, v in new.items():
        access.write(n, v)
    out["no_flush"] = logits(engine, ids)
    access.flush()
    out["written"] = logits(engine, ids)
    out["read_back"] = reads(access)
    out["loss"] = train_step(engine, ids, labels)
    out["after_step"] = zero.gather_full_params(engine)
    # After a step ZeRO-3 holds no gathered copy: the flush releases nothing (it skips
    # DeepSpeed's release of every parameter) and the written values still reach the
    # forward; a forward outside training leaves them gathered, and then it releases.
    calls = []
    release = engine.optimizer.empty_partition_cache
    engine.optimizer.empty_partition_cache = lambda: (calls.append(1), release())[-1]
    for n, v in new.items():
        access.write(n, v)
    access.flush()
    out["flush_calls_after_step"] = len(calls)
    out["rewritten"] = logits(engine, ids)
    for n, v in new.items():
        access.write(n, torch.zeros_like(v))
    access.flush()
    out["flush_calls_gathered"] = len(calls)
    out["zeroed"] = logits(engine, ids)
    return out


def scenario_frozen(spec, rank, world):
    """Frozen parameters (train.freeze) have no fp32 master: written values reach the
    forward pass through the compute partition alone, and a training step keeps them."""
    engine = engine_for(spec, seed=0, freeze=spec["freeze"])
    access = zero.ZeroShardAccess(engine)
    target = build_model(ModelSource(config=spec["model_config"], seed=spec["write_seed"]))
    ids, labels = batch(spec["write_batch_seed"], spec["vocab"])
    for n, p in target.named_parameters():
        access.write(n, shard_slice(p.detach().flatten(), world, rank))
    access.flush()
    out = {"trains": {n: access.trains(n) for n in access.params}, "ids": ids}
    out["written"] = logits(engine, ids)
    train_step(engine, ids, labels)
    out["after_step"] = zero.gather_full_params(engine)
    out["finite"] = zero.model_finite(engine)
    return out


def scenario_syncer(spec, rank, world):
    """Bootstrap and one due send, merge and apply, with the island's agreement collective."""
    from ds_diloco.client import CoordinatorClient
    from ds_diloco.fragments import FragmentPlan, Schedule, param_specs, signature
    from ds_diloco.syncer import FragmentSyncer

    engine = engine_for(spec, seed=7)  # not the coordinator's init: bootstrap must replace it
    ids, _ = batch(spec["write_batch_seed"], spec["vocab"])
    out = {"ids": ids, "init": logits(engine, ids)}
    client = CoordinatorClient(spec["url"], spec["token"], retries=2, backoff_s=0.1)
    sig = signature(param_specs(engine.module.named_parameters()))
    if rank == 0:
        client.register("isl", world, sig)
    zero.barrier()
    info = client.plan()
    plan, schedule = FragmentPlan.from_json(info["plan"]), Schedule(**info["schedule"])
    syncer = FragmentSyncer(
        client, "isl", plan, schedule, zero.ZeroShardAccess(engine),
        world_size=world, rank=rank, agree=zero.island_gather, poll_s=0.02, long_poll_s=1.0,
    )  # fmt: skip
    out["boot_versions"] = syncer.bootstrap()
    out["boot_logits"] = logits(engine, ids)
    out["boot_full"] = zero.gather_full_params(engine)
    applied, versions = [], []
    for step in range(1, spec["steps"] + 1):
        train_step(engine, *batch(1000 * rank + step, spec["vocab"]))
        if step == 1:  # what fragment 0's pseudo-gradient is taken against
            out["local1"] = zero.gather_full_params(engine)
        waiting = [s for s in syncer.slots if s.sent_step is not None]
        deadline = time.monotonic() + 30
        while not all(s.arrived for s in waiting) and time.monotonic() < deadline:
            time.sleep(0.01)  # results this rank waits for are due now: let them arrive
        applied.append(syncer.on_step(step, tokens=ids.numel()))
        versions.append(syncer.versions())
    out["applied"], out["versions"] = applied, versions
    out["full"] = zero.gather_full_params(engine)
    syncer.close()
    out["stats"] = vars(syncer.stats)
    return out


def scenario_pretrained(spec, rank, world):
    """Fine-tuning start: an engine partitioned from a pretrained folder, and its first forward."""
    engine = engine_for(spec, 0, ModelSource(pretrained=spec["pretrained"]))
    ids, _ = batch(spec["write_batch_seed"], spec["vocab"])
    return {"ids": ids, "logits": logits(engine, ids), "full": zero.gather_full_params(engine)}


def scenario_no_token(spec, rank, world):
    """The token variable is set on rank 0 only (as on a node whose environment lacks it):
    every rank must raise, none may wait for the other in a collective."""
    from ds_diloco.config import TOKEN_ENV
    from ds_diloco.learner import Learner, LearnerError

    engine = engine_for(spec, seed=0)
    if rank == 0:
        os.environ[TOKEN_ENV] = spec["token"]
    else:
        os.environ.pop(TOKEN_ENV, None)
    try:
        Learner(engine, spec["url"], "no-token", connect_timeout_s=10.0)
    except LearnerError as e:
        return {"error": str(e)}
    finally:
        os.environ.pop(TOKEN_ENV, None)
    return {"error": None}


def scenario_unmastered(spec, rank, world):
    """A parameter frozen when the engine was built, then set to require grad: it trains in
    the user's eyes, yet the optimizer holds no fp32 master of it. The Learner refuses it on
    every rank, naming it, before it registers (a bare KeyError from DeepSpeed before)."""
    from ds_diloco.learner import Learner, LearnerError

    engine = engine_for(spec, seed=0, freeze=spec["freeze"])
    name = next(n for n, p in engine.module.named_parameters() if not p.requires_grad)
    engine.module.get_parameter(name).requires_grad_(True)
    try:
        Learner(engine, spec["url"], "unmastered", token=spec["token"], connect_timeout_s=10.0)
    except LearnerError as e:
        return {"name": name, "error": str(e), "type": type(e).__name__}
    return {"name": name, "error": None}


def scenario_checkpoint_under_learner(spec, rank, world):
    """A DeepSpeed checkpoint loaded under a running Learner (steps go back), and one loaded
    after the Learner was built (it took the global model first): both refused, every rank."""
    from ds_diloco.learner import Learner, LearnerError

    ids, labels = batch(spec["write_batch_seed"], spec["vocab"])
    errors = []
    engine = engine_for(spec, seed=0)
    learner = Learner(engine, spec["ckpt_url"], "ckpt", token=spec["token"])
    for step in range(1, 4):
        train_step(engine, ids, labels)
        learner.step(ids.numel())
        if step == 1:
            engine.save_checkpoint(spec["ckpt_dir"], tag="s1")
    for late in (False, True):
        if late:  # a new launch: the Learner joins, then the checkpoint is loaded
            learner.close(leave=False, flush=False)
            engine = engine_for(spec, seed=0)
            learner = Learner(engine, spec["ckpt_url"], "ckpt", token=spec["token"])
        engine.load_checkpoint(spec["ckpt_dir"], tag="s1")
        train_step(engine, ids, labels)
        try:
            learner.step(ids.numel())
            errors.append(None)
        except LearnerError as e:
            errors.append(str(e))
    run = learner.syncer.run  # the run's id, from the coordinator: sent with every upload
    learner.close(leave=True, flush=False)
    return {"errors": errors, "run": run}


def scenario_finite(spec, rank, world):
    """zero.model_finite: the same answer on every rank, NaN in one rank's slice or not."""
    engine = engine_for(spec, seed=0)
    access = zero.ZeroShardAccess(engine)
    out = [zero.model_finite(engine)]
    name = sorted(access.params)[-1]
    for bad in (1e20, float("nan")):  # a square that overflows float32; NaN
        if rank == world - 1:  # one value of the last rank's slice of one tensor
            values = access.read(name).clone()
            values[-1] = bad
            access.write(name, values)
        out.append(zero.model_finite(engine))
    return {"finite": out}


def _resize_engine(spec):
    """The engine both launches of the resize scenarios build: frozen layers, a schedule."""
    ds = json.loads(Path(spec["deepspeed_config"]).read_text())
    ds.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1,
              train_batch_size=MICRO_BATCH * torch.distributed.get_world_size())  # fmt: skip
    return zero.build_engine(ModelSource(config=spec["model_config"], seed=0), ds, spec["lr"],
                             spec["weight_decay"], lambda step: (step + 1) / 10,
                             freeze=tuple(spec["freeze"]))  # fmt: skip


def _inner_state(engine) -> dict:
    """Whole fp32 values and AdamW moments of every trained tensor (gathered), the step
    AdamW counted and the learning rate now."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    whole = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            whole[name] = [safe_get_full_fp32_param(p).clone()] + [
                safe_get_full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")
            ]
    flat = engine.optimizer.fp32_partitioned_groups_flat[0]
    step = float(engine.optimizer.optimizer.state[flat]["step"])
    return {
        "whole": whole,
        "adam_step": step,
        "lr": engine.optimizer.optimizer.param_groups[0]["lr"],
    }


def scenario_resize_save(spec, rank, world):
    """Three inner steps on this island's ranks, then a checkpoint (a collective)."""
    engine = _resize_engine(spec)
    for step in range(3):
        train_step(engine, *batch(100 * rank + step, spec["vocab"]))
    zero.save_checkpoint(engine, Path(spec["resize_dir"]), 3,
                         {"step": 3, "tokens": 3 * world * MICRO_BATCH * SEQ, "batches": 3,
                          "rows": 3 * world * MICRO_BATCH})  # fmt: skip
    return _inner_state(engine)


def scenario_resize_load(spec, rank, world):
    """The same island relaunched with another number of ranks: its checkpoint loaded, and
    one step on (which checkpoints again)."""
    engine = _resize_engine(spec)
    resumed = zero.load_checkpoint(engine, Path(spec["resize_dir"]))
    state = _inner_state(engine)
    train_step(engine, *batch(7, spec["vocab"]))
    zero.save_checkpoint(
        engine, Path(spec["resize_dir"]), 4, {"step": 4, "tokens": 0, "batches": 4}
    )
    return {**state, "resumed": resumed, "after": sorted(os.listdir(spec["resize_dir"]))}


def scenario_retuned_resume(spec, rank, world):
    """A checkpoint saved with one learning rate, weight decay and schedule (or none),
    loaded by an engine built with others (a run resumed with train.lr, train.weight_decay,
    train.warmup_steps edited): the rate and decay each group has then, the step, and the
    rate after one more step; and the refusal of an engine that freezes other parameters."""
    ds = json.loads(Path(spec["deepspeed_config"]).read_text())
    ds.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1,
              train_batch_size=MICRO_BATCH * world)  # fmt: skip
    out = {}
    warmup = lambda step: (step + 1) / 10  # noqa: E731
    for case, (saved, loaded) in {"constant": (None, None), "scheduled": (warmup, warmup),
                                  "schedule added": (None, warmup)}.items():  # fmt: skip
        directory = Path(spec["out"]) / f"retuned-{case}"

        def engine(lr, decay, schedule):
            source = ModelSource(config=spec["model_config"], seed=0)
            return zero.build_engine(source, ds, lr, decay, schedule)

        first = engine(1e-2, 0.01, saved)
        for step in range(3):
            train_step(first, *batch(100 * rank + step, spec["vocab"]))
        zero.save_checkpoint(first, directory, 3, {"step": 3, "tokens": 0})
        again = engine(4e-3, 0.1, loaded)
        resumed = zero.load_checkpoint(again, directory)
        groups = again.optimizer.param_groups
        loaded = [(g["lr"], g["weight_decay"]) for g in groups]
        train_step(again, *batch(7, spec["vocab"]))
        out[case] = {"resumed": resumed, "loaded": loaded, "next_lr": groups[0]["lr"]}
    # train.freeze edited: the checkpoint's AdamW state is of other parameters.
    source = ModelSource(config=spec["model_config"], seed=0)
    frozen = zero.build_engine(source, ds, 1e-2, 0.01, freeze=(r"layers\.0\.",))
    try:
        zero.load_checkpoint(frozen, Path(spec["out"]) / "retuned-constant")
        out["refrozen"] = None
    except ValueError as e:
        out["refrozen"] = str(e)
    return out


def scenario_checkpointing(spec, rank, world):
    """The same steps with activation checkpointing off, on every layer and on every other
    layer, all parameters trained and some frozen: the losses, this rank's fp32 master
    slices after them and how often each decoder layer's MLP ran forward (a recompute is
    one more). ZeRO-3 releases every gathered parameter as soon as its module is done
    (the project's config keeps them until reused), so a recompute must gather again."""
    ds = json.loads(Path(spec["deepspeed_config"]).read_text())
    ds["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_max_live_parameters=0,
                                   stage3_prefetch_bucket_size=0)  # fmt: skip
    releasing = Path(spec["out"]) / f"zero3-release-rank{rank}.json"
    releasing.write_text(json.dumps(ds))
    out = {}
    for frozen in (False, True):
        for every in (0, 1, 2):
            engine = engine_for(spec, seed=0, freeze=spec["freeze"] if frozen else (),
                                checkpointing=every, ds_config=str(releasing))  # fmt: skip
            calls = [0] * len(engine.module.model.layers)
            for i, layer in enumerate(engine.module.model.layers):
                # The layer's own hooks stay outside the recompute (HF checkpoints its forward).
                hook = lambda *_, i=i, c=calls: c.__setitem__(i, c[i] + 1)  # noqa: E731
                layer.mlp.register_forward_hook(hook)
            losses = [train_step(engine, *batch(100 * rank + s, spec["vocab"])) for s in range(3)]
            out[f"frozen={frozen} every={every}"] = {
                "losses": losses, "reads": reads(zero.ZeroShardAccess(engine)), "forwards": calls,
            }  # fmt: skip
    return out


SCENARIOS = {
    "checkpointing": scenario_checkpointing,
    "resize_save": scenario_resize_save,
    "resize_load": scenario_resize_load,
    "retuned_resume": scenario_retuned_resume,
    "checkpoint_under_learner": scenario_checkpoint_under_learner,
    "finite": scenario_finite,
    "minmax": scenario_minmax,
    "shards": scenario_shards,
    "write": scenario_write,
    "frozen": scenario_frozen,
    "syncer": scenario_syncer,
    "pretrained": scenario_pretrained,
    "no_token": scenario_no_token,
    "unmastered": scenario_unmastered,
}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank, world = zero.init_distributed()
    for name in spec["scenarios"]:
        t0 = time.perf_counter()
        try:
            result = SCENARIOS[name](spec, rank, world)
        except Exception:
            # Recorded for the test, then out at once: the other rank may be waiting in a
            # collective that this one will never join, and the test stops it when this exits.
            (out_dir / f"{name}-rank{rank}.error").write_text(traceback.format_exc())
            sys.stderr.flush()
            os._exit(1)
        result["seconds"] = time.perf_counter() - t0
        torch.save(result, out_dir / f"{name}-rank{rank}.pt")
    zero.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo was seen to abort there now and then, after all work.
    os._exit(0)


if __name__ == "__main__":
    main()
