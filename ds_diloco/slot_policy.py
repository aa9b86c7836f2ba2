"""Which device slots an island's next launch runs on: downscaling around a failed slot.

A ZeRO-3 island cannot go on without one of its ranks, so a rank that dies takes its
whole launch down (``ds-diloco run`` restarts it). When the rank of the same slot (a GPU,
or on CPU a process place) is the first to die in ``after`` launches in a row, the slot
is the likely cause (a GPU that fails again at start, or an ECC error): the island is
restarted on the slots left, and goes on with fewer ranks from its checkpoint
(``zero.load_checkpoint``, DeepSpeed's universal format) instead of failing on that slot
until ``max_restarts`` gives the island up. A slot left out comes back at the island's
first launch after ``quarantine_s`` (its repair time; the supervisor stops a smaller
launch after its next checkpoint for that); the island's last slot is never left out.
Pure functions: the supervisor (``run.LocalRun``) keeps the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SlotState:
    """One island's record: its slots, the failing streak, and the slots left out."""

    slots: tuple[int, ...]
    """Every slot the island was given (its ``include``, or 0..world_size-1)."""
    streak: tuple[int, int] | None = None
    """(slot, launches in a row whose first rank to die was that slot's)."""
    out_until: dict[int, float] = field(default_factory=dict)
    """Slots left out, and until when (a monotonic time)."""


def after_death(
    state: SlotState, launched: tuple[int, ...], first_dead: int | None, after: int,
    quarantine_s: float, now: float,
) -> tuple[SlotState, int | None, str]:  # fmt: skip
    """A launch on ``launched`` died and ``first_dead`` is the local rank seen dying first
    (None: not known, e.g. every rank went at once). Returns the new state, the slot left
    out from now on (or None) and the reason, in words."""
    if first_dead is None or not 0 <= first_dead < len(launched):
        return state, None, "no rank was seen dying first"
    slot = launched[first_dead]
    count = state.streak[1] + 1 if state.streak and state.streak[0] == slot else 1
    why = (f"rank {first_dead} (slot {slot}) was the first to die in {count} "
           f"launch{'es' if count > 1 else ''} in a row")  # fmt: skip
    counted = SlotState(state.slots, (slot, count), dict(state.out_until))
    if after <= 0 or count < after:
        return counted, None, why
    if len(launched) <= 1:
        return counted, None, f"{why}, but it is the island's last slot"
    out = {**state.out_until, slot: now + quarantine_s}
    return SlotState(state.slots, None, out), slot, why


def launch_slots(
    state: SlotState, now: float
) -> tuple[SlotState, tuple[int, ...], tuple[int, ...]]:
    """The slots the island's next launch runs on: all but those still left out. Returns
    the new state (slots whose time is up are forgotten), the slots, and the slots that
    came back for this launch."""
    back = tuple(s for s, until in state.out_until.items() if until <= now)
    out = {s: until for s, until in state.out_until.items() if until > now}
    slots = tuple(s for s in state.slots if s not in out)
    return SlotState(state.slots, state.streak, out), slots, back
