"""The coordinator client's transport against small real HTTP servers (sockets, threads).

What the islands count on: a keep-alive connection the server closed while idle
is reopened without a failure; unreachable is retried with backoff and then
raised; no answer in time is raised at once (the request may be in progress); a
4xx is a refusal and a 5xx a coordinator failure, each with the server's message;
every thread has its own connection; a download cut short is a broken transport,
not a malformed body.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from ds_diloco import wire
from ds_diloco.client import (
    TRANSPORT_ERRORS,
    CoordinatorClient,
    CoordinatorError,
    Interrupted,
    RefusedError,
)


class _Server:
    """An HTTP/1.1 server whose handler is ``respond(handler) -> (status, body)``.

    ``close_after`` closes each connection after its answer without saying so (no
    ``Connection: close``), as a server does when an idle keep-alive times out.
    """

    def __init__(self, respond, close_after: bool = False, delay_s: float = 0.0):
        self.connections = 0
        self.paths: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def setup(self):
                super().setup()
                server.connections += 1

            def _answer(self):
                n = int(self.headers.get("Content-Length", 0))
                self.body = self.rfile.read(n) if n else b""
                server.paths.append(self.path)
                time.sleep(delay_s)
                status, data = respond(self)
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if close_after:
                    self.close_connection = True

            do_GET = do_POST = _answer

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _ok(handler):
    return 200, json.dumps({"versions": [1, 2]}).encode()


def test_one_kept_alive_connection_carries_a_threads_requests():
    srv = _Server(_ok)
    try:
        c = CoordinatorClient(srv.url, "t", retries=0)
        assert [c.versions() for _ in range(5)] == [[1, 2]] * 5
        assert srv.connections == 1
        c.close()
        assert c.versions() == [1, 2] and srv.connections == 2  # reopened after close()
    finally:
        srv.close()


def test_a_connection_the_server_closed_while_idle_is_reopened_without_a_failure(caplog):
    srv = _Server(_ok, close_after=True)
    try:
        c = CoordinatorClient(srv.url, "t", retries=0)  # no retries: a failure would raise
        for _ in range(4):
            assert c.versions() == [1, 2]
            time.sleep(0.05)  # the server has closed its end by now
        assert srv.connections == 4
        assert "retry" not in caplog.text
    finally:
        srv.close()


def _upload_body(values: list[float]) -> wire.Body:
    header = wire.UploadHeader(island="a", rank=0, world_size=1, fragment=0, base_version=0,
                               step=1, tokens=4, steps=1)  # fmt: skip
    return wire.upload_parts(header, {"w": torch.tensor(values)})


def test_a_released_upload_drops_its_parts_once_sent_and_is_not_sent_twice(caplog):
    # Released: the pseudo-gradient is not held while the coordinator works on it. On a
    # kept-alive connection the server closed while idle it still goes through (the
    # close is seen before sending); a failure after the bytes went is raised, not sent
    # again (the coordinator may have taken it).
    srv = _Server(lambda h: (200, json.dumps({"status": "accepted", "n": len(h.body)}).encode()),
                  close_after=True)  # fmt: skip
    try:
        c = CoordinatorClient(srv.url, "t", retries=3)
        for i in range(3):
            body = _upload_body([float(i)] * 5)
            whole = bytes(body)
            assert c.upload_body(body, release=True) == {"status": "accepted", "n": len(whole)}
            assert body.parts is None and len(body) == len(whole)
            time.sleep(0.05)  # the server has closed its end by now
        assert srv.connections == 3 and "retry" not in caplog.text
        with pytest.raises(TypeError, match=r"wire\.Body"):
            c.upload_body(whole, release=True)
    finally:
        srv.close()

    def vanish(handler):  # reads the request, then the connection dies unanswered
        raise ConnectionAbortedError("coordinator gone")

    srv = _Server(vanish)
    try:
        c = CoordinatorClient(srv.url, "t", retries=3, backoff_s=0.01)
        body = _upload_body([1.0, 2.0])
        with pytest.raises(TRANSPORT_ERRORS):
            c.upload_body(body, release=True)
        assert srv.paths == ["/v1/upload"] and body.parts is None  # sent once
        with pytest.raises(TRANSPORT_ERRORS):
            c.upload_body(bytes(_upload_body([1.0, 2.0])))  # kept: retried
        assert srv.paths == ["/v1/upload"] * 5
    finally:
        srv.close()


def test_threads_use_their_own_connections():
    # In parallel, not one after the other: each answer waits until all three requests are
    # with the server (a bound of 0.5 s on three 0.2 s answers left a loaded machine 0.1 s
    # per thread to start and connect).
    together = threading.Barrier(3, timeout=10)
    srv = _Server(lambda handler: (together.wait(), _ok(handler))[1])
    try:
        c = CoordinatorClient(srv.url, "t", retries=0)
        out = []
        threads = [threading.Thread(target=lambda: out.append(c.versions())) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == [[1, 2]] * 3 and srv.connections == 3
        assert not together.broken
    finally:
        srv.close()


def test_interrupt_stops_one_threads_request_at_once_and_not_the_others():
    # A syncer's close() wakes its downloader out of a long poll (the server answers after
    # 2 s here): the request raises Interrupted at once, not retried although retries are
    # allowed; another thread's request on the same client is answered; the interrupted
    # thread's next request opens a new connection and is answered.
    srv = _Server(_ok, delay_s=2.0)
    try:
        c = CoordinatorClient(srv.url, "t", retries=5, backoff_s=1.0)  # no wait for a retry
        out: dict = {}

        def ask(name):
            t0 = time.perf_counter()
            try:
                out[name] = c.versions()
            except Exception as e:
                out[name] = e
            out[name + "_s"], out[name + "_end"] = time.perf_counter() - t0, time.perf_counter()

        polled = threading.Thread(target=lambda: (ask("polled"), ask("next")))
        other = threading.Thread(target=ask, args=("other",))
        polled.start()
        other.start()
        while len(srv.paths) < 2:  # both requests are with the server
            time.sleep(0.01)
        interrupted = time.perf_counter()
        c.interrupt(polled)
        polled.join(timeout=10)
        other.join(timeout=10)
        # At once, not at the answer (2 s): timed from the interrupt, not from the request's
        # start (a loaded machine may take its time to get the other request to the server).
        assert isinstance(out["polled"], Interrupted), out
        assert out["polled_end"] - interrupted < 0.8, out
        assert out["next"] == [1, 2] and out["other"] == [1, 2] and out["other_s"] >= 1.9, out
        assert len(srv.paths) == 3 and srv.connections == 3  # not retried; next: a new one
        # A request not yet sent when its thread is interrupted is stopped before it goes
        # (made once interrupted: a sleep of 0.2 s before it raced this thread's interrupt).
        go = threading.Event()
        idle = threading.Thread(target=lambda: (go.wait(10), ask("idle")))
        idle.start()
        c.interrupt(idle)
        go.set()
        idle.join(timeout=10)
        assert isinstance(out["idle"], Interrupted) and len(srv.paths) == 3, out
    finally:
        srv.close()


def test_a_request_interrupted_while_it_connects_is_not_sent_once_connected():
    # A coordinator that does not take connections (its accept queue full: a frozen
    # process, a host gone): the connect waits, and interrupt() finds no socket to shut
    # down. syncer.close() gives up on the upload thread then, and lets the next downloads
    # write the base that the upload's body aliases; connected later, the thread sent that
    # body all the same: global values as a pseudo-gradient (found by review).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):  # the accept queue is full: the next connect waits (SYNs dropped)
        f = socket.socket()
        f.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            f.connect(("127.0.0.1", port))
        fillers.append(f)
    c = CoordinatorClient(f"http://127.0.0.1:{port}", "t", retries=0, timeout_s=20.0)
    out: dict = {}

    def ask():
        try:
            out["reply"] = c.health()
        except Exception as e:
            out["reply"] = e

    t = threading.Thread(target=ask)
    got = b""
    try:
        time.sleep(0.2)
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # connecting
        c.interrupt(t)
        listener.settimeout(0.5)
        deadline = time.monotonic() + 15.0
        while t.is_alive() and time.monotonic() < deadline:  # until its SYN, resent, is in
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                conn.settimeout(0.5)
                with contextlib.suppress(TimeoutError):
                    got += conn.recv(1024)
                conn.close()
        t.join(timeout=10)
        assert isinstance(out["reply"], Interrupted), out
        assert got == b"", got[:40]
    finally:
        for f in fillers:
            f.close()
        listener.close()


def test_refusals_and_failures_carry_the_servers_message():
    answers = {"/v1/plan": (401, b'{"error": "bad token"}'), "/v1/status": (503, b"overloaded")}
    srv = _Server(lambda h: answers[h.path])
    try:
        c = CoordinatorClient(srv.url, "t", retries=3)
        with pytest.raises(RefusedError, match="401: bad token") as e:
            c.plan()
        assert e.value.status == 401
        with pytest.raises(CoordinatorError, match="503: overloaded"):
            c.status()
        assert srv.paths == ["/v1/plan", "/v1/status"]  # answered: neither is retried
        assert srv.connections == 1  # and the connection stays usable
    finally:
        srv.close()


def test_unreachable_is_retried_with_backoff_then_raised(caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = CoordinatorClient(f"http://127.0.0.1:{port}", "t", retries=2, backoff_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(ConnectionRefusedError):
        c.health()
    assert time.perf_counter() - t0 >= 0.05 + 0.1  # two waits, doubling
    assert caplog.text.count("retry") == 2
    assert issubclass(ConnectionRefusedError, TRANSPORT_ERRORS)
    assert c.unreachable  # no connection: the coordinator is gone for now (finish() asks)


def test_no_answer_in_time_is_raised_at_once_not_retried():
    srv = _Server(_ok, delay_s=1.0)
    try:
        c = CoordinatorClient(srv.url, "t", retries=3, timeout_s=0.2)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            c.versions()
        assert time.perf_counter() - t0 < 0.9 and srv.paths == ["/v1/versions"]
        assert c.unreachable  # no answer in time: a hung coordinator looks like this
    finally:
        srv.close()


def test_an_answer_clears_unreachable():
    srv = _Server(_ok)
    try:
        c = CoordinatorClient(srv.url, "t")
        c.unreachable = True  # as after a failed connection
        c.versions()
        assert not c.unreachable
    finally:
        srv.close()


def test_the_token_and_the_json_body_are_sent():
    seen = {}

    def respond(h):
        seen.update(auth=h.headers["Authorization"], type=h.headers["Content-Type"], body=h.body)
        return 200, b'{"ok": true}'

    srv = _Server(respond)
    try:
        CoordinatorClient(srv.url, "s3cret", retries=0).register("isl", 2, "abc")
        assert seen["auth"] == "Bearer s3cret" and seen["type"] == "application/json"
        assert json.loads(seen["body"]) == {"island": "isl", "world_size": 2, "signature": "abc"}
    finally:
        srv.close()


def _fragment_body() -> tuple[bytes, dict[str, torch.Tensor]]:
    header = wire.FragmentHeader(fragment=0, version=3, world_size=1, rank=0)
    slices = {"w": torch.arange(1000, dtype=torch.float32)}
    return bytes(wire.fragment_parts(header, slices)), slices


def _fragment_server(body: bytes, headers: dict, cut: dict) -> http.server.ThreadingHTTPServer:
    """Serves ``body`` as version 3 with ``headers``; half of it while ``cut["on"]``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header(wire.VERSION_HEADER, "3")
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[: len(body) // 2] if cut["on"] else body)
            self.close_connection = cut["on"]

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_download_is_read_into_the_tensors_and_one_cut_short_is_a_transport_failure():
    body, slices = _fragment_body()
    cut = {"on": False}
    httpd = _fragment_server(body, {}, cut)
    try:
        c = CoordinatorClient(f"http://127.0.0.1:{httpd.server_address[1]}", "t", retries=0)
        dest = {"w": torch.zeros(1000)}
        assert c.download_into(0, 1, 0, dest) == 3 and torch.equal(dest["w"], slices["w"])
        cut["on"] = True
        with pytest.raises(http.client.IncompleteRead):
            c.download_into(0, 1, 0, {"w": torch.zeros(1000)})
        cut["on"] = False
        assert c.download_into(0, 1, 0, dest) == 3  # a new connection, not the broken one
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("raw", [None, "0.25", "nan", "-1", "soon"])
def test_a_downloads_opened_ago_header_is_read_and_a_bad_one_named(raw):
    body, _ = _fragment_body()
    headers = {} if raw is None else {wire.OPENED_AGO_HEADER: raw}
    httpd = _fragment_server(body, headers, {"on": False})
    try:
        c = CoordinatorClient(f"http://127.0.0.1:{httpd.server_address[1]}", "t", retries=0)
        info: dict = {}
        if raw in ("nan", "-1", "soon"):
            with pytest.raises(wire.WireError, match=f"{wire.OPENED_AGO_HEADER}.*{raw!r}"):
                c.download_into(0, 1, 0, {"w": torch.zeros(1000)}, info=info)
            assert info == {}
        else:
            assert c.download_into(0, 1, 0, {"w": torch.zeros(1000)}, info=info) == 3
            ago = {} if raw is None else {"opened_ago_s": 0.25}
            old = {"epoch": "", "unchanged": [], "bytes": len(body)}  # a body without the fields
            assert info == {**old, **ago}
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_bad_url_is_refused_with_its_name():
    with pytest.raises(ValueError, match="ftp://x"):
        CoordinatorClient("ftp://x", "t")
    # A port urllib cannot read: the URL named, not a bare 'Port out of range 0-65535'.
    for url in ("http://127.0.0.1:99999", "http://127.0.0.1:abc"):
        with pytest.raises(ValueError, match=rf"^coordinator URL '{url}': Port"):
            CoordinatorClient(url, "t")


def test_a_rank_reaching_the_coordinator_by_name_does_not_load_the_idna_codec():
    # getaddrinfo encodes a str host with the idna codec, which imports stringprep: 0.4 MB
    # in every rank, beyond the one fp32 shard copy a rank may hold more than plain ZeRO-3.
    srv = _Server(_ok)
    try:
        probe = (
            "import sys; from ds_diloco.client import CoordinatorClient; "
            f"c = CoordinatorClient({srv.url.replace('127.0.0.1', 'localhost')!r}, 't', retries=0); "
            "print(c.versions(), sorted({'stringprep', 'encodings.idna'} & set(sys.modules)))"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    finally:
        srv.close()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[1,", "2]", "[]"], out.stdout
