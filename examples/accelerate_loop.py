"""An accelerate training loop with its DeepSpeed plugin (ZeRO-3) joins a ds_diloco run.

The lines marked ``# ds_diloco`` are all it takes; launched with accelerate::

    ds-diloco coordinator --config examples/coordinator.yaml &
    export DS_DILOCO_TOKEN=$(cat runs/examples-coordinator/token)
    accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 \
        examples/accelerate_loop.py --island c                  # on CPU: DS_ACCELERATOR=cpu
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import AutoConfig, AutoModelForCausalLM

import ds_diloco  # ds_diloco
from ds_diloco import zero
from ds_diloco.data import prepare_corpus

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default="http://127.0.0.1:8470")
    p.add_argument("--island", default="c")
    p.add_argument("--model-config", default=str(REPO / "model_configs" / "tiny-llama.json"))
    p.add_argument("--ds-config", default=str(REPO / "model_configs/deepspeed/zero3_cpu.json"))
    p.add_argument("--text", default=str(REPO / ".cache" / "corpus"), help="text file or folder")
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "ds_diloco"))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--save", help="save the run's merged model here at the end (HF folder)")
    args = p.parse_args()
    if not Path(args.text).exists():  # before the island joins the run
        p.error(f"--text {args.text}: no such file or folder (the demo's corpus: "
                "bash launch/get_corpus.sh .cache/corpus .venv/bin/python)")  # fmt: skip
    return args


def main() -> None:
    args = parse_args()
    zero.prepare_cpu_accelerate()  # without CUDA: gloo over all ranks (before Accelerator)
    ds_config = json.loads(Path(args.ds_config).read_text())
    ds_config.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=1)
    ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=True)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model_config = AutoConfig.from_pretrained(args.model_config)
    model = AutoModelForCausalLM.from_config(model_config)  # partitioned as it is built
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    _, blocks = prepare_corpus(args.text, args.cache_dir, model_config.vocab_size, args.seq_len)
    loader = torch.utils.data.DataLoader(blocks, batch_size=args.micro_batch, shuffle=True)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # a DeepSpeed engine

    learner = ds_diloco.Learner(engine, args.coordinator, args.island)  # ds_diloco

    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    for step, ids in zip(range(1, args.steps + 1), batches):
        loss = engine(input_ids=ids, labels=ids).loss  # the model shifts the labels itself
        accelerator.backward(loss)  # with DeepSpeed: backward and the engine's step
        optimizer.step()
        optimizer.zero_grad()
        applied = learner.step(tokens=ids.numel())  # ds_diloco
        if accelerator.is_main_process and (step % 10 == 0 or applied):
            print(f"step {step} loss {loss.item():.3f} applied {applied}", flush=True)

    versions = learner.close(take_global=True)  # ds_diloco: leave, take the merged model
    if args.save:
        state = accelerator.get_state_dict(engine)  # gathered from every rank's shard
        if accelerator.is_main_process:
            accelerator.unwrap_model(engine).save_pretrained(args.save, state_dict=state)
            (Path(args.save) / "versions.json").write_text(json.dumps(versions))
            print(f"done: global versions {versions}", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group: no gloo thread left for teardown


if __name__ == "__main__":
    main()
    zero.exit_without_teardown()  # gloo's threads can abort a finished job's teardown
