"""The Hugging Face Trainer with DeepSpeed ZeRO-3 joins a ds_diloco run as an island.

One callback is all it takes (marked ``# ds_diloco``); the rest is an ordinary
Trainer script, launched with the deepspeed launcher as usual::

    ds-diloco coordinator --config examples/coordinator.yaml &
    export DS_DILOCO_TOKEN=$(cat runs/examples-coordinator/token)
    deepspeed --num_gpus 2 examples/hf_trainer.py --island b       # on CPU: DS_ACCELERATOR=cpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

import ds_diloco  # ds_diloco
from ds_diloco import zero
from ds_diloco.data import prepare_corpus

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default="http://127.0.0.1:8470")
    p.add_argument("--island", default="b")
    p.add_argument("--model-config", default=str(REPO / "model_configs" / "tiny-llama.json"))
    p.add_argument("--ds-config", default=str(REPO / "model_configs/deepspeed/zero3_cpu.json"))
    p.add_argument("--text", default=str(REPO / ".cache" / "corpus"), help="text file or folder")
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "ds_diloco"))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out", default=str(REPO / "runs" / "examples-trainer"))
    p.add_argument("--save", help="save the run's merged model here at the end (HF folder)")
    p.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = p.parse_args()
    if not Path(args.text).exists():  # before the island joins the run
        p.error(f"--text {args.text}: no such file or folder (the demo's corpus: "
                "bash launch/get_corpus.sh .cache/corpus .venv/bin/python)")  # fmt: skip
    return args


class CausalBlocks(torch.utils.data.Dataset):
    """The corpus's blocks as Trainer examples; the model shifts the labels itself."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        ids = self.blocks[i]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    args = parse_args()
    zero.prepare_cpu_accelerate()  # without CUDA: gloo, all ranks (before TrainingArguments)
    ds_config = json.loads(Path(args.ds_config).read_text())
    ds_config["gradient_accumulation_steps"] = "auto"
    ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    training = TrainingArguments(
        output_dir=args.out, deepspeed=ds_config, max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=10,
        save_strategy="no", report_to=[], seed=0,
        accelerator_config={"use_configured_state": zero.on_cpu()},
        include_num_input_tokens_seen=True,  # ds_diloco weights islands by their tokens
    )  # fmt: skip
    model_config = AutoConfig.from_pretrained(args.model_config)
    model = AutoModelForCausalLM.from_config(model_config)  # partitioned: ZeRO-3 is on
    _, blocks = prepare_corpus(args.text, args.cache_dir, model_config.vocab_size, args.seq_len)
    train = CausalBlocks(blocks)  # read from the memory-mapped tokens as batches are made
    diloco = ds_diloco.DiLoCoCallback(args.coordinator, island=args.island)  # ds_diloco
    trainer = Trainer(model=model, args=training, train_dataset=train, callbacks=[diloco])
    trainer.train()  # the callback joins the run, syncs after each step, leaves at the end
    if args.save:  # the merged global model, taken by the callback when training ended
        trainer.save_model(args.save)
        if trainer.is_world_process_zero():
            (Path(args.save) / "versions.json").write_text(json.dumps(diloco.versions))
            print(f"done: global versions {diloco.versions}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # no gloo thread left for interpreter teardown


if __name__ == "__main__":
    main()
    zero.exit_without_teardown()  # gloo's threads can abort a finished job's teardown
