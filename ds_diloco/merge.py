"""Merging the islands' pseudo-gradients of one fragment into one.

Weights: dynamic token weighting (tokens x tokens-per-step) and a staleness
policy. Combination, per tensor: embeddings by plain weighted mean, everything
else by radial-directional averaging (RDA), which averages norms and directions
separately so that the merged norm does not shrink like 1/sqrt(M) when M nearly
orthogonal pseudo-gradients are merged.

``merge_fragment`` is the fast path: one pass over the K contributions' rows per
tensor, a weighted sum a cache-sized chunk at a time. ``merge_reference`` is the slow,
obviously correct oracle the tests compare it with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Elements per BLAS dot when summing squares: fp32 accumulation over a chunk
# this size is accurate to ~1e-7 relative even on one thread (6e-8 on 300k values
# of mean 0.5; 2^18 was 1.2e-6 there), and the chunks add up in float64; smaller
# chunks only add Python overhead (2^16 against 2^18: 20 against 17 ms per 50M).
_SQ_CHUNK = 1 << 16
# Elements of a merge's output per chunk (4 MiB): it stays in cache while the K rows'
# chunks are added to it. Measured against one torch.mv over a (K, F) matrix, 16M
# elements, 2 threads: 7.0 / 13.6 / 19.3 ms for K = 2 / 4 / 8 against 15.3 / 14.7 / 24.9
# (1 thread: 8.5 / 17.7 / 30.2 against 7.7 / 13.3 / 26.7).
_MIX_CHUNK = 1 << 20


def token_weight(tokens: int, steps: int) -> float:
    """Dynamic token weight: tokens (quantity) x tokens / steps (quality).

    An island that lost chips trains on smaller batches, so with the same
    tokens it needs more steps and counts less.
    """
    if steps <= 0:
        raise ValueError(f"steps must be > 0 to weight a contribution, got {steps}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return float(tokens) * float(tokens) / float(steps)


_STALENESS_MODES = ("drop", "discount")


@dataclass(frozen=True, kw_only=True)
class StalenessPolicy:
    """What a contribution computed against an older version of the fragment weighs."""

    mode: str = "drop"
    """"drop": weight 0, as in the paper; "discount": w / (1 + discount_lambda * staleness)."""

    discount_lambda: float = 1.0
    """Discount per version of staleness (mode "discount" only); >= 0, 0 keeps stale weights."""

    def __post_init__(self) -> None:
        if self.mode not in _STALENESS_MODES:
            raise ValueError(
                f"StalenessPolicy.mode must be one of {_STALENESS_MODES}, got {self.mode!r}"
            )
        if not (math.isfinite(self.discount_lambda) and self.discount_lambda >= 0):
            raise ValueError(
                "StalenessPolicy.discount_lambda must be a finite number >= 0, "
                f"got {self.discount_lambda}"
            )


@dataclass(frozen=True)
class NormGuard:
    """Refuse a pseudo-gradient far larger than the fragment's recent ones (off by default).

    An island whose inner training diverges sends finite but huge pseudo-gradients; with
    K = 1 one of them is the whole outer step. Compared per inner step (a contribution
    covering more steps is larger), against the median of the fragment's last ``window``
    accepted contributions, once ``min_history`` of them are known.
    """

    max_ratio: float = 0.0
    """Refuse above this many times the recent median per-step norm; 0: off (the paper)."""

    window: int = 32
    min_history: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_ratio) and (self.max_ratio == 0 or self.max_ratio > 1)):
            raise ValueError(f"NormGuard.max_ratio must be 0 (off) or > 1, got {self.max_ratio}")
        if self.window < 1 or not 1 <= self.min_history <= self.window:
            raise ValueError(
                f"NormGuard needs window >= 1 and 1 <= min_history <= window, got "
                f"window {self.window}, min_history {self.min_history}"
            )


def norm_outlier(norm_per_step: float, recent: Sequence[float], guard: NormGuard) -> str:
    """Why a contribution of this per-step norm is refused ("" when it is not)."""
    if guard.max_ratio == 0 or len(recent) < guard.min_history:
        return ""
    ordered = sorted(recent)
    median = ordered[len(ordered) // 2]
    if median > 0 and norm_per_step > guard.max_ratio * median:
        return (
            f"dropped: pseudo-gradient norm {norm_per_step:.4g} per inner step is "
            f"{norm_per_step / median:.1f}x the fragment's recent median {median:.4g} "
            f"(norm_guard.max_ratio {guard.max_ratio:g}): a diverging island?"
        )
    return ""


def staleness_weight(weight: float, staleness: int, policy: StalenessPolicy) -> tuple[float, str]:
    """Weight of a contribution ``staleness`` versions behind, and why."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0 (versions behind), got {staleness}")
    if staleness == 0:
        return weight, "fresh"
    if policy.mode == "drop":
        return 0.0, f"dropped: {staleness} version(s) stale (policy drop)"
    factor = 1.0 / (1.0 + policy.discount_lambda * staleness)
    return (
        weight * factor,
        f"discounted x{factor:.4g}: {staleness} version(s) stale "
        f"(lambda={policy.discount_lambda:g})",
    )


DEFAULT_PLAIN_PATTERNS = (r"embed", r"lm_head", r"\bwte\b", r"\bwpe\b")
"""Tensor names merged by plain weighted mean (embeddings, as in the paper)."""


def is_plain_tensor(name: str, patterns: Sequence[str]) -> bool:
    """True if ``name`` matches any pattern: merge by plain mean, not RDA."""
    return any(re.search(p, name) for p in patterns)


@dataclass(frozen=True)
class Segment:
    """One tensor's place inside a fragment's flat fp32 buffer."""

    name: str
    offset: int
    numel: int


def fragment_layout(fragment, plain_patterns: Sequence[str]) -> tuple[list[Segment], list[bool]]:
    """A fragment's segments in its flat buffer, and which of them merge by RDA."""
    segments = [Segment(p.name, off, p.numel) for p, off in zip(fragment.params, fragment.offsets)]
    return segments, [not is_plain_tensor(p.name, plain_patterns) for p in fragment.params]


def sq_norm(x: Tensor) -> float:
    """Sum of squares of a 1-D fp32 tensor, accumulated in float64 across chunks.

    A single fp32 reduction over millions of elements loses ~1e-5 relative;
    chunked BLAS dots summed in Python floats are both fast and accurate.
    """
    n = x.numel()
    if n <= _SQ_CHUNK:
        return float(torch.dot(x, x)) if n else 0.0
    total = 0.0
    for i in range(0, n, _SQ_CHUNK):
        c = x[i : i + _SQ_CHUNK]
        total += float(torch.dot(c, c))
    return total


def _check_segments(segments: Sequence[Segment], total: int, what: str) -> None:
    end = 0
    for s in sorted(segments, key=lambda s: s.offset):
        if s.offset < 0 or s.numel < 0:
            raise ValueError(f"segment {s.name!r} has negative offset or numel: {s}")
        if s.offset < end:
            raise ValueError(f"segment {s.name!r} at offset {s.offset} overlaps the previous one")
        end = s.offset + s.numel
        if end > total:
            raise ValueError(
                f"segment {s.name!r} [{s.offset}, {end}) runs past the {what} of {total} elements"
            )


def segment_sq_norms(flat: Tensor, segments: Sequence[Segment]) -> Tensor:
    """Sum of squares of each segment of a 1-D buffer, float64, one per segment."""
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-D, got shape {tuple(flat.shape)}")
    _check_segments(segments, flat.numel(), "buffer")
    return torch.tensor(
        [sq_norm(flat[s.offset : s.offset + s.numel]) for s in segments], dtype=torch.float64
    )


def _weights_tensor(weights: Sequence[float] | Tensor, k: int) -> Tensor:
    w = torch.as_tensor(weights, dtype=torch.float64).detach().cpu()
    if w.shape != (k,):
        raise ValueError(
            f"weights must have one entry per contribution ({k}), got {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"weights must be finite and >= 0, got {w.tolist()}")
    if float(w.sum()) <= 0:
        raise ValueError(f"weights must have a positive sum, got {w.tolist()}")
    return w


def merge_fragment(
    deltas: Tensor | Sequence[Tensor],
    weights: Sequence[float] | Tensor,
    segments: Sequence[Segment],
    rda: Sequence[bool],
    sq_norms: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Merge K contributions to one fragment into one pseudo-gradient (F,) fp32.

    ``deltas`` are the K contributions, each a (F,) fp32 row over the whole fragment
    (separate buffers, as the coordinator's ``BufferPool`` holds them, or the rows of a
    (K, F) tensor); ``segments`` tile a row, one per tensor, and ``rda[t]`` picks RDA
    (True) or plain weighted mean (False) for segment t. ``sq_norms`` (K, T) float64 are
    the squared norms of each row and segment, computed here when None. Each segment is
    one weighted sum of its rows with per-row coefficients, computed a cache-sized chunk
    at a time (the chunk of ``out`` stays in cache while the rows stream past, so each
    row is read once); rows of weight 0 are not read. RDA segments are then rescaled in
    place to the weighted mean norm.

    Returns ``out`` (allocated when None), except when a single contribution
    carries all the weight: then its row itself (not to be written to), since the
    merge gives it back unchanged.
    """
    if isinstance(deltas, Tensor) and deltas.dim() != 2:
        raise ValueError(f"deltas must be a (K, F) tensor or K rows, got {tuple(deltas.shape)}")
    rows = list(deltas)
    k = len(rows)
    if k < 1:
        raise ValueError("deltas must hold at least one contribution (K >= 1)")
    f = rows[0].numel()
    for i, row in enumerate(rows):
        if row.dim() != 1 or row.dtype != torch.float32 or row.numel() != f:
            raise ValueError(
                f"deltas must be K rows of ({f},) float32 (a (K, F) tensor or K 1-D tensors); "
                f"row {i} is {tuple(row.shape)} {row.dtype}"
            )
    t_count = len(segments)
    if len(rda) != t_count:
        raise ValueError(f"rda must have one flag per segment ({t_count}), got {len(rda)}")
    covered = sum(s.numel for s in segments)
    if covered != f:
        raise ValueError(f"segments cover {covered} elements but a row has F={f}")
    _check_segments(segments, f, "fragment")
    w = _weights_tensor(weights, k)
    if out is not None and (out.shape != (f,) or out.dtype != torch.float32):
        raise ValueError(f"out must be a ({f},) float32 tensor, got {tuple(out.shape)} {out.dtype}")

    nonzero = torch.nonzero(w).flatten()
    if len(nonzero) == 1:
        # One contribution: both the weighted mean (w d / w) and RDA (|d| unit(unit(d)))
        # give it back unchanged. K = 1 is the paper's default quorum, so skip the math
        # and the copy: the result is its row.
        return rows[int(nonzero[0])]
    if out is None:
        out = torch.empty(f, dtype=torch.float32, device=rows[0].device)

    if sq_norms is None:
        sq = torch.tensor(
            [[sq_norm(row[s.offset : s.offset + s.numel]) for s in segments] for row in rows],
            dtype=torch.float64,
        ).reshape(k, t_count)
    else:
        if tuple(sq_norms.shape) != (k, t_count):
            raise ValueError(
                f"sq_norms must be (K, T) = ({k}, {t_count}), got {tuple(sq_norms.shape)}"
            )
        sq = sq_norms.detach().to(device="cpu", dtype=torch.float64)

    # Coefficients for all segments at once, (T, K): one list of K per segment.
    total_w = float(w.sum())
    norms = sq.clamp_min(0).sqrt()  # (K, T)
    rda_mask = torch.tensor(list(rda), dtype=torch.bool)
    plain_c = (w / total_w).unsqueeze(1).expand(k, t_count)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    rda_c = torch.where(norms > 0, w.unsqueeze(1) / (total_w * safe), torch.zeros_like(norms))
    coef = torch.where(rda_mask, rda_c, plain_c).t().to(torch.float32).tolist()
    mean_norm = ((w.unsqueeze(1) * norms).sum(0) / total_w).tolist()

    for t, s in enumerate(segments):
        a, b = s.offset, s.offset + s.numel
        if a == b:
            continue
        dst = out[a:b]
        _weighted_sum(dst, [(row, c) for row, c in zip(rows, coef[t]) if c != 0], a)
        if rda[t]:
            # unit() of the direction sum, times the weighted mean norm.
            dir_norm = math.sqrt(sq_norm(dst))
            if dir_norm > 0:
                dst.mul_(mean_norm[t] / dir_norm)
            else:
                dst.zero_()
    return out


def _weighted_sum(dst: Tensor, terms: list[tuple[Tensor, float]], offset: int) -> None:
    """``dst`` = sum of c x row[offset : offset + len(dst)] over ``terms``, a chunk at a time."""
    if not terms:
        dst.zero_()
        return
    n = dst.numel()
    for lo in range(0, n, _MIX_CHUNK):
        hi = min(lo + _MIX_CHUNK, n)
        d = dst[lo:hi]
        (row, c), *rest = terms
        torch.mul(row[offset + lo : offset + hi], c, out=d)
        for row, c in rest:
            d.add_(row[offset + lo : offset + hi], alpha=c)


def merge_reference(
    deltas_list: list[dict[str, Tensor]],
    weights: Sequence[float] | Tensor,
    plain: Callable[[str], bool],
) -> dict[str, Tensor]:
    """Per-tensor merge in float64 with plain loops: the oracle for ``merge_fragment``.

    Returns float64 tensors with the original shapes.
    """
    if not deltas_list:
        raise ValueError("deltas_list is empty")
    w = _weights_tensor(weights, len(deltas_list)).tolist()
    total_w = sum(w)
    names = list(deltas_list[0])
    for d in deltas_list[1:]:
        if list(d) != names:
            raise ValueError(f"contributions name different tensors: {list(d)} vs {names}")
    merged: dict[str, Tensor] = {}
    for name in names:
        ds = [d[name].detach().to(torch.float64) for d in deltas_list]
        if plain(name):
            acc = torch.zeros_like(ds[0])
            for wk, dk in zip(w, ds, strict=True):
                acc += wk * dk
            merged[name] = acc / total_w
            continue
        mean_norm = 0.0
        direction = torch.zeros_like(ds[0])
        for wk, dk in zip(w, ds, strict=True):
            nk = float(dk.norm())
            mean_norm += wk * nk
            if nk > 0:
                direction += wk * (dk / nk)
        mean_norm /= total_w
        direction /= total_w
        dn = float(direction.norm())
        merged[name] = mean_norm * direction / dn if dn > 0 else torch.zeros_like(direction)
    return merged
