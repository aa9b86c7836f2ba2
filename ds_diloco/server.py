"""The coordinator's HTTP service (aiohttp). Wire API: docs/wire-api.md.

The event loop moves bytes and takes in small uploads (``INLINE_UPLOAD_BYTES``);
a larger one is read straight into its contribution row (``Coordinator.upload_begin``),
and checking its values, and merges, run in a thread pool, so health,
status and downloads keep being served while a fragment merges; a download is sent
straight from the served values, which a merge never writes in place. A small round
loop closes rounds when the policy says so: right after a contribution completes, and
at the grace-window deadlines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import hmac
import logging
import math
import signal
import ssl
import threading

import numpy as np
from aiohttp import web

from ds_diloco import gc_tuning, tls, wire
from ds_diloco.config import CoordinatorConfig
from ds_diloco.coordinator import Coordinator, CoordinatorError
from ds_diloco.metrics import process_stats, prometheus_text
from ds_diloco.stall_exit import LoopStallExit

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 3.0
"""On stop, how long requests in flight may finish; an upload cut short is not
acknowledged, and the fragment's next send carries its steps."""
VERSION_HEADER = wire.VERSION_HEADER
_IDLE_POLL_S = 0.25
_MAX_WAIT_S = 30.0  # longest long poll
_READ_BUFSIZE = 16 * 1024 * 1024
_SMALL_WRITE = 64 * 1024  # download parts below this are joined before sending
_WRITE_SLICE = 1024 * 1024
"""Download parts are written this much at a time, each write waiting for the connection
to drain. asyncio copies what the socket does not take at once into the connection's
buffer: a part written whole was held there whole, so a download held a copy of a tensor
slice (the 125M Llama, 8 downloads from readers at 32 MB/s each: +177 MiB of RSS for
472 MiB served; a 7B model's MLP slices are 180 MB each, per download)."""
_KEEP_BUFFER_BYTES = 512 * 1024 * 1024  # upload buffers kept for reuse, at most
INLINE_UPLOAD_BYTES = 4 * 1024 * 1024
"""Uploads up to this size are taken in on the event loop, larger ones in the thread pool.
Decoding, checking and copying a small body costs less than the hop to a worker thread
and back (two thread wake-ups): on ``ds-diloco bench coordinator``'s round workload (2
ranks upload their halves of a 2 MiB fragment, merge, 2 downloads), three interleaved runs
of 200 rounds took 10.3-11.2 ms of coordinator CPU a round with every upload in the pool
and 9.4-10.2 ms with these on the loop (wall time per round 15.5-16.6 and 13.7-15.5 ms).
A 4 MiB body holds the loop for about a millisecond (decode, check for NaN, squared
norms, copy into its row)."""
BODY_IDLE_S = 60.0
"""An upload body that sends no byte for this long is refused (408) and its buffer freed:
a client stalled half-way held its buffer, the size it declared, for ever."""
SEND_IDLE_S = 60.0
"""A download whose client takes none of the next slice (``_WRITE_SLICE``) for this long is
cut off: a client that stopped reading (a stopped process, its connection open) held the
download's handler, and what asyncio had not sent of its body, for ever."""


def _coalesce(parts, small: int = _SMALL_WRITE, most: int = _WRITE_SLICE):
    """The parts for sending: runs of small ones joined (fewer sends), large ones in views
    of at most ``most`` bytes (no copy).

    aiohttp joins the first chunk with the HTTP headers into one new buffer (before
    Python 3.12.9 it joins whatever it writes in one call): a small first chunk keeps
    that copy small.
    """
    run: list = []
    size = 0
    for p in parts:
        if len(p) >= small:
            if run:
                yield b"".join(run)
                run, size = [], 0
            view = memoryview(p).cast("B")
            for a in range(0, len(view), most):
                yield view[a : a + most]
        else:
            run.append(p)
            size += len(p)
            if size >= small:
                yield b"".join(run)
                run, size = [], 0
    if run:
        yield b"".join(run)


class _Buffers:
    """Buffers of the upload bodies read whole (small ones, and compressed ones, which are
    decoded whole; larger plain ones are read straight into their contribution row), kept
    for the next uploads (used on the event loop only).

    Each page of a new buffer costs a page fault when first written, about as much as
    the copy into it; the uploads of a fragment come back at the same sizes every round.
    Not zero-filled (bytearray(n) is): every byte of a body is written before it is read.
    """

    def __init__(self, keep: int, max_bytes: int = _KEEP_BUFFER_BYTES):
        self._free: list[np.ndarray] = []
        self._keep, self._max_bytes = keep, max_bytes

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes: the smallest kept one that fits, else a new one."""
        fits = [i for i, b in enumerate(self._free) if n <= len(b) <= 2 * n]
        if not fits:
            return np.empty(n, dtype=np.uint8)
        return self._free.pop(min(fits, key=lambda i: len(self._free[i])))

    def give(self, body) -> None:
        """Keep the buffer of a body read by ``_read_body`` (a memoryview of it)."""
        if not isinstance(body, memoryview) or not isinstance(body.obj, np.ndarray):
            return  # chunked bodies come from aiohttp
        self._free.append(body.obj)
        self._free.sort(key=len, reverse=True)
        while len(self._free) > self._keep or sum(map(len, self._free)) > self._max_bytes:
            self._free.pop(0)  # the largest


class CoordinatorServer:
    def __init__(self, coordinator: Coordinator, token: str, max_body_bytes: int, workers: int = 4):
        self.coord = coordinator
        # A header's value never ends in white space (parsers strip it): a token read with
        # its newline (an environment variable set from a file) admitted no request.
        if not token.strip():
            raise ValueError("the bearer token is empty")
        self._token = token.strip().encode()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="coord")
        self._kick: asyncio.Event | None = None
        self._round_task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._closing = False
        self.max_body_bytes = max_body_bytes
        self._buffers = _Buffers(keep=workers)
        self.app = web.Application(
            client_max_size=max_body_bytes,
            middlewares=[self._errors, self._auth],
            # Uploads are large: a small read buffer pauses and resumes the socket
            # every 256 KiB, which costs more than the bytes themselves. Bodies are not
            # inflated (a Content-Encoding is refused): a refused 1 MB of gzipped zeros was
            # inflated whole to be discarded, 8 s of CPU.
            handler_args={"read_bufsize": _READ_BUFSIZE, "auto_decompress": False},
        )
        self.app.add_routes(
            [
                web.get("/healthz", self.health),
                web.get("/metrics", self.metrics),
                web.get("/v1/status", self.status),
                web.get("/v1/plan", self.plan),
                web.get("/v1/versions", self.versions),
                web.get("/v1/model-config", self.model_config),
                web.get("/v1/generation-config", self.generation_config),
                web.post("/v1/islands", self.register),
                web.delete("/v1/islands/{island}", self.leave),
                web.post("/v1/islands/{island}/start", self.island_start),
                web.post("/v1/upload", self.upload),
                # No HEAD (aiohttp's default on GET routes): the download streams its body
                # whatever the method, and after a HEAD's headers it was read as the
                # connection's next answer.
                web.get("/v1/fragments", self.next_fragment, allow_head=False),
                web.get("/v1/fragments/{fragment}", self.download, allow_head=False),
            ]
        )

    # ---------------------------------------------------------------- plumbing
    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except CoordinatorError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        except web.HTTPRequestEntityTooLarge as e:
            return web.json_response(
                {"error": f"request body too large: {e.text} (max_body_mb in the config)"},
                status=413,
            )
        except web.HTTPMethodNotAllowed as e:  # from the routing: name what was asked
            allowed = ", ".join(sorted(e.allowed_methods))
            return web.json_response(
                {"error": f"{request.method} {request.path}: method not allowed (allowed: "
                 f"{allowed})"}, status=405, headers={"Allow": allowed},
            )  # fmt: skip
        except web.HTTPNotFound:  # (the handlers refuse with CoordinatorError)
            return web.json_response(
                {"error": f"no such endpoint: {request.method} {request.path} (see "
                 "docs/wire-api.md; a wrong path in the coordinator URL?)"}, status=404,
            )  # fmt: skip
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return web.json_response({"error": e.text or e.reason}, status=e.status)

    @web.middleware
    async def _auth(self, request, handler):
        if request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            if header[:7].lower() != "bearer ":  # the scheme is case-insensitive (RFC 9110)
                raise CoordinatorError(401, "missing bearer token (Authorization: Bearer ...)")
            # Headers are decoded with surrogateescape: encode back the same way (bytes that
            # are not UTF-8 are a wrong token, not a 500).
            token = header[len("Bearer ") :].encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(token, self._token):
                raise CoordinatorError(401, "wrong bearer token")
        return await handler(request)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ routes
    async def health(self, request):
        return web.json_response({"ok": True, "versions": self.coord.versions()})

    async def status(self, request):
        return web.json_response({**await self._run(self.coord.status), "process": process_stats()})

    async def metrics(self, request):
        """Prometheus text format (unauthenticated, like /healthz: scrape it from inside)."""
        text = prometheus_text(await self._run(self.coord.status), process_stats())
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Format": "prometheus-0.0.4"})  # fmt: skip

    async def island_start(self, request):
        island, run = request.match_info["island"], request.query.get("run", "")
        return web.json_response(await self._run(self.coord.start, island, run))

    def _touch(self, request, what: str) -> None:
        """The lease of the island a download or poll names (``island``), renewed; refused
        if it says it is from another run (``run``)."""
        q = request.query
        self.coord.touch(q.get("island", ""), q.get("run", ""), what)

    async def leave(self, request):
        try:
            raw = request.query.get("incarnation")
            incarnation = None if raw is None else int(raw)
        except ValueError:
            raise CoordinatorError(400, "leave: incarnation must be an integer") from None
        island, run = request.match_info["island"], request.query.get("run", "")
        return web.json_response(await self._run(self.coord.leave, island, incarnation, run))

    async def plan(self, request):
        return web.json_response(self.coord.plan_info())

    async def model_config(self, request):
        return web.json_response(await self._run(self.coord.model_config))

    async def generation_config(self, request):
        return web.json_response(await self._run(self.coord.generation_config))

    async def versions(self, request):
        """Versions now, or (with known=v0,v1,... and wait=S) once one is newer than known."""
        self._touch(request, "versions poll")
        if "known" in request.query:
            known, wait = self._long_poll_query(request, "versions")
            await self._wait_newer(known, wait)
        return web.json_response({"versions": self.coord.versions()})

    def _long_poll_query(self, request, what: str) -> tuple[list[int], float]:
        """``known`` (one version per fragment) and ``wait`` (seconds, capped) of a long poll."""
        try:
            known = [int(v) for v in request.query["known"].split(",")]
            wait = float(request.query.get("wait", 0))
            if math.isnan(wait):  # never <= 0: the poll would never end
                raise ValueError
        except (KeyError, ValueError):
            raise CoordinatorError(400, f"{what}: known=v0,v1,... and wait=seconds") from None
        if len(known) != len(self.coord.versions()):
            raise CoordinatorError(
                400, f"{what}: known has {len(known)} entries, there are "
                f"{len(self.coord.versions())} fragments"
            )  # fmt: skip
        return known, min(max(wait, 0.0), _MAX_WAIT_S)

    async def _wait_newer(self, known: list[int], wait: float) -> list[int]:
        """The fragments whose version is newer than ``known`` (by index), once there is one
        or ``wait`` seconds have passed (then none): a long poll, no traffic meanwhile."""

        def newer():
            return [i for i, (v, k) in enumerate(zip(self.coord.versions(), known)) if v > k]

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while not (found := newer()) and not self._closing:
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), left)
        return found

    async def register(self, request):
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deeply
            raise CoordinatorError(400, "register: body must be JSON") from None
        if not isinstance(body, dict):
            raise CoordinatorError(400, "register: body must be a JSON object")
        missing = [k for k in ("island", "world_size", "signature") if k not in body]
        if missing:
            raise CoordinatorError(400, f"register: missing field(s) {missing}")
        reply = await self._run(
            self.coord.register, body["island"], body["world_size"], body["signature"]
        )
        return web.json_response(reply)

    async def upload(self, request):
        n, reply, head = request.content_length, None, b""
        try:
            coding = request.headers.get("Content-Encoding", "identity")
            if coding.strip().lower() not in ("", "identity"):
                raise CoordinatorError(
                    415, f"upload: Content-Encoding {coding!r} is not taken: send the body as "
                    "it is (a safetensors file)",
                )  # fmt: skip
            if n is not None and INLINE_UPLOAD_BYTES < n <= self.max_body_bytes:
                reply, head = await self._stream_upload(request, n)
            if reply is None:  # small, or compressed (decoded whole)
                reply = await self._upload_whole(request, head)
        except (CoordinatorError, web.HTTPRequestEntityTooLarge) as e:
            # (Not a stalled body again, nor a chunked one: no end known.)
            if e.status != 408 and n is not None:
                await self._discard_rest(request)
            raise
        if reply.get("complete"):
            self._kick.set()
        return web.json_response(reply)

    async def _discard_rest(self, request) -> None:
        """Read what is left of a refused upload's body. Its client reads the answer once it
        has sent the whole body, and aiohttp reads on for 10 s after answering, then closes
        the connection: a body that took longer got a reset, not its refusal (the client
        sent it again, and a superseded island never heard that it was)."""
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            while await asyncio.wait_for(request.content.readany(), BODY_IDLE_S):
                pass

    async def _upload_whole(self, request, head: bytes) -> dict:
        """An upload read into a buffer of its own and then taken in; ``head``: its first
        bytes, read already."""
        body = await self._read_body(request, head)
        self.coord.traffic["upload_bytes"] += len(body)  # counted on the loop only
        # Once upload() has returned or refused, it holds nothing of the body: the buffer is
        # free again. Not when cancelled: the worker thread may still be reading it.
        try:
            if len(body) <= INLINE_UPLOAD_BYTES:
                reply = self.coord.upload(body)
            else:
                reply = await self._run(self.coord.upload, body)
        except CoordinatorError:
            self._buffers.give(body)
            raise
        self._buffers.give(body)
        return reply

    async def _stream_upload(self, request, n: int) -> tuple[dict | None, bytes]:
        """A large upload read straight into its contribution row: the head first, which
        says where the data go (``Coordinator.upload_begin``), then the data, no buffer
        of the whole body: (reply, b""). (None, head): a compressed upload, to be read
        whole after its head."""
        head = await self._read_exactly(request, min(8, n), 0, n)
        try:
            size = wire.head_length(head, n)
        except wire.WireError as e:
            raise CoordinatorError(400, str(e)) from None
        head += await self._read_exactly(request, size - 8, 8, n)
        ing = self.coord.upload_begin(head, n)  # on the loop: the head's checks only
        if ing is None:
            return None, head
        try:
            pos = size
            while pos < n:
                chunk = await self._read_chunk(request, pos, n)
                ing.write(chunk)
                pos += len(chunk)
        except BaseException:  # refused, cut short, or the client went away
            self.coord.upload_abort(ing)
            raise
        self.coord.traffic["upload_bytes"] += n
        # Its checks (NaN/Inf, norms) read every byte: off the loop.
        return await self._run(self.coord.upload_finish, ing), b""

    async def _read_exactly(self, request, size: int, pos: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            chunk = await self._read_chunk(request, pos + len(out), n, size - len(out))
            out += chunk
        return bytes(out)

    async def _read_chunk(self, request, pos: int, n: int, most: int | None = None) -> bytes:
        """The body's next bytes (at most ``most``) from ``pos`` of ``n``, refused as
        stalled, cut short or too long."""
        try:
            if most is None:
                chunk = await asyncio.wait_for(request.content.readany(), BODY_IDLE_S)
            else:
                chunk = await asyncio.wait_for(request.content.read(most), BODY_IDLE_S)
        except asyncio.TimeoutError:
            raise CoordinatorError(
                408, f"upload body stalled: no byte for {BODY_IDLE_S:g} s after {pos} of {n}"
            ) from None
        except ConnectionError:  # (an island stopped mid-upload): not a server error
            log.debug("upload: the client went away after %d of %d bytes of its body", pos, n)
            raise CoordinatorError(400, f"body cut short: the client went away after {pos} of {n} "
                                   "bytes") from None  # fmt: skip
        if not chunk:
            raise CoordinatorError(400, f"body ended after {pos} of {n} bytes")
        if pos + len(chunk) > n:
            raise CoordinatorError(400, f"body longer than its Content-Length {n}")
        return chunk

    async def _read_body(self, request, head: bytes = b"") -> memoryview | bytes:
        """The body into one buffer allocated once (aiohttp's read() copies it twice);
        ``head``: its first bytes, read already."""
        n = request.content_length
        if n is None:
            return await request.read()  # chunked: aiohttp enforces client_max_size
        if n > self.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=n)
        view, pos = memoryview(self._buffers.take(n))[:n], len(head)
        view[:pos] = head
        try:
            while pos < n:
                chunk = await self._read_chunk(request, pos, n)
                view[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
        except BaseException:
            self._buffers.give(view)
            raise
        return view

    async def download(self, request):
        try:
            fragment = int(request.match_info["fragment"])
            world_size, rank = self._rank_query(request)
            after = int(request.query["after"]) if "after" in request.query else None
        except (KeyError, ValueError):
            raise CoordinatorError(
                400,
                "download: need integer fragment, ?world_size=W&rank=R (and optional after=V, "
                "keep=MASK, epoch=E)",
            ) from None
        self._touch(request, f"download of fragment {fragment}")
        # On the loop: no lock, no copy (the body aliases the served values).
        version, body = self.coord.download(
            fragment, world_size, rank, after,
            keep=request.query.get("keep", ""), epoch=request.query.get("epoch", ""),
        )  # fmt: skip
        if body is None:
            return web.Response(status=304, headers={VERSION_HEADER: str(version)})  # current
        return await self._send_fragment(request, fragment, version, body)

    async def next_fragment(self, request):
        """The first fragment newer than ``known``, once there is one (a long poll that
        answers with the download itself: the version poll and the download in one
        request); 304 with every version (``VERSIONS_HEADER``) if none came in ``wait``.

        ``known[i]``: the version the rank holds (-1: any version), or a version no fragment
        reaches for one it is not waiting for. ``keep=M0,M1,...``: per fragment, the
        slices to leave out if unchanged since ``known[i]`` of process ``epoch``."""
        try:
            world_size, rank = self._rank_query(request)
        except (KeyError, ValueError):
            raise CoordinatorError(
                400, "next fragment: need ?known=V0,V1,...&wait=S&world_size=W&rank=R (and "
                "optional keep=M0,M1,..., epoch=E)"
            ) from None  # fmt: skip
        if world_size < 1 or not 0 <= rank < world_size:  # now, not once a fragment is newer
            raise CoordinatorError(422, f"rank {rank} is outside world size {world_size}")
        known, wait = self._long_poll_query(request, "next fragment")
        keep = request.query.get("keep", "")
        keeps = keep.split(",") if keep else [""] * len(known)
        if len(keeps) != len(known):
            raise CoordinatorError(
                400, f"next fragment: keep has {len(keeps)} masks for {len(known)} fragments"
            )
        for frag, mask in zip(self.coord.plan.fragments, keeps):  # all, not only the one sent
            try:
                if mask:
                    wire.parse_keep_mask(mask, len(frag.params))
            except wire.WireError as e:
                raise CoordinatorError(400, f"next fragment: fragment {frag.index}: {e}") from None
        self._touch(request, "next fragment poll")
        for fragment in await self._wait_newer(known, wait):
            after = known[fragment] if known[fragment] >= 0 else None
            version, body = self.coord.download(
                fragment, world_size, rank, after, keep=keeps[fragment],
                epoch=request.query.get("epoch", ""),
            )  # fmt: skip
            if body is not None:  # (always, unless it went back since: a restore)
                return await self._send_fragment(request, fragment, version, body)
        versions = ",".join(map(str, self.coord.versions()))
        return web.Response(status=304, headers={wire.VERSIONS_HEADER: versions})

    @staticmethod
    def _rank_query(request) -> tuple[int, int]:
        return int(request.query["world_size"]), int(request.query["rank"])

    async def _send_fragment(self, request, fragment: int, version: int, body: wire.Body):
        headers = {VERSION_HEADER: str(version), wire.FRAGMENT_HEADER: str(fragment)}
        ago = self.coord.opened_ago(fragment, version)
        if ago is not None:
            headers[wire.OPENED_AGO_HEADER] = str(ago)
        resp = web.StreamResponse(headers=headers)
        resp.content_type = "application/octet-stream"
        resp.content_length = len(body)
        loop = asyncio.get_running_loop()
        taken_at = loop.time()  # when the client last took a slice

        def watch():  # one timer per download (wait_for per write: a task each, ~20 us)
            nonlocal timer
            if (idle := loop.time() - taken_at) < SEND_IDLE_S:
                timer = loop.call_later(SEND_IDLE_S - idle, watch)
            elif request.transport is not None:
                log.warning("fragment %d v%d: the client read nothing for %g s: cut off",
                            fragment, version, SEND_IDLE_S)  # fmt: skip
                request.transport.abort()  # drops what it holds of the body; the write fails

        timer = loop.call_later(SEND_IDLE_S, watch)
        try:
            await resp.prepare(request)
            for chunk in _coalesce(body.parts):
                await resp.write(chunk)
                taken_at = loop.time()
            await resp.write_eof()
        except ConnectionError:  # (an island's downloader drops its long poll to ask anew)
            log.debug("fragment %d v%d: the client went away before its body was sent",
                      fragment, version)  # fmt: skip
        finally:
            timer.cancel()
        return resp

    # -------------------------------------------------------------- round loop
    async def _round_loop(self):
        loop = asyncio.get_running_loop()
        busy: dict[int, asyncio.Future] = {}
        # Not ``while True`` + cancel(): up to Python 3.11, asyncio.wait_for swallows a
        # cancellation that lands as its awaitable completes (a merge kicking the loop),
        # and a SIGTERM'd coordinator merged on for as long as islands sent.
        while not self._closing:
            # Cheap: asked on the loop (no thread hop) unless the bookkeeping lock is busy.
            try:
                plan = self.coord.schedule(wait=False)
                due, wake = plan if plan is not None else await self._run(self.coord.schedule)
            except Exception:  # the loop must outlive a bug: a dead one never merges again
                log.exception("round schedule failed; asking again in %.1f s", _IDLE_POLL_S)
                due, wake = [], None
            for i in due:
                if i not in busy:
                    busy[i] = loop.run_in_executor(self._pool, self.coord.poll, i, False)
                    busy[i].add_done_callback(lambda _f, i=i: self._merge_done(busy, i))
            # A merge kicks the loop when it is done: its fragment needs no wake-up time.
            delay = _IDLE_POLL_S if wake is None else max(0.0, wake - self.coord.clock())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout=min(delay, _IDLE_POLL_S))
            self._kick.clear()

    def _merge_done(self, busy, i):
        fut = busy.pop(i)
        if fut.exception() is not None:
            log.error("merge of fragment %d failed", i, exc_info=fut.exception())
        self._kick.set()
        published, self._published = self._published, asyncio.Event()
        published.set()  # wakes the long polls waiting for this merge
        # Not in the merge's task: the long polls waited for the save (every changed
        # fragment's file, without durable_merges) before they heard of the version.
        if not self._closing:  # (stop saves, once the pool is done)
            self._pool.submit(self.coord.save_if_due)

    # ------------------------------------------------------------ life cycle
    async def start(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        self._kick = asyncio.Event()
        self._published = asyncio.Event()  # set (and replaced) after every merge
        # aiohttp's default grace is 60 s, and islands keep sending long polls on their
        # keep-alive connections during it: a SIGTERM took a minute to save and exit.
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        self._round_task = asyncio.create_task(self._round_loop())
        bound = site._server.sockets[0].getsockname()
        return bound[0], bound[1]

    async def stop(self, save: bool = True) -> None:
        self._closing = True
        if self._round_task is not None:
            self._kick.set()  # the loop sees _closing at once (a merge in flight ends first)
            self._published.set()  # and the long polls answer now
            with contextlib.suppress(asyncio.CancelledError):
                await self._round_task
        if self._runner is not None:
            await self._runner.cleanup()
        self._pool.shutdown(wait=True)
        if save:
            self.coord.save(final=True)


def build_server(cfg: CoordinatorConfig) -> CoordinatorServer:
    coord = Coordinator(cfg)
    return CoordinatorServer(coord, cfg.resolve_token(), body_limit(cfg, coord))


def body_limit(cfg: CoordinatorConfig, coord: Coordinator) -> int:
    """The largest request body taken, in bytes: ``max_body_mb``, else (None) the largest
    upload a valid island sends. A limit below that is named in a warning: it is a
    setting that refuses the uploads of islands with few ranks, every time."""
    need = coord.largest_upload_bytes()
    if cfg.max_body_mb is None:
        return need
    limit = int(cfg.max_body_mb * 1024 * 1024)
    if limit < need:
        log.warning(
            "max_body_mb %g is below the largest upload a valid island sends (%.1f MiB: the "
            "largest fragment in fp32 from an island of one rank): an island of W ranks "
            "sends about 1/W of it, and its uploads above %g MiB will be refused (413). "
            "Leave max_body_mb unset to take what the model needs.",
            cfg.max_body_mb, need / 2**20, cfg.max_body_mb,
        )  # fmt: skip
    return limit


def _tls_context(cfg: CoordinatorConfig) -> ssl.SSLContext | None:
    """HTTPS with the configured certificate; else a warning when others can listen in."""
    warning = tls.clear_text_warning(cfg.host, cfg.tls_cert is not None)
    if warning:
        log.warning(warning)
    return tls.server_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None


def serve_forever(cfg: CoordinatorConfig, ready=None) -> None:
    """Run until SIGTERM/SIGINT, then save the state and exit (the CLI's coordinator).

    SIGUSR1 prints every thread's stack to stderr (a hung shutdown or merge, live)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    async def main():
        context = _tls_context(cfg)
        server = build_server(cfg)
        try:
            host, port = await server.start(cfg.host, cfg.port, context)
        except OSError as e:  # taken, or a host that is not this machine's: one line
            raise ValueError(
                f"coordinator cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}"
            ) from None
        log.info("coordinator listening on %s", cfg.url_at(host, port))
        gc_tuning.resume_after_setup()
        if ready is not None:
            ready(host, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        stall = LoopStallExit(loop, cfg.stall_exit_s)
        stall.start()
        await stop.wait()
        stall.stop()
        log.info("stopping: saving state to %s", cfg.state_dir)
        await server.stop(save=True)

    asyncio.run(main())


class ServerThread:
    """A coordinator on its own event loop in a background thread (tests, demos, benches)."""

    def __init__(self, cfg: CoordinatorConfig):
        self.cfg = cfg
        self.server = build_server(cfg)
        self.coord = self.server.coord
        self.token = cfg.resolve_token()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        start = self.server.start(cfg.host, cfg.port, _tls_context(cfg))
        self.host, self.port = asyncio.run_coroutine_threadsafe(start, self._loop).result(30)
        self.url = cfg.url_at(self.host, self.port)

    def stop(self, save: bool = True) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(save=save), self._loop)
        fut.result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
