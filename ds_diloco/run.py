"""``ds-diloco run FILE``: a whole run on this machine.

Starts the coordinator (``ds-diloco coordinator``) and every island through the
deepspeed launcher (each island its own process group and master port), shows
progress, stops everything cleanly on Ctrl-C, and at the end exports the merged
model and compares it with the initial one on held-out text.

Layout of the run's workdir::

    coordinator.json      the coordinator's config, as started
    state/                the coordinator's durable state
    islands/<name>/       island.json, log.txt, progress.jsonl, summary-rank<r>.json
    export/               the merged model as a Hugging Face folder
    summary.json          what the run did
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from ds_diloco.client import CoordinatorClient
from ds_diloco.config import TOKEN_ENV, IslandConfig, RunConfig

PROGRESS_EVERY_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(token: str) -> dict:
    env = {**os.environ, TOKEN_ENV: token, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")  # one core per rank; the launcher does not set it
    return env


def plain_dict(obj) -> dict:
    """A config dataclass as a dict for JSON, unset (None) fields left out."""
    return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None}


class LocalRun:
    def __init__(self, cfg: RunConfig, fresh: bool = True):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir)
        if fresh:  # a run starts from the initial model; keep the corpus cache
            shutil.rmtree(self.workdir / "state", ignore_errors=True)
            shutil.rmtree(self.workdir / "islands", ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token = cfg.coordinator.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        self.env = _env(self.token)
        self.coordinator: subprocess.Popen | None = None
        self.islands: dict[str, subprocess.Popen] = {}
        self.url = ""

    # ------------------------------------------------------------ processes
    def start_coordinator(self) -> CoordinatorClient:
        c = self.cfg.coordinator
        # A restarted coordinator must come back where the islands look for it.
        port = self._port = getattr(self, "_port", None) or c.port or free_port()
        coord = {**plain_dict(c), "port": port, "token": None}
        coord.pop("token")
        path = self.workdir / "coordinator.json"
        path.write_text(json.dumps(coord, indent=1))
        log = (self.workdir / "coordinator.log").open("w")
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "ds_diloco.cli", "coordinator", "--config", str(path)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        host = "127.0.0.1" if c.host in ("0.0.0.0", "") else c.host
        self.url = f"http://{host}:{port}"
        client = CoordinatorClient(self.url, self.token, retries=0, timeout_s=10)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"coordinator exited: see {self.workdir / 'coordinator.log'}")
            try:
                client.health()
                return client
            except Exception:
                time.sleep(0.2)
        raise RuntimeError("coordinator did not come up within 120 s")

    def start_islands(self) -> None:
        for shard, spec in enumerate(self.cfg.islands):
            self.start_island(spec, shard, len(self.cfg.islands))

    def start_island(self, spec, shard: int, num_shards: int, plain: bool = False):
        """One island through the deepspeed launcher, in its own process group.

        ``plain`` runs the same job as plain ZeRO-3, without the coordinator (benchmarks).
        """
        d = self.workdir / "islands" / spec.name
        d.mkdir(parents=True, exist_ok=True)
        icfg = IslandConfig(
            island=spec.name, coordinator_url=self.url or "http://127.0.0.1:9",
            model=self.cfg.model, deepspeed_config=self.cfg.deepspeed_config,
            data=self.cfg.data, train=self.cfg.train, shard=shard, num_shards=num_shards,
            workdir=str(d),
        )  # fmt: skip
        (d / "island.json").write_text(json.dumps(plain_dict(icfg), indent=1))
        port = spec.master_port or free_port()
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port)]
        cmd += ["--include", spec.include] if spec.include else ["--num_gpus", str(spec.world_size)]
        cmd += ["--module", "ds_diloco.cli", "island", *(["--plain"] if plain else [])]
        cmd += ["--config", str(d / "island.json")]
        with (d / "log.txt").open("w") as log:
            proc = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.islands[spec.name] = proc
        return proc

    def stop(self) -> None:
        """Islands first (their process groups), then the coordinator, which saves."""
        for p in self.islands.values():
            _signal_group(p, signal.SIGTERM)
        for p in self.islands.values():
            _wait(p, 30)
        if self.coordinator is not None:
            _signal_group(self.coordinator, signal.SIGTERM)
            _wait(self.coordinator, 60)

    # ------------------------------------------------------------- progress
    def island_records(self) -> dict[str, dict]:
        out = {}
        for spec in self.cfg.islands:
            path = self.workdir / "islands" / spec.name / "progress.jsonl"
            if path.exists():
                lines = path.read_text().splitlines()
                if lines:
                    out[spec.name] = json.loads(lines[-1])
        return out

    def progress_line(self, client: CoordinatorClient) -> str:
        cells = []
        for name, r in sorted(self.island_records().items()):
            if r.get("done"):
                cells.append(f"{name}: done ({r['steps']} steps)")
            else:
                cells.append(
                    f"{name}: step {r['step']} loss {r.get('loss', float('nan')):.3f} tok {r.get('tokens', 0)}"
                )
        try:
            st = client.status()
            v, m = st["versions"], st["merges"]
            coord = (
                f"versions {min(v)}..{max(v)}  merges/fragment {min(m)}..{max(m)} (total {sum(m)})"
            )
        except Exception as e:  # the coordinator may be restarting
            coord = f"coordinator unreachable ({type(e).__name__})"
        return f"[{' | '.join(cells) or 'starting'}]  {coord}"


def _signal_group(p: subprocess.Popen, sig) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)


def _wait(p: subprocess.Popen, timeout: float) -> None:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(p, signal.SIGKILL)
        p.wait(timeout=10)


def evaluate(cfg: RunConfig, export_dir: Path | None, heldout: torch.Tensor) -> dict:
    """Held-out loss of the initial and the merged model, and a sample from the merged one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_diloco.hf_model import build_model, lm_loss

    @torch.no_grad()
    def loss_of(model) -> float:
        model.eval()
        losses = [lm_loss(model, b[:, :-1], b[:, 1:]).item() for b in heldout.split(8)]
        return sum(losses) / len(losses)

    out = {"heldout_loss_initial": loss_of(build_model(cfg.model))}
    if export_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        out["heldout_loss_merged"] = loss_of(model)
        tok = AutoTokenizer.from_pretrained(export_dir)
        ids = tok(cfg.prompt, return_tensors="pt").input_ids
        torch.manual_seed(0)
        gen = model.generate(ids, max_new_tokens=60, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        out["sample"] = tok.decode(gen[0], skip_special_tokens=True)
    return out


def run(cfg: RunConfig) -> int:
    from ds_diloco.data import heldout_split, prepare_corpus, tokenizer_dir
    from ds_diloco.export import export_model, load_global_tensors

    lr = LocalRun(cfg)
    d = cfg.data
    print(f"preparing data from {d.path} ...", flush=True)
    _, blocks = prepare_corpus(d.path, d.cache_dir, d.vocab_size, d.seq_len, tokenizer=d.tokenizer,
                               text_field=d.text_field)  # fmt: skip
    _, heldout = heldout_split(blocks, d.heldout_fraction, seed=d.seed)
    heldout = heldout[:64]
    t0 = time.monotonic()
    code = 0
    try:
        client = lr.start_coordinator()
        print(f"coordinator at {lr.url} (state {cfg.coordinator.state_dir})", flush=True)
        lr.start_islands()
        sizes = ", ".join(f"{s.name} x{s.world_size}" for s in cfg.islands)
        print(f"islands: {sizes}; logs in {lr.workdir / 'islands'}", flush=True)
        next_print = time.monotonic()
        while any(p.poll() is None for p in lr.islands.values()):
            if time.monotonic() >= next_print:
                print(lr.progress_line(client), flush=True)
                next_print += PROGRESS_EVERY_S
            time.sleep(0.2)
        print(lr.progress_line(client), flush=True)
        failed = {n: p.returncode for n, p in lr.islands.items() if p.returncode != 0}
        if failed:
            print(f"islands failed: {failed} (see their log.txt)", flush=True)
            code = 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping islands and coordinator ...", flush=True)
        code = 130
    finally:
        lr.stop()
    wall = time.monotonic() - t0
    summary = {"wall_s": round(wall, 1), "islands": {}, "exit": code}
    for spec in cfg.islands:
        path = lr.workdir / "islands" / spec.name / "summary-rank0.json"
        if path.exists():
            summary["islands"][spec.name] = json.loads(path.read_text())
    state = json.loads((Path(cfg.coordinator.state_dir) / "coordinator.json").read_text())
    summary["merges"] = state["merges"]
    export_dir = None
    if cfg.export and code == 0:
        config, tensors = load_global_tensors(cfg.coordinator.state_dir)
        tok = d.tokenizer or str(tokenizer_dir(d.cache_dir, d.path, d.vocab_size))
        export_dir = Path(export_model(config, tensors, lr.workdir / "export", tokenizer=tok))
        summary["export"] = str(export_dir)
    if code == 0:
        summary.update(evaluate(cfg, export_dir, heldout))
    (lr.workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    _print_summary(summary)
    return code


def _print_summary(s: dict) -> None:
    toks = sum(i.get("tokens", 0) for i in s["islands"].values())
    print(f"\nrun finished in {s['wall_s']} s: {toks} tokens over {len(s['islands'])} islands; "
          f"merges per fragment {s['merges']}")  # fmt: skip
    for name, i in s["islands"].items():
        print(f"  {name}: {i['steps']} steps, {i['tokens']} tokens, sync time {i['sync_s']} s "
              f"(max {i['sync_max_s']} s per step), uploads {i['stats']['uploads']}, "
              f"dropped {i['stats']['dropped']}, failed {i['stats']['failed']}")  # fmt: skip
    if "heldout_loss_initial" in s:
        line = f"held-out loss: initial {s['heldout_loss_initial']:.3f}"
        if "heldout_loss_merged" in s:
            line += f" -> merged {s['heldout_loss_merged']:.3f}"
        print(line)
    if "export" in s:
        print(f"merged model: {s['export']} (AutoModelForCausalLM.from_pretrained loads it)")
    if "sample" in s:
        print(f"sample: {s['sample']!r}")
