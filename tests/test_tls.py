"""TLS between islands and the coordinator: real certificates (trustme), a real server.

Islands in other datacenters reach the coordinator over networks the run does not own:
the coordinator serves HTTPS with tls_cert/tls_key, and clients check its certificate.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import trustme
from conftest import write_run_file

from ds_diloco import tls, wire
from ds_diloco.client import CoordinatorClient, RefusedError, TLSError, rank_slices
from ds_diloco.config import (
    CoordinatorConfig,
    IslandConfig,
    ModelSource,
    load_coordinator_config,
    load_island_config,
    load_run_config,
)
from ds_diloco.fragments import FragmentPlan
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread

REPO = Path(__file__).resolve().parents[1]
TOKEN = "tls-test-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A private CA, and a certificate it issued for 127.0.0.1 (and a second, unrelated key)."""
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(d / "key.pem"))
    ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(d / "other-key.pem"))
    trustme.CA().cert_pem.write_to_path(str(d / "other-ca.pem"))
    return d


def coordinator_cfg(tiny_config_path, state_dir, certs=None, **kw) -> CoordinatorConfig:
    tls_files = {}
    if certs is not None:
        tls_files = {"tls_cert": str(certs / "cert.pem"), "tls_key": str(certs / "key.pem")}
    return CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0), state_dir=str(state_dir),
        num_fragments=2, sync_every=4, policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        token=TOKEN, **tls_files, **kw,
    )  # fmt: skip


def test_a_round_goes_through_https_and_the_download_is_the_global_model(
    certs, tiny_config_path, tmp_path
):
    with ServerThread(coordinator_cfg(tiny_config_path, tmp_path / "s", certs)) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        # Trusting the private CA, or the coordinator's own certificate (partial chain).
        for ca_file in ("ca.pem", "cert.pem"):
            client = CoordinatorClient(srv.url, TOKEN, retries=0, ca_file=str(certs / ca_file))
            assert client.health()["ok"]
        plan = FragmentPlan.from_json(client.plan()["plan"])
        inc = client.register("a", 1, plan.signature)["incarnation"]
        theta = srv.coord.global_tensors()
        g = torch.Generator().manual_seed(0)
        delta = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in theta.items()}
        frag = plan.fragments[0]
        header = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=0, base_version=0,
                                   step=2, tokens=512, steps=2, incarnation=inc)  # fmt: skip
        assert client.upload(header, rank_slices(frag, delta, 1, 0))["status"] == "accepted"
        deadline = time.monotonic() + 20
        while client.versions()[0] != 1:
            assert time.monotonic() < deadline, client.versions()
            time.sleep(0.05)
        version, got = client.download(0, 1, 0)
        merged = srv.coord.global_tensors()
        assert version == 1
        for p in frag.params:  # what came over TLS is the merged global value, bit for bit
            assert torch.equal(got[p.name], merged[p.name].reshape(-1)), p.name
            assert not torch.equal(merged[p.name], theta[p.name]), p.name  # and it moved
        # The token is still required over TLS.
        with pytest.raises(RefusedError) as e:
            CoordinatorClient(srv.url, "wrong", retries=0, ca_file=str(certs / "ca.pem")).status()
        assert e.value.status == 401


def test_an_untrusted_certificate_is_one_clear_error_at_once_and_the_env_var_trusts_it(
    certs, tiny_config_path, tmp_path, monkeypatch
):
    monkeypatch.delenv(tls.CA_FILE_ENV, raising=False)
    with ServerThread(coordinator_cfg(tiny_config_path, tmp_path / "s", certs)) as srv:
        client = CoordinatorClient(srv.url, TOKEN, retries=3, backoff_s=1.0)  # system CAs only
        t0 = time.monotonic()
        with pytest.raises(TLSError) as e:
            client.health()
        assert time.monotonic() - t0 < 1.0  # not retried: a retry would be refused the same
        assert "certificate was refused" in str(e.value) and "coordinator_ca" in str(e.value)
        assert isinstance(e.value, OSError)  # a transport error: a running island retries
        monkeypatch.setenv(tls.CA_FILE_ENV, str(certs / "ca.pem"))
        assert CoordinatorClient(srv.url, TOKEN, retries=0).health()["ok"]
        # A client that speaks plain HTTP gets no answer from a TLS coordinator.
        with pytest.raises(ConnectionResetError):
            CoordinatorClient(srv.url.replace("https://", "http://"), TOKEN, retries=0).health()


def test_https_to_a_coordinator_without_tls_says_so(certs, tiny_config_path, tmp_path):
    with ServerThread(coordinator_cfg(tiny_config_path, tmp_path / "s")) as srv:
        assert srv.url.startswith("http://")
        url = srv.url.replace("http://", "https://")
        with pytest.raises(TLSError, match="does not speak TLS: use http://"):
            CoordinatorClient(url, TOKEN, retries=3, ca_file=str(certs / "ca.pem")).health()


def test_tls_settings_are_checked_when_loaded(certs, tiny_config_path, tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        CoordinatorConfig(model=ModelSource(config=tiny_config_path), state_dir=str(tmp_path),
                          tls_cert=str(certs / "cert.pem"))  # fmt: skip
    # Paths relative to the file; a typo or a key of another certificate fails at load.
    (tmp_path / "c").mkdir()
    for name in ("cert.pem", "key.pem", "other-key.pem"):
        (tmp_path / "c" / name).write_bytes((certs / name).read_bytes())
    base = {"model": {"config": tiny_config_path}, "state_dir": "state"}
    path = tmp_path / "coordinator.json"
    path.write_text(json.dumps({**base, "tls_cert": "c/cert.pem", "tls_key": "c/key.pem"}))
    cfg = load_coordinator_config(path)
    assert cfg.tls_cert == str(tmp_path / "c" / "cert.pem") and cfg.url_at("h", 1) == "https://h:1"
    path.write_text(json.dumps({**base, "tls_cert": "c/cert.pm", "tls_key": "c/key.pem"}))
    with pytest.raises(ValueError, match=r"^tls_cert '.*c/cert.pm' does not exist"):
        load_coordinator_config(path)
    path.write_text(json.dumps({**base, "tls_cert": "c/cert.pem", "tls_key": "c/other-key.pem"}))
    with pytest.raises(ValueError, match="are not a PEM certificate and its private key"):
        load_coordinator_config(path)
    # In a run file, named as the coordinator's.
    run = _run_file(tmp_path, tiny_config_path, certs, steps=1)
    data = json.loads(run.read_text())
    data["coordinator"]["tls_key"] = str(certs / "missing.pem")
    run.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"^coordinator\.tls_key '.*missing.pem' does not exist"):
        load_run_config(run)
    # An island: a CA file only with https://, and one that exists.
    island = {"island": "a", "model": {"config": tiny_config_path},
              "deepspeed_config": str(REPO / "model_configs/deepspeed/zero3_cpu.json"),
              "data": {"path": str(REPO / "tests" / "data"), "vocab_size": 512}}  # fmt: skip
    with pytest.raises(ValueError, match="coordinator_ca is set but coordinator_url"):
        IslandConfig(**{**island, "coordinator_url": "http://10.0.0.1:8470",
                        "model": ModelSource(config=tiny_config_path),
                        "data": None, "coordinator_ca": "ca.pem"})  # fmt: skip
    path = tmp_path / "island.json"
    path.write_text(json.dumps({**island, "coordinator_url": "https://10.0.0.1:8470",
                                "coordinator_ca": "ca.pem"}))  # fmt: skip
    with pytest.raises(ValueError, match=r"^coordinator_ca: CA file '.*ca.pem' .* does not exist"):
        load_island_config(path)


def test_an_expired_certificate_is_refused_at_start(tmp_path):
    # Loaded without a word, it was served, and every island's handshake then failed.
    now = datetime.datetime.now(datetime.timezone.utc)
    leaf = trustme.CA().issue_cert(
        "127.0.0.1", not_before=now - datetime.timedelta(days=30),
        not_after=now - datetime.timedelta(days=1),
    )  # fmt: skip
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    with pytest.raises(ValueError, match=r"^tls_cert '.*cert.pem' expired on \d{4}-\d\d-\d\d"):
        tls.server_context(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))


def test_an_encrypted_key_is_refused_without_asking_for_its_pass_phrase(certs, tmp_path):
    # OpenSSL asked for it on the terminal (the coordinator waited there), or failed with
    # "OSError: [Errno 22] Invalid argument" without one.
    key = subprocess.run(
        ["openssl", "pkey", "-in", str(certs / "key.pem"), "-aes256", "-passout", "pass:pw"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    (tmp_path / "key.pem").write_bytes(key)
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from ds_diloco import tls\n"
         "try: tls.server_context(*sys.argv[1:])\nexcept ValueError as e: print(e)",
         str(certs / "cert.pem"), str(tmp_path / "key.pem")],
        capture_output=True, text=True, timeout=60, start_new_session=True,  # no terminal
    )  # fmt: skip
    assert proc.stdout.startswith(f"tls_key '{tmp_path / 'key.pem'}' is encrypted"), proc


def test_a_coordinator_others_can_reach_without_tls_is_warned_about():
    for host in ("127.0.0.1", "::1", "localhost"):
        assert tls.clear_text_warning(host, tls=False) is None, host
    for host in ("0.0.0.0", "", "10.0.0.1", "coord.example.org"):
        assert "clear text" in tls.clear_text_warning(host, tls=False), host
        assert tls.clear_text_warning(host, tls=True) is None


def _run_file(tmp_path, tiny_config_path, certs, steps) -> Path:
    islands = [{"name": "a", "world_size": 1}, {"name": "b", "world_size": 1}]
    return write_run_file(
        tmp_path, tiny_config_path, islands, steps, num_fragments=2, sync_every=2,
        tls_cert=str(certs / "cert.pem"), tls_key=str(certs / "key.pem"),
    )  # fmt: skip


def test_a_run_with_a_tls_coordinator_trains_and_merges_over_https(
    certs, tiny_config_path, tmp_path, monkeypatch
):
    # Real islands (deepspeed launcher, ZeRO-3 on gloo) reach the run's own coordinator
    # over HTTPS, trusting its certificate file; nothing else is trusted.
    monkeypatch.delenv(tls.CA_FILE_ENV, raising=False)
    run = _run_file(tmp_path, tiny_config_path, certs, steps=6)
    proc = subprocess.run(
        [sys.executable, "-m", "ds_diloco.cli", "run", str(run)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    work = tmp_path / "run"
    logs = "".join(p.read_text()[-2000:] for p in work.glob("islands/*/log.txt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    for name in ("a", "b"):
        island = json.loads((work / "islands" / name / "island.json").read_text())
        assert island["coordinator_url"].startswith("https://127.0.0.1:"), island
        assert island["coordinator_ca"] == str(certs / "cert.pem")
    summary = json.loads((work / "summary.json").read_text())
    assert min(summary["merges"]) >= 2, summary["merges"]
    assert f"--ca-file {certs / 'cert.pem'}" in proc.stdout  # the status command it prints
    assert "coordinator listening on https://" in (work / "coordinator.log").read_text()


def test_a_run_whose_coordinator_certificate_is_not_for_its_host_says_so_at_once(
    certs, tiny_config_path, tmp_path, monkeypatch
):
    # The run reaches its coordinator at 127.0.0.1: with a certificate for another name it
    # waited COORDINATOR_START_S (120 s), then said the coordinator "did not answer".
    from ds_diloco import run as run_mod

    leaf = trustme.CA().issue_cert("coordinator.example")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    tls_files = {"tls_cert": str(tmp_path / "cert.pem"), "tls_key": str(tmp_path / "key.pem")}
    srv = ServerThread(dataclasses.replace(coordinator_cfg(tiny_config_path, tmp_path / "s"),
                                           **tls_files))  # fmt: skip
    try:
        run = load_run_config(_run_file(tmp_path, tiny_config_path, certs, steps=1))
        lr = run_mod.LocalRun(dataclasses.replace(
            run, coordinator=dataclasses.replace(run.coordinator, **tls_files)))  # fmt: skip
        lr.url, lr.token = srv.url, TOKEN

        class Alive:  # the coordinator process, up
            def poll(self):
                return None

        lr.coordinator = Alive()
        monkeypatch.setattr(run_mod, "COORDINATOR_START_S", 3.0)
        t0 = time.monotonic()
        with pytest.raises(run_mod.CoordinatorStartError) as e:
            lr.wait_for_coordinator()
        assert time.monotonic() - t0 < 2.0
        assert "certificate was refused" in str(e.value) and "127.0.0.1" in str(e.value), e.value
    finally:
        srv.stop()


def test_an_island_that_does_not_trust_the_coordinator_is_given_up_with_one_line(
    certs, tiny_config_path, tmp_path, monkeypatch
):
    # A certificate refused is the island's set-up, not a passing fault: exit 2, which
    # ds-diloco run does not restart (it restarted such an island until max_restarts).
    monkeypatch.delenv(tls.CA_FILE_ENV, raising=False)
    with ServerThread(coordinator_cfg(tiny_config_path, tmp_path / "s", certs)) as srv:
        island = {"island": "a", "coordinator_url": srv.url, "token": TOKEN,
                  "coordinator_ca": str(certs / "other-ca.pem"), "connect_timeout_s": 90,
                  "model": {"config": tiny_config_path},
                  "deepspeed_config": str(REPO / "model_configs/deepspeed/zero3_cpu.json"),
                  "data": {"path": str(REPO / "tests" / "data"), "vocab_size": 512,
                           "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
                  "train": {"steps": 2, "micro_batch": 4}, "workdir": str(tmp_path / "w")}  # fmt: skip
        (tmp_path / "island.json").write_text(json.dumps(island))
        port = socket.socket()
        port.bind(("127.0.0.1", 0))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port.getsockname()[1])}  # fmt: skip
        port.close()
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "ds_diloco.cli", "island", "--config",
             str(tmp_path / "island.json")], env=env, capture_output=True, text=True, timeout=150,
        )  # fmt: skip
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 2, out
    assert "ds-diloco island: island 'a': TLS with the coordinator at https://" in proc.stderr, out
    assert "certificate was refused" in proc.stderr and "Traceback" not in proc.stderr, out
    assert time.monotonic() - t0 < 60  # at once, not after 90 s of retries
    assert "a" not in srv.coord.status()["islands"]


def test_ca_file_with_a_coordinator_that_is_not_https_is_refused(tmp_path, capsys):
    """Ignored before, as an island file's coordinator_ca with an http:// URL is refused."""
    from ds_diloco.cli import main as cli_main

    pem, data = tmp_path / "ca.pem", tmp_path / "run.yaml"  # never read: refused first
    for argv in (["status", "http://127.0.0.1:9", "--token", "t"],
                 ["export", "--from", str(tmp_path), "--out", str(tmp_path / "out")],
                 ["eval", "--from", "http://127.0.0.1:9", "--data", str(data), "--token", "t"]):  # fmt: skip
        assert cli_main([*argv, "--ca-file", str(pem)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ds-diloco: error: --ca-file is set but ") and "https://" in err, err
        assert len(err.splitlines()) == 1, err


def test_status_and_export_take_the_coordinators_certificate_with_ca_file(
    certs, tiny_config_path, tmp_path, monkeypatch, capsys
):
    from transformers import AutoModelForCausalLM

    from ds_diloco.cli import main as cli_main

    monkeypatch.delenv(tls.CA_FILE_ENV, raising=False)
    monkeypatch.setenv("DS_DILOCO_TOKEN", TOKEN)
    with ServerThread(coordinator_cfg(tiny_config_path, tmp_path / "s", certs)) as srv:
        assert cli_main(["status", srv.url, "--ca-file", str(certs / "cert.pem")]) == 0
        assert f"coordinator {srv.url}" in capsys.readouterr().out
        assert cli_main(["status", srv.url]) == 2  # the system's CAs do not know it
        err = capsys.readouterr().err
        assert "certificate was refused" in err and "Traceback" not in err, err
        out = tmp_path / "export"
        args = ["export", "--from", srv.url, "--out", str(out), "--ca-file", str(certs / "ca.pem")]
        assert cli_main(args) == 0
        theta = srv.coord.global_tensors()
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), theta[name]), name


def test_a_certificate_for_another_host_or_out_of_date_is_not_told_to_be_trusted(
    certs, tiny_config_path, tmp_path, monkeypatch
):
    # Both said "trust it with the island's coordinator_ca", which the client already did:
    # trusting it again changes nothing. Each names what would.
    import http.server
    import ssl
    import threading

    monkeypatch.delenv(tls.CA_FILE_ENV, raising=False)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cfg = dataclasses.replace(coordinator_cfg(tiny_config_path, tmp_path / "s"),
                              tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"))  # fmt: skip
    with ServerThread(cfg) as srv:
        url = srv.url.replace("127.0.0.1", "localhost")  # the certificate names 127.0.0.1
        with pytest.raises(TLSError) as e:
            CoordinatorClient(url, TOKEN, retries=0, ca_file=str(tmp_path / "ca.pem")).health()
    msg = str(e.value)
    assert "certificate was refused" in msg and "not valid for 'localhost'" in msg, msg
    assert "coordinator_ca" not in msg and "subjectAltName" in msg, msg
    # A certificate that expired while the coordinator served it (it was checked at start).
    now = datetime.datetime.now(datetime.timezone.utc)
    leaf = ca.issue_cert("127.0.0.1", not_before=now - datetime.timedelta(days=30),
                         not_after=now - datetime.timedelta(days=1))  # fmt: skip
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(ctx)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = CoordinatorClient(f"https://127.0.0.1:{httpd.server_port}", TOKEN, retries=0,
                                   ca_file=str(tmp_path / "ca.pem"))  # fmt: skip
        with pytest.raises(TLSError) as e:
            client.health()
    finally:
        httpd.shutdown()
        httpd.server_close()
    msg = str(e.value)
    assert "certificate has expired" in msg and "coordinator_ca" not in msg, msg
    assert "new certificate" in msg, msg


def test_the_chaos_proxies_reach_a_coordinator_that_listens_elsewhere_than_127_0_0_1(
    tiny_config_path, tmp_path
):
    # `ds-diloco chaos` proxied every island to 127.0.0.1 whatever coordinator.host said:
    # with host 192.0.2.2 each island was reset for 150 s, gave up ("a coordinator serving
    # TLS closes http:// connections: https?") and the harness crashed on its records. And
    # over TLS the islands were given https://127.0.0.1:..., which a certificate for the
    # coordinator's address does not name.
    from ds_diloco.chaos.harness import island_proxies

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf = ca.issue_cert("127.0.0.2")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    tls_files = {"tls_cert": str(tmp_path / "cert.pem"), "tls_key": str(tmp_path / "key.pem")}
    for i, files in enumerate(({}, tls_files)):
        cfg = coordinator_cfg(tiny_config_path, tmp_path / f"s{i}", host="127.0.0.2", **files)
        with ServerThread(cfg) as srv:
            proxies = island_proxies(srv.url, ["a", "b"])
            try:
                for p in proxies.values():
                    client = CoordinatorClient(p.url, TOKEN, retries=0, timeout_s=10,
                                               ca_file=str(tmp_path / "ca.pem"))  # fmt: skip
                    assert client.health()["ok"], p.url
            finally:
                for p in proxies.values():
                    p.close()


def test_a_bad_ca_file_from_the_environment_is_named_as_such(tmp_path, monkeypatch, capsys):
    # Set in a shell profile long ago, it was named as "CA file '...'" alone: the user of
    # `ds-diloco status`, who gave no --ca-file, could not tell where it came from.
    from ds_diloco.cli import main as cli_main

    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    for path, problem in ((tmp_path / "gone.pem", "does not exist"),
                          (tmp_path / "garbage.pem", "holds no PEM certificate")):  # fmt: skip
        monkeypatch.setenv(tls.CA_FILE_ENV, str(path))
        assert cli_main(["status", "https://127.0.0.1:9", "--token", "t"]) == 2
        err = capsys.readouterr().err
        assert f"CA file '{path}' (${tls.CA_FILE_ENV})" in err and problem in err, err
        with pytest.raises(ValueError) as e:  # one given is named as before
            tls.client_context(str(path))
        assert tls.CA_FILE_ENV not in str(e.value) and problem in str(e.value), e.value


def test_a_certificate_not_valid_yet_is_refused_at_start(tmp_path):
    # As an expired one: loaded without a word, served, and refused by every island.
    now = datetime.datetime.now(datetime.timezone.utc)
    leaf = trustme.CA().issue_cert(
        "127.0.0.1", not_before=now + datetime.timedelta(days=2),
        not_after=now + datetime.timedelta(days=30),
    )  # fmt: skip
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    with pytest.raises(
        ValueError, match=r"^tls_cert '.*cert.pem' is not valid before \d{4}-\d\d-\d\d"
    ):
        tls.server_context(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
