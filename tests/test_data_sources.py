"""What a corpus's files give: splits named by file names, encodings, several books in a
file, files of any name, caches that must (and must not) be used again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets
import pytest

from ds_diloco import data
from ds_diloco.config import load_data_config

SONNETS = Path(__file__).parent / "data" / "sonnets.txt"
VOCAB = 512
LINES = [f"Line {i} of a record, with words enough to train on." for i in range(40)]


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def _jsonl(path: Path, texts, field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _texts(source, **kw) -> list[str]:
    return list(data.load_text_dataset(source, **kw)["text"])


def test_several_books_in_one_file_each_keep_their_text():
    # Only the first book was kept: the text after its footer (the next books) was cut.
    book = (
        "*** START OF THE PROJECT GUTENBERG EBOOK {0} ***\n{0} body.\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK {0} ***\nLicence of {0}.\n"
    )
    text = "Header licence.\n" + "".join(book.format(b) for b in ("HAMLET", "MACBETH", "LEAR"))
    assert data.clean_gutenberg(text) == "HAMLET body.\n\nMACBETH body.\n\nLEAR body."


def test_a_folders_file_names_name_its_splits(tmp_path):
    # data.split was ignored for a local folder: test.jsonl was trained on with train.jsonl.
    folder = tmp_path / "records"
    _jsonl(folder / "train.jsonl", ["train one", "train two"])
    _jsonl(folder / "test.jsonl", ["test one"])
    assert _texts(folder) == ["train one", "train two"]
    assert _texts(folder, split="test") == ["test one"]
    with pytest.raises(ValueError, match=r"split 'validation' not found .* \['test', 'train'\]"):
        _texts(folder, split="validation")
    # Folders name them too (datasets' convention); a folder naming none is all train.
    (tmp_path / "by_dir" / "train").mkdir(parents=True)
    (tmp_path / "by_dir" / "valid").mkdir()
    (tmp_path / "by_dir" / "train" / "a.txt").write_text("Trained on.")
    (tmp_path / "by_dir" / "valid" / "b.txt").write_text("Held for validation.")
    assert _texts(tmp_path / "by_dir") == ["Trained on."]
    assert _texts(tmp_path / "by_dir", split="validation") == ["Held for validation."]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "devon.txt").write_text("Not a split's name.")
    assert _texts(plain) == ["Not a split's name."]
    with pytest.raises(ValueError, match=r"data.split 'test': no file or folder .* names a split"):
        _texts(plain, split="test")
    # The tokens of each split are their own, and the tokenizer is trained on the split asked.
    cache = tmp_path / "cache"
    tok, train = data.prepare_corpus(folder, cache, 300, 2)
    test_tok, test = data.prepare_corpus(folder, cache, 300, 2, split="test")
    assert tok.decode(train.tensor().flatten().tolist()).startswith("train one")
    assert test_tok.decode(test.tensor().flatten().tolist()).startswith("test one")


def test_files_of_any_name_are_text_and_record_files_of_another_kind_are_refused(tmp_path):
    # BOOK.TXT, a file with no suffix: a tokenizer was trained on them, then they were refused.
    for name in ("BOOK.TXT", "input"):
        (tmp_path / name).write_text("A paragraph.\n\nAnother one.")
        assert _texts(tmp_path / name) == ["A paragraph.", "Another one."]
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "A.TXT").write_text("Found in a folder too.")
    assert _texts(upper) == ["Found in a folder too."]
    (tmp_path / "x.csv").write_text("id,text\n1,hello\n")
    with pytest.raises(ValueError, match=r"x.csv'?: a \.csv file is not read as a corpus"):
        data.prepare_corpus(tmp_path / "x.csv", tmp_path / "cache", 300, 4)
    assert not list((tmp_path / "cache").glob("tokenizer-*"))  # refused before any training


def test_utf16_text_is_read_and_nul_bytes_are_refused(tmp_path):
    # Windows' "Unicode" text was read as cp1252: 'ÿþH\x00e\x00l...' trained on.
    (tmp_path / "utf16.txt").write_bytes("Hello wörld.".encode("utf-16"))  # with its BOM
    assert _texts(tmp_path / "utf16.txt") == ["Hello wörld."]
    (tmp_path / "utf32.txt").write_bytes("Hello wörld.".encode("utf-32"))
    assert _texts(tmp_path / "utf32.txt") == ["Hello wörld."]
    (tmp_path / "bare.txt").write_bytes("Hello.".encode("utf-16-le"))  # no BOM
    with pytest.raises(ValueError, match=r"bare.txt: holds NUL bytes"):
        _texts(tmp_path / "bare.txt")


def test_a_non_text_column_is_refused_naming_the_text_columns(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user"}], "body": "hi", "n": 1}) + "\n")
    with pytest.raises(ValueError, match=r"text_field='n' holds .*int.*, not text; .*\['body'\]"):
        _texts(path, text_field="n")
    with pytest.raises(ValueError, match=r"text_field='messages' holds .* not text"):
        _texts(path, text_field="messages")


def test_a_replaced_record_file_is_read_again_even_with_the_same_mtime(tmp_path):
    # datasets' own cache is keyed by path and mtime: a file unpacked or copied with its
    # times (the same second) gave the old records.
    path = _jsonl(tmp_path / "r.jsonl", ["old text"])
    assert _texts(path) == ["old text"]
    st = path.stat()
    _jsonl(path, ["the new, longer text"])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _texts(path) == ["the new, longer text"]
    # A folder datasets.load_dataset reads (of .csv files): the same.
    (tmp_path / "csv").mkdir()
    path = tmp_path / "csv" / "train.csv"
    path.write_text("text\nold text\n")
    assert _texts(path.parent) == ["old text"]
    st = path.stat()
    path.write_text("text\nthe new and longer text\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _texts(path.parent) == ["the new and longer text"]


def test_a_cache_inside_the_corpus_folder_is_not_read_as_corpus(tmp_path):
    # Its tokenizer.json was read as records: "Expected object or value".
    folder = tmp_path / "records"
    _jsonl(folder / "part.jsonl", LINES)
    _, blocks = data.prepare_corpus(folder, folder / "cache", 300, 8)
    _, again = data.prepare_corpus(folder, folder / "cache", 300, 8)
    assert again.tensor().equal(blocks.tensor())
    assert [f.name for f in data._walk(folder)] == ["part.jsonl"]


def test_the_tokens_are_kept_where_an_option_does_not_change_them(tmp_path):
    # vocab_size with a tokenizer given, text_field and split of a .txt corpus: each wrote
    # another token file of the same tokens (hours on a large corpus).
    tok_dir = tmp_path / "tok"
    data.train_tokenizer([SONNETS], VOCAB, tok_dir)
    cache = tmp_path / "cache"
    for vocab, field in ((VOCAB, "text"), (VOCAB * 2, "text"), (VOCAB, "body")):
        data.prepare_corpus(SONNETS, cache, vocab, 16, tokenizer=tok_dir, text_field=field)
    data.prepare_corpus(SONNETS, cache, VOCAB, 16, text_field="text")
    data.prepare_corpus(SONNETS, cache, VOCAB, 16, text_field="body")
    assert len(list(cache.glob("tokens-*"))) == 2  # the given tokenizer's, the trained one's


def test_a_killed_writers_partial_token_file_is_swept(tmp_path):
    tok = data.train_tokenizer([SONNETS], VOCAB, tmp_path / "tok")
    target = tmp_path / "cache" / "tokens-x.uint16"
    target.parent.mkdir()
    stale, live = target.parent / f".{target.name}.dead", target.parent / f".{target.name}.live"
    stale.write_bytes(b"\0" * 64)
    live.write_bytes(b"\0" * 64)
    old = time.time() - data.PARTIAL_STALE_S - 60
    os.utime(stale, (old, old))
    data.write_tokens([["some text"]], tok, target)
    assert target.is_file() and not stale.exists() and live.exists()


def test_paths_take_the_home_folder_and_a_missing_relative_path_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    run = tmp_path / "conf" / "island.yaml"
    run.parent.mkdir()
    run.write_text("data: {path: ~/corpus, cache_dir: ~/.cache/ds}\n")
    d = load_data_config(run)
    assert (d.path, d.cache_dir) == (str(tmp_path / "corpus"), str(tmp_path / ".cache/ds"))
    monkeypatch.chdir(tmp_path)
    # A mistyped folder was taken for a dataset name: "set data.tokenizer", the wrong advice.
    with pytest.raises(ValueError, match=r"'data/shakespear' is not a file or folder here"):
        data.prepare_corpus("data/shakespear", tmp_path / "cache", 300, 8)


def test_a_hub_datasets_configuration_is_asked_for_and_keys_its_tokens(tmp_path, monkeypatch):
    # A hub dataset with several configurations (wikitext-103-raw-v1, ...) could not be
    # named: load_dataset refused it without one. The Hub is out of reach here: its loader
    # stands in, the one call that would go to the network.
    asked = []

    def load_dataset(path, name=None, split=None):
        asked.append((path, name, split))
        return datasets.Dataset.from_dict(
            {"text": [f"The {name} text, line {i}." for i in range(50)]}
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    tok_dir = tmp_path / "tok"
    data.train_tokenizer([SONNETS], VOCAB, tok_dir)
    cache = tmp_path / "cache"
    tok, raw = data.prepare_corpus("someone/wiki", cache, VOCAB, 8, tokenizer=tok_dir, subset="raw")
    _, plain = data.prepare_corpus("someone/wiki", cache, VOCAB, 8, tokenizer=tok_dir, subset="v1")
    assert asked == [("someone/wiki", "raw", "train"), ("someone/wiki", "v1", "train")]
    assert tok.decode(raw[0].tolist()).startswith("The raw text")
    assert tok.decode(plain[0].tolist()).startswith("The v1 text")


def test_record_shards_with_other_columns_or_no_records_are_read_and_a_bad_one_named(tmp_path):
    # Shards whose records carry other extra columns failed in datasets' cast after the
    # tokenizer was trained (DatasetGenerationError); an empty shard failed the training
    # ("generator raised StopIteration"), an empty parquet file every read.
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "shards"
    _jsonl(folder / "a.jsonl", LINES[:20])
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": t, "url": "u"}) + "\n"
                                            for t in LINES[20:]))  # fmt: skip
    (folder / "c.jsonl").write_text("")
    (folder / "d.jsonl").write_text("\n")
    (folder / "e.jsonl").write_text(json.dumps({"text": None}) + "\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "f.parquet")
    assert _texts(folder) == [*LINES, None]
    tok, blocks = data.prepare_corpus(folder, tmp_path / "cache", 300, 8)
    assert (
        blocks.tensor().flatten().tolist()
        == data.pack(data.load_text_dataset(folder), tok, 8).flatten().tolist()
    )
    _jsonl(folder / "g.jsonl", LINES, field="body")
    with pytest.raises(ValueError, match=r"g.jsonl: text_field='text' not found"):
        _texts(folder)
    with pytest.raises(ValueError, match=r"g.jsonl: text_field='text' not found"):
        data.prepare_corpus(folder, tmp_path / "cache", 300, 8)


def test_a_record_file_that_does_not_parse_is_named(tmp_path):
    # A shard cut short (a killed download): a DatasetGenerationError traceback, no file named.
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps({"text": LINES[0]}) + '\n{"text": "Line 1 of')
    with pytest.raises(ValueError, match=r"cut.jsonl: not readable as JSON records .*JSON parse"):
        _texts(cut)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + b"\1" * 100)
    with pytest.raises(ValueError, match=r"junk.parquet: not readable as parquet records"):
        data.prepare_corpus(junk, tmp_path / "cache", 300, 8)


def test_a_filled_cache_is_only_read(tmp_path):
    # Prepared ahead (ds-diloco prepare-data) and mounted read-only on the nodes: every rank
    # failed with "Read-only file system" touching the cache's mark. Nothing in a filled
    # cache may be written again (as root, the mount is what refuses: mtimes are checked).
    cache = tmp_path / "cache"
    _, blocks = data.prepare_corpus(SONNETS, cache, VOCAB, 16)
    before = {p: p.stat().st_mtime_ns for p in [cache, *cache.rglob("*")]}
    time.sleep(0.01)
    if os.geteuid() != 0:
        for p in before:
            p.chmod(p.stat().st_mode & ~0o222)
    try:
        _, again = data.prepare_corpus(SONNETS, cache, VOCAB, 16)
    finally:
        for p in before:
            p.chmod(p.stat().st_mode | 0o200)
    assert again.tensor().equal(blocks.tensor())
    assert {p: p.stat().st_mtime_ns for p in [cache, *cache.rglob("*")]} == before


def test_the_caches_files_take_the_umask_as_the_tokenizers_do(tmp_path):
    # The token file and the fingerprint were mode 0600 (mkstemp), tokenizer.json 0644: a
    # cache prepared by one user was unreadable to the others sharing it.
    cache = tmp_path / "cache"
    data.prepare_corpus(SONNETS, cache, VOCAB, 16)
    (tokens,) = cache.glob("tokens-*")
    (tok_dir,) = cache.glob("tokenizer-*")
    mode = (tok_dir / "tokenizer.json").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
    assert tokens.stat().st_mode & 0o777 == mode
    assert (tok_dir / data.FINGERPRINT_FILE).stat().st_mode & 0o777 == mode


def test_a_folder_datasets_cannot_read_is_named(tmp_path):
    # A folder of .md files with data.tokenizer: "DataFilesNotFoundError: No task.toml or
    # instruction.md files found", a traceback from datasets' guess of what the folder is.
    tok_dir = tmp_path / "tok"
    data.train_tokenizer([SONNETS], VOCAB, tok_dir)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text(SONNETS.read_text())
    with pytest.raises(ValueError, match=r"docs' holds no .txt, .json, .jsonl or .parquet file"
                                         r"s, and datasets.load_dataset does not read it \(.+\)"):  # fmt: skip
        data.prepare_corpus(docs, tmp_path / "cache", VOCAB, 16, tokenizer=tok_dir)


def test_a_folder_with_dataset_info_that_load_from_disk_refuses_is_named(tmp_path):
    # A datasets cache folder (dataset_info.json beside its .arrow files, no state.json): a
    # FileNotFoundError traceback from load_from_disk.
    folder = data.load_text_dataset(_jsonl(tmp_path / "r.jsonl", LINES)).cache_files[0]
    folder = Path(folder["filename"]).parent
    assert (folder / "dataset_info.json").is_file()
    with pytest.raises(ValueError, match=r"data.path '.*' is not a dataset save_to_disk wrote "
                                         r"\(.*neither a `Dataset` directory"):  # fmt: skip
        data.load_text_dataset(folder)


def test_ndjson_files_are_records(tmp_path):
    # Newline-delimited JSON under its other common suffix was read as text: the tokenizer
    # and the model trained on the records' JSON syntax, '{"text": ...', with no error.
    path = tmp_path / "part.ndjson"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(LINES)))
    assert _texts(path) == LINES
    (tmp_path / "folder").mkdir()
    path.rename(tmp_path / "folder" / path.name)
    assert _texts(tmp_path / "folder") == LINES


def test_a_cache_folder_that_cannot_be_made_is_named(tmp_path):
    # A relative data.cache_dir beside a config file in a read-only checkout: an OSError
    # traceback ("Read-only file system"); a path through a file, the same.
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"data.cache_dir '.*a_file/cache' cannot be written"):
        data.prepare_corpus(SONNETS, tmp_path / "a_file" / "cache", VOCAB, 16)
