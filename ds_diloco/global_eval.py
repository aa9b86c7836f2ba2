"""The held-out loss of the global (merged) model: once, or every N merges while a run
goes on. The islands' losses are their local models'; this is the model the run makes.

``ds-diloco eval --from URL|STATE_DIR --data FILE``: the held-out blocks are the islands'
own (the ``data`` section of a run or island file: the same corpus, tokenizer, seed and
split, see ``data.heldout_split``), and the model one set of versions the coordinator
served at one moment, read as ``export`` reads it. ``ds-diloco run``'s own evaluations
(``eval_every_merges``: ``live_model.PeriodicEval``) are :func:`evaluate_global` too.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from ds_diloco.config import DataConfig

HELDOUT_BLOCKS = 64
"""Held-out blocks evaluated by default: the first of the seeded held-out split."""


def heldout_blocks(d: DataConfig, count: int = HELDOUT_BLOCKS) -> torch.Tensor:
    """The first ``count`` held-out blocks of the corpus ``d`` describes, (N, seq_len + 1)
    token ids (the corpus is tokenised and cached on first use, as an island does)."""
    from ds_diloco.data import as_tensor, heldout_split, prepare_section

    if count < 1:
        raise ValueError(f"held-out blocks: need at least 1, got {count}")
    _, blocks = prepare_section(d)
    _, heldout = heldout_split(blocks, d.heldout_fraction, seed=d.seed)
    return as_tensor(heldout[:count])


def evaluate_global(
    source: str | os.PathLike, heldout: torch.Tensor, token: str | None = None,
    ca_file: str | None = None, device: str = "cpu",
) -> dict:  # fmt: skip
    """{"merges", "versions", "heldout_loss"} of the global model at ``source`` (a
    coordinator URL or its state directory) on ``heldout``, computed on ``device``
    (in fp32 there: the global model's own precision)."""
    from ds_diloco.export import global_model, load_global
    from ds_diloco.hf_model import mean_loss

    g = load_global(source, token, ca_file=ca_file)
    vocab, top = g.config.get("vocab_size"), int(heldout.max())
    if vocab is not None and top >= vocab:  # else an IndexError traceback from the embedding
        raise ValueError(
            f"the held-out blocks hold token id {top}, beyond the model's vocab_size {vocab}: "
            "the data section's tokenizer is not the model's"
        )
    model = global_model(g.config, g.tensors).to(device)
    del g.tensors  # on a GPU: the host copies go
    loss = mean_loss(model, heldout)
    merges = sum(g.merges) if g.merges is not None else None
    return {"merges": merges, "versions": g.versions, "heldout_loss": loss}


def describe(record: dict) -> str:
    v = record["versions"]
    at = "" if record["merges"] is None else f" at {record['merges']} merges"
    return (f"global model{at} (versions {min(v)}..{max(v)}): held-out loss "
            f"{record['heldout_loss']:.4f}")  # fmt: skip


def _check_device(device: str) -> None:
    """``--device`` names a device of this machine."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )


def main(args) -> int:
    """``ds-diloco eval``: evaluate once, or (``--every-merges``) each time the merges,
    summed over fragments, pass the next multiple, until ``--count`` or Ctrl-C."""
    from ds_diloco.client import TRANSPORT_ERRORS, CoordinatorClient, RefusedError
    from ds_diloco.config import load_data_config
    from ds_diloco.export import CoordinatorUnreachable, is_url
    from ds_diloco.live_model import next_due
    from ds_diloco.status_view import resolve_token

    if args.every_merges is not None and args.every_merges < 1:
        raise ValueError(f"--every-merges must be >= 1, got {args.every_merges}")
    if args.every_merges is not None and not is_url(args.source):
        raise ValueError("--every-merges needs a running coordinator's URL, not a state dir")
    if args.count is not None and args.count < 1:
        raise ValueError(f"--count must be >= 1, got {args.count}")
    token = resolve_token(args, args.source) if is_url(args.source) else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _check_device(device)  # before the corpus is read, not a traceback once the model is
    heldout = heldout_blocks(load_data_config(args.data), args.blocks)
    if len(heldout) < args.blocks:  # else a figure on fewer blocks than asked, unsaid
        print(f"the held-out split has {len(heldout)} blocks: evaluating those, not "
              f"--blocks {args.blocks}", flush=True)  # fmt: skip
    board = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        board = SummaryWriter(args.tensorboard)

    def evaluate() -> dict:
        record = {**evaluate_global(args.source, heldout, token, args.ca_file, device),
                  "blocks": len(heldout), "time": round(time.time(), 3)}  # fmt: skip
        print(describe(record), flush=True)
        if args.json:
            with open(args.json, "a") as f:  # one line per evaluation: a watch appends
                f.write(json.dumps(record) + "\n")
        if board is not None and record["merges"] is not None:
            board.add_scalar("global/heldout_loss", record["heldout_loss"], record["merges"])
            board.flush()
        return record

    try:
        if args.every_merges is None:
            evaluate()
            return 0
        client = CoordinatorClient(args.source, token, retries=1, timeout_s=10,
                                   ca_file=args.ca_file)  # fmt: skip
        due, done = 0, 0
        while args.count is None or done < args.count:
            try:
                merges = sum(client.status()["merges"])
            except RefusedError as e:  # a wrong token: no use asking again
                raise ValueError(f"{client.url} refused: {e.message}") from None
            except TRANSPORT_ERRORS as e:  # restarting, say: the watch goes on
                print(f"no status from {client.url}: {e}", flush=True)
                merges = -1
            if merges >= due:
                try:
                    record = evaluate()
                except CoordinatorUnreachable as e:  # gone while it read the model: as above
                    print(f"no evaluation from {client.url}: {e}", flush=True)
                else:
                    done += 1
                    due = next_due(record["merges"], args.every_merges)
            if args.count is None or done < args.count:
                time.sleep(args.poll_s)
        return 0
    except KeyboardInterrupt:  # the way a watch ends
        return 0
    finally:
        if board is not None:
            board.close()
        sys.stdout.flush()
