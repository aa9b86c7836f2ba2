"""``ds-diloco eval``: the held-out loss of the global model, from a state dir or a live
coordinator (a watch every N merges), on the islands' own held-out blocks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SIGINT_IGNORED
from transformers import AutoConfig, AutoModelForCausalLM

from ds_diloco import wire
from ds_diloco.cli import main as cli_main
from ds_diloco.client import CoordinatorClient, rank_slices
from ds_diloco.config import CoordinatorConfig, ModelSource, load_data_config
from ds_diloco.coordinator import Coordinator
from ds_diloco.fragments import FragmentPlan
from ds_diloco.global_eval import heldout_blocks
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread

REPO = Path(__file__).resolve().parents[1]
TOKEN = "eval-token"


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "island.yaml"  # only its data section is read
    path.write_text(yaml.safe_dump({"data": {
        "path": str(REPO / "tests" / "data"), "vocab_size": 512, "seq_len": 32,
        "cache_dir": str(tmp_path / "cache"), "heldout_fraction": 0.05}}))  # fmt: skip
    return path


def _coord_cfg(tiny_config_path, state_dir) -> CoordinatorConfig:
    return CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0), state_dir=str(state_dir),
        num_fragments=2, sync_every=2, policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        token=TOKEN,
    )  # fmt: skip


def _loss(tiny_config_path, tensors, blocks) -> float:
    """The mean next-token loss, computed apart from ds_diloco's own helpers."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_config_path))
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=blocks[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()))


def test_eval_of_a_state_dir_is_the_loss_of_its_model_on_the_islands_heldout_blocks(
    tiny_config_path, data_file, tmp_path, capsys
):
    coord = Coordinator(_coord_cfg(tiny_config_path, tmp_path / "state"))
    out = tmp_path / "evals.jsonl"
    code = cli_main(["eval", "--from", str(tmp_path / "state"), "--data", str(data_file),
                     "--blocks", "8", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    blocks = heldout_blocks(load_data_config(data_file), 8)
    assert blocks.shape == (8, 33)
    want = _loss(tiny_config_path, coord.global_tensors(), blocks)
    assert abs(record["heldout_loss"] - want) < 1e-5, (record, want)
    assert record["merges"] == 0 and record["versions"] == [0, 0] and record["blocks"] == 8
    assert f"global model at 0 merges (versions 0..0): held-out loss {want:.4f}" in (
        capsys.readouterr().out
    )
    # More blocks than the held-out split has: the figure is on those, and says so.
    have = len(heldout_blocks(load_data_config(data_file), 10_000))
    code = cli_main(["eval", "--from", str(tmp_path / "state"), "--data", str(data_file),
                     "--blocks", "10000", "--json", str(out)])  # fmt: skip
    assert code == 0
    assert json.loads(out.read_text().splitlines()[-1])["blocks"] == have < 10_000
    assert f"the held-out split has {have} blocks: evaluating those, not --blocks 10000" in (
        capsys.readouterr().out
    )


def test_heldout_ids_beyond_the_models_vocabulary_are_named_in_one_line(
    tiny_config_path, tmp_path, capsys
):
    # Another run's data section, its tokenizer larger than the model's 512 ids: an
    # IndexError traceback from the embedding once the model had been read.
    Coordinator(_coord_cfg(tiny_config_path, tmp_path / "state"))
    data = tmp_path / "other.yaml"
    data.write_text(yaml.safe_dump({"data": {
        "path": str(REPO / "tests" / "data"), "vocab_size": 1024, "seq_len": 32,
        "cache_dir": str(tmp_path / "cache"), "heldout_fraction": 0.05}}))  # fmt: skip
    top = int(heldout_blocks(load_data_config(data), 8).max())
    assert top >= 512
    code = cli_main(
        ["eval", "--from", str(tmp_path / "state"), "--data", str(data), "--blocks", "8"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"ds-diloco: error: the held-out blocks hold token id {top}, beyond the model's "
        "vocab_size 512: the data section's tokenizer is not the model's"
    )


def test_a_watch_evaluates_now_and_after_every_n_merges(tiny_config_path, data_file, tmp_path):
    srv = ServerThread(_coord_cfg(tiny_config_path, tmp_path / "state"))
    out = tmp_path / "evals.jsonl"
    codes = []
    argv = ["eval", "--from", srv.url, "--data", str(data_file), "--blocks", "4", "--token",
            TOKEN, "--every-merges", "2", "--count", "2", "--poll-s", "0.05", "--json", str(out),
            "--tensorboard", str(tmp_path / "tb")]  # fmt: skip
    watch = threading.Thread(target=lambda: codes.append(cli_main(argv)))
    try:
        watch.start()
        client = CoordinatorClient(srv.url, TOKEN, retries=0)
        inc = client.register("a", 1, srv.coord.plan.signature)["incarnation"]
        for _ in range(600):  # the first evaluation: at 0 merges
            if out.exists() and out.read_text():
                break
            watch.join(0.05)
        step = 0
        for _ in range(2):  # 2 merges per round of both fragments: due again
            step += 2
            for frag in srv.coord.plan.fragments:
                g = torch.Generator().manual_seed(step * 10 + frag.index)
                delta = {p.name: torch.randn(p.numel, generator=g) * 1e-2 for p in frag.params}
                header = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=frag.index,
                                           base_version=srv.coord.versions()[frag.index],
                                           step=step, tokens=64, steps=2, incarnation=inc)  # fmt: skip
                assert client.upload(header, rank_slices(frag, delta, 1, 0))["status"] == "accepted"
                for _ in range(200):
                    if srv.coord.versions()[frag.index] == step // 2:
                        break
                    watch.join(0.02)
        watch.join(60)
        assert not watch.is_alive() and codes == [0]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 2 and records[0]["merges"] == 0 and records[1]["merges"] >= 2, (
            records
        )
        assert records[0]["heldout_loss"] != records[1]["heldout_loss"]
    finally:
        srv.stop(save=False)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert len(board.Scalars("global/heldout_loss")) == 2


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_watch_goes_on_through_a_coordinator_outage_during_an_evaluation(
    tiny_config_path, data_file, tmp_path, capsys
):
    # An outage (a restart) that came while an evaluation downloaded the model ended the
    # watch with "cannot reach the coordinator"; one during a status poll did not.
    from urllib.parse import urlsplit

    from ds_diloco.chaos.proxy import ChaosProxy

    srv = ServerThread(_coord_cfg(tiny_config_path, tmp_path / "state"))
    where = urlsplit(srv.url)
    proxy = ChaosProxy(where.hostname, where.port).start()
    client = CoordinatorClient(srv.url, TOKEN, retries=0)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    client.register("a", 1, plan.signature)
    merging, steps = threading.Event(), [0]

    def merge_all_the_time():  # evaluations one after the other: the watch is mostly in one
        while not merging.is_set():
            versions = client.versions()
            for frag in plan.fragments:
                steps[0] += 1
                header = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=frag.index,
                                           base_version=versions[frag.index], step=steps[0],
                                           tokens=64, steps=1)  # fmt: skip
                deltas = {s.name: 1e-3 * torch.randn(s.shape) for s in frag.params}
                client.upload(header, rank_slices(frag, deltas, 1, 0))
            time.sleep(0.02)

    out, log = tmp_path / "evals.jsonl", tmp_path / "watch.log"
    argv = [sys.executable, "-c", SIGINT_IGNORED, "eval", "--from", proxy.url, "--data",
            str(data_file), "--every-merges", "1", "--poll-s", "0.01", "--token", TOKEN,
            "--json", str(out)]  # fmt: skip
    merger = threading.Thread(target=merge_all_the_time, daemon=True)
    merger.start()
    with open(log, "w") as f:
        watch = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait(lambda: out.is_file(), 60, "the first evaluation")
        # Slowed down, a download the coordinator has served is still on its way when the
        # link is cut: the outage comes in the middle of an evaluation.
        proxy.set(delay_s=0.3)
        served = srv.coord.traffic["download_bytes"]
        _wait(lambda: srv.coord.traffic["download_bytes"] > served, 30, "an evaluation")
        proxy.set(drop=True)
        # Down until the evaluation has given up (the client's retries: 6.2 s of backoff
        # and each attempt's own time): a fixed 7.5 s left about a second for 6 attempts
        # through a proxy in this busy process, and an evaluation still retrying when the
        # link came back was answered ("no evaluation from" never came).
        _wait(lambda: "no evaluation from" in log.read_text(), 60, "the evaluation to give up")
        proxy.set(drop=False)
        seen = len(out.read_text().splitlines())
        _wait(lambda: len(out.read_text().splitlines()) > seen, 30, "an evaluation after")
        assert watch.poll() is None, log.read_text()
        assert "no evaluation from" in log.read_text()
    finally:
        merging.set()
        merger.join()
        if watch.poll() is None:
            watch.send_signal(signal.SIGINT)  # the way a watch ends
        code = watch.wait(30)
        proxy.close()
        srv.stop(save=False)
    assert code == 0, log.read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--every-merges", "2"], "--every-merges needs a running coordinator's URL"),
        (["--every-merges", "0"], "--every-merges must be >= 1, got 0"),
        (["--blocks", "0"], "held-out blocks: need at least 1, got 0"),
        # Not a RuntimeError or AssertionError traceback once the model was read.
        (["--device", "banana"], "--device 'banana' is not a device (cpu, cuda, cuda:1, ...)"),
        (["--device", f"cuda:{torch.cuda.device_count()}"], "CUDA device(s)"),
    ],
)
def test_eval_refuses_bad_arguments_in_one_line(tmp_path, data_file, capsys, extra, message):
    code = cli_main(["eval", "--from", str(tmp_path), "--data", str(data_file), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_output_folders_that_are_files_are_refused_before_the_command_runs(
    tmp_path, data_file, capsys
):
    """eval --tensorboard, chaos and bench quality's --workdir: a file, or below one, was a
    FileExistsError or NotADirectoryError traceback once the work had begun."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    run = tmp_path / "run.yaml"  # never read: refused first
    for argv in (["eval", "--from", str(tmp_path), "--data", str(data_file), "--tensorboard"],
                 ["chaos", str(run), "--workdir"], ["bench", "quality", "--workdir"]):  # fmt: skip
        for path in (a_file, a_file / "below"):
            assert cli_main([*argv, str(path)]) == 2, argv
            err = capsys.readouterr().err
            assert err == f"ds-diloco: error: {argv[-1]} {path}: {a_file} is a file, not a folder\n"


def test_eval_needs_a_file_with_a_data_section_and_a_token_for_a_url(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DS_DILOCO_TOKEN", raising=False)
    bare = tmp_path / "c.yaml"
    bare.write_text("model: {config: x}\n")
    assert cli_main(["eval", "--from", str(tmp_path), "--data", str(bare)]) == 2
    assert "has no data section (a run or island file has one)" in capsys.readouterr().err
    assert cli_main(["eval", "--from", "http://127.0.0.1:9", "--data", str(bare)]) == 2
    assert "no bearer token for http://127.0.0.1:9" in capsys.readouterr().err
