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


def test_a_periodic_export_is_named_after_the_merges_it_holds(tmp_path, tiny_config_path, capsys):
    # Named after the merges that set it off, it held those made before its download too:
    # "exports/merges-6", its card "7 merges in all", beside "[eval] ... at 7 merges".
    import json
    import types

    from conftest import write_run_file
    from test_export import TOKEN, make_cfg, merge_one_round

    from ds_diloco.config import load_run_config
    from ds_diloco.data import prepare_section
    from ds_diloco.live_model import PeriodicExport
    from ds_diloco.server import ServerThread

    cfg = load_run_config(write_run_file(tmp_path, tiny_config_path, [{"name": "a"}], steps=1))
    prepare_section(cfg.data)  # the run's tokenizer, as the run prepares it first
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "state"))
    try:
        merge_one_round(srv)  # 4 merges, one per fragment
        lr = types.SimpleNamespace(url=srv.url, token=TOKEN, ca_file=None, workdir=tmp_path)
        PeriodicExport(cfg, lr).work(3)  # set off at 3 merges
    finally:
        srv.stop()
    out = tmp_path / "exports" / "merges-4"
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["merges-4"]
    assert f"[export] {out}" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "# merges-4" in card and "(4 fragments, 4 merges in all)" in card
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
