"""The coordinator's island table: who registered, what each island sent, what was merged.

One record per island: its world size and registrations (a later launch supersedes an
earlier one), its lease (``last_seen``), the last step of every rank's uploads per
fragment (anything not newer is a replay), its step time, and its merged and dropped
contributions (goodput, ``/metrics``). The table is saved now and then; the fragment
files, written with every merge, carry ``merged_by``, which brings a table read back
from disk up to date (:func:`islands_on_disk`: the coordinator's load, and an export
from a state dir).
"""

from __future__ import annotations

import dataclasses
import time

from ds_diloco.round_policy import Ema


@dataclasses.dataclass
class IslandRecord:
    """What the coordinator knows of one island (saved with its table, by name)."""

    island: str
    world_size: int
    last_seen: float
    last_step: int = 0
    last_step_at: float | None = None
    step_time: Ema = dataclasses.field(default_factory=Ema)
    uploads: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    """(fragment, rank) -> last step received: anything not newer is a replay."""
    merged: int = 0
    dropped: int = 0
    """Contributions that will never be merged: stale, replaced by a newer one of the
    island, or still pending when it left. merged + dropped = contributions sent.
    Durable with the table only (every ``save_every_merges`` merges, each registration,
    shutdown): after a SIGKILL the drop counts may read lower than before it; the merge
    counts do not (written with the fragments, ``merged_by``)."""
    tokens_merged: int = 0
    steps_merged: int = 0
    """Inner steps in this island's merged contributions, summed over fragments."""
    steps_dropped: int = 0
    """Inner steps in its dropped contributions, summed over fragments."""
    last_dropped: dict[int, int] = dataclasses.field(default_factory=dict)
    """fragment -> step of the last contribution of this registration counted as dropped:
    each rank's part of one contribution can end on its own path (stale on arrival,
    dropped at the merge, replaced, left pending); the contribution is counted once."""
    joined_at: float = dataclasses.field(default_factory=lambda: time.time())
    """Wall-clock time of the first registration: from then on the island is allocated.
    Moved later by the time between a leave and its next registration, which is not."""
    left_at: float | None = None
    """Wall-clock time it left for good (``leave``); None while it belongs to the run."""
    registrations: int = 1
    started: bool = False
    """It said it is about to take its first step (:meth:`Coordinator.start`)."""
    finishing: bool = False
    """It sent its final flush (an upload marked ``final``): done training, it is no
    longer live for any quorum; its final contributions wait for the next rounds."""

    def new_incarnation(self, incarnation: int, world_size: int, now: float) -> None:
        """A new launch of the island registered (or is taken as registered): live again,
        at its world size; its step counts, replay and drop marks start over (a restarted
        island may count its steps from an earlier checkpoint: a contribution at a step
        the last launch had one dropped at was not counted). The old launch's pending
        contributions are dropped first (``Coordinator._drop_pending``)."""
        if self.left_at is not None:  # gone since (a finished run resumed): not allocated
            self.joined_at += max(0.0, time.time() - self.left_at)
        self.registrations, self.world_size = incarnation, world_size
        self.left_at, self.finishing = None, False
        self.uploads.clear()
        self.last_dropped.clear()
        self.last_step, self.last_step_at, self.last_seen = 0, None, now

    def count_dropped(self, fragment: int, step: int, steps: int) -> None:
        if self.last_dropped.get(fragment) != step:
            self.last_dropped[fragment] = step
            self.dropped += 1
            self.steps_dropped += steps

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "last_step": self.last_step,
            "merged": self.merged,
            "dropped": self.dropped,
            "tokens_merged": self.tokens_merged,
            "steps_merged": self.steps_merged,
            "steps_dropped": self.steps_dropped,
            "joined_at": self.joined_at,
            "left_at": self.left_at,
            "registrations": self.registrations,
            "finishing": self.finishing,
            "uploads": [[f, r, s] for (f, r), s in sorted(self.uploads.items())],
            "last_dropped": [[f, s] for f, s in sorted(self.last_dropped.items())],
            "step_time": self.step_time.to_dict(),
        }

    @classmethod
    def from_json(cls, island: str, d: dict, now: float) -> IslandRecord:
        isl = cls(island=island, world_size=d["world_size"], last_seen=now)
        isl.last_step, isl.merged, isl.dropped = d["last_step"], d["merged"], d["dropped"]
        isl.tokens_merged = d["tokens_merged"]
        isl.steps_merged = d.get("steps_merged", 0)
        isl.steps_dropped = d.get("steps_dropped", 0)
        isl.joined_at = d.get("joined_at", time.time())
        isl.left_at = d.get("left_at")
        isl.registrations = d.get("registrations", 1)
        isl.finishing = d.get("finishing", False)
        isl.uploads = {(f, r): s for f, r, s in d["uploads"]}
        # (else a contribution whose ranks were dropped on both sides of a restart counted twice)
        isl.last_dropped = {f: s for f, s in d.get("last_dropped", [])}
        isl.step_time = Ema.from_dict(d["step_time"])
        return isl


def merged_by_after(old: dict[str, dict], counted) -> dict[str, dict]:
    """A fragment's ``merged_by`` after merging the contributions ``counted``."""
    new = dict(old)
    for c in counted:
        m = new.get(c.island, {"merges": 0, "tokens": 0, "steps": 0})
        new[c.island] = {"incarnation": c.incarnation, "world_size": c.world_size,
                         "step": c.step, "merges": m["merges"] + 1,
                         "tokens": m["tokens"] + c.tokens, "steps": m["steps"] + c.steps}  # fmt: skip
    return new


def merges_on_disk(state: dict, index: int, version: int) -> int:
    """Fragment ``index``'s merge count from a state dir: the table's, plus the merges made
    durable (its file at ``version``) after the table's last save."""
    merges, merges_at = state["merges"][index], state.get("merges_at")
    return merges + (max(0, version - merges_at[index]) if merges_at is not None else 0)


def islands_on_disk(state: dict, merged_by: list[dict], now: float) -> dict[str, IslandRecord]:
    """The island table of a state dir, brought up to its fragment files' ``merged_by``
    (the coordinator's load, and an export from the state dir)."""
    islands = {k: IslandRecord.from_json(k, v, now) for k, v in state["islands"].items()}
    restore_merge_marks(islands, merged_by, now)
    return islands


def restore_merge_marks(
    islands: dict[str, IslandRecord], merged_by: list[dict], now: float
) -> None:
    """Bring the island table (saved now and then) up to the fragment files (written with
    every merge): a contribution merged after the table's last save is a replay if sent
    again (it was merged twice after a crash), and counts as merged. An island merged but
    not in the table (taken as registered from an upload since its last save:
    ``Coordinator._adopt_unknown``) is put back in it."""
    for name in sorted({n for m in merged_by for n in m} - islands.keys()):
        if all("world_size" in m[name] for m in merged_by if name in m):
            islands[name] = IslandRecord(island=name, world_size=1, last_seen=now, registrations=0)
    for name, isl in islands.items():
        marks = [(f, m[name]) for f, m in enumerate(merged_by) if name in m]
        if not marks:
            continue
        for key in ("merges", "tokens", "steps"):  # per fragment, over all registrations
            total = sum(m[key] for _, m in marks)
            attr = {"merges": "merged", "tokens": "tokens_merged", "steps": "steps_merged"}[key]
            setattr(isl, attr, max(getattr(isl, attr), total))
        latest = max(m["incarnation"] for _, m in marks)
        if latest > isl.registrations and "world_size" in marks[0][1]:
            # Merged from a registration the table never saved (taken from an upload, the
            # state put back from a backup: Coordinator._adopt_registration).
            isl.registrations = latest
            isl.world_size = next(m["world_size"] for _, m in marks if m["incarnation"] == latest)
            isl.uploads.clear()
            isl.last_dropped.clear()
        for f, m in marks:
            if m["incarnation"] != isl.registrations:
                continue  # registered again since: it may count its steps from a checkpoint
            isl.last_step = max(isl.last_step, m["step"])
            for rank in range(isl.world_size):
                isl.uploads[(f, rank)] = max(isl.uploads.get((f, rank), -1), m["step"])
