"""A TCP proxy between one island and the coordinator that can add latency or cut traffic.

``ChaosProxy`` listens on 127.0.0.1 (port 0 by default) and forwards each connection to
the target host:port; the island is given ``proxy.url`` instead of the coordinator's.
It runs its own asyncio loop in a daemon thread, so any thread may call its controls:

- ``set(delay_s=d)``: every chunk, in each direction, is delivered ``d`` seconds after
  the proxy read it, and a new connection waits ``d`` before connecting upstream (the
  handshake). Delivery is pipelined, not store-and-forward: a large body pays the
  latency once, not once per chunk, up to ``max_inflight_bytes`` in flight per direction
  (beyond that the reader waits: a bandwidth-delay limit, as on a real long link).
- ``set(drop=True)``: existing connections are reset at once (in both directions) and new
  ones are accepted and reset, so the island's HTTP client sees connection errors until
  ``set(drop=False)``.
- ``set_target(host, port)``: new connections go to a new upstream (a coordinator
  restarted on another port); existing ones are left alone.

Nothing is buffered beyond one chunk per read plus the in-flight queue, so bodies of
any size stream through; there are no idle timeouts, so long polls are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
import threading
from typing import Any

log = logging.getLogger(__name__)


class _Conn:
    """One proxied connection: the client's and the upstream's writers, and its task."""

    __slots__ = ("client", "task", "upstream")

    def __init__(self, client: asyncio.StreamWriter, task: asyncio.Task):
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task = task


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER 0), so the peer sees a reset, not a clean end."""
    if writer is None:
        return
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class ChaosProxy:
    """Forwards 127.0.0.1:<port> to ``target_host:target_port``; see the module docstring."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        chunk_bytes: int = 256 * 1024,
        max_inflight_bytes: int = 8 * 1024 * 1024,
        connect_timeout_s: float = 10.0,
        scheme: str = "http",
    ):
        self.scheme = scheme  # the target's; TLS passes through the proxy untouched
        if chunk_bytes < 1:
            raise ValueError(f"ChaosProxy.chunk_bytes must be >= 1, got {chunk_bytes}")
        if max_inflight_bytes < chunk_bytes:
            raise ValueError(
                f"ChaosProxy.max_inflight_bytes ({max_inflight_bytes}) must be >= "
                f"chunk_bytes ({chunk_bytes})"
            )
        if not connect_timeout_s > 0:
            raise ValueError(f"ChaosProxy.connect_timeout_s must be > 0, got {connect_timeout_s}")
        self._target = (target_host, int(target_port))
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.chunk_bytes = chunk_bytes
        self._queue_items = max(1, max_inflight_bytes // chunk_bytes)
        self.connect_timeout_s = connect_timeout_s
        self._delay_s = 0.0
        self._drop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self.port: int | None = None
        # Counters: only the loop thread writes them.
        self.connections = 0
        """Connections accepted in total (dropped ones included)."""
        self.dropped = 0
        """Connections reset because of ``drop`` (refused new ones and cut existing ones)."""
        self.upstream_errors = 0
        """Connections closed because the target could not be reached."""
        self.bytes_up = 0
        """Bytes delivered from clients to the target."""
        self.bytes_down = 0
        """Bytes delivered from the target to clients."""

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> ChaosProxy:
        """Bind and start serving (returns at once with ``port`` set)."""
        if self._thread is not None:
            raise RuntimeError("ChaosProxy already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"chaos-proxy-{self._target[1]}", daemon=True
        )
        self._thread.start()
        try:
            self._server = self._run(
                asyncio.start_server(
                    self._handle, self.listen_host, self.listen_port, limit=self.chunk_bytes
                )
            )
        except BaseException:
            self._stop_loop()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("chaos proxy %s:%d -> %s:%d", self.listen_host, self.port, *self._target)
        return self

    def close(self) -> None:
        """Stop listening, reset every connection, stop the loop. Idempotent."""
        if self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._run(self._shutdown(), timeout_s=10.0)
        self._stop_loop()

    def __enter__(self) -> ChaosProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- controls ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http(s)://<listen_host>:<port>``: what the island should use as the coordinator's URL."""
        if self.port is None:
            raise RuntimeError("ChaosProxy not started")
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host  # IPv6
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def target(self) -> tuple[str, int]:
        return self._target

    @property
    def delay_s(self) -> float:
        return self._delay_s

    @property
    def drop(self) -> bool:
        return self._drop

    def set(self, delay_s: float = 0.0, drop: bool = False) -> None:
        """Set the latency and the drop state; ``set()`` restores a clean link.

        With ``drop``, returns once every existing connection has been reset.
        """
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)):
            raise ValueError(f"ChaosProxy.set: delay_s must be a number, got {delay_s!r}")
        if not (math.isfinite(delay_s) and delay_s >= 0):
            raise ValueError(f"ChaosProxy.set: delay_s must be finite and >= 0, got {delay_s!r}")
        self._delay_s = float(delay_s)
        self._drop = bool(drop)
        if drop and self._loop is not None and not self._loop.is_closed():
            if threading.current_thread() is self._thread:
                self._loop.create_task(self._reset_all())
            else:
                self._run(self._reset_all())

    def set_target(self, host: str, port: int) -> None:
        """Send new connections to ``host:port`` (existing ones keep their upstream)."""
        self._target = (host, int(port))

    def stats(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "active": len(self._conns),
            "dropped": self.dropped,
            "upstream_errors": self.upstream_errors,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "delay_s": self._delay_s,
            "drop": self._drop,
        }

    # ---- internals (loop thread) ---------------------------------------------------------

    def _run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _stop_loop(self) -> None:
        loop = self._loop
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all(count=False)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    async def _reset_all(self, count: bool = True) -> None:
        conns = list(self._conns)
        for c in conns:
            _reset(c.client)
            _reset(c.upstream)
            c.task.cancel()
        if count:
            self.dropped += len(conns)
        # Let the handlers unwind before returning, so callers see a clean state.
        await asyncio.gather(*(c.task for c in conns), return_exceptions=True)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter):
        self.connections += 1
        conn = _Conn(cwriter, asyncio.current_task())
        self._conns.add(conn)
        try:
            await self._serve(conn, creader)
        except asyncio.CancelledError:
            pass  # reset by drop or close: the transports are already aborted
        except (ConnectionError, OSError) as e:
            log.debug("chaos proxy: connection ended: %s", e)
        finally:
            self._conns.discard(conn)
            for w in (conn.client, conn.upstream):
                if w is not None and not w.transport.is_closing():
                    w.transport.abort()

    async def _serve(self, conn: _Conn, creader: asyncio.StreamReader) -> None:
        if self._drop:
            self.dropped += 1
            _reset(conn.client)
            return
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        host, port = self._target
        try:
            ureader, uwriter = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=self.chunk_bytes),
                self.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as e:
            self.upstream_errors += 1
            log.debug("chaos proxy: cannot reach %s:%d: %s", host, port, e)
            _reset(conn.client)
            return
        conn.upstream = uwriter
        if self._drop:  # dropped while connecting
            self.dropped += 1
            _reset(conn.client)
            _reset(uwriter)
            return
        up = asyncio.create_task(self._pipe(creader, uwriter, up=True))
        down = asyncio.create_task(self._pipe(ureader, conn.client, up=False))
        try:
            # A clean end of one direction (half-close) lets the other one finish;
            # an error in either ends both.
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in (up, down):
                t.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
        for t in (up, down):
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        with contextlib.suppress(Exception):
            conn.client.close()
            uwriter.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool
    ) -> None:
        """Copy reader -> writer, each chunk delivered ``delay_s`` after it was read."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(self._queue_items)

        async def read_side() -> None:
            try:
                while True:
                    data = await reader.read(self.chunk_bytes)
                    if not data:
                        await queue.put(None)
                        return
                    await queue.put((loop.time() + self._delay_s, data))
            except Exception as e:
                await queue.put(e)

        reading = asyncio.create_task(read_side())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                if isinstance(item, Exception):
                    raise item
                due, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
