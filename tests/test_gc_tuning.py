"""The garbage collector around our processes' set-up and exit (ds_diloco.gc_tuning)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from ds_diloco import cli, gc_tuning


@pytest.fixture
def clean_gc():
    """Each test starts with automatic collection on and nothing frozen, and leaves it so."""
    gc.enable()
    gc.unfreeze()
    yield
    gc.enable()
    gc.unfreeze()


def test_set_up_runs_without_collections_and_the_loop_with_them_over_frozen_survivors(clean_gc):
    kept = []
    with gc_tuning.paused_for_setup():
        assert not gc.isenabled()
        kept.append([object() for _ in range(1000)])
        cycle = []
        cycle.append(cycle)  # garbage that only the collector frees
        del cycle
        gc_tuning.resume_after_setup()
        assert gc.isenabled() and gc.get_freeze_count() >= 1000
        assert gc.collect() == 0  # the set-up's cycle went before the freeze
    assert gc.isenabled()


def test_a_set_up_that_fails_turns_collection_back_on(clean_gc, tmp_path, capsys):
    with pytest.raises(RuntimeError), gc_tuning.paused_for_setup():
        raise RuntimeError("no engine")
    assert gc.isenabled()
    # The CLI's own failure path: a bad coordinator file is refused during set-up.
    assert cli.main(["coordinator", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_paused_block_leaves_collection_off_if_it_was_off(clean_gc):
    gc.disable()
    with gc_tuning.paused_for_setup():
        pass
    assert not gc.isenabled()


def test_the_program_freezes_every_object_before_it_exits(clean_gc, monkeypatch):
    # What the interpreter's exit would walk once more (3.0 s in a rank, measured; 0.3 s
    # frozen): ``ds-diloco`` and ``python -m ds_diloco.cli`` run ``program``.
    monkeypatch.setattr(cli, "main", lambda: 0)
    assert cli.program() == 0
    assert gc.get_freeze_count() >= len(gc.get_objects()) // 2, gc.get_freeze_count()


def test_an_island_rank_leaves_without_the_interpreters_teardown(tmp_path):
    # Its work done, a rank exits at once with its code, what it wrote flushed: an atexit
    # handler (like the C++ destructors of interpreter teardown) never runs.
    script = (
        "import atexit, logging, sys\n"
        "from ds_diloco import cli\n"
        "def island(args):\n"
        "    atexit.register(lambda: print('teardown ran', flush=True))\n"
        "    logging.getLogger('x').warning('logged before the exit')\n"
        "    print('printed before the exit', end='')\n"
        "    cli._exit_at_once = True\n"
        "    return 3\n"
        "cli._island = island\n"
        "sys.argv = ['ds-diloco', 'island', '--config', 'unused.yaml']\n"
        "sys.exit(cli.program())\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "printed before the exit", proc.stdout
    assert "logged before the exit" in proc.stderr, proc.stderr


def test_the_island_command_leaves_at_once_when_done_or_superseded_only(clean_gc, monkeypatch):
    # ``ds-diloco island`` sets the flag ``program`` reads: after a finished run or a
    # Superseded stop (exit 3, the supervisor must not restart it), not after a failure,
    # whose traceback and teardown the launcher should see as usual.
    from ds_diloco import config, island
    from ds_diloco.syncer import Superseded

    monkeypatch.setattr(config, "load_island_config", lambda path: f"loaded {path}")
    runs = []

    def finish(cfg, plain):
        runs.append((cfg, plain))

    def superseded(cfg, plain):
        raise Superseded("registered again elsewhere")

    def crash(cfg, plain):
        raise RuntimeError("a rank failed")

    for run_island, code in ((finish, 0), (superseded, Superseded.exit_code), (crash, None)):
        monkeypatch.setattr(cli, "_exit_at_once", False)
        monkeypatch.setattr(island, "run_island", run_island)
        if code is None:
            with pytest.raises(RuntimeError, match="a rank failed"):
                cli.main(["island", "--config", "i.yaml", "--plain"])
            assert not cli._exit_at_once
        else:
            assert cli.main(["island", "--config", "i.yaml", "--plain"]) == code
            assert cli._exit_at_once, run_island.__name__
    assert runs == [("loaded i.yaml", True)]
