"""HF safetensors -> GGUF for Llama and Mistral models (`pykv convert`), written with the gguf
package. Facts followed (llama.cpp's GGUF conventions): tensors take GGUF's names; the query
and key projections are permuted from HF's rotate-half RoPE layout to the interleaved pairs
that GGUF Llama models use; norms stay float32; a byte-level BPE vocabulary is stored as
tokenizer.json spells it, with tokenizer.ggml.pre naming its pre-tokenizer, a SentencePiece
one as pieces, scores and token types; Llama 3's rope scaling becomes the rope_freqs divisors.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
OUT_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
# safetensors dtypes that can be read (BF16 is widened to float32 by a shift)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class ConvertError(ValueError):
    """The model folder cannot be converted; the message says why."""


# ---- safetensors ----------------------------------------------------------------------

def _safetensors_files(model_dir: Path):
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"no *.safetensors files in {model_dir} (pytorch .bin checkpoints are not read)")
    return files


def read_safetensors(path: Path) -> Iterator[Tuple[str, np.ndarray]]:
    """(name, float array) for every tensor of one file, mapped rather than read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConvertError(f"{path.name}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ConvertError(f"{path.name}: the header claims {n} bytes, more than the file holds")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConvertError(f"{path.name}: corrupt safetensors header ({exc})") from exc
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ConvertError(f"{path.name}: tensor {name} has dtype {info.get('dtype')}; F32, F16 and BF16 are read")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end > data.size or end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ConvertError(f"{path.name}: tensor {name} lies outside the file or has the wrong size")
        arr = data[start:end].view(dtype).reshape(shape)
        if dtype is np.uint16:
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        yield name, arr


# ---- hyperparameters and tensors --------------------------------------------------------

def _config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise ConvertError(f"{model_dir} has no config.json: give a Hugging Face model folder")
    cfg = json.loads(path.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ConvertError(f"architecture {arch} is not supported (pykv converts {', '.join(ARCHITECTURES)})")
    theta, scaling = rope_config(cfg)
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ConvertError(f"rope scaling {scaling} is not converted (pykv reads Llama 3's, as rope_freqs)")
    return cfg


def rope_config(cfg: dict) -> Tuple[float, Optional[dict]]:
    """(RoPE base, scaling parameters or None) from a config.json written by transformers 4
    (rope_theta, rope_scaling) or 5 (rope_parameters holding both)."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def llama3_rope_factors(theta: float, s: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as per-frequency divisors (GGUF's rope_freqs): long wavelengths
    are slowed by `factor`, short ones kept, those between blended."""
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = np.clip((old_ctx / wavelen - lo) / (hi - lo), 0.0, 1.0)
    out = 1.0 / ((1.0 - smooth) / factor + smooth)   # 1 for short wavelengths, factor for long ones
    return out.astype(np.float32)


def _permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from HF's halves (x0..x(d/2-1), then the rest) to GGUF's
    interleaved pairs, head by head."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model_dir: Path, cfg: dict) -> Iterator[Tuple[str, np.ndarray]]:
    import gguf

    n_layer, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_head_kv = cfg.get("num_key_value_heads", n_head)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)
    for path in _safetensors_files(model_dir):
        for name, arr in read_safetensors(path):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ConvertError(f"tensor {name} has no GGUF name for a Llama model")
            if name.endswith("q_proj.weight"):
                arr = _permute_rope(arr, n_head)
            elif name.endswith("k_proj.weight"):
                arr = _permute_rope(arr, n_head_kv)
            yield new, arr


def _stored(name: str, arr: np.ndarray, out_type: str):
    """(array to write, its GGML type): vectors stay float32, matrices take out_type where
    their rows split into whole blocks, else f16."""
    import gguf

    T = gguf.GGMLQuantizationType
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or out_type == "f32":
        return arr, T.F32
    if out_type == "f16":
        return arr.astype(np.float16), T.F16
    qtype = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}[out_type]
    if arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return arr.astype(np.float16), T.F16
    return gguf.quants.quantize(arr, qtype), qtype


# ---- tokenizer ------------------------------------------------------------------------------

def _pre_tokenizer(tok: dict) -> str:
    """tokenizer.ggml.pre for the pre-tokenizers pykv implements, read from tokenizer.json."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds and kinds[-1] == "ByteLevel" and any(
            "\\p{N}{1,3}" in (s.get("pattern") or {}).get("Regex", "") for s in steps):
        return "llama-bpe"
    raise ConvertError(f"tokenizer.json's pre-tokenizer ({kinds}) is not one pykv knows; "
                       "name it with --pre (gpt2, llama-bpe, qwen2, smollm, default)")


def _is_byte_level(tok: dict) -> bool:
    model = tok.get("model", {})
    return (model.get("type") == "BPE" and not model.get("byte_fallback")
            and (tok.get("decoder") or {}).get("type") == "ByteLevel")


def _add_vocab(w, model_dir: Path, n_vocab: int, pre: Optional[str]) -> None:
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if tok is not None and _is_byte_level(tok):
        _add_bpe_vocab(w, model_dir, tok, n_vocab, pre)
    elif (model_dir / "tokenizer.model").exists():   # Llama 2, Mistral: SentencePiece
        _add_spm_vocab(w, model_dir, n_vocab)
    elif tok is not None:
        raise ConvertError("tokenizer.json is not a byte-level BPE vocabulary and there is no tokenizer.model")
    else:
        raise ConvertError(f"{model_dir} has no tokenizer.json or tokenizer.model")


def _add_spm_vocab(w, model_dir: Path, n_vocab: int) -> None:
    """Pieces, scores and token types from the SentencePiece model, as llama.cpp stores them."""
    import gguf
    try:
        import sentencepiece
    except ImportError as exc:
        raise ConvertError("a tokenizer.model vocabulary needs the sentencepiece package "
                           "(pip install sentencepiece)") from exc
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(T.UNKNOWN if sp.is_unknown(i) else T.CONTROL if sp.is_control(i) else
                     T.BYTE if sp.is_byte(i) else T.UNUSED if sp.is_unused(i) else T.NORMAL)
    for i in range(len(tokens), n_vocab):   # a model may have rows past the tokenizer's pieces
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(T.UNUSED)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _add_bpe_vocab(w, model_dir: Path, tok: dict, n_vocab: int, pre: Optional[str]) -> None:
    import gguf

    model = tok["model"]
    tokens: Dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in tokens}
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    size = max(n_vocab, max(tokens) + 1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or _pre_tokenizer(tok))
    w.add_token_list([tokens.get(i, f"[PAD{i}]") for i in range(size)])
    w.add_token_types([types.get(i, gguf.TokenType.UNUSED) for i in range(size)])
    # merges, BOS/EOS/PAD ids, add_bos and the chat template, from tokenizer_config.json
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=size).add_to_gguf(w, quiet=True)


# ---- the file ------------------------------------------------------------------------------

def convert(model_dir, out_path, out_type: str = "f16", pre: Optional[str] = None, progress=sys.stderr) -> Path:
    """Write the GGUF of the HF model in model_dir to out_path; returns out_path."""
    try:
        import gguf
    except ImportError as exc:
        raise ConvertError("pykv convert needs the gguf package: pip install 'pykv[hf]'") from exc
    if out_type not in OUT_TYPES:
        raise ConvertError(f"--outtype must be one of {', '.join(OUT_TYPES)}, got {out_type!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    cfg = _config(model_dir)
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or n_embd // n_head

    tmp = out_path.with_name(out_path.name + ".part")   # a failed run leaves no half-written model
    w = gguf.GGUFWriter(str(tmp), "llama")
    try:
        w.add_name(model_dir.name)
        w.add_context_length(cfg.get("max_position_embeddings", 2048))
        w.add_embedding_length(n_embd)
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(n_head)
        w.add_head_count_kv(cfg.get("num_key_value_heads", n_head))
        w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))
        theta, scaling = rope_config(cfg)
        w.add_rope_freq_base(theta)
        w.add_rope_dimension_count(head_dim)
        if head_dim != n_embd // n_head:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_vocab_size(cfg["vocab_size"])
        w.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}[out_type])
        w.add_quantization_version(2)
        _add_vocab(w, model_dir, cfg["vocab_size"], pre)

        names = []
        if scaling:
            w.add_tensor("rope_freqs.weight", llama3_rope_factors(theta, scaling, head_dim))
        for name, arr in _tensors(model_dir, cfg):
            data, qtype = _stored(name, arr, out_type)
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                w.add_tensor(name, data)
            else:   # bytes of blocks: the writer takes the element shape from them
                w.add_tensor(name, data, raw_dtype=qtype)
            names.append(name)
            if progress:
                print(f"pykv: [{len(names):4d}] {name:32s} {str(tuple(arr.shape)):16s} -> {qtype.name}", file=progress)
        if "output.weight" not in names and not cfg.get("tie_word_embeddings", False):
            raise ConvertError("the model has no lm_head.weight and does not tie its embeddings")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
