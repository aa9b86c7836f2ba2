"""Compressed pseudo-gradients: error bounds, exact sizes, error feedback, refusals.

The coordinator decodes what islands send, so every malformed payload must end
in a ``ValueError`` that names the problem, never in another exception or an
out-of-bounds read; and with error feedback the sum of what is sent must track
the sum of the true pseudo-gradients (checked against a run without it, which
drifts, so the check can fail).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ds_diloco import wire
from ds_diloco.compress import Codec, Encoded, ErrorFeedback, decode, encode, from_wire, to_wire

QMAX = {"int8": 127, "int4": 7}
SIZES = [0, 1, 7, 63, 64, 65, 255, 256, 257, 1001]


def sample(n: int, seed: int = 0, block: int = 64) -> torch.Tensor:
    """Gaussian values whose magnitude changes from block to block (scales differ)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    mag = torch.exp(4 * torch.randn(-(-n // block), generator=g)).repeat_interleave(block)[:n]
    return x * mag


def expected_nbytes(name: str, n: int, block: int) -> int:
    """The sizes as the module docstring documents them, written out independently."""
    blocks = math.ceil(n / block)
    return {
        "none": 4 * n,
        "bf16": 2 * n,
        "int8": n + 4 * blocks,
        "int4": (n + 1) // 2 + 4 * blocks,
    }[name]


def block_of(n: int, block: int) -> torch.Tensor:
    return torch.arange(n) // block


# ------------------------------------------------------------------------ codec spec
def test_codec_from_name_and_defaults():
    c = Codec.from_name("int4")
    assert (c.name, c.block, c.rounding) == ("int4", 256, "nearest")
    assert Codec.from_name("int8", block=128, rounding="stochastic").block == 128


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "int3"}, "codec name: unknown codec 'int3'"),
        ({"name": "int8", "block": 4}, "codec block"),
        ({"name": "int8", "block": 2**21}, "codec block"),
        ({"name": "int8", "block": 64.0}, "codec block"),
        ({"name": "int8", "block": True}, "codec block"),
        ({"name": "int8", "rounding": "up"}, "codec rounding"),
        ({"name": "int4", "residual": "float16"}, "codec residual: must be 'float32' or"),
    ],
)
def test_codec_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Codec(**kwargs)


def test_bytes_per_value():
    assert Codec.from_name("none").bytes_per_value == 4.0
    assert Codec.from_name("bf16").bytes_per_value == 2.0
    assert Codec.from_name("int8").bytes_per_value == 1 + 4 / 256
    assert Codec.from_name("int4").bytes_per_value == 0.515625
    assert Codec.from_name("int4", block=64).bytes_per_value == 0.5625
    for name in ("none", "bf16", "int8", "int4"):  # exact for whole blocks
        c = Codec.from_name(name)
        assert c.encoded_nbytes(256 * 1000) == c.bytes_per_value * 256 * 1000


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4"])
@pytest.mark.parametrize("block", [64, 100])
def test_sizes_are_exactly_as_documented(name, block):
    c = Codec.from_name(name, block=block)
    for n in SIZES:
        enc = encode(sample(n, seed=n), c)
        want = expected_nbytes(name, n, block)
        assert enc.nbytes == want == c.encoded_nbytes(n), (name, n)
        tensors, _ = to_wire({"x": enc})
        assert sum(t.numel() * t.element_size() for t in tensors.values()) == want, (name, n)


# ------------------------------------------------------------------------ round trips
def test_none_is_exact_and_does_not_alias_the_input():
    x = sample(1000)
    enc = encode(x, Codec.from_name("none"))
    x_before = x.clone()
    x.add_(1.0)  # the payload must not see this
    assert torch.equal(decode(enc), x_before)


@pytest.mark.parametrize("n", SIZES)
def test_bf16_is_round_to_nearest_within_half_an_ulp(n):
    # 8 significant bits: half an ulp is at most 2**-8 of the value (at a power of two).
    x = sample(n, seed=1)
    out = decode(encode(x, Codec.from_name("bf16")))
    assert torch.equal(out, x.bfloat16().float())
    assert ((out - x).abs() <= x.abs() * 2.0**-8).all()


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("n", SIZES)
def test_int_round_to_nearest_error_is_at_most_half_a_scale(name, n):
    block, qmax = 64, QMAX[name]
    x = sample(n, seed=2)
    enc = encode(x, Codec.from_name(name, block=block))
    # The scales, recomputed independently: absmax of each block / qmax.
    idx = block_of(n, block)
    absmax = torch.zeros(math.ceil(n / block)).scatter_reduce(0, idx, x.abs(), "amax")
    torch.testing.assert_close(enc.scales, absmax / qmax, rtol=1e-6, atol=0)
    err = (decode(enc) - x).abs()
    bound = enc.scales[idx] / 2 * (1 + 1e-5)
    assert (err <= bound).all(), float((err - bound).max())
    levels = _levels(enc)
    assert levels.abs().max() <= qmax if n else True


def _levels(enc: Encoded) -> torch.Tensor:
    """The integer levels of an int8 / int4 payload."""
    p = enc.payload
    if enc.codec.name == "int8":
        return p.view(torch.int8).long()
    return torch.stack((p & 15, p >> 4), 1).view(-1)[: enc.numel].long() - 8


def test_shape_zero_blocks_and_tail_block():
    x = sample(3 * 100, seed=3).view(3, 100)
    x[1] = 0.0  # block 1 (of 64) is partly zero, the values 128..191 all zero
    x.view(-1)[128:192] = 0.0
    for name in ("none", "bf16", "int8", "int4"):
        enc = encode(x, Codec.from_name(name, block=64))
        out = decode(enc)
        assert out.shape == (3, 100) and out.dtype == torch.float32
        assert (out.view(-1)[128:192] == 0).all()
        if enc.scales is not None:
            assert enc.scales[2] == 0
            assert enc.scales.numel() == 5  # 300 = 4 full blocks + a tail of 44


def test_int4_packing_layout():
    # Block 8, absmax 7 in each block: scale 1, levels are the values themselves.
    x = torch.tensor([7.0, -7, 1, 0, -1, 3, 2, -3, 7, -2, 5])
    enc = encode(x, Codec.from_name("int4", block=8))
    assert enc.scales.tolist() == [1.0, 1.0]
    # Value 2i in the low nibble of byte i, 2i+1 in the high one, stored as q + 8;
    # the odd last value pads its high nibble with 8 (zero).
    q = [v + 8 for v in [7, -7, 1, 0, -1, 3, 2, -3, 7, -2, 5, 0]]
    assert enc.payload.tolist() == [q[i] | q[i + 1] << 4 for i in range(0, 12, 2)]
    assert torch.equal(decode(enc), x)


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4"])
def test_encode_does_not_modify_its_input(name):
    x = sample(1000, seed=4)
    before = x.clone()
    encode(x, Codec.from_name(name, rounding="stochastic"), torch.Generator().manual_seed(0))
    assert torch.equal(x, before)


# ------------------------------------------------------------------ stochastic rounding
@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_stochastic_rounding_is_unbiased_and_round_to_nearest_is_not(name):
    reps, width = 4000, 64
    g = torch.Generator().manual_seed(5)
    base = torch.rand(width, generator=g) * 0.5 + 0.5  # in [0.5, 1): one bf16 ulp is 2**-8
    base[0] = 1.0  # every block has absmax 1: the same scale everywhere
    base[1::2] *= -1
    x = base.repeat(reps)
    step = 2.0**-8 if name == "bf16" else 1.0 / QMAX[name]  # spacing of the levels
    tol = 5 * step / (2 * math.sqrt(reps))  # 5 sigma of a mean of `reps` roundings
    sr = Codec.from_name(name, block=width, rounding="stochastic")
    out = decode(encode(x, sr, torch.Generator().manual_seed(6))).view(reps, width)
    assert ((out - x.view(reps, width)).abs() < step).all()  # one level at most
    assert (out.mean(0) - base).abs().max() <= tol
    # Round-to-nearest repeats the same error: its mean is off, so the check bites.
    rtn = decode(encode(x, Codec.from_name(name, block=width))).view(reps, width)
    assert (rtn.mean(0) - base).abs().max() > 10 * tol


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_stochastic_rounding_is_deterministic_given_a_seed(name):
    x = sample(1000, seed=7)
    c = Codec.from_name(name, rounding="stochastic")
    a = encode(x, c, torch.Generator().manual_seed(1))
    b = encode(x, c, torch.Generator().manual_seed(1))
    other = encode(x, c, torch.Generator().manual_seed(2))
    assert torch.equal(a.payload, b.payload)
    assert not torch.equal(a.payload, other.payload)


# --------------------------------------------------------------------- error feedback
def ef_deltas(steps: int, n: int, block: int, seed: int = 8):
    """Pseudo-gradients whose small entries are always below half a quantisation step.

    Entry 0 of each block is a random +-1, so the scale is 1/qmax; the others are a
    steady 0.02-0.04 that plain round-to-nearest turns into 0 every time for int4
    and rounds the same way every time for int8 and bf16: without error feedback
    that error adds up step after step.
    """
    g = torch.Generator().manual_seed(seed)
    steady = 0.02 + 0.02 * torch.rand(n, generator=g)
    heads = torch.arange(0, n, block)
    for _ in range(steps):
        d = steady.clone()
        d[heads] = torch.randint(0, 2, (len(heads),), generator=g).float() * 2 - 1
        yield d


@pytest.mark.parametrize(
    ("name", "rounding"),
    [("int4", "nearest"), ("int8", "nearest"), ("bf16", "nearest"), ("int4", "stochastic")],
)
def test_error_feedback_sum_sent_tracks_sum_of_true_values(name, rounding):
    steps, n, block = 300, 1000, 64
    codec = Codec.from_name(name, block=block, rounding=rounding)
    ef = ErrorFeedback(codec, seed=3)
    true_sum = torch.zeros(n, dtype=torch.float64)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    plain_sum = torch.zeros(n, dtype=torch.float64)
    idx = block_of(n, block)
    worst_residual = 0.0
    for delta in ef_deltas(steps, n, block):
        enc = ef.compress("frag0/rank0", delta)
        sent = decode(enc)
        true_sum += delta.double()
        sent_sum += sent.double()
        plain_sum += decode(encode(delta, codec, torch.Generator().manual_seed(0))).double()
        residual = ef.residual("frag0/rank0")
        # The sum sent is the true sum less the residual (up to float32 arithmetic) ...
        torch.testing.assert_close(true_sum - sent_sum, residual.double(), rtol=0, atol=1e-4)
        # ... and the residual is one step's quantisation error at most.
        if name == "bf16":
            bound = sent.abs() * 2.0**-8  # half an ulp of the value sent
        else:
            bound = enc.scales[idx] * (0.5 if rounding == "nearest" else 1.0)
        assert (residual.abs() <= bound * (1 + 1e-5) + 1e-7).all()
        worst_residual = max(worst_residual, float(residual.abs().max()))
    gap = (true_sum - sent_sum).abs().max().item()
    assert gap <= worst_residual + 1e-4
    # Without error feedback the steady entries drift away: the bound above is tight enough.
    assert (true_sum - plain_sum).abs().max().item() > 20 * (worst_residual + 1e-4)


def test_error_feedback_with_bfloat16_residuals_keeps_half_the_memory_and_still_tracks_the_sum():
    steps, n, block = 300, 1000, 64
    wide, half = (Codec.from_name("int4", block=block, residual=r) for r in ("float32", "bfloat16"))
    ef, ef32 = ErrorFeedback(half), ErrorFeedback(wide)
    true_sum, sent_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    kept = torch.zeros(n, dtype=torch.float64)  # what the bfloat16 roundings took, in all
    worst = 0.0
    for delta in ef_deltas(steps, n, block):
        before = ef.residual("k")
        x = delta.double() + (before.double() if before is not None else 0.0)
        enc = ef.compress("k", delta)
        ef32.compress("k", delta)
        sent = decode(enc).double()
        true_sum += delta.double()
        sent_sum += sent
        residual = ef.residual("k").double()
        kept += (x - sent) - residual  # the residual before rounding, less the one kept
        # Each rounding is at most 2**-9 of the residual (bfloat16 has 8 significant bits).
        assert ((x - sent) - residual).abs().le((x - sent).abs() * 2.0**-8 + 1e-12).all()
        worst = max(worst, float(residual.abs().max()))
    assert ef.residual("k").dtype == torch.bfloat16 and ef32.residual("k").dtype == torch.float32
    assert ef.residual("k").nbytes * 2 == ef32.residual("k").nbytes
    # The sum sent is the true sum less the residual and the roundings: nothing else lost.
    torch.testing.assert_close(true_sum - sent_sum, residual + kept, rtol=0, atol=1e-4)
    # Those roundings stay far below what plain rounding loses (the fp32 test: > 20x worst).
    assert (true_sum - sent_sum).abs().max().item() <= 2 * worst + 1e-4


def test_error_feedback_puts_back_the_residuals_of_an_upload_that_was_not_taken():
    # An island's upload fails every third time; its base stays, so the next pseudo-
    # gradient carries the lost one's progress again. The residuals from before the lost
    # upload are owed still: put back, the sum delivered stays within one residual of the
    # progress. Forgotten (as the syncer did), each loss added one rounding error per
    # value, and the gap grew as a random walk: about 8x, 15x and 30x the restored one's
    # (mean) at 200, 800 and 3200 uploads.
    n, block = 1000, 64
    ef = ErrorFeedback(Codec.from_name("int4", block=block))
    g = torch.Generator().manual_seed(5)
    progress, delivered = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    pending = torch.zeros(n)
    worst = 0.0
    for i in range(600):
        pending += 0.01 * torch.randn(n, generator=g)
        saved = ef.snapshot(["k"])
        assert saved["k"] is None if i == 0 else torch.equal(saved["k"], ef.residual("k"))
        enc = ef.compress("k", pending)
        if i % 3 == 1:  # not taken: the next upload sends this progress again
            ef.restore(saved)
            assert torch.equal(ef.residual("k"), saved["k"])
            continue
        progress += pending.double()
        delivered += decode(enc).double()
        pending.zero_()
        worst = max(worst, float(ef.residual("k").abs().max()))
        torch.testing.assert_close(
            progress - delivered, ef.residual("k").double(), rtol=0, atol=1e-5
        )
    assert (progress - delivered).abs().max().item() <= worst + 1e-5
    saved = ef.snapshot(["new"])  # a key with no residual yet has none again
    ef.compress("new", pending)
    ef.restore(saved)
    assert ef.residual("new") is None and ef.residual("k") is not None


def test_error_feedback_keeps_one_buffer_per_key_in_place():
    ef = ErrorFeedback(Codec.from_name("int4", block=64))
    a, b = sample(500, seed=9), sample(300, seed=10)
    ef.compress("a", a)
    ef.compress("b", b)
    ptr = ef.residual("a").data_ptr()
    for s in range(5):
        ef.compress("a", sample(500, seed=11 + s))
    assert ef.residual("a").data_ptr() == ptr
    assert ef.residual("a").shape == (500,) and ef.residual("b").shape == (300,)
    assert ef.residual("a").dtype == torch.float32
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset()
    assert ef.residual("b") is None


def test_error_feedback_refuses_nan_and_shape_changes_without_touching_the_residual():
    ef = ErrorFeedback(Codec.from_name("int8", block=64))
    ef.compress("k", sample(200, seed=12))
    kept = ef.residual("k").clone()
    bad = sample(200, seed=13)
    bad[17] = float("nan")
    with pytest.raises(ValueError, match=r"delta for key 'k' holds 1 non-finite.*index 17"):
        ef.compress("k", bad)
    bad[17] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        ef.compress("k", bad)
    with pytest.raises(ValueError, match=r"shape \(100,\).*reset the key"):
        ef.compress("k", sample(100))
    assert torch.equal(ef.residual("k"), kept)


def test_error_feedback_state_dict_resumes_identically():
    codec = Codec.from_name("int4", block=64, rounding="stochastic")
    ef = ErrorFeedback(codec, seed=4)
    for s in range(3):
        ef.compress(("frag", 0), sample(700, seed=20 + s))
        ef.compress(("frag", 1), sample(90, seed=30 + s))
    state = ef.state_dict()
    resumed = ErrorFeedback(codec, seed=99)
    resumed.load_state_dict(state)
    nxt = sample(700, seed=40)
    a, b = ef.compress(("frag", 0), nxt), resumed.compress(("frag", 0), nxt)
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert torch.equal(ef.residual(("frag", 0)), resumed.residual(("frag", 0)))

    with pytest.raises(ValueError, match="uses"):
        ErrorFeedback(Codec.from_name("int8")).load_state_dict(state)
    broken = {**state, "residuals": {"k": torch.tensor([1.0, float("nan")])}}
    with pytest.raises(ValueError, match="residual of key 'k' holds 1 non-finite"):
        ErrorFeedback(codec).load_state_dict(broken)
    with pytest.raises(ValueError, match="malformed"):
        ErrorFeedback(codec).load_state_dict({"codec": {}})
    # Residuals kept in bfloat16 resume as such; float32 ones are refused for that codec.
    half = Codec.from_name("int4", block=64, residual="bfloat16")
    ef16 = ErrorFeedback(half)
    ef16.compress("k", sample(300, seed=50))
    again = ErrorFeedback(half)
    again.load_state_dict(ef16.state_dict())
    assert torch.equal(again.residual("k"), ef16.residual("k"))
    assert again.residual("k").dtype == torch.bfloat16
    wrong = {**ef16.state_dict(), "residuals": {"k": torch.zeros(300)}}
    with pytest.raises(ValueError, match="residual of key 'k' must be a bfloat16 tensor"):
        ErrorFeedback(half).load_state_dict(wrong)


# --------------------------------------------------------------------- input refusals
@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_rejects_non_finite_values(name, bad):
    x = sample(300, seed=14)
    x[130] = bad
    with pytest.raises(ValueError, match=r"input holds 1 non-finite value.*index 130"):
        encode(x, Codec.from_name(name, block=64))


def test_encode_rejects_overflow_and_non_float():
    with pytest.raises(ValueError, match="bfloat16 range"):
        encode(torch.tensor([3.4e38]), Codec.from_name("bf16"))
    with pytest.raises(ValueError, match="floating-point"):
        encode(torch.arange(10), Codec.from_name("int8"))
    with pytest.raises(ValueError, match="decode needs an Encoded"):
        decode(torch.zeros(3))


# ------------------------------------------------------------------------------- wire
HEADER = wire.UploadHeader(
    island="a", rank=0, world_size=2, fragment=1, base_version=3, step=7, tokens=100, steps=4
)


def wire_body(encoded: dict[str, Encoded], plain: dict[str, torch.Tensor] | None = None) -> bytes:
    tensors, meta = to_wire(encoded)
    tensors.update(plain or {})
    header_meta = {k: str(v) for k, v in vars(HEADER).items()}
    return wire.encode(tensors, {**header_meta, **meta})


def test_wire_round_trip_mixed_codecs_and_plain_slices():
    xs = {
        "embed.weight": sample(1000, seed=15),
        "layers.0.mlp.weight": sample(12 * 11, seed=16).view(12, 11),
        "norm.weight": sample(5, seed=17),
    }
    codecs = {"embed.weight": "int4", "layers.0.mlp.weight": "int8", "norm.weight": "bf16"}
    encoded = {k: encode(x, Codec.from_name(codecs[k], block=64)) for k, x in xs.items()}
    plain = {"bias": sample(9, seed=18)}  # an uncompressed slice, as sent today
    body = wire_body(encoded, plain)
    header, tensors = wire.decode_upload(body)
    assert header == HEADER  # the extra metadata does not disturb the header
    meta, tensors = wire.decode(body)
    got = from_wire(tensors, meta)
    assert sorted(got) == sorted([*xs, "bias"])
    for k, enc in encoded.items():
        assert got[k].codec.name == codecs[k]
        assert torch.equal(decode(got[k]), decode(enc))
    assert got["bias"].codec.name == "none"
    assert torch.equal(decode(got["bias"]), plain["bias"])
    assert len(body) < sum(x.numel() for x in xs.values()) * 4 / 2  # actually compressed


def test_to_wire_rejects_names_it_cannot_round_trip():
    enc = encode(sample(10), Codec.from_name("int8"))
    with pytest.raises(ValueError, match="without '#'"):
        to_wire({"a#scales": enc})
    with pytest.raises(ValueError, match="expected an Encoded"):
        to_wire({"a": sample(10)})


def _good() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An int4 slice 'w' of 300 values in blocks of 64 (150 payload bytes, 5 scales)."""
    tensors, meta = to_wire({"w": encode(sample(300, seed=19), Codec.from_name("int4", block=64))})
    return dict(tensors), dict(meta)


def _set(key, value):
    def mutate(t, m):
        (m if isinstance(value, str) else t)[key] = value

    return mutate


def _drop(key):
    def mutate(t, m):
        (m if key in m else t).pop(key)

    return mutate


def _scale(i, v):
    def mutate(t, m):
        s = t["w#scales"].clone()
        s[i] = v
        t["w#scales"] = s

    return mutate


BAD_PAYLOADS = {
    "unknown codec": (_set("w#codec", "int3"), "slice 'w': unknown codec 'int3'"),
    "missing codec": (_drop("w#codec"), "missing w#codec"),
    "missing shape": (_drop("w#shape"), "missing w#shape"),
    "missing block": (_drop("w#block"), "missing w#block"),
    "block not an integer": (_set("w#block", "6x4"), "block '6x4' is not a non-negative"),
    "negative block": (_set("w#block", "-64"), "block '-64' is not"),
    "block out of range": (_set("w#block", "4"), "slice 'w': codec block"),
    "unicode digits": (_set("w#shape", "３００"), "shape '３００' is not"),
    "shape too long": (_set("w#shape", "301"), "payload has 150 elements.*needs 151"),
    "shape too short": (_set("w#shape", "2,100"), "payload has 150 elements.*needs 100"),
    "shape overflows": (_set("w#shape", "0,999999999999999999,99999999999"), "too large"),
    "shape not integers": (_set("w#shape", "1e3"), "shape '1e3' is not"),
    "truncated payload": (lambda t, m: t.update(w=t["w"][:-1]), "payload has 149 elements"),
    "payload dtype": (lambda t, m: t.update(w=t["w"].float()), "1-D torch.uint8"),
    "payload 2-D": (lambda t, m: t.update(w=t["w"].view(2, 75)), "1-D torch.uint8"),
    "missing scales": (_drop("w#scales"), "needs a w#scales tensor"),
    "too few scales": (lambda t, m: t.update({"w#scales": t["w#scales"][:4]}), "scales has 4"),
    "scales dtype": (lambda t, m: t.update({"w#scales": t["w#scales"].half()}), "float32"),
    "stray tensor": (_set("w#extra", torch.zeros(3)), "unexpected tensor 'w#extra'"),
    "scales of nothing": (_set("v#scales", torch.zeros(3)), "unexpected tensor 'v#scales'"),
    "unknown metadata": (_set("w#fancy", "1"), "unknown compression metadata 'w#fancy'"),
    "metadata of nothing": (_set("z#codec", "int8"), "missing tensor 'z'"),
    "scales on bf16": (_set("w#codec", "bf16"), "bf16 takes no scales tensor"),
    "none with bytes": (
        lambda t, m: (m.update({"w#codec": "none"}), t.pop("w#scales")),
        "none payload must be a 1-D torch.float32",
    ),
    "NaN scale": (_scale(2, float("nan")), "scales must be finite and non-negative; block 2"),
    "inf scale": (_scale(3, float("inf")), "block 3 has inf"),
    "negative scale": (_scale(0, -1.0), "block 0 has -1"),
    "overflowing scale": (_scale(1, 3e38), "int4 payload holds .* non-finite"),
}


@pytest.mark.parametrize("case", BAD_PAYLOADS)
def test_bad_payloads_are_refused_with_a_reason(case):
    mutate, match = BAD_PAYLOADS[case]
    tensors, meta = _good()
    mutate(tensors, meta)
    meta2, tensors2 = wire.decode(wire.encode(tensors, meta))  # as the coordinator sees it
    with pytest.raises(ValueError, match=match):
        for enc in from_wire(tensors2, meta2).values():
            decode(enc)


@pytest.mark.parametrize(
    ("name", "dtype"), [("bf16", torch.bfloat16), ("none", torch.float32)], ids=str
)
def test_non_finite_float_payloads_are_refused(name, dtype):
    tensors, meta = to_wire({"w": encode(sample(50), Codec.from_name(name))})
    bad = tensors["w"].clone()
    bad[7] = float("nan")
    (got,) = from_wire({"w": bad}, meta).values()
    with pytest.raises(ValueError, match=f"{name} payload holds 1 non-finite.*index 7"):
        decode(got)
    (plain,) = from_wire({"w": bad.float()}, {}).values()  # uncompressed upload
    with pytest.raises(ValueError, match="non-finite"):
        decode(plain)


def test_direct_construction_is_validated():
    c8 = Codec.from_name("int8", block=64)
    with pytest.raises(ValueError, match="int8 scales must be a 1-D float32 tensor"):
        Encoded(c8, (10,), torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bf16 codec takes no scales"):
        Encoded(Codec.from_name("bf16"), (2,), torch.zeros(2, dtype=torch.bfloat16), torch.ones(1))
    with pytest.raises(ValueError, match="shape must be a tuple"):
        Encoded(c8, [10], torch.zeros(10, dtype=torch.uint8), torch.ones(1))


def test_corrupted_bodies_fail_cleanly():
    """Random byte flips: a clean ValueError or a finite tensor of the declared shape."""
    x = sample(300, seed=21)
    body = bytearray(wire_body({"w": encode(x, Codec.from_name("int4", block=64))}))
    rng = random.Random(0)
    outcomes = {"refused": 0, "decoded": 0}
    for _ in range(300):
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            meta, tensors = wire.decode(bytes(b))
            for enc in from_wire(tensors, meta).values():
                out = decode(enc)
                assert out.shape == enc.shape and torch.isfinite(out).all()
            outcomes["decoded"] += 1
        except ValueError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and outcomes["decoded"] > 0, outcomes
