"""Hugging Face models: build one from a config or a folder, whole, on the CPU.

The coordinator uses this once, to create the initial global model; islands
build theirs partitioned under ZeRO-3. Names come from ``named_parameters()``,
which lists tied weights once, exactly as a DeepSpeed engine's module does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ds_diloco.config import ModelSource, _check_model_config, check_model_weights


def build_model(source: ModelSource):
    """A float32 causal LM on the CPU from a pretrained folder or from a config + seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # A config.json that is not a model's (a coordinator's fresh start): named, not a
    # transformers OSError traceback or its advice to add a model_type key.
    if source.pretrained:
        if not os.path.isdir(source.pretrained):
            raise ValueError(f"model.pretrained {source.pretrained!r} is not a folder")
        _check_model_config(Path(source.pretrained), "model.pretrained")
        check_model_weights(Path(source.pretrained), "model.pretrained")
        model, info = AutoModelForCausalLM.from_pretrained(
            source.pretrained, dtype=torch.float32, **LOADING_INFO
        )
        check_loaded(info, f"model.pretrained {source.pretrained!r}")
        return model
    path = source.config
    if not os.path.exists(path):
        raise ValueError(f"model.config {path!r} does not exist")
    _check_model_config(Path(path), "model.config")
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(source.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


LOADING_INFO = {"output_loading_info": True, "ignore_mismatched_sizes": True}
"""``from_pretrained`` arguments for :func:`check_loaded`: what did not load is named there,
not a RuntimeError pointing at a report printed "above"."""


def check_loaded(info: dict, where: str) -> None:
    """Refuse a load (``from_pretrained(..., **LOADING_INFO)``'s info) that left parameters
    of the model out: transformers fills a tensor the checkpoint lacks (or has in another
    shape) with a random init and prints a report, and the run fine-tuned a model that was
    partly not the pretrained one."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k)
                        for k in info.get("mismatched_keys") or ())  # fmt: skip
    if missing or mismatched:
        what = "; ".join(
            f"{len(names)} {how} (e.g. {names[0]!r})"
            for names, how in ((missing, "missing"), (mismatched, "of another shape than its config's"))
            if names
        )  # fmt: skip
        raise ValueError(
            f"{where}: its weights do not give the whole model: parameters {what}; they "
            "would start random. The checkpoint is incomplete or its config is another model's"
        )


def initial_params(source: ModelSource, save_config_to: str | None = None):
    """(name, fp32 tensor) in model order, detached from the model.

    With ``save_config_to``, the model's config (and generation config) is saved
    there too, so that the global model can be exported without the source.
    """
    model = build_model(source)
    if save_config_to is not None:
        model.config.save_pretrained(save_config_to)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(save_config_to)
    return [(n, p.detach().float().contiguous()) for n, p in model.named_parameters()]


def model_specs(source: ModelSource) -> list:
    """The parameters (``fragments.ParamSpec``: names, shapes, in order) of the model
    ``source`` describes, built on the meta device: no weights are made or read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_diloco.fragments import param_specs

    config = AutoConfig.from_pretrained(source.pretrained or source.config)
    with torch.device("meta"):  # (accelerate's init_empty_weights left tied weights apart)
        model = AutoModelForCausalLM.from_config(config)
    return param_specs(model.named_parameters())


def check_freeze(patterns: Sequence[str], names: Sequence[str]) -> None:
    """``train.freeze``'s patterns (``re.search``) each match a parameter name: a typo
    would silently train everything."""
    for pattern in patterns:
        if not any(re.search(pattern, name) for name in names):
            like = f"they are named like {names[0]!r}"
            if re.search(pattern, "lm_head.weight") and not any("lm_head" in n for n in names):
                # A tied head (SmolLM2's, GPT-2's) is the embedding, listed once under its name.
                emb = next((n for n in names if re.search(r"embed|wte", n)), names[0])
                like = (f"its output layer lm_head is tied to the input embeddings, listed once "
                        f"as {emb!r}: freeze that")  # fmt: skip
            raise ValueError(
                f"train.freeze: {pattern!r} matches no parameter of the model ({like})"
            )


_POSITIONS = re.compile(r"(?:^|\.)(?:wpe|embed_positions|position_embeddings)\.weight$")
"""A learned absolute-position table (GPT-2's wpe, OPT's, GPT-Neo's): a row per position."""


def check_sequence_fits(specs, seq_len: int) -> None:
    """A model with learned absolute positions has a row for each: a longer sequence is an
    IndexError in every rank's first step (rotary models, Llama's, have no such table)."""
    for spec in specs:
        if _POSITIONS.search(spec.name) and seq_len > spec.shape[0]:
            raise ValueError(
                f"data.seq_len {seq_len} is longer than the model's {spec.shape[0]} learned "
                f"positions ({spec.name}): lower data.seq_len"
            )


def check_tokenizer_fits(tokenizer, source: ModelSource, name: str | None) -> None:
    """Every id of ``tokenizer`` (``data.tokenizer`` ``name``, None: trained on the corpus)
    is a row of the model's embeddings: a larger one is an IndexError in every rank's first
    forward."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(source.pretrained or source.config).vocab_size
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer ({name or 'trained on the corpus'}) has {len(tokenizer)} tokens, "
            f"above the model's vocab_size {vocab}: its ids would index past the embeddings "
            "(an IndexError in every rank's first step); use the model's own tokenizer or a "
            "model with a larger vocabulary"
        )
    if source.pretrained and name and Path(name).resolve() != Path(source.pretrained).resolve():
        _check_same_vocabulary(tokenizer, source.pretrained, name)


def _check_same_vocabulary(tokenizer, pretrained: str, name: str) -> None:
    """A ``data.tokenizer`` other than the pretrained model's own gives its ids the model's
    tokens: with another vocabulary (a BPE trained on the corpus, another model's) the run
    fine-tuned on text the model read as other words, its pretraining lost, and exported
    that tokenizer with it. Tokens added on top (special ones, chat markers) may differ."""
    from ds_diloco.data import load_tokenizer

    try:
        own = load_tokenizer(pretrained, "model.pretrained")
    except ValueError:
        return  # the folder holds no tokenizer: nothing to compare with
    added = set(tokenizer.get_added_vocab().values()) | set(own.get_added_vocab().values())
    theirs = {i: t for t, i in tokenizer.get_vocab().items() if i not in added}
    ours = {i: t for t, i in own.get_vocab().items() if i not in added}
    differ = [i for i in sorted(theirs.keys() & ours.keys()) if theirs[i] != ours[i]]
    if differ:
        i = differ[0]
        raise ValueError(
            f"data.tokenizer {name!r} has another vocabulary than model.pretrained's own "
            f"tokenizer ({len(differ)} of the ids both have are other tokens, e.g. id {i} is "
            f"{theirs[i]!r}, the model's {ours[i]!r}): the model would read the text as other "
            "words; leave data.tokenizer out to use the model's"
        )


def model_signature(source: ModelSource) -> str:
    """The parameter signature (names, shapes, order) of the model ``source`` describes."""
    from ds_diloco.fragments import signature

    return signature(model_specs(source))


def lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``labels`` are already shifted (data.BlockLoader)."""
    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@torch.no_grad()
def mean_loss(model, blocks: torch.Tensor, batch: int = 8) -> float:
    """Mean ``lm_loss`` of a whole model over token blocks ((N, seq_len + 1)), ``batch``
    blocks at a time (each batch weighs its blocks)."""
    if len(blocks) == 0:
        raise ValueError("no blocks to compute a loss over")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for b in blocks.split(batch):
        b = b.to(device)
        total += lm_loss(model, b[:, :-1], b[:, 1:]).item() * len(b)
    model.train(was_training)
    return total / len(blocks)
