"""ChaosProxy against a real HTTP server: forwarding, streaming, latency, drops, retargeting."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from ds_diloco.chaos.proxy import ChaosProxy

BIG = 20 * 1024 * 1024
BLOCK = bytes(range(256)) * 4096  # 1 MiB


def big_body() -> bytes:
    return b"".join(BLOCK[i:] + BLOCK[:i] for i in range(BIG // len(BLOCK)))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the coordinator

    def log_message(self, *args):
        pass

    def _reply(self, body: bytes, status: int = 200):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/ping":
            self._reply(f"pong {self.server.name}".encode())
        elif self.path.startswith("/hold/"):  # a long poll: answers after N seconds
            time.sleep(float(self.path.split("/")[2]))
            self._reply(b"held")
        elif self.path == "/big":
            self.send_response(200)
            self.send_header("Content-Length", str(BIG))
            self.end_headers()
            for i in range(BIG // len(BLOCK)):
                self.wfile.write(BLOCK[i:] + BLOCK[:i])
        elif self.path == "/gated":  # 1 MiB now, the rest once the client has seen it
            self.send_response(200)
            self.send_header("Content-Length", str(2 * len(BLOCK)))
            self.end_headers()
            self.wfile.write(BLOCK)
            self.wfile.flush()
            self.server.gate.wait(10.0)
            self.wfile.write(BLOCK)
        else:
            self._reply(b"not found", 404)

    def do_POST(self):  # digest of the body, read in pieces
        n = int(self.headers["Content-Length"])
        h = hashlib.sha256()
        while n:
            piece = self.rfile.read(min(n, 1 << 20))
            h.update(piece)
            n -= len(piece)
        self._reply(h.hexdigest().encode())


@pytest.fixture
def server():
    servers = []

    def make(name="A"):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        srv.name = name
        srv.gate = threading.Event()
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.gate.set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def target(server):
    return server("A")


@pytest.fixture
def proxy(target):
    p = ChaosProxy("127.0.0.1", target.server_address[1]).start()
    yield p
    p.close()


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # no HTTP(S)_PROXY from the environment
    return s


def timed_get(s, url, **kw):
    t = time.perf_counter()
    r = s.get(url, timeout=10, **kw)
    r.raise_for_status()
    return time.perf_counter() - t


def test_forwards_http_and_20mb_bodies_intact(proxy):
    assert proxy.url.startswith("http://127.0.0.1:") and proxy.port != proxy.target[1]
    s = session()
    assert s.get(proxy.url + "/ping", timeout=5).text == "pong A"
    assert s.get(proxy.url + "/nope", timeout=5).status_code == 404
    body = big_body()
    r = s.post(proxy.url + "/digest", data=body, timeout=30)
    assert r.text == hashlib.sha256(body).hexdigest()
    r = s.get(proxy.url + "/big", timeout=30)
    assert len(r.content) == BIG and r.content == body
    st = proxy.stats()
    assert st["connections"] == 1  # keep-alive: one connection for all four exchanges
    assert st["bytes_up"] > BIG and st["bytes_down"] > BIG
    assert st["dropped"] == 0 and st["upstream_errors"] == 0


def test_streams_instead_of_buffering(target, proxy):
    # The server sends its second half only after the client has the first one: a
    # store-and-forward proxy would time out here (the read timeout is 3 s).
    with session().get(proxy.url + "/gated", stream=True, timeout=3) as r:
        assert r.raw.read(len(BLOCK)) == BLOCK
        target.gate.set()
        assert r.raw.read(len(BLOCK)) == BLOCK


def test_many_concurrent_long_polls(proxy):
    def hold(_):
        with session() as s:
            return s.get(proxy.url + "/hold/1.0", timeout=10).text

    t = time.perf_counter()
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(hold, range(40)))
    elapsed = time.perf_counter() - t
    assert results == ["held"] * 40
    assert elapsed < 6.0, f"40 concurrent 1 s polls took {elapsed:.1f}s: not concurrent"
    assert proxy.stats()["connections"] == 40
    deadline = time.monotonic() + 5
    while proxy.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proxy.stats()["active"] == 0  # closed connections are forgotten


def test_delay_adds_latency_both_ways_and_clears(proxy):
    s = session()
    timed_get(s, proxy.url + "/ping")  # connect outside the timings
    base = min(timed_get(s, proxy.url + "/ping") for _ in range(3))
    proxy.set(delay_s=0.15)
    assert proxy.delay_s == 0.15 and not proxy.drop
    delayed = min(timed_get(s, proxy.url + "/ping") for _ in range(2))
    # One request chunk up, one response chunk down: 2 x 0.15 s on a kept-alive connection.
    assert 0.3 <= delayed < 0.3 + base + 0.5, (base, delayed)
    # A large body pays the latency once, not per chunk (80 chunks of 256 KiB).
    body = big_body()
    t = time.perf_counter()
    r = s.post(proxy.url + "/digest", data=body, timeout=30)
    assert r.text == hashlib.sha256(body).hexdigest()
    assert time.perf_counter() - t < 6.0
    proxy.set()
    assert min(timed_get(s, proxy.url + "/ping") for _ in range(3)) < 0.1


def test_drop_cuts_existing_and_new_connections_until_cleared(proxy):
    s = session()
    assert s.get(proxy.url + "/ping", timeout=5).ok
    errors: list[BaseException] = []
    cut_at: list[float] = []

    def long_poll():
        try:
            session().get(proxy.url + "/hold/8", timeout=20)
        except requests.ConnectionError as e:
            cut_at.append(time.perf_counter())
            errors.append(e)

    poller = threading.Thread(target=long_poll)
    poller.start()
    deadline = time.monotonic() + 5
    while proxy.stats()["active"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    t = time.perf_counter()
    proxy.set(drop=True)
    assert proxy.drop
    poller.join(5)
    assert not poller.is_alive() and len(errors) == 1, "the long poll was not cut"
    assert cut_at[0] - t < 2.0
    with pytest.raises(requests.ConnectionError):
        s.get(proxy.url + "/ping", timeout=5)  # its kept-alive connection was reset
    with pytest.raises(requests.ConnectionError):
        session().get(proxy.url + "/ping", timeout=5)  # and new ones are refused
    assert proxy.stats()["dropped"] >= 3
    proxy.set(drop=False)
    assert s.get(proxy.url + "/ping", timeout=5).text == "pong A"
    assert session().get(proxy.url + "/ping", timeout=5).text == "pong A"


def test_retarget_and_unreachable_upstream(server, proxy):
    s = session()
    assert s.get(proxy.url + "/ping", timeout=5).text == "pong A"
    b = server("B")
    proxy.set_target("127.0.0.1", b.server_address[1])
    assert session().get(proxy.url + "/ping", timeout=5).text == "pong B"
    b.shutdown()
    b.server_close()  # the "coordinator" is down: connection errors, counted
    with pytest.raises(requests.ConnectionError):
        session().get(proxy.url + "/ping", timeout=5)
    assert proxy.stats()["upstream_errors"] == 1


def test_bad_settings_and_lifecycle(server):
    srv = server()
    p = ChaosProxy("127.0.0.1", srv.server_address[1])
    with pytest.raises(RuntimeError, match="not started"):
        _ = p.url
    with p:
        with pytest.raises(ValueError, match="delay_s must be finite and >= 0"):
            p.set(delay_s=-0.1)
        with pytest.raises(ValueError, match="delay_s must be a number"):
            p.set(delay_s="1")
        with pytest.raises(RuntimeError, match="already started"):
            p.start()
        assert session().get(p.url + "/ping", timeout=5).ok
    p.close()  # idempotent
    with pytest.raises(requests.ConnectionError):
        session().get(p.url + "/ping", timeout=2)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        ChaosProxy("127.0.0.1", 1, chunk_bytes=1024, max_inflight_bytes=10)
