"""``ds-diloco status URL`` against a real coordinator on a real port, fed real uploads."""

from __future__ import annotations

import http.server
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import SIGINT_IGNORED

from ds_diloco import wire
from ds_diloco.cli import main as cli_main
from ds_diloco.client import CoordinatorClient, rank_slices
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.fragments import FragmentPlan
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread
from ds_diloco.status_view import StatusError, process_text, render

TOKEN = "status-token"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def server(tiny_config_path, tmp_path):
    cfg = CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0), state_dir=str(tmp_path / "state"),
        num_fragments=2, sync_every=2, policy=PolicyOptions(min_quorum=2, grace_gamma=0.0, tau=1),
        token=TOKEN,
    )  # fmt: skip
    srv = ServerThread(cfg)
    yield srv
    srv.stop()


def _upload(client, plan, island, world_size, rank, frag, incarnation, seed):
    g = torch.Generator().manual_seed(seed)
    delta = {p.name: torch.randn(p.numel, generator=g) * 1e-3 for p in frag.params}
    header = wire.UploadHeader(
        island=island, rank=rank, world_size=world_size, fragment=frag.index, base_version=0,
        step=2, tokens=512, steps=2, incarnation=incarnation,
    )  # fmt: skip
    reply = client.upload(header, rank_slices(frag, delta, world_size, rank))
    assert reply["status"] == "accepted", reply


def _status(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(["status", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_status_shows_islands_open_rounds_and_merges(server, capsys):
    client = CoordinatorClient(server.url, TOKEN, retries=0)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    inc = {
        i: client.register(i, ws, plan.signature)["incarnation"] for i, ws in (("a", 1), ("b", 2))
    }
    for frag in plan.fragments:  # a: complete everywhere; b: rank 0 of fragment 0 only
        _upload(client, plan, "a", 1, 0, frag, inc["a"], seed=frag.index)
    _upload(client, plan, "b", 2, 0, plan.fragments[0], inc["b"], seed=10)

    code, text, _ = _status(capsys, server.url, "--token", TOKEN)
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0] == (f"coordinator {server.url}  fragments 2  versions 0  merges 0 "
                        "(0 per fragment, 0 failed)")  # fmt: skip
    row = {ln.split()[0]: ln.split() for ln in lines if ln.split()[:1] in (["a"], ["b"])}
    assert row["a"][1:4] == ["1", "live", "2"] and row["b"][1:3] == ["2", "live"]
    assert "round open, fragment 0: complete: a; b has ranks [0]" in lines
    assert "round open, fragment 1: complete: a" in lines

    # b completes: with K = 2 both fragments merge, and the view follows.
    _upload(client, plan, "b", 2, 1, plan.fragments[0], inc["b"], seed=11)
    for r in (0, 1):
        _upload(client, plan, "b", 2, r, plan.fragments[1], inc["b"], seed=12 + r)
    # The round loop merges them too, in its pool: a merge under way there is waited for
    # (200 polls in a row, about a millisecond, ended before it did on a loaded machine).
    deadline = time.monotonic() + 30.0
    while client.versions() != [1, 1] and time.monotonic() < deadline:
        server.coord.poll(0), server.coord.poll(1)
        time.sleep(0.01)
    assert client.versions() == [1, 1]
    client.leave("a", inc["a"])
    code, text, _ = _status(capsys, server.url, "--token", TOKEN)
    assert code == 0
    lines = text.splitlines()
    assert "versions 1  merges 2 (1 per fragment, 0 failed)" in lines[0]
    assert "merges by islands in them: 2: 2" in lines[1]
    sent = server.coord.traffic["upload_bytes"]  # 6 uploads; no download yet
    assert sent > 0 and lines[2] == (
        f"traffic since the coordinator started: uploads {sent / 1e6:,.1f} MB in, "
        "downloads 0.0 MB out"
    )
    b = server.coord.status()["buffers"]  # both fragments' values, the rows given back
    assert b["in_use"] == 2 and lines[3] == (
        f"fragment buffers: {b['held']} ({b['bytes'] / 1e6:,.1f} MB; values, rows, merges), "
        "2 in use"
    )
    # The coordinator's own process (here this test's, which the server runs in).
    proc = re.fullmatch(r"coordinator process: ([\d,.]+) MB resident, [\d,.]+ s CPU, "
                        r"(\d+) open files( of \d+)?, up \d+h\d\dm", lines[4])  # fmt: skip
    assert proc, lines[4]
    rss = float(proc.group(1).replace(",", "")) * 1e6
    assert 0.5 < rss / psutil.Process().memory_info().rss < 2 and int(proc.group(2)) >= 3, lines[4]
    row = {ln.split()[0]: ln.split() for ln in lines if ln.split()[:1] in (["a"], ["b"])}
    assert row["a"][2] == "left" and row["b"][2] == "live"
    assert row["a"][5] == "2" and row["b"][5] == "2"  # contributions merged
    assert not any(ln.startswith("round open") for ln in lines)

    code, raw, _ = _status(capsys, server.url, "--token", TOKEN, "--json")
    assert code == 0 and json.loads(raw)["versions"] == [1, 1]


def test_status_says_in_one_line_what_kept_it_from_an_answer(server, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("DS_DILOCO_TOKEN", raising=False)
    code, _, err = _status(capsys, server.url)
    assert code == 2 and "no bearer token" in err
    code, _, err = _status(capsys, server.url, "--token", "wrong")
    assert code == 2 and f"{server.url} refused: wrong bearer token" in err
    code, _, err = _status(capsys, "http://127.0.0.1:9", "--token", TOKEN)  # nothing listens
    assert code == 2 and "no status from http://127.0.0.1:9" in err
    code, _, err = _status(capsys, server.url, "--token", TOKEN, "--watch", "0")
    assert code == 2 and "--watch must be > 0" in err
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.write_text("\n")
    code, _, err = _status(capsys, server.url, "--token-file", str(empty))
    assert code == 2 and f"--token-file {empty}: the file is empty" in err
    code, _, err = _status(capsys, server.url, "--token-file", str(missing))
    assert code == 2 and f"--token-file {missing}: No such file" in err
    (tmp_path / "token").write_text(TOKEN + "\n")  # what a run writes as state_dir/token
    code, out, _ = _status(capsys, server.url, "--token-file", str(tmp_path / "token"))
    assert code == 0 and out.startswith(f"coordinator {server.url}")


def test_an_answer_that_is_not_json_is_a_line_and_the_watch_goes_on(capsys, monkeypatch):
    class Page(http.server.BaseHTTPRequestHandler):  # what a proxy in front may answer
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        code, _, err = _status(capsys, url, "--token", TOKEN)
        assert code == 2 and f"no status from {url}: the answer is not JSON" in err, err
        polls = []

        def sleep(s):  # the second poll's wait ends the watch (Ctrl-C)
            polls.append(s)
            if len(polls) == 2:
                raise KeyboardInterrupt

        monkeypatch.setattr(time, "sleep", sleep)
        code, out, _ = _status(capsys, url, "--token", TOKEN, "--watch", "5")
        assert code == 0 and out.count(f"no status from {url}: the answer is not JSON") == 2
    finally:
        httpd.shutdown()


def test_render_refuses_a_document_that_is_not_a_status():
    with pytest.raises(StatusError, match="not a coordinator status document"):
        render({"versions": [0]})


def test_the_coordinator_process_line_gives_memory_cpu_files_and_uptime():
    process = {"resident_memory_bytes": 2_500_000_000, "virtual_memory_bytes": 9e9,
               "cpu_seconds_total": 12345.67, "open_fds": 40, "max_fds": 1024,
               "start_time_seconds": 1000.0}  # fmt: skip
    assert process_text(process, now=1000.0 + 3 * 3600 + 7 * 60 + 59) == (
        "2,500.0 MB resident, 12,345.7 s CPU, 40 open files of 1024, up 3h07m"
    )
    del process["open_fds"], process["max_fds"]  # a platform without them
    assert process_text(process, now=0.0) == "2,500.0 MB resident, 12,345.7 s CPU, up 0h00m"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_watch_started_with_sigint_ignored_ends_on_a_signal(server, signum, tmp_path):
    log = tmp_path / "watch.log"
    argv = [sys.executable, "-c", SIGINT_IGNORED, "status", server.url, "--token", TOKEN,
            "--watch", "0.2"]  # fmt: skip
    with open(log, "w") as f:
        watch = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("versions") < 2:  # two polls shown: in its loop
            assert watch.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        watch.send_signal(signum)
        code = watch.wait(20)
    finally:
        watch.kill()
    assert code == 0, log.read_text()
