"""ZeRO-3 shard access on a real two-rank DeepSpeed island (CPU, gloo).

One launch of two worker processes (``tests/dist_worker.py``) runs every
scenario, each on an engine of its own, and saves what each rank saw; the
tests below compare that with whole tensors and with plain Hugging Face models
computed here. The model has odd-sized tensors (hidden 63, MLP 171), so the
last rank's ZeRO-3 partition of those carries a padding element.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from ds_diloco import zero
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.coordinator import Coordinator
from ds_diloco.hf_model import build_model, lm_loss
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.run import free_port
from ds_diloco.server import ServerThread
from ds_diloco.sharding import shard_slice

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
DS_CONFIG = ROOT / "model_configs" / "deepspeed" / "zero3_cpu.json"
WORLD = 2
TIMEOUT_S = 180  # the launch takes 10-25 s on two (busy) cores; this only bounds a hang

ODD_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 63,
    "intermediate_size": 171,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
LR, WEIGHT_DECAY = 1e-2, 0.01
MINMAX = [[3, -1, 7, 0, 2**40, -5], [5, -2, 7, 10, -(2**40), -5]]
FREEZE = ("embed_tokens", r"layers\.0\.")  # the tied embeddings and the first layer


@dataclass
class Island:
    out: Path
    spec: dict
    server: ServerThread
    global0: dict[str, torch.Tensor]  # the coordinator's model before the island started
    problem: str | None  # why the launch failed, with the workers' logs

    def result(self, scenario: str, rank: int) -> dict:
        path = self.out / f"{scenario}-rank{rank}.pt"
        if not path.exists():
            errors = "\n".join(f"{e.name}:\n{e.read_text()}" for e in self.out.glob("*.error"))
            pytest.fail(
                f"no {scenario} result from rank {rank}\n{errors}\n{self.problem or logs(self.out)}"
            )
        return torch.load(path)

    def both(self, scenario: str) -> list[dict]:
        return [self.result(scenario, r) for r in range(WORLD)]


def logs(out: Path, tail: int = 6000) -> str:
    parts = []
    for r in range(WORLD):
        for kind in ("stderr", "stdout"):
            p = out / f"rank{r}.{kind}"
            text = p.read_text(errors="replace") if p.exists() else ""
            parts.append(f"--- rank {r} {kind} (tail) ---\n{text[-tail:]}")
    return "\n".join(parts)


def launch(spec: dict, out: Path, world: int = WORLD) -> str | None:
    """Run every rank to the end; None, or what went wrong with the workers' logs."""
    (out / "spec.json").write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        with open(out / f"rank{rank}.stdout", "w") as o, open(out / f"rank{rank}.stderr", "w") as e:
            cmd = [sys.executable, str(WORKER), str(out / "spec.json"), str(out)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e))
    deadline = time.monotonic() + TIMEOUT_S
    problem = None
    while any(p.poll() is None for p in procs):
        failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            problem = f"ranks {failed} failed" if failed else f"timed out after {TIMEOUT_S} s"
            break
        time.sleep(0.1)
    for p in procs:  # only the workers started above
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    codes = [p.returncode for p in procs]
    if problem or any(codes):
        return f"{problem or 'a rank failed'}; exit codes {codes}\n{logs(out)}"
    return None


@pytest.fixture(scope="module")
def island(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    model_config = out / "odd-llama.json"
    model_config.write_text(json.dumps(ODD_LLAMA))
    pretrained = out / "pretrained"  # a fine-tuning start: a saved HF model, other weights
    build_model(ModelSource(config=str(model_config), seed=77)).save_pretrained(pretrained)
    cfg = CoordinatorConfig(
        model=ModelSource(config=str(model_config), seed=0), state_dir=str(out / "state"),
        num_fragments=2, sync_every=2, policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        token="t",
    )  # fmt: skip
    # A coordinator of its own for the checkpoint scenario: the others' results are read
    # from this one's versions and tensors after every scenario ran.
    other = dataclasses.replace(cfg, state_dir=str(out / "state-ckpt"))
    with ServerThread(cfg) as srv, ServerThread(other) as srv_ckpt:
        spec = {
            "scenarios": [
                "minmax",
                "shards",
                "write",
                "frozen",
                "syncer",
                "pretrained",
                "no_token",
                "unmastered",
                "checkpoint_under_learner",
                "finite",
                "resize_save",
                "checkpointing",
            ],
            "pretrained": str(pretrained),
            "model_config": str(model_config),
            "deepspeed_config": str(DS_CONFIG),
            "vocab": ODD_LLAMA["vocab_size"],
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "minmax": MINMAX,
            "write_seed": 123,
            "freeze": list(FREEZE),
            "write_batch_seed": 5,
            "url": srv.url,
            "token": "t",
            "ckpt_dir": str(out / "ckpt"),
            "ckpt_url": srv_ckpt.url,
            "ckpt_run": srv_ckpt.coord.run_id,
            "steps": 2,
            "resize_dir": str(out / "resize"),
            "out": str(out),
        }
        global0 = srv.coord.global_tensors()
        problem = launch(spec, out)
        yield Island(out, spec, srv, global0, problem)


def plain_model(spec: dict, seed: int = 0, values: dict[str, torch.Tensor] | None = None):
    model = build_model(ModelSource(config=spec["model_config"], seed=seed))
    if values is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(values[n])
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_island_gather_gives_every_rank_all_rows_in_rank_order(island):
    for r, res in enumerate(island.both("minmax")):
        assert res["rows"] == MINMAX, f"rank {r}"
        assert res["rows_group"] == [list(reversed(row)) for row in MINMAX], f"rank {r}"
        # The ranks agree over their own sockets; with those off, a gloo island agrees on its
        # own group.
        assert res["mesh"] == "SocketAgreement" and res["fallback"] is None, res
        assert res["rows_mesh"] == [[[0, k, -k], [1, k, -k]] for k in range(3)], f"rank {r}"
        # The group given is the one gathered on; none given: the default group; the
        # sockets: no all-gather at all.
        assert res["gathered_on"] == ["own", "None"], f"rank {r}: {res['gathered_on']}"


def test_activation_checkpointing_recomputes_the_layers_asked_and_changes_no_value(island):
    # train.activation_checkpointing: 3 steps each, with the same batches, on a ZeRO-3
    # config that releases every parameter after use. A layer whose activations are
    # recomputed runs its submodules twice a step, hooks and all (where ZeRO-3 gathers the
    # parameters again). Frozen parameters too (DeepSpeed issue 4332 failed there).
    for rank, res in enumerate(island.both("checkpointing")):
        for frozen in (False, True):
            off = res[f"frozen={frozen} every=0"]
            assert off["forwards"] == [3, 3], off["forwards"]  # ODD_LLAMA: 2 layers
            for every, forwards in ((1, [6, 6]), (2, [6, 3])):
                on = res[f"frozen={frozen} every={every}"]
                assert on["forwards"] == forwards, (rank, frozen, every, on["forwards"])
                assert on["losses"] == pytest.approx(off["losses"], rel=1e-6), (rank, frozen)
                for n, v in off["reads"].items():
                    assert torch.allclose(on["reads"][n], v, rtol=1e-5, atol=1e-7), (
                        rank, frozen, every, n, max_diff(on["reads"][n], v),
                    )  # fmt: skip
        # The frozen runs trained fewer parameters: a different model, so the check has teeth.
        assert res["frozen=True every=0"]["losses"][2] != res["frozen=False every=0"]["losses"][2]


def test_a_checkpoint_gives_the_islands_place_in_its_data_or_none_from_before_it_was_kept():
    # (step, tokens, micro-batches each rank has read, the island's data walk)
    assert zero._resume_point({"step": 5, "tokens": 9, "batches": 6, "rows": 48}, 2, 1) == (
        5, 9, 12, 48,
    )  # fmt: skip
    assert zero._resume_point({"step": 5, "tokens": 9, "batches": 6}, 2, 4) == (5, 9, 3, None)


def test_freeze_params_refuses_a_pattern_that_matches_nothing_or_everything(tiny_config_path):
    def model():
        return build_model(ModelSource(config=tiny_config_path, seed=0))

    m = model()
    trained = zero.freeze_params(m, FREEZE)
    names = [n for n, _ in m.named_parameters()]
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {n for n in names if any(re.search(f, n) for f in FREEZE)}
    assert frozen and [id(p) for p in trained] == [id(p) for p in m.parameters() if p.requires_grad]
    # A typo would otherwise train everything, silently.
    with pytest.raises(ValueError, match=r"train.freeze: 'embed_token\$' matches no parameter"):
        zero.freeze_params(model(), [r"embed_token$"])
    # The model's head is tied: the pattern that would freeze it is the embedding's.
    with pytest.raises(ValueError, match=r"'lm_head' matches no parameter of the model \(its "
                       r"output layer lm_head is tied to the input embeddings, listed once as "
                       r"'model\.embed_tokens\.weight': freeze that\)"):  # fmt: skip
        zero.freeze_params(model(), ["lm_head"])
    with pytest.raises(ValueError, match=r"freezes every parameter"):
        zero.freeze_params(model(), ["."])


def test_a_rank_alone_agrees_without_a_collective(monkeypatch):
    """An island of one rank: no all-gather (on NCCL it would wait for the GPU's queue)."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "all_gather", None)  # called: a TypeError
    assert zero.island_gather([3, 4]) == [[3, 4]]
    assert zero.agreement_group() is None


def test_read_is_the_ranks_zero3_slice_and_gives_the_shard_pseudo_gradient(island):
    res = island.both("shards")
    for key in ("full0", "full1"):  # the gather itself agrees across ranks
        assert all(torch.equal(res[0][key][n], res[1][key][n]) for n in res[0][key])
    full0, full1 = res[0]["full0"], res[0]["full1"]
    odd = [n for n, t in full0.items() if t.numel() % WORLD]
    assert odd, "the model should have tensors whose last partition is padded"
    for n in full0:
        assert not torch.equal(full0[n], full1[n]), f"{n} did not train: the checks are void"
        for read, full in (("read0", full0), ("read1", full1)):
            flat = full[n].flatten()
            for r in range(WORLD):
                got, want = res[r][read][n], shard_slice(flat, WORLD, r)
                assert torch.equal(got, want), f"{read} {n} rank {r}: {got.shape} vs {want.shape}"
            # Independent of our own arithmetic: the ranks' reads put together are the tensor.
            assert torch.equal(torch.cat([res[r][read][n] for r in range(WORLD)]), flat), n
        whole = (full0[n] - full1[n]).flatten()
        for r in range(WORLD):
            assert torch.equal(res[r]["pseudo"][n], shard_slice(whole, WORLD, r)), f"{n} rank {r}"


def test_written_values_reach_the_forward_pass_and_the_optimizer(island):
    res = island.both("write")
    spec = island.spec
    ids, labels = res[0]["ids"], res[0]["labels"]
    target = plain_model(spec, seed=spec["write_seed"])
    with torch.no_grad():
        ref = target(input_ids=ids).logits
    params = dict(target.named_parameters())
    for r, out in enumerate(res):
        assert torch.equal(out["ids"], ids), "both ranks must use the same batch"
        for n, p in params.items():
            assert torch.equal(out["read_back"][n], shard_slice(p.detach().flatten(), WORLD, r)), n
        # Observed: exactly 0; the tolerance only absorbs thread-count rounding.
        assert max_diff(out["written"], ref) <= 1e-5, f"rank {r}"
        # Why write does three things: the old values differ, and the fp32 master alone (set
        # to zeros, then a flush), or both partitions without a flush, change nothing.
        assert max_diff(out["before"], ref) > 0.1
        assert max_diff(out["master_only"], out["before"]) <= 1e-6, f"rank {r}"
        assert max_diff(out["no_flush"], out["before"]) <= 1e-6, f"rank {r}"
        # The flush after a training step had nothing gathered to release, and the values
        # written then still reached the forward; after a forward it released them.
        assert out["flush_calls_after_step"] == 0, f"rank {r}"
        assert max_diff(out["rewritten"], ref) <= 1e-5, f"rank {r}"
        assert out["flush_calls_gathered"] == 1, f"rank {r}"
        assert max_diff(out["zeroed"], out["rewritten"]) > 0.1, f"rank {r}"

    # The next training step computes its loss on the written values ...
    loss = lm_loss(target, ids, labels)
    for r, out in enumerate(res):
        assert abs(out["loss"] - loss.item()) <= 1e-6, f"rank {r}: {out['loss']} vs {loss.item()}"

    # ... and AdamW continues from them with its kept state: one plain AdamW step from the
    # engine's state, with the config's gradient clipping, lands on the engine's values.
    steps = set(res[0]["adam_step"])
    assert len(steps) == 1 and steps.pop() == 2.0, res[0]["adam_step"]
    opt = torch.optim.AdamW(target.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for n, p in params.items():
        opt.state[p] = {"step": torch.tensor(2.0), **res[0]["adam"][n]}
    loss.backward()
    clip = json.loads(DS_CONFIG.read_text())["gradient_clipping"]
    torch.nn.utils.clip_grad_norm_(target.parameters(), clip)
    opt.step()
    for r, out in enumerate(res):
        for n, p in params.items():
            d = max_diff(out["after_step"][n], p.detach())
            assert d <= 1e-6, f"{n} rank {r}: {d}"


def test_frozen_parameters_take_written_values_and_keep_them_through_a_step(island):
    res = island.both("frozen")
    spec = island.spec
    target = plain_model(spec, seed=spec["write_seed"])
    with torch.no_grad():
        ref = target(input_ids=res[0]["ids"])
    params = dict(target.named_parameters())
    frozen = {n for n in params if any(re.search(f, n) for f in FREEZE)}
    assert frozen and frozen != set(params)
    for r, out in enumerate(res):
        assert {n for n, t in out["trains"].items() if not t} == frozen, f"rank {r}"
        # No fp32 master to write: the compute partition alone carries the written values.
        assert max_diff(out["written"], ref.logits) <= 1e-5, f"rank {r}"
        for n, p in params.items():
            moved = max_diff(out["after_step"][n], p.detach())
            if n in frozen:  # not trained: exactly what was written
                assert moved == 0, f"{n} rank {r}: {moved}"
            else:
                assert moved > 0, f"{n} rank {r}: not trained"
        assert out["finite"] is True


def test_syncer_bootstrap_and_apply_on_a_zero3_island(island):
    res = island.both("syncer")
    spec, coord = island.spec, island.server.coord
    ids = res[0]["ids"]
    with torch.no_grad():
        ref = plain_model(spec, values=island.global0)(input_ids=ids).logits
    for r, out in enumerate(res):
        assert max_diff(out["init"], ref) > 0.1, "the island must start from other values"
        assert out["boot_versions"] == [0, 0], f"rank {r}"
        assert max_diff(out["boot_logits"], ref) <= 1e-5, f"rank {r}"
        for n, t in island.global0.items():
            assert torch.equal(out["boot_full"][n], t), f"bootstrap {n} rank {r}"

    # Step 1 sends fragment 0; its merge is applied at step 1 + tau = 2 on both ranks.
    assert res[0]["applied"] == res[1]["applied"] == [[], [0]]
    assert res[0]["versions"] == res[1]["versions"] == [[0, 0], [1, 0]]
    assert coord.versions()[0] == 1
    now = coord.global_tensors()
    # The island's pseudo-gradient (each rank's slices of base - local) reached the merge: a
    # first Nesterov step with one contribution is global - lr * (1 + momentum) * delta.
    outer = island.server.cfg.outer
    for n in coord.plan.fragments[0].names:
        g0 = island.global0[n]
        want = g0 - outer.lr * (1 + outer.momentum) * (g0 - res[0]["local1"][n])
        assert max_diff(now[n], want) <= 1e-6, n
        assert not torch.equal(now[n], g0), f"{n}: the merge changed nothing"
        for r, out in enumerate(res):
            assert torch.equal(out["full"][n], now[n]), f"{n} rank {r}"
    for out in res:
        assert out["stats"]["uploads"] == 2 and out["stats"]["failed"] == 0, out["stats"]


def test_fine_tuning_starts_from_the_pretrained_folder(island, tmp_path):
    """The coordinator's initial tensors are the checkpoint's, and an island partitioned
    from it (never a full copy per rank) gives the plain HF model's first forward."""
    from transformers import AutoModelForCausalLM

    folder = island.spec["pretrained"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = {n: p.detach() for n, p in model.named_parameters()}
    coord = Coordinator(CoordinatorConfig(model=ModelSource(pretrained=folder),
                                          state_dir=str(tmp_path / "s"), num_fragments=2,
                                          sync_every=2, policy=PolicyOptions(tau=1)))  # fmt: skip
    got = coord.global_tensors()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    for r in island.both("pretrained"):
        assert all(torch.equal(r["full"][n], want[n]) for n in want)
        with torch.no_grad():
            expected = model(input_ids=r["ids"]).logits
        assert torch.allclose(r["logits"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pointer", ["", "step40"])
def test_a_checkpoint_pointer_naming_no_checkpoint_is_refused_with_its_path(tmp_path, pointer):
    # An island killed while DeepSpeed rewrote its 'latest' left it empty, and DeepSpeed's
    # load then failed with a bare AssertionError on every restart (the chaos test).
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(RuntimeError, match=r"latest names no checkpoint"):
        zero.load_checkpoint(None, tmp_path)


def test_a_checkpoint_of_an_island_gone_back_to_an_earlier_step_is_kept(tmp_path, monkeypatch):
    # A resized island whose conversion failed starts over at step 0 beside its checkpoints
    # of steps 4 and 6. Pruned by step number, its step-2 checkpoint was removed as soon as
    # written and `latest` named nothing: every restart and --resume failed.
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: None)

    class Engine:  # writes rank 0's files, as DeepSpeed does
        def save_checkpoint(self, directory, tag, client_state, save_latest):
            (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
            (Path(directory) / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()

    for step in (4, 6, 2, 3):
        zero.save_checkpoint(Engine(), tmp_path, step, {"step": step})
        assert (tmp_path / zero.latest_tag(tmp_path)).is_dir(), zero.latest_tag(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step2", "step3"]


def test_torch_compile_in_the_block_waits_for_the_first_call():
    # What build_engine imports DeepSpeed's Muon optimizer under: its torch.compile at import
    # must not load inductor (seconds of every rank's start-up), and must still compile and
    # compute when called; torch.compile is restored after the block.
    code = """
import sys, torch
from ds_diloco.zero import _compile_on_first_call
real = torch.compile
with _compile_on_first_call():
    @torch.compile(backend="eager")
    def add(x):
        return x + 1
    square = torch.compile(lambda x: x * x, backend="eager")
    import deepspeed.runtime.zero.muon.muon_optimizer
assert torch.compile is real
print("inductor" if "torch._inductor.compile_fx" in sys.modules else "no inductor")
print(add(torch.ones(2)).tolist(), square(torch.full((2,), 3.0)).tolist())
"""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["no inductor", "[2.0, 2.0] [9.0, 9.0]"], out.stdout


def test_a_token_missing_on_one_rank_is_raised_on_every_rank(island):
    # Before, the rank without DS_DILOCO_TOKEN raised alone and the other waited for it in
    # the island's next collective (a hang of the whole island at start-up).
    with_token, without = [r["error"] for r in island.both("no_token")]
    assert without is not None and "DS_DILOCO_TOKEN" in without, without
    assert with_token is not None and "on ranks [1]" in with_token, with_token


def test_a_trained_parameter_the_optimizer_does_not_hold_is_refused_naming_it(island):
    # It requires grad but has no fp32 master: the Learner failed in DeepSpeed with a bare
    # KeyError, after the island had registered.
    for r in island.both("unmastered"):
        assert r["type"] == "SetupError", r
        assert "in no optimizer group" in r["error"] and r["name"] in r["error"], r
    assert "unmastered" not in island.server.coord.status()["islands"]  # it never registered


def test_every_rank_agrees_whether_the_island_model_is_finite(island):
    # Checked before a checkpoint is saved: a diverged state saved there was resumed by
    # every restart, diverging again until max_restarts.
    assert [r["finite"] for r in island.both("finite")] == [[True, False, False]] * 2


def test_a_checkpoint_loaded_under_the_learner_is_refused_on_every_rank(island):
    # Unnoticed, the next upload carried global - checkpoint (a pull back towards an older
    # model), and versions() named what the model no longer held.
    for r in island.both("checkpoint_under_learner"):
        assert r["run"] == island.spec["ckpt_run"] != "", r  # every rank sends the run's id
        back, late = errors = r["errors"]
        assert back is not None and "global_steps went from 3 to 2" in back, errors
        assert late is not None and "global_steps went from 0 to 2" in late, errors
        assert "Load it first" in late, errors


def test_an_island_resized_between_launches_resumes_its_exact_adamw_state(island):
    # Two ranks (frozen layers, a schedule, odd-sized tensors whose last partition is
    # padded) take three steps and checkpoint; the island relaunched on one rank loads that
    # checkpoint through DeepSpeed's universal format. Before, it started from step 0 with
    # fresh AdamW state.
    saved = island.result("resize_save", 0)
    out = island.out / "resized"
    out.mkdir()
    # The two ranks were killed while saving step 4: rank 1's files are there, one of them
    # cut short. The one-rank launch saves its own step 4 in that folder.
    ckpt = Path(island.spec["resize_dir"])
    (ckpt / "step4").mkdir()
    shutil.copy(ckpt / "step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt", ckpt / "step4")
    (ckpt / "step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    problem = launch({**island.spec, "scenarios": ["resize_load"]}, out, world=1)
    assert problem is None, problem
    loaded = torch.load(out / "resize_load-rank0.pt")
    # Step, tokens, the 2 x 3 micro-batches, and the island's place in its data walk.
    assert loaded["resumed"] == (3, 3 * 2 * 2 * 16, 6, 3 * 2 * 2)
    assert loaded["adam_step"] == saved["adam_step"] == 3.0
    assert loaded["lr"] == saved["lr"] == pytest.approx(LR * 0.4)  # (3 + 1) / 10
    assert saved["whole"].keys() == loaded["whole"].keys()
    assert not any(re.search(p, n) for p in FREEZE for n in saved["whole"])  # trained ones only
    for name, (values, m, v) in saved["whole"].items():
        assert v.abs().sum() > 0, name  # the moments are not just fresh zeros
        for what, a, b in zip(
            ("fp32", "exp_avg", "exp_avg_sq"), (values, m, v), loaded["whole"][name]
        ):
            assert torch.equal(a, b), (name, what, max_diff(a, b))
    # Its next checkpoint makes the converted one stale: removed.
    assert {"latest", "step3", "step4"} <= set(loaded["after"]), loaded["after"]
    assert "universal" not in loaded["after"], loaded["after"]
    # Only the one rank's files are in it, and it converts for a launch resized again (before,
    # DeepSpeed read the dead rank's file too: "EOFError: Ran out of input").
    assert sorted(p.name for p in (ckpt / "step4").iterdir()) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ]  # fmt: skip
    target = island.out / "resized-universal" / "step4"
    assert zero._convert_to_universal(ckpt / "step4", target, 600.0) is None
    assert (target / "zero").is_dir()


def test_a_run_resumed_with_another_learning_rate_trains_on_with_it(tmp_path, tiny_config_path):
    # Saved at lr 1e-2 and weight decay 0.01, loaded by an engine built with 4e-3 and 0.1:
    # DeepSpeed put the checkpoint's back (the optimizer's groups, the schedule's base
    # rate), and the resumed run trained on with those, saying nothing. The schedule's
    # position is the checkpoint's: step 3 of (step + 1) / 10. One saved without a schedule
    # and resumed with one failed to load on every launch (DeepSpeed: "'NoneType' object
    # has no attribute 'pop'").
    spec = {"scenarios": ["retuned_resume"], "model_config": tiny_config_path,
            "deepspeed_config": str(DS_CONFIG), "vocab": 512, "out": str(tmp_path)}  # fmt: skip
    problem = launch(spec, tmp_path, world=1)
    assert problem is None, problem
    got = torch.load(tmp_path / "retuned_resume-rank0.pt")
    cases = ("constant", "scheduled", "schedule added")
    assert [got[case]["resumed"][0] for case in cases] == [3, 3, 3]
    assert got["constant"]["loaded"] == [(4e-3, 0.1)], got["constant"]
    assert got["constant"]["next_lr"] == 4e-3
    for case in cases[1:]:
        assert got[case]["loaded"] == [(pytest.approx(4e-3 * 0.4), 0.1)], (case, got[case])
        assert got[case]["next_lr"] == pytest.approx(4e-3 * 0.5), (case, got[case])


def test_a_run_resumed_with_other_frozen_parameters_is_refused_naming_the_change(
    tmp_path, tiny_config_path
):
    # train.freeze edited for a resumed run: the checkpoint's AdamW state is one flat
    # partition of other parameters, and DeepSpeed failed on every launch with a bare
    # KeyError: 'model.layers.0.self_attn.q_proj.weight'.
    spec = {"scenarios": ["retuned_resume"], "model_config": tiny_config_path,
            "deepspeed_config": str(DS_CONFIG), "vocab": 512, "out": str(tmp_path)}  # fmt: skip
    problem = launch(spec, tmp_path, world=1)
    assert problem is None, problem
    refused = torch.load(tmp_path / "retuned_resume-rank0.pt")["refrozen"]
    assert (
        refused is not None
        and "trained other parameters than this island (here 0 more, " in refused
    )
    assert "train.freeze changed since it was saved" in refused, refused


def test_a_checkpoint_that_cannot_be_converted_says_why_and_leaves_no_folder(island, tmp_path):
    # A resized island whose checkpoint DeepSpeed cannot convert starts from the global
    # model (zero._load_resized) and names the cause; nothing half-written is left to be
    # taken for a converted checkpoint by the next launch. The two-rank checkpoint of the
    # resize scenario, rank 1's optimizer file spoilt: rank 0's part is converted first.
    source = tmp_path / "step3"
    shutil.copytree(Path(island.spec["resize_dir"]) / "step3", source)
    (source / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"not a checkpoint")
    target = tmp_path / zero.UNIVERSAL / "step3"
    problem = zero._convert_to_universal(source, target, 600.0)
    assert problem is not None and problem.startswith(
        "its conversion to DeepSpeed's universal format failed (exit 1: "
    ), problem
    assert not target.exists() and list(target.parent.iterdir()) == []
    # One that takes longer than train.convert_timeout_s is given up, killed, nothing left
    # (its imports alone take longer than 0.5 s).
    shutil.copytree(Path(island.spec["resize_dir"]) / "step3", source, dirs_exist_ok=True)
    t0 = time.monotonic()
    problem = zero._convert_to_universal(source, target, 0.5)
    assert problem == (
        "its conversion to DeepSpeed's universal format took over 0.5 s (train.convert_timeout_s)"
    ), problem
    assert time.monotonic() - t0 < 30 and list(target.parent.iterdir()) == []
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if str(source) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert left == [], left  # it and any worker it started are gone


_TREE = """
import subprocess, sys, time
depth = int(sys.argv[1])
if depth:  # two children, each with a tree of its own below
    kids = [subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth - 1), sys.argv[2]])
            for _ in range(2)]
print("up", flush=True)
time.sleep(600)
"""


def test_a_conversion_given_up_is_killed_with_every_process_it_started():
    # ds_to_universal runs worker pools: given up (train.convert_timeout_s), the conversion's
    # process and all its descendants go, or the pools would go on writing the folder.
    root = subprocess.Popen([sys.executable, "-c", _TREE, "2", _TREE], stdout=subprocess.PIPE)
    proc = psutil.Process(root.pid)
    deadline = time.monotonic() + 60
    while len(proc.children(recursive=True)) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = [proc, *proc.children(recursive=True)]

    def alive(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    try:
        assert len(tree) == 7, tree  # the root, 2 children, 4 grandchildren
        zero._kill_tree(root.pid)
        root.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(map(alive, tree)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p.pid for p in tree if alive(p)] == []
    finally:  # none left running if it failed
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        root.wait(timeout=30)


_SLOW_CONVERTER = """
import datetime, json, sys, time
from pathlib import Path
import torch.distributed as dist
from ds_diloco import zero

rank, folder = int(sys.argv[1]), Path(sys.argv[2])
# Both ranks at the rendezvous together: its timeout is the group's 2 s too, and a loaded
# machine can finish one rank's imports seconds after the other's ("waiting for clients").
(folder / f"ready{rank}").touch()
while not (folder / f"ready{1 - rank}").exists():
    time.sleep(0.01)
# The process group's timeout, 30 min in an island, made 2 s: rank 0's conversion takes longer.
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
real = zero._convert_to_universal
def slow(*args):
    time.sleep(5)  # a large model's checkpoint, read and written whole
    return real(*args)
zero._convert_to_universal = slow
t0 = time.monotonic()
problem = zero.converted_everywhere(folder / "step3", folder / "universal" / "step3", 600.0)
print(json.dumps({"problem": problem, "waited_s": time.monotonic() - t0}))
"""


def test_the_other_ranks_wait_for_a_conversion_longer_than_their_process_groups_timeout(tmp_path):
    # Rank 0 converts a resized island's checkpoint while the others wait. They waited in a
    # gather on the process group, which ended at its timeout (30 min): the island was
    # relaunched and the conversion began again, on every relaunch. Here the checkpoint is
    # not one (rank 0's conversion fails after the wait): every rank gets its reason.
    (tmp_path / "step3").mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen([sys.executable, "-c", _SLOW_CONVERTER, str(rank), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank in range(2)
    ]  # fmt: skip
    got = [(p.wait(timeout=TIMEOUT_S), *p.communicate()) for p in procs]
    assert [rc for rc, _, _ in got] == [0, 0], [err[-2000:] for _, _, err in got]
    rows = [json.loads(out.splitlines()[-1]) for _, out, _ in got]
    assert rows[1]["waited_s"] > 4.5, rows  # past the 2 s timeout
    assert rows[0]["problem"] == rows[1]["problem"], rows
    assert rows[0]["problem"].startswith("its conversion to DeepSpeed's universal format failed")
