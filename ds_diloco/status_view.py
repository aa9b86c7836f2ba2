"""``ds-diloco status URL``: a running coordinator's ``/v1/status``, as an operator reads it.

The coordinator's JSON has everything (islands, versions, open rounds, the last merge
and merge failure, goodput); this turns it into a few lines and a table, the view a
multi-node run has no other way to show (``ds-diloco run`` prints its own progress).
``render`` is a pure function of the status document, so tests feed it real ones.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ds_diloco.config import TOKEN_ENV


class StatusError(ValueError):
    """The answer is not a coordinator's status document."""


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def traffic_text(traffic: dict) -> str:
    """The coordinator's ``traffic`` counters (``/v1/status``) in a line's words."""
    text = (
        f"uploads {_mb(traffic['upload_bytes'])} in, downloads {_mb(traffic['download_bytes'])} out"
    )
    if traffic["unchanged_bytes"]:
        text += f" ({_mb(traffic['unchanged_bytes'])} of unchanged frozen slices left out)"
    return text


def process_text(process: dict, now: float | None = None) -> str:
    """The coordinator process's own figures (``metrics.process_stats``): what to watch
    over a long run (a memory that only grows, descriptors running out)."""
    up = max(0.0, (time.time() if now is None else now) - process["start_time_seconds"])
    h, m = divmod(int(up) // 60, 60)
    fds = process.get("open_fds")
    files = "" if fds is None else f", {fds} open files" + (
        f" of {process['max_fds']}" if "max_fds" in process else "")  # fmt: skip
    return (f"{_mb(process['resident_memory_bytes'])} resident, "
            f"{process['cpu_seconds_total']:,.1f} s CPU{files}, up {h}h{m:02d}m")  # fmt: skip


def _range(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _state(isl: dict) -> str:
    if isl["left"]:
        return "left"
    if isl["finishing"]:
        return "finishing"  # final flush sent: no round waits for it
    return "live" if isl["live"] else "silent"  # lease lapsed: rounds no longer wait


def render(st: dict, url: str = "") -> str:
    """The status document ``st`` (``GET /v1/status``) as text. StatusError if it lacks
    what a coordinator sends."""
    try:
        return _render(st, url)
    except (KeyError, TypeError, ValueError) as e:
        raise StatusError(f"not a coordinator status document ({type(e).__name__}: {e})") from None


def _render(st: dict, url: str) -> str:
    versions, merges, failures = st["versions"], st["merges"], st["merge_failures"]
    run = st["run"]
    head = f"coordinator {url}  " if url else ""
    quorums = sorted(run["by_quorum"].items(), key=_int_key)
    sizes = ", ".join(f"{k}: {v}" for k, v in quorums) or "-"
    out = [
        f"{head}fragments {st['num_fragments']}  versions {_range(versions)}  "
        f"merges {sum(merges)} ({_range(merges)} per fragment, {sum(failures)} failed)",
        f"goodput {_pct(run['goodput'])}  uptime {_pct(run['uptime'])} "
        f"({run['uptime_window_s']:g} s windows)  merges by islands in them: {sizes}",
    ]
    traffic = st.get("traffic")  # not from a coordinator before this field
    if traffic:
        out.append(f"traffic since the coordinator started: {traffic_text(traffic)}")
    buffers = st.get("buffers")  # not from a coordinator before this field
    if buffers:
        out.append(f"fragment buffers: {buffers['held']} ({_mb(buffers['bytes'])}; values, "
                   f"rows, merges), {buffers['in_use']} in use")  # fmt: skip
    process = st.get("process")  # not from a coordinator before this field
    if process:
        out.append(f"coordinator process: {process_text(process)}")
    islands = st["islands"]
    if islands:
        cols = ("island", "ranks", "state", "step", "step time", "merged", "dropped",
                "steps merged", "steps dropped", "tokens merged", "last seen")  # fmt: skip
        rows = [
            (name, str(i["world_size"]), _state(i), str(i["last_step"]),
             "-" if i["step_time_s"] is None else f"{i['step_time_s']:.3f} s",
             str(i["merged"]), str(i["dropped"]), str(i["steps_merged"]),
             str(i["steps_dropped"]), f"{i['tokens_merged']:,}", f"{i['last_seen_s']:.1f} s ago")
            for name, i in sorted(islands.items())
        ]  # fmt: skip
        widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(cols)]
        out.append("")
        for r in (cols, *rows):  # names left, numbers right
            out.append("  ".join(
                v.ljust(w) if k in (0, 2) else v.rjust(w) for k, (v, w) in enumerate(zip(r, widths))
            ).rstrip())  # fmt: skip
    else:
        out.append("no island has registered")
    pending = st["pending"]
    if pending:
        out.append("")
        for frag, p in sorted(pending.items(), key=_int_key):
            parts = [f"complete: {', '.join(p['complete'])}"] if p["complete"] else []
            parts += [
                f"{name} has ranks {ranks}" for name, ranks in sorted(p["assembling"].items())
            ]
            parts += [  # (absent from coordinators before it)
                f"{name} is sending ranks {ranks}"
                for name, ranks in sorted(p.get("receiving", {}).items())
            ]
            out.append(f"round open, fragment {frag}: " + "; ".join(parts))
    failures_now = st["last_merge_failure"]
    for frag, f in sorted(failures_now.items(), key=_int_key):
        out.append(f"last merge failure, fragment {frag} (version {f['version']}, "
                   f"{f['in_a_row']} in a row): {f['error']}")  # fmt: skip
    return "\n".join(out)


def _int_key(item) -> int:
    return int(item[0])


def resolve_token(args, url: str) -> str:
    """The bearer token for ``url`` from ``--token``, ``--token-file`` or $DS_DILOCO_TOKEN."""
    import os

    token = args.token or _token_file(args.token_file) or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"no bearer token for {url}: pass --token or --token-file, "
                         f"or set ${TOKEN_ENV}")  # fmt: skip
    return token


def _token_file(path: str | None) -> str | None:
    """The token in ``path`` (a run's or a standalone coordinator's ``state_dir/token``)."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"--token-file {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"--token-file {path}: the file is empty")
    return token


def main(args) -> int:
    """``ds-diloco status``: print the view (or the JSON) once, or every ``--watch`` seconds
    (an unanswered poll is a line, and the watch goes on)."""
    from ds_diloco.client import TRANSPORT_ERRORS, CoordinatorClient, RefusedError

    token = resolve_token(args, args.url)
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch must be > 0 seconds, got {args.watch}")
    client = CoordinatorClient(args.url, token, retries=1, timeout_s=10, ca_file=args.ca_file)
    try:
        while True:
            try:
                try:
                    st = client.status()
                except json.JSONDecodeError as e:  # a proxy's page, say: ended the watch
                    raise StatusError(f"the answer is not JSON ({e})") from None
                text = json.dumps(st, indent=1) if args.json else render(st, client.url)
            except RefusedError as e:  # a wrong token: no use asking again
                raise ValueError(f"{client.url} refused: {e.message}") from None
            except (*TRANSPORT_ERRORS, StatusError) as e:
                problem = f"no status from {client.url}: {e}"
                if args.watch is None:
                    raise ValueError(problem) from None
                text = problem
            if args.watch is not None:
                print(time.strftime("--- %Y-%m-%d %H:%M:%S"))
            print(text)
            sys.stdout.flush()
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:  # the way a watch ends
        return 0
    finally:
        client.close()
