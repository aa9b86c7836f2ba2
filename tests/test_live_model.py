"""What a run does with the live global model every N merges (live_model.EveryMerges)."""

from __future__ import annotations

import threading

from ds_diloco.live_model import EveryMerges


class Recorder(EveryMerges):
    def __init__(self, every: int):
        super().__init__(every)
        self.calls: list[tuple[int, bool]] = []  # (merges, in a thread of its own)

    def work(self, merges: int) -> None:
        self.calls.append((merges, threading.current_thread() is not threading.main_thread()))


def status(*merges: int) -> dict:
    return {"merges": list(merges)}


def test_work_runs_in_the_background_at_each_multiple_passed_and_once_more_at_the_end():
    r = Recorder(8)
    r.maybe(status(3, 4))  # 7: not yet
    r.maybe(None)  # no status (the coordinator restarting): nothing
    r.maybe(status(4, 5))  # 9: passed 8
    r.join()
    r.maybe(status(5, 5))  # 10: the next is at 16
    r.maybe(status(12, 13))  # 25: passed 16 and 24, one call
    r.join()
    assert r.calls == [(9, True), (25, True)]
    r.finish(status(13, 13))  # 26 > 25: the final model, here
    r.finish(status(13, 13))  # nothing new since
    assert r.calls == [(9, True), (25, True), (26, False)]


def test_a_resumed_run_goes_on_after_the_merges_made_already_and_zero_means_never():
    r = Recorder(10)
    r.resume_at(23)
    r.maybe(status(12, 12))  # 24: below the next multiple, 30
    r.finish(status(12, 11))  # 23: nothing since the resume
    assert r.calls == []
    r.maybe(status(15, 15))
    r.join()
    assert r.calls == [(30, True)]
    never = Recorder(0)
    never.maybe(status(100))
    never.finish(status(200))
    assert never.calls == []
