"""The coordinator's durable state directory, written atomically.

Layout of ``state_dir``:
  coordinator.json          plan, island table, counters (JSON)
  model/config.json         the global model's Hugging Face config (for export)
  versions.json             version high-water marks, written before a version is served
  fragments/frag-00007.safetensors   global values + outer optimizer state of fragment 7

Every file is written to a temporary name, fsynced, renamed over the old one,
and the directory fsynced, so a crash leaves either the old or the new file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from ds_diloco import wire


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
        atomic_write(self.root / name, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, name: str):
        path = self.root / name
        if not path.is_file():
            return None
        return json.loads(path.read_text())

    def write_fragment(
        self, index: int, version: int, values: torch.Tensor, optim_state: dict[str, torch.Tensor]
    ) -> None:
        tensors = {
            "values": values,
            **{f"optim.{k}": v.reshape(-1) for k, v in optim_state.items()},
        }
        shapes = {k: list(v.shape) for k, v in optim_state.items()}
        meta = {"fragment": str(index), "version": str(version), "optim_shapes": json.dumps(shapes)}
        atomic_write(self._frag_path(index), wire.encode(tensors, meta))

    def read_fragment(self, index: int) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
        path = self._frag_path(index)
        if not path.is_file():
            raise FileNotFoundError(f"state directory {self.root} lacks {path.name}")
        meta, tensors = wire.decode(path.read_bytes())
        if int(meta["fragment"]) != index:
            raise ValueError(f"{path} holds fragment {meta['fragment']}, expected {index}")
        shapes = json.loads(meta["optim_shapes"])
        optim = {k: tensors[f"optim.{k}"].clone().view(shapes[k]) for k in shapes}
        return int(meta["version"]), tensors["values"].clone(), optim
