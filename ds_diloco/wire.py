"""The wire format: safetensors bodies whose ``__metadata__`` carries the header.

An upload is one rank's slices of one fragment, a download the slices that one
rank of a given world size owns. Both are plain safetensors files, so any
language can read them. We write and parse the format ourselves (it is an
8-byte length, a JSON header and raw little-endian bytes) to avoid copies: the
encoder writes views of the global tensors straight into the body, the decoder
returns tensors that alias the received bytes. Tests check both directions
against the ``safetensors`` library.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from collections.abc import Mapping

import torch

MAX_HEADER_BYTES = 16 * 1024 * 1024
_DTYPES = {
    "F32": torch.float32,
    "F64": torch.float64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "I64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class WireError(ValueError):
    """A body that is not a valid message; the text names what is wrong."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UploadHeader:
    """Who sent a pseudo-gradient, against which global version, and its counters."""

    island: str
    rank: int
    world_size: int
    fragment: int
    base_version: int
    step: int
    """The island's inner step at which the pseudo-gradient was taken."""
    tokens: int
    """Tokens the island trained on since it last received this fragment (all ranks)."""
    steps: int
    """Inner steps the island took since it last received this fragment."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FragmentHeader:
    """What a download holds: fragment, version and whose slices."""

    fragment: int
    version: int
    world_size: int
    rank: int


def _header_to_meta(header) -> dict[str, str]:
    return {f.name: str(getattr(header, f.name)) for f in dataclasses.fields(header)}


def _meta_to_header(cls, meta: Mapping[str, str]):
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in meta:
            raise WireError(f"missing metadata field {f.name!r}")
        raw = meta[f.name]
        if f.type == "str":
            if not raw:
                raise WireError(f"metadata field {f.name!r} is empty")
            values[f.name] = raw
            continue
        try:
            values[f.name] = int(raw)
        except ValueError:
            raise WireError(f"metadata field {f.name!r} must be an integer, got {raw!r}") from None
    return cls(**values)


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file of 1-D tensors, written without intermediate copies."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise WireError(f"metadata must map strings to strings, got {dict(metadata)!r}")
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    chunks: list[memoryview] = []
    offset = 0
    for name, t in tensors.items():
        if name == "__metadata__":  # the key of the metadata in the same JSON object
            raise WireError("a tensor cannot be named '__metadata__'")
        if t.dtype not in _DTYPE_NAMES:
            raise WireError(f"tensor {name!r}: dtype {t.dtype} is not supported on the wire")
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        if nbytes:
            chunks.append(memoryview(t.view(-1).view(torch.uint8).numpy()))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    return b"".join([struct.pack("<Q", len(head)), head, *chunks])


def decode(body: bytes | bytearray | memoryview) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Parse a safetensors body; tensors alias ``body`` (read-only: copy before writing)."""
    view = memoryview(body)
    if len(view) < 8:
        raise WireError(
            f"malformed body: {len(view)} bytes is shorter than the 8-byte header length"
        )
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(view):
        raise WireError(
            f"malformed body: header length {hlen} does not fit a {len(view)}-byte body"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"malformed body: header is not JSON ({e})") from None
    except RecursionError:  # e.g. "[[[[...": nested deeper than the parser's stack allows
        raise WireError("malformed body: header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise WireError("malformed body: header is not a JSON object")
    meta = header.pop("__metadata__", None)  # absent or null: no metadata
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WireError("malformed body: __metadata__ must map strings to strings")
    data = view[8 + hlen :]
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise WireError(f"malformed body: bad entry for tensor {name!r}: {info!r}")
        dtype_name = info.get("dtype")
        if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            raise WireError(
                f"tensor {name!r}: dtype {dtype_name!r} is not supported "
                f"(supported: {', '.join(_DTYPES)})"
            )
        shape = _int_list(name, info, "shape")
        offsets = _int_list(name, info, "data_offsets")
        if len(offsets) != 2:
            raise WireError(f"malformed body: tensor {name!r} data_offsets must be [start, end]")
        entries.append((offsets[0], offsets[1], name, _DTYPES[dtype_name], shape))
    # By (start, end), as safetensors does: an empty tensor may share its start with the next.
    entries.sort(key=lambda e: (e[0], e[1]))
    tensors: dict[str, torch.Tensor] = {}
    end_expected = 0
    for start, end, name, dtype, shape in entries:
        numel = 1
        for s in shape:
            if s < 0:
                raise WireError(f"malformed body: tensor {name!r} has a negative dimension")
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if start != end_expected or end - start != numel * itemsize or end > len(data):
            raise WireError(
                f"malformed body: tensor {name!r} offsets [{start}, {end}) do not match its "
                f"shape {shape} and the {len(data)} data bytes"
            )
        end_expected = end
        try:
            tensors[name] = _frombuffer(data[start:end], dtype, numel).view(shape)
        except (RuntimeError, TypeError) as e:  # an empty tensor whose dims overflow int64
            raise WireError(f"malformed body: tensor {name!r} has shape {shape} ({e})") from None
    if end_expected != len(data):
        raise WireError(f"malformed body: {len(data) - end_expected} trailing bytes")
    return meta, tensors


def _int_list(name: str, info: dict, key: str) -> list[int]:
    """``info[key]`` as a list of JSON integers; like safetensors, refuse floats, bools, text."""
    value = info.get(key)
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise WireError(
            f"malformed body: tensor {name!r} {key} must be a list of integers, got {value!r}"
        )
    return value


def _frombuffer(buf: memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
        raise WireError("big-endian hosts are not supported")
    import warnings

    with warnings.catch_warnings():  # frombuffer warns on read-only buffers; we never write them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=numel)


def encode_upload(header: UploadHeader, slices: Mapping[str, torch.Tensor]) -> bytes:
    return encode(slices, _header_to_meta(header))


def decode_upload(body: bytes) -> tuple[UploadHeader, dict[str, torch.Tensor]]:
    meta, tensors = decode(body)
    return _meta_to_header(UploadHeader, meta), tensors


def encode_fragment(header: FragmentHeader, slices: Mapping[str, torch.Tensor]) -> bytes:
    return encode(slices, _header_to_meta(header))


def decode_fragment(body: bytes) -> tuple[FragmentHeader, dict[str, torch.Tensor]]:
    meta, tensors = decode(body)
    return _meta_to_header(FragmentHeader, meta), tensors
