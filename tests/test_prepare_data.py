"""``ds-diloco prepare-data``: the corpus tokenised into its cache before any launch."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO, write_run_file

from ds_diloco import data
from ds_diloco.config import load_data_config
from ds_diloco.prepare_data import prepare


def _prepare_cli(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_diloco.cli", "prepare-data", "--config",
                           str(path)], capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_cache_it_fills_is_the_one_an_islands_ranks_then_only_map(tmp_path, tiny_config_path):
    islands = [{"name": "a", "world_size": 2}, {"name": "b", "world_size": 1}]
    run_file = write_run_file(tmp_path, tiny_config_path, islands, steps=4)
    out = _prepare_cli(run_file)
    assert out.returncode == 0, out.stderr[-2000:]
    cache = tmp_path / "cache"
    tokens = list(cache.glob("tokens-*"))
    assert len(tokens) == 1, sorted(p.name for p in cache.iterdir())
    written = tokens[0].stat().st_mtime_ns
    # What a rank's start-up does (island.load_blocks): it finds the file and maps it.
    d = load_data_config(run_file)
    _, blocks = data.prepare_corpus(d.path, d.cache_dir, d.vocab_size, d.seq_len)
    assert tokens[0].stat().st_mtime_ns == written and list(cache.glob("tokens-*")) == tokens
    train, heldout = data.heldout_split(blocks, d.heldout_fraction, seed=d.seed)
    lines = out.stdout.splitlines()
    assert re.search(rf": {len(blocks)} blocks of 32 tokens \({len(train)} to train on, "
                     rf"{len(heldout)} held out\), vocabulary 512, cached in ", lines[0]), lines  # fmt: skip
    a, b = (len(data.split_blocks(train, 2, i)) for i in (0, 1))
    assert lines[1:] == [f"  a: {a} blocks, {a // 2} or more an epoch for each of its 2 ranks",
                         f"  b: {b} blocks, {b} or more an epoch for its rank"], lines  # fmt: skip


def test_an_island_file_gets_its_own_shard_and_a_corpus_too_small_is_named(
    tmp_path, tiny_config_path
):
    island = {
        "island": "east", "coordinator_url": "http://127.0.0.1:1",
        "model": {"config": tiny_config_path},
        "deepspeed_config": str(REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"),
        "data": {"path": str(REPO / "tests" / "data"), "vocab_size": 512, "seq_len": 32,
                 "cache_dir": str(tmp_path / "cache")},
        "shard": 1, "num_shards": 3, "workdir": str(tmp_path / "east"),
    }  # fmt: skip
    path = tmp_path / "island.json"
    path.write_text(json.dumps(island))
    lines = prepare(str(path))
    d = load_data_config(path)
    _, blocks = data.prepare_corpus(d.path, d.cache_dir, d.vocab_size, d.seq_len)
    train, _ = data.heldout_split(blocks, d.heldout_fraction, seed=d.seed)
    mine = len(data.split_blocks(train, 3, 1))
    assert lines[1] == f"  east (shard 1 of 3): {mine} blocks, walked by its ranks together"
    # A run whose ranks outnumber the blocks: refused before anything is launched, named.
    run_file = write_run_file(tmp_path, tiny_config_path, [{"name": "big", "world_size": 4096}], 4)
    out = _prepare_cli(run_file)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "give island 'big'" in out.stderr and "for its 4096 ranks" in out.stderr, out.stderr
