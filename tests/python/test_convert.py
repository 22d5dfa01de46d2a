"""`pykv convert`: a tiny random-weight Llama saved by transformers (safetensors, with SmolLM2's
byte-level BPE vocabulary in tokenizer.json) converted to GGUF and run by pykv. References:
transformers' forward pass on the same HF model (f32), and on the weights read back from the
quantized GGUF by the gguf package (q8_0, q4_1); the `tokenizers` library for the vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import _vocab_fixtures as vf
from _compare import EXACT, assert_logits_close
from pykv import Llama
from pykv.convert import ConvertError, convert

pytestmark = pytest.mark.model   # the vocabulary comes from the SmolLM2 GGUF

N_HEAD, N_HEAD_KV = 4, 2
TEXTS = ["Hello world", "The year 2024 has 366 days.", "Ça va? 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tokenizer_json(vocab) -> dict:
    tokens = list(vocab["tokens"])
    control = [i for i, t in enumerate(vocab["types"]) if int(t) == 3]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in control],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                byte_level]},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": list(vocab["merges"])},
    }


def _save_random_model(folder, arch="Llama", **config):
    """A transformers model with random weights (2 layers, 4 heads, 2 KV heads) saved as
    safetensors in folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, f"{arch}Config")(**dict(
        dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=N_HEAD,
             num_key_value_heads=N_HEAD_KV, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), **config))
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).float().eval()
    with torch.no_grad():   # larger than the default init, so the logits are far from flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_model(smollm2_path, tmp_path_factory):
    """(folder, transformers model): a Llama with SmolLM2's 49152-token byte-level vocabulary."""
    vocab = vf.read_bpe_vocab(Path(smollm2_path))
    folder = tmp_path_factory.mktemp("hf-llama")
    model = _save_random_model(folder, vocab_size=len(vocab["tokens"]))
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json(vocab)), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": TEMPLATE}))
    return folder, model


def _hf_logits(model, tokens):
    import torch
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def _pykv_logits(path, tokens):
    """Logits after each token, fed one at a time (every decode step is compared)."""
    rows = []
    with Llama(str(path), n_ctx=128, n_threads=2, **EXACT) as llm:
        for t in tokens:
            llm.eval([t])
            rows.append(llm.logits().astype(np.float64))
    return np.array(rows)


TOKENS = [1, 504, 3458, 282, 4649, 314, 2, 17, 905, 1212, 28, 30, 12000, 49000]


def test_f32_matches_transformers(hf_model, tmp_path):
    folder, model = hf_model
    out = convert(folder, tmp_path / "tiny-f32.gguf", "f32", progress=None)
    got, ref = _pykv_logits(out, TOKENS), _hf_logits(model, TOKENS)
    for i in range(len(TOKENS)):
        assert_logits_close(got[i], ref[i], atol=1e-3, rtol_scale=1e-4, what=f"f32 step {i}")


def test_tied_embeddings_and_bf16(tmp_path):
    """A model that ties lm_head to the embeddings (SmolLM2 does) saved in bfloat16: no
    output.weight in the GGUF, the runtime reads token_embd for the logits."""
    import torch

    model = _save_random_model(tmp_path, vocab_size=512, tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    model = model.float()   # the bf16-rounded weights, in float32 for the reference
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["model.embed_tokens.weight"]["dtype"] == "BF16" and "lm_head.weight" not in header
    (tmp_path / "tokenizer.json").write_text(json.dumps(_tiny_bpe_tokenizer(512)), encoding="utf-8")
    out = convert(tmp_path, tmp_path / "tied.gguf", "f32", pre="gpt2", progress=None)
    with Llama(str(out), vocab_only=True) as llm:
        names = {t["name"] for t in llm.tensors}
    assert "output.weight" not in names and "token_embd.weight" in names
    tokens = [5, 77, 300, 12, 511, 0, 42]
    got, ref = _pykv_logits(out, tokens), _hf_logits(model, tokens)
    for i in range(len(tokens)):
        assert_logits_close(got[i], ref[i], atol=1e-3, rtol_scale=1e-4, what=f"tied step {i}")


@pytest.mark.parametrize("config_style", ["transformers 5", "transformers 4"])
def test_llama3_rope_scaling_matches_transformers(tmp_path, config_style):
    """Llama 3.1's rope scaling becomes rope_freqs; a short original context puts the model's
    frequencies in all three regimes (kept, blended, slowed by the factor). config.json spells
    RoPE as transformers 5 writes it (rope_parameters) or as hub models from transformers 4 do
    (rope_theta, rope_scaling)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model = _save_random_model(tmp_path, vocab_size=512, rope_theta=500000.0, rope_scaling=scaling)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0 and "rope_theta" not in cfg
    if config_style == "transformers 4":
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text(json.dumps(_tiny_bpe_tokenizer(512)), encoding="utf-8")
    out = convert(tmp_path, tmp_path / "llama3.gguf", "f32", pre="gpt2", progress=None)
    tokens = [(7 * i + 3) % 512 for i in range(48)]
    got, ref = _pykv_logits(out, tokens), _hf_logits(model, tokens)
    for i in range(len(tokens)):
        assert_logits_close(got[i], ref[i], atol=1e-3, rtol_scale=1e-4, what=f"llama3 rope step {i}")


def _tiny_bpe_tokenizer(n: int) -> dict:
    """A byte-level BPE vocabulary of n single-character tokens (no merges)."""
    chars = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0x100, 0x100 + n)]
    tok = _tokenizer_json({"tokens": chars[:n], "types": [1] * n, "merges": []})
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return tok


def _dequantized_model(model, gguf_path):
    """model with its weights replaced by the GGUF's, dequantized by the gguf package and
    permuted back to HF's q/k layout."""
    import copy

    import gguf
    import torch

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    stored = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for hf_name, p in twin.named_parameters():
            t = stored[names.get_name(hf_name, try_suffixes=(".weight",))]
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(p.shape).astype(np.float32)
            n_head = N_HEAD if hf_name.endswith("q_proj.weight") else N_HEAD_KV if hf_name.endswith("k_proj.weight") else 0
            if n_head:   # interleaved pairs back to halves
                w = w.reshape(n_head, -1, 2, w.shape[1]).swapaxes(1, 2).reshape(p.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(w)))
    return twin


@pytest.mark.parametrize("out_type, ggml_type", [("q8_0", "q8_0"), ("q4_1", "q4_1"), ("f16", "f16")])
def test_quantized_matches_transformers_on_the_stored_weights(hf_model, tmp_path, out_type, ggml_type):
    folder, model = hf_model
    out = convert(folder, tmp_path / f"tiny-{out_type}.gguf", out_type, progress=None)
    with Llama(str(out), vocab_only=True) as llm:
        types = {t["name"]: t["type"].lower() for t in llm.tensors}
    assert types["blk.0.attn_q.weight"] == ggml_type and types["output.weight"] == ggml_type
    assert types["blk.1.ffn_norm.weight"] == "f32"
    got, ref = _pykv_logits(out, TOKENS), _hf_logits(_dequantized_model(model, out), TOKENS)
    for i in range(len(TOKENS)):
        assert_logits_close(got[i], ref[i], atol=1e-3, rtol_scale=1e-4, what=f"{out_type} step {i}")
    # and the storage loses little against the float model: next-token KL per step, in nats
    kl = _kl(_hf_logits(model, TOKENS), got)
    assert kl.max() < KL_BOUND[out_type], kl


KL_BOUND = {"f16": 1e-4, "q8_0": 1e-3, "q4_1": 0.5}   # 4 bits of random Gaussian weights: ~0.03..0.2


def _kl(ref, got):
    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(got)
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def test_vocabulary_matches_tokenizers(hf_model, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    folder, _ = hf_model
    out = convert(folder, tmp_path / "tiny.gguf", "f16", progress=None)
    ref = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    with Llama(str(out), vocab_only=True) as llm:
        for text in TEXTS:
            assert llm.tokenize(text, add_bos=True, special=True) == ref.encode(text).ids, text
        assert (llm.token_bos(), llm.token_eos()) == (1, 2)
        assert llm.chat_template == TEMPLATE
        assert llm.metadata["tokenizer.ggml.pre"] == "smollm"


def test_tensors_are_converted_one_at_a_time(tmp_path):
    """Each tensor is read, converted and written before the next is read: the Python heap's
    peak stays a small part of the file written (it held every converted tensor before)."""
    import tracemalloc

    def peak_and_size(n_layer):
        folder = tmp_path / f"layers-{n_layer}"
        _save_random_model(folder, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=n_layer)
        (folder / "tokenizer.json").write_text(json.dumps(_tiny_bpe_tokenizer(512)), encoding="utf-8")
        tracemalloc.start()
        try:
            out = convert(folder, folder / "model.gguf", "q8_0", pre="gpt2", progress=None)
            return tracemalloc.get_traced_memory()[1], out.stat().st_size
        finally:
            tracemalloc.stop()

    peak_and_size(2)   # imports and first-call caches out of the way
    (peak2, size2), (peak24, size24) = peak_and_size(2), peak_and_size(24)
    # measured: ~0.6 MB and ~1.3 MB for 2 and 24 layers (15 MB of q8_0); 17 MB at 24 before
    assert size24 > 12 * size2 / 2
    assert peak24 < size24 / 5, f"peak {peak2} B with 2 layers, {peak24} B with 24 ({size24} B written)"


def _copy_model(folder, dest):
    import shutil
    shutil.copytree(folder, dest)
    return dest


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})), "not supported"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
     "outside the file|more than the file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 4), "truncated"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
])
def test_bad_folders_are_clear_errors_and_leave_no_file(hf_model, tmp_path, damage, match):
    folder = _copy_model(hf_model[0], tmp_path / "model")
    damage(folder)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConvertError, match=match):
        convert(folder, out, "q8_0", progress=None)
    assert not out.exists() and not list(tmp_path.glob("*.part"))


def test_cli_convert(hf_model, tmp_path):
    folder = _copy_model(hf_model[0], tmp_path / "tiny-model")
    r = subprocess.run([sys.executable, "-m", "pykv", "convert", str(folder), "--outtype", "q8_0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.strip())
    assert out == folder / "tiny-model-Q8_0.gguf" and out.exists()
    assert "blk.1.ffn_down.weight" in r.stderr   # progress, one line per tensor
    with Llama(str(out), n_ctx=32, n_threads=2) as llm:
        assert llm.generate("Hello", max_tokens=3, temperature=0.0).tokens
    bad = subprocess.run([sys.executable, "-m", "pykv", "convert", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("pykv: error: ") and "config.json" in bad.stderr


@pytest.fixture(scope="module")
def mistral_model(tmp_path_factory):
    """(folder, transformers model): a Mistral with Mistral's v1 SentencePiece tokenizer.model."""
    pytest.importorskip("sentencepiece")
    try:
        proto = vf.spm_model_bytes("v1")
    except vf.DownloadError as exc:
        pytest.skip(f"mistral-common wheel unavailable: {exc}")
    folder = tmp_path_factory.mktemp("hf-mistral")
    model = _save_random_model(folder, arch="Mistral", vocab_size=32000, sliding_window=None)
    (folder / "tokenizer.model").write_bytes(proto)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}))
    return folder, model


def test_mistral_sentencepiece_matches_sentencepiece_and_transformers(mistral_model, tmp_path):
    import sentencepiece

    folder, model = mistral_model
    out = convert(folder, tmp_path / "mistral.gguf", "f32", progress=None)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    with Llama(str(out), vocab_only=True) as llm:
        for text in TEXTS[:3] + ["  two spaces\nand a newline", "\x07 control byte"]:
            ids = llm.tokenize(text, add_bos=True)
            assert ids == [sp.bos_id()] + sp.encode(text), text
            assert llm.detokenize(ids[1:]) == text.encode(), text   # byte pieces spell bytes
        assert (llm.token_bos(), llm.token_eos()) == (1, 2)
        assert llm.metadata["tokenizer.ggml.model"] == "llama"
    tokens = [1, 415, 5565, 302, 4843, 349, 2, 28705, 31999, 1000, 13]
    got, ref = _pykv_logits(out, tokens), _hf_logits(model, tokens)
    for i in range(len(tokens)):
        assert_logits_close(got[i], ref[i], atol=1e-3, rtol_scale=1e-4, what=f"mistral step {i}")


@pytest.mark.parametrize("pre_tokenizer, name", [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                           {"type": "ByteLevel", "use_regex": True}]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [   # Llama 3's tokenizer.json
        {"type": "Split", "pattern": {"Regex": vf.LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}, "llama-bpe"),
    ({"type": "Metaspace", "replacement": "\u2581"}, None),
])
def test_pre_tokenizer_is_recognised_or_named(pre_tokenizer, name):
    from convert.vocab import _pre_tokenizer
    if name is None:
        with pytest.raises(ConvertError, match="--pre"):
            _pre_tokenizer({"pre_tokenizer": pre_tokenizer})
    else:
        assert _pre_tokenizer({"pre_tokenizer": pre_tokenizer}) == name
