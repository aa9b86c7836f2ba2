"""``ds-diloco prepare-data --config FILE``: a run's or an island's corpus tokenised into its cache
ahead of the launch.

An island's ranks otherwise wait at start-up for the one that tokenises it (and, with a
cache on each node's own disk, for each node's first rank): on a large corpus that is
the whole launch's start-up, on every node (``island.load_blocks``). Done once ahead,
every launch of every island finds the cache filled and only maps the file. It also
tells, before anything is launched, whether the corpus gives every rank blocks.
"""

from __future__ import annotations

import time

from ds_diloco.config import load_file, load_island_config, load_run_config
from ds_diloco.data import check_shards, heldout_split, prepare_section, split_blocks


def prepare(path: str) -> list[str]:
    """Tokenise the data of the run or island file at ``path`` into its cache; the lines
    that say what it holds. Raises ValueError naming what does not fit (a shard or a rank
    left without a block)."""
    is_run = "islands" in load_file(path)
    cfg = load_run_config(path) if is_run else load_island_config(path)
    d = cfg.data
    t0 = time.monotonic()
    tok, blocks = prepare_section(d)
    train, heldout = heldout_split(blocks, d.heldout_fraction, seed=d.seed)
    lines = [
        f"{d.path}: {len(blocks)} blocks of {d.seq_len} tokens ({len(train)} to train on, "
        f"{len(heldout)} held out), vocabulary {len(tok)}, cached in {d.cache_dir} "
        f"({time.monotonic() - t0:.1f} s)"
    ]
    if is_run:  # islands take every M-th block; an island's ranks walk its blocks together
        sizes = {s.name: s.world_size for s in cfg.islands}
        check_shards(len(train), sizes)
        for i, (name, world) in enumerate(sizes.items()):
            mine = len(split_blocks(train, len(sizes), i))  # the island's own split, a view
            each = "its rank" if world == 1 else f"each of its {world} ranks"
            lines.append(f"  {name}: {mine} blocks, {mine // world} or more an epoch for {each}")
    else:  # the island file does not say its world size: the launcher does
        mine = len(split_blocks(train, cfg.num_shards, cfg.shard))
        lines.append(f"  {cfg.island} (shard {cfg.shard} of {cfg.num_shards}): {mine} blocks, "
                     "walked by its ranks together")  # fmt: skip
    return lines


def main(args) -> int:
    for line in prepare(args.config):
        print(line, flush=True)
    return 0
