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
import re
import struct
import sys
import warnings
from collections.abc import Collection, Mapping, Sequence

import torch

MAX_HEADER_BYTES = 16 * 1024 * 1024
VERSION_HEADER = "X-DS-Diloco-Version"
"""HTTP header of a download: the fragment's version (also in the body's metadata)."""
OPENED_AGO_HEADER = "X-DS-Diloco-Opened-Ago"
"""HTTP header of a download, when known: seconds since the round that made its version
got its first contribution (an island that applies it instead of sending learns how late
it is, as a stale upload's ``late_s`` tells)."""
FRAGMENT_HEADER = "X-DS-Diloco-Fragment"
"""HTTP header of a download: which fragment it is (``GET /v1/fragments``, the long poll
that answers with a download, says so before its body)."""
VERSIONS_HEADER = "X-DS-Diloco-Versions"
"""HTTP header of a ``304`` from that long poll: every fragment's version, comma-separated."""
_INTEGER = re.compile(r"-?[0-9]{1,4000}")  # longer: int() refuses (its digit limit)
_HEX = re.compile(r"[0-9a-f]{1,4000}")


def keep_mask(names: Sequence[str], keep: Collection[str]) -> str:
    """A download's ``keep`` query: which of the fragment's slices (``names``, in plan
    order) the island holds at its ``after`` version and would keep if unchanged, as a
    hexadecimal bit mask (bit i: ``names[i]``); "" for none."""
    bits = sum(1 << i for i, n in enumerate(names) if n in keep)
    return format(bits, "x") if bits else ""


def parse_keep_mask(raw: str, count: int) -> list[int]:
    """The slice indices of a ``keep`` mask over a fragment of ``count`` slices."""
    if not _HEX.fullmatch(raw):
        raise WireError(f"keep must be a lower-case hexadecimal bit mask, got {raw[:40]!r}")
    bits = int(raw, 16)
    if bits >> count:
        raise WireError(f"keep names slice {bits.bit_length() - 1}, the fragment has {count}")
    return [i for i in range(count) if bits >> i & 1]


_DTYPES = {
    "F32": torch.float32,
    "F64": torch.float64,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "I64": torch.int64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {t: torch.empty((), dtype=t).element_size() for t in _DTYPES.values()}


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
    incarnation: int = 1
    """Which registration of the island sent it (``incarnation`` in the registration's
    reply): an upload from a process the island's later registration superseded is
    refused."""
    run: str = ""
    """The run it belongs to (``run`` in the coordinator's plan): a coordinator whose state
    has no record of the island (its state dir put back from a backup older than the
    registration) takes it as registered only if this is its own run. Optional: omitted
    when empty, and then such an upload is refused as from an unknown island."""
    final: int = 0
    """1: the island's final flush before it leaves for good. The coordinator merges it
    with the fragment's next round that closes (an island that finished waits for no
    result, so it neither makes a quorum nor closes a round), and keeps it when the island
    leaves. Optional: omitted when 0."""
    zeros: str = ""
    """Comma-separated names of the fragment's slices left out of the body because they
    are all zero: frozen parameters, which do not train (the coordinator takes them as
    zeros). Optional: omitted when empty."""

    def __post_init__(self) -> None:
        if self.final not in (0, 1):
            raise WireError(f"metadata field 'final' must be 0 or 1, got {self.final}")

    def zero_names(self) -> list[str]:
        return self.zeros.split(",") if self.zeros else []


SUPERSEDED = "this process was superseded"
"""In the coordinator's refusal of an upload or leave from an earlier incarnation of its island."""
NOT_FINITE = "holds NaN or Inf"
"""In the coordinator's refusal of an upload whose values are not finite: the island's local
model is (its base, the global values, is checked finite on every download)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FragmentHeader:
    """What a download holds: fragment, version and whose slices."""

    fragment: int
    version: int
    world_size: int
    rank: int
    epoch: str = ""
    """The serving coordinator process's id: a download's ``after`` version is comparable
    with its versions only if the island got it from the same one (``unchanged``).
    Optional: omitted when empty."""
    unchanged: str = ""
    """Comma-separated names of slices left out of the body because they hold the same
    values as at the version the island asked ``after`` and it said it keeps them (its
    frozen ones): its base copy already holds them. Optional: omitted when empty."""

    def unchanged_names(self) -> list[str]:
        return self.unchanged.split(",") if self.unchanged else []


_OPTIONAL = {"run": "", "final": 0, "zeros": "", "epoch": "", "unchanged": ""}
"""Header fields added after the first wire version, by their default: omitted when they
hold it, and read as it when omitted (an empty ``run`` too)."""


def _header_to_meta(header) -> dict[str, str]:
    """Every field as a string; an optional field that holds its default is omitted."""
    return {
        f.name: str(getattr(header, f.name))
        for f in dataclasses.fields(header)
        if not (f.name in _OPTIONAL and getattr(header, f.name) == _OPTIONAL[f.name])
    }


def _meta_to_header(cls, meta: Mapping[str, str]):
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in _OPTIONAL and not meta.get(f.name):  # optional: omitted, or empty
            continue
        if f.name not in meta:
            raise WireError(f"missing metadata field {f.name!r}")
        raw = meta[f.name]
        if f.type == "str":
            if not raw:
                raise WireError(f"metadata field {f.name!r} is empty")
            values[f.name] = raw
            continue
        if not _INTEGER.fullmatch(raw):  # int() also takes "1_0", " 5" and other scripts' digits
            raise WireError(f"metadata field {f.name!r} must be an integer, got {raw!r}")
        values[f.name] = int(raw)
    return cls(**values)


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file of 1-D tensors, in one buffer."""
    return bytes(encode_parts(tensors, metadata))


def encode_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Body:
    """A safetensors file of 1-D tensors, as parts that alias the tensors (no copy).

    The tensors must not change until the body has been sent.
    """
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
    return Body([struct.pack("<Q", len(head)), head, *chunks])


class Body:
    """An encoded message as its parts: the header, then views of the tensors' memory.

    The client sends it without joining the parts (``len`` gives Content-Length, then
    each part goes from its memory, once per attempt), so an upload costs no copy of
    the tensors; ``bytes(body)`` joins them where one buffer is needed.
    """

    def __init__(self, parts: list):
        self.parts: list | None = parts
        self.nbytes = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        if self.parts is None:
            raise WireError("body already released after sending: its bytes are gone")
        return b"".join(self.parts)

    def release(self) -> None:
        """Drop the parts (and so the tensors' memory, if nothing else holds it)."""
        self.parts = None


def decode(
    body: bytes | bytearray | memoryview, max_tensors: int | None = None
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Parse a safetensors body; tensors alias ``body`` (read-only: copy before writing).
    ``max_tensors``: refuse a header listing more, before building any (a small body
    listing tens of thousands of empty tensors held the coordinator's loop ~1 s)."""
    view = memoryview(body)
    meta, entries, start = decode_head(view, len(view), max_tensors)
    data = view[start:]
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # frombuffer warns on read-only buffers; we never write them
        warnings.simplefilter("ignore", UserWarning)
        for e in entries:
            try:
                tensors[e.name] = _frombuffer(data[e.start : e.end], e.dtype, e.numel).view(e.shape)
            except (RuntimeError, TypeError) as err:  # an empty tensor whose dims overflow int64
                raise WireError(
                    f"malformed body: tensor {e.name!r} has shape {e.shape} ({err})"
                ) from None
    return meta, tensors


def head_length(first: bytes | bytearray | memoryview, body_len: int) -> int:
    """How many bytes the head of a ``body_len``-byte body takes (its first 8 give it):
    the 8-byte length and the JSON header, after which the tensors' data start."""
    if body_len < 8 or len(first) < 8:
        raise WireError(
            f"malformed body: {body_len} bytes is shorter than the 8-byte header length"
        )
    (hlen,) = struct.unpack("<Q", memoryview(first)[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > body_len:
        raise WireError(f"malformed body: header length {hlen} does not fit a {body_len}-byte body")
    return 8 + hlen


def decode_head(
    head: bytes | bytearray | memoryview, body_len: int, max_tensors: int | None = None
) -> tuple[dict[str, str], list[Entry], int]:
    """The metadata and tensor entries (by data offset) of a ``body_len``-byte body from its
    first bytes (at least :func:`head_length`), checked to tile the rest of the body; and
    where the data start. Lets a body's data be read straight to where they go."""
    start = head_length(head, body_len)
    if len(head) < start:
        raise WireError(f"malformed body: {len(head)} bytes given of a {start}-byte head")
    meta, entries = _parse_header(memoryview(head)[8:start])
    if max_tensors is not None and len(entries) > max_tensors:
        raise WireError(
            f"malformed body: the header lists {len(entries)} tensors, at most {max_tensors} "
            "are expected"
        )
    return meta, _check_layout(entries, body_len - start), start


@dataclasses.dataclass(frozen=True)
class Entry:
    start: int
    end: int
    name: str
    dtype: torch.dtype
    shape: list[int]
    numel: int


def _parse_header(raw: memoryview) -> tuple[dict[str, str], list[Entry]]:
    """The metadata and the tensor entries of a header, sorted by data offset."""
    try:
        header = json.loads(bytes(raw))
    except ValueError as e:  # not JSON, not UTF-8, or an integer past int()'s 4300 digits
        raise WireError(f"malformed body: header is not JSON ({e})") from None
    except RecursionError:  # e.g. "[[[[...": nested deeper than the parser's stack allows
        raise WireError("malformed body: header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise WireError("malformed body: header is not a JSON object")
    meta = header.pop("__metadata__", None)  # absent or null: no metadata
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise WireError("malformed body: __metadata__ must map strings to strings")
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
        numel = 1
        span = 1  # the product of its nonzero dimensions: torch's strides must fit int64
        for d in shape:
            if d < 0:
                raise WireError(f"malformed body: tensor {name!r} has a negative dimension")
            numel *= d
            span *= max(d, 1)
        if span >= _MAX_SPAN:
            raise WireError(f"malformed body: tensor {name!r} has shape {shape}: too large")
        entries.append(Entry(offsets[0], offsets[1], name, _DTYPES[dtype_name], shape, numel))
    # By (start, end), as safetensors does: an empty tensor may share its start with the next.
    entries.sort(key=lambda e: (e.start, e.end))
    return meta, entries


_MAX_SPAN = 2**62
"""Above any tensor's size; an empty tensor's other dimensions are still taken to torch,
whose strides overflow (a shape of [0, 2**64] was a bare 500 from a streamed upload)."""


def _check_layout(entries: list[Entry], data_len: int) -> list[Entry]:
    """The entries, checked to tile ``data_len`` bytes exactly, in order, without gaps."""
    end_expected = 0
    for e in entries:
        itemsize = _ITEMSIZE[e.dtype]
        if e.start != end_expected or e.end - e.start != e.numel * itemsize or e.end > data_len:
            raise WireError(
                f"malformed body: tensor {e.name!r} offsets [{e.start}, {e.end}) do not match "
                f"its shape {e.shape} and the {data_len} data bytes"
            )
        end_expected = e.end
    if end_expected != data_len:
        raise WireError(f"malformed body: {data_len - end_expected} trailing bytes")
    return entries


def read_fragment_into(
    stream, length: int, dest: Mapping[str, torch.Tensor], keep: Collection[str] = ()
) -> tuple[FragmentHeader, dict[str, str]]:
    """Read a download of ``length`` bytes from ``stream`` straight into ``dest``'s memory.

    ``dest`` maps every expected tensor name to a contiguous 1-D tensor of the
    expected dtype and size; the body must hold exactly those but the ones its
    header lists as ``unchanged``, which must be among ``keep`` (the slices the
    request offered to keep). Nothing is buffered, so a body that turns out bad
    has already overwritten part of ``dest``: the caller treats ``dest`` as
    garbage on any error. Returns the header and the metadata.
    """
    head = _read_exact(stream, 8)
    (hlen,) = struct.unpack("<Q", head)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > length:
        raise WireError(f"malformed body: header length {hlen} does not fit a {length}-byte body")
    meta, entries = _parse_header(memoryview(_read_exact(stream, hlen)))
    header = _meta_to_header(FragmentHeader, meta)
    unchanged = header.unchanged_names()
    if not set(unchanged) <= set(keep) or len(set(unchanged)) != len(unchanged):
        raise WireError(
            f"the body leaves out {sorted(set(unchanged) - set(keep))[:4] or unchanged[:4]} as "
            "unchanged: not slices the request offered to keep, or listed twice"
        )
    got, want = {e.name for e in entries}, set(dest) - set(unchanged)
    if got != want:
        raise WireError(f"tensors {sorted(got ^ want)[:4]} missing or unexpected")
    for e in _check_layout(entries, length - 8 - hlen):
        out = dest[e.name]
        if e.dtype != out.dtype or e.numel != out.numel() or len(e.shape) != 1:
            raise WireError(
                f"{e.name}: {e.dtype} of shape {e.shape}, expected {out.dtype} of {out.numel()}"
            )
        if e.numel:
            _readinto(stream, memoryview(out.view(torch.uint8).numpy()))
    if stream.read(1):
        raise WireError(f"malformed body: longer than its {length} bytes")
    return header, meta


def _read_exact(stream, n: int) -> bytes:
    buf = bytearray(n)
    _readinto(stream, memoryview(buf))
    return bytes(buf)


_READ_CHUNK = 1 << 24
"""Bytes asked of the stream per read. Each read takes the GIL back, from a training loop
that holds it: measured with a pure-Python loop beside it, a 94 MiB download read in
1 MiB pieces took ~700 reads and ran at half the rate of 16 MiB pieces (4 vs 9 downloads
in 2 s); plain HTTP reads straight into the destination, so no buffer grows with it."""


def _readinto(stream, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = stream.readinto(view[done : done + _READ_CHUNK])
        if not n:
            raise WireError(f"body ended early: {done} of {len(view)} bytes of a tensor")
        done += n


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
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # callers silence its read-only warning


def encode_upload(header: UploadHeader, slices: Mapping[str, torch.Tensor]) -> bytes:
    return encode(slices, _header_to_meta(header))


def upload_parts(
    header: UploadHeader,
    slices: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> Body:
    """An upload as parts aliasing ``slices``: what the client streams.

    ``metadata``: more entries beside the header's, e.g. how compressed slices are
    encoded (``compress.to_wire``); a key that is a header field is refused.
    """
    meta = _header_to_meta(header)
    clash = sorted(set(meta) & set(metadata or {}))
    if clash:
        raise WireError(f"metadata keys {clash} are upload header fields")
    return encode_parts(slices, {**(metadata or {}), **meta})


def decode_upload_head(
    head: bytes | bytearray | memoryview, body_len: int, max_tensors: int | None = None
) -> tuple[UploadHeader, list[Entry], dict[str, str]]:
    """An upload's header, tensor entries (by data offset) and whole metadata, from the
    body's head (:func:`decode_head`)."""
    meta, entries, _ = decode_head(head, body_len, max_tensors)
    return _meta_to_header(UploadHeader, meta), entries, meta


def decode_upload(body: bytes) -> tuple[UploadHeader, dict[str, torch.Tensor]]:
    header, tensors, _ = decode_upload_with_metadata(body)
    return header, tensors


def decode_upload_with_metadata(
    body: bytes, max_tensors: int | None = None
) -> tuple[UploadHeader, dict[str, torch.Tensor], dict[str, str]]:
    """Like :func:`decode_upload`, plus the whole metadata (compressed slices describe
    themselves there: ``compress.from_wire``)."""
    meta, tensors = decode(body, max_tensors)
    return _meta_to_header(UploadHeader, meta), tensors, meta


def encode_fragment(header: FragmentHeader, slices: Mapping[str, torch.Tensor]) -> bytes:
    return encode(slices, _header_to_meta(header))


def fragment_parts(header: FragmentHeader, slices: Mapping[str, torch.Tensor]) -> Body:
    """A download as parts aliasing ``slices`` (what the coordinator sends); the same
    bytes as :func:`encode_fragment`."""
    return encode_parts(slices, _header_to_meta(header))


def decode_fragment(body: bytes) -> tuple[FragmentHeader, dict[str, torch.Tensor]]:
    meta, tensors = decode(body)
    return _meta_to_header(FragmentHeader, meta), tensors
