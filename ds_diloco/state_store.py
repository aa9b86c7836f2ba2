"""The coordinator's durable state directory, written atomically.

Layout of ``state_dir``:
  coordinator.json          plan, island table, counters (JSON)
  model/config.json         the global model's Hugging Face config (for export)
  versions.json             version high-water marks, written before a version is served
  fragments/frag-00007.safetensors   global values + outer optimizer state of fragment 7,
                                     and each island's last merged step and counts in it

Every file is written whole under another name, fsynced, renamed over the old
one, and the directory fsynced, so a crash leaves either the old or the new file.

Files rewritten again and again (a fragment before every version is served) keep
a spare: ``.frag-00007.safetensors.spare``, the file's previous content. The new
content overwrites the spare, which is then swapped with the file in one atomic
rename (``renameat2(RENAME_EXCHANGE)``, Linux), so the old file becomes the next
spare. Overwriting pages the page cache already holds takes about half the CPU
of writing a new file (no page allocation, no eviction of the old file), at the
price of one spare's worth of disk per file. Where the swap is not supported,
the spare is renamed over the file (written anew next time).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from ds_diloco import wire

_IOV_MAX = 1024  # buffers per writev (the Linux limit)


def atomic_write(path: Path, data: bytes | Sequence, keep_spare: bool = False) -> None:
    """Write ``data`` (bytes, or buffers written one after the other, straight from their
    memory) as ``path``: on return it is durable; a crash leaves the old or the new file.

    ``keep_spare``: for a file rewritten often, see the module docstring.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    buffers = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    if keep_spare and path.exists():
        with _lock(path):  # one writer at a time per spare
            _swap_in(path, buffers)
    else:
        _replace(path, buffers)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _replace(path: Path, buffers: Sequence) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        try:
            _write_all(fd, buffers)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


READ_ATTEMPTS = 10


def read_whole(path: Path, attempts: int = READ_ATTEMPTS) -> bytes:
    """``path``'s bytes as one write left them. A file kept with a spare is overwritten in
    place once two rewrites have swapped it out and back in: a read that takes longer than
    two writes (an export of a large fragment while the coordinator merges) got the start
    of one version and the end of the next, which decodes without an error. A read during
    which the file changed (its ctime, set by a write or a swap) is done again."""
    for _ in range(attempts):
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            data = f.read()
            after = os.fstat(f.fileno())
        if (before.st_ctime_ns, before.st_size) == (after.st_ctime_ns, after.st_size):
            return data
    raise ValueError(f"state file {path} changed during each of {attempts} reads")


def spare_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.spare")


def _swap_in(path: Path, buffers: Sequence) -> None:
    spare = spare_path(path)
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, _write_all(fd, buffers))  # the spare may have been longer
        _fdatasync(fd)  # data and size; the swap and the directory fsync do the rest
    finally:
        os.close(fd)
    if not _exchange(spare, path):
        os.replace(spare, path)


def _write_all(fd: int, buffers: Sequence) -> int:
    """Write the buffers in order from the file's position (no joined copy); returns bytes."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    total = sum(len(v) for v in views)
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + _IOV_MAX])
        if n == 0:
            raise OSError(f"writev wrote nothing ({len(views) - i} buffers left)")
        while n:  # a short write stops anywhere: resume after the last byte written
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0
    return total


_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(path: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(path, threading.Lock())


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic rename; False where the system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. a file system without it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


class StateStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @property
    def model_dir(self) -> Path:
        """The global model's HF config.json (and generation_config.json)."""
        return self.root / "model"

    def _frag_path(self, index: int) -> Path:
        return self.root / "fragments" / f"frag-{index:05d}.safetensors"

    def exists(self) -> bool:
        return (self.root / "coordinator.json").is_file()

    def write_json(self, name: str, obj) -> None:
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        atomic_write(self.root / name, data, keep_spare=True)

    def read_json(self, name: str):
        path = self.root / name
        if not path.is_file():
            return None
        data = read_whole(path)
        try:
            return json.loads(data.decode())
        except (ValueError, UnicodeDecodeError) as e:  # damaged outside us: name the file
            raise ValueError(f"state file {path} is not valid JSON: {e}") from None

    def write_fragment(
        self,
        index: int,
        version: int,
        values: torch.Tensor,
        optim_state: dict[str, torch.Tensor],
        merged_by: dict | None = None,
    ) -> None:
        """Written from the tensors' own memory: they must not change until this returns.

        ``merged_by``: what the coordinator must know of the merges in this version as
        surely as the version itself (JSON; :meth:`read_fragment_state`)."""
        tensors = {
            "values": values,
            **{f"optim.{k}": v.reshape(-1) for k, v in optim_state.items()},
        }
        shapes = {k: list(v.shape) for k, v in optim_state.items()}
        meta = {"fragment": str(index), "version": str(version), "optim_shapes": json.dumps(shapes)}
        if merged_by is not None:
            meta["merged_by"] = json.dumps(merged_by, sort_keys=True)
        parts = wire.encode_parts(tensors, meta).parts
        atomic_write(self._frag_path(index), parts, keep_spare=True)

    def read_fragment(self, index: int) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
        version, values, optim, _ = self.read_fragment_state(index)
        return version, values, optim

    def read_fragment_state(
        self, index: int
    ) -> tuple[int, torch.Tensor, dict[str, torch.Tensor], dict]:
        """Version, values, outer optimizer state and ``merged_by`` ({} if none was written)."""
        path = self._frag_path(index)
        if not path.is_file():
            raise FileNotFoundError(f"state directory {self.root} lacks {path.name}")
        try:
            meta, tensors = wire.decode(read_whole(path))
        except wire.WireError as e:
            raise ValueError(f"state file {path} is damaged: {e}") from None
        if int(meta["fragment"]) != index:
            raise ValueError(f"{path} holds fragment {meta['fragment']}, expected {index}")
        shapes = json.loads(meta["optim_shapes"])
        optim = {k: tensors[f"optim.{k}"].clone().view(shapes[k]) for k in shapes}
        merged_by = json.loads(meta.get("merged_by", "{}"))
        return int(meta["version"]), tensors["values"].clone(), optim, merged_by
