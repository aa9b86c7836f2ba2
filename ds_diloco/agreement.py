"""The island's per-step agreement over TCP sockets of its own, beside the process group.

Every inner step the ranks of an island exchange a few integers (which fragment versions
each holds, its token count, ...). On gloo that all-gather is queued to the process
group's worker threads and the caller waits for them: on busy cores each hand-off waits
for a core, and a rank waited 1.6-1.7 ms on average after the later rank arrived, against
0.2-0.25 ms over a socket that the waiting rank reads itself (docs/measurements.md). So
the ranks open a socket to each other once, at start, and exchange the rows there.

:func:`open_mesh` is given an ``exchange`` (every rank's object, by rank: an all-gather of
the process group, made by :mod:`ds_diloco.zero`) and returns None where the sockets could
not be opened on every rank: the agreement then stays on the process group. No thread,
no timer: a rank writes its row to every peer, then reads each peer's. A peer that died
closes its sockets, and the read raises; one that hangs, after ``PEER_TIMEOUT_S`` (the
island stops, as on a gloo error, and is restarted).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence

from ds_diloco import hostnames

log = logging.getLogger(__name__)

ENV = "DS_DILOCO_SOCKET_AGREEMENT"
"""Set to 0 to keep the agreement on the process group."""

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""The network interface the island's traffic is told to use (gloo's variable): the
agreement listens on its address too."""

MAX_WORLD = 64
"""Islands of more ranks stay on the process group: the sockets form a full mesh."""

CONNECT_TIMEOUT_S = 10.0
"""How long a rank tries to reach a peer at start before the island stays on the group."""

PEER_TIMEOUT_S = 1800.0
"""How long a rank waits for a peer's row: as long as a gloo collective waits by default
(a rank stopped for good then fails the island, which is restarted, as on gloo)."""

_HELLO = struct.Struct("<16sI")  # the island's nonce, the connecting rank
_COUNT = struct.Struct("<I")


class SocketAgreement:
    """Connected sockets to every other rank of the island, by rank."""

    def __init__(self, rank: int, world: int, peers: dict[int, socket.socket]):
        self.rank, self.world, self.peers = rank, world, peers

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values``, by rank (each rank calls it at the same point)."""
        row = _COUNT.pack(len(values)) + struct.pack(f"<{len(values)}q", *values)
        for peer in self.peers.values():
            peer.sendall(row)  # a few bytes: into the socket's buffer, never waits for a read
        rows: list[list[int]] = []
        for r in range(self.world):
            if r == self.rank:
                rows.append([int(v) for v in values])
                continue
            who = f"rank {r}"
            (n,) = _COUNT.unpack(_read(self.peers[r], _COUNT.size, who))
            rows.append(list(struct.unpack(f"<{n}q", _read(self.peers[r], 8 * n, who))))
        return rows

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers = {}


def _read(sock: socket.socket, n: int, who: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise TimeoutError(
                f"agreement: no row from {who} in {sock.gettimeout():.0f} s"
            ) from None
        if k == 0:
            raise ConnectionError(f"agreement: {who} closed its socket (it stopped)")
        got += k
    return bytes(buf)


ROUTE_PROBE = ("192.0.2.1", 9)
"""An address off every network here (TEST-NET-1): a UDP socket "connected" to it takes
the default route's source address; nothing is sent."""


def spans_nodes() -> bool:
    """The launcher says the island has ranks on other nodes (``WORLD_SIZE`` above the
    ranks started on this one: deepspeed's ``LOCAL_SIZE``, torchrun's ``LOCAL_WORLD_SIZE``)."""
    local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
    try:
        return local is not None and int(os.environ.get("WORLD_SIZE", local)) > int(local)
    except ValueError:
        return False


def _source_address(target: tuple[str, int]) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(target)  # sends nothing: picks the route
        return s.getsockname()[0]


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's address


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux; OSError where it has none)."""
    import fcntl  # here, not above: a rank that names no interface loads nothing new

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def local_host() -> str:
    """The address this rank listens on: that of the interface ``GLOO_SOCKET_IFNAME``
    names (its first), where it is set: the one the island's traffic is told to use.
    Else the one its traffic to the island's master (``MASTER_ADDR``, where rank 0
    runs) leaves from, so peers on other nodes reach it. On the master's node
    ``MASTER_ADDR`` may resolve to loopback (a host name mapped to 127.0.1.1): loopback
    serves an island on one node; one that spans nodes listens on the address of the
    default route, which the other nodes can reach."""
    named = os.environ.get(IFNAME_ENV, "").split(",")[0].strip()
    if named:
        try:
            return interface_address(named)
        except (OSError, ImportError) as e:
            log.warning("agreement: %s=%s has no IPv4 address here (%s); the address "
                        "towards MASTER_ADDR is used", IFNAME_ENV, named, e)  # fmt: skip
    try:
        target = hostnames.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        port = int(os.environ.get("MASTER_PORT", "29500"))
        if not target.startswith("127."):
            return _source_address((target, port))
        return _source_address(ROUTE_PROBE) if spans_nodes() else "127.0.0.1"
    except (OSError, ValueError):
        return "127.0.0.1"


def open_mesh(
    rank: int, world: int, exchange: Callable[[object], list], host: str | None = None
) -> SocketAgreement | None:
    """Sockets between every pair of the island's ranks, or None (on every rank) where one
    could not be opened. A collective: every rank calls it at the same point.

    Each rank listens, the addresses go round through ``exchange``, each rank connects to
    the ranks below it and accepts the ranks above it (a hello with the island's nonce
    names the rank, so nothing else can take a peer's place), and ``exchange`` says
    whether every rank got all of its peers."""
    if world < 2 or world > MAX_WORLD or os.environ.get(ENV, "1") == "0":
        return None
    peers: dict[int, socket.socket] = {}
    listener = None
    address = None
    try:
        listener = socket.create_server((host or local_host(), 0), backlog=world)
        listener.settimeout(CONNECT_TIMEOUT_S)
        address = listener.getsockname()[:2]
    except OSError as e:
        log.warning("agreement: cannot listen (%s); it stays on the process group", e)
    nonce = os.urandom(16) if rank == 0 else b""
    table = exchange((address, nonce))
    nonce = table[0][1]
    try:
        if any(a is None for a, _ in table):
            raise OSError("a rank could not listen")
        for r in range(rank):
            s = hostnames.create_connection(tuple(table[r][0]), timeout=CONNECT_TIMEOUT_S)
            s.sendall(_HELLO.pack(nonce, rank))
            peers[r] = s
        for _ in range(rank + 1, world):
            s, addr = listener.accept()
            s.settimeout(CONNECT_TIMEOUT_S)
            got, r = _HELLO.unpack(_read(s, _HELLO.size, f"the peer at {addr}"))
            if got != nonce or not rank < r < world or r in peers:
                s.close()
                raise OSError(f"an unexpected connection from {addr}")
            peers[r] = s
        ok = True
    except OSError as e:
        log.warning("agreement: rank %d could not reach its peers (%s); it stays on the "
                    "process group", rank, e)  # fmt: skip
        ok = False
    finally:
        if listener is not None:
            listener.close()
    if not all(flag for flag in exchange(ok)):
        for s in peers.values():
            s.close()
        return None
    for s in peers.values():
        s.settimeout(PEER_TIMEOUT_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return SocketAgreement(rank, world, peers)
