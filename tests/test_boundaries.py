"""Where DeepSpeed and torch.distributed may be touched: ``ds_diloco/zero.py`` alone.

The coordinator, the merge, the wire format and the policies are tested and run without
them, and a coordinator host needs no working DeepSpeed (no accelerator to detect, no
ops to build). So every other module reaches them through ``zero``'s functions, and
nothing on the coordinator's side loads DeepSpeed at all (``zero`` imports it inside its
functions, when a rank calls them).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ds_diloco"
ALLOWED = {"ds_diloco/zero.py"}


def references(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each import of ``deepspeed`` or ``torch.distributed`` and each
    ``torch.distributed`` attribute in a module (names in strings do not count: ``run``
    starts ``deepspeed.launcher.launch`` as a program)."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found += [(n.lineno, f"import {a.name}") for a in n.names if _touches(a.name)]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [f"{n.module}.{a.name}" for a in n.names]
            if _touches(n.module) or any(_touches(x) for x in names):
                found.append((n.lineno, f"from {n.module} import ..."))
        elif isinstance(n, ast.Attribute) and n.attr == "distributed" and _is_torch(n.value):
            found.append((n.lineno, "torch.distributed"))
    return found


def _is_torch(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def _touches(module: str) -> bool:
    return module.split(".")[0] == "deepspeed" or module.startswith("torch.distributed")


def test_the_scan_finds_every_way_of_reaching_them():
    src = (
        "import deepspeed\nimport torch.distributed as dist\nfrom torch import distributed\n"
        "from deepspeed.runtime.config import DeepSpeedConfig\nimport torch\n"
        "torch.distributed.barrier()\nx = 'deepspeed.launcher.launch'\nfrom . import zero\n"
    )
    assert [line for line, _ in references(ast.parse(src))] == [1, 2, 3, 4, 6]


def test_only_zero_touches_deepspeed_and_torch_distributed():
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        found = references(ast.parse(path.read_text(), filename=rel))
        if found and rel not in ALLOWED:
            outside[rel] = found
    assert outside == {}, f"use ds_diloco.zero's functions instead: {outside}"
    assert references(ast.parse((PACKAGE / "zero.py").read_text()))  # the scan sees zero's


def test_a_coordinator_and_the_client_side_load_no_deepspeed(tiny_config_path, tmp_path):
    # A coordinator built from a model config and serving, with the modules of every
    # command imported: DeepSpeed is not among the modules the process loaded.
    script = f"""
import json, sys
import ds_diloco, ds_diloco.cli, ds_diloco.run, ds_diloco.syncer, ds_diloco.learner
import ds_diloco.export, ds_diloco.simulate, ds_diloco.chaos.harness, ds_diloco.status_view
from ds_diloco.client import CoordinatorClient
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.server import ServerThread
cfg = CoordinatorConfig(model=ModelSource(config={tiny_config_path!r}, seed=0),
                        state_dir={str(tmp_path / "state")!r}, num_fragments=4, token="t")
with ServerThread(cfg) as srv:
    versions = CoordinatorClient(srv.url, "t").versions()
print(json.dumps({{"versions": versions,
                  "deepspeed": sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed")}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["versions"] == [0, 0, 0, 0], out
    assert out["deepspeed"] == [], out
