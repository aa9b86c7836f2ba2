from __future__ import annotations

import pytest

from ds_diloco.round_policy import (
    Decision,
    Ema,
    PolicyOptions,
    RoundState,
    decide,
    grace_window,
)


def _state(**kw) -> RoundState:
    base = {
        "live_islands": 3,
        "contributors": 1,
        "first_arrival": 10.0,
        "quorum_at": 10.0,
        "xi_step": 1.0,
        "xi_quorum": 0.2,
        "xi_sync": 0.3,
    }
    return RoundState(**{**base, **kw})


def test_no_contribution_waits_without_deadline():
    d = decide(5.0, _state(contributors=0, first_arrival=None, quorum_at=None), PolicyOptions())
    assert d == Decision(False, None, "no contribution yet")


def test_below_quorum_waits():
    d = decide(11.0, _state(contributors=1, quorum_at=None), PolicyOptions(min_quorum=3))
    assert not d.merge and d.wait_until is None
    assert d.reason == "quorum 1/3 (K=3)"


def test_final_contributions_neither_make_the_quorum_nor_close_the_round():
    """Islands that finished (their final flush) are not live and wait for no result."""
    only = _state(live_islands=2, contributors=1, passive=1, quorum_at=None)
    d = decide(11.0, only, PolicyOptions(min_quorum=1))
    assert d == Decision(
        False, None, "only final contributions (1): waiting for one of the 2 live islands"
    )
    # A live island's upload counts as the first: quorum 1/1, grace, then merged with the final.
    one = _state(live_islands=2, contributors=2, passive=1, quorum_at=10.0)
    assert not decide(
        10.5, one, PolicyOptions(min_quorum=1)
    ).merge  # grace 0.5 x (2 x 1 - 0.5) = 0.75 s
    assert decide(10.8, one, PolicyOptions(min_quorum=1)).merge
    assert not decide(10.8, one, PolicyOptions(min_quorum=2)).merge  # 1 of K=2 live ones
    all_in = _state(live_islands=1, contributors=2, passive=1)
    d = decide(10.0, all_in, PolicyOptions(min_quorum=1))
    assert d == Decision(True, None, "all 1 live islands in + 1 final")
    nobody = _state(live_islands=0, contributors=2, passive=2, quorum_at=None)
    d = decide(10.0, nobody, PolicyOptions(min_quorum=3))
    assert d == Decision(True, None, "only final contributions (2), no live island left")
    # Another island finishing (its flush under way) may still send its final upload of
    # this fragment: waited for, at most the grace window's cap after the first final.
    flushing = _state(live_islands=0, contributors=1, passive=1, finishing=1, first_final=10.0)
    d = decide(12.0, flushing, PolicyOptions(max_grace_s=5.0))
    assert not d.merge and d.wait_until == 15.0 and "1 finishing island(s)" in d.reason
    d = decide(15.0, flushing, PolicyOptions(max_grace_s=5.0))
    assert d.merge and "sent none within 5s" in d.reason


def test_synchronous_when_k_equals_live_islands():
    opts = PolicyOptions(min_quorum=3)
    for c in (1, 2):
        d = decide(100.0, _state(contributors=c, quorum_at=None), opts)
        assert not d.merge and d.reason == f"quorum {c}/3 (K=3)"
    d = decide(100.0, _state(contributors=3), opts)
    assert d.merge and d.reason == "all 3 live islands in"


def test_quorum_capped_by_live_islands():
    # K=3 but one island died: two live islands must not wait for it.
    opts = PolicyOptions(min_quorum=3)
    d = decide(11.0, _state(live_islands=2, contributors=1, quorum_at=None), opts)
    assert not d.merge and d.reason == "quorum 1/2 (K=3 capped to 2 live islands)"
    d = decide(11.0, _state(live_islands=2, contributors=2), opts)
    assert d.merge and d.reason == "all 2 live islands in"


def test_contribution_from_island_that_died_since_is_merged():
    d = decide(11.0, _state(live_islands=0, contributors=1), PolicyOptions(min_quorum=2))
    assert d.merge and "all 0 live islands in" in d.reason


def test_quorum_reached_waits_for_grace_then_merges():
    opts = PolicyOptions(min_quorum=1, grace_gamma=0.5, tau=2)
    # slack = 2 * 1.0 - (0.2 + 0.3) = 1.5; grace = 0.75
    st = _state(contributors=1, quorum_at=10.0)
    d = decide(10.25, st, opts)
    assert not d.merge
    assert d.wait_until == pytest.approx(10.75)
    assert "quorum 1/1 (K=1) reached" in d.reason and "waiting 0.500s" in d.reason
    assert "grace 0.750s" in d.reason
    why = "gamma 0.5 x max(2 x step 1.000s - (quorum 0.200s + sync 0.300s), 0)"
    assert d.reason == (
        "quorum 1/1 (K=1) reached, 1/3 live islands in; waiting 0.500s more for stragglers: "
        f"grace 0.750s = {why}"
    )
    d = decide(10.75, st, opts)
    assert d.merge and d.wait_until is None
    assert (
        d.reason
        == f"quorum 1/1 (K=1) reached, 1/3 live islands in; grace over: grace 0.750s = {why}"
    )


def test_quorum_at_missing_counts_from_now():
    opts = PolicyOptions(min_quorum=2)
    d = decide(20.0, _state(contributors=2, quorum_at=None), opts)
    assert not d.merge and d.wait_until == pytest.approx(20.75)


def test_zero_grace_merges_as_soon_as_quorum_is_reached():
    d = decide(10.0, _state(contributors=1), PolicyOptions(grace_gamma=0.0))
    assert d.merge and "grace disabled" in d.reason
    d = decide(10.0, _state(contributors=1, xi_step=None), PolicyOptions())
    assert d.merge and "no step-time estimate yet" in d.reason


def test_grace_window_numbers_and_cap():
    opts = PolicyOptions(grace_gamma=0.5, tau=2, max_grace_s=5.0)
    g, why = grace_window(_state(xi_step=1.0, xi_quorum=0.2, xi_sync=0.3), opts)
    assert g == pytest.approx(0.75)
    assert (
        why == "grace 0.750s = gamma 0.5 x max(2 x step 1.000s - (quorum 0.200s + sync 0.300s), 0)"
    )
    # Unknown quorum / sync times count as 0.
    g, _ = grace_window(_state(xi_step=1.0, xi_quorum=None, xi_sync=None), opts)
    assert g == pytest.approx(1.0)
    # No slack left: no grace.
    g, _ = grace_window(_state(xi_step=1.0, xi_quorum=1.5, xi_sync=1.0), opts)
    assert g == 0.0
    # Capped.
    g, why = grace_window(_state(xi_step=100.0, xi_quorum=0.0, xi_sync=0.0), opts)
    assert g == 5.0 and "capped" in why and "100.000s" in why
    assert grace_window(_state(xi_step=None), opts) == (0.0, "no step-time estimate yet")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_quorum": 0}, "min_quorum"),
        ({"grace_gamma": 1.0}, "grace_gamma"),
        ({"grace_gamma": -0.1}, "grace_gamma"),
        ({"max_grace_s": -1.0}, "max_grace_s"),
        ({"tau": 0}, "tau"),
    ],
)
def test_options_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"PolicyOptions.{field}"):
        PolicyOptions(**kwargs)


def test_round_state_validation():
    with pytest.raises(ValueError, match="live_islands"):
        RoundState(live_islands=-1, contributors=0)
    with pytest.raises(ValueError, match="passive"):
        RoundState(live_islands=1, contributors=1, passive=2)


def test_ema():
    e = Ema(alpha=0.5)
    assert e.value is None
    assert e.update(4.0) == 4.0  # the first sample is taken as is
    assert e.update(2.0) == pytest.approx(3.0)
    assert e.update(3.0) == pytest.approx(3.0)
    e2 = Ema.from_dict(e.to_dict())
    assert e2.value == e.value and e2.alpha == 0.5
    assert e2.update(5.0) == e.update(5.0) == pytest.approx(4.0)
    assert Ema.from_dict(Ema().to_dict()).value is None
    with pytest.raises(ValueError, match="alpha"):
        Ema(alpha=0.0)
    with pytest.raises(ValueError, match="finite"):
        e.update(float("nan"))


def test_after_the_grace_window_the_round_waits_for_islands_expected_soon():
    # Grace here: 0.5 x (2 x 1.0 - 0.5) = 0.75 s after the quorum at t = 10.
    opts = PolicyOptions(grace_gamma=0.5, tau=2, wait_expected_steps=4)
    state = _state(expected=(12.5, 30.0))  # one island 2.5 steps behind, one far behind
    d = decide(11.0, state, opts)
    assert not d.merge and d.wait_until == 14.0  # first arrival + 4 steps of 1 s
    assert d.reason == (
        "quorum 1/1 (K=1) reached, 1/3 live islands in; grace over, waiting "
        "3.000s more: 1 live island(s) expected within 4 x step 1.000s"
    )
    assert decide(14.0, state, opts).merge  # it did not come: closed at the bound
    # It came (the coordinator no longer lists it): nobody else is expected soon.
    d = decide(12.6, _state(contributors=2, quorum_at=10.0, expected=(30.0,)), opts)
    assert d.merge and d.reason == (
        "quorum 2/1 (K=1) reached, 2/3 live islands in; grace over: grace 0.750s = gamma 0.5 x "
        "max(2 x step 1.000s - (quorum 0.200s + sync 0.300s), 0); no live island expected "
        "within 4 x step 1.000s"
    )
    # Off (the paper's rule, the default): the grace window alone.
    assert decide(11.0, state, PolicyOptions(grace_gamma=0.5, tau=2)).merge
    with pytest.raises(ValueError, match="wait_expected_steps must be >= 0"):
        PolicyOptions(wait_expected_steps=-1)
