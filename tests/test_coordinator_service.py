"""The coordinator on a real port, fed real ZeRO-3-sliced pseudo-gradients of a real HF model.

Stand-in islands (threads, one per rank) train their own copy of a tiny Llama
for a few AdamW steps, then upload the slices each rank would own under ZeRO-3.
The expected global model is computed here with plain tensors and torch's SGD.
"""

from __future__ import annotations

import gc
import http.client
import json
import logging
import math
import random
import re
import socket
import threading
import time

import psutil
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ds_diloco import server as server_mod
from ds_diloco import wire
from ds_diloco.client import CoordinatorClient, RefusedError, rank_slices
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.fragments import FragmentPlan
from ds_diloco.merge import StalenessPolicy, merge_reference
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread
from ds_diloco.sharding import shard_numel

TOKEN = "test-token"
LR, MOMENTUM = 0.7, 0.9


INLINE_DEFAULT = server_mod.INLINE_UPLOAD_BYTES


def make_cfg(config_path, state_dir, islands=3, **kw) -> CoordinatorConfig:
    base = {
        "model": ModelSource(config=config_path, seed=0),
        "state_dir": str(state_dir),
        "num_fragments": 4,
        "sync_every": 4,
        "policy": PolicyOptions(min_quorum=islands, grace_gamma=0.0, tau=1),
        "outer": OuterOptimConfig(name="nesterov", lr=LR, momentum=MOMENTUM),
        "token": TOKEN,
    }
    base.update(kw)
    return CoordinatorConfig(**base)


def _initial(config_path):
    return [(n, p.detach()) for n, p in initial_model(config_path).named_parameters()]


def initial_model(config_path, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))


def train_copy(config_path, start: dict[str, torch.Tensor], seed: int, steps: int = 3):
    """A real local model: `start` values, then a few AdamW steps on its own token stream."""
    model = initial_model(config_path)
    model.load_state_dict(start, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def upload_island(
    client, plan, island, world_size, deltas, *, step, tokens, steps, versions, incarnation=1
):
    """Every rank of the island uploads its own slices of every fragment, concurrently."""
    errors = []

    def rank_main(rank):
        try:
            for frag in plan.fragments:
                header = wire.UploadHeader(
                    island=island,
                    rank=rank,
                    world_size=world_size,
                    fragment=frag.index,
                    base_version=versions[frag.index],
                    step=step,
                    tokens=tokens,
                    steps=steps,
                    incarnation=incarnation,
                )
                reply = client.upload(header, rank_slices(frag, deltas, world_size, rank))
                assert reply["status"] == "accepted", reply
        except Exception as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


def wait_versions(client, want, timeout=20.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = client.versions()
        if v == want:
            return v
        time.sleep(0.02)
    raise AssertionError(f"versions {client.versions()} never reached {want}")


def reference_outer_step(theta, deltas_by_island, weights, opts_state, plain_names):
    """Synchronous DiLoCo's outer step with plain tensors: RDA/plain mean, then torch SGD."""
    new = {}
    total = sum(weights)
    for name, t0 in theta.items():
        ds = [d[name].double() for d in deltas_by_island]
        if name in plain_names:
            g = sum(w * d for w, d in zip(weights, ds)) / total
        else:
            mean_norm = sum(w * d.norm() for w, d in zip(weights, ds)) / total
            direction = sum(w * d / d.norm() for w, d in zip(weights, ds)) / total
            g = mean_norm * direction / direction.norm()
        p = opts_state.setdefault(name, torch.nn.Parameter(t0.clone()))
        opt = opts_state.setdefault(
            name + "/opt", torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, nesterov=True)
        )
        p.grad = g.float()
        opt.step()
        new[name] = p.detach().clone()
    return new


@pytest.fixture
def server(tiny_config_path, tmp_path):
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "state", max_body_mb=1.0))
    yield srv
    srv.stop()


def client_for(srv) -> CoordinatorClient:
    return CoordinatorClient(srv.url, TOKEN, retries=0)


ISLANDS = {"a": 1, "b": 2, "c": 3}  # islands of different world sizes in one run
TOKENS = {"a": 4096, "b": 2048, "c": 6144}
STEPS = {"a": 4, "b": 4, "c": 8}


def run_round(srv, config_path, theta, seed, world_sizes=ISLANDS, step=8):
    # step >= every island's STEPS: the steps since an island's last sync are among its steps
    client = client_for(srv)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    versions = client.versions()
    deltas, incarnations = {}, {}
    for i, (island, ws) in enumerate(world_sizes.items()):
        incarnations[island] = client.register(island, ws, plan.signature)["incarnation"]
        local = train_copy(config_path, theta, seed=seed + i)
        deltas[island] = {n: theta[n] - local[n] for n in theta}
    for island, ws in world_sizes.items():
        upload_island(
            client,
            plan,
            island,
            ws,
            deltas[island],
            step=step,
            tokens=TOKENS[island],
            steps=STEPS[island],
            versions=versions,
            incarnation=incarnations[island],
        )
    wait_versions(client, [v + 1 for v in versions])
    return deltas


def test_initial_global_model_is_the_seeded_hf_model(server, tiny_config_path):
    model = initial_model(tiny_config_path)
    got = server.coord.global_tensors()
    names = [n for n, _ in model.named_parameters()]
    assert list(got) != [] and sorted(got) == sorted(names)
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.detach()), n


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_a_coordinator_on_an_ipv6_address_gives_its_url_in_brackets(tiny_config_path, tmp_path):
    with ServerThread(make_cfg(tiny_config_path, tmp_path / "s", host="::1")) as srv:
        assert srv.url == f"http://[::1]:{srv.port}"
        assert CoordinatorClient(srv.url, TOKEN, retries=0).health()["ok"]


def test_a_token_with_a_trailing_newline_is_the_token(tiny_config_path, tmp_path, monkeypatch):
    # As a secret mounted as an environment variable has it: the coordinator took only
    # "Bearer tok\n" (which no header can carry) and the client could not send it.
    monkeypatch.setenv("DS_DILOCO_TOKEN", TOKEN + "\n")
    with ServerThread(make_cfg(tiny_config_path, tmp_path / "s", token=None)) as srv:
        for token in (TOKEN + "\n", TOKEN):
            assert CoordinatorClient(srv.url, token, retries=0).status()["versions"] == [0] * 4
        with pytest.raises(RefusedError, match="wrong bearer token"):
            CoordinatorClient(srv.url, "wrong", retries=0).status()


def test_a_token_that_is_not_ascii_is_the_token(tiny_config_path, tmp_path):
    # The coordinator reads the header as UTF-8; the client sent it as Latin-1: "pässwörd",
    # the same on both sides, was "wrong bearer token", and "pass€" a UnicodeEncodeError.
    for token in ("pässwörd", "pass€"):
        cfg = make_cfg(tiny_config_path, tmp_path / token, token=token)
        with ServerThread(cfg) as srv:
            assert CoordinatorClient(srv.url, token, retries=0).status()["versions"] == [0] * 4
            with pytest.raises(RefusedError, match="wrong bearer token"):
                CoordinatorClient(srv.url, "passwörd", retries=0).status()


def test_the_bearer_scheme_is_case_insensitive(server):
    # "bearer TOKEN" (curl by hand, some clients) was "missing bearer token".
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    for scheme, status in (("bearer", 200), ("BEARER", 200), ("Basic", 401)):
        conn.request("GET", "/v1/plan", headers={"Authorization": f"{scheme} {TOKEN}"})
        r = conn.getresponse()
        assert (r.status, scheme) == (status, scheme), r.read()
        r.read()
    conn.close()


def test_an_unknown_endpoint_or_method_is_named_in_its_refusal(server):
    # Both were a bare "404: Not Found" / "405: Method Not Allowed": a coordinator URL with a
    # wrong path prefix failed every request naming nothing.
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for method, path, status, text in (
        ("GET", "/v1/fragment/0", 404, "no such endpoint: GET /v1/fragment/0"),
        ("GET", "/prefix/healthz", 404, "no such endpoint: GET /prefix/healthz"),
        ("PUT", "/v1/upload", 405, "PUT /v1/upload: method not allowed (allowed: POST)"),
    ):
        conn.request(method, path, headers=auth)
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == status and text in error, (r.status, error)
    conn.close()


def test_a_head_request_for_a_download_leaves_the_connection_usable(server):
    # aiohttp answers HEAD on GET routes; the download handler streamed its body after the
    # headers anyway, and the connection's next answer was read from the model's bytes.
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/v1/fragments/0?world_size=1&rank=0",
                 "/v1/fragments?known=-1,-1,-1,-1&wait=0&world_size=1&rank=0"):  # fmt: skip
        conn.request("HEAD", path, headers=auth)
        head = conn.getresponse()
        head.read()
        conn.request("GET", "/v1/versions", headers=auth)
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (200, {"versions": [0] * 4})
        assert head.status == 405, head.status  # GET it: a download is for islands
    conn.close()


def test_sync_diloco_round_matches_plain_tensor_reference(server, tiny_config_path):
    theta = server.coord.global_tensors()
    weights = [TOKENS[i] ** 2 / STEPS[i] for i in ISLANDS]
    ref_state: dict = {}
    plain = {n for n in theta if "embed" in n}
    assert plain, "the tiny Llama's embedding must take the plain-average path"
    expected = dict(theta)
    for rnd in range(2):  # two rounds: the second exercises Nesterov momentum
        deltas = run_round(server, tiny_config_path, expected, seed=10 * rnd, step=8 * (rnd + 1))
        expected = reference_outer_step(
            expected, [deltas[i] for i in ISLANDS], weights, ref_state, plain
        )
        got = server.coord.global_tensors()
        for n in theta:
            assert torch.allclose(got[n], expected[n], atol=1e-6, rtol=1e-5), n
    assert client_for(server).versions() == [2, 2, 2, 2]
    # Every island sent its whole model twice (fp32), and a header per upload.
    model_bytes = 4 * sum(t.numel() for t in theta.values())
    sent = client_for(server).status()["traffic"]["upload_bytes"]
    assert 6 * model_bytes < sent < 6.1 * model_bytes, (sent, model_bytes)
    merged = client_for(server).status()["last_merge"]["0"]
    assert merged["islands"] == ["a", "b", "c"] and "all 3 live islands in" in merged["reason"]
    # The norms it reports: each island's pseudo-gradient of fragment 0, and the merged one.
    names = server.coord.plan.fragments[0].names
    for i in ISLANDS:
        norm = math.sqrt(sum(float(deltas[i][n].double().pow(2).sum()) for n in names))
        assert math.isclose(merged["norms"][i], norm, rel_tol=1e-5), i
    ref = merge_reference([{n: deltas[i][n] for n in names} for i in ISLANDS], weights,
                          lambda n: n in plain)  # fmt: skip
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in ref.values()))
    assert math.isclose(merged["pseudo_gradient_norm"], norm, rel_tol=1e-5)


def test_sharded_uploads_equal_unsharded_uploads(tiny_config_path, tmp_path):
    results = []
    for name, sizes in (("sharded", ISLANDS), ("whole", dict.fromkeys(ISLANDS, 1))):
        srv = ServerThread(make_cfg(tiny_config_path, tmp_path / name))
        try:
            run_round(srv, tiny_config_path, srv.coord.global_tensors(), seed=3, world_sizes=sizes)
            results.append(srv.coord.global_tensors())
        finally:
            srv.stop()
    sharded, whole = results
    # Equal up to fp32 summation order (norms add up per rank slice, rows in arrival order).
    for n in sharded:
        assert torch.allclose(sharded[n], whole[n], rtol=1e-6, atol=1e-8), n
    assert any(not torch.equal(sharded[n], initial) for n, initial in _initial(tiny_config_path))


def test_download_serves_each_ranks_zero3_slice(server):
    client = client_for(server)
    full = server.coord.global_tensors()
    plan = FragmentPlan.from_json(client.plan()["plan"])
    for world_size in (1, 2, 3):
        for frag in plan.fragments:
            parts = [client.download(frag.index, world_size, r) for r in range(world_size)]
            for p in frag.params:
                joined = torch.cat([slices[p.name] for _, slices in parts])
                assert torch.equal(joined, full[p.name].reshape(-1)), (world_size, p.name)
    assert client.download(0, 2, 1, after=0) is None  # not newer than what the island holds
    # The 304 says the coordinator's version, not the one asked after (it echoed that).
    r = client._request("GET", "/v1/fragments/0", params={"world_size": 1, "rank": 0, "after": 7})
    assert (r.status_code, r.headers[wire.VERSION_HEADER]) == (304, "0")


def _rank_dests(plan, world_size, rank):
    """Zeroed destinations for every fragment's slices of one rank, in wire order."""
    return [
        {p.name: torch.zeros(shard_numel(p.numel, world_size, rank)) for p in frag.params}
        for frag in plan.fragments
    ]


def test_the_long_poll_for_fragments_answers_with_the_first_newer_one(server):
    # GET /v1/fragments: the version poll and the download in one request. Nothing is
    # newer than the versions 0 the coordinator starts at: 304 after the wait, with every
    # version; -1 asks for any version: the first such fragment comes at once, whole.
    client = client_for(server)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    never = 2**62
    dests = _rank_dests(plan, 2, 1)
    claimed = []

    def claim(i):
        claimed.append(i)
        return True

    t0 = time.perf_counter()
    got = client.download_next([0, 0, 0, 0], 2, 1, dests, claim, wait=0.3)
    assert got.fragment is None and got.versions == [0, 0, 0, 0] and claimed == []
    assert time.perf_counter() - t0 >= 0.25  # it waited
    info: dict = {}
    got = client.download_next([never, -1, 0, -1], 2, 1, dests, claim, wait=5.0, info=info)
    assert (got.fragment, got.version, claimed) == (1, 0, [1])
    assert info["bytes"] > 0 and info["unchanged"] == []
    _, want = client.download(1, 2, 1)
    assert all(torch.equal(dests[1][n], want[n]) for n in want)
    assert all(not t.any() for t in dests[0].values())  # only the fragment that came
    # Refused by the caller once named: the body is not read, the connection is closed,
    # and the next request goes through.
    fresh = _rank_dests(plan, 2, 1)
    got = client.download_next([-1] * 4, 2, 1, fresh, lambda i: False, wait=1.0)
    assert (got.fragment, got.version) == (0, None)
    assert all(not t.any() for d in fresh for t in d.values())
    got = client.download_next([-1] * 4, 2, 1, fresh, claim, wait=1.0)
    assert (got.fragment, got.version) == (0, 0) and claimed == [1, 0]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("known=0,0&wait=1&world_size=1&rank=0", "known has 2 entries, there are 4"),
        ("known=0,0,0,0&wait=x&world_size=1&rank=0", "known=v0,v1,... and wait=seconds"),
        ("known=0,0,0,0&wait=1&rank=0", "need ?known=V0,V1,...&wait=S&world_size=W"),
        ("known=0,0,0,0&wait=1&world_size=1&rank=0&keep=1,,&epoch=e", "keep has 3 masks"),
        ("known=-1,0,0,0&wait=1&world_size=1&rank=3", "rank 3 is outside world size 1"),
        # Refused at once, not only once a fragment is newer (a 304 after the wait before).
        ("known=0,0,0,0&wait=2&world_size=0&rank=0", "rank 0 is outside world size 0"),
        ("known=0,0,0,0&wait=2&world_size=2&rank=7", "rank 7 is outside world size 2"),
        # A mask of a fragment that is not the one sent is refused all the same.
        ("known=-1,0,0,0&wait=0&world_size=1&rank=0&keep=,,,zz&epoch=e", "fragment 3: keep must"),
    ],
)
def test_a_bad_long_poll_for_fragments_is_refused_naming_the_problem(server, query, message):
    with pytest.raises(RefusedError, match=re.escape(message)) as e:
        client_for(server)._request("GET", f"/v1/fragments?{query}")
    assert e.value.status in (400, 422)


def test_polls_downloads_and_start_from_another_run_are_refused_and_renew_no_lease(server):
    # A process of another run's island of the same name (left from an earlier run) kept
    # this run's island's lease alive with its polls and downloads: only its uploads and
    # leave carried the run id. Refused now, naming both runs, as superseded (it stops).
    client = client_for(server)
    run, other = server.coord.run_id, "0123456789abcdef"
    client.register("a", 2, server.coord.plan.signature)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    isl = server.coord._islands["a"]
    seen = isl.last_seen
    for send in (
        lambda: client.versions("a", run=other),
        lambda: client.versions("a", known=[0] * 4, wait=0.0, run=other),
        lambda: client.download(0, 2, 1, island="a", run=other),
        lambda: client.download_into(0, 2, 1, _rank_dests(plan, 2, 1)[0], island="a", run=other),
        lambda: client.download_next([-1] * 4, 2, 1, _rank_dests(plan, 2, 1), lambda i: True,
                                     wait=0.0, island="a", run=other),
        lambda: client.start("a", run=other),
    ):  # fmt: skip
        with pytest.raises(RefusedError) as e:
            send()
        assert e.value.status == 409 and wire.SUPERSEDED in e.value.message, e.value
        assert run in e.value.message and other in e.value.message, e.value.message
        assert isl.last_seen == seen and not isl.started
    # This run's id, or none (a client from before run ids), renews it as before.
    assert client.versions("a", run=run) == [0] * 4 and isl.last_seen > seen
    assert client.download(0, 2, 1, island="a")[0] == 0
    assert client.start("a", run=run)["started"] == 1


def test_restart_resumes_versions_values_and_momentum(tiny_config_path, tmp_path):
    cfg = make_cfg(tiny_config_path, tmp_path / "state")
    srv = ServerThread(cfg)
    theta = srv.coord.global_tensors()
    weights = [TOKENS[i] ** 2 / STEPS[i] for i in ISLANDS]
    plain = {n for n in theta if "embed" in n}
    ref_state: dict = {}
    deltas = run_round(srv, tiny_config_path, theta, seed=1)
    expected = reference_outer_step(theta, [deltas[i] for i in ISLANDS], weights, ref_state, plain)
    srv.stop()  # what SIGTERM does: save and exit

    srv = ServerThread(cfg)
    try:
        assert client_for(srv).versions() == [1, 1, 1, 1]
        got = srv.coord.global_tensors()
        for n in theta:
            assert torch.equal(got[n], expected[n].to(got[n].dtype)) or torch.allclose(
                got[n], expected[n], atol=1e-6
            ), n
        # The next round continues the same momentum as an uninterrupted run.
        deltas = run_round(srv, tiny_config_path, got, seed=2, step=8)
        expected = reference_outer_step(
            expected, [deltas[i] for i in ISLANDS], weights, ref_state, plain
        )
        got = srv.coord.global_tensors()
        for n in theta:
            assert torch.allclose(got[n], expected[n], atol=1e-6, rtol=1e-5), n
        # Replay protection survives the restart too.
        assert srv.coord.status()["islands"]["a"]["last_step"] == 8
    finally:
        srv.stop()


def test_quorum_one_merges_without_waiting_for_others(tiny_config_path, tmp_path):
    cfg = make_cfg(
        tiny_config_path, tmp_path / "s", policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    )
    srv = ServerThread(cfg)
    try:
        client = client_for(srv)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        for island in ("a", "b"):
            client.register(island, 1, plan.signature)
        theta = srv.coord.global_tensors()
        local = train_copy(tiny_config_path, theta, seed=5)
        delta = {n: theta[n] - local[n] for n in theta}
        upload_island(client, plan, "a", 1, delta, step=4, tokens=100, steps=4, versions=[0] * 4)
        wait_versions(client, [1, 1, 1, 1])
        # "b" is now stale against version 0: the paper's policy drops it.
        frag = plan.fragments[0]
        header = wire.UploadHeader(
            island="b",
            rank=0,
            world_size=1,
            fragment=0,
            base_version=0,
            step=4,
            tokens=100,
            steps=4,
        )
        reply = client.upload(header, rank_slices(frag, delta, 1, 0))
        assert reply["status"] == "dropped" and "stale" in reply["reason"]
    finally:
        srv.stop()


def upload_every_fragment(srv, tiny_config_path):
    """Island "a" (one rank) uploads every fragment once against version 0; the client, the
    global tensors it started from and its pseudo-gradient."""
    client = client_for(srv)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    client.register("a", 1, plan.signature)
    theta = srv.coord.global_tensors()
    delta = {n: theta[n] - t for n, t in train_copy(tiny_config_path, theta, seed=5).items()}
    upload_island(client, plan, "a", 1, delta, step=4, tokens=100, steps=4, versions=[0] * 4)
    return client, theta, delta


def _long_poll(srv, known: str, wait: float) -> socket.socket:
    """A long poll for fragments on a raw connection, which its caller may drop at will."""
    conn = socket.create_connection((srv.host, srv.port))
    conn.sendall(
        f"GET /v1/fragments?known={known}&wait={wait:g}&world_size=1&rank=0 HTTP/1.1\r\n"
        f"Host: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    return conn


def test_a_long_poll_whose_client_went_away_ends_quietly(tiny_config_path, tmp_path, caplog):
    # An island's downloader drops its long poll whenever it wants another fragment. The
    # answer then met a closed connection, and aiohttp logged it as an error with a
    # traceback (whose frames kept the body alive until the cyclic collector ran).
    cfg = make_cfg(
        tiny_config_path, tmp_path / "s", policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    )
    srv = ServerThread(cfg)
    try:
        poll = _long_poll(srv, "0,0,0,0", 30)
        time.sleep(0.3)  # waiting for a newer version ...
        poll.close()  # ... when its client goes away
        with caplog.at_level(logging.DEBUG):
            client = upload_every_fragment(srv, tiny_config_path)[0]
            wait_versions(client, [1, 1, 1, 1])  # the long poll's answer is written now
            time.sleep(0.3)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        assert any("went away" in r.getMessage() for r in caplog.records), caplog.text
        assert client.versions() == [1, 1, 1, 1]
    finally:
        srv.stop()


def test_the_coordinator_answers_throughout_uploads_dropped_polls_and_collections(
    tiny_config_path, tmp_path
):
    # Everything at once, as a busy run has it: two islands upload every fragment as fast
    # as they can, two clients drop long polls while they wait and while their bodies
    # come, and the collector runs every few allocations (finalisers give versions'
    # buffers back from whatever thread it runs on). The coordinator must answer its
    # health check throughout, merge on, and end with no buffer lost. (The freeze of
    # f6aa872 was too rare to show here: its test sets the moment up exactly.)
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "s", islands=1))
    plan = FragmentPlan.from_json(client_for(srv).plan()["plan"])
    theta = srv.coord.global_tensors()
    delta = {n: 1e-3 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
             for n, t in theta.items()}  # fmt: skip
    stop, errors = threading.Event(), []

    def island(name):
        c = client_for(srv)
        inc = c.register(name, 1, plan.signature)["incarnation"]
        step = 0
        while not stop.is_set():
            versions, step = c.versions(), step + 1
            for frag in plan.fragments:
                header = wire.UploadHeader(
                    island=name, rank=0, world_size=1, fragment=frag.index, step=step,
                    base_version=versions[frag.index], tokens=100, steps=1, incarnation=inc,
                )  # fmt: skip
                reply = c.upload(header, rank_slices(frag, delta, 1, 0))
                assert reply["status"] in ("accepted", "dropped"), reply

    def dropper():
        rng = random.Random(0)
        while not stop.is_set():
            known = ",".join(str(v - rng.randint(0, 1)) for v in srv.coord.versions())
            with _long_poll(srv, known, 5) as conn:
                time.sleep(rng.uniform(0.0, 0.02))
                if rng.random() < 0.5:
                    conn.recv(rng.randint(1, 4096))  # the head, or part of the body

    def guarded(fn, *args):
        try:
            fn(*args)
        except Exception as e:  # surfaced below
            errors.append(e)
            stop.set()

    workers = [threading.Thread(target=guarded, args=a, daemon=True)
               for a in ((island, "a"), (island, "b"), (dropper,), (dropper,))]  # fmt: skip
    health, slowest = CoordinatorClient(srv.url, TOKEN, retries=0, timeout_s=5.0), 0.0
    thresholds = gc.get_threshold()
    gc.set_threshold(20, 2, 2)  # a full collection every few hundred allocations
    try:
        for w in workers:
            w.start()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not stop.is_set():
            t0 = time.monotonic()
            health.health()  # raises after 5 s without an answer
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        stop.set()
        for w in workers:
            w.join(timeout=30)
        assert not any(w.is_alive() for w in workers), "a client waited on the coordinator"
        assert errors == [], errors
        versions = health.versions()
        assert min(versions) >= 5, versions  # it merged on throughout
        # Once the last rounds are merged and the last bodies gone, only the served values
        # hold a buffer: every other version's came back.
        settle = time.monotonic() + 10.0
        while time.monotonic() < settle:
            gc.collect()
            if srv.coord._buffers.usage()["in_use"] == len(plan.fragments):
                break
            time.sleep(0.1)
        assert srv.coord._buffers.usage()["in_use"] == len(plan.fragments)
    finally:
        gc.set_threshold(*thresholds)
        stop.set()
        srv.stop()
    assert slowest < 2.0, slowest


def test_the_round_loop_outlives_a_failure_in_the_schedule(tiny_config_path, tmp_path):
    # A failure escaping the loop used to end its task silently: uploads were still
    # accepted, /healthz fine, and nothing ever merged again.
    cfg = make_cfg(
        tiny_config_path, tmp_path / "s", policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    )
    srv = ServerThread(cfg)
    try:
        real, failures = srv.coord.schedule, []

        def failing_twice(*a, **kw):
            if len(failures) < 2:
                failures.append(1)
                raise OverflowError("a bug in the schedule")
            return real(*a, **kw)

        srv.coord.schedule = failing_twice
        client, _, _ = upload_every_fragment(srv, tiny_config_path)
        wait_versions(client, [1, 1, 1, 1])
        assert len(failures) == 2
    finally:
        srv.stop()


def test_a_merge_whose_durable_write_fails_is_retried_by_the_round_loop(tiny_config_path, tmp_path):
    # A full disk during a merge's durable write stopped the coordinator (exit 70), and
    # before that a failed merge lost the contributions it had taken: accepted, never merged.
    import errno

    cfg = make_cfg(
        tiny_config_path, tmp_path / "s", policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1)
    )
    srv = ServerThread(cfg)
    try:
        store, failed = srv.coord.store, []
        real_write = store.write_fragment

        def write_fragment(index, version, values, optim_state, merged_by=None):
            if not failed:  # the first merge's write: the disk is full, once
                failed.append((index, version))
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(index, version, values, optim_state, merged_by)

        store.write_fragment = write_fragment
        client, theta, delta = upload_every_fragment(srv, tiny_config_path)
        wait_versions(client, [1, 1, 1, 1])  # the failed fragment too, after the backoff
        (index, version), status = failed[0], client.status()
        assert version == 1
        assert status["merge_failures"] == [int(i == index) for i in range(4)]
        metrics = client.metrics()
        assert f'ds_diloco_fragment_merge_failures_total{{fragment="{index}"}} 1' in metrics
        # The coordinator's own memory, as Prometheus's process collector names it: here
        # this test's process, the one the ServerThread runs in.
        rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", metrics, re.M).group(1))
        assert 0.5 < rss / psutil.Process().memory_info().rss < 2, rss
        failure = status["last_merge_failure"][str(index)]
        assert "No space left" in failure["error"] and failure["back"] == ["a"]
        assert status["islands"]["a"]["merged"] == 4 and status["islands"]["a"]["dropped"] == 0
        # Every fragment took one outer step from theta with a's pseudo-gradient: the failed
        # attempt left no trace (a momentum stepped twice would show here).
        expected = reference_outer_step(theta, [delta], [100**2 / 4], {}, set())
        got = srv.coord.global_tensors()
        for n in theta:
            assert torch.allclose(got[n], expected[n], atol=1e-6, rtol=1e-5), n
        assert store.read_fragment(index)[0] == 1  # and on disk
    finally:
        srv.stop()


def test_a_merge_is_answered_to_its_long_polls_before_the_periodic_save(tiny_config_path, tmp_path):
    # Without durable merges, a merge's task went on to the periodic save (every changed
    # fragment's file) before the round loop woke the long polls: served, the version
    # reached no island until the save was done (2 s on this slow disk).
    cfg = make_cfg(
        tiny_config_path, tmp_path / "s", policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        durable_merges=False, save_every_merges=1,
    )  # fmt: skip
    srv = ServerThread(cfg)
    try:
        store = srv.coord.store
        real_write = store.write_fragment

        def slow_write(*args, **kwargs):
            time.sleep(2.0)
            real_write(*args, **kwargs)

        store.write_fragment = slow_write
        client, poller = client_for(srv), client_for(srv)
        client.register("a", 1, srv.coord.plan.signature)
        frag = srv.coord.plan.fragments[0]
        delta = rank_slices(frag, {p.name: torch.full(p.shape, 1e-3) for p in frag.params}, 1, 0)
        h = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=0, base_version=0,
                              step=4, tokens=64, steps=4)  # fmt: skip
        answer = []
        waiter = threading.Thread(
            target=lambda: answer.append((poller.versions(known=[0] * 4, wait=10), time.monotonic()))
        )  # fmt: skip
        waiter.start()
        time.sleep(0.3)  # waiting
        assert client.upload(h, delta)["complete"]
        while srv.coord.versions()[0] != 1:
            time.sleep(0.005)
        served = time.monotonic()
        waiter.join(timeout=15)
        assert answer and answer[0][0] == [1, 0, 0, 0], answer
        assert answer[0][1] - served < 1.0, answer[0][1] - served
        deadline = time.monotonic() + 10  # and the periodic save is made all the same
        while store.read_fragment(0)[0] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        srv.stop()


def test_discount_policy_merges_stale_contribution_with_less_weight(tiny_config_path, tmp_path):
    cfg = make_cfg(
        tiny_config_path,
        tmp_path / "s",
        policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        staleness=StalenessPolicy(mode="discount", discount_lambda=1.0),
    )
    srv = ServerThread(cfg)
    try:
        client = client_for(srv)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        frag = plan.fragments[0]
        theta = srv.coord.global_tensors()
        delta = {n: torch.full_like(t, 0.01) for n, t in theta.items()}
        for island in ("a", "b"):
            client.register(island, 1, plan.signature)
        header = dict(rank=0, world_size=1, fragment=0, step=4, tokens=100, steps=4)
        client.upload(
            wire.UploadHeader(island="a", base_version=0, **header), rank_slices(frag, delta, 1, 0)
        )
        wait_versions(client, [1, 0, 0, 0])
        reply = client.upload(
            wire.UploadHeader(island="b", base_version=0, **header), rank_slices(frag, delta, 1, 0)
        )
        assert reply["status"] == "accepted" and reply["weight"] == pytest.approx(2500 / 2)
        wait_versions(client, [2, 0, 0, 0])
    finally:
        srv.stop()


def test_every_contribution_ends_merged_or_dropped_once(tiny_config_path, tmp_path):
    """A contribution (one per island, fragment and step, whatever its ranks) is counted
    once when it can no longer be merged: replaced by a newer one, stale (on every rank),
    or pending when its island left; merged + dropped = contributions sent."""
    cfg = make_cfg(tiny_config_path, tmp_path / "s", policy=PolicyOptions(min_quorum=2, tau=1))
    srv = ServerThread(cfg)
    try:
        client = client_for(srv)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        client.register("a", 2, plan.signature)
        client.register("b", 1, plan.signature)
        delta = {n: torch.full_like(t, 0.01) for n, t in srv.coord.global_tensors().items()}

        def send(island, ranks, frag, step):
            ws = 2 if island == "a" else 1
            header = dict(island=island, world_size=ws, fragment=frag, step=step,
                          base_version=0, tokens=64, steps=4)  # fmt: skip
            f = plan.fragments[frag]
            return [client.upload(wire.UploadHeader(rank=r, **header),
                                  rank_slices(f, delta, ws, r))["status"]
                    for r in ranks]  # fmt: skip

        counts = lambda i: {k: srv.coord.status()["islands"][i][k]  # noqa: E731
                            for k in ("merged", "dropped", "steps_dropped")}  # fmt: skip
        assert send("a", [0, 1], 0, step=4) == ["accepted"] * 2
        assert send("a", [0, 1], 0, step=8) == ["accepted"] * 2  # replaces step 4's
        assert counts("a") == {"merged": 0, "dropped": 1, "steps_dropped": 4}
        assert send("b", [0], 0, step=4) == ["accepted"]
        wait_versions(client, [1, 0, 0, 0])
        assert counts("a")["merged"] == counts("b")["merged"] == 1
        assert send("a", [0, 1], 0, step=12) == ["dropped"] * 2  # stale: counted once
        assert counts("a") == {"merged": 1, "dropped": 2, "steps_dropped": 8}
        assert send("a", [0], 1, step=12) == ["accepted"]  # half a contribution, then it leaves
        client.leave("a")
        assert counts("a") == {"merged": 1, "dropped": 3, "steps_dropped": 12}  # 4 sent
        assert srv.coord.status()["pending"] == {}  # its half contribution is gone too
    finally:
        srv.stop()


# ------------------------------------------------------------------ bad input
def _snapshot(srv):
    st = srv.coord.status()
    return (
        srv.coord.versions(),
        srv.coord.global_tensors(),
        st["pending"],
        {k: (v["last_step"], v["merged"], v["dropped"]) for k, v in st["islands"].items()},
        st["buffers"]["in_use"],
    )


def _assert_same(a, b):
    assert a[0] == b[0] and a[2] == b[2] and a[3] == b[3] and a[4] == b[4]
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


@pytest.mark.parametrize("inline_bytes", [INLINE_DEFAULT, 0], ids=["inline", "streamed"])
def test_every_bad_input_is_refused_with_a_clear_error_and_changes_nothing(
    server, tiny_config_path, monkeypatch, inline_bytes
):
    import requests

    # Streamed (every body above 0 bytes): read into its contribution row as it comes.
    monkeypatch.setattr(server_mod, "INLINE_UPLOAD_BYTES", inline_bytes)

    client = client_for(server)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    client.register("a", 2, plan.signature)
    client.register("b", 1, plan.signature)
    frag = plan.fragments[1]
    theta = server.coord.global_tensors()
    delta = {n: torch.randn_like(t) * 1e-3 for n, t in theta.items()}
    good = dict(
        island="a", rank=0, world_size=2, fragment=1, base_version=0, step=4, tokens=64, steps=4
    )

    def body(slices=None, **over):
        h = wire.UploadHeader(**{**good, **over})
        ws, r = h.world_size, h.rank
        return wire.encode_upload(
            h,
            slices if slices is not None else rank_slices(frag, delta, ws, max(0, min(r, ws - 1))),
        )

    # One accepted rank-0 upload first, so that a replay and a counter mismatch can be tried.
    assert client.upload_body(body())["status"] == "accepted"
    before = _snapshot(server)

    def refused(status, text, send):
        with pytest.raises(RefusedError) as e:
            send()
        assert e.value.status == status, e.value
        assert text in e.value.message, e.value.message
        _assert_same(before, _snapshot(server))

    nan = dict(rank_slices(frag, delta, 2, 1))
    first = frag.params[0].name
    nan[first] = nan[first].clone()
    nan[first][3] = float("nan")
    inf = dict(nan)
    inf[first] = nan[first].clone().fill_(math.inf)
    short = dict(rank_slices(frag, delta, 2, 1))
    short[first] = short[first][:-1]
    halfp = {k: v.to(torch.float16) for k, v in rank_slices(frag, delta, 2, 1).items()}
    missing = dict(rank_slices(frag, delta, 2, 1))
    missing.pop(first)

    raw = requests.post(server.url + "/v1/upload", data=body())
    assert raw.status_code == 401 and "missing bearer token" in raw.json()["error"]
    bad_auth = CoordinatorClient(server.url, "not-the-token", retries=0)
    refused(401, "wrong bearer token", lambda: bad_auth.upload_body(body(rank=1)))
    refused(404, "unknown island", lambda: client.upload_body(body(island="zz", rank=1)))
    refused(404, "unknown fragment 9", lambda: client.upload_body(body(fragment=9, rank=1)))
    refused(
        422,
        "world size 2, the upload says 3",
        lambda: client.upload_body(body(world_size=3, rank=1)),
    )
    refused(422, "expected [", lambda: client.upload_body(body(short, rank=1)))
    refused(422, "dtype", lambda: client.upload_body(body(halfp, rank=1)))
    refused(422, "missing", lambda: client.upload_body(body(missing, rank=1)))
    refused(422, "NaN or Inf", lambda: client.upload_body(body(nan, rank=1)))
    refused(422, "NaN or Inf", lambda: client.upload_body(body(inf, rank=1)))
    refused(409, "from the future", lambda: client.upload_body(body(rank=1, base_version=5)))
    refused(409, "replayed upload", lambda: client.upload_body(body()))
    refused(409, "counters disagree", lambda: client.upload_body(body(rank=1, tokens=65)))
    # An island of the same name in another run (a process left from an earlier one, its
    # coordinator restarted on a new state dir): it was merged into this run's model.
    refused(409, "another run's", lambda: client.upload_body(body(rank=1, run="0123456789abcdef")))
    # ... and it stops (the syncer stops its island on this phrase, as a superseded launch)
    refused(409, wire.SUPERSEDED, lambda: client.upload_body(body(rank=1, run="0123456789abcdef")))
    refused(400, "malformed body", lambda: client.upload_body(b"\x00" * 3))
    refused(400, "malformed body", lambda: client.upload_body(body(rank=1)[:-7]))
    head = b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}  '
    huge_dim = len(head).to_bytes(8, "little") + head  # past int()'s digits: was a 500
    refused(400, "header is not JSON", lambda: client.upload_body(huge_dim))
    refused(
        400,
        "missing metadata field 'island'",
        lambda: client.upload_body(wire.encode({}, {"rank": "1"})),
    )
    refused(
        400,
        "must be an integer",
        lambda: client.upload_body(body(rank=1).replace(b'"step":"4"', b'"step":"x"')),
    )
    refused(409, "signature mismatch", lambda: client.register("a", 2, "0" * 64))
    refused(400, "incarnation must be an integer", lambda: client.leave("a", "x"))
    refused(409, "leave from incarnation 7", lambda: client.leave("a", 7))
    # A process of another run's island "a" leaving took this run's "a" out of every
    # quorum: its uploads were refused for good (410).
    refused(409, "another run's", lambda: client.leave("a", 1, run="0123456789abcdef"))
    assert not server.coord.status()["islands"]["a"]["left"]
    refused(413, "too large", lambda: client.upload_body(b"\x00" * (2**20 + 1)))
    # A small body listing thousands of empty tensors held the event loop ~1 s per request
    # (each built before the names were checked).
    many = {f"t{i}": torch.zeros(0) for i in range(5000)}
    meta = wire._header_to_meta(wire.UploadHeader(**{**good, "rank": 1}))
    refused(400, "lists 5000 tensors", lambda: client.upload_body(wire.encode(many, meta)))
    deep = requests.post(server.url + "/v1/islands", data="[" * 100_000 + "]" * 100_000,
                         headers={"Authorization": f"Bearer {server.token}"})  # fmt: skip
    assert deep.status_code == 400 and "body must be JSON" in deep.json()["error"], deep.text
    # Counters a float cannot hold: tokens^2 / steps = inf lost a whole round's merge, a
    # huge step killed the round loop and /metrics (found by review, each reproduced).
    too_big = 2**53 + 1
    for field in ("tokens", "steps", "step", "base_version", "incarnation"):
        over = {field: too_big, "step": too_big} if field == "steps" else {field: too_big}
        refused(422, "over 2**53", lambda over=over: client.upload_body(body(rank=1, **over)))
    refused(422, "exceed the island's step 4", lambda: client.upload_body(body(rank=1, steps=5)))
    # Incarnations count from 1: an island unknown here but sending the run's id was adopted
    # into the table with incarnation 0 or -7, and its upload taken.
    run = client.plan()["run"]
    for bad in (0, -7):
        refused(
            422,
            f"incarnation {bad} must be >= 1",
            lambda bad=bad: client.upload_body(
                body(island="zz", world_size=1, rank=0, run=run, incarnation=bad)
            ),
        )
    refused(
        400,  # int() would read Arabic-Indic digits, "1_0" or " 4" as numbers
        "must be an integer",
        lambda: client.upload_body(
            wire.encode(
                rank_slices(frag, delta, 2, 1),
                {
                    **wire._header_to_meta(wire.UploadHeader(**{**good, "rank": 1})),
                    "step": "\u0664",
                },
            )
        ),
    )
    refused(400, "island id must be", lambda: client.register("a?b", 1, plan.signature))
    refused(400, "island id must be", lambda: client.register("..", 1, plan.signature))
    refused(400, "world_size must be", lambda: client.register("c", True, plan.signature))
    # An id that is not one path segment names no island: "a?b" used to make "a" leave.
    refused(404, "unknown island", lambda: client.leave("a?b"))
    refused(404, "unknown island", lambda: client.start("a#1"))
    refused(400, "wait=seconds", lambda: client.versions(known=[0] * len(plan), wait=math.nan))
    raw = requests.get(server.url + "/v1/plan", headers={"Authorization": b"Bearer \xff"})
    assert raw.status_code == 401 and "wrong bearer token" in raw.json()["error"]
    _assert_same(before, _snapshot(server))

    # And the good rank-1 upload still completes the island's contribution afterwards.
    reply = client.upload_body(body(rank=1, slices=rank_slices(frag, delta, 2, 1)))
    assert reply["status"] == "accepted" and reply["complete"] is True


def test_a_download_is_written_in_slices_that_alias_the_served_values():
    # A part written whole was copied whole into the connection's buffer by asyncio when
    # the socket did not take it at once: a copy of each tensor slice per slow download.
    import numpy as np

    from ds_diloco.server import _coalesce

    big = np.arange(5 * 2**20 // 4 + 3, dtype=np.float32)  # 5 MiB and 12 bytes
    body = wire.encode_parts({"big": torch.from_numpy(big), "small": torch.ones(3)}, {})
    out = list(_coalesce(body.parts, most=2**20))
    assert b"".join(bytes(x) for x in out) == bytes(body)
    assert max(len(x) for x in out) <= 2**20
    data = [x for x in out if len(x) == 2**20]
    assert len(data) == 5 and all(np.shares_memory(np.asarray(x), big) for x in data)


def test_upload_buffers_are_kept_for_reuse_within_bounds():
    from ds_diloco.server import _Buffers

    pool = _Buffers(keep=2, max_bytes=1000)
    a = pool.take(100)
    assert len(a) >= 100
    pool.give(memoryview(a)[:100])
    assert pool.take(90) is a  # fits: reused, not allocated again
    pool.give(memoryview(a)[:90])
    assert pool.take(40) is not a  # twice as large as needed: not worth holding for it
    same = _Buffers(keep=2)
    d, e = same.take(150), same.take(150)  # equal sizes: kept and taken back by identity
    same.give(memoryview(d))
    same.give(memoryview(e))
    again = [same.take(150), same.take(150)]
    assert any(x is d for x in again) and any(x is e for x in again)
    b, c = pool.take(300), pool.take(200)
    for buf in (b, c):
        pool.give(memoryview(buf))
    assert sorted(map(len, pool._free)) == [100, 200]  # keep=2: the largest went
    pool.give(memoryview(pool.take(900)))  # 1200 bytes together: over max_bytes
    assert sum(map(len, pool._free)) <= 1000
    pool.give(memoryview(b"not ours"))  # bodies aiohttp read itself are left alone
    assert all(isinstance(buf, type(a)) for buf in pool._free)


def test_reused_upload_buffers_never_leak_into_a_merge(tiny_config_path, tmp_path):
    cfg = make_cfg(
        tiny_config_path, tmp_path / "state", islands=1, outer=OuterOptimConfig(name="average")
    )
    with ServerThread(cfg) as srv:
        client = client_for(srv)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        client.register("a", 2, plan.signature)
        frag = plan.fragments[2]
        theta = srv.coord.global_tensors()
        g = torch.Generator().manual_seed(5)
        delta = {p.name: torch.randn(p.shape, generator=g) * 1e-3 for p in frag.params}
        nan = {n: t.clone() for n, t in rank_slices(frag, delta, 2, 1).items()}
        nan[frag.params[0].name][0] = float("nan")

        def send(rank, slices):
            h = wire.UploadHeader(
                island="a", rank=rank, world_size=2, fragment=2, base_version=0, step=4,
                tokens=64, steps=4,
            )  # fmt: skip
            return client.upload_body(wire.encode_upload(h, slices))

        assert send(0, rank_slices(frag, delta, 2, 0))["status"] == "accepted"
        with pytest.raises(RefusedError, match="NaN"):
            send(1, nan)  # read into a kept buffer, refused: the buffer is kept again
        assert send(1, rank_slices(frag, delta, 2, 1))["complete"]  # reuses one of them
        deadline = time.monotonic() + 10
        while client.versions()[2] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        got = srv.coord.global_tensors()
        for p in frag.params:  # averaging: theta - merged delta, exactly
            assert torch.equal(got[p.name], theta[p.name] - delta[p.name])
        client.close()


def test_stop_ends_the_round_loop_even_as_a_merge_kicks_it(tiny_config_path, tmp_path):
    """A merge finishing as the coordinator stops: the loop's kick lands in the same turn
    as the stop. Up to Python 3.11, asyncio.wait_for then swallows a cancel() and the
    round loop ran on (a SIGTERM'd coordinator merged until its islands left, in CI)."""
    import asyncio

    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "state", islands=1))
    server = srv.server

    async def kick_and_stop():
        server._kick.set()  # what _merge_done does
        await server.stop(save=False)

    time.sleep(0.1)  # the round loop waits on its kick
    fut = asyncio.run_coroutine_threadsafe(kick_and_stop(), srv._loop)
    try:
        fut.result(timeout=10)
    finally:
        srv._loop.call_soon_threadsafe(srv._loop.stop)
    assert server._round_task.done()


@pytest.mark.parametrize(
    "inline_bytes, where",
    [(INLINE_DEFAULT, ["upload on the loop"]),
     (0, ["upload_begin on the loop", "upload_finish in the pool"])],
)  # fmt: skip
def test_small_uploads_are_taken_in_on_the_loop_and_large_ones_streamed_into_their_row(
    tiny_config_path, tmp_path, monkeypatch, inline_bytes, where
):
    monkeypatch.setattr(server_mod, "INLINE_UPLOAD_BYTES", inline_bytes)
    with ServerThread(make_cfg(tiny_config_path, tmp_path / "state", islands=1)) as srv:
        taken_in = []
        loop_thread = srv._thread.ident

        def spy(name):
            real = getattr(srv.coord, name)

            def call(*args):
                on = "on the loop" if threading.get_ident() == loop_thread else "in the pool"
                taken_in.append(f"{name} {on}")
                return real(*args)

            return call

        for name in ("upload", "upload_begin", "upload_finish"):
            monkeypatch.setattr(srv.coord, name, spy(name))
        buffers = []  # a streamed body is read into its row: no buffer of its own
        take = srv.server._buffers.take
        monkeypatch.setattr(srv.server._buffers, "take", lambda n: buffers.append(n) or take(n))
        client = client_for(srv)
        plan = FragmentPlan.from_json(client.plan()["plan"])
        client.register("a", 1, plan.signature)
        frag = plan.fragments[0]
        delta = rank_slices(frag, {p.name: torch.full(p.shape, 1e-3) for p in frag.params}, 1, 0)
        h = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=0, base_version=0,
                              step=4, tokens=64, steps=4)  # fmt: skip
        body = wire.encode_upload(h, delta)
        assert 0 < len(body) <= INLINE_DEFAULT
        assert client.upload_body(body)["complete"]
        assert taken_in == where
        assert buffers == ([len(body)] if inline_bytes else [])
        deadline = time.monotonic() + 10  # and it is merged either way
        while client.versions()[0] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client.close()


def test_an_upload_body_that_stalls_is_refused_and_its_buffer_freed(
    tiny_config_path, tmp_path, monkeypatch
):
    # A client that sent half a body and waited held its connection and a buffer of the
    # size it declared for as long as it liked (75 s seen, no timeout).
    import socket

    monkeypatch.setattr(server_mod, "BODY_IDLE_S", 0.5)
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "state", islands=1))
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n" + b"\x00" * 10
            )
            t0 = time.monotonic()
            answer = s.recv(4096).decode("latin-1")
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "upload body stalled: no byte for 0.5 s after 10 of 100000" in answer, answer
        assert time.monotonic() - t0 < 5.0
        assert CoordinatorClient(srv.url, TOKEN, retries=0).health()  # serving on
    finally:
        srv.stop()


def test_a_streamed_upload_that_stalls_is_refused_and_lets_go_of_its_row(
    tiny_config_path, tmp_path, monkeypatch
):
    # Its head said where the data go (a row of the pool): a client that stops sending
    # half-way must not keep it.
    import socket

    monkeypatch.setattr(server_mod, "BODY_IDLE_S", 0.5)
    monkeypatch.setattr(server_mod, "INLINE_UPLOAD_BYTES", 0)
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "state", islands=1))
    try:
        client, in_use, body = _registered_with_a_body(srv)
        sent = wire.head_length(body, len(body)) + 100
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
                + b"Authorization: Bearer "
                + TOKEN.encode()
                + b"\r\n\r\n"
                + body[:sent]
            )
            deadline = time.monotonic() + 5
            while srv.coord.status()["buffers"]["in_use"] == in_use:  # its row is taken
                assert time.monotonic() < deadline
                time.sleep(0.01)
            answer = s.recv(4096).decode("latin-1")
        assert answer.startswith("HTTP/1.1 408"), answer
        assert f"no byte for 0.5 s after {sent} of {len(body)}" in answer, answer
        assert srv.coord.status()["buffers"]["in_use"] == in_use
        assert srv.coord.status()["pending"] == {}
        # The same upload whole afterwards is taken (nothing of the first is held).
        assert client.upload_body(body)["complete"]
    finally:
        srv.stop()


def _registered_with_a_body(srv):
    """(client, buffers in use, an upload body of island "a" for fragment 0 at step 4)."""
    client = client_for(srv)
    client.register("a", 1, srv.coord.plan.signature)
    in_use = srv.coord.status()["buffers"]["in_use"]
    frag = srv.coord.plan.fragments[0]
    delta = rank_slices(frag, {p.name: torch.full(p.shape, 1e-3) for p in frag.params}, 1, 0)
    h = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=0, base_version=0,
                          step=4, tokens=64, steps=4)  # fmt: skip
    return client, in_use, wire.encode_upload(h, delta)


@pytest.mark.parametrize("inline_bytes", [INLINE_DEFAULT, 0], ids=["whole", "streamed"])
def test_an_upload_with_a_content_encoding_is_refused_naming_it(
    tiny_config_path, tmp_path, monkeypatch, inline_bytes
):
    # aiohttp inflated a gzip body as it came: a gzipped upload was refused as "body longer
    # than its Content-Length" or as offsets that do not match, and 1 MB of gzipped zeros
    # took 8 s of the coordinator's CPU to refuse (inflated whole, 1 GiB, to discard it).
    import gzip

    monkeypatch.setattr(server_mod, "INLINE_UPLOAD_BYTES", inline_bytes)
    with ServerThread(make_cfg(tiny_config_path, tmp_path / "state", islands=1)) as srv:
        client, in_use, body = _registered_with_a_body(srv)
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        for data in (gzip.compress(body), gzip.compress(bytes(64 << 20))):
            conn.request("POST", "/v1/upload", body=data, headers={
                "Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip"})  # fmt: skip
            r = conn.getresponse()
            error = json.loads(r.read())["error"]
            assert r.status == 415 and "Content-Encoding 'gzip'" in error, (r.status, error)
        assert srv.coord.status()["pending"] == {} and srv.coord.versions() == [0] * 4
        assert srv.coord.status()["buffers"]["in_use"] == in_use
        assert client.upload_body(body)["status"] == "accepted"  # as it is: taken


@pytest.mark.parametrize("inline_bytes", [INLINE_DEFAULT, 0], ids=["whole", "streamed"])
def test_an_upload_whose_client_goes_away_mid_body_ends_quietly_and_keeps_nothing(
    tiny_config_path, tmp_path, monkeypatch, caplog, inline_bytes
):
    # An island stopped (or cut off) half-way through an upload: the read of the rest
    # raised ConnectionResetError, which aiohttp logged as an error with a traceback.
    monkeypatch.setattr(server_mod, "INLINE_UPLOAD_BYTES", inline_bytes)
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "state", islands=1))
    try:
        client, in_use, body = _registered_with_a_body(srv)
        with caplog.at_level(logging.DEBUG, logger="ds_diloco.server"):
            with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
                    + b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
                    + body[: len(body) // 2]
                )  # fmt: skip
                time.sleep(0.2)
            deadline = time.monotonic() + 5
            while "went away" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.01)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        assert srv.coord.status()["buffers"]["in_use"] == in_use
        assert srv.coord.status()["pending"] == {}
        assert client.upload_body(body)["complete"]  # the same upload whole is taken
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "inline_bytes, max_body_mb, refusal",
    [(0, None, f"HTTP/1.1 409 .*{wire.SUPERSEDED}"),
     (INLINE_DEFAULT, 0.1, "HTTP/1.1 413 .*max_body_mb")],
    ids=["superseded", "too large"],
)  # fmt: skip
def test_an_upload_refused_before_its_body_is_in_is_answered_however_long_the_body_takes(
    tiny_config_path, tmp_path, monkeypatch, inline_bytes, max_body_mb, refusal
):
    # Refused from its head (here: from a superseded launch, or over the body limit), the
    # answer was written at once, and aiohttp read on for lingering_time (10 s) before it
    # closed the connection: a client still sending its body (a large one on a slow link)
    # got a broken pipe, not the refusal, sent the body again, and a superseded island
    # never learnt it was.
    from aiohttp import web_protocol

    monkeypatch.setattr(server_mod, "INLINE_UPLOAD_BYTES", inline_bytes)
    monkeypatch.setitem(web_protocol.RequestHandler.__init__.__kwdefaults__, "lingering_time", 0.3)
    cfg = make_cfg(tiny_config_path, tmp_path / "state", islands=1, max_body_mb=max_body_mb)
    srv = ServerThread(cfg)
    try:
        client = client_for(srv)
        for _ in range(2):  # incarnation 2: uploads of incarnation 1 are refused
            client.register("a", 1, srv.coord.plan.signature)
        frag = srv.coord.plan.fragments[0]
        delta = rank_slices(frag, {p.name: torch.full(p.shape, 1e-3) for p in frag.params}, 1, 0)
        h = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=0, base_version=0,
                              step=4, tokens=64, steps=4, incarnation=1)  # fmt: skip
        body = wire.encode_upload(h, delta)
        assert len(body) > srv.server.max_body_bytes or max_body_mb is None
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
                + b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
            )  # fmt: skip
            piece = len(body) // 4 + 1
            for i in range(0, len(body), piece):  # over 1 s, the lingering time 0.3 s
                s.sendall(body[i : i + piece])
                time.sleep(0.25)
            answer = s.recv(4096).decode("latin-1")
        assert re.match(refusal, answer, re.S), answer
        assert CoordinatorClient(srv.url, TOKEN, retries=0).health()
    finally:
        srv.stop()


def test_a_download_whose_client_stops_reading_is_cut_off(tmp_path, monkeypatch, caplog):
    # A client that asked for a fragment and stopped reading (a stopped process, its
    # connection open) held the download's handler, and what asyncio had not sent of the
    # body (with Python >= 3.12 views of the version's values: their buffer), for ever.
    # A fragment of 8 MiB: more than the socket buffers take.
    from conftest import TINY_LLAMA

    monkeypatch.setattr(server_mod, "SEND_IDLE_S", 0.3)
    path = tmp_path / "wide.json"
    path.write_text(json.dumps({**TINY_LLAMA, "vocab_size": 32768}))
    srv = ServerThread(make_cfg(str(path), tmp_path / "s", num_fragments=1))
    try:
        with caplog.at_level(logging.DEBUG), socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((srv.host, srv.port))
            s.sendall(
                f"GET /v1/fragments/0?world_size=1&rank=0 HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            time.sleep(1.0)  # not reading
            s.settimeout(3.0)
            got = b""
            while chunk := s.recv(1 << 20):  # what was sent, then the end (no time-out)
                got += chunk
        length = int(re.search(rb"Content-Length: (\d+)", got).group(1))
        assert len(got) < length, (len(got), length)
        assert "the client read nothing for 0.3 s: cut off" in caplog.text
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
        assert CoordinatorClient(srv.url, TOKEN, retries=0).health()
    finally:
        srv.stop()


def test_the_body_limit_by_default_is_the_largest_upload_a_valid_island_sends(
    tiny_config_path, tmp_path, caplog
):
    srv = ServerThread(make_cfg(tiny_config_path, tmp_path / "s", islands=1))
    try:
        need = srv.coord.largest_upload_bytes()
        largest = max(srv.coord.plan.fragments, key=lambda f: f.numel)
        assert srv.server.max_body_bytes == need > 4 * largest.numel
        client = client_for(srv)
        client.register("a", 1, srv.coord.plan.signature)
        # An island of one rank sends the largest fragment whole: taken.
        full = {p.name: torch.full(p.shape, 1e-3) for p in largest.params}
        header = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=largest.index,
                                   base_version=0, step=4, tokens=64, steps=4)  # fmt: skip
        body = wire.encode_upload(header, rank_slices(largest, full, 1, 0))
        assert 4 * largest.numel < len(body) <= need
        assert client.upload_body(body)["status"] == "accepted"
        with pytest.raises(RefusedError, match="too large") as e:
            client.upload_body(b"\x00" * (need + 1))
        assert e.value.status == 413
    finally:
        srv.stop(save=False)
    # A limit set below it is taken, with a warning that names it.
    cfg = make_cfg(tiny_config_path, tmp_path / "s", islands=1, max_body_mb=1.0)
    with caplog.at_level("WARNING", logger="ds_diloco.server"):
        assert server_mod.body_limit(cfg, srv.coord) == 2**20
    assert "max_body_mb 1 is below the largest upload a valid island sends" in caplog.text
