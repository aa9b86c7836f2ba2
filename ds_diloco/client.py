"""HTTP client of the coordinator's wire API, used by islands, tests and benchmarks.

Plain ``http.client`` over one keep-alive connection per thread (the syncer's
upload and download threads each hold their own): a request costs about a
sixth of the CPU ``requests`` took (0.12 against 0.70 ms for a version poll,
0.7 against 1.8 ms for a 1 MiB download, measured on 2 CPU cores), and a
download is read straight into its tensors (urllib3 read each chunk into a new
bytes object first). Proxy variables are not read: the coordinator is reached
directly, as cluster traffic is.

Connection failures are retried with bounded exponential backoff and logged
(a keep-alive connection the coordinator closed while idle is reopened at
once, not counted); a timeout waiting for an answer is raised as
``TimeoutError``; a 4xx is the coordinator refusing the request and is raised
at once as :class:`RefusedError` with the coordinator's message; a 5xx as
:class:`CoordinatorError`; a TLS handshake refused for a reason retrying does not
change (an untrusted certificate, no TLS at that address) at once as
:class:`TLSError`, saying what to fix. ``TRANSPORT_ERRORS`` is every failure of the
transport itself.

An upload sent with ``release=True`` drops its body's parts (the pseudo-gradient's
memory) as soon as its bytes are sent, before the coordinator answers; a keep-alive
connection the coordinator closed is noticed before sending (the body is then sent
on a new one), and a failure after the bytes went is raised, not sent again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import math
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from urllib.parse import quote, urlencode, urlsplit

import torch

from ds_diloco import hostnames, tls, wire
from ds_diloco.fragments import Fragment
from ds_diloco.sharding import shard_range

log = logging.getLogger(__name__)


def _quote(island: str) -> str:
    """An island id as one URL path segment ("a?b" must not leave island "a")."""
    return quote(island, safe="")


class _StatusError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class RefusedError(_StatusError):
    """The coordinator answered 4xx: the request was wrong and changed nothing."""


class CoordinatorError(_StatusError):
    """The coordinator answered 5xx: it failed on a request that may have been right."""


TRANSPORT_ERRORS = (OSError, http.client.HTTPException, CoordinatorError)
"""Failures to get an answer (unreachable, reset, timed out, a broken answer, a 5xx)."""


class TLSError(ConnectionError):
    """The TLS handshake with the coordinator failed for a reason that retrying does not
    change (its certificate refused, or no TLS at that address); the message says what to
    fix. A transport error, so a running island keeps training and retries with backoff."""


class Interrupted(ConnectionError):
    """A request stopped by :meth:`CoordinatorClient.interrupt` (its thread is being stopped)."""


_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
"""How a keep-alive connection that the server closed while idle fails on its next use."""


def _tls_config_error(e: Exception) -> bool:
    """A handshake that fails for a reason on one side's set-up, not a passing fault."""
    return isinstance(e, ssl.SSLCertVerificationError) or (
        isinstance(e, ssl.SSLError) and e.reason == "WRONG_VERSION_NUMBER"
    )


class Reply:
    """A whole answer: status, headers, body."""

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes):
        self.status_code, self.headers, self.content = status, headers, body

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class CoordinatorClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        ca_file: str | None = None,
    ):
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"coordinator URL must be http(s)://HOST[:PORT], got {url!r}")
        try:
            port = parts.port  # parsed when asked for: 'Port out of range 0-65535' named nothing
        except ValueError as e:
            raise ValueError(f"coordinator URL {url!r}: {e}") from None
        self.ca_file = ca_file
        # https: the certificate is checked against ca_file, else $DS_DILOCO_CA_FILE, else
        # the system's CAs (ds_diloco/tls.py).
        self._tls = tls.client_context(ca_file) if parts.scheme == "https" else None
        self._host, self._port = parts.hostname, port
        self._prefix = parts.path
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._token = token
        # (a newline, as from an environment variable set from a file: not a header value)
        # As UTF-8 bytes, as the coordinator reads it: http.client encodes a str as Latin-1,
        # so a token that is not ASCII was a wrong token there, or could not be sent at all.
        self._headers = {"Authorization": b"Bearer " + token.strip().encode()}
        self._local = threading.local()  # this thread's connection
        # Every thread's connection, for close() and interrupt(); dropped with the thread.
        self._conns: weakref.WeakKeyDictionary[threading.Thread, http.client.HTTPConnection]
        self._conns = weakref.WeakKeyDictionary()
        self._interrupted: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._conns_lock = threading.Lock()
        # The last request, from any thread, could not connect or got no answer in time
        # (no answer since): the coordinator is gone for now. Read by FragmentSyncer.finish.
        self.unreachable = False

    def with_limits(self, timeout_s: float, retries: int = 0) -> CoordinatorClient:
        """A new client to the same coordinator (connections of its own) that waits at most
        ``timeout_s`` for a connection or an answer and retries ``retries`` times."""
        return CoordinatorClient(
            self.url, self._token, timeout_s=timeout_s, retries=retries,
            backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s, ca_file=self.ca_file,
        )  # fmt: skip

    # ------------------------------------------------------------ transport
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._tls is not None:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.timeout_s, context=self._tls
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
            conn._create_connection = hostnames.create_connection  # no idna codec
            self._local.conn = conn
            with self._conns_lock:
                self._conns[threading.current_thread()] = conn
        return conn

    def close(self) -> None:
        """Close every thread's connection (a later request opens a new one)."""
        with self._conns_lock:
            for conn in list(self._conns.values()):
                conn.close()

    def interrupt(self, thread: threading.Thread) -> None:
        """Stop ``thread``'s request on this client, or its next one: it raises
        :class:`Interrupted` at once, without retrying, even in the middle of a long poll
        or a download (its socket is shut down, which wakes it; closing is left to it).
        Other threads' requests go on."""
        with self._conns_lock:
            self._interrupted.add(thread)
            conn = self._conns.get(thread)
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def forget_interrupt(self) -> None:
        """Drop an :meth:`interrupt` of this thread whose request had ended already (or
        that its request did not see): it would stop this thread's next request."""
        with self._conns_lock:
            self._interrupted.discard(threading.current_thread())

    def _check_interrupt(self) -> None:
        with self._conns_lock:
            me = threading.current_thread()
            if me not in self._interrupted:
                return
            self._interrupted.discard(me)
        raise Interrupted("request interrupted: the thread that sent it is being stopped")

    def _open(
        self, method: str, path: str, params: dict | None = None, body=None, content_type=None,
        release: bool = False,
    ) -> http.client.HTTPResponse:  # fmt: skip
        """Send a request and return its response, body unread; raises on 4xx and 5xx.

        ``body``: bytes, or a :class:`wire.Body` sent part by part from the tensors' memory.
        ``release`` (a Body): drop its parts once all its bytes are sent, before the answer
        comes, so that its memory is not held while the coordinator works; a failure after
        that is raised, not retried (the coordinator may have the request).
        """
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        headers = dict(self._headers)
        if content_type:
            headers["Content-Type"] = content_type
        delay = self.backoff_s
        attempt = 0
        while True:
            self._check_interrupt()
            conn = self._conn()
            if conn.sock is not None and _closed_by_peer(conn.sock):
                conn.close()  # closed by the coordinator while idle: a new one, no failure
            reused = conn.sock is not None
            connected = reused
            sent = False
            try:
                if not reused:
                    conn.connect()  # a connect that times out is retried like a refused one
                    connected = True
                    # interrupt() while it connected found no socket to shut down: nothing
                    # is sent now (close() may have let a download write an upload's body).
                    with self._conns_lock:
                        if threading.current_thread() in self._interrupted:
                            raise Interrupted("request interrupted while it connected")
                self._send(conn, method, target, headers, body)
                sent = True
                if release:
                    body.release()
                r = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if not connected or isinstance(e, TimeoutError):  # none, or no answer in time
                    self.unreachable = True  # (a hung coordinator accepts and never answers)
                self._check_interrupt()  # woken by interrupt(): no retry, no backoff
                if not connected and _tls_config_error(e):
                    raise TLSError(tls.explain(e, self.url)) from None  # the same next time
                if connected and isinstance(e, TimeoutError):
                    raise  # no answer in time: the request may be in progress, not retried
                if sent and release:
                    raise  # the body is gone; the coordinator may have taken it
                if reused and isinstance(e, _STALE):
                    continue  # closed by the coordinator while idle: reopen, not a failure
                if attempt >= self.retries:
                    raise
                attempt += 1
                log.warning("%s %s failed (%s); retry %d in %.1fs", method, path, e, attempt, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            self.unreachable = False
            if r.status >= 400:
                data = r.read()
                try:
                    msg = json.loads(data).get("error", data.decode("utf-8", "replace"))
                except (ValueError, AttributeError):
                    msg = data.decode("utf-8", "replace")
                raise (RefusedError if r.status < 500 else CoordinatorError)(r.status, msg)
            return r

    @staticmethod
    def _send(conn, method: str, target: str, headers: dict, body) -> None:
        if isinstance(body, wire.Body):
            conn.putrequest(method, target)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                conn.putheader(k, v)
            conn.endheaders()
            for part in body.parts:
                conn.send(part)
        else:
            conn.request(method, target, body=body, headers=headers)

    @contextlib.contextmanager
    def _reading(self):
        """Around reading a response: on any error the connection, half-read, is closed."""
        try:
            yield
        except BaseException:
            self._conn().close()
            raise

    def _request(self, method: str, path: str, params: dict | None = None, body=None,
                 content_type=None, release: bool = False) -> Reply:  # fmt: skip
        r = self._open(method, path, params, body, content_type, release)
        with self._reading():
            data = r.read()
        return Reply(r.status, r.headers, data)

    def _post_json(self, path: str, obj=None) -> Reply:
        body = b"" if obj is None else json.dumps(obj).encode()
        return self._request("POST", path, body=body, content_type="application/json")

    def health(self) -> dict:
        return self._request("GET", "/healthz").json()

    def status(self) -> dict:
        return self._request("GET", "/v1/status").json()

    def plan(self) -> dict:
        return self._request("GET", "/v1/plan").json()

    def model_config(self) -> dict:
        return self._request("GET", "/v1/model-config").json()

    def generation_config(self) -> dict | None:
        """The model's generation_config.json; None when it has none (or the coordinator
        predates the endpoint)."""
        try:
            return self._request("GET", "/v1/generation-config").json()
        except RefusedError as e:
            if e.status == 404:
                return None
            raise

    def versions(
        self, island: str | None = None, known: list[int] | None = None, wait: float = 0.0,
        run: str = "",
    ) -> list[int]:  # fmt: skip
        """Current versions; with ``known`` and ``wait``, once one is newer (long poll).
        ``island`` renews that island's lease; ``run`` (its run's id, the plan's ``run``):
        refused (409, superseded) if the coordinator's run is another one."""
        params = _island_query(island, run)
        if known is not None:
            params["known"] = ",".join(map(str, known))
            params["wait"] = wait
        return self._request("GET", "/v1/versions", params=params).json()["versions"]

    def register(self, island: str, world_size: int, signature: str) -> dict:
        body = {"island": island, "world_size": world_size, "signature": signature}
        return self._post_json("/v1/islands", body).json()

    def start(self, island: str, run: str = "") -> dict:
        """Say ``island`` takes its first step now: {"started": how many of the run's islands
        have, "clock": where the rounds' schedule is, in steps mod H, or None}. ``run``: as
        :meth:`versions`'."""
        path, params = f"/v1/islands/{_quote(island)}/start", _island_query(None, run)
        return self._request("POST", path, params=params, body=b"").json()

    def leave(self, island: str, incarnation: int | None = None, run: str = "") -> dict:
        """The island leaves the run for good (a later register brings it back);
        ``incarnation``: only if that registration is still the island's current one;
        ``run``: only if the coordinator's run is this one (its plan's ``run``)."""
        params = {} if incarnation is None else {"incarnation": incarnation}
        if run:
            params["run"] = run
        return self._request("DELETE", f"/v1/islands/{_quote(island)}", params=params).json()

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    def upload(self, header: wire.UploadHeader, slices: dict[str, torch.Tensor]) -> dict:
        # Streamed from the slices' memory: no copy of the pseudo-gradient is made.
        return self.upload_body(wire.upload_parts(header, slices))

    def upload_body(self, body: bytes | wire.Body, release: bool = False) -> dict:
        """Send an encoded upload; ``release`` (a Body): see :meth:`_open`."""
        if release and not isinstance(body, wire.Body):
            raise TypeError("release needs a wire.Body (bytes cannot be released)")
        return self._request(
            "POST", "/v1/upload", body=body, content_type="application/octet-stream",
            release=release,
        ).json()  # fmt: skip

    def download(
        self,
        fragment: int,
        world_size: int,
        rank: int,
        after: int | None = None,
        island: str | None = None,
        run: str = "",
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, slices) of this rank's part of a fragment; None if not newer than ``after``.
        ``island``, ``run``: as :meth:`versions`'."""
        params = _fragment_query(world_size, rank, after, island, run)
        r = self._request("GET", f"/v1/fragments/{fragment}", params=params)
        if r.status_code == 304:
            return None
        header, slices = wire.decode_fragment(r.content)
        _check_fragment(header, r.headers, fragment, world_size, rank)
        return header.version, slices

    def download_into(
        self,
        fragment: int,
        world_size: int,
        rank: int,
        dest: dict[str, torch.Tensor],
        after: int | None = None,
        island: str | None = None,
        info: dict | None = None,
        keep: Collection[str] = (),
        epoch: str = "",
        run: str = "",
    ) -> int | None:
        """Like :meth:`download`, but read straight into ``dest`` (no buffer of the body).

        Returns the version, or None if not newer than ``after``. On an error ``dest``
        may hold part of the body: the caller must not use it. ``keep``: slices ``dest``
        holds at version ``after`` of the coordinator process ``epoch`` (a download's
        ``info["epoch"]``) that the coordinator may leave out if they have not changed
        since (they are then left as they are). ``info``, if given, gets ``epoch``,
        ``unchanged`` (the slices left out), ``bytes`` (the body's) and ``opened_ago_s``
        when the coordinator says it (:data:`wire.OPENED_AGO_HEADER`).
        """
        params = _fragment_query(world_size, rank, after, island, run)
        keep = keep if after is not None and epoch else ()
        mask = wire.keep_mask(list(dest), keep)
        if mask:
            params.update(keep=mask, epoch=epoch)
        r = self._open("GET", f"/v1/fragments/{fragment}", params=params)
        with self._reading():
            if r.status == 304:
                r.read()
                return None
            try:
                length = int(r.headers["Content-Length"])
            except (KeyError, ValueError):
                raise wire.WireError("download without a Content-Length") from None
            header, _ = wire.read_fragment_into(_Whole(r), length, dest, keep=keep)
        _check_fragment(header, r.headers, fragment, world_size, rank)
        if info is not None:
            _download_info(info, header, r.headers, length)
        return header.version

    def download_next(
        self,
        known: Sequence[int],
        world_size: int,
        rank: int,
        dests: Sequence[Mapping[str, torch.Tensor]],
        claim: Callable[[int], bool],
        wait: float,
        island: str | None = None,
        keep: Sequence[Collection[str]] = (),
        epoch: str = "",
        info: dict | None = None,
        run: str = "",
    ) -> NextFragment:
        """The long poll that answers with a download: once some fragment i is newer than
        ``known[i]`` (-1: any version; a version no fragment reaches: not waited for), its
        body is read straight into ``dests[i]`` -- one request where a version poll and a
        download took two (and two round trips).

        ``claim(i)`` is called once the answer names fragment i, before any of its body is
        read: True lets it be read into ``dests[i]`` (the caller may take a lock there, for
        the fragment alone); False drops it (the connection is closed, the body unread).
        ``keep[i]``: as :meth:`download_into`'s ``keep``, the slices ``dests[i]`` holds at
        ``known[i]`` of the coordinator process ``epoch``. ``info`` gets what
        :meth:`download_into` gives. On an error after ``claim`` the caller must not use
        ``dests[i]``: it may hold part of the body.
        """
        params = {"known": ",".join(map(str, known)), "wait": wait}
        params.update(_fragment_query(world_size, rank, None, island, run))
        keep = list(keep) or [()] * len(dests)
        masks = [wire.keep_mask(list(d), k) if k else "" for d, k in zip(dests, keep)]
        offered = bool(epoch) and any(masks)
        if offered:
            params.update(keep=",".join(masks), epoch=epoch)
        r = self._open("GET", "/v1/fragments", params=params)
        with self._reading():
            if r.status == 304:
                r.read()
                return NextFragment(versions=_versions_header(r.headers, len(known)))
            fragment = _fragment_header(r.headers, len(known))
            try:
                length = int(r.headers["Content-Length"])
            except (KeyError, ValueError):
                raise wire.WireError("download without a Content-Length") from None
            if not claim(fragment):
                self._conn().close()  # its body is not wanted now: not read at all
                return NextFragment(fragment=fragment)
            kept = keep[fragment] if offered else ()
            header, _ = wire.read_fragment_into(_Whole(r), length, dests[fragment], keep=kept)
        _check_fragment(header, r.headers, fragment, world_size, rank)
        if info is not None:
            _download_info(info, header, r.headers, length)
        return NextFragment(fragment=fragment, version=header.version)


def _island_query(island: str | None, run: str) -> dict:
    params = {}
    if island:
        params["island"] = island
    if run:
        params["run"] = run
    return params


def _fragment_query(
    world_size: int, rank: int, after: int | None, island: str | None, run: str = ""
) -> dict:
    params = {"world_size": world_size, "rank": rank}
    if after is not None:
        params["after"] = after
    return {**params, **_island_query(island, run)}


@dataclasses.dataclass
class NextFragment:
    """What :meth:`CoordinatorClient.download_next` got."""

    fragment: int | None = None
    """The fragment that came (None: none was newer within the wait)."""
    version: int | None = None
    """Its version, read into its destination (None: not read, ``claim`` said no)."""
    versions: list[int] | None = None
    """When none came: every fragment's version, as the coordinator answered."""


def _download_info(info: dict, header, headers, length: int) -> None:
    ago = _opened_ago(headers)
    info["epoch"], info["unchanged"] = header.epoch, header.unchanged_names()
    info["bytes"] = length
    if ago is not None:
        info["opened_ago_s"] = ago


def _fragment_header(headers, count: int) -> int:
    raw = headers.get(wire.FRAGMENT_HEADER, "")
    if not (raw.isascii() and raw.isdigit()) or int(raw) >= count:
        raise wire.WireError(
            f"download: {wire.FRAGMENT_HEADER} must name one of {count} fragments, got {raw!r}"
        )
    return int(raw)


def _versions_header(headers, count: int) -> list[int]:
    raw = headers.get(wire.VERSIONS_HEADER, "")
    try:
        versions = [int(v) for v in raw.split(",")]
    except ValueError:
        versions = []
    if len(versions) != count:
        raise wire.WireError(
            f"not modified: {wire.VERSIONS_HEADER} must list {count} versions, got {raw[:80]!r}"
        )
    return versions


def _opened_ago(headers) -> float | None:
    raw = headers.get(wire.OPENED_AGO_HEADER)
    if raw is None:
        return None
    try:
        ago = float(raw)
    except ValueError:
        ago = math.nan
    if not (math.isfinite(ago) and ago >= 0):
        raise wire.WireError(
            f"download: {wire.OPENED_AGO_HEADER} must be seconds >= 0, got {raw!r}"
        )
    return ago


def _check_fragment(header, headers, fragment: int, world_size: int, rank: int) -> None:
    """A download's header must be the fragment and rank asked for, at the version it says."""
    if header.fragment != fragment or header.world_size != world_size or header.rank != rank:
        raise wire.WireError(
            f"download answered {header}, asked for fragment {fragment} rank {rank}/{world_size}"
        )
    if int(headers.get(wire.VERSION_HEADER, header.version)) != header.version:
        raise wire.WireError("download: version header and body disagree")


def _closed_by_peer(sock) -> bool:
    """An idle keep-alive connection with something to read: the server's close (EOF)."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class _Whole:
    """A response read to its Content-Length: ending before it is a broken connection
    (``http.client`` returns 0 bytes there), a transport failure, not a malformed body."""

    def __init__(self, r: http.client.HTTPResponse):
        self.r = r

    def readinto(self, b) -> int:
        n = self.r.readinto(b)
        if n == 0 and len(b):
            raise http.client.IncompleteRead(b"", len(b))
        return n

    def read(self, n: int) -> bytes:
        return self.r.read(n)


def rank_slices(
    fragment: Fragment, full: dict[str, torch.Tensor], world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """The flat slices of whole tensors that ``rank`` of ``world_size`` owns under ZeRO-3."""
    out = {}
    for p in fragment.params:
        a, b = shard_range(p.numel, world_size, rank)
        out[p.name] = full[p.name].reshape(-1)[a:b]
    return out
