"""The wire format against the ``safetensors`` library, and its refusals.

Bodies come from islands over the network, so every malformed one must end in a
``WireError`` (a 400 for the sender), never in another exception (a 500, or a
crashed handler); and what we write must be a file any safetensors reader opens.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ds_diloco import wire
from ds_diloco.wire import FragmentHeader, UploadHeader, WireError

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int64]
META = {"island": "a", "note": "ünïcode ✓", "empty": ""}


def sample(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)  # the full range: I64 values beyond 2**53 catch a float detour
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def raw_body(header: dict | bytes, data: bytes = b"") -> bytes:
    """A body with exactly this header (a dict, or raw JSON bytes) and data."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def read_with_safe_open(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


# --------------------------------------------------------------- encode -> safetensors
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_is_read_by_safetensors(dtype, tmp_path):
    tensors = {
        "flat": sample(dtype, (37,), seed=1),
        "matrix": sample(dtype, (3, 5), seed=2),
        "scalar": sample(dtype, (), seed=3),
    }
    body = wire.encode(tensors, META)

    assert_same(st_load(body), tensors)
    path = tmp_path / "x.safetensors"
    path.write_bytes(body)
    meta, loaded = read_with_safe_open(path)
    assert meta == META
    assert_same(loaded, tensors)
    # The format aligns the data to 8 bytes, so that F64/I64 tensors can be mapped in place.
    assert (8 + struct.unpack("<Q", body[:8])[0]) % 8 == 0


def test_encode_mixed_dtypes_and_empty_tensors(tmp_path):
    tensors = {
        "empty_first": torch.zeros(0, dtype=torch.float16),
        "a": sample(torch.int8, (3,)),  # odd byte count: the next tensor starts unaligned
        "empty_mid": torch.zeros(0, 4, dtype=torch.float64),
        "b": sample(torch.float64, (5,)),
        "c": sample(torch.bfloat16, (7,)),
        "empty_last": torch.zeros(2, 0, dtype=torch.int64),
    }
    body = wire.encode(tensors, META)
    assert_same(st_load(body), tensors)
    path = tmp_path / "x.safetensors"
    path.write_bytes(body)
    meta, loaded = read_with_safe_open(path)
    assert meta == META
    assert_same(loaded, tensors)
    assert_same(wire.decode(body)[1], tensors)


def test_encode_only_empty_tensors_and_no_metadata(tmp_path):
    tensors = {"e": torch.zeros(0), "f": torch.zeros(0, 3, dtype=torch.int64)}
    body = wire.encode(tensors, {})
    assert_same(st_load(body), tensors)
    meta, got = wire.decode(body)
    assert meta == {}
    assert_same(got, tensors)
    assert wire.decode(wire.encode({}, {})) == ({}, {})


def test_encode_views_writes_only_the_viewed_elements():
    """Slices of the global tensors go on the wire as they are: the encoder must write
    the view's own elements, not its storage from offset 0 or the whole storage."""
    big = torch.arange(120, dtype=torch.float32)
    grid = big.view(10, 12)
    before = big.clone()
    views = {
        "slice": big[17:41],  # contiguous, storage offset 17
        "row": grid[3],  # contiguous, storage offset 36
        "column": grid[:, 5],  # stride 12
        "transposed": grid[2:5, 1:4].t(),  # non-contiguous 2-D
        "stepped": big[1::7],
        "expanded": big[3:4].expand(6),  # stride 0
        "bf16_view": big.to(torch.bfloat16)[50:60:3],
    }
    assert not views["column"].is_contiguous()
    body = wire.encode(views, {"k": "v"})

    want = {k: v.clone() for k, v in views.items()}
    assert_same(st_load(body), want)
    assert_same(wire.decode(body)[1], want)
    assert torch.equal(big, before)  # encoding never writes into the source


def test_encode_many_tensors(tmp_path):
    rng = random.Random(0)
    tensors = {}
    for i in range(300):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (rng.randrange(0, 9),) if i % 5 else (rng.randrange(1, 4), rng.randrange(0, 4))
        tensors[f"model.layers.{i}.w"] = sample(dtype, shape, seed=i)
    meta = {f"key{i}": str(i) for i in range(50)}
    body = wire.encode(tensors, meta)

    assert_same(st_load(body), tensors)
    path = tmp_path / "many.safetensors"
    path.write_bytes(body)
    got_meta, loaded = read_with_safe_open(path)
    assert got_meta == meta
    assert_same(loaded, tensors)
    got_meta, decoded = wire.decode(body)
    assert got_meta == meta
    assert_same(decoded, tensors)


def test_encode_refuses_what_no_reader_could_parse():
    with pytest.raises(WireError, match=r"dtype torch\.bool is not supported"):
        wire.encode({"mask": torch.ones(2, dtype=torch.bool)}, {})
    with pytest.raises(WireError, match="strings to strings"):
        wire.encode({"a": torch.ones(1)}, {"rank": 1})  # type: ignore[dict-item]
    with pytest.raises(WireError, match="'__metadata__'"):
        wire.encode({"__metadata__": torch.ones(1)}, {})


# --------------------------------------------------------------- safetensors -> decode
def test_decode_reads_safetensors_save_exactly():
    tensors = {
        f"{str(dtype).removeprefix('torch.')}_{i}": sample(dtype, shape, seed=i)
        for i, (dtype, shape) in enumerate(
            (d, s) for d in DTYPES for s in [(11,), (2, 3), (), (0,), (4, 0, 2)]
        )
    }
    meta = {"fragment": "3", "version": "17", "text": "a b\nc"}
    body = st_save(tensors, metadata=meta)
    got_meta, got = wire.decode(body)
    assert got_meta == meta
    assert_same(got, tensors)


def test_decode_without_metadata_and_with_null_metadata():
    t = {"x": torch.arange(4, dtype=torch.int64)}
    assert wire.decode(st_save(t))[0] == {}
    body = raw_body(
        {"__metadata__": None, "x": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}},
        b"\x01\x02",
    )
    meta, got = wire.decode(body)
    assert meta == {}
    assert got["x"].tolist() == [1, 2]


def test_decode_empty_tensor_listed_after_one_with_the_same_start():
    """Valid for safetensors (it orders by (start, end)); a sort by start alone refused it."""
    body = raw_body(
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F64", "shape": [0], "data_offsets": [0, 0]},
        },
        struct.pack("<f", 1.5),
    )
    want = st_load(body)
    _, got = wire.decode(body)
    assert_same(got, want)


# --------------------------------------------------------------- headers
UPLOAD = UploadHeader(
    island="island-ä/1",
    rank=3,
    world_size=8,
    fragment=5,
    base_version=12,
    step=2**40,
    tokens=10**15,
    steps=24,
)
FRAGMENT = FragmentHeader(fragment=7, version=99, world_size=4, rank=0)


def test_upload_header_round_trip(tmp_path):
    slices = {"w": sample(torch.float32, (6,))}
    body = wire.encode_upload(UPLOAD, slices)
    header, got = wire.decode_upload(body)
    assert header == UPLOAD
    assert_same(got, slices)
    # Any language can read the header: it is plain safetensors metadata.
    path = tmp_path / "upload.safetensors"
    path.write_bytes(body)
    meta, _ = read_with_safe_open(path)
    assert meta == upload_meta()  # every field but the optional ones at their defaults


def test_fragment_header_round_trip():
    slices = {"w": sample(torch.float32, (6,)), "e": torch.zeros(0)}
    header, got = wire.decode_fragment(wire.encode_fragment(FRAGMENT, slices))
    assert header == FRAGMENT
    assert_same(got, slices)


def test_a_download_reads_into_dest_and_leaves_the_unchanged_slices_kept_as_they_are():
    dest = {"a": torch.zeros(3), "b": torch.full((2,), 7.0), "c": torch.zeros(1)}
    sent = {"a": torch.tensor([1.0, 2.0, 3.0]), "c": torch.tensor([4.0])}
    header = dataclasses.replace(FRAGMENT, epoch="e1", unchanged="b")
    body = wire.encode_fragment(header, sent)
    got, _ = wire.read_fragment_into(io.BytesIO(body), len(body), dest, keep={"b"})
    assert got == header and got.unchanged_names() == ["b"]
    assert_same(dest, {**sent, "b": torch.full((2,), 7.0)})  # "b" is what it was
    for keep, message in [((), r"leaves out \['b'\] as unchanged"), ({"a", "b"}, "")]:
        if message:  # left out, though the request did not offer to keep it
            with pytest.raises(wire.WireError, match=message):
                wire.read_fragment_into(io.BytesIO(body), len(body), dest, keep=keep)
        else:  # offered, but the answer may send it all the same
            wire.read_fragment_into(io.BytesIO(body), len(body), dest, keep=keep)
    twice = wire.encode_fragment(dataclasses.replace(header, unchanged="b,b"), sent)
    with pytest.raises(wire.WireError, match="listed twice"):
        wire.read_fragment_into(io.BytesIO(twice), len(twice), dest, keep={"b"})


@pytest.mark.parametrize("hlen", [2**64 - 1, wire.MAX_HEADER_BYTES + 1, 100])
def test_a_download_whose_header_length_does_not_fit_is_refused_before_it_is_read(hlen):
    # Without the check the header's buffer was allocated at its stated length: 2**64-1
    # raised OverflowError (not a WireError), 16 MiB was allocated for a 10-byte body.
    body = struct.pack("<Q", hlen) + b"{}"
    with pytest.raises(wire.WireError, match=rf"header length {hlen} does not fit a 10-byte"):
        wire.read_fragment_into(io.BytesIO(body), len(body), {"a": torch.zeros(3)})


def test_keep_masks_round_trip_and_a_bad_one_is_named():
    names = [f"t{i}" for i in range(70)]
    for keep in ({"t0"}, {"t3", "t69"}, set(names)):
        mask = wire.keep_mask(names, keep)
        assert {names[i] for i in wire.parse_keep_mask(mask, len(names))} == keep
    assert wire.keep_mask(names, ()) == "" and wire.keep_mask(names, {"other"}) == ""
    for raw, message in [("", "hexadecimal"), ("0x1", "hexadecimal"), ("AB", "hexadecimal"),
                         ("8", "names slice 3, the fragment has 3")]:  # fmt: skip
        with pytest.raises(wire.WireError, match=message):
            wire.parse_keep_mask(raw, 3)


OPTIONAL = {"run": "", "final": 0, "zeros": ""}  # omitted at these values


def upload_meta(**changes) -> dict[str, str]:
    meta = {
        k: str(v)
        for k, v in dataclasses.asdict(UPLOAD).items()
        if k not in OPTIONAL or v != OPTIONAL[k]
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


REQUIRED = [f.name for f in dataclasses.fields(UploadHeader) if f.name not in OPTIONAL]


def test_an_upload_may_say_its_run_and_omits_it_when_it_has_none():
    with_run = dataclasses.replace(UPLOAD, run="0123456789abcdef")
    header, _ = wire.decode_upload(wire.encode_upload(with_run, {"w": torch.ones(1)}))
    assert header == with_run
    body = wire.encode_upload(UPLOAD, {"w": torch.ones(1)})
    assert "run" not in wire.decode_upload_with_metadata(body)[2]  # not sent as an empty field
    assert wire.decode_upload(body)[0] == UPLOAD and UPLOAD.run == ""
    empty = wire.encode({"w": torch.ones(1)}, upload_meta(run=""))  # sent empty: none either
    assert wire.decode_upload(empty)[0] == UPLOAD
    assert "run" not in REQUIRED and "incarnation" in REQUIRED


def test_an_upload_names_the_zero_slices_it_left_out_and_others_omit_it():
    frozen = dataclasses.replace(UPLOAD, zeros="model.embed_tokens.weight,lm_head.weight")
    header, _ = wire.decode_upload(wire.encode_upload(frozen, {"w": torch.ones(1)}))
    assert header == frozen
    assert header.zero_names() == ["model.embed_tokens.weight", "lm_head.weight"]
    body = wire.encode_upload(UPLOAD, {"w": torch.ones(1)})
    assert "zeros" not in wire.decode_upload_with_metadata(body)[2]
    assert wire.decode_upload(body)[0].zero_names() == []


def test_a_final_flush_upload_says_so_and_others_omit_it():
    final = dataclasses.replace(UPLOAD, final=1)
    body = wire.encode_upload(final, {"w": torch.ones(1)})
    assert wire.decode_upload_with_metadata(body)[2]["final"] == "1"
    assert wire.decode_upload(body)[0] == final
    assert (
        "final"
        not in wire.decode_upload_with_metadata(wire.encode_upload(UPLOAD, {"w": torch.ones(1)}))[2]
    )
    for bad in ("2", "-1", "yes"):
        body = wire.encode({"w": torch.ones(1)}, upload_meta(final=bad))
        with pytest.raises(WireError, match="'final' must be"):
            wire.decode_upload(body)


@pytest.mark.parametrize("field", REQUIRED)
def test_upload_missing_field_is_named(field):
    body = wire.encode({"w": torch.ones(1)}, upload_meta(**{field: None}))
    with pytest.raises(WireError, match=f"missing metadata field '{field}'"):
        wire.decode_upload(body)


@pytest.mark.parametrize("field", ["rank", "world_size", "fragment", "base_version", "steps"])
@pytest.mark.parametrize("value", ["one", "1.5", "", "0x10"])
def test_upload_non_integer_field_is_named(field, value):
    body = wire.encode({"w": torch.ones(1)}, upload_meta(**{field: value}))
    with pytest.raises(WireError, match=f"metadata field '{field}' must be an integer"):
        wire.decode_upload(body)


def test_upload_empty_island_is_refused():
    body = wire.encode({"w": torch.ones(1)}, upload_meta(island=""))
    with pytest.raises(WireError, match="metadata field 'island' is empty"):
        wire.decode_upload(body)


def test_fragment_header_fields_are_checked():
    meta = {k: str(v) for k, v in dataclasses.asdict(FRAGMENT).items()}
    del meta["version"]
    with pytest.raises(WireError, match="missing metadata field 'version'"):
        wire.decode_fragment(wire.encode({}, meta))
    with pytest.raises(WireError, match="metadata field 'rank' must be an integer"):
        wire.decode_fragment(wire.encode({}, {**meta, "version": "1", "rank": "r0"}))
    # An upload is not a download: the fragment header's 'version' is missing from it.
    with pytest.raises(WireError, match="'version'"):
        wire.decode_fragment(wire.encode_upload(UPLOAD, {}))


# --------------------------------------------------------------- malformed bodies
F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
FOUR = b"\0\0\x80\x3f"

MALFORMED = {
    "empty body": (b"", "0 bytes is shorter than the 8-byte header length"),
    "7 bytes": (b"\x02\0\0\0\0\0\0", "7 bytes is shorter than the 8-byte header length"),
    "header beyond body": (struct.pack("<Q", 100) + b"{}", "header length 100 does not fit"),
    "header length 2**64-1": (b"\xff" * 8 + b"{}", "does not fit a 10-byte body"),
    "header beyond limit": (
        struct.pack("<Q", wire.MAX_HEADER_BYTES + 1) + b" " * (wire.MAX_HEADER_BYTES + 1),
        "does not fit",
    ),
    "not JSON": (raw_body(b"{nope"), "header is not JSON"),
    "not UTF-8": (raw_body(b'{"\xff\xfe":1}'), "header is not JSON"),
    "NaN in JSON": (raw_body(b'{"a":NaN}'), "bad entry for tensor 'a'"),
    "deeply nested": (raw_body(b"[" * 100_000), "nested too deeply"),
    "header is a list": (raw_body(b"[]"), "header is not a JSON object"),
    "header is a number": (raw_body(b"3"), "header is not a JSON object"),
    "entry not an object": (raw_body({"a": 5}), "bad entry for tensor 'a'"),
    "overlap": (
        raw_body(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            FOUR * 2,
        ),
        r"tensor 'b' offsets \[4, 8\) do not match",
    ),
    "same offsets twice": (
        raw_body({"a": F32_1, "b": F32_1}, FOUR),
        r"offsets \[0, 4\) do not match",
    ),
    "gap": (
        raw_body(
            {"a": F32_1, "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}},
            FOUR * 3,
        ),
        r"tensor 'b' offsets \[8, 12\) do not match",
    ),
    "gap at the start": (
        raw_body({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, FOUR * 2),
        r"tensor 'a' offsets \[4, 8\)",
    ),
    "shape larger than offsets": (
        raw_body({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, FOUR * 2),
        r"tensor 'a' offsets \[0, 8\) do not match its shape \[3\]",
    ),
    "dtype wider than offsets": (
        raw_body({"a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 4]}}, FOUR),
        r"tensor 'a' offsets \[0, 4\) do not match",
    ),
    "offsets beyond the data": (
        raw_body({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, FOUR),
        "and the 4 data bytes",
    ),
    "negative start": (
        raw_body({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, FOUR),
        r"tensor 'a' offsets \[-4, 0\)",
    ),
    "unsupported dtype": (
        raw_body({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
        "tensor 'a': dtype 'U8' is not supported",
    ),
    "bool dtype": (
        raw_body({"m": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
        "tensor 'm': dtype 'BOOL' is not supported",
    ),
    "dtype not a string": (
        raw_body({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, FOUR),
        "dtype \\['F32'\\] is not supported",
    ),
    "missing dtype": (
        raw_body({"a": {"shape": [1], "data_offsets": [0, 4]}}, FOUR),
        "tensor 'a': dtype None is not supported",
    ),
    "missing shape": (
        raw_body({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, FOUR),
        "tensor 'a' shape must be a list of integers",
    ),
    "float dim": (
        raw_body({"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, FOUR),
        "tensor 'a' shape must be a list of integers",
    ),
    "bool dim": (
        raw_body({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, FOUR),
        "tensor 'a' shape must be a list of integers",
    ),
    "shape as text": (
        raw_body({"a": {"dtype": "I8", "shape": "12", "data_offsets": [0, 2]}}, b"xy"),
        "tensor 'a' shape must be a list of integers",
    ),
    "infinite dim": (
        raw_body(b'{"a":{"dtype":"I8","shape":[Infinity],"data_offsets":[0,1]}}', b"x"),
        "tensor 'a' shape must be a list of integers",
    ),
    "infinite start": (
        raw_body(b'{"a":{"dtype":"I8","shape":[1],"data_offsets":[Infinity,1]}}', b"x"),
        "tensor 'a' data_offsets must be a list of integers",
    ),
    "offsets as text": (
        raw_body({"a": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, FOUR),
        "tensor 'a' data_offsets must be a list of integers",
    ),
    "three offsets": (
        raw_body({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, FOUR),
        r"tensor 'a' data_offsets must be \[start, end\]",
    ),
    "negative dims": (
        # (-2) * (-2) = 4 elements = 16 bytes: only the sign check catches it.
        raw_body({"a": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, FOUR * 4),
        "tensor 'a' has a negative dimension",
    ),
    "empty tensor dims overflow int64": (
        raw_body({"a": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}),
        "tensor 'a' has shape",
    ),
    "empty tensor dim beyond int64": (
        raw_body({"a": {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [0, 0]}}),
        "tensor 'a' has shape",
    ),
    "dim with more digits than int() reads": (
        # json raises a bare ValueError past 4300 digits: it was a 500 from the coordinator.
        raw_body(b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}'),
        "header is not JSON .*4300 digits",
    ),
    "trailing bytes": (raw_body({"a": F32_1}, FOUR + b"xyz"), "3 trailing bytes"),
    "data without tensors": (raw_body({}, b"x"), "1 trailing bytes"),
    "metadata value not a string": (
        raw_body({"__metadata__": {"rank": 1}}),
        "__metadata__ must map strings to strings",
    ),
    "metadata is a list": (raw_body({"__metadata__": []}), "__metadata__ must map strings"),
    "metadata is text": (raw_body({"__metadata__": "x"}), "__metadata__ must map strings"),
    "metadata is false": (raw_body({"__metadata__": False}), "__metadata__ must map strings"),
}


@pytest.mark.parametrize("body,message", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_body_is_refused_with_a_reason(body, message):
    with pytest.raises(WireError, match=message):
        wire.decode(body)


@pytest.mark.parametrize("shape", [[2**62, 2**62, 0], [2**64, 0], [0, 2**61, 2**61]])
def test_a_shape_too_large_for_torch_is_refused_from_the_head_alone(shape):
    # A streamed upload reads its head alone (decode_head) and shapes its row's slices from
    # it: torch's stride overflow there was a bare 500, the whole body's decode a 400.
    body = raw_body({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(WireError, match=r"tensor 'a' has shape \[.*\]: too large"):
        wire.decode_head(body, len(body))


def test_malformed_bodies_are_also_refused_by_safetensors():
    """Our refusals are not stricter than the format: the reference reader refuses the
    same bodies, except the dtypes it knows and we keep off the wire."""
    accepted = []
    for name, (body, _) in MALFORMED.items():
        try:
            st_load(body)
            accepted.append(name)
        except Exception:
            pass
    assert sorted(accepted) == ["bool dtype", "unsupported dtype"]


def test_fuzzed_bodies_decode_or_raise_wire_error():
    """Truncations and byte flips of a valid body never raise anything but WireError."""
    tensors = {
        "a": sample(torch.float32, (5,)),
        "b": sample(torch.int8, (3,)),
        "e": torch.zeros(0, dtype=torch.float64),
        "c": sample(torch.bfloat16, (2, 2)),
        "d": sample(torch.int64, (2,)),
    }
    body = wire.encode(tensors, {"island": "x", "rank": "0"})
    data_start = 8 + struct.unpack("<Q", body[:8])[0]
    rng = random.Random(1234)
    outcomes = {"decoded": 0, "refused": 0}

    for _ in range(200):  # every strict prefix is missing bytes its header promises
        cut = rng.randrange(len(body))
        with pytest.raises(WireError):
            wire.decode(body[:cut])

    for case in range(400):
        mutated = bytearray(body)
        # Half the flips in the length and header, where parsing can go wrong.
        hi = data_start if case % 2 else len(body)
        positions = [rng.randrange(hi) for _ in range(rng.choice([1, 1, 2, 3]))]
        for pos in positions:
            mutated[pos] ^= rng.randrange(1, 256)
        try:
            wire.decode(bytes(mutated))
            outcomes["decoded"] += 1
        except WireError:
            outcomes["refused"] += 1
        except Exception as e:  # pragma: no cover - the failure this test looks for
            pytest.fail(f"flips at {positions}: {type(e).__name__}: {e}")
        if all(p >= data_start for p in positions):  # only tensor bytes changed: still valid
            _, got = wire.decode(bytes(mutated))
            assert sorted(got) == sorted(tensors)
    assert outcomes["decoded"] > 0 and outcomes["refused"] > 0, outcomes


# --------------------------------------------------------------- zero copy
def test_decoded_tensors_alias_the_body():
    """The coordinator takes in uploads of up to a GiB: decode must not copy the tensor
    bytes (memory and time per upload double otherwise), so the tensors it returns are
    views of the received buffer. Callers therefore copy before writing."""
    tensors = {"a": sample(torch.float32, (64,)), "b": sample(torch.int64, (2, 8))}
    body = bytearray(wire.encode(tensors, {}))
    _, got = wire.decode(body)

    address = torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    for t in got.values():
        start = t.data_ptr() - address
        assert start >= 0 and start + t.numel() * t.element_size() <= len(body)

    # The last 8 bytes are b[1, 7]: mutating the buffer shows through the decoded tensor.
    body[-8:] = struct.pack("<q", -42)
    assert got["b"][1, 7].item() == -42
    assert torch.equal(got["a"], tensors["a"])
