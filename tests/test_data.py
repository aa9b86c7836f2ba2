"""The real-text data path on a small public-domain fixture (Shakespeare's sonnets I-XVIII)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import numpy as np
import pytest
import torch

from ds_diloco import data

SONNETS = Path(__file__).parent / "data" / "sonnets.txt"
VOCAB = 512  # the sonnets have enough distinct pairs to fill it with merges


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    """The json/parquet builders cache arrow files; keep them out of ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return data.train_tokenizer([SONNETS], VOCAB, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def blocks(tokenizer):
    return data.pack(data.load_text_dataset(str(SONNETS)), tokenizer, seq_len=16)


def test_find_text_files(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ["b/z.txt", "a.txt", "notes.md"]:
        (tmp_path / name).write_text("x")
    assert data.find_text_files(tmp_path) == [str(tmp_path / "a.txt"), str(tmp_path / "b/z.txt")]
    assert data.find_text_files(tmp_path / "notes.md") == [str(tmp_path / "notes.md")]
    with pytest.raises(ValueError, match="nowhere"):
        data.find_text_files(tmp_path / "nowhere")


def test_find_text_files_skips_hidden_entries_and_follows_linked_folders(tmp_path):
    # A notebook's .ipynb_checkpoints copy was trained on (held-out text included), and a
    # symlinked folder was skipped (Path.rglob does not follow them).
    root, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    for name in ["a.txt", ".ipynb_checkpoints/a-checkpoint.txt", ".secret.txt", "b/.c.txt"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    elsewhere.mkdir()
    (elsewhere / "l.txt").write_text("x")
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)  # no endless walk
    assert data.find_text_files(root) == [str(root / "a.txt"), str(root / "linked" / "l.txt")]
    only_link = tmp_path / "only-link"
    only_link.mkdir()
    (only_link / "d").symlink_to(elsewhere, target_is_directory=True)
    assert data.find_text_files(only_link) == [str(only_link / "d" / "l.txt")]


def test_a_mistyped_data_path_says_it_does_not_exist(tmp_path):
    # It was taken for a hub dataset's name: "holds no local text files to train a
    # tokenizer on: set data.tokenizer", the wrong advice.
    missing = tmp_path / "no-such-corpus"
    with pytest.raises(ValueError, match="no-such-corpus' does not exist"):
        data.prepare_corpus(missing, tmp_path / "cache", VOCAB, 32)
    with pytest.raises(ValueError, match="does not exist"):
        data.load_text_dataset(str(missing))


def test_a_folder_of_jsonl_files_trains_its_tokenizer_and_a_split_can_be_named(tmp_path, tokenizer):
    # A folder of .jsonl files "held no local text files to train a tokenizer on" (one
    # file trained fine); a saved DatasetDict without a "train" split could not be used.
    paragraphs = data._paragraphs(data.clean_gutenberg(SONNETS.read_text()))
    folder = tmp_path / "records"
    folder.mkdir()
    for i in range(2):
        part = paragraphs[i::2]
        (folder / f"part{i}.jsonl").write_text("".join(json.dumps({"t": p}) + "\n" for p in part))
    tok, blocks = data.prepare_corpus(folder, tmp_path / "cache", VOCAB, 32, text_field="t")
    assert tok.decode(blocks[0].tolist()).startswith(paragraphs[0])  # part0.jsonl first
    assert (data.tokenizer_dir(tmp_path / "cache", folder, VOCAB, "t") / "tokenizer.json").is_file()
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"validation": datasets.Dataset.from_dict({"text": paragraphs})}
    ).save_to_disk(str(saved))
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    _, val = data.prepare_corpus(saved, tmp_path / "cache", VOCAB, 32, tokenizer=tok_dir,
                                 split="validation")  # fmt: skip
    assert len(val) > 10
    with pytest.raises(ValueError, match="split 'train' not found"):
        data.prepare_corpus(saved, tmp_path / "cache", VOCAB, 32, tokenizer=tok_dir)


def test_shards_that_leave_a_rank_without_a_block_are_refused_naming_the_island():
    data.check_shards(5, {"a": 3, "b": 2})  # 3 and 2 blocks: one per rank
    with pytest.raises(ValueError, match=r"give island 'b' 1 for its 2 ranks"):
        data.check_shards(3, {"a": 2, "b": 2})


@pytest.mark.parametrize(
    ("header", "footer"),
    [
        (
            "The Project Gutenberg EBook of The Sonnets\r\nLicence blah\r\n"
            "*** START OF THE PROJECT GUTENBERG EBOOK THE SONNETS ***\r\n",
            "\r\n*** END OF THE PROJECT GUTENBERG EBOOK THE SONNETS ***\r\nMore licence\r\n",
        ),
        (
            "**The Project Gutenberg Etext of Shakespeare's Sonnets**\nLicence blah\n"
            "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n",
            "\nEnd of Project Gutenberg's Etext of Shakespeare's Sonnets\nMore licence\n",
        ),
    ],
)
def test_clean_gutenberg_strips_licence(header, footer):
    body = "I\n\nFrom fairest creatures we desire increase,  \nThat thereby beauty's rose"
    cleaned = data.clean_gutenberg(header + body.replace("\n", "\r\n") + footer)
    assert cleaned == body.replace("  \n", "\n")
    assert "\r" not in cleaned and "Gutenberg" not in cleaned and "licence" not in cleaned.lower()


def test_clean_gutenberg_keeps_text_without_markers():
    text = SONNETS.read_text()
    assert data.clean_gutenberg(text).startswith("THE SONNETS\nby William Shakespeare")
    assert data.clean_gutenberg(text).endswith("this gives life to thee.")


def test_tokenizer_special_ids_vocab_and_round_trip(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "<s>", "</s>"]
    assert len(tokenizer) == VOCAB
    for text in [SONNETS.read_text(), "Shall I compare thee — to a summer’s day? 日本\n\t"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Trained merges make the corpus shorter than its bytes.
    assert len(tokenizer(SONNETS.read_text())["input_ids"]) < 0.6 * len(SONNETS.read_bytes())


def test_tokenizer_rejects_vocab_below_byte_alphabet(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer([SONNETS], 200, tmp_path)


def test_tokenizer_cache_is_reused_and_invalidated(tmp_path, monkeypatch):
    corpus = tmp_path / "sonnets.txt"
    shutil.copy(SONNETS, corpus)
    out = tmp_path / "tok"
    first = data.train_tokenizer([corpus], VOCAB, out)
    fingerprint = json.loads((out / data.FINGERPRINT_FILE).read_text())
    assert fingerprint["vocab_size"] == VOCAB and fingerprint["files"][0][0] == str(
        corpus.resolve()
    )

    trained = []
    real_train = data.Tokenizer.train_from_iterator
    monkeypatch.setattr(
        data.Tokenizer,
        "train_from_iterator",
        lambda self, *a, **k: trained.append(1) or real_train(self, *a, **k),
    )
    again = data.train_tokenizer([corpus], VOCAB, out)
    assert trained == []
    assert again.get_vocab() == first.get_vocab() and again.eos_token_id == 2

    data.train_tokenizer([corpus], VOCAB + 20, out)  # another vocab size retrains
    assert trained == [1]
    with corpus.open("a") as f:
        f.write("\nNew lines make a new corpus.\n")
    data.train_tokenizer([corpus], VOCAB + 20, out)  # so does a changed file
    assert trained == [1, 1]


def test_corpus_cache_sees_same_size_edits_and_other_folders(tmp_path):
    # Keyed on (file name, size), a typo fix or another corpus with the same names and
    # sizes reused the old tokenizer and blocks.
    corpus, twin, cache = tmp_path / "corpus", tmp_path / "twin", tmp_path / "cache"
    corpus.mkdir()
    twin.mkdir()
    shutil.copy(SONNETS, corpus / "sonnets.txt")
    text = SONNETS.read_text()
    edit = text.replace("thee", "QZQZ")
    assert len(edit.encode()) == len(text.encode())
    (twin / "sonnets.txt").write_text(edit)

    tok, _ = data.prepare_corpus(corpus, cache, VOCAB, 32)
    tok_dir = data.tokenizer_dir(cache, corpus, VOCAB)  # what `ds-diloco run` exports
    assert data.tokenizer_dir(cache, corpus, VOCAB) == tok_dir  # stable while unchanged
    assert data.PreTrainedTokenizerFast.from_pretrained(tok_dir).get_vocab() == tok.get_vocab()
    twin_tok, twin_blocks = data.prepare_corpus(twin, cache, VOCAB, 32)
    assert data.tokenizer_dir(cache, twin, VOCAB) != tok_dir
    assert twin_tok.get_vocab() != tok.get_vocab()
    assert "QZQZ" in twin_tok.decode(twin_blocks.tensor().flatten().tolist())

    path = corpus / "sonnets.txt"
    path.write_text(edit)  # in place, same size; the mtime moves on by a second at least
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert data.tokenizer_dir(cache, corpus, VOCAB) != tok_dir
    tok2, blocks2 = data.prepare_corpus(corpus, cache, VOCAB, 32)
    assert tok2.get_vocab() == twin_tok.get_vocab()
    decoded = tok2.decode(blocks2.tensor().flatten().tolist())
    assert "QZQZ" in decoded and "thee" not in decoded


def test_load_text_dataset_txt_paragraphs():
    ds = data.load_text_dataset(SONNETS)
    assert ds.column_names == ["text"]
    assert ds[0]["text"] == "THE SONNETS\nby William Shakespeare"
    assert ds[1]["text"] == "I"
    assert ds[2]["text"].startswith("From fairest creatures") and ds[2]["text"].count("\n") == 13
    assert sum(t.strip() == "XVIII" for t in ds["text"]) == 1
    assert all(t.strip() for t in ds["text"])


def test_load_text_dataset_jsonl_parquet_and_folders(tmp_path):
    rows = [{"body": "To be, or not to be", "id": 1}, {"body": "that is the question", "id": 2}]
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = data.load_text_dataset(str(path), text_field="body")
    assert ds.column_names == ["text"] and ds["text"] == [r["body"] for r in rows]
    with pytest.raises(ValueError, match="text_field"):
        data.load_text_dataset(str(path))

    saved = tmp_path / "saved"
    ds.rename_column("text", "body").save_to_disk(str(saved))
    assert data.load_text_dataset(saved, text_field="body")["text"] == ds["text"]
    parquet = tmp_path / "pq"
    parquet.mkdir()
    ds.to_parquet(str(parquet / "part-0.parquet"))  # a folder of data files: load_dataset
    assert data.load_text_dataset(parquet)["text"] == ds["text"]
    assert data.load_text_dataset(parquet / "part-0.parquet")["text"] == ds["text"]

    (tmp_path / "sub").mkdir()
    shutil.copy(SONNETS, tmp_path / "sub" / "s.txt")
    mixed = data.load_text_dataset([tmp_path / "sub", path], text_field="body")
    assert len(mixed) == len(data.load_text_dataset(SONNETS)) + 2
    assert mixed["text"][-2:] == [r["body"] for r in rows]


def test_pack_shape_shift_and_eos(tokenizer, blocks):
    ds = data.load_text_dataset(str(SONNETS))
    total = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in ds["text"])
    assert blocks.dtype == torch.int64
    assert blocks.shape == (total // 17, 17)
    assert (blocks == tokenizer.eos_token_id).sum() >= len(ds) - 1  # only the tail's may be lost
    inputs, labels = blocks[:, :-1], blocks[:, 1:]
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    # The blocks are the corpus, in order: block 0 starts the first paragraph.
    first = tokenizer(ds[0]["text"], add_special_tokens=False)["input_ids"]
    assert blocks.flatten()[: len(first) + 1].tolist() == [*first, tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="block"):
        data.pack(ds.select(range(2)), tokenizer, seq_len=512)


def test_a_slow_tokenizer_is_called_as_it_is(tokenizer):
    # Fast ones are asked through their Rust backend (data._ids_of); a tokenizer without
    # one (a slow, Python one) through its own call, which gives the same ids.
    class Slow:
        is_fast = False

        def __call__(self, texts, add_special_tokens):
            return tokenizer(texts, add_special_tokens=add_special_tokens)

    texts = ["Shall I compare thee", "", "to a summer's day?"]
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert data._ids_of(Slow())(texts) == data._ids_of(tokenizer)(texts) == expected


def test_split_blocks_partitions_twice(blocks):
    n = len(blocks)
    tagged = torch.arange(n)  # split row numbers: the same code path, easy to compare
    seen = []
    for island in range(3):
        island_rows = data.split_blocks(tagged, 3, island)
        for rank in range(2):
            seen += data.split_blocks(island_rows, 2, rank).tolist()
    assert sorted(seen) == list(range(n))
    assert torch.equal(data.split_blocks(blocks, 3, 1), blocks[tagged[1::3]])
    assert torch.equal(data.split_blocks(blocks, 1, 0), blocks)
    # Each refusal names its own cause: with one check gone, (0, 0) still raised (the
    # shard's "must be in [0, 0)"), and an unmatched ValueError let that pass.
    for bad, said in [((0, 0), r"^num_shards=0: must be at least 1"),
                      ((3, 3), r"^shard=3: must be in \[0, 3\)"),
                      ((3, -1), r"^shard=-1: must be in \[0, 3\)"),
                      ((n + 1, 0), rf"^{n} blocks cannot give {n + 1} non-empty shards")]:  # fmt: skip
        with pytest.raises(ValueError, match=said):
            data.split_blocks(blocks, *bad)


def test_heldout_split_is_deterministic_and_disjoint(blocks):
    rows = torch.arange(len(blocks))
    train, held = data.heldout_split(rows, 0.1, seed=3)
    assert len(held) == round(len(rows) * 0.1)
    assert sorted([*train.tolist(), *held.tolist()]) == rows.tolist()
    assert torch.equal(data.heldout_split(rows, 0.1, seed=3)[1], held)
    assert not torch.equal(data.heldout_split(rows, 0.1, seed=4)[1], held)
    for bad in [0.0, 1.0]:  # 1.0 was also refused as "cannot hold out n": matched here
        with pytest.raises(ValueError, match=rf"^fraction={bad}: must be in \(0, 1\)"):
            data.heldout_split(rows, bad, seed=0)
    # A fraction in range that leaves no block to train on.
    with pytest.raises(ValueError, match=r"^3 blocks cannot hold out 3 and keep some"):
        data.heldout_split(rows[:3], 0.9, seed=0)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def test_block_loader_epochs_tokens_and_determinism(blocks):
    shard = blocks[:10]
    loader = data.BlockLoader(shard, 4, seed=7)
    batches = _take(loader, 5)  # 20 rows: exactly two epochs of 10
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (4, 16)
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert loader.tokens_seen == 5 * 4 * 16
    assert (loader.epoch, loader.position) == (2, 0)
    rows = torch.cat([torch.cat([i, lab[:, -1:]], 1) for i, lab in batches])

    def as_set(t):
        return sorted(map(tuple, t.tolist()))

    assert as_set(rows[:10]) == as_set(shard) == as_set(rows[10:])  # each epoch: all once
    assert not torch.equal(rows[:10], rows[10:])  # a fresh order per epoch

    same = _take(data.BlockLoader(shard, 4, seed=7), 5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, same, strict=True))
    other = _take(data.BlockLoader(shard, 4, seed=8), 5)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(batches, other, strict=True))


def test_block_loader_resumes_exactly(blocks):
    loader = data.BlockLoader(blocks[:10], 3, seed=1)
    _take(loader, 3)  # 9 rows: stops one short of the epoch's end
    state = json.loads(json.dumps(loader.state_dict()))  # survives a JSON checkpoint
    expected = _take(loader, 4)

    resumed = data.BlockLoader(blocks[:10], 3, seed=999)
    resumed.load_state_dict(state)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(expected, _take(resumed, 4), strict=True)
    )
    assert resumed.tokens_seen == loader.tokens_seen == 7 * 3 * 16
    with pytest.raises(ValueError, match="blocks"):
        data.BlockLoader(blocks[:11], 3).load_state_dict(state)
    # A state from before the walk was kept (epoch and place) goes on from the same count.
    old = {"epoch": 1, "position": 4, "seed": 1, "tokens_seen": 0, "num_blocks": 10}
    resumed.load_state_dict(old)
    assert resumed.rows == 14 and (resumed.epoch, resumed.position) == (1, 4)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 4097, 65537])
def test_shuffled_is_a_permutation_drawn_from_its_key(n):
    a, b = (data.shuffled(np.arange(n), n, key) for key in (11, 12))
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(n))  # every place once
    if n >= 16:
        assert a.tolist() != b.tolist() and a.tolist() != list(range(n))
    assert data.shuffled(np.array([n - 1, 0]), n, 11).tolist() == [a[n - 1], a[0]]  # per place


def test_an_islands_ranks_walk_one_order_and_a_resized_island_goes_on_where_it_stopped(blocks):
    # An island of 2 ranks (micro-batch 3) takes 4 micro-batches and checkpoints its place;
    # relaunched on 1 rank with micro-batches of 2 it goes on from there: over the epoch
    # (48 of the blocks here), every block comes once, across the resize.
    shard = blocks[:48]
    pair = [data.BlockLoader(shard, 3, seed=4, rank=r, world=2) for r in (0, 1)]
    taken = []
    for _ in range(4):
        step = [next(loader)[0] for loader in pair]
        assert not set(map(tuple, step[0].tolist())) & set(map(tuple, step[1].tolist()))
        taken += step
    assert pair[0].rows == pair[1].rows == 4 * 2 * 3 and pair[0].tokens_seen == 4 * 3 * 16
    alone = data.BlockLoader(shard, 2, seed=4)
    alone.seek(json.loads(json.dumps(pair[0].state_dict()))["rows"])  # through a checkpoint
    taken += [next(alone)[0] for _ in range((48 - 24) // 2)]
    assert alone.rows == 48 and (alone.epoch, alone.position) == (1, 0)
    rows = sorted(map(tuple, torch.cat(taken).tolist()))
    assert rows == sorted(map(tuple, shard[:, :-1].tolist()))  # each block of the epoch once
    # The walk is the same one however it is cut: one rank of micro-batch 6 takes, in
    # order, what the pair took rank by rank.
    one = data.BlockLoader(shard, 6, seed=4)
    assert torch.equal(torch.cat([next(one)[0] for _ in range(4)]), torch.cat(taken[:8]))
    with pytest.raises(ValueError, match=r"rank=2: must be in \[0, world=2\)"):
        data.BlockLoader(shard, 3, rank=2, world=2)


def test_prepare_corpus_caches_blocks(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(SONNETS, corpus / "sonnets.txt")
    tok, blocks = data.prepare_corpus(corpus, tmp_path / "cache", VOCAB, 32)
    assert blocks.shape[1] == 33 and len(tok) == VOCAB

    monkeypatch.setattr(data, "write_tokens", lambda *a, **k: pytest.fail("tokenised again"))
    tok2, again = data.prepare_corpus(corpus, tmp_path / "cache", VOCAB, 32)
    assert torch.equal(again.tensor(), blocks.tensor()) and tok2.get_vocab() == tok.get_vocab()
    # Another seq_len cuts the same cached tokens differently.
    _, longer = data.prepare_corpus(corpus, tmp_path / "cache", VOCAB, 64)
    assert longer.shape[1] == 65
    with pytest.raises(ValueError, match="seq_len=0: must be at least 1"):  # cached or not
        data.prepare_corpus(corpus, tmp_path / "cache", VOCAB, 0)
    assert torch.equal(longer.tensor().flatten(), blocks.tensor().flatten()[: len(longer) * 65])


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 9, 40])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_blocks_give_every_rank_the_same_nonempty_count(blocks, world):
    # ZeRO-3 ranks meet in every forward: unequal (or empty) shares hang or crash the
    # evaluation. 5 blocks over 2 ranks used to give 3 and 2; 1 block gave rank 1 none.
    heldout = torch.arange(blocks * 3).view(blocks, 3)
    limit = 8
    shares = [data.eval_blocks(heldout, r, world, limit) for r in range(world)]
    counts = {len(s) for s in shares}
    assert len(counts) == 1 and 0 < counts.pop() <= limit, [len(s) for s in shares]
    rows = [tuple(x.tolist()) for s in shares for x in s]
    if blocks >= world:  # disjoint: each block evaluated once
        assert len(rows) == len(set(rows))
    assert set(rows) <= {tuple(x.tolist()) for x in heldout}


def test_tokenizer_for_a_json_or_parquet_file_learns_the_text_column(tmp_path):
    # Trained on the raw file, the BPE learned JSON syntax, the other columns and
    # parquet's binary footer, not the text that pack() then encodes.
    paragraphs = data._paragraphs(data.clean_gutenberg(SONNETS.read_text()))
    rows = [{"id": f"zqx-{i:06d}", "text": p, "body": p.upper()} for i, p in enumerate(paragraphs)]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    cache = tmp_path / "cache"

    tok, blocks = data.prepare_corpus(jsonl, cache, VOCAB, 32)
    learned = [t for t in tok.get_vocab() if len(t) > 1 and t not in data.SPECIAL_TOKENS]
    assert not [t for t in learned if '"' in t or "zqx" in t or "{" in t]
    assert tok.decode(blocks[0].tolist()).startswith(paragraphs[0])
    assert tok.get_vocab() == data.prepare_corpus(parquet, cache, VOCAB, 32)[0].get_vocab()
    assert (data.tokenizer_dir(cache, jsonl, VOCAB) / "tokenizer.json").is_file()

    body_tok, _ = data.prepare_corpus(jsonl, cache, VOCAB, 32, text_field="body")  # retrains
    assert body_tok.get_vocab() != tok.get_vocab() and "ĠTHE" in body_tok.get_vocab()
    assert data.tokenizer_dir(cache, jsonl, VOCAB) == data.tokenizer_dir(cache, jsonl, VOCAB)
    # Each column's tokenizer in a folder of its own: the "text" run's export ships the
    # tokenizer its blocks were made with (the "body" one had been retrained over it).
    text_dir = data.tokenizer_dir(cache, jsonl, VOCAB)
    assert data.tokenizer_dir(cache, jsonl, VOCAB, "body") != text_dir
    shipped = data.PreTrainedTokenizerFast.from_pretrained(str(text_dir))
    assert shipped.get_vocab() == tok.get_vocab()


def test_blocks_cache_sees_a_dataset_or_tokenizer_rewritten_in_place(tmp_path, monkeypatch):
    # Keyed on the folder's path and len(tokenizer), rewritten data or a tokenizer
    # retrained in place gave back the old blocks.
    paragraphs = data._paragraphs(data.clean_gutenberg(SONNETS.read_text()))
    tok_dir, ds_dir = tmp_path / "tok", tmp_path / "ds"
    data.train_tokenizer([SONNETS], VOCAB, tok_dir)
    datasets.Dataset.from_dict({"text": paragraphs}).save_to_disk(str(ds_dir))
    cache = ds_dir / "cache"  # inside the folder: its blocks must not move the key
    tok, first = data.prepare_corpus(ds_dir, cache, VOCAB, 32, tokenizer=tok_dir)
    with monkeypatch.context() as m:
        m.setattr(data, "write_tokens", lambda *a, **k: pytest.fail("tokenised again"))
        assert torch.equal(
            data.prepare_corpus(ds_dir, cache, VOCAB, 32, tokenizer=tok_dir)[1].tensor(),
            first.tensor(),
        )

    def fresh():
        return data.pack(data.load_text_dataset(ds_dir), tok, 32)

    for f in ds_dir.iterdir():  # rewritten in place; the cache stays
        if f.is_file():
            f.unlink()
    datasets.Dataset.from_dict({"text": paragraphs[:20]}).save_to_disk(str(ds_dir))
    _, second = data.prepare_corpus(ds_dir, cache, VOCAB, 32, tokenizer=tok_dir)
    assert len(second) < len(first) and torch.equal(second.tensor(), fresh())

    upper = tmp_path / "upper.txt"
    upper.write_text(SONNETS.read_text().upper())
    shutil.rmtree(tok_dir)
    data.train_tokenizer([upper], VOCAB, tok_dir)
    tok, third = data.prepare_corpus(ds_dir, cache, VOCAB, 32, tokenizer=tok_dir)
    assert not torch.equal(third.tensor(), second.tensor()) and torch.equal(third.tensor(), fresh())


def test_read_text_keeps_utf8_with_a_stray_byte_and_reads_cp1252(tmp_path):
    good = "Café crème, naïve façade — “quoted”.\n\n" * 3
    path = tmp_path / "a.txt"
    path.write_bytes(good.encode() + b"stray \xff byte\n")
    assert data._read_text(str(path)) == good + "stray \ufffd byte\n"  # not 'CafÃ©'
    path.write_bytes("He said “hello” – ok".encode("cp1252"))
    assert data._read_text(str(path)) == "He said “hello” – ok"  # not C1 controls
    path.write_bytes("Ælfred\x81 à".encode("latin-1"))  # 0x81: undefined in cp1252
    assert data._read_text(str(path)) == "Ælfred\x81 à"


def test_pack_and_prepare_corpus_refuse_a_corpus_without_text(tmp_path, tokenizer):
    # Without any text, map() never made the input_ids column: a KeyError, not this.
    for texts in [["", "  \n"], []]:
        with pytest.raises(ValueError, match="0 tokens do not fill one block"):
            data.pack(datasets.Dataset.from_dict({"text": texts}), tokenizer, seq_len=8)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(ValueError, match="0 tokens do not fill one block"):
        data.prepare_corpus(corpus, tmp_path / "cache", VOCAB, 32)


def test_a_tokenizer_folder_holding_none_is_named_in_one_line(tmp_path):
    """A model folder exported without its tokenizer (model.pretrained, no data.tokenizer):
    transformers' six lines advising to install sentencepiece, naming no key or folder."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError) as e:
        data.prepare_corpus(SONNETS, tmp_path / "cache", VOCAB, 32, tokenizer=folder)
    message = str(e.value)
    assert message.startswith(f"data.tokenizer {str(folder)!r} holds no tokenizer"), message
    assert "model.pretrained" in message and len(message.splitlines()) == 1, message


def test_a_hub_dataset_that_does_not_load_is_named_in_one_line(tmp_path, monkeypatch):
    """Offline (the tests are), unreachable or not found: a ConnectionError or
    DatasetNotFoundError traceback from ``ds-diloco prepare-data`` or a run's set-up."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        data.load_text_dataset("no-such-owner/no-such-dataset")
    message = str(e.value)
    assert message.startswith("data.path 'no-such-owner/no-such-dataset' is not a file or")
    assert "nor a Hugging Face dataset that loads: " in message and "\n" not in message


def test_tokenising_says_how_far_it_is(tmp_path, tokenizer, caplog):
    # A large corpus is tokenised for hours, while the island's other ranks wait on it.
    paragraphs = data.load_text_dataset(str(SONNETS))["text"]
    batches = [paragraphs[i : i + 8] for i in range(0, len(paragraphs), 8)]
    with caplog.at_level(logging.INFO, logger="ds_diloco.data"):
        n = data.write_tokens(iter(batches), tokenizer, tmp_path / "t.uint16", report_every_s=0)
    lines = [r.getMessage() for r in caplog.records]
    counts = [int(m.group(1).replace(",", "")) for line in lines
              if (m := re.search(r"tokenising into t\.uint16: ([\d,]+) tokens so far, [\d,]+ tokens/s", line))]  # fmt: skip
    assert len(counts) == len(batches) and counts == sorted(counts) and counts[-1] == n, lines
    assert re.search(rf"tokenised {n:,} tokens into \S+t\.uint16 in [\d.]+ s", lines[-1]), lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_diloco.data"):  # every minute by default
        data.write_tokens(iter(batches), tokenizer, tmp_path / "u.uint16")
    assert not any("so far" in r.getMessage() for r in caplog.records), caplog.text


def test_prepared_blocks_are_the_packed_ones_memory_mapped_and_shared_by_views(tmp_path):
    # The corpus as int64 tensors cost every rank its size eight times over, twice
    # (the blocks, and the training split's copy): 215 MB a rank for a 40 MB corpus.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(SONNETS, corpus / "sonnets.txt")
    tok, blocks = data.prepare_corpus(corpus, tmp_path / "cache", VOCAB, 16)
    [path] = (tmp_path / "cache").glob("tokens-*.uint16")
    packed = data.pack(data.load_text_dataset(corpus), tok, seq_len=16)
    assert len(packed) == path.stat().st_size // 2 // 17  # every token, two bytes each
    assert isinstance(blocks, data.Blocks) and blocks.rows.dtype == torch.uint16
    assert torch.equal(blocks.tensor(), packed) and blocks.tensor().dtype == torch.int64
    assert blocks.shape == tuple(packed.shape) and torch.equal(blocks[3], packed[3])

    # Splits and shares are views of the same mapped rows, equal to the tensor's.
    train, held = data.heldout_split(blocks, 0.1, seed=3)
    t_train, t_held = data.heldout_split(packed, 0.1, seed=3)
    mine = data.split_blocks(data.split_blocks(train, 3, 1), 2, 1)
    t_mine = data.split_blocks(data.split_blocks(t_train, 3, 1), 2, 1)
    for view, tensor in ((train, t_train), (held, t_held), (mine, t_mine)):
        assert view.rows is blocks.rows  # no copy of the corpus
        assert torch.equal(view.tensor(), tensor)
    assert torch.equal(data.eval_blocks(held, 1, 2, 5), data.eval_blocks(t_held, 1, 2, 5))
    a, b = data.BlockLoader(mine, 3, seed=5), data.BlockLoader(t_mine, 3, seed=5)
    for _ in range(7):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert xa.dtype == torch.int64 and torch.equal(xa, xb) and torch.equal(ya, yb)

    # Written through a view, a block stays as the file has it (a private mapping).
    row = blocks.rows[0].clone()
    blocks.rows[0].fill_(7)
    assert torch.equal(data.read_blocks(path, 16, "uint16").rows[0], row)


def test_a_vocabulary_beyond_uint16_gets_an_int32_token_file(tmp_path, tokenizer):
    class Wide:  # len() is all token_dtype reads
        def __len__(self):
            return 70_000

    assert data.token_dtype(tokenizer) == np.uint16 and data.token_dtype(Wide()) == np.int32
    ids = np.arange(3 * 9, dtype=np.int32) + 65_530  # ids above uint16's range
    ids.tofile(tmp_path / "t.int32")
    blocks = data.read_blocks(tmp_path / "t.int32", 8, "int32")
    assert blocks.shape == (3, 9) and blocks.tensor().flatten().tolist() == ids.tolist()
    with pytest.raises(ValueError, match="27 tokens do not fill one block of 28"):
        data.read_blocks(tmp_path / "t.int32", 27, "int32")


def test_text_batches_are_the_datasets_records_in_order_a_file_at_a_time(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    (corpus / "b").mkdir(parents=True)
    shutil.copy(SONNETS, corpus / "a.txt")
    (corpus / "b" / "c.txt").write_text("Second file.\n\nIts second paragraph.\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"body": f"row {i}"}) + "\n" for i in range(3)))
    for source, field in ((corpus, "text"), (SONNETS, "text"), (rows, "body")):
        batches = list(data.text_batches(source, text_field=field))
        expected = data.load_text_dataset(source, text_field=field)["text"]
        assert [t for b in batches for t in b] == expected, source
        assert max(len(b) for b in batches) <= data.ENCODE_BATCH
    # A folder of text files is read one file at a time, as the batches are taken.
    reads = []
    real = data._read_text
    monkeypatch.setattr(data, "_read_text", lambda f: reads.append(f) or real(f))
    batches = data.text_batches(corpus)
    next(batches)
    assert reads == [str(corpus / "a.txt")]


def test_each_node_fills_its_own_cache_once_before_its_other_ranks_read_it():
    from ds_diloco.island import preparation_turn

    # Two nodes of 4 ranks: global rank 0 first (a shared cache is then filled for all),
    # the first rank of node 2 next (a node-local cache), every other rank last.
    turns = [preparation_turn(rank, rank % 4) for rank in range(8)]
    assert turns == [0, 2, 2, 2, 1, 2, 2, 2]
    assert preparation_turn(0, 0) == 0 and preparation_turn(1, 1) == 2  # one node


_SLOW_PREPARER = """
import datetime, json, os, pathlib, sys, time
import torch.distributed as dist
from ds_diloco import data, island
from ds_diloco.config import DataConfig, IslandConfig, ModelSource

rank, cache, timeout_s, config = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
# Both ranks at the rendezvous together: its timeout is the group's 2 s too, and a loaded
# machine can finish one rank's imports seconds after the other's ("waiting for clients").
pathlib.Path(f"{cache}.ready{rank}").touch()
while not pathlib.Path(f"{cache}.ready{1 - rank}").exists():
    time.sleep(0.01)
# The process group's timeout, 30 min in an island, made 2 s: rank 0's turn takes longer.
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
real = data.prepare_corpus  # what island.load_blocks calls, through data.prepare_section
def slow(*args, **kwargs):
    time.sleep(5)  # a large corpus: tokenising it outlasts the group's timeout
    return real(*args, **kwargs)
data.prepare_corpus = slow
cfg = IslandConfig(island="a", coordinator_url="http://127.0.0.1:1", model=ModelSource(config=config),
                   deepspeed_config="unused", data=DataConfig(path=sys.argv[5], vocab_size=300,
                   seq_len=16, cache_dir=cache, prepare_timeout_s=timeout_s))
t0 = time.monotonic()
train, heldout = island.load_blocks(cfg, rank)
print(json.dumps({"train": len(train), "heldout": len(heldout), "waited_s": time.monotonic() - t0}))
"""


def test_an_islands_ranks_wait_for_the_corpus_longer_than_their_process_groups_timeout(
    tmp_path, tiny_config_path
):
    # Rank 0 tokenises while the others wait; their barrier on the island's process group
    # ended after its timeout (30 min), so a large corpus stopped every multi-rank launch.
    from ds_diloco.run import free_port

    def launch(timeout_s: float, cache: Path):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        procs = [
            subprocess.Popen([sys.executable, "-c", _SLOW_PREPARER, str(rank), str(cache),
                              str(timeout_s), tiny_config_path, str(SONNETS)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for rank in (0, 1)
        ]  # fmt: skip
        return [(p.wait(timeout=120), *p.communicate()) for p in procs]

    got = launch(60.0, tmp_path / "cache")
    assert [rc for rc, _, _ in got] == [0, 0], [err[-2000:] for _, _, err in got]
    rows = [json.loads(out.splitlines()[-1]) for _, out, _ in got]
    assert rows[1]["waited_s"] > 4.5, rows  # it waited for rank 0, past the 2 s timeout
    assert rows[0]["heldout"] == rows[1]["heldout"] > 0, rows  # both read the one cache
    assert abs(rows[0]["train"] - rows[1]["train"]) <= 1, rows  # their halves of the blocks
    # data.prepare_timeout_s is that wait's bound: 1 s is too short for rank 0's turn.
    rc, _, err = launch(1.0, tmp_path / "cache2")[1]
    assert rc != 0 and "Timed out" in err, err[-2000:]


def _plain_island(tmp_path, model_config: str) -> subprocess.CompletedProcess:
    """``ds-diloco island --plain`` of one rank on the sonnets, with a tokenizer of VOCAB."""
    from ds_diloco.run import free_port

    data.train_tokenizer([SONNETS], VOCAB, tmp_path / "tok")
    island = {
        "island": "east", "coordinator_url": "http://127.0.0.1:1",
        "model": {"config": model_config},
        "deepspeed_config": str(Path(__file__).parent.parent / "model_configs" / "deepspeed"
                                / "zero3_cpu.json"),
        "data": {"path": str(SONNETS), "tokenizer": str(tmp_path / "tok"), "seq_len": 16,
                 "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": 1, "micro_batch": 2}, "workdir": str(tmp_path / "east"),
    }  # fmt: skip
    path = tmp_path / "island.json"
    path.write_text(json.dumps(island))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "ds_diloco.cli", "island", "--config", str(path),
                           "--plain"], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


def test_an_island_refuses_a_tokenizer_whose_ids_pass_the_models_embeddings(
    tmp_path, tiny_config_path
):
    # `ds-diloco run` checked it; an island launched on its own (deepspeed ... island) went
    # on to an IndexError traceback in every rank's first forward.
    model = json.loads(Path(tiny_config_path).read_text())
    Path(tiny_config_path).write_text(json.dumps({**model, "vocab_size": 300}))
    out = _plain_island(tmp_path, tiny_config_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"has {VOCAB} tokens, above the model's vocab_size 300" in out.stderr, out.stderr[-3000:]


def test_an_island_refuses_a_sequence_longer_than_the_models_learned_positions(tmp_path):
    # The same for data.seq_len past GPT-2's position table: an IndexError in every rank.
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_positions": 8,
            "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": VOCAB}  # fmt: skip
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    out = _plain_island(tmp_path, str(tmp_path / "gpt2.json"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "data.seq_len 16 is longer than the model's 8 learned positions" in out.stderr, (
        out.stderr[-3000:]
    )
