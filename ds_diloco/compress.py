"""Compressed pseudo-gradients: bf16, int8 and 4-bit codecs with error feedback.

A pseudo-gradient slice is a float32 tensor. A :class:`Codec` turns it into an
:class:`Encoded` (a payload, per-block scales and the shape) and back:

========  ===============================  ====================================
codec     payload                          bytes for ``n`` values (block ``B``)
========  ===============================  ====================================
``none``  float32, a copy                  ``4n``
``bf16``  bfloat16                         ``2n``
``int8``  one signed byte per value        ``n + 4·ceil(n/B)``
``int4``  two values per byte (uint8)      ``ceil(n/2) + 4·ceil(n/B)``
========  ===============================  ====================================

Quantisation is symmetric and blockwise: each run of ``B`` consecutive values
(the last run may be shorter) has one float32 scale ``absmax / qmax`` with
``qmax`` = 127 (int8) or 7 (int4), and a value is stored as ``round(x / scale)``
in ``[-qmax, qmax]``. Symmetric, because pseudo-gradients are centred on zero
and a zero point would cost a second number per block for no accuracy. Scales
are float32, not float16: a pseudo-gradient block can be smaller than float16's
smallest normal (6e-5), and at ``B = 256`` the fp32 scale costs 1/64 of a byte
per value. int4 stores ``q + 8`` in a nibble, value ``2i`` in the low nibble of
byte ``i`` and value ``2i + 1`` in the high one; an odd count pads the last
high nibble.

Rounding defaults to round-to-nearest: the error is at most ``scale / 2`` and,
under :class:`ErrorFeedback`, the residual carries what rounding dropped into
the next step, so the sum of what is sent stays within one step's error of the
sum of the true values. ``rounding="stochastic"`` rounds up with probability
equal to the fraction (unbiased in expectation, error below ``scale``),
deterministic given a ``torch.Generator``; for bf16 it adds random low bits to
the float32 pattern before truncating to the top 16.

Decoding is meant for untrusted bytes (the coordinator decodes what islands
send): every size is checked before any memory is read or allocated and the
result is always finite, otherwise a ``ValueError`` names what is wrong.
:func:`to_wire` / :func:`from_wire` map encoded slices onto the tensors and
string metadata of a safetensors body (``ds_diloco.wire``): the payload keeps
the slice's name, the scales are ``"<name>#scales"`` and the metadata keys
``"<name>#codec"``, ``"<name>#block"``, ``"<name>#shape"``. A tensor without
``#codec`` metadata is a plain float32 slice, so uncompressed bodies still read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping
from typing import Literal

import torch

CodecName = Literal["none", "bf16", "int8", "int4"]
Rounding = Literal["nearest", "stochastic"]
Residual = Literal["float32", "bfloat16"]
_RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CODECS: tuple[str, ...] = ("none", "bf16", "int8", "int4")
RESIDUALS: tuple[str, ...] = tuple(_RESIDUAL_DTYPES)
_QMAX = {"int8": 127, "int4": 7}
"""The largest level encode writes; a decoder may still meet -128 (int8) or -8 (int4)."""
_SCALE_BYTES = 4  # float32 scales
_MIN_BLOCK, _MAX_BLOCK = 8, 1 << 20
_SEP = "#"  # separates a slice name from its scales / metadata suffix on the wire


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec:
    """How a slice is compressed; validated on construction."""

    name: CodecName = "none"
    """``none`` (float32), ``bf16``, ``int8`` or ``int4`` (two values per byte)."""
    block: int = 256
    """Values sharing one float32 scale (int8 / int4 only); ``8 <= block <= 2**20``."""
    rounding: Rounding = "nearest"
    """``nearest`` (error <= scale/2) or ``stochastic`` (unbiased; needs a generator for
    reproducible results). Only the sender needs to know: decoding ignores it."""
    residual: Residual = "float32"
    """How the sender keeps its error-feedback residuals (lossy codecs): ``float32``, or
    ``bfloat16`` for half the memory (the residuals are one more copy of the sender's
    shard: a whole fp32 copy, or half of one). A bfloat16 residual is rounded when kept,
    by at most 2**-9 of itself, which is under half a quantisation step: what is lost per
    step is that much of a rounding error, never a part of the values."""

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"codec name: unknown codec {self.name!r}; choose one of {CODECS}")
        if type(self.block) is not int or not _MIN_BLOCK <= self.block <= _MAX_BLOCK:
            raise ValueError(
                f"codec block: must be an integer in [{_MIN_BLOCK}, {_MAX_BLOCK}], "
                f"got {self.block!r}"
            )
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(
                f"codec rounding: must be 'nearest' or 'stochastic', got {self.rounding!r}"
            )
        if self.residual not in RESIDUALS:
            raise ValueError(
                f"codec residual: must be 'float32' or 'bfloat16', got {self.residual!r}"
            )

    @classmethod
    def from_name(cls, name: str, **overrides) -> Codec:
        """``Codec.from_name("int4")``, ``Codec.from_name("int8", block=128)``."""
        return cls(name=name, **overrides)

    @property
    def quantised(self) -> bool:
        return self.name in _QMAX

    @property
    def bytes_per_value(self) -> float:
        """Bytes per value for a long slice (the scales amortised over a full block)."""
        return {
            "none": 4.0,
            "bf16": 2.0,
            "int8": 1.0 + _SCALE_BYTES / self.block,
            "int4": 0.5 + _SCALE_BYTES / self.block,
        }[self.name]

    def encoded_nbytes(self, numel: int) -> int:
        """Exact bytes of payload plus scales for ``numel`` values."""
        payload = self.payload_numel(numel) * self._payload_itemsize
        return payload + _SCALE_BYTES * self.num_blocks(numel)

    def payload_numel(self, numel: int) -> int:
        return (numel + 1) // 2 if self.name == "int4" else numel

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block) if self.quantised else 0

    @property
    def payload_dtype(self) -> torch.dtype:
        return {"none": torch.float32, "bf16": torch.bfloat16}.get(self.name, torch.uint8)

    @property
    def _payload_itemsize(self) -> int:
        return {"none": 4, "bf16": 2}.get(self.name, 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Encoded:
    """A compressed slice. Construction checks that the sizes agree with the codec.

    ``payload`` is 1-D: float32 (none), bfloat16 (bf16) or uint8 (int8 as two's
    complement bytes, int4 packed); ``scales`` is 1-D float32 with one entry per
    block for int8 / int4 and None otherwise.
    """

    codec: Codec
    shape: tuple[int, ...]
    payload: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        c = self.codec
        if not isinstance(c, Codec):
            raise ValueError(f"codec must be a Codec, got {type(c).__name__}")
        if not isinstance(self.shape, tuple) or not all(
            type(s) is int and s >= 0 for s in self.shape
        ):
            raise ValueError(f"shape must be a tuple of non-negative integers, got {self.shape!r}")
        if math.prod(d for d in self.shape if d) >= 1 << 63:  # strides must fit int64
            raise ValueError(f"shape {list(self.shape)} is too large")
        n = self.numel
        p = self.payload
        if not isinstance(p, torch.Tensor) or p.dtype != c.payload_dtype or p.dim() != 1:
            got = f"{p.dtype} {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p)
            raise ValueError(f"{c.name} payload must be a 1-D {c.payload_dtype} tensor, got {got}")
        if p.numel() != c.payload_numel(n):
            raise ValueError(
                f"{c.name} payload has {p.numel()} elements; shape {list(self.shape)} "
                f"({n} values) needs {c.payload_numel(n)}"
            )
        s = self.scales
        if not c.quantised:
            if s is not None:
                raise ValueError(f"{c.name} codec takes no scales")
            return
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1:
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s)
            raise ValueError(f"{c.name} scales must be a 1-D float32 tensor, got {got}")
        if s.numel() != c.num_blocks(n):
            raise ValueError(
                f"{c.name} scales has {s.numel()} entries; {n} values in blocks of "
                f"{c.block} need {c.num_blocks(n)}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (payload + scales; the metadata strings not counted)."""
        n = self.payload.numel() * self.payload.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * _SCALE_BYTES)


# ----------------------------------------------------------------------- encode
def encode(x: torch.Tensor, codec: Codec, generator: torch.Generator | None = None) -> Encoded:
    """Compress a float tensor (any shape; non-finite values are a ValueError).

    ``generator`` drives stochastic rounding (torch's default generator if None);
    round-to-nearest ignores it. ``x`` is never modified nor aliased.
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"encode needs a floating-point tensor, got {got}")
    shape = tuple(x.shape)
    flat = x.detach().reshape(-1).float()
    stochastic = codec.rounding == "stochastic"
    if codec.name == "none":
        _check_finite(flat, "input")
        return Encoded(codec, shape, flat.clone() if flat.data_ptr() == x.data_ptr() else flat)
    if codec.name == "bf16":
        payload = _to_bf16_stochastic(flat, generator) if stochastic else flat.bfloat16()
        if not _all_finite(payload):
            _check_finite(flat, "input")  # names the bad value; else it overflowed bf16
            raise ValueError("input: a value rounds past the bfloat16 range")
        return Encoded(codec, shape, payload)
    return _quantise(flat, shape, codec, generator)


def _chunks(n: int, block: int):
    """(start, stop, width) runs of whole blocks, about 2**20 values each, then the short
    last block: temporaries stay a few MiB (cache-sized, no page faults on fresh
    64 MiB buffers) and no padded copy of the input is made."""
    step = block * max(1, _CHUNK_VALUES // block)
    full = n // block * block
    for lo in range(0, full, step):
        yield lo, min(lo + step, full), block
    if n > full:
        yield full, n, n - full


_CHUNK_VALUES = 1 << 20


def _quantise(flat: torch.Tensor, shape, codec: Codec, gen) -> Encoded:
    n, b, qmax = flat.numel(), codec.block, _QMAX[codec.name]
    q = torch.empty(n, dtype=torch.int8, device=flat.device)
    scales = torch.empty(codec.num_blocks(n), dtype=torch.float32, device=flat.device)
    for lo, hi, width in _chunks(n, b):
        xb = flat[lo:hi].view(-1, width)
        # amax and amin propagate NaN, and inf gives an inf scale: no separate finite
        # check of the input. (aminmax(dim=1) is several times slower on CPU.)
        s = torch.maximum(xb.amax(1), xb.amin(1).neg_()).div_(qmax)
        if not _all_finite(s):
            _check_finite(flat, "input")
            raise ValueError("input: a block's absmax overflows the float32 scale")
        scales[lo // b : lo // b + xb.shape[0]] = s
        t = xb / torch.where(s > 0, s, 1.0).unsqueeze(1)  # an all-zero block keeps scale 0
        if codec.rounding == "stochastic":
            t.add_(torch.rand(t.shape, generator=gen, device=t.device)).floor_()
        else:
            t.round_()  # half to even
        t.clamp_(-qmax, qmax)  # x/scale may exceed qmax by an ulp
        q[lo:hi].view(-1, width).copy_(t)
    if codec.name == "int8":
        return Encoded(codec, shape, q.view(torch.uint8), scales)
    u = q.add_(8).view(torch.uint8)  # 1..15
    if n % 2:
        u = torch.cat([u, u.new_full((1,), 8)])
    pairs = u.view(-1, 2)
    packed = pairs[:, 1] << 4
    packed |= pairs[:, 0]
    return Encoded(codec, shape, packed, scales)


def _to_bf16_stochastic(flat: torch.Tensor, gen) -> torch.Tensor:
    # Add uniform noise below bf16's last bit to the float32 bit pattern, then drop
    # the low 16 bits: the magnitude rounds up with probability equal to the
    # dropped fraction. Finite inputs cannot carry into the sign bit.
    bits = torch.randint(
        0, 1 << 16, flat.shape, generator=gen, dtype=torch.int32, device=flat.device
    )
    bits += flat.contiguous().view(torch.int32)
    bits &= -(1 << 16)
    return bits.view(torch.float32).bfloat16()


def _all_finite(t: torch.Tensor) -> bool:
    """One pass, no temporary: min and max are finite only if every value is (NaN propagates)."""
    if t.numel() == 0:
        return True
    mn, mx = torch.aminmax(t)
    return bool(torch.isfinite(mn) & torch.isfinite(mx))


def _check_finite(t: torch.Tensor, what: str) -> None:
    if _all_finite(t):
        return
    idx = (~torch.isfinite(t)).reshape(-1).nonzero()
    first = int(idx[0, 0])
    raise ValueError(
        f"{what} holds {idx.shape[0]} non-finite value(s) (NaN or Inf); "
        f"first at flat index {first}: {float(t.reshape(-1)[first])}"
    )


# ----------------------------------------------------------------------- decode
def decode(enc: Encoded) -> torch.Tensor:
    """The float32 tensor of ``enc.shape``; ValueError if the payload is malformed.

    Safe on untrusted data: sizes were checked when ``enc`` was built, and here
    scales must be finite and non-negative and the result finite.
    """
    if not isinstance(enc, Encoded):
        raise ValueError(f"decode needs an Encoded, got {type(enc).__name__}")
    c = enc.codec
    if c.quantised:
        s = enc.scales
        if s.numel() and not bool((s >= 0).all() & torch.isfinite(s).all()):  # NaN fails >= 0
            bad = int((~((s >= 0) & torch.isfinite(s))).nonzero()[0, 0])
            raise ValueError(
                f"{c.name} scales must be finite and non-negative; block {bad} has {float(s[bad])}"
            )
    out = _dequantise(enc)
    # int8/int4 levels reach 128 at most: only scales that large can overflow.
    if not c.quantised or (enc.scales.numel() and float(enc.scales.max()) * 128 > _F32_MAX):
        _check_finite(out, f"{c.name} payload")
    return out


_F32_MAX = torch.finfo(torch.float32).max


def _dequantise(enc: Encoded) -> torch.Tensor:
    """Decode without value checks (for payloads we made ourselves)."""
    c, n = enc.codec, enc.numel
    if c.name == "none":
        return enc.payload.clone().view(enc.shape)
    if c.name == "bf16":
        return enc.payload.float().view(enc.shape)
    p = enc.payload
    if c.name == "int8":
        q = p.view(torch.int8)
    else:
        u = torch.stack((p & 15, p >> 4), dim=1).view(-1).view(torch.int8)
        q = u.sub_(8)[:n]
    out = torch.empty(n, dtype=torch.float32, device=p.device)
    b = c.block
    for lo, hi, width in _chunks(n, b):
        o = out[lo:hi].view(-1, width)
        o.copy_(q[lo:hi].view(-1, width))  # int8 -> float32, then one in-place scale
        o.mul_(enc.scales[lo // b : lo // b + o.shape[0]].unsqueeze(1))
    return out.view(enc.shape)


# --------------------------------------------------------------- error feedback
class ErrorFeedback:
    """Per-key quantisation residuals, added to the next value of the same key.

    A key names one slice that is compressed repeatedly (e.g. ``(fragment, rank,
    tensor name)``). ``compress`` sends ``encode(delta + residual)`` and keeps
    ``residual = delta + residual - decode(sent)``, so the sum of everything sent
    for a key equals the sum of the deltas minus the current residual: the
    quantisation error does not accumulate. Memory: one float32 buffer per key,
    updated in place; a step allocates only encode's and decode's temporaries. With
    ``codec.residual == "bfloat16"`` the buffer is bfloat16 (half the memory) and a step
    also takes a float32 temporary of the key's size; the sum sent then tracks the sum
    of the deltas within the residual plus the bfloat16 roundings of the residuals kept.
    """

    def __init__(self, codec: Codec, *, seed: int = 0) -> None:
        if not isinstance(codec, Codec):
            raise ValueError(f"codec must be a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.seed = seed
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._generators: dict[str, torch.Generator] = {}  # one per device, for stochastic

    def compress(self, key: Hashable, delta: torch.Tensor) -> Encoded:
        """Encode ``delta`` plus this key's residual; the residual is unchanged on error."""
        if not isinstance(delta, torch.Tensor) or not delta.dtype.is_floating_point:
            raise ValueError(f"delta for key {key!r} must be a floating-point tensor")
        r = self._residuals.get(key)
        if r is not None and (r.shape != delta.shape or r.device != delta.device):
            raise ValueError(
                f"delta for key {key!r} has shape {tuple(delta.shape)} on {delta.device}; "
                f"its residual has {tuple(r.shape)} on {r.device} (reset the key if it changed)"
            )
        _check_finite(delta, f"delta for key {key!r}")
        if r is None:
            dtype = _RESIDUAL_DTYPES[self.codec.residual]
            r = torch.zeros(delta.shape, dtype=dtype, device=delta.device)
            self._residuals[key] = r
        # float32: summed in place in the residual; bfloat16: in a float32 temporary.
        x = r.add_(delta) if r.dtype == torch.float32 else delta.to(torch.float32) + r
        try:
            enc = encode(x, self.codec, self._generator(r.device))
        except ValueError:
            r.zero_()  # delta + residual overflowed float32: nothing sensible to keep
            raise
        x.sub_(_dequantise(enc))
        if x is not r:
            r.copy_(x)  # rounded to bfloat16
        return enc

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The kept residual of ``key`` (a live buffer: do not modify), or None."""
        return self._residuals.get(key)

    def snapshot(self, keys) -> dict:
        """Copies of ``keys``' residuals (None: no residual yet), for :meth:`restore`.

        Taken before compressing an upload: if it is not delivered, the residuals it
        took go back. Forgetting them instead lost one rounding error per value at
        every undelivered upload, and those losses added up (a random walk).
        """
        return {k: None if (r := self._residuals.get(k)) is None else r.clone() for k in keys}

    def restore(self, saved: Mapping) -> None:
        """Put back the residuals of a :meth:`snapshot` (None: forget the key's)."""
        for k, r in saved.items():
            if r is None:
                self._residuals.pop(k, None)
            else:
                self._residuals[k] = r

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key`` (of every key if None), freeing its buffer."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    def state_dict(self) -> dict:
        return {
            "codec": dataclasses.asdict(self.codec),
            "seed": self.seed,
            "residuals": {k: r.clone() for k, r in self._residuals.items()},
            "generators": {d: g.get_state() for d, g in self._generators.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore residuals and RNG state; the codec must match, residuals be finite."""
        try:
            codec = Codec(**state["codec"])
            residuals = dict(state["residuals"])
            generators = dict(state.get("generators", {}))
            seed = int(state["seed"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"error-feedback state is malformed ({e!r})") from None
        if codec != self.codec:
            raise ValueError(f"error-feedback state is for {codec}, this one uses {self.codec}")
        dtype = _RESIDUAL_DTYPES[codec.residual]
        for k, r in residuals.items():
            if not isinstance(r, torch.Tensor) or r.dtype != dtype:
                raise ValueError(f"residual of key {k!r} must be a {codec.residual} tensor")
            _check_finite(r, f"residual of key {k!r}")
        self.seed = seed
        self._residuals = {k: r.clone() for k, r in residuals.items()}
        self._generators = {}
        for d, s in generators.items():
            self._generator(torch.device(d)).set_state(s)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.codec.rounding != "stochastic":
            return None
        g = self._generators.get(str(device))
        if g is None:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[str(device)] = g
        return g


# ------------------------------------------------------------------------- wire
def to_wire(slices: Mapping[str, Encoded]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata for ``wire.encode`` (merge the metadata with a header's).

    Payloads go as int8 when quantised (the wire has no uint8; the bytes are the same).
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for name, enc in slices.items():
        if not isinstance(name, str) or not name or _SEP in name:
            raise ValueError(f"slice name must be a non-empty string without {_SEP!r}: {name!r}")
        if not isinstance(enc, Encoded):
            raise ValueError(f"slice {name!r}: expected an Encoded, got {type(enc).__name__}")
        c = enc.codec
        p = enc.payload.cpu()
        tensors[name] = p.view(torch.int8) if p.dtype == torch.uint8 else p
        if c.quantised:
            tensors[name + _SEP + "scales"] = enc.scales.cpu()
            meta[name + _SEP + "block"] = str(c.block)
        meta[name + _SEP + "codec"] = c.name
        meta[name + _SEP + "shape"] = ",".join(map(str, enc.shape))
    return tensors, meta


def from_wire(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> dict[str, Encoded]:
    """The encoded slices of a decoded body; ValueError naming the first inconsistency.

    Metadata keys without ``#`` (the upload header's) are ignored. A tensor with no
    ``#codec`` entry is a plain float32 slice of its own shape (codec ``none``).
    """
    extra: dict[str, dict[str, str]] = {}
    for key, value in metadata.items():
        if _SEP not in key:
            continue
        name, _, field = key.rpartition(_SEP)
        if field not in ("codec", "block", "shape"):
            raise ValueError(f"unknown compression metadata {key!r}")
        if name not in tensors:
            raise ValueError(f"metadata {key!r} refers to a missing tensor {name!r}")
        extra.setdefault(name, {})[field] = value
    for name in tensors:
        if _SEP in name:
            base, _, suffix = name.rpartition(_SEP)
            if suffix != "scales" or base not in tensors:
                raise ValueError(f"unexpected tensor {name!r}")
    return {
        name: _slice_from_wire(name, t, extra.get(name), tensors.get(name + _SEP + "scales"))
        for name, t in tensors.items()
        if _SEP not in name
    }


def _slice_from_wire(name, payload, meta, scales) -> Encoded:
    if meta is None:  # an uncompressed slice
        if scales is not None:
            raise ValueError(f"slice {name!r}: missing {name + _SEP}codec metadata for its scales")
        return Encoded(Codec(), tuple(payload.shape), payload.reshape(-1), None)
    try:
        cname = meta["codec"]
        if cname not in CODECS:
            raise ValueError(f"slice {name!r}: unknown codec {cname!r}; known: {CODECS}")
        shape_text = meta.get("shape")
        if shape_text is None:
            raise ValueError(f"slice {name!r}: missing {name + _SEP}shape metadata")
        shape = (
            tuple(_parse_int(name, "shape", s) for s in shape_text.split(",")) if shape_text else ()
        )
        block = 256
        if cname in _QMAX:
            if "block" not in meta:
                raise ValueError(f"slice {name!r}: missing {name + _SEP}block metadata")
            block = _parse_int(name, "block", meta["block"])
    except KeyError:
        raise ValueError(f"slice {name!r}: missing {name + _SEP}codec metadata") from None
    try:
        codec = Codec(name=cname, block=block)
    except ValueError as e:
        raise ValueError(f"slice {name!r}: {e}") from None
    if codec.quantised:
        if scales is None:
            raise ValueError(f"slice {name!r}: {cname} needs a {name + _SEP}scales tensor")
        if isinstance(payload, torch.Tensor) and payload.dtype == torch.int8:
            payload = payload.view(torch.uint8)
    elif scales is not None:
        raise ValueError(f"slice {name!r}: {cname} takes no scales tensor")
    try:
        return Encoded(codec, shape, payload, scales)
    except ValueError as e:
        raise ValueError(f"slice {name!r}: {e}") from None


def _parse_int(name: str, field: str, text: str) -> int:
    # ASCII digits only (str.isdigit alone takes "³"), no sign, small enough for int64.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise ValueError(f"slice {name!r}: {field} {text!r} is not a non-negative integer")
    return int(text)
