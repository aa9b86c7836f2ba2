"""Which tensors form each fragment, and when each fragment is synchronised.

Decoupled DiLoCo splits the model into P fragments (disjoint sets of whole
tensors) and syncs one fragment every H/P inner steps, so traffic stays flat
instead of bursting every H steps. Everything here is pure arithmetic over
parameter names and shapes: islands and the coordinator build the same plan
independently and compare ``signature`` to refuse a model mismatch.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

STRATEGIES = ("balanced", "layer")

# A transformer block is the component ``<container>.<i>.`` in a parameter name:
# ``model.layers.3.`` (Llama, Mistral, Qwen), ``transformer.h.3.`` (GPT-2),
# ``encoder.layer.3.`` (BERT), ``blocks.3.`` (nanoGPT-style models).
_BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's name and full (unpartitioned) shape."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # Normalise torch.Size / JSON lists so equality and hashing are by value.
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape of {self.name!r} has a negative dimension: {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes as fp32, the dtype pseudo-gradients and global values are kept in."""
        return 4 * self.numel


def param_specs(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """Specs in model order. A ZeRO-3 partitioned parameter has an empty ``.data``
    and its full shape in ``ds_shape``, so that attribute wins when present."""
    specs: list[ParamSpec] = []
    seen: set[str] = set()
    for name, p in named_params:
        if name in seen:
            raise ValueError(f"duplicate parameter name {name!r}")
        seen.add(name)
        shape = getattr(p, "ds_shape", None)
        specs.append(ParamSpec(name, tuple(p.shape if shape is None else shape)))
    return specs


def signature(specs: Iterable[ParamSpec]) -> str:
    """sha256 hex over the ordered lines ``name:d0xd1x...``: equal iff same names,
    shapes and order."""
    text = "\n".join(f"{s.name}:{'x'.join(map(str, s.shape))}" for s in specs)
    return hashlib.sha256(text.encode()).hexdigest()


def spec_difference(ours: Sequence[ParamSpec], theirs: Sequence[ParamSpec], most: int = 3) -> str:
    """What differs between two parameter lists (where their signatures differ), in words:
    the parameters only one has, those of another shape, else their order."""
    mine, other = {s.name: s.shape for s in ours}, {s.name: s.shape for s in theirs}
    parts = []
    if missing := [n for n in other if n not in mine]:
        parts.append(f"{len(missing)} of the run's missing here ({', '.join(missing[:most])})")
    if extra := [n for n in mine if n not in other]:
        parts.append(f"{len(extra)} not in the run's ({', '.join(extra[:most])})")
    if reshaped := [n for n in mine if n in other and mine[n] != other[n]]:
        shapes = ", ".join(f"{n} {list(mine[n])} here, {list(other[n])} in the run"
                           for n in reshaped[:most])  # fmt: skip
        parts.append(f"{len(reshaped)} of another shape ({shapes})")
    if not parts:
        at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        parts.append(f"the same parameters in another order (from {ours[at].name})")
    return "; ".join(parts)


@dataclass(frozen=True)
class Fragment:
    """A set of whole tensors synced together; params are in model order, which
    fixes the layout of the fragment's flat fp32 buffer."""

    index: int
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    @property
    def offsets(self) -> tuple[int, ...]:
        """Flat start of each param inside the fragment's buffer."""
        out, pos = [], 0
        for p in self.params:
            out.append(pos)
            pos += p.numel
        return tuple(out)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


@dataclass(frozen=True)
class FragmentPlan:
    """A partition of the model's tensors into fragments 0..P-1.

    ``specs`` keeps the model order across fragments (balanced fragments
    interleave it); when omitted it is taken as the fragments' concatenation.
    """

    fragments: tuple[Fragment, ...]
    strategy: str
    specs: tuple[ParamSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "fragments", tuple(self.fragments))
        if not self.specs:
            object.__setattr__(self, "specs", tuple(p for f in self.fragments for p in f.params))
        object.__setattr__(self, "specs", tuple(self.specs))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        _check_unique(self.specs)
        for i, f in enumerate(self.fragments):
            if f.index != i:
                raise ValueError(f"fragment at position {i} has index {f.index}")
            if not f.params:
                raise ValueError(f"fragment {i} is empty")
        if not self.fragments:
            raise ValueError("a plan needs at least one fragment")
        in_fragments = sorted((p.name, p.shape) for f in self.fragments for p in f.params)
        if in_fragments != sorted((p.name, p.shape) for p in self.specs):
            raise ValueError("fragments must hold every spec exactly once")

    # -- constructors ---------------------------------------------------------

    @classmethod
    def build(cls, specs: Iterable[ParamSpec], num_fragments: int, strategy: str) -> FragmentPlan:
        if strategy == "balanced":
            return cls.balanced(specs, num_fragments)
        if strategy == "layer":
            return cls.by_layer(specs, num_fragments)
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")

    @classmethod
    def balanced(cls, specs: Iterable[ParamSpec], num_fragments: int) -> FragmentPlan:
        """Greedy bin-packing (LPT) of whole tensors into fragments of near-equal bytes.

        Largest tensor first, each into the currently lightest fragment (ties: lowest
        index). Equal-sized tensors are taken in name order, not model order, so the
        membership depends only on the set of names and shapes. The heaviest fragment
        is at most mean + largest tensor: its last tensor went to the lightest bin,
        whose load was then at most the mean.
        """
        specs = tuple(specs)
        _check_unique(specs)
        if not 1 <= num_fragments <= len(specs):
            raise ValueError(
                f"num_fragments must be in [1, {len(specs)}] (the model has {len(specs)} "
                f"tensors and a fragment holds whole tensors), got {num_fragments}"
            )
        bins: list[tuple[int, int]] = [(0, i) for i in range(num_fragments)]  # (bytes, index)
        owner: dict[str, int] = {}
        for s in sorted(specs, key=lambda s: (-s.nbytes, s.name)):
            load, i = heapq.heappop(bins)
            owner[s.name] = i
            heapq.heappush(bins, (load + s.nbytes, i))
        return cls._from_owner(specs, owner, num_fragments, "balanced")

    @classmethod
    def by_layer(cls, specs: Iterable[ParamSpec], num_fragments: int) -> FragmentPlan:
        """Contiguous groups of whole transformer blocks, near-equal block counts.

        Tensors before the first block (embeddings) join fragment 0; all other
        tensors outside blocks (final norm, lm_head) join the last fragment.
        """
        specs = tuple(specs)
        _check_unique(specs)
        block_of: dict[str, str] = {}
        blocks: dict[str, int] = {}  # block prefix -> block number, in first-seen order
        for s in specs:
            m = _BLOCK_RE.search(s.name)
            if m:
                block_of[s.name] = s.name[: m.end()]
                blocks.setdefault(block_of[s.name], len(blocks))
        if not blocks:
            raise ValueError(
                "no transformer blocks found: layer fragmentation needs names with a "
                "'.layers.<i>.', '.h.<i>.', '.layer.<i>.' or '.blocks.<i>.' component; "
                "use strategy 'balanced'"
            )
        n = len(blocks)
        if not 1 <= num_fragments <= n:
            raise ValueError(
                f"num_fragments must be in [1, {n}] (the model has {n} blocks), got {num_fragments}"
            )
        # Block b goes to group floor(b * P / L): contiguous, sizes differ by at most one.
        owner: dict[str, int] = {}
        before_first = True
        for s in specs:
            if s.name in block_of:
                before_first = False
                owner[s.name] = blocks[block_of[s.name]] * num_fragments // n
            else:
                owner[s.name] = 0 if before_first else num_fragments - 1
        return cls._from_owner(specs, owner, num_fragments, "layer")

    @classmethod
    def _from_owner(
        cls, specs: tuple[ParamSpec, ...], owner: dict[str, int], num_fragments: int, strategy: str
    ) -> FragmentPlan:
        members: list[list[ParamSpec]] = [[] for _ in range(num_fragments)]
        for s in specs:  # model order is kept inside every fragment
            members[owner[s.name]].append(s)
        fragments = tuple(Fragment(i, tuple(m)) for i, m in enumerate(members))
        return cls(fragments, strategy, specs)

    # -- queries --------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.fragments)

    @cached_property
    def _owner(self) -> dict[str, int]:
        return {p.name: f.index for f in self.fragments for p in f.params}

    def fragment_of(self, name: str) -> int:
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in the fragment plan") from None

    @property
    def signature(self) -> str:
        return signature(self.specs)

    @property
    def max_imbalance(self) -> float:
        """Heaviest fragment's bytes over the mean: 1.0 is perfectly flat traffic."""
        sizes = [f.nbytes for f in self.fragments]
        mean = sum(sizes) / len(sizes)
        return max(sizes) / mean if mean else 1.0

    # -- serialisation --------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "signature": self.signature,
            "params": [[s.name, list(s.shape)] for s in self.specs],
            "fragments": [list(f.names) for f in self.fragments],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FragmentPlan:
        specs = tuple(ParamSpec(name, tuple(shape)) for name, shape in d["params"])
        by_name = {s.name: s for s in specs}
        try:
            fragments = tuple(
                Fragment(i, tuple(by_name[n] for n in names))
                for i, names in enumerate(d["fragments"])
            )
        except KeyError as e:
            raise ValueError(f"fragment lists unknown parameter {e.args[0]!r}") from None
        plan = cls(fragments, d["strategy"], specs)
        if "signature" in d and d["signature"] != plan.signature:
            raise ValueError("plan JSON signature does not match its params")
        return plan


def _check_unique(specs: Iterable[ParamSpec]) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"duplicate parameter name {s.name!r}")
        seen.add(s.name)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """When each fragment is sent and when its merged result is applied.

    Steps count from 1. Fragment p is sent after inner steps (p+1)*stride + k*H,
    k >= 0, with stride = H/P: one fragment every stride steps, round-robin, each
    fragment exactly H steps apart. With H = P one fragment is sent every step.
    """

    sync_every: int
    """H: inner steps between two syncs of the same fragment."""
    num_fragments: int
    """P: number of fragments; H must be a multiple of P."""
    overlap: int
    """tau: inner steps between sending a fragment and applying its merged result."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments (P) must be >= 1, got {self.num_fragments}")
        if self.sync_every % self.num_fragments:
            raise ValueError(
                f"sync_every (H={self.sync_every}) must be a multiple of num_fragments "
                f"(P={self.num_fragments}) so that fragments are evenly staggered, one every "
                f"H/P steps: change sync_every or num_fragments"
            )
        if not 0 <= self.overlap < self.sync_every:
            raise ValueError(
                f"overlap (tau) must be in [0, sync_every={self.sync_every}) so a fragment's "
                f"result is applied before it is sent again, got {self.overlap}"
            )

    @property
    def stride(self) -> int:
        """Inner steps between two consecutive sends (of different fragments)."""
        return self.sync_every // self.num_fragments

    def due(self, step: int) -> int | None:
        """The fragment sent after inner step ``step``, or None."""
        if step < 1:
            raise ValueError(f"step counts from 1, got {step}")
        if step % self.stride:
            return None
        return (step // self.stride - 1) % self.num_fragments

    def apply_at(self, send_step: int) -> int:
        """Step boundary at which the result of a send after ``send_step`` is applied."""
        return send_step + self.overlap

    def position(self, fragment: int) -> int:
        """Where ``fragment`` is sent in the schedule: the steps (+ phase) it is due after
        are this, mod H (the inverse of :meth:`due`)."""
        return (fragment + 1) * self.stride % self.sync_every

    def join_phase(self, clock: float, last_step: int) -> int:
        """The phase (0 <= phase < H) that puts step ``last_step + 1``, sending at schedule
        position ``last_step + 1 + phase``, one step after the rounds' position ``clock``
        (where their schedule is now, in steps): the island then sends each fragment when
        the other islands do. ``due(step + phase)`` is the fragment due after ``step``."""
        return (round(clock) - last_step) % self.sync_every

    def sends_between(self, a: int, b: int) -> list[tuple[int, int]]:
        """(step, fragment) for every send with a < step <= b."""
        first = (max(a, 0) // self.stride + 1) * self.stride
        return [
            (s, (s // self.stride - 1) % self.num_fragments)
            for s in range(first, b + 1, self.stride)
        ]
