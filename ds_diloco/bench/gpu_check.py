"""Two islands of ZeRO-3 on the GPUs present, with and without ds_diloco (``launch/gpu_check.sh``).

The same two jobs run twice, each time both at once on the same devices: as
plain DeepSpeed ZeRO-3 (``ds-diloco island --plain``: no coordinator), then as
two ds_diloco islands of one run (a coordinator on this host). With two or more
GPUs each island takes half of them; with one GPU both islands share it. Printed
per mode: the island step time (median over steps after the warm-up, the
slowest rank's), tokens per second (both islands together, training loops
only), peak GPU memory per rank (``torch.cuda.max_memory_allocated``; host RSS
on a CPU), and the merges the coordinator did. A deadline bounds the whole
check: a launch still running then is stopped and the check fails.

``python -m ds_diloco.bench.gpu_check --help`` lists the settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ds_diloco.bench.quality import REPO, default_corpus
from ds_diloco.compress import CODECS, Codec
from ds_diloco.config import (
    CoordinatorConfig,
    DataConfig,
    IslandSpec,
    ModelSource,
    RunConfig,
    TrainConfig,
)
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.run import LocalRun

MODES = ("plain", "ds_diloco")


def run_config(args, workdir: Path) -> RunConfig:
    gpus = torch.cuda.device_count()
    # Half of the GPUs each (one GPU: both islands on it; none: CPU ranks). No include:
    # the run lays islands out on the devices CUDA_VISIBLE_DEVICES gives it, where an
    # include's ids are the devices' own (GPUs 0 and 1 for a job given GPUs 2 and 3).
    size = max(1, gpus // 2)
    islands = tuple(IslandSpec(name=f"island-{x}", world_size=size) for x in "ab")
    model = ModelSource(config=str(Path(args.model).resolve()), seed=0)
    coordinator = CoordinatorConfig(
        model=model,
        state_dir=str(workdir / "state"),
        num_fragments=args.fragments,
        sync_every=args.sync_every,
        policy=PolicyOptions(min_quorum=1, grace_gamma=0.5, tau=2),
        compression=Codec(name=args.compression),
        save_every_merges=10**6,  # a throughput check: the state is written at the end only
        durable_merges=False,
    )
    return RunConfig(
        model=model,
        deepspeed_config=str(Path(args.deepspeed_config).resolve()),
        data=DataConfig(
            path=args.corpus,
            vocab_size=args.vocab_size,
            seq_len=args.seq_len,
            cache_dir=str(Path(args.cache_dir).resolve()),
        ),
        train=TrainConfig(
            steps=args.steps,
            micro_batch=args.micro_batch,
            lr=3e-4,
            warmup_steps=min(10, args.steps),
            log_every=10,
        ),
        islands=islands,
        coordinator=coordinator,
        workdir=str(workdir),
        export=False,
    )


def launch(cfg: RunConfig, mode: str, deadline: float) -> dict:
    """Both islands at once in ``mode``; their ranks' summaries and the coordinator's merges."""
    lr = LocalRun(cfg)
    merges = None
    try:
        if mode == "ds_diloco":
            lr.spawn_coordinator()  # it starts up while the islands do
        for shard, spec in enumerate(cfg.islands):
            lr.start_island(spec, shard, len(cfg.islands), plain=mode == "plain")
        client = lr.wait_for_coordinator() if mode == "ds_diloco" else None
        while any(p.poll() is None for p in lr.islands.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: still running at the deadline (--deadline-s)")
            time.sleep(0.5)
        failed = {n: p.returncode for n, p in lr.islands.items() if p.returncode}
        if failed:
            name = next(iter(failed))
            log = (lr.workdir / "islands" / name / "log.txt").read_text(errors="replace")
            raise RuntimeError(f"{mode}: islands failed {failed}; {name}'s log:\n{log[-3000:]}")
        if client:
            merges = client.status()["merges"]
    finally:
        lr.stop()
    ranks = [
        json.loads((lr.workdir / "islands" / s.name / f"summary-rank{r}.json").read_text())
        for s in cfg.islands
        for r in range(s.world_size)
    ]
    return {"ranks": ranks, "merges": merges}


def figures(run: dict, warmup: int) -> dict:
    by_island: dict[str, list[dict]] = {}
    for r in run["ranks"]:
        by_island.setdefault(r["island"], []).append(r)
    step, tokens_s = [], 0.0
    for ranks in by_island.values():
        times = [max(t) for t in zip(*(r["step_times_s"] for r in ranks))]
        step.append(statistics.median(times[warmup:] if len(times) > warmup else times))
        tokens_s += ranks[0]["tokens"] / sum(times)
    gpu = [r.get("peak_gpu_mb") for r in run["ranks"]]

    def per_step_ms(key: str) -> float:  # a rank's syncer time per step, mean over ranks
        # In the loop only (the final flush's sends are not in the sync part).
        return 1e3 * statistics.fmean(
            (r.get("loop_stats") or {}).get(key, 0.0) / r["steps"] for r in run["ranks"]
        )

    return {
        "step_s": max(step),
        "sync_ms": 1e3 * statistics.fmean(r["sync_s"] / r["steps"] for r in run["ranks"]),
        "send_ms": per_step_ms("send_s"),
        "apply_ms": per_step_ms("apply_s") + per_step_ms("cache_s"),
        # Applies that read a copy the download thread had put on the GPU already (a GPU
        # shard), against all of them.
        "applies": [
            sum((r.get("stats") or {}).get(k, 0) for r in run["ranks"])
            for k in ("prefetched", "applied")
        ],
        "tokens_per_s": tokens_s,
        "peak_gpu_mb": max(gpu) if all(g is not None for g in gpu) else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in run["ranks"]),
        "merges": run["merges"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_diloco.bench.gpu_check", description=__doc__)
    p.add_argument("--model", default=str(REPO / "model_configs" / "llama-1b.json"))
    p.add_argument("--deepspeed-config",
                   default=str(REPO / "model_configs" / "deepspeed" / "zero3_gpu.json"))  # fmt: skip
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the step time")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=4096, help="of the tokenizer trained")
    p.add_argument("--corpus", default=default_corpus())
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "ds_diloco"))
    p.add_argument("--fragments", type=int, default=16, help="P")
    p.add_argument("--sync-every", type=int, default=64, help="H")
    p.add_argument("--compression", default="int4", choices=CODECS)
    p.add_argument("--workdir", default="runs/gpu-check")
    p.add_argument("--deadline-s", type=float, default=450.0, help="the whole check")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    workdir = Path(args.workdir).resolve()
    cfg = run_config(args, workdir)
    where = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "CPU (no CUDA)"
    )
    where_ranks = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = " + ".join(f"{s.name} x{s.world_size} ({where_ranks})" for s in cfg.islands)
    print(
        f"gpu_check: {Path(args.model).name}, {Path(args.deepspeed_config).name} on {where}; "
        f"islands {sizes}; {args.steps} steps of micro_batch {args.micro_batch} x "
        f"{args.seq_len}; ds_diloco: P={args.fragments} H={args.sync_every} K=1 tau=2, "
        f"{args.compression}",
        flush=True,
    )
    from ds_diloco.data import prepare_section

    # The tokenizer and blocks once, before the islands (which would race for them).
    prepare_section(cfg.data)
    out = {}
    for mode in MODES:
        t0 = time.monotonic()
        run = launch(dataclasses.replace(cfg, workdir=str(workdir / mode)), mode, deadline)
        out[mode] = figures(run, args.warmup)
        out[mode]["launch_s"] = round(time.monotonic() - t0, 1)
        print(f"  {mode} done in {out[mode]['launch_s']} s", flush=True)
    plain, ds = out["plain"], out["ds_diloco"]
    for mode in MODES:
        f = out[mode]
        mem = f"peak GPU {f['peak_gpu_mb']:.0f} MB" if f["peak_gpu_mb"] is not None else ""
        merges = f", merges {sum(f['merges'])}" if f["merges"] else ""
        if f["merges"]:  # where the training loop's extra time goes
            merges += (
                f"; sync part {f['sync_ms']:.1f} ms a step (sends {f['send_ms']:.1f}, "
                f"applies {f['apply_ms']:.1f}; {f['applies'][0]} of {f['applies'][1]} applies "
                "from a copy on the device)"
            )
        print(
            f"  {mode:9s} island step {f['step_s'] * 1e3:.1f} ms, {f['tokens_per_s']:,.0f} tokens/s "
            f"(both islands), {mem or 'no GPU'}, peak RSS {f['peak_rss_mb']:.0f} MB per rank"
            f"{merges}",
            flush=True,
        )
    line = f"  ds_diloco / plain: step time {ds['step_s'] / plain['step_s']:.3f}, tokens/s "
    line += f"{ds['tokens_per_s'] / plain['tokens_per_s']:.3f}"
    if plain["peak_gpu_mb"] is not None:
        line += f", peak GPU memory {ds['peak_gpu_mb'] - plain['peak_gpu_mb']:+.0f} MB per rank"
    merges = ds["merges"] or [0]
    print(f"{line}; merges done {sum(merges)} (per fragment {min(merges)}..{max(merges)})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if sum(merges) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
