"""The README's main job: a short local Decoupled DiLoCo run on real text, on the CPU.

A coordinator on a local port and M islands as separate processes, each
training a tiny Llama with AdamW on its own shard of Shakespeare and syncing
one fragment at a time through the real wire API. Until the DeepSpeed ZeRO-3
islands land, each island here is one plain-PyTorch process (world size 1)
using the same rank-side syncer the ZeRO-3 islands use.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import queue
import secrets
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
MODEL_CONFIG = REPO / "model_configs" / "tiny-llama.json"
SEQ_LEN, MICRO_BATCH, VOCAB = 128, 4, 4096


def _island_main(url, token, island, shard, num_islands, steps, train_path, progress, lr, start):
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from ds_diloco.client import CoordinatorClient
    from ds_diloco.config import ModelSource
    from ds_diloco.data import BlockLoader, split_blocks
    from ds_diloco.fragments import FragmentPlan, Schedule, param_specs, signature
    from ds_diloco.hf_model import build_model, lm_loss
    from ds_diloco.syncer import FragmentSyncer, ModelShardAccess

    model = build_model(ModelSource(config=str(MODEL_CONFIG), seed=shard))
    client = CoordinatorClient(url, token)
    info = client.register(island, 1, signature(param_specs(model.named_parameters())))
    plan = FragmentPlan.from_json(info["plan"])
    schedule = Schedule(**info["schedule"])
    syncer = FragmentSyncer(client, island, plan, schedule, ModelShardAccess(model))
    syncer.bootstrap()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    blocks = split_blocks(torch.load(train_path), num_islands, shard)
    loader = iter(BlockLoader(blocks, MICRO_BATCH, seed=shard))
    start.wait()  # islands start together, as a launcher would start them
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        input_ids, labels = next(loader)
        loss = lm_loss(model, input_ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        applied = syncer.on_step(step, input_ids.numel())
        progress.put(
            {
                "island": island,
                "step": step,
                "loss": loss.item(),
                "tokens": step * input_ids.numel(),
                "applied": len(applied),
                "versions": syncer.versions(),
                "seconds": time.perf_counter() - t0,
            }
        )
    syncer.close()
    progress.put({"island": island, "done": True, "stats": vars(syncer.stats)})


@torch.no_grad()
def heldout_loss(tensors: dict[str, torch.Tensor], blocks: torch.Tensor) -> float:
    from ds_diloco.config import ModelSource
    from ds_diloco.hf_model import build_model, lm_loss

    model = build_model(ModelSource(config=str(MODEL_CONFIG)))
    model.load_state_dict(tensors, strict=False)
    model.eval()
    losses = [lm_loss(model, b[:, :-1], b[:, 1:]).item() for b in blocks.split(MICRO_BATCH)]
    return sum(losses) / len(losses)


def run_demo(args) -> int:
    from ds_diloco.config import CoordinatorConfig, ModelSource
    from ds_diloco.data import heldout_split, prepare_corpus
    from ds_diloco.round_policy import PolicyOptions
    from ds_diloco.server import ServerThread

    workdir = Path(args.workdir)
    state_dir = workdir / "state"
    shutil.rmtree(state_dir, ignore_errors=True)  # a demo starts from the seeded model
    corpus = args.corpus or str(REPO / ".cache" / "corpus")
    _, blocks = prepare_corpus(corpus, workdir / "cache", VOCAB, SEQ_LEN)
    train, heldout = heldout_split(blocks, 0.02, seed=0)
    heldout = heldout[:64]
    train_path = workdir / "cache" / "train-blocks.pt"
    torch.save(train, train_path)
    print(f"corpus: {len(train)} training blocks of {SEQ_LEN + 1} tokens, {len(heldout)} held out")

    cfg = CoordinatorConfig(
        model=ModelSource(config=str(MODEL_CONFIG), seed=0),
        state_dir=str(state_dir),
        num_fragments=8,
        sync_every=8,
        policy=PolicyOptions(min_quorum=1, grace_gamma=0.5, tau=2),
        token=secrets.token_urlsafe(16),
    )
    with ServerThread(cfg) as srv:
        start_loss = heldout_loss(srv.coord.global_tensors(), heldout)
        print(f"coordinator at {srv.url}; held-out loss of the initial model {start_loss:.3f}")
        ctx = mp.get_context("spawn")
        progress = ctx.Queue()
        start = ctx.Barrier(args.islands)
        names = [f"island-{i}" for i in range(args.islands)]
        procs = [
            ctx.Process(
                target=_island_main,
                args=(
                    srv.url,
                    cfg.token,
                    n,
                    i,
                    args.islands,
                    args.steps,
                    str(train_path),
                    progress,
                    1e-3,
                    start,
                ),
                daemon=True,
            )
            for i, n in enumerate(names)
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        last: dict[str, dict] = {}
        done: dict[str, dict] = {}
        next_print = time.perf_counter() + 5
        while len(done) < len(procs):
            try:
                msg = progress.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            (done if msg.get("done") else last)[msg["island"]] = msg
            if time.perf_counter() >= next_print:
                next_print += 5
                _print_progress(last, srv.coord.status())
        for p in procs:
            p.join(timeout=30)
        wall = time.perf_counter() - t0
        status = srv.coord.status()
        final_loss = heldout_loss(srv.coord.global_tensors(), heldout)
    _print_progress(last, status)
    tokens = sum(m["tokens"] for m in last.values())
    summary = {
        "islands": args.islands,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "heldout_loss_start": round(start_loss, 4),
        "heldout_loss_end": round(final_loss, 4),
        "versions": status["versions"],
        "merges": status["merges"],
        "island_stats": {k: v["stats"] for k, v in done.items()},
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"\ndone in {wall:.0f}s: {tokens} tokens ({tokens / wall:.0f}/s), "
        f"{sum(status['merges'])} merges, held-out loss {start_loss:.3f} -> {final_loss:.3f}"
        f"\nsummary: {workdir / 'summary.json'}"
    )
    failed = [n for n in names if n not in done]
    if failed:
        print(f"islands that did not finish: {failed}")
        return 1
    return 0 if final_loss < start_loss else 1


def _print_progress(last: dict[str, dict], status: dict) -> None:
    cells = "  ".join(
        f"{k}: step {m['step']} loss {m['loss']:.4f}" for k, m in sorted(last.items())
    )
    v = status["versions"]
    print(f"[{cells}]  versions {min(v)}..{max(v)}  merges {sum(status['merges'])}", flush=True)
