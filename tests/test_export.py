"""Export: the coordinator's global model, from its URL or its state directory,
as a Hugging Face folder that ``from_pretrained`` loads with the same logits.

One coordinator (a real HF tiny Llama, tied embeddings) serves the module; an
island merges a pseudo-gradient into every fragment first, so the global model
is no longer the initial one and every fragment is at version 1.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_LLAMA
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ds_diloco import cli, wire
from ds_diloco.client import CoordinatorClient, rank_slices
from ds_diloco.config import TOKEN_ENV, CoordinatorConfig, ModelSource
from ds_diloco.data import train_tokenizer
from ds_diloco.export import (
    export,
    export_model,
    global_model,
    load_global,
    load_global_tensors,
    replacing_folder,
)
from ds_diloco.fragments import FragmentPlan
from ds_diloco.model_card import IslandSummary, RunSummary, load_run_summary
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions
from ds_diloco.server import ServerThread

TOKEN = "export-token"
SONNETS = Path(__file__).parent / "data" / "sonnets.txt"
IDS = torch.tensor([[1, 5, 77, 300, 42, 9, 511, 3]])


def make_cfg(config_path, state_dir) -> CoordinatorConfig:
    return CoordinatorConfig(
        model=ModelSource(config=str(config_path), seed=0),
        state_dir=str(state_dir),
        num_fragments=4,
        sync_every=4,
        policy=PolicyOptions(min_quorum=1, grace_gamma=0.0, tau=1),
        outer=OuterOptimConfig(name="nesterov", lr=0.7, momentum=0.9),
        token=TOKEN,
    )


def merge_one_round(srv: ServerThread) -> None:
    """Island 'a' (2 ranks) uploads a random pseudo-gradient of every fragment; wait for v1."""
    client = CoordinatorClient(srv.url, TOKEN, retries=0)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    client.register("a", 2, plan.signature)
    g = torch.Generator().manual_seed(1)
    deltas = {s.name: 0.01 * torch.randn(s.shape, generator=g) for s in plan.specs}
    for frag in plan.fragments:
        for rank in range(2):
            header = wire.UploadHeader(
                island="a", rank=rank, world_size=2, fragment=frag.index, base_version=0,
                step=1, tokens=64, steps=1,
            )  # fmt: skip
            assert client.upload(header, rank_slices(frag, deltas, 2, rank))["status"] == "accepted"
    deadline = time.monotonic() + 20
    while client.versions() != [1] * len(plan):
        assert time.monotonic() < deadline, f"versions stuck at {client.versions()}"
        time.sleep(0.02)
    srv.coord.save()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    config_path = tmp / "tiny-llama.json"
    config_path.write_text(json.dumps(TINY_LLAMA))
    srv = ServerThread(make_cfg(config_path, tmp / "state"))
    srv.config_path = config_path
    srv.state_dir = tmp / "state"
    merge_one_round(srv)
    yield srv
    srv.stop()


def reference_model(config_path, tensors: dict[str, torch.Tensor]):
    """A plain model built from the config that holds ``tensors``."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_path)))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the input embedding
    return model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def assert_same_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


# --------------------------------------------------------------- reading the global model
def test_state_dir_and_url_give_the_global_tensors(served, monkeypatch):
    want = served.coord.global_tensors()
    initial = dict(
        AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(served.config_path)
        ).named_parameters()
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(want[name], initial[name].detach())  # the merge changed it

    from_dir = load_global(served.state_dir)
    from_url = load_global(served.url, token=TOKEN)
    assert from_dir.versions == from_url.versions == [1, 1, 1, 1]
    assert from_dir.signature == from_url.signature == served.coord.plan.signature
    assert_same_tensors(from_dir.tensors, want)
    assert_same_tensors(from_url.tensors, want)
    assert list(from_dir.tensors) == [s.name for s in served.coord.plan.specs]  # model order
    saved_config = json.loads((served.state_dir / "model" / "config.json").read_text())
    assert from_dir.config == from_url.config == saved_config
    # The generation config too (a pretrained start's end-of-sequence tokens, sampling
    # defaults): the URL export used to derive one from config.json instead.
    gen_path = served.state_dir / "model" / "generation_config.json"
    gen = {**json.loads(gen_path.read_text()), "eos_token_id": [2, 7], "temperature": 0.6}
    saved_gen = gen_path.read_text()
    try:
        gen_path.write_text(json.dumps(gen))
        assert load_global(served.url, token=TOKEN).generation_config == gen
        assert load_global(served.state_dir).generation_config == gen
        gen_path.unlink()  # a state directory without one: both say so the same way
        assert load_global(served.url, token=TOKEN).generation_config is None
        assert load_global(served.state_dir).generation_config is None
    finally:
        gen_path.write_text(saved_gen)

    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the token may come from the environment
    config, tensors = load_global_tensors(served.url)
    assert config == saved_config
    assert_same_tensors(tensors, want)


# --------------------------------------------------------------- writing the HF folder
def test_export_loads_with_the_logits_of_the_global_model(served, tmp_path):
    config, tensors = load_global_tensors(served.state_dir)
    out = export_model(config, tensors, tmp_path / "hf")
    assert Path(out) == tmp_path / "hf"
    files = sorted(p.name for p in Path(out).iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    want = served.coord.global_tensors()
    assert torch.equal(logits(loaded), logits(reference_model(served.config_path, want)))
    gen = json.loads((Path(out) / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_is_right_tied_or_not(tmp_path, tied):
    config = {**TINY_LLAMA, "tie_word_embeddings": tied}
    (tmp_path / "c.json").write_text(json.dumps(config))
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "c.json"))
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert ("lm_head.weight" in tensors) is not tied  # named_parameters lists a tie once
    loaded = AutoModelForCausalLM.from_pretrained(export_model(config, tensors, tmp_path / "o"))
    head = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(loaded.lm_head.weight, head)
    assert torch.equal(logits(loaded.eval()), logits(model.eval()))


def test_models_built_in_threads_at_once_keep_their_tie(tmp_path):
    # A run's periodic export and evaluation build models in two threads at the same time;
    # accelerate's init_empty_weights patches torch.nn.Module process-wide while it is open,
    # and one of them came out with its head apart ("missing ['lm_head.weight']").
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    errors, tied = [], []

    def build():
        try:
            for _ in range(3):
                m = global_model(TINY_LLAMA, tensors)
                tied.append(m.lm_head.weight is m.model.embed_tokens.weight)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and tied == [True] * 18, (errors, tied)


def test_sharded_export_has_an_index_and_loads_the_same(served, tmp_path):
    config, tensors = load_global_tensors(served.state_dir)
    whole = logits(
        AutoModelForCausalLM.from_pretrained(export_model(config, tensors, tmp_path / "a"))
    )
    out = Path(export_model(config, tensors, tmp_path / "b", max_shard_size="100KB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(tensors)  # the tied head is not stored twice
    assert {out / f for f in index["weight_map"].values()} == set(shards)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out).eval()), whole)


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16"])
def test_bf16_export(served, tmp_path, dtype):
    config, tensors = load_global_tensors(served.state_dir)
    out = export_model(config, tensors, tmp_path / "hf", dtype=dtype)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded.get_parameter(name), tensors[name].to(torch.bfloat16))


def test_fp16_export_refuses_values_beyond_its_range(served, tmp_path):
    # float16 tops out at 65504: a larger weight was saved as inf, without a word.
    config, tensors = load_global_tensors(served.state_dir)
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6
    with pytest.raises(ValueError, match=r"up_proj\.weight' holds values up to 1e\+06"):
        export_model(config, tensors, tmp_path / "hf", dtype="float16")
    assert not (tmp_path / "hf").exists()
    out = export_model(config, tensors, tmp_path / "hf", dtype="bfloat16")  # in its range
    assert torch.isfinite(AutoModelForCausalLM.from_pretrained(out).lm_head.weight).all()


def test_tokenizer_is_saved_with_the_model(served, tmp_path):
    tok = train_tokenizer([SONNETS], 384, tmp_path / "tok")
    config, tensors = load_global_tensors(served.state_dir)
    out = export_model(config, tensors, tmp_path / "hf", tokenizer=tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(out)
    text = "Shall I compare thee to a summer's day?"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<s>", "</s>")
    ids = torch.tensor([loaded(text)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model(ids).logits.shape == (1, ids.shape[1], TINY_LLAMA["vocab_size"])


def test_exporting_again_replaces_the_earlier_export_whole(served, tmp_path):
    # Saving into the old folder would leave its files: an old model.safetensors next to
    # a new sharded index is what from_pretrained loads, an old tokenizer what
    # AutoTokenizer loads. Measured before the fix: the earlier bf16 weights came back.
    train_tokenizer([SONNETS], 384, tmp_path / "tok")
    config, tensors = load_global_tensors(served.state_dir)
    out = tmp_path / "hf"
    export_model(config, tensors, out, tokenizer=tmp_path / "tok", dtype="bfloat16")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    newer = {n: t + 0.25 for n, t in tensors.items()}
    export_model(config, newer, out, max_shard_size="100KB")  # sharded, fp32, no tokenizer
    assert not (out / "model.safetensors").exists() and not (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    name = "model.layers.1.mlp.up_proj.weight"
    assert loaded.dtype == torch.float32 and torch.equal(loaded.get_parameter(name), newer[name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tok"]  # nothing left beside

    # An export that fails leaves the earlier one as it was.
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="shape"):
        export_model(config, {**tensors, name: tensors[name][:1]}, out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tok"]


CRASH_MID_EXPORT = """
import os, signal, sys
from ds_diloco.export import replacing_folder
with replacing_folder(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_bytes(b"half written")
    os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-write: no handler runs
"""


def test_the_next_export_removes_what_a_crashed_export_left_and_nothing_else(served, tmp_path):
    # A process killed mid-export left its .hf.new-* folder (a model's worth) for ever.
    config, tensors = load_global_tensors(served.state_dir)
    out = tmp_path / "hf"
    crash = subprocess.run([sys.executable, "-c", CRASH_MID_EXPORT, str(out)],
                           capture_output=True, text=True)  # fmt: skip
    assert crash.returncode == -9, crash.stderr
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.new-")]
    assert (left / "model.safetensors").is_file()
    # Not ours: another destination's, one that only looks alike, a live export's (this
    # process's pid: an export of it in another thread).
    others = [".hf2.new-0123abcd", ".hf.new-notes", ".hf.new-0123abcd.bak", "hf.new-0123abcd",
              f".hf.new-{os.getpid()}-0123abcd"]  # fmt: skip
    for name in others:
        (tmp_path / name).mkdir()
    stray = tmp_path / ".hf.new-89abcdef"  # as exports before this fix named theirs
    stray.mkdir()
    export_model(config, tensors, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", *others])


def test_an_export_that_fails_as_it_takes_the_folders_place_leaves_it_as_it_was(
    served, tmp_path, monkeypatch
):
    # Failing after the writing (here: the new folder cannot be moved into place), the
    # export left its temporary folder, and the earlier export moved aside.
    config, tensors = load_global_tensors(served.state_dir)
    out = tmp_path / "hf"
    export_model(config, tensors, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_rename, failed = Path.rename, []

    def rename(self, target):
        if Path(target) == out and self.name.startswith(".hf.new-") and not failed:
            failed.append(self)
            raise OSError(errno.EBUSY, "Device or resource busy", str(target))
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="busy"):
        export_model(config, {n: t + 1 for n, t in tensors.items()}, out)
    assert failed and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_earlier_export_a_crash_left_moved_aside_is_put_back_or_removed(served, tmp_path):
    # A death between the two renames left the earlier export only in .hf.old-*, and no
    # hf: the next export puts it back first (so a failure of that export still leaves it
    # in place); with hf present, an .old-* of a dead export is removed.
    config, tensors = load_global_tensors(served.state_dir)
    out = tmp_path / "hf"
    export_model(config, tensors, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    out.rename(tmp_path / f".hf.old-{dead}-0123abcd")
    with pytest.raises(RuntimeError, match="midway"), replacing_folder(out):
        raise RuntimeError("midway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (tmp_path / f".hf.old-{dead}-4567abcd").mkdir()
    export_model(config, tensors, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_folder_that_is_not_an_export_is_not_replaced(served, tmp_path):
    config, tensors = load_global_tensors(served.state_dir)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no earlier export"):
        export_model(config, tensors, tmp_path)
    with pytest.raises(ValueError, match="holds no earlier export"):
        export(served.state_dir, tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        export_model(config, tensors, tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="max shard size '2gigs' is not a size"):
        export(served.state_dir, tmp_path / "x", max_shard_size="2gigs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (Path(export_model(config, tensors, empty)) / "config.json").is_file()
    # A link to a folder on another disk: the export goes there, the link stays (it was
    # renamed away and a local folder put in its place); the working directory is refused.
    link = tmp_path / "link"
    link.symlink_to(empty)
    export_model(config, tensors, link)
    assert link.is_symlink() and (empty / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link", "notes.txt"]
    with pytest.raises(ValueError, match="is the working directory or holds it"):
        export_model(config, tensors, ".")


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_download(
    served, tmp_path, monkeypatch, capsys
):
    # Beneath a file, or in a folder it may not write: a FileExistsError or PermissionError
    # traceback once the whole model had been downloaded and built.
    (tmp_path / "notes.txt").write_text("mine")
    calls = []
    monkeypatch.setattr(CoordinatorClient, "download", _counting(CoordinatorClient.download, calls))
    for out in (tmp_path / "notes.txt" / "hf", tmp_path / "notes.txt" / "a" / "hf"):
        argv = ["export", "--from", served.url, "--out", str(out), "--token", TOKEN]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"ds-diloco: error: output folder {str(out)!r}: "
                       f"{tmp_path / 'notes.txt'} is a file, not a folder"]  # fmt: skip
    assert not calls
    access = os.access  # tmp_path read-only (root may write anywhere)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: access(p, mode) and p != tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path} is not writable"):
        export(served.state_dir, tmp_path / "hf")
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------- errors
def test_a_state_dir_missing_a_fragment_is_named_in_one_line(served, tmp_path, capsys):
    state = tmp_path / "state"
    shutil.copytree(served.state_dir, state)
    (frag,) = [p for p in (state / "fragments").iterdir() if p.name.startswith("frag-00001")]
    frag.unlink()
    with pytest.raises(ValueError, match=f"lacks {frag.name}: the state directory is incomplete"):
        load_global(state)
    assert cli.main(["export", "--from", str(state), "--out", str(tmp_path / "out")]) == 2
    assert "is incomplete" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_a_state_dir(tmp_path):
    with pytest.raises(ValueError, match="is not a coordinator state directory"):
        load_global_tensors(tmp_path)
    with pytest.raises(ValueError, match="neither an http"):
        load_global_tensors(tmp_path / "nowhere")


def test_a_wrong_or_missing_token(served, monkeypatch):
    with pytest.raises(ValueError, match=r"refused the export \(401: wrong bearer token\)"):
        load_global_tensors(served.url, token="not-the-token")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(
        ValueError, match=f"needs the coordinator's token: --token or \\${TOKEN_ENV}"
    ):
        load_global_tensors(served.url)


def test_a_missing_model_config(served, tmp_path):
    state = tmp_path / "state"
    shutil.copytree(served.state_dir, state)
    (state / "model" / "config.json").unlink()
    with pytest.raises(ValueError, match="has no model config"):
        load_global_tensors(state)
    # A coordinator resumed from that directory cannot serve the config either.
    with (
        ServerThread(make_cfg(served.config_path, state)) as srv,
        pytest.raises(ValueError, match="could not serve its model config"),
    ):
        load_global_tensors(srv.url, token=TOKEN)
    _, tensors = load_global_tensors(served.state_dir)
    with pytest.raises(ValueError, match="no model config"):
        export_model({}, tensors, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tensors_that_do_not_fit_the_config(served, tmp_path):
    config, tensors = load_global_tensors(served.state_dir)
    short = dict(tensors)
    del short["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        export_model(config, short, tmp_path / "out")
    with pytest.raises(ValueError, match=r"has shape \[512, 64\], the config gives \[256, 64\]"):
        export_model({**config, "vocab_size": 256}, tensors, tmp_path / "out")
    tok = train_tokenizer([SONNETS], 600, tmp_path / "tok")
    assert len(tok) > config["vocab_size"]
    with pytest.raises(ValueError, match="more than the model's vocab_size 512"):
        export_model(config, tensors, tmp_path / "out", tokenizer=tmp_path / "tok")
    assert not (tmp_path / "out").exists()
    (tmp_path / "no-tok").mkdir()  # a folder with no tokenizer: one line naming it
    with pytest.raises(ValueError, match=r"^tokenizer '.*no-tok' holds no tokenizer [^\n]*$"):
        export_model(config, tensors, tmp_path / "out", tokenizer=tmp_path / "no-tok")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------- CLI
def test_cli_export(served, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.main(["export", "--from", str(served.state_dir), "--out", str(out)]) == 0
    n = sum(t.numel() for t in served.coord.global_tensors().values())
    printed = capsys.readouterr().out
    assert f"exported {n:,} parameters" in printed and str(out) in printed
    assert (out / "model.safetensors").is_file()

    argv = ["export", "--from", served.url, "--out", str(tmp_path / "x"), "--token", "bad"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ds-diloco: error: ")
    assert "401: wrong bearer token" in err[0]

    # The token file `ds-diloco run` writes, as status and eval read it.
    (tmp_path / "token").write_text(TOKEN + "\n")
    argv = ["export", "--from", served.url, "--out", str(tmp_path / "y"), "--token-file",
            str(tmp_path / "token")]  # fmt: skip
    assert cli.main(argv) == 0
    assert (tmp_path / "y" / "model.safetensors").is_file()
    argv[-1] = str(tmp_path / "none")
    assert cli.main(argv) == 2
    assert "--token-file" in capsys.readouterr().err


# --------------------------------------------------------------- a live, consistent export
def merge_fragments(url: str, fragments: list[int], base_version: int, step: int) -> None:
    """Island 'a' (registered, 2 ranks) sends ``fragments``; wait until each has merged."""
    client = CoordinatorClient(url, TOKEN, retries=0)
    plan = FragmentPlan.from_json(client.plan()["plan"])
    g = torch.Generator().manual_seed(step)
    deltas = {s.name: 0.01 * torch.randn(s.shape, generator=g) for s in plan.specs}
    for i in fragments:
        for rank in range(2):
            header = wire.UploadHeader(
                island="a", rank=rank, world_size=2, fragment=i, base_version=base_version,
                step=step, tokens=64, steps=1,
            )  # fmt: skip
            reply = client.upload(header, rank_slices(plan.fragments[i], deltas, 2, rank))
            assert reply["status"] == "accepted"
    deadline = time.monotonic() + 20
    while any(client.versions()[i] != base_version + 1 for i in fragments):
        assert time.monotonic() < deadline, f"versions stuck at {client.versions()}"
        time.sleep(0.02)


def test_live_export_fetches_again_what_merged_during_it(served, tmp_path, monkeypatch):
    """A merge of fragments 0 and 1 lands after fragment 0 was downloaded and before
    fragment 1 was: one pass holds fragment 0 before the merge and fragment 1 after
    it, a set that never existed. Export must notice and fetch fragment 0 again."""
    from ds_diloco.client import CoordinatorClient as Client

    with ServerThread(make_cfg(served.config_path, tmp_path / "state")) as srv:
        merge_one_round(srv)
        calls = []
        download = Client.download

        def download_then_merge(self, fragment, **kw):
            got = download(self, fragment, **kw)
            calls.append(fragment)
            if calls == [0]:
                merge_fragments(srv.url, [0, 1], base_version=1, step=2)
            return got

        monkeypatch.setattr(Client, "download", download_then_merge)
        g = load_global(srv.url, token=TOKEN)
        assert calls == [0, 1, 2, 3, 0]
        assert g.versions == srv.coord.versions() == [2, 2, 1, 1]
        assert g.merges == [2, 2, 1, 1]
        assert_same_tensors(g.tensors, srv.coord.global_tensors())


def test_live_export_gives_up_when_fragments_keep_merging(served, monkeypatch):
    from ds_diloco.client import CoordinatorClient as Client

    status, downloads = Client.status, []
    monkeypatch.setattr(Client, "download", _counting(Client.download, downloads))

    def moving_status(self):  # every fragment has merged again since the last look
        s = status(self)
        return {**s, "versions": [v + len(downloads) for v in s["versions"]]}

    monkeypatch.setattr(Client, "status", moving_status)
    with pytest.raises(ValueError, match=r"merged again during each of 3 download passes"):
        load_global(served.url, token=TOKEN, attempts=3)
    assert len(downloads) == 3 * 4


def _counting(fn, calls: list):
    def wrapped(self, fragment, **kw):
        calls.append(fragment)
        return fn(self, fragment, **kw)

    return wrapped


# --------------------------------------------------------------- the model card
SUMMARY = {
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "base_license": "apache-2.0",
    "data": "Shakespeare's sonnets (public domain)",
    "islands": [
        {"name": "a", "world_size": 2, "tokens": 12345, "steps": 7},
        {"name": "b", "world_size": 4, "tokens": 1000, "steps": 3},
    ],
    "outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9, "H": 99, "P": 4, "tau": 1, "K": 1},
    "goodput": 0.875,
    "heldout_loss_before": 3.21094,
    "heldout_loss_after": 2.71828,
    "wall_s": 12.5,  # what else a run writes is ignored
}


def card_parts(readme: Path) -> tuple[dict, dict, list[list[str]]]:
    """(front matter, {row: value} of the first table, rows of the islands table)."""
    text = readme.read_text()
    _, front, body = text.split("---\n", 2)
    tables = [[c.strip() for c in line.strip("|").split("|")] for line in body.splitlines()
              if line.startswith("| ") and not line.startswith("| |")]  # fmt: skip
    summary = {r[0]: r[1] for r in tables if len(r) == 2}
    islands = [r for r in tables if len(r) == 6 and r[0] != "island"]
    return yaml.safe_load(front), summary, islands


def test_export_from_a_live_coordinator_with_the_run_figures(served, tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    out = tmp_path / "hf"
    argv = ["export", "--from", served.url, "--token", TOKEN, "--out", str(out),
            "--run-summary", str(tmp_path / "summary.json")]  # fmt: skip
    assert cli.main(argv) == 0
    assert "fragments at version 1" in capsys.readouterr().out

    # The weights: the coordinator's, in fp32, the head still tied to the embedding.
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    want = served.coord.global_tensors()
    assert torch.equal(logits(loaded), logits(reference_model(served.config_path, want)))

    meta, rows, islands = card_parts(out / "README.md")
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "transformers"
    n = sum(t.numel() for t in want.values())
    assert rows == {
        "base model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license of the base": "apache-2.0",
        "data": "Shakespeare's sonnets (public domain)",
        "islands": "2: a (2 ranks), b (4 ranks)",
        "tokens": "13,345",
        "merges per fragment": "1 (4 fragments, 4 merges in all)",  # the coordinator's
        "outer optimizer": "nesterov, lr 0.7, momentum 0.9",
        # The coordinator serves H and tau: its figures win over the summary's H = 99.
        "schedule": "H = 4 inner steps between syncs of a fragment, P = 4 fragments, "
        "tau = 1 overlap steps, K = 1 minimum quorum",
        "goodput": "87.5%",
        "final held-out loss": "2.7183 (from 3.2109 before the run)",
        "parameters": f"{n:,} (float32)",
        "fragment versions exported": "1, 1, 1, 1",
    }
    # Island a merged one contribution per fragment; b never reached the coordinator.
    assert islands == [
        ["a", "2", "12,345", "7", "4", "0"],
        ["b", "4", "1,000", "3", "not given", "not given"],
    ]


def test_the_run_summarys_figures_of_other_weights_are_not_given_as_theirs(served, tmp_path):
    # A summary.json written at 3 merges (a run since resumed), the weights exported at 4:
    # the card gave the summary's held-out loss and tokens as those of these weights.
    (tmp_path / "summary.json").write_text(json.dumps({**SUMMARY, "merges": [1, 1, 1, 0]}))
    export(served.url, tmp_path / "hf", token=TOKEN, run_summary=tmp_path / "summary.json")
    _, rows, _ = card_parts(tmp_path / "hf" / "README.md")
    at = "the run summary's, of the model at 3 merges; these weights are at 4"
    assert rows["final held-out loss"] == f"not measured for these weights (2.7183: {at})"
    assert rows["tokens"] == f"13,345 ({at})"
    assert rows["merges per fragment"] == "1 (4 fragments, 4 merges in all)"
    # The summary of these weights: its figures are theirs.
    (tmp_path / "summary.json").write_text(json.dumps({**SUMMARY, "merges": [1, 1, 1, 1]}))
    export(served.url, tmp_path / "hf", token=TOKEN, run_summary=tmp_path / "summary.json")
    _, rows, _ = card_parts(tmp_path / "hf" / "README.md")
    assert rows["final held-out loss"] == "2.7183 (from 3.2109 before the run)"
    assert rows["tokens"] == "13,345"


def test_model_card_without_a_summary_says_what_is_unknown(served, tmp_path):
    export(served.state_dir, tmp_path / "hf", dtype="bf16")
    meta, rows, islands = card_parts(tmp_path / "hf" / "README.md")
    assert rows["parameters"].endswith(" (bfloat16)")
    assert "license" not in meta and "base_model" not in meta
    assert rows["base model"] == rows["data"] == rows["tokens"] == "not given"
    assert rows["goodput"] == rows["final held-out loss"] == "not measured"
    assert rows["islands"] == "1: a (2 ranks)"  # the coordinator's island table
    assert rows["merges per fragment"] == "1 (4 fragments, 4 merges in all)"
    # The schedule is the coordinator's state's; K is a run setting it does not hold.
    assert rows["schedule"].startswith("H = 4 inner steps") and "K = not given" in rows["schedule"]
    assert islands == [["a", "2", "not given", "not given", "4", "0"]]


def test_run_summary_as_ds_diloco_run_writes_it(tmp_path):
    run = {
        "wall_s": 327.6,
        "islands": {"island-a": {"world_size": 2, "steps": 160, "tokens": 327680, "rank": 0}},
        "merges": [20, 19],
        "heldout_loss_initial": 8.35,
        "heldout_loss_merged": 6.14,
        "sample": "ROMEO: ...",
    }
    s = RunSummary.from_json(run)
    assert s.islands == (IslandSummary(name="island-a", world_size=2, tokens=327680, steps=160),)
    assert (s.merges, s.heldout_loss_before, s.heldout_loss_after) == ((20, 19), 8.35, 6.14)
    with pytest.raises(ValueError, match=r"goodput must be in \[0, 1\], got 1.5"):
        RunSummary.from_json({"goodput": 1.5})
    with pytest.raises(ValueError, match=r"islands.tokens: expected int, got 'many'"):
        RunSummary.from_json({"islands": [{"name": "a", "tokens": "many"}]})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_run_summary(tmp_path / "bad.json")


def test_generation_config_comes_from_the_run(served, tmp_path):
    saved = json.loads((served.state_dir / "model" / "generation_config.json").read_text())
    export(served.state_dir, tmp_path / "hf")
    got = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert {k: got.get(k) for k in saved if k != "transformers_version"} == {
        k: v for k, v in saved.items() if k != "transformers_version"
    }
    # A pretrained folder given as the tokenizer brings its generation config.
    tok = train_tokenizer([SONNETS], 384, tmp_path / "tok")
    assert len(tok) <= TINY_LLAMA["vocab_size"]
    (tmp_path / "tok" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 3, "max_new_tokens": 17})
    )
    config, tensors = load_global_tensors(served.state_dir)
    export_model(config, tensors, tmp_path / "hf2", tokenizer=tmp_path / "tok")
    got = json.loads((tmp_path / "hf2" / "generation_config.json").read_text())
    assert (got["eos_token_id"], got["max_new_tokens"]) == (3, 17)


def test_an_export_from_a_state_dir_has_the_coordinators_schedule(served, tmp_path):
    # The state held no H or tau: the card of an export from a state directory said "not
    # given" for both. A state written before the schedule was saved still says so.
    shutil.copytree(served.state_dir, tmp_path / "state")
    export(tmp_path / "state", tmp_path / "hf")
    _, rows, _ = card_parts(tmp_path / "hf" / "README.md")
    assert rows["schedule"].startswith("H = 4 inner steps between syncs of a fragment, P = 4 "
                                       "fragments, tau = 1 overlap steps"), rows  # fmt: skip
    table = tmp_path / "state" / "coordinator.json"
    old = json.loads(table.read_text())
    del old["schedule"]
    table.write_text(json.dumps(old))
    export(tmp_path / "state", tmp_path / "hf")
    _, rows, _ = card_parts(tmp_path / "hf" / "README.md")
    assert rows["schedule"].startswith("H = not given inner steps"), rows
