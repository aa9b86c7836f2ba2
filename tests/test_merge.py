from __future__ import annotations

import math

import pytest
import torch

from ds_diloco import merge
from ds_diloco.merge import (
    DEFAULT_PLAIN_PATTERNS,
    Segment,
    StalenessPolicy,
    is_plain_tensor,
    merge_fragment,
    merge_reference,
    segment_sq_norms,
    staleness_weight,
    token_weight,
)


def test_token_weight_is_tokens_squared_over_steps():
    assert token_weight(1000, 10) == 100_000.0
    assert token_weight(0, 5) == 0.0
    # Same tokens, twice the steps (half the batch): half the weight.
    assert token_weight(1000, 20) == pytest.approx(token_weight(1000, 10) / 2)
    # Twice the tokens in the same steps: four times the weight.
    assert token_weight(2000, 10) == pytest.approx(4 * token_weight(1000, 10))


@pytest.mark.parametrize(
    ("tokens", "steps", "match"), [(10, 0, "steps"), (10, -1, "steps"), (-1, 3, "tokens")]
)
def test_token_weight_errors(tokens, steps, match):
    with pytest.raises(ValueError, match=match):
        token_weight(tokens, steps)


def test_staleness_drop_and_discount():
    drop = StalenessPolicy()
    assert staleness_weight(5.0, 0, drop) == (5.0, "fresh")
    w, why = staleness_weight(5.0, 2, drop)
    assert w == 0.0 and "dropped" in why and "2" in why

    disc = StalenessPolicy(mode="discount", discount_lambda=0.5)
    assert staleness_weight(6.0, 0, disc) == (6.0, "fresh")
    w, why = staleness_weight(6.0, 2, disc)
    assert w == pytest.approx(3.0)  # 6 / (1 + 0.5 * 2)
    assert "discounted" in why and "0.5" in why
    w, _ = staleness_weight(6.0, 1, StalenessPolicy(mode="discount"))
    assert w == pytest.approx(3.0)  # default lambda 1


def test_staleness_errors():
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(1.0, -1, StalenessPolicy())
    with pytest.raises(ValueError, match="mode"):
        StalenessPolicy(mode="ignore")
    with pytest.raises(ValueError, match="discount_lambda"):
        StalenessPolicy(mode="discount", discount_lambda=-1.0)


def test_plain_patterns():
    plain = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "transformer.wte.weight",
        "transformer.wpe.weight",
    ]
    rda = ["model.layers.0.self_attn.q_proj.weight", "transformer.h.0.mlp.c_fc.weight"]
    assert all(is_plain_tensor(n, DEFAULT_PLAIN_PATTERNS) for n in plain)
    assert not any(is_plain_tensor(n, DEFAULT_PLAIN_PATTERNS) for n in rda)
    assert not is_plain_tensor("transformer.wtex", DEFAULT_PLAIN_PATTERNS)


@pytest.mark.parametrize("m", [4, 16])
def test_rda_keeps_norm_of_orthogonal_vectors_plain_mean_shrinks(m):
    n, norm = 64, 3.0
    q, _ = torch.linalg.qr(
        torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
    )
    deltas = (norm * q[:m]).to(torch.float32).contiguous()  # m orthonormal rows, scaled
    seg = [Segment("w", 0, n)]
    rda = merge_fragment(deltas, [1.0] * m, seg, [True])
    plain = merge_fragment(deltas, [1.0] * m, seg, [False])
    assert float(rda.norm()) == pytest.approx(norm, rel=1e-5)
    assert float(plain.norm()) == pytest.approx(norm / math.sqrt(m), rel=1e-5)
    # Same direction either way: the plain mean is RDA scaled down.
    torch.testing.assert_close(rda / math.sqrt(m), plain, rtol=1e-5, atol=1e-6)


def _fragment(gen: torch.Generator, k: int):
    shapes = {
        "model.embed_tokens.weight": (7, 5),
        "model.layers.0.q_proj.weight": (6, 6),
        "model.layers.0.q_proj.bias": (6,),
        "model.layers.0.norm.weight": (1,),
        "lm_head.weight": (5, 3),
        "model.layers.0.mlp.weight": (9, 4),
    }
    segments, offset = [], 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        segments.append(Segment(name, offset, numel))
        offset += numel
    # Contributions live in the first k rows of a larger buffer (as the coordinator's are).
    buf = torch.randn(k + 3, offset, generator=gen)
    scales = torch.tensor([0.1, 1.0, 10.0, 0.5, 2.0][:k]).unsqueeze(1)
    buf[:k] *= scales
    # Contribution 1 has an all-zero tensor: RDA must skip its direction, not divide by 0.
    q = segments[1]
    buf[1, q.offset : q.offset + q.numel] = 0
    deltas = buf[:k]
    dicts = [
        {s.name: deltas[i, s.offset : s.offset + s.numel].reshape(shapes[s.name]) for s in segments}
        for i in range(k)
    ]
    return deltas, segments, dicts


@pytest.mark.parametrize(
    "precomputed, layout, chunk",
    [(True, "matrix", None), (False, "matrix", None), (True, "rows", None), (True, "rows", 5)],
)
def test_merge_fragment_matches_reference(precomputed, layout, chunk, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    k = 4
    deltas, segments, dicts = _fragment(gen, k)
    if layout == "rows":  # separate buffers, as the coordinator's BufferPool holds them
        deltas = [row.clone() for row in deltas]
    if chunk is not None:  # chunks that end inside segments and across their ends
        monkeypatch.setattr(merge, "_MIX_CHUNK", chunk)
    weights = [1.0, 3.0, 0.5, 2.0]
    plain = [is_plain_tensor(s.name, DEFAULT_PLAIN_PATTERNS) for s in segments]
    assert any(plain) and not all(plain)
    sq = torch.stack([segment_sq_norms(row, segments) for row in deltas]) if precomputed else None
    out = torch.full((deltas[0].numel(),), float("nan"))
    got = merge_fragment(deltas, weights, segments, [not p for p in plain], sq_norms=sq, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = merge_reference(dicts, weights, lambda n: is_plain_tensor(n, DEFAULT_PLAIN_PATTERNS))
    for s in segments:
        torch.testing.assert_close(
            got[s.offset : s.offset + s.numel].double(),
            want[s.name].reshape(-1),
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, s=s: f"{s.name}: {m}",
        )


def test_merge_fragment_never_reads_a_row_of_weight_zero():
    # A contribution weighed out at the merge (stale: weight 0) is not read at all: no
    # bandwidth for it, and whatever its buffer holds (here NaN) cannot reach the merge.
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(12, generator=gen) for _ in range(3)]
    segs = [Segment("embed", 0, 5), Segment("w", 5, 7)]
    want = merge_fragment([rows[0], rows[2]], [1.0, 2.0], segs, [False, True])
    sq = torch.stack([segment_sq_norms(row, segs) for row in rows])  # taken at upload
    rows[1].fill_(float("nan"))
    got = merge_fragment(rows, [1.0, 0.0, 2.0], segs, [False, True], sq_norms=sq)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


def test_merge_fragment_refuses_rows_of_different_sizes():
    segs = [Segment("a", 0, 4)]
    with pytest.raises(ValueError, match=r"row 1 is \(5,\)"):
        merge_fragment([torch.zeros(4), torch.zeros(5)], [1.0, 1.0], segs, [True])


def test_merge_reference_rda_by_hand():
    # Two orthogonal vectors with norms 1 and 3, equal weights: mean norm 2, direction (1,1)/sqrt2.
    d = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 3.0])}]
    got = merge_reference(d, [1.0, 1.0], lambda n: False)["w"]
    torch.testing.assert_close(got, torch.tensor([2.0, 2.0], dtype=torch.float64) / math.sqrt(2))
    plain = merge_reference(d, [1.0, 3.0], lambda n: True)["w"]
    torch.testing.assert_close(plain, torch.tensor([0.25, 2.25], dtype=torch.float64))


def test_merge_fragment_opposite_and_zero_contributions_give_zero():
    deltas = torch.tensor([[1.0, 2.0, 0.0], [-1.0, -2.0, 0.0]])
    segs = [Segment("a", 0, 2), Segment("b", 2, 1)]
    got = merge_fragment(deltas, [1.0, 1.0], segs, [True, True])
    assert torch.equal(got, torch.zeros(3))


def test_merge_fragment_single_contribution_is_identity():
    deltas = torch.randn(1, 10, generator=torch.Generator().manual_seed(1))
    segs = [Segment("a", 0, 4), Segment("b", 4, 6)]
    got = merge_fragment(deltas, [2.0], segs, [True, False])
    torch.testing.assert_close(got, deltas[0])


def test_segment_sq_norms_accumulates_long_segments_accurately():
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(2)) + 0.5
    segs = [Segment("a", 0, 3), Segment("b", 3, 299_998)]
    # On one thread (a one-core coordinator), where each BLAS dot is one fp32 sum: with
    # 2^18-element chunks it was 1.2e-6 off, and passed only where torch had 2 threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = segment_sq_norms(x, segs)
    finally:
        torch.set_num_threads(threads)
    assert got.dtype == torch.float64
    want = torch.stack([(x[:3].double() ** 2).sum(), (x[3:].double() ** 2).sum()])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_merge_fragment_errors():
    d = torch.randn(2, 6)
    segs = [Segment("a", 0, 2), Segment("b", 2, 4)]
    ok = {"weights": [1.0, 1.0], "segments": segs, "rda": [True, False]}

    def call(deltas=d, **kw):
        return merge_fragment(deltas, **{**ok, **kw})

    with pytest.raises(ValueError, match="float32"):
        call(d.double())
    with pytest.raises(ValueError, match=r"\(K, F\)"):
        call(d[0])
    with pytest.raises(ValueError, match="one entry per contribution"):
        call(weights=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        call(weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="positive sum"):
        call(weights=[0.0, 0.0])
    with pytest.raises(ValueError, match="one flag per segment"):
        call(rda=[True])
    with pytest.raises(ValueError, match="cover 5 elements"):
        call(segments=[Segment("a", 0, 2), Segment("b", 2, 3)])
    with pytest.raises(ValueError, match="overlaps"):
        call(segments=[Segment("a", 0, 4), Segment("b", 2, 2)])
    with pytest.raises(ValueError, match="runs past"):
        call(segments=[Segment("a", 0, 2), Segment("b", 3, 4)])
    with pytest.raises(ValueError, match="sq_norms"):
        call(sq_norms=torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(5))
    with pytest.raises(ValueError, match="1-D"):
        segment_sq_norms(d, segs)
    with pytest.raises(ValueError, match="different tensors"):
        merge_reference([{"a": d}, {"b": d}], [1.0, 1.0], lambda n: True)


def test_single_weighted_contribution_is_returned_unchanged_among_zero_weights():
    g = torch.Generator().manual_seed(3)
    segments = [Segment("embed", 0, 6), Segment("w", 6, 10)]
    deltas = torch.randn(3, 16, generator=g)
    out = merge_fragment(deltas, [0.0, 2.0, 0.0], segments, [False, True])
    assert torch.equal(out, deltas[1])
    ref = merge_reference(
        [{"embed": d[:6], "w": d[6:]} for d in deltas], [0.0, 2.0, 0.0], lambda n: n == "embed"
    )
    assert torch.allclose(out[6:].double(), ref["w"], atol=1e-6)
