"""Export: the coordinator's global model, from its URL or its state directory,
as a Hugging Face folder that ``from_pretrained`` loads with the same logits.

One coordinator (a real HF tiny Llama, tied embeddings) serves the module; an
island merges a pseudo-gradient into every fragment first, so the global model
is no longer the initial one and every fragment is at version 1.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_LLAMA
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ds_diloco import cli, wire
from ds_diloco.client import CoordinatorClient, rank_slices
from ds_diloco.config import TOKEN_ENV, CoordinatorConfig, ModelSource
from ds_diloco.data import train_tokenizer
from ds_diloco.export import export_model, load_global, load_global_tensors
from ds_diloco.fragments import FragmentPlan
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


def test_bf16_export(served, tmp_path):
    config, tensors = load_global_tensors(served.state_dir)
    out = export_model(config, tensors, tmp_path / "hf", dtype="bfloat16")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(loaded.get_parameter(name), tensors[name].to(torch.bfloat16))


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


# --------------------------------------------------------------- errors
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
