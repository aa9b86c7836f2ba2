"""One rank's side of the outer loop: base copies, shard pseudo-gradients, background transport.

A rank owns a flat slice of every parameter (ZeRO-3's layout; the whole tensor
when the world size is 1). For each fragment it keeps the last global value of
its own slices (fp32: one extra copy of its shard), and when the fragment is
due it sends ``base - local`` with the fragment's counters. Uploads and the
wait for the merged result run in a background thread: the training loop
calls :meth:`FragmentSyncer.on_step` after each inner step and never blocks on
the network. A merged fragment is applied at the first step boundary at or
after ``send step + tau`` once it has arrived; until then training goes on.

How a rank reads and writes its slices is a :class:`ShardAccess`; the island
(DeepSpeed ZeRO-3) provides one over its fp32 master partition, and
:class:`ModelShardAccess` serves a plain ``nn.Module``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Protocol

import torch

from ds_diloco import wire
from ds_diloco.client import CoordinatorClient, RefusedError
from ds_diloco.fragments import Fragment, FragmentPlan, Schedule
from ds_diloco.sharding import shard_range

log = logging.getLogger(__name__)


class ShardAccess(Protocol):
    """Reads and writes the flat, unpadded slice of a parameter that this rank owns."""

    def read(self, name: str) -> torch.Tensor: ...

    def write(self, name: str, values: torch.Tensor) -> None: ...


class ModelShardAccess:
    """Slices of a plain ``nn.Module``'s parameters (world size 1: whole tensors)."""

    def __init__(self, model: torch.nn.Module, world_size: int = 1, rank: int = 0):
        self.params = dict(model.named_parameters())
        self.world_size, self.rank = world_size, rank

    def _view(self, name: str) -> torch.Tensor:
        p = self.params[name].data.view(-1)
        a, b = shard_range(p.numel(), self.world_size, self.rank)
        return p[a:b]

    def read(self, name: str) -> torch.Tensor:
        return self._view(name).float()

    @torch.no_grad()
    def write(self, name: str, values: torch.Tensor) -> None:
        self._view(name).copy_(values)


@dataclasses.dataclass
class _Slot:
    """What this rank knows about one fragment."""

    version: int = -1
    base: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    tokens: int = 0
    steps: int = 0
    sent_step: int | None = None  # step of the upload whose result we wait for
    ready: tuple[int, dict[str, torch.Tensor]] | None = None  # downloaded, not yet applied


@dataclasses.dataclass
class SyncStats:
    uploads: int = 0
    dropped: int = 0
    refused: int = 0
    failed: int = 0
    applied: int = 0


class FragmentSyncer:
    def __init__(
        self,
        client: CoordinatorClient,
        island: str,
        plan: FragmentPlan,
        schedule: Schedule,
        access: ShardAccess,
        *,
        world_size: int = 1,
        rank: int = 0,
        alpha: float = 0.0,
        poll_s: float = 0.05,
    ):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha (blend of local into global) must be in [0, 1), got {alpha}")
        self.client, self.island, self.plan, self.schedule = client, island, plan, schedule
        self.access, self.world_size, self.rank = access, world_size, rank
        self.alpha, self.poll_s = alpha, poll_s
        self.slots = [_Slot() for _ in plan.fragments]
        self.stats = SyncStats()
        self._lock = threading.Lock()
        self._uploads: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._worker, name=f"sync-{island}-{rank}", daemon=True
        )

    # ----------------------------------------------------------- training side
    def bootstrap(self) -> list[int]:
        """Take every fragment's current global value (blocking: before training starts)."""
        for frag in self.plan.fragments:
            got = self.client.download(frag.index, self.world_size, self.rank, island=self.island)
            self._apply(frag, *got, blend=False)
        self._thread.start()
        return self.versions()

    def versions(self) -> list[int]:
        return [s.version for s in self.slots]

    def on_step(self, step: int, tokens: int) -> list[int]:
        """Call after inner step ``step`` (from 1); returns the fragments applied now."""
        applied = []
        for frag, slot in zip(self.plan.fragments, self.slots):
            slot.tokens += tokens
            slot.steps += 1
            with self._lock:
                ready = slot.ready
                due = slot.sent_step is not None and step >= self.schedule.apply_at(slot.sent_step)
                if ready is not None and due:
                    slot.ready, slot.sent_step = None, None
            if ready is not None and due:
                self._apply(frag, *ready, blend=True)
                applied.append(frag.index)
        p = self.schedule.due(step)
        if p is not None:
            self._send(self.plan.fragments[p], step)
        return applied

    def _send(self, frag: Fragment, step: int) -> None:
        slot = self.slots[frag.index]
        delta = {n: slot.base[n] - self.access.read(n) for n in frag.names}
        header = wire.UploadHeader(
            island=self.island,
            rank=self.rank,
            world_size=self.world_size,
            fragment=frag.index,
            base_version=slot.version,
            step=step,
            tokens=slot.tokens,
            steps=max(slot.steps, 1),
        )
        with self._lock:
            slot.sent_step, slot.ready = step, None  # a newer send supersedes an older wait
        self._uploads.put((header, delta))

    def _apply(self, frag: Fragment, version: int, slices: dict[str, torch.Tensor], blend: bool):
        slot = self.slots[frag.index]
        for name in frag.names:
            new = slices[name].float()
            if blend and self.alpha > 0.0:
                new = self.alpha * self.access.read(name) + (1.0 - self.alpha) * new
            self.access.write(name, new)
            slot.base[name] = slices[name].float().clone()
        slot.version, slot.tokens, slot.steps = version, 0, 0
        self.stats.applied += 1

    # ---------------------------------------------------------- network side
    def _worker(self) -> None:
        while not self._stop.is_set():
            try:
                header, delta = self._uploads.get(timeout=self.poll_s)
            except queue.Empty:
                self._poll_results()
                continue
            self._upload(header, delta)
            self._uploads.task_done()

    def _upload(self, header: wire.UploadHeader, delta) -> None:
        try:
            reply = self.client.upload(header, delta)
            self.stats.uploads += 1
            if reply["status"] != "accepted":
                self.stats.dropped += 1
                log.info(
                    "%s/%d fragment %d step %d: %s",
                    self.island,
                    self.rank,
                    header.fragment,
                    header.step,
                    reply["reason"],
                )
        except RefusedError as e:
            self.stats.refused += 1
            log.warning("%s/%d upload refused: %s", self.island, self.rank, e)
        except Exception as e:  # coordinator unreachable: keep training, try again next time
            self.stats.failed += 1
            log.warning("%s/%d upload failed: %s", self.island, self.rank, e)

    def _poll_results(self) -> None:
        for frag, slot in zip(self.plan.fragments, self.slots):
            with self._lock:
                waiting = slot.sent_step is not None and slot.ready is None
                have = slot.version
            if not waiting:
                continue
            try:
                got = self.client.download(
                    frag.index, self.world_size, self.rank, after=have, island=self.island
                )
            except Exception as e:
                log.warning(
                    "%s/%d download of fragment %d failed: %s",
                    self.island,
                    self.rank,
                    frag.index,
                    e,
                )
                return
            if got is not None:
                with self._lock:
                    if slot.sent_step is not None:
                        slot.ready = got

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued uploads, then stop the background thread."""
        deadline = time.monotonic() + timeout
        while self._uploads.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
