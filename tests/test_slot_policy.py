"""Downscaling an island around a failed slot: the pure policy (ds_diloco.slot_policy)."""

from __future__ import annotations

from ds_diloco.slot_policy import SlotState, after_death, launch_slots


def test_a_slot_whose_rank_dies_first_in_launches_in_a_row_is_left_out_until_its_repair():
    state = SlotState((0, 1, 2, 3))
    state, out, why = after_death(state, (0, 1, 2, 3), 2, after=2, quarantine_s=60, now=10)
    assert out is None and why == "rank 2 (slot 2) was the first to die in 1 launch in a row"
    state, slots, back = launch_slots(state, now=11)
    assert slots == (0, 1, 2, 3) and back == ()
    state, out, why = after_death(state, slots, 2, after=2, quarantine_s=60, now=12)
    assert out == 2 and why.endswith("in 2 launches in a row"), why
    state, slots, back = launch_slots(state, now=13)
    assert slots == (0, 1, 3) and back == ()
    # On the smaller launch, local rank 2 is slot 3: its streak starts at 1.
    state, out, why = after_death(state, slots, 2, after=2, quarantine_s=60, now=14)
    assert out is None and why.startswith("rank 2 (slot 3) was the first to die in 1 launch")
    state, slots, back = launch_slots(state, now=71.9)  # 12 + 60: not yet
    assert slots == (0, 1, 3) and back == ()
    state, slots, back = launch_slots(state, now=72)  # repaired
    assert slots == (0, 1, 2, 3) and back == (2,) and state.out_until == {}


def test_another_slot_or_an_unknown_first_death_starts_no_streak_of_the_same_slot():
    state = SlotState((0, 1))
    state, out, _ = after_death(state, (0, 1), 1, after=2, quarantine_s=60, now=0)
    state, out, _ = after_death(state, (0, 1), 0, after=2, quarantine_s=60, now=1)
    assert out is None and state.streak == (0, 1)
    same, out, why = after_death(state, (0, 1), None, after=2, quarantine_s=60, now=2)
    assert out is None and same.streak == (0, 1) and why == "no rank was seen dying first"
    for rank in (2, -1):  # not a rank of this launch: unknown too (-1 is not the last slot)
        same, out, why = after_death(state, (0, 1), rank, after=2, quarantine_s=60, now=2)
        assert (out, same.streak, why) == (None, (0, 1), "no rank was seen dying first"), rank
    _, out, _ = after_death(state, (0, 1), 0, after=2, quarantine_s=60, now=3)
    assert out == 0


def test_the_last_slot_is_never_left_out_and_zero_never_downscales():
    state = SlotState((0, 1))
    _, out, why = after_death(state, (1,), 0, after=1, quarantine_s=60, now=0)
    assert out is None and why.endswith("but it is the island's last slot"), why
    for _ in range(3):
        state, out, _ = after_death(state, (0, 1), 1, after=0, quarantine_s=60, now=0)
        assert out is None
    assert launch_slots(state, now=1)[1] == (0, 1)
