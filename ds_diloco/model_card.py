"""The model card (README.md) of an exported model, and the run summary it is built from.

Two sources: what the coordinator knows (merges per fragment, each island's
world size and merged contributions, the schedule H, P, tau) and what only the
run knows, given as a JSON file (:class:`RunSummary`: base model and its
license, data, tokens, outer settings, goodput, held-out loss). Figures
neither gives are written as "not given" / "not measured", never guessed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ds_diloco.config import from_dict

if TYPE_CHECKING:
    from ds_diloco.export import GlobalModel


@dataclasses.dataclass(frozen=True, kw_only=True)
class IslandSummary:
    """One island of the run, as the run reports it."""

    name: str
    """Island id (as registered at the coordinator)."""
    world_size: int | None = None
    """ZeRO-3 ranks of the island."""
    tokens: int | None = None
    """Training tokens the island consumed."""
    steps: int | None = None
    """Inner steps the island ran."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterSummary:
    """The outer loop's settings."""

    name: str | None = None
    """Outer optimizer, e.g. 'nesterov'."""
    lr: float | None = None
    """Outer learning rate."""
    momentum: float | None = None
    """Outer momentum."""
    H: int | None = None
    """Inner steps between two syncs of the same fragment (sync_every)."""
    P: int | None = None
    """Fragments the model is split into (num_fragments)."""
    tau: int | None = None
    """Overlap: inner steps between sending a fragment and applying its result."""
    K: int | None = None
    """Minimum quorum: islands a merge waits for."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What a run reports about itself, for the model card (``--run-summary FILE``).

    A JSON object; every key is optional, and keys not listed here are ignored,
    so the summary.json that ``ds-diloco run`` writes can carry these next to its
    own. Example::

        {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "base_license": "apache-2.0",
         "data": "Shakespeare's sonnets (public domain)",
         "islands": [{"name": "a", "world_size": 2, "tokens": 327680, "steps": 160}],
         "outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9, "H": 8, "P": 8,
                   "tau": 2, "K": 1},
         "goodput": 0.93, "heldout_loss_before": 3.41, "heldout_loss_after": 2.87}

    ``islands`` may also be an object keyed by island name (as ``ds-diloco run``
    writes it), and ``heldout_loss_initial`` / ``heldout_loss_merged`` (its names)
    are read as before / after. Where the coordinator says the same thing (merges,
    world sizes, H, P, tau) the coordinator's figure is used: it describes the
    exported weights.
    """

    base_model: str | None = None
    """The checkpoint the run started from: a Hub id or a path."""
    base_license: str | None = None
    """License of the base model (a Hub license id such as 'apache-2.0')."""
    data: str | None = None
    """The training text: name, source, license."""
    islands: tuple[IslandSummary, ...] = ()
    """The islands of the run."""
    merges: tuple[int, ...] | None = None
    """Merges per fragment (used when the coordinator does not say)."""
    outer: OuterSummary = dataclasses.field(default_factory=OuterSummary)
    """Outer optimizer and schedule."""
    goodput: float | None = None
    """Share of the chips' time spent on useful training, in [0, 1] (None: not measured)."""
    heldout_loss_before: float | None = None
    """Held-out loss of the base (or initial) model."""
    heldout_loss_after: float | None = None
    """Held-out loss of the merged model."""

    def __post_init__(self):
        if self.goodput is not None and not 0.0 <= self.goodput <= 1.0:
            raise ValueError(f"run summary: goodput must be in [0, 1], got {self.goodput}")
        for isl in self.islands:
            if (isl.tokens or 0) < 0 or (isl.world_size is not None and isl.world_size < 1):
                raise ValueError(f"run summary: island {isl.name!r} has {isl}")

    @classmethod
    def from_json(cls, data: dict) -> RunSummary:
        if not isinstance(data, dict):
            raise ValueError(f"run summary: expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        for theirs, ours in (("initial", "before"), ("merged", "after")):
            data.setdefault(f"heldout_loss_{ours}", data.get(f"heldout_loss_{theirs}"))
        islands = data.get("islands") or []
        if isinstance(islands, dict):  # {name: {...}}, as ds-diloco run writes it
            islands = [{**v, "name": k} for k, v in islands.items() if isinstance(v, dict)]
        if isinstance(islands, list):
            data["islands"] = [_known(IslandSummary, i) for i in islands]
        data["outer"] = _known(OuterSummary, data.get("outer") or {})
        return from_dict(cls, _known(cls, data), "run summary: ")


def _known(cls, data):
    """The keys of ``data`` that ``cls`` has; from_dict then checks their types."""
    if not isinstance(data, dict):
        return data  # from_dict names what is wrong with it
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names and v is not None}


def load_run_summary(path: str | os.PathLike) -> RunSummary:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"run summary {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"run summary {str(p)!r} is not valid JSON: {e}") from None
    return RunSummary.from_json(data)


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
NOT_GIVEN = "not given"


def _or(value, fmt: str = "{}", missing: str = NOT_GIVEN) -> str:
    return missing if value is None else fmt.format(value)


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell."""
    return " ".join(str(text).replace("|", "\\|").split())


def model_card(
    g: GlobalModel,
    summary: RunSummary | None = None,
    *,
    title: str = "Model",
    dtype: str = "float32",
    tokenizer: bool = False,
    repo: str | None = None,
    revision: str | None = None,
) -> str:
    """README.md of an exported model: Hub metadata, the run's figures, how to load it
    (from ``repo`` at branch ``revision`` when it is pushed there)."""
    import yaml

    s = summary or RunSummary()
    told = {i.name: i for i in s.islands}
    names = list(dict.fromkeys([*told, *g.islands]))  # the run's order, then the coordinator's

    def ranks(name: str):  # as registered at the coordinator, else as the run says
        ranks = g.islands.get(name, {}).get("world_size")
        return ranks if ranks is not None else getattr(told.get(name), "world_size", None)

    tokens = [told[n].tokens for n in names if n in told and told[n].tokens is not None]
    merges = g.merges if g.merges is not None else s.merges
    if merges:
        lo, hi = min(merges), max(merges)
        each = f"{lo}" if lo == hi else f"{lo} to {hi}"
        merges_line = f"{each} ({len(merges)} fragments, {sum(merges)} merges in all)"
    else:
        merges_line = NOT_GIVEN
    o = s.outer
    h, tau = g.schedule.get("sync_every", o.H), g.schedule.get("overlap", o.tau)
    # A summary written at other merges (a run resumed since) measured other weights: its
    # held-out loss and tokens were given as these weights' own.
    other = s.merges is not None and g.merges is not None and list(s.merges) != list(g.merges)
    at = f"the run summary's, of the model at {sum(s.merges or ())} merges; these weights are at "
    at += f"{sum(g.merges or ())}"
    if s.heldout_loss_after is None:
        loss = "not measured"
    elif other:
        loss = f"not measured for these weights ({s.heldout_loss_after:.4f}: {at})"
    elif s.heldout_loss_before is None:
        loss = f"{s.heldout_loss_after:.4f}"
    else:
        loss = f"{s.heldout_loss_after:.4f} (from {s.heldout_loss_before:.4f} before the run)"
    sizes = ", ".join(f"{n} ({_or(ranks(n))} ranks)" for n in names)
    rows = {
        "base model": _or(s.base_model),
        "license of the base": s.base_license or "not given: check the base model's license",
        "data": _or(s.data),
        "islands": f"{len(names)}: {sizes}" if names else NOT_GIVEN,
        "tokens": (f"{sum(tokens):,}" + (f" ({at})" if other else ""))
        if names and len(tokens) == len(names)
        else NOT_GIVEN,
        "merges per fragment": merges_line,
        "outer optimizer": f"{_or(o.name)}, lr {_or(o.lr)}, momentum {_or(o.momentum)}",
        "schedule": f"H = {_or(h)} inner steps between syncs of a fragment, "
        f"P = {len(g.versions)} fragments, tau = {_or(tau)} overlap steps, "
        f"K = {_or(o.K)} minimum quorum",
        "goodput": "not measured" if s.goodput is None else f"{100 * s.goodput:.1f}%",
        "final held-out loss": loss,
        "parameters": f"{sum(t.numel() for t in g.tensors.values()):,} ({dtype})",
        "fragment versions exported": ", ".join(map(str, g.versions)),
    }

    meta: dict = {}
    if s.base_license:
        meta["license"] = s.base_license
    if s.base_model and _HUB_ID.match(s.base_model) and not Path(s.base_model).exists():
        meta["base_model"] = s.base_model  # the Hub refuses a local path here
    meta.update(library_name="transformers", pipeline_tag="text-generation",
                tags=["ds-diloco", "diloco"])  # fmt: skip

    out = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    out += [
        "Trained with ds_diloco (Decoupled DiLoCo): independent islands, each a DeepSpeed "
        "ZeRO-3 group with its own data and inner AdamW, send pseudo-gradients of one "
        "fragment of the model at a time to a coordinator, which merges them with an outer "
        "optimizer. These are the coordinator's merged weights.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {_cell(v)} |" for k, v in rows.items()),
        "",
    ]
    if names:
        out += ["## Islands", "",
                "| island | ranks | tokens | inner steps | contributions merged | dropped |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for n in names:
            t, c = told.get(n, IslandSummary(name=n)), g.islands.get(n, {})
            out.append(f"| {_cell(n)} | {_or(ranks(n))} | {_or(t.tokens, '{:,}')} | {_or(t.steps)} | "
                       f"{_or(c.get('merged'))} | {_or(c.get('dropped'))} |")  # fmt: skip
        out.append("")
    where = f'"{repo}"' if repo else '"PATH/TO/THIS/FOLDER"'
    if repo and revision and revision != "main":  # else the snippet loads main: another model
        where += f', revision="{revision}"'
    out += ["## Use", "", "```python",
            "from transformers import AutoModelForCausalLM" + (", AutoTokenizer" if tokenizer else ""),
            "", f"model = AutoModelForCausalLM.from_pretrained({where})"]  # fmt: skip
    if tokenizer:
        out.append(f"tokenizer = AutoTokenizer.from_pretrained({where})")
    out += ["```", ""]
    return "\n".join(out)
