"""The end of the data path: the coordinator's global model as a Hugging Face folder.

The global model lives as P fragments, each one flat fp32 buffer holding whole
tensors in the plan's order. Export reads them from a running coordinator
(the wire API, as one rank of a world of size 1) or from its state directory
(no coordinator needed), cuts them into full-shape tensors and writes a folder
that ``AutoModelForCausalLM.from_pretrained`` loads, with a model card
(README.md) built from what the coordinator knows plus the run's summary JSON
(:class:`RunSummary`).

Consistency: fragments merge independently, so a live coordinator may merge one
while the others are being downloaded. Export reads the versions after the
downloads and fetches again the fragments that moved on, until every fragment
it holds is still the one served: the set then existed, whole, at that moment.
A state directory holds what the coordinator last saved (each fragment as it was
when written); export from the URL while a run is going.

Memory: the model is built with empty (meta) weights and the tensors are
assigned to it, not copied, so a 7B model needs its tensors once (27 GiB in
fp32), not twice. Fragments are fetched and cut one at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from ds_diloco.config import TOKEN_ENV
from ds_diloco.fragments import Fragment, FragmentPlan
from ds_diloco.island_table import islands_on_disk, merges_on_disk
from ds_diloco.model_card import RunSummary, load_run_summary, model_card
from ds_diloco.state_store import StateStore

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # fmt: skip
_BUILD_LOCK = threading.Lock()
SNAPSHOT_ATTEMPTS = 10
"""Download passes before giving up on a coordinator whose fragments keep merging."""


@dataclasses.dataclass
class GlobalModel:
    """The global model as read from a coordinator or its state directory."""

    config: dict
    """The Hugging Face config.json of the model."""
    tensors: dict[str, torch.Tensor]
    """Full-shape fp32 tensors by ``named_parameters()`` name (tied weights once)."""
    versions: list[int]
    """Version of each fragment at the time it was read. Fragments merge
    independently, so a live coordinator may be mid-way through a round."""
    signature: str
    """The plan's parameter signature (names and shapes, in model order)."""
    merges: list[int] | None = None
    """Merges applied to each fragment (versions may skip numbers after a restart)."""
    islands: dict[str, dict] = dataclasses.field(default_factory=dict)
    """The coordinator's island table: world_size, merged, dropped, tokens_merged."""
    schedule: dict = dataclasses.field(default_factory=dict)
    """sync_every (H), num_fragments (P), overlap (tau), when the coordinator serves them."""
    generation_config: dict | None = None
    """The model's generation_config.json, when the state directory holds one."""


class CoordinatorUnreachable(ValueError):
    """The coordinator could not be reached, or failed, while the model was read from it:
    a later try may do (it was restarting, say)."""


def is_url(source: str | os.PathLike) -> bool:
    return str(source).startswith(("http://", "https://"))


def split_fragment(fragment: Fragment, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Full-shape tensors of one fragment's flat buffer, each with its own storage.

    Views would do for loading, but ``save_pretrained`` clones tensors that share
    a storage before writing them: copying here, one fragment at a time, keeps
    the peak at the model plus one fragment instead of twice the model."""
    if values.dim() != 1 or values.numel() != fragment.numel:
        raise ValueError(
            f"fragment {fragment.index} holds {values.numel()} values in shape "
            f"{list(values.shape)}; its plan needs a flat buffer of {fragment.numel}"
        )
    return {
        p.name: values[o : o + p.numel].view(p.shape).clone()
        for p, o in zip(fragment.params, fragment.offsets)
    }


def load_global(
    source: str | os.PathLike, token: str | None = None, attempts: int = SNAPSHOT_ATTEMPTS,
    ca_file: str | None = None,
) -> GlobalModel:  # fmt: skip
    """Read the global model from a coordinator URL or a coordinator state directory.

    From a URL the fragments are one set the coordinator served at one moment;
    ``attempts`` bounds the download passes spent getting there; ``ca_file``: the
    certificates trusted for an https:// coordinator (default: $DS_DILOCO_CA_FILE, else
    the system's)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    if is_url(source):
        token = token or os.environ.get(TOKEN_ENV)
        return _from_coordinator(str(source), token, attempts, ca_file)
    return _from_state_dir(Path(source))


def load_global_tensors(
    source: str | os.PathLike, token: str | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config dict, {name: full-shape fp32 tensor}) from a URL or a state directory.

    ``token`` is the coordinator's bearer token (default: $DS_DILOCO_TOKEN);
    a state directory needs none.
    """
    g = load_global(source, token)
    return g.config, g.tensors


def _from_state_dir(root: Path) -> GlobalModel:
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is neither an http(s):// coordinator URL nor a folder")
    store = StateStore(root)
    if not store.exists():
        raise ValueError(
            f"{str(root)!r} is not a coordinator state directory: it has no coordinator.json "
            "(pass the coordinator's state_dir, or its http(s):// URL)"
        )
    state = store.read_json("coordinator.json")
    if "plan" not in state:
        raise ValueError(f"{root / 'coordinator.json'} holds no fragment plan")
    plan = FragmentPlan.from_json(state["plan"])
    config_path = store.model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"state directory {str(root)!r} has no model config ({config_path} is missing): "
            "the coordinator that wrote it predates saving the HF config; copy the model's "
            "config.json there"
        )
    config = store.read_json("model/config.json")
    tensors: dict[str, torch.Tensor] = {}
    versions, merged_by = [], []
    for frag in plan.fragments:
        try:
            version, values, _, marks = store.read_fragment_state(frag.index)
        except FileNotFoundError as e:
            raise ValueError(f"{e}: the state directory is incomplete") from None
        tensors.update(split_fragment(frag, values))
        versions.append(version)
        merged_by.append(marks)
    # As the coordinator loads it: merges made durable after the table's last save count.
    merges = (
        [merges_on_disk(state, i, v) for i, v in enumerate(versions)] if "merges" in state else None
    )
    islands = {k: v.to_json() for k, v in islands_on_disk(state, merged_by, 0.0).items()}
    log.info("read %d fragments from %s at versions %s", len(plan), root, versions)
    return GlobalModel(
        config,
        _in_model_order(plan, tensors),
        versions,
        plan.signature,
        merges=merges,
        islands=islands,
        schedule=state.get("schedule", {}),  # none in states written before it was saved
        generation_config=store.read_json("model/generation_config.json"),
    )


def _from_coordinator(
    url: str, token: str | None, attempts: int, ca_file: str | None
) -> GlobalModel:
    from ds_diloco.client import TRANSPORT_ERRORS, CoordinatorClient, CoordinatorError, RefusedError

    if not token:
        raise ValueError(
            f"exporting from {url} needs the coordinator's token: --token or ${TOKEN_ENV}"
        )
    client = CoordinatorClient(url, token, ca_file=ca_file)
    try:
        info = client.plan()
        plan = FragmentPlan.from_json(info["plan"])
        try:
            config = client.model_config()
            generation_config = client.generation_config()
        except CoordinatorError as e:
            raise ValueError(
                f"coordinator {url} could not serve its model config ({e}): its state "
                "directory may lack model/config.json"
            ) from None
        held: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        todo = [f.index for f in plan.fragments]
        for attempt in range(1, attempts + 1):
            for i in todo:
                held[i] = _download(client, url, plan.fragments[i])
            # Versions only grow: a fragment still at the version it was downloaded at
            # was served unchanged from its download until now, so the set held is
            # exactly what the coordinator served at this moment.
            status = client.status()
            todo = [i for i, v in enumerate(status["versions"]) if held[i][0] != v]
            if not todo:
                break
            log.info("fragments %s merged during export pass %d of %d; fetching them again",
                     todo, attempt, attempts)  # fmt: skip
        else:
            raise ValueError(
                f"coordinator {url}: fragments {todo} merged again during each of {attempts} "
                "download passes, so no consistent set was read; try again (or export from "
                "the state directory after the run)"
            )
    except RefusedError as e:
        hint = f": check --token or ${TOKEN_ENV}" if e.status == 401 else ""
        raise ValueError(f"coordinator {url} refused the export ({e}){hint}") from None
    except CoordinatorError as e:
        raise CoordinatorUnreachable(f"coordinator {url} failed during the export: {e}") from None
    except TRANSPORT_ERRORS as e:
        raise CoordinatorUnreachable(f"cannot reach the coordinator at {url}: {e}") from None
    versions = [held[f.index][0] for f in plan.fragments]
    tensors = {n: t for f in plan.fragments for n, t in held[f.index][1].items()}
    log.info("downloaded %d fragments from %s at versions %s", len(plan), url, versions)
    return GlobalModel(
        config,
        _in_model_order(plan, tensors),
        versions,
        plan.signature,
        merges=status.get("merges"),
        islands=status.get("islands", {}),
        schedule=info.get("schedule", {}),
        generation_config=generation_config,
    )


def _download(client, url: str, frag: Fragment) -> tuple[int, dict[str, torch.Tensor]]:
    # World size 1, rank 0: one rank that owns every tensor whole.
    version, slices = client.download(frag.index, world_size=1, rank=0)
    missing = sorted(set(frag.names) - set(slices))
    if missing:
        raise ValueError(f"coordinator {url}: fragment {frag.index} lacks {missing[:5]}")
    values = torch.cat([slices[p.name].reshape(-1) for p in frag.params])
    del slices
    return version, split_fragment(frag, values)


def _in_model_order(plan: FragmentPlan, tensors: dict[str, torch.Tensor]) -> dict:
    return {s.name: tensors[s.name] for s in plan.specs}


def _hf_config(config_dict: dict | None):
    from transformers import CONFIG_MAPPING

    if not config_dict:
        raise ValueError("no model config: export needs the HF config.json of the global model")
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model config has model_type {model_type!r}, which this transformers version "
            "does not know"
        )
    return CONFIG_MAPPING[model_type].from_dict(config_dict)


def shard_size_bytes(size: int | str) -> int:
    """``max_shard_size`` ("2GB", "500MB", bytes) in bytes, checked before any work."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        n = convert_file_size_to_int(size)
    except (ValueError, TypeError) as e:
        raise ValueError(f"max shard size {size!r} is not a size like 2GB or 500MB ({e})") from None
    if n < 1:
        raise ValueError(f"max shard size {size!r} must be positive")
    return n


def check_out_folder(out: str | os.PathLike) -> Path:
    """``out`` may receive an export: new, empty, or an earlier export (it has a
    config.json), which is replaced whole. Anything else is refused, not deleted.

    A link is followed: its target is the folder replaced (the link itself was renamed
    away and a local folder put in its place: the export left the big disk it pointed to).
    """
    out, cwd = Path(out).resolve(), Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise ValueError(
            f"output folder {str(out)!r} is the working directory or holds it: an export "
            "replaces its folder whole; name a folder of its own (e.g. --out export)"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} is a file, not a folder")
    # The export is written beside ``out`` (parents made): a file on the way, or a folder it
    # may not write, was a traceback once the whole model had been downloaded and built.
    nearest = out.parent
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ValueError(f"output folder {str(out)!r}: {nearest} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {str(out)!r}: {nearest} is not writable")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(
            f"output folder {str(out)!r} is not empty and holds no earlier export (no "
            "config.json): pick a new or empty folder; an earlier export is replaced whole"
        )
    return out


@contextlib.contextmanager
def replacing_folder(out: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty folder beside ``out`` to write into; once the block succeeds it
    takes ``out``'s place (two renames), so no file of an earlier export survives: an
    old model.safetensors next to a new sharded index would be what from_pretrained
    loads, an old chat template what the tokenizer applies. On failure ``out`` is left
    as it was, and the folder is removed."""
    out = check_out_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_exports(out)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the pid tells a dead export's folder
    tmp = out.with_name(f".{out.name}.new-{tag}")
    tmp.mkdir()
    try:
        yield tmp
        _put_in_place(tmp, out, out.with_name(f".{out.name}.old-{tag}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _put_in_place(new: Path, out: Path, old: Path) -> None:
    """``new`` renamed to ``out``, an earlier ``out`` moved aside to ``old`` and removed; if
    the second rename fails, the earlier ``out`` is moved back."""
    if out.exists():
        out.rename(old)
    try:
        new.rename(out)
    except BaseException:
        if old.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_dead_exports(out: Path) -> None:
    """Clear what exports to ``out`` left when their process died (SIGKILL, out of memory,
    a crash of the machine), a model's worth each, for ever: the folders they were writing
    (``.<name>.new-<pid>-<hex>``, and ``.<name>.new-<hex>`` as named before the pid was
    added), removed; an earlier export moved aside (``.<name>.old-<pid>-<hex>``) and not
    yet replaced, put back if ``out`` is missing (a death between the two renames), else
    removed. Only those whose pid is no live process here."""
    ours = re.compile(rf"\.{re.escape(out.name)}\.(new|old)-(?:(\d+)-)?[0-9a-f]{{8}}")
    left = []
    for path in sorted(out.parent.iterdir()):
        m = ours.fullmatch(path.name)
        if m and path.is_dir() and not path.is_symlink() and not _alive(m[2]):
            left.append((m[1], path))
    for kind, path in left:
        if kind == "old" and not out.exists():
            path.rename(out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: str | None) -> bool:
    """Whether ``pid`` is a live process on this machine (None, no pid: an older export's)."""
    if pid is None:
        return False
    try:
        os.kill(int(pid), 0)
    except PermissionError:  # another user's
        return True
    except (ProcessLookupError, OverflowError):  # none; no pid is that large
        return False
    return True


def global_model(config, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
    """The Hugging Face model (eval mode) holding ``tensors`` (named as ``named_parameters()``
    names them, tied weights once; the tie is restored here) for ``config`` (a
    ``PretrainedConfig`` or its dict), in ``dtype`` (default: the tensors' fp32). The
    tensors are assigned, not copied (a cast to ``dtype`` makes copies).

    One model at a time: accelerate's ``init_empty_weights`` patches torch.nn.Module for
    the whole process while it is open, and parameters registered meanwhile in another
    thread (a run's periodic export and evaluation) went to the meta device.
    """
    if isinstance(config, dict):
        config = _hf_config(config)
    with _BUILD_LOCK:
        model = _build_with(config, tensors, dtype)
    model.eval()
    return model


def _build_with(config, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # Parameters on the meta device, buffers (rotary frequencies) real: no memory
    # is spent on weights that are replaced anyway.
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    want = [n for n, _ in model.named_parameters()]  # tied weights listed once
    missing = [n for n in want if n not in tensors]
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(
            f"the tensors do not match the model the config builds: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{'...' if len(extra) > 5 else ''}"
        )
    for name in want:
        t = tensors[name]
        shape = model.get_parameter(name).shape
        if t.shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {list(t.shape)}, the config gives {list(shape)}"
            )
    if dtype is not None:
        tensors = {n: _cast(n, t, dtype) for n, t in tensors.items()}
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()  # assign replaced the input embedding; re-point the tied head to it
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"parameters left without values after loading: {left[:5]}")
    return model


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; refused where a finite value is beyond its range (float16 tops out
    at 65504): the export would hold inf there, and the model's outputs NaN."""
    c = t.to(dtype)
    if c.dtype != t.dtype and c.is_floating_point() and torch.isinf(c).sum() > torch.isinf(t).sum():
        big = t[torch.isfinite(t)].abs().max().item()
        raise ValueError(
            f"tensor {name!r} holds values up to {big:.4g}, beyond the range of {dtype} "
            f"(max {torch.finfo(dtype).max:.4g}): they would be saved as inf; export in "
            "bfloat16 or float32"
        )
    return c


def export_model(
    config_dict: dict,
    tensors: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    max_shard_size: int | str = "2GB",
    dtype: torch.dtype | str | None = None,
    generation_config: dict | None = None,
) -> str:
    """Write a Hugging Face model folder (config, generation config, safetensors
    shards with an index when larger than ``max_shard_size``, tokenizer when given).

    ``tensors`` are named as ``named_parameters()`` names them (tied weights once;
    the tie is restored here). ``dtype`` (default: the tensors' fp32) is the
    saved dtype. The generation config is ``generation_config``, else the
    tokenizer folder's generation_config.json (a pretrained model folder has one),
    else derived from the model config. Returns the folder.
    """
    from transformers import GenerationConfig

    from ds_diloco.data import load_tokenizer

    config = _hf_config(config_dict)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    tok = None
    if tokenizer is not None:  # before any writing: a bad tokenizer leaves no half export
        if not Path(tokenizer).is_dir():
            raise ValueError(f"tokenizer {str(tokenizer)!r} is not a folder")
        tok = load_tokenizer(tokenizer, "tokenizer")
        if len(tok) > config.vocab_size:
            raise ValueError(
                f"tokenizer {str(tokenizer)!r} has {len(tok)} tokens, more than the model's "
                f"vocab_size {config.vocab_size}"
            )

    model = global_model(config, tensors, dtype)
    if generation_config is None and tokenizer is not None:
        path = Path(tokenizer) / "generation_config.json"
        generation_config = json.loads(path.read_text()) if path.is_file() else None
    if generation_config is not None:
        model.generation_config = GenerationConfig.from_dict(generation_config)
    elif model.can_generate() and model.generation_config is None:
        model.generation_config = GenerationConfig.from_model_config(config)

    out = Path(out_dir)
    with replacing_folder(out) as tmp:
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        if tok is not None:
            tok.save_pretrained(str(tmp))
    log.info("exported %s parameters to %s", f"{sum(t.numel() for t in tensors.values()):,}", out)
    return str(out)


def export(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    token: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    dtype: str = "float32",
    max_shard_size: int | str = "2GB",
    run_summary: RunSummary | str | os.PathLike | None = None,
    repo: str | None = None,
    revision: str | None = None,
    ca_file: str | None = None,
) -> GlobalModel:
    """The global model of ``source`` (URL or state directory) as a Hugging Face
    folder with a model card. ``repo``, ``revision``: the Hub repo and branch it is for
    (the card is named after the repo, and loads from that branch); ``ca_file``: see
    :func:`load_global`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    shard_size_bytes(max_shard_size)
    check_out_folder(out_dir)  # before downloading anything
    if run_summary is not None and not isinstance(run_summary, RunSummary):
        run_summary = load_run_summary(run_summary)
    g = load_global(source, token, ca_file=ca_file)
    write_export(g, out_dir, tokenizer=tokenizer, dtype=dtype, max_shard_size=max_shard_size,
                 run_summary=run_summary, repo=repo, revision=revision)  # fmt: skip
    return g


def write_export(
    g: GlobalModel,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype: str = "float32",
    max_shard_size: int | str = "2GB",
    run_summary: RunSummary | None = None,
    repo: str | None = None,
    revision: str | None = None,
) -> str:
    """:func:`export` of a model already read (:func:`load_global`); returns the folder."""
    out = export_model(g.config, g.tensors, out_dir, tokenizer=tokenizer,
                       max_shard_size=max_shard_size, dtype=dtype,
                       generation_config=g.generation_config)  # fmt: skip
    title = repo.split("/")[-1] if repo else Path(out).resolve().name
    saved = str(DTYPES[dtype]).removeprefix("torch.")
    card = model_card(g, run_summary, title=title, dtype=saved, tokenizer=tokenizer is not None,
                      repo=repo, revision=revision)  # fmt: skip
    (Path(out) / "README.md").write_text(card)
    return out
