"""``ds-diloco simulate``: arguments, tables, the PNG plot and the JSON summary."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
import sys
from decimal import Decimal
from pathlib import Path

from ds_diloco.simulate.config import (
    PAPER_CHIPS,
    PAPER_ISLANDS,
    PUBLISHED,
    PUBLISHED_DILOCO,
    SYSTEMS,
    SimConfig,
)
from ds_diloco.simulate.plan import DEFAULT_TOLERANCE, Plan, recommend
from ds_diloco.simulate.result import CHIP_TIME
from ds_diloco.simulate.run import Result, run_configs, sweep_configs

# Set by their own flags (lists, or not numbers); every other SimConfig field gets --field-name.
_OWN = ("chips", "islands", "min_quorum", "days", "seed", "systems")


class CountError(argparse.ArgumentTypeError, ValueError):
    """Not a count: argparse shows the message after the flag's name."""


def parse_count(text: str) -> int:
    """'150k' -> 150000, '1.2M' -> 1200000, '4096' -> 4096."""
    t = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(t[-1:], 1)
    try:  # exact: 4.1M is 4100000, not 4099999.9999999995 (not a whole number)
        value = Decimal(t[:-1] if scale > 1 else t) * scale
    except ArithmeticError:  # InvalidOperation
        value = Decimal("nan")
    if not (value.is_finite() and math.isfinite(float(value))):  # also inf and 1e400
        raise CountError(f"not a count: {text!r} (write 150000, 150k or 1.2M)")
    if value != value.to_integral_value():  # rounded, --islands 2.5 ran M = 2
        raise CountError(f"not a count: {text!r} is not a whole number")
    return int(value)


def _counts(text: str) -> list[int]:
    return [parse_count(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chips", type=_counts, default=list(PAPER_CHIPS),
                   help="cluster sizes, comma-separated (150k,1.2M,...); default: the paper's "
                   "150k..2.4M")  # fmt: skip
    g = p.add_mutually_exclusive_group()
    g.add_argument("--islands", type=_counts, default=None,
                   help="Decoupled DiLoCo learners M, comma-separated (default 2,4,8,16)")  # fmt: skip
    g.add_argument("--chips-per-island", type=parse_count, default=None,
                   help="instead of --islands: M = chips // this, per cluster size")  # fmt: skip
    p.add_argument("--min-quorum", type=_counts, default=None,
                   help="Decoupled DiLoCo's quorum K, comma-separated (each K up to M is run "
                   f"with every M; default {SimConfig.min_quorum})")  # fmt: skip
    p.add_argument("--plan", type=float, nargs="?", const=100 * DEFAULT_TOLERANCE, default=None,
                   metavar="POINTS", help="recommend M and K at each cluster size: the fewest "
                   "islands within POINTS of the best goodput (default "
                   f"{100 * DEFAULT_TOLERANCE:g}), then that M's best quorum "
                   "(ds_diloco/simulate/plan.py)")  # fmt: skip
    p.add_argument("--days", type=float, default=SimConfig.days, help="simulated days")
    p.add_argument("--seed", type=int, default=SimConfig.seed)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="processes (results do not depend on it)")
    p.add_argument("--breakdown", action="store_true",
                   help="where the chip-time went, per system, at every cluster size "
                   "(default: only when one size is asked for)")  # fmt: skip
    p.add_argument("--plot", metavar="PNG", default=None, help="write goodput vs chips as a PNG")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the results as JSON ('-': to stdout, instead of the tables; an "
                   "infinite value, such as --chip-mtbi-s inf, as the string \"inf\")")  # fmt: skip
    model = p.add_argument_group("model parameters (defaults: the calibrated ones)")
    for f in dataclasses.fields(SimConfig):
        if f.name in _OWN:
            continue
        if isinstance(f.default, bool):  # --align-phase / --no-align-phase
            model.add_argument("--" + f.name.replace("_", "-"), default=None,
                               action=argparse.BooleanOptionalAction,
                               help=f"default {'on' if f.default else 'off'}")  # fmt: skip
        else:
            kind = parse_count if "chips" in f.name else type(f.default)  # 150k, 1.2M
            model.add_argument("--" + f.name.replace("_", "-"), type=kind,
                               default=None, help=f"default {f.default:g}")  # fmt: skip


def _flag(match: re.Match) -> str:
    field = {"tau": "overlap"}.get(match[2], match[2])  # PolicyOptions.tau is --overlap
    return "--" + field.replace("_", "-")


def flag_names(e: ValueError) -> ValueError:
    """A SimConfig error (or its PolicyOptions') with each field named by its flag."""
    return ValueError(re.sub(r"\b(SimConfig|PolicyOptions)\.(\w+)", _flag, str(e)))


def config_from_args(args: argparse.Namespace) -> SimConfig:
    over = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SimConfig)
        if f.name not in _OWN and getattr(args, f.name, None) is not None
    }
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if not args.chips:
        raise ValueError("--chips: give at least one cluster size (150k,1.2M,...)")
    cpi = getattr(args, "chips_per_island", None)
    # An island holds whole slices: under a slice, M = chips // this is over the slices,
    # and that was refused as --islands, a flag not given.
    lo = over.get("chips_per_slice", SimConfig.chips_per_slice)
    if cpi is not None and not max(lo, 1) <= cpi <= min(args.chips):
        raise ValueError(f"--chips-per-island must be {max(lo, 1)}..{min(args.chips)} (one "
                         f"slice, --chips-per-slice, to the smallest --chips), got {cpi}")  # fmt: skip
    if getattr(args, "islands", None) == []:  # ',' is not the default 2,4,8,16
        raise ValueError("--islands: give at least one M (2,4,...)")
    # Checked here against the largest size: the fewest islands asked for (M per size
    # comes from --islands or --chips-per-island, not from this default).
    islands = min(args.islands) if getattr(args, "islands", None) else 1
    quorums = getattr(args, "min_quorum", None)
    if quorums is not None and not quorums:
        raise ValueError("--min-quorum: give at least one quorum K (1,2,...)")
    if quorums:  # checked per M by sweep_configs: a K over some M is not run for it
        over["min_quorum"] = min(min(quorums), islands)
    return SimConfig(chips=max(args.chips), days=args.days, seed=args.seed, systems=systems,
                     islands=islands, **over)  # fmt: skip


def _short(n: int) -> str:
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1e6:g}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1000}k"
    return str(n)


def _nominal(chips: int, requested: list[int], slice_chips: int) -> int:
    """The requested size a row was run for (rows hold whole slices: 150k -> 149,760)."""
    for n in requested:
        if n // slice_chips * slice_chips == chips:
            return n
    return chips


def _published(system: str, chips: int, islands: int, quorum: int = 1) -> int | None:
    if system == "diloco":  # the paper's K = 1: no published cell for another quorum
        return PUBLISHED_DILOCO.get((chips, islands)) if quorum == 1 else None
    return PUBLISHED.get(system, {}).get(chips)


def sizes_note(requested: list[int], slice_chips: int, chips_per_island: int | None) -> str:
    """What each size asked for runs as: whole slices (a remainder below one is not used,
    ``SimConfig.chips``), and with ``--chips-per-island`` M = chips // it islands of whole
    slices, so islands of other sizes than asked. "" if every size is simulated as asked.
    Without it, 1000 chips ran as 768 under the heading 1k and nothing said so."""
    lines = []
    for n in dict.fromkeys(requested):
        slices, left = divmod(n, slice_chips)
        line = f"  {_short(n)}: {slices * slice_chips:,} chips ({slices} slice(s)"
        line += f"; {left:,} below a whole slice, not used)" if left else ")"
        exact = not left
        if chips_per_island is not None:  # islands: contiguous blocks of slices (diloco.py)
            m = n // chips_per_island
            lo, hi = slices // m, -(-slices // m)
            each, chips = f"{lo}", f"{lo * slice_chips:,}"
            if lo != hi:
                each, chips = f"{lo}-{hi}", f"{chips}-{hi * slice_chips:,}"
            line += f", M = {m} islands of {each} slice(s), {chips} chips each"
            if lo != hi or lo * slice_chips != chips_per_island:
                line, exact = f"{line} (not {chips_per_island:,})", False
        if not exact:
            lines.append(line)
    if not lines:
        return ""
    per = "" if chips_per_island is None else f", --chips-per-island {chips_per_island:,}"
    head = f"simulated as (whole slices of {slice_chips} chips, --chips-per-slice{per}):"
    return "\n".join([head, *lines, ""])


def tables(result: Result, requested: list[int], slice_chips: int) -> str:
    """Goodput and uptime, % by cluster size; published goodput in brackets."""
    cols = sorted({_nominal(r.chips, requested, slice_chips) for r in result.rows})
    labels = list(dict.fromkeys(r.label for r in result.rows))
    width = max(len(x) for x in labels) + 2
    out = []
    for metric in ("goodput", "uptime"):
        note = " ([published])" if metric == "goodput" else ""
        out.append(f"{metric} %{note}")
        out.append(" " * width + "".join(f"{_short(c):>12}" for c in cols))
        for label in labels:
            cells = {}
            for r in result.rows:
                if r.label == label:
                    n = _nominal(r.chips, requested, slice_chips)
                    cell = f"{100 * getattr(r, metric):.1f}"
                    pub = _published(r.system, n, r.islands, r.min_quorum)
                    if metric == "goodput" and pub is not None:
                        cell += f" [{pub}]"
                    cells[n] = cell
            out.append(f"{label:<{width}}" + "".join(f"{cells.get(c, '-'):>12}" for c in cols))
        out.append("")
    return "\n".join(out)


def breakdown(result: Result, requested: list[int], slice_chips: int) -> str:
    """Per cluster size, where each system's chip-time went (% of it, by ``CHIP_TIME``);
    categories no system spent anything on are left out."""
    out = []
    for n in sorted({_nominal(r.chips, requested, slice_chips) for r in result.rows}):
        rows = [r for r in result.rows if _nominal(r.chips, requested, slice_chips) == n]
        cats = [k for k in CHIP_TIME if any(r.chip_time[k] >= 5e-4 for r in rows)]
        width = max(len(r.label) for r in rows) + 2
        out.append(f"where the chip-time went at {_short(n)} chips, %")
        out.append(" " * width + "".join(f"{k:>12}" for k in cats))
        for r in rows:
            out.append(
                f"{r.label:<{width}}" + "".join(f"{100 * r.chip_time[k]:>12.1f}" for k in cats)
            )
        out.append("")
    out += [f"  {k}: {v}" for k, v in CHIP_TIME.items()]
    return "\n".join(out) + "\n"


def plans(result: Result, requested: list[int], slice_chips: int, tolerance: float) -> list[Plan]:
    """``plan.recommend`` at every cluster size, from that size's rows."""
    out = []
    for n in sorted({_nominal(r.chips, requested, slice_chips) for r in result.rows}):
        rows = [r for r in result.rows if _nominal(r.chips, requested, slice_chips) == n]
        out.append(recommend(rows, tolerance))
    return out


def plot(result: Result, requested: list[int], slice_chips: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    labels = list(dict.fromkeys(r.label for r in result.rows))
    for label in labels:
        rows = sorted((r for r in result.rows if r.label == label), key=lambda r: r.chips)
        xs = [_nominal(r.chips, requested, slice_chips) for r in rows]
        (line,) = ax.plot(xs, [100 * r.goodput for r in rows], marker="o", label=label)
        pts = [(x, _published(r.system, x, r.islands, r.min_quorum)) for x, r in zip(xs, rows)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot(*zip(*pts), ls="--", marker="s", mfc="none", color=line.get_color(),
                    label=f"{label} (published)")  # fmt: skip
    ax.set_xscale("log")
    sizes = sorted({_nominal(r.chips, requested, slice_chips) for r in result.rows})
    ax.set_xticks(sizes, [_short(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput %")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Goodput vs cluster size (simulated; same failure trace per size)")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    # A PNG at the very path given: left to its suffix, matplotlib appends ".png" to a
    # path without one and refuses an unknown one after the whole simulation has run.
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def _strict(x):
    """``x`` with every float that JSON cannot hold (``--chip-mtbi-s inf``: no failures)
    as its string, "inf": ``json`` writes ``Infinity``, which JSON parsers refuse."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        p = argparse.ArgumentParser(prog="ds-diloco simulate", description=__doc__)
        add_arguments(p)
        args = p.parse_args(args)
    # Every input is checked before anything is simulated (a sweep can run for minutes).
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)")
    tolerance = None if args.plan is None else args.plan / 100
    if tolerance is not None and not 0 <= tolerance < 1:
        raise ValueError(f"--plan: POINTS must be in [0, 100), got {args.plan:g}")
    islands = args.islands or (list(PAPER_ISLANDS) if args.chips_per_island is None else [])
    try:
        cfg = config_from_args(args)
        if tolerance is not None and "diloco" not in cfg.systems:
            raise ValueError("--plan: recommends Decoupled DiLoCo settings; --systems must "
                             "include diloco")  # fmt: skip
        tasks = sweep_configs(
            cfg, args.chips, islands, chips_per_island=args.chips_per_island,
            quorums=args.min_quorum or (),
        )  # fmt: skip
    except ValueError as e:
        raise flag_names(e) from None
    result = run_configs(tasks, jobs=args.jobs)
    published_diloco = [
        {"chips": n, "islands": m, "goodput": g} for (n, m), g in PUBLISHED_DILOCO.items()
    ]
    doc = _strict({**result.to_dict(), "published": {**PUBLISHED, "diloco": published_diloco}})
    planned = [] if tolerance is None else plans(result, args.chips, cfg.chips_per_slice, tolerance)
    if planned:
        doc["plan"] = [p.to_dict() for p in planned]
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1, allow_nan=False)
        print()
    else:
        print(tables(result, args.chips, cfg.chips_per_slice))
        cpi = args.chips_per_island if "diloco" in cfg.systems else None  # M: DiLoCo's
        if note := sizes_note(args.chips, cfg.chips_per_slice, cpi):
            print(note)
        if args.breakdown or len(args.chips) == 1:
            print(breakdown(result, args.chips, cfg.chips_per_slice))
        for p in planned:
            print(f"plan at {_short(_nominal(p.chips, args.chips, cfg.chips_per_slice))} chips: "
                  f"{p.reason}")  # fmt: skip
        if planned:
            print()
        print(f"{cfg.days:g} simulated days, seed {cfg.seed}, {result.wall_s:.1f}s wall")
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(doc, indent=1, allow_nan=False))
    if args.plot:
        plot(result, args.chips, cfg.chips_per_slice, args.plot)
    return 0
