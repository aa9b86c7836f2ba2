"""ZeRO-3's flat partition layout, as plain arithmetic.

DeepSpeed ZeRO-3 flattens every parameter on its own and gives rank r of W the
flat elements [r*ps, min((r+1)*ps, n)) with ps = ceil(n / W); the tail of the
last rank(s) is padding. The coordinator stores parameters whole and cuts the
same slices on demand, so islands of different world sizes can share one run.
Padding never travels on the wire.
"""

from __future__ import annotations

import torch


def partition_size(numel: int, world_size: int) -> int:
    """Elements per rank partition, padding included (DeepSpeed's ``ds_tensor.ds_numel``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return -(-numel // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Flat [start, end) of the real (unpadded) elements rank ``rank`` owns; may be empty."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    ps = partition_size(numel, world_size)
    start = min(rank * ps, numel)
    return start, min(start + ps, numel)


def shard_numel(numel: int, world_size: int, rank: int) -> int:
    start, end = shard_range(numel, world_size, rank)
    return end - start


def shard_slice(flat: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The view of a whole flat tensor that rank ``rank`` of ``world_size`` owns."""
    start, end = shard_range(flat.numel(), world_size, rank)
    return flat.view(-1)[start:end]
