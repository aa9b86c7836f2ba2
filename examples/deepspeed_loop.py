"""A plain DeepSpeed ZeRO-3 training loop that joins a ds_diloco run as an island.

The lines marked ``# ds_diloco`` are all it takes; the rest is an ordinary loop.
Every rank runs this script (the deepspeed launcher), one island per launch::

    ds-diloco coordinator --config examples/coordinator.yaml &      # prints nothing secret
    export DS_DILOCO_TOKEN=$(cat runs/examples-coordinator/token)
    deepspeed --num_gpus 2 examples/deepspeed_loop.py --island a     # on CPU: DS_ACCELERATOR=cpu
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

import ds_diloco  # ds_diloco
from ds_diloco import zero
from ds_diloco.data import BlockLoader, prepare_corpus

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default="http://127.0.0.1:8470")
    p.add_argument("--island", default="a")
    p.add_argument("--model-config", default=str(REPO / "model_configs" / "tiny-llama.json"))
    p.add_argument("--ds-config", default=str(REPO / "model_configs/deepspeed/zero3_cpu.json"))
    p.add_argument("--text", default=str(REPO / ".cache" / "corpus"), help="text file or folder")
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "ds_diloco"))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--connect-timeout", type=float, default=30.0)
    p.add_argument("--save", help="save the run's merged model here at the end (HF folder)")
    p.add_argument("--freeze", help="regex: parameters whose names match are not trained")
    p.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = p.parse_args()
    if not Path(args.text).exists():  # before the island joins the run
        p.error(f"--text {args.text}: no such file or folder (the demo's corpus: "
                "bash launch/get_corpus.sh .cache/corpus .venv/bin/python)")  # fmt: skip
    return args


def main() -> None:
    args = parse_args()
    zero.init_distributed()  # gloo on CPU (and no shm op build); NCCL on GPUs
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ds_config = json.loads(Path(args.ds_config).read_text())
    ga = args.grad_accum
    ds_config.update(train_micro_batch_size_per_gpu=args.micro_batch,
                     gradient_accumulation_steps=ga, train_batch_size=args.micro_batch * world * ga)  # fmt: skip
    model_config = AutoConfig.from_pretrained(args.model_config)
    keep = HfDeepSpeedConfig(ds_config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config)
    if args.freeze:  # e.g. embeddings kept fixed while fine-tuning: their pseudo-gradient is 0
        for name, param in model.named_parameters():
            param.requires_grad_(re.search(args.freeze, name) is None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    # Joins the run: checks the model against the run's, takes the global model.
    learner = ds_diloco.Learner(  # ds_diloco
        engine, args.coordinator, args.island, connect_timeout_s=args.connect_timeout
    )

    _, blocks = prepare_corpus(args.text, args.cache_dir, model_config.vocab_size, args.seq_len)
    # The ranks walk one order of the blocks together, rank r the r-th micro-batch of each
    # world x micro_batch: the same walk on any number of ranks.
    batches = iter(BlockLoader(blocks, args.micro_batch, seed=0, rank=rank, world=world))
    for micro in range(1, args.steps * ga + 1):
        ids, next_ids = (x.to(engine.device) for x in next(batches))  # labels shifted already
        logits = engine(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), next_ids.flatten())
        engine.backward(loss)
        engine.step()  # an optimizer step every `ga` micro-batches
        applied = learner.step(tokens=ids.numel())  # ds_diloco: after every engine.step()
        if rank == 0 and (micro % (10 * ga) == 0 or applied):
            print(
                f"step {engine.global_steps} loss {loss.item():.3f} applied {applied}", flush=True
            )

    # Sends the steps not sent yet, leaves the run, loads the merged model into the engine.
    versions = learner.close(take_global=True)  # ds_diloco
    if rank == 0:
        print(f"done: global versions {versions}, uploads {learner.stats.uploads}", flush=True)
    if args.save:
        full = zero.gather_full_params(engine)  # every rank takes part in the gather
        del keep  # a plain (not partitioned) model from here on
        if rank == 0:
            plain = AutoModelForCausalLM.from_config(model_config)
            plain.load_state_dict(full, strict=False)
            plain.save_pretrained(args.save)
            (Path(args.save) / "versions.json").write_text(json.dumps(versions))
    # Torch's own advice: tear the process group down before exiting. Left to interpreter
    # teardown, a gloo worker thread still freeing the last collective's tensors needs
    # the GIL after finalization began, and the rank aborts ("terminate called without
    # an active exception"). The barrier first, as the other examples have it: without
    # it the rank that did not save left while rank 0 was still writing, and aborted
    # so (once in CI, twice in this project's test runs since).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    zero.exit_without_teardown()  # gloo's threads can abort a finished job's teardown
