"""The state directory's durable writes: parts written as they are, swapped in with a spare."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import threading

import pytest
import torch

from ds_diloco import state_store, wire
from ds_diloco.state_store import StateStore, atomic_write, spare_path

exchange = pytest.mark.skipif(state_store._renameat2 is None, reason="no renameat2 here")


def _fragment(seed: int, n: int = 1000):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), {
        "num_steps": torch.tensor(seed, dtype=torch.int64),
        "momentum_buffer": torch.randn(n, generator=g),
    }


def _old_encoding(index, version, values, optim) -> bytes:
    """What write_fragment wrote before it wrote parts: one joined buffer."""
    tensors = {"values": values, **{f"optim.{k}": v.reshape(-1) for k, v in optim.items()}}
    shapes = {k: list(v.shape) for k, v in optim.items()}
    meta = {"fragment": str(index), "version": str(version), "optim_shapes": json.dumps(shapes)}
    return wire.encode(tensors, meta)


def test_fragment_file_is_the_joined_encoding_and_reads_back(tmp_path):
    store = StateStore(tmp_path)
    for version in (3, 4):  # a new file, then a rewrite through the spare
        values, optim = _fragment(version)
        store.write_fragment(7, version, values, optim)
        path = tmp_path / "fragments" / "frag-00007.safetensors"
        assert path.read_bytes() == _old_encoding(7, version, values, optim)
        got_version, got_values, got_optim = store.read_fragment(7)
        assert got_version == version and torch.equal(got_values, values)
        assert set(got_optim) == set(optim)
        assert all(torch.equal(got_optim[k], optim[k]) for k in optim)


@exchange
def test_a_rewrite_swaps_the_file_with_its_spare(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, b"first", keep_spare=True)
    assert not spare_path(path).exists()  # a new file: written under a temporary name
    atomic_write(path, [b"sec", memoryview(b"ond!")], keep_spare=True)
    assert path.read_bytes() == b"second!" and spare_path(path).read_bytes() == b"first"
    atomic_write(path, b"3", keep_spare=True)  # shorter than the spare it overwrites
    assert path.read_bytes() == b"3" and spare_path(path).read_bytes() == b"second!"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".f.bin.spare", "f.bin"]
    atomic_write(path, b"plain")  # without keep_spare: the classic rename, spare untouched
    assert path.read_bytes() == b"plain" and spare_path(path).read_bytes() == b"second!"


def test_without_the_swap_the_spare_is_renamed_over_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(state_store, "_exchange", lambda a, b: False)
    path = tmp_path / "f.bin"
    for data in (b"one", b"two", b"three"):
        atomic_write(path, data, keep_spare=True)
        assert path.read_bytes() == data and not spare_path(path).exists()


@exchange
def test_a_file_system_without_the_swap_falls_back_and_other_failures_are_raised(
    tmp_path, monkeypatch
):
    # The fallback was only ever reached with _exchange itself stood in for: which errors
    # mean "this file system cannot swap" (rename instead) was never checked.
    path = tmp_path / "f.bin"
    for data in (b"one", b"two"):  # the spare now exists: the next write swaps
        atomic_write(path, data, keep_spare=True)
    with pytest.raises(FileNotFoundError):  # the real call: a failure that is not "cannot"
        state_store._exchange(tmp_path / "missing", path)

    def failing(err):
        def renameat2(*args):
            ctypes.set_errno(err)
            return -1

        return renameat2

    for err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        monkeypatch.setattr(state_store, "_renameat2", failing(err))
        atomic_write(path, errno.errorcode[err].encode(), keep_spare=True)
        assert path.read_bytes() == errno.errorcode[err].encode()
    monkeypatch.setattr(state_store, "_renameat2", failing(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write(path, b"lost", keep_spare=True)
    assert path.read_bytes() == errno.errorcode[errno.EOPNOTSUPP].encode()  # the last kept


def test_a_crash_before_the_swap_leaves_the_old_file_whole(tmp_path, monkeypatch):
    store = StateStore(tmp_path)
    values, optim = _fragment(1)
    store.write_fragment(0, 1, values, optim)
    store.write_fragment(0, 2, *_fragment(2))  # the spare now exists: the next write uses it
    old = store.read_fragment(0)

    def crash(a, b):
        raise OSError("killed between the spare's fsync and the swap")

    monkeypatch.setattr(state_store, "_exchange", crash)
    with pytest.raises(OSError, match="killed"):
        store.write_fragment(0, 3, *_fragment(3))
    version, got, _ = store.read_fragment(0)
    assert version == old[0] == 2 and torch.equal(got, old[1])
    # A torn spare (a crash while it was written) is never read, and the next write heals it.
    spare_path(tmp_path / "fragments" / "frag-00000.safetensors").write_bytes(b"\x00" * 99)
    monkeypatch.undo()
    assert store.read_fragment(0)[0] == 2
    values, optim = _fragment(4)
    store.write_fragment(0, 4, values, optim)
    assert torch.equal(store.read_fragment(0)[1], values)


def test_short_writes_are_resumed(tmp_path, monkeypatch):
    real = os.writev

    def stingy(fd, buffers):  # at most 777 bytes per call, as a full pipe or disk may
        budget, out = 777, []
        for b in buffers:
            out.append(memoryview(b)[:budget])
            budget -= len(out[-1])
            if not budget:
                break
        return real(fd, out)

    monkeypatch.setattr(state_store.os, "writev", stingy)
    parts = [bytes(range(256)) * 7, b"", memoryview(bytes(5000)), b"tail"]
    for keep_spare in (False, True, True):
        atomic_write(tmp_path / "f.bin", parts, keep_spare=keep_spare)
        assert (tmp_path / "f.bin").read_bytes() == b"".join(bytes(p) for p in parts)


def test_writers_of_the_same_file_never_mix(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, b"start", keep_spare=True)
    contents = [bytes([i]) * (50_000 + 1000 * i) for i in range(4)]

    def writer(data):
        for _ in range(10):
            atomic_write(path, data, keep_spare=True)

    threads = [threading.Thread(target=writer, args=(c,)) for c in contents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_bytes() in contents


@exchange
def test_a_read_that_two_rewrites_overtake_is_done_again(tmp_path, monkeypatch):
    # An export reads a fragment file while the coordinator merges: two rewrites swap the
    # file out and back, and the second overwrites it in place. A read slower than both
    # got the head of one version and the tail of the next, and decoded it without a word.
    import builtins
    import io
    import time

    store = StateStore(tmp_path)
    for version in (1, 2):  # the file and its spare
        store.write_fragment(0, version, *_fragment(version))
    path = tmp_path / "fragments" / "frag-00000.safetensors"
    real_open, overtaken = builtins.open, []

    class Slow(io.FileIO):
        def read(self, size=-1):
            if overtaken or size != -1:
                return super().read(size)
            head = super().read(os.fstat(self.fileno()).st_size // 2)
            for version in (3, 4):  # the coordinator writes on meanwhile
                time.sleep(0.02)  # past the clock tick that file times are stamped with
                store.write_fragment(0, version, *_fragment(version))
            overtaken.append(True)
            return head + super().read()

    def slow_open(file, mode="r", *args, **kwargs):
        if str(file) == str(path) and mode == "rb":
            return Slow(file, "rb")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", slow_open)
    monkeypatch.setattr(io, "open", slow_open)  # Path.read_bytes opens through io.open
    version, values, optim = store.read_fragment(0)
    monkeypatch.undo()
    assert overtaken
    want_values, want_optim = _fragment(version)
    assert torch.equal(values, want_values), version
    assert torch.equal(optim["momentum_buffer"], want_optim["momentum_buffer"]), version


def test_a_state_file_damaged_outside_the_coordinator_is_named_in_the_error(tmp_path):
    # A coordinator restarted on such a directory said only "Expecting property name
    # enclosed in double quotes: line 1 column 2" (which file?).
    store = StateStore(tmp_path)
    store.write_json("coordinator.json", {"plan": 1})
    store.write_fragment(0, 3, torch.arange(4.0), {})
    (tmp_path / "coordinator.json").write_text("{")
    with pytest.raises(ValueError, match=r"state file .*coordinator\.json is not valid JSON"):
        store.read_json("coordinator.json")
    path = tmp_path / "fragments" / "frag-00000.safetensors"
    path.write_bytes(path.read_bytes()[:20])  # truncated
    with pytest.raises(ValueError, match=r"state file .*frag-00000\.safetensors is damaged"):
        store.read_fragment(0)
    # A fragment's file copied over another's (by hand, from another state dir): read as
    # the fragment its name says, its values would have gone to the wrong parameters.
    store.write_fragment(1, 3, torch.arange(4.0), {})
    (tmp_path / "fragments" / "frag-00002.safetensors").write_bytes(
        (tmp_path / "fragments" / "frag-00001.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match=r"frag-00002\.safetensors holds fragment 1, expected 2"):
        store.read_fragment(2)
