"""Name lookups that leave the ``idna`` codec unloaded: a rank's sockets to the coordinator
and to its island's peers.

``socket.getaddrinfo`` (under ``create_connection``) and ``socket.gethostbyname`` encode a
``str`` host, even an address such as "127.0.0.1", with the ``idna`` codec, and its first
use imports ``stringprep`` and unicodedata's 3.2 tables: about 107 kB of Python objects in
a training rank (tracemalloc at step 20 of ``ds-diloco bench island``), 420 kB of resident
memory in a fresh interpreter, in every rank, that a plain ZeRO-3 rank never loads. That
counts against the one fp32 shard copy a rank may hold beyond plain ZeRO-3. An ASCII host
passed as bytes skips the codec; other names still go through it (and so does TLS's
server name, for a host name that is no address)."""

from __future__ import annotations

import socket


def lookup_form(host):
    """``host`` as the resolver is given it: ASCII text as bytes, anything else unchanged."""
    return host.encode("ascii") if isinstance(host, str) and host.isascii() else host


def create_connection(address, *args, **kwargs) -> socket.socket:
    """``socket.create_connection`` with the host in :func:`lookup_form`."""
    host, port = address
    return socket.create_connection((lookup_form(host), port), *args, **kwargs)


def gethostbyname(host: str) -> str:
    """``socket.gethostbyname`` with the host in :func:`lookup_form`."""
    return socket.gethostbyname(lookup_form(host))
