"""The island's agreement over sockets of its own (``ds_diloco/agreement.py``), with ranks
that are threads here; ``tests/test_zero.py`` runs it between two processes of a real
gloo group, and every multi-rank e2e test agrees over it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ds_diloco import agreement


@pytest.fixture(autouse=True)
def _no_interface_named(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the tests name one themselves


def exchanges(world: int):
    """An all-gather of objects among ``world`` threads: what the process group gives."""
    table: list = [None] * world
    barrier = threading.Barrier(world, timeout=60)

    def for_rank(rank):
        def exchange(obj):
            table[rank] = obj
            barrier.wait()
            out = list(table)
            barrier.wait()
            return out

        return exchange

    return [for_rank(r) for r in range(world)]


def open_all(world: int, hosts=None):
    hosts = hosts or ["127.0.0.1"] * world
    ex = exchanges(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(agreement.open_mesh, r, world, ex[r], hosts[r])
                   for r in range(world)]  # fmt: skip
        return [f.result(timeout=120) for f in futures]


def test_every_rank_gets_every_row_in_rank_order_call_after_call():
    world = 4
    meshes = open_all(world)
    assert all(isinstance(m, agreement.SocketAgreement) for m in meshes)
    try:
        with ThreadPoolExecutor(world) as pool:
            for k in range(20):  # rows of any length, any int64, call after call
                rows = [[r, k, -(2**62) + r] + [7] * (k % 3) for r in range(world)]
                got = list(pool.map(lambda m, row: m.gather(row), meshes, rows))
                assert got == [rows] * world, k
    finally:
        for m in meshes:
            m.close()


def test_a_peer_that_stopped_is_named_not_waited_for():
    meshes = open_all(3)
    meshes[2].close()  # what a dead rank's sockets do
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(meshes[r].gather, [r]) for r in (0, 1)]:
            with pytest.raises(ConnectionError, match="rank 2 closed its socket"):
                f.result(timeout=30)
    for m in meshes[:2]:
        m.close()


def test_a_peer_that_sends_nothing_is_waited_for_as_long_as_gloo_would_then_named(
    monkeypatch,
):
    monkeypatch.setattr(agreement, "PEER_TIMEOUT_S", 0.5)
    meshes = open_all(2)
    try:  # rank 1 is stopped (SIGSTOP, a hung step): it never calls gather
        with pytest.raises(TimeoutError, match="agreement: no row from rank 1 in"):
            meshes[0].gather([0])
    finally:
        for m in meshes:
            m.close()


def test_where_a_rank_cannot_listen_every_rank_stays_on_the_process_group(monkeypatch):
    monkeypatch.setattr(agreement, "CONNECT_TIMEOUT_S", 2.0)
    t0 = time.monotonic()
    # Rank 1's address is not this host's: it cannot listen; the others may have begun.
    assert open_all(3, hosts=["127.0.0.1", "192.0.2.1", "127.0.0.1"]) == [None, None, None]
    assert time.monotonic() - t0 < 30


def test_a_connection_without_the_islands_nonce_is_refused(monkeypatch):
    monkeypatch.setattr(agreement, "CONNECT_TIMEOUT_S", 2.0)
    ex = exchanges(2)
    real = agreement._HELLO.pack

    def wrong_nonce(nonce, rank):  # rank 1 presents another island's nonce
        return real(bytes(16) if nonce != bytes(16) else b"x" * 16, rank)

    monkeypatch.setattr(agreement, "_HELLO", type("H", (), {
        "pack": staticmethod(wrong_nonce), "unpack": agreement._HELLO.unpack,
        "size": agreement._HELLO.size}))  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(agreement.open_mesh, r, 2, ex[r], "127.0.0.1") for r in (0, 1)]
        assert [f.result(timeout=60) for f in futures] == [None, None]


def test_no_sockets_for_one_rank_too_many_ranks_or_when_turned_off(monkeypatch):
    never = lambda obj: pytest.fail("no exchange expected")  # noqa: E731
    assert agreement.open_mesh(0, 1, never) is None
    assert agreement.open_mesh(0, agreement.MAX_WORLD + 1, never) is None
    monkeypatch.setenv(agreement.ENV, "0")
    assert agreement.open_mesh(0, 2, never) is None


def test_the_address_is_the_one_towards_the_master(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert agreement.local_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert agreement.local_host() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    assert agreement.local_host() == "127.0.0.1"


def test_opening_the_sockets_does_not_load_the_idna_codec():
    # A str host given to the resolver (gethostbyname, create_connection) loads the idna
    # codec and stringprep: about 0.1 MB of objects in every rank that plain ZeRO-3 has not,
    # beyond the one fp32 shard copy a rank may hold more (ds_diloco/hostnames.py).
    probe = (
        "import sys, threading\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from ds_diloco import agreement\n"
        "table, barrier = [None, None], threading.Barrier(2, timeout=60)\n"
        "def exchange(rank):\n"
        "    def go(obj):\n"
        "        table[rank] = obj; barrier.wait(); out = list(table); barrier.wait()\n"
        "        return out\n"
        "    return go\n"
        "with ThreadPoolExecutor(2) as pool:\n"
        "    meshes = [f.result(60) for f in [pool.submit(agreement.open_mesh, r, 2, exchange(r))"
        " for r in (0, 1)]]\n"
        "print(list(meshes[0].peers) == [1], list(meshes[1].peers) == [0],"
        " sorted({'stringprep', 'encodings.idna'} & set(sys.modules)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "LOCAL_SIZE")}
    env.update(MASTER_ADDR="localhost", MASTER_PORT="29500")  # a name: the lookup runs
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "[]"], out.stdout


def test_an_island_across_nodes_listens_where_other_nodes_reach_it(monkeypatch):
    # On the master's node its host name may resolve to 127.0.1.1: listening on loopback
    # there, the island's ranks on other nodes could not connect, and it stayed on gloo.
    try:
        route = agreement._source_address(agreement.ROUTE_PROBE)
    except OSError:
        pytest.skip("this machine has no default route")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # deepspeed's launcher: 2 of the 4 ranks here
    assert not route.startswith("127.") and agreement.local_host() == route
    monkeypatch.setenv("LOCAL_SIZE", "4")  # every rank on this node: loopback serves
    assert agreement.local_host() == "127.0.0.1"
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun's name for it
    assert agreement.local_host() == route
    monkeypatch.setenv("MASTER_ADDR", route)  # a master named by its address: the same
    assert agreement.local_host() == route
    ex = exchanges(2)
    with ThreadPoolExecutor(2) as pool:  # the ranks meet at that address
        futures = [pool.submit(agreement.open_mesh, r, 2, ex[r]) for r in (0, 1)]
        meshes = [f.result(timeout=60) for f in futures]
    try:
        assert all(m is not None for m in meshes)
        assert meshes[0].peers[1].getsockname()[0] == route
    finally:
        for m in meshes:
            if m is not None:
                m.close()


def test_the_interface_gloo_is_told_to_use_gives_the_address(monkeypatch, caplog):
    # Where the default route is not the cluster's fabric, users name its interface for
    # gloo; the agreement's sockets listen there too.
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert agreement.local_host() == "127.0.0.1"
    named = {}
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError):  # an interface without an IPv4 address
            named[name] = agreement.interface_address(name)
    other = next(((n, a) for n, a in named.items() if not a.startswith("127.")), None)
    if other is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", f"{other[0]},lo")  # the first one counts
        assert agreement.local_host() == other[1]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")  # named wrong: said, then the rule
    with caplog.at_level("WARNING", logger="ds_diloco.agreement"):
        assert agreement.local_host() == "127.0.0.1"
    assert "GLOO_SOCKET_IFNAME=no-such-if0 has no IPv4 address here" in caplog.text
