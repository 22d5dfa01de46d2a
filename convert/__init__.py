"""HF safetensors -> GGUF for Llama and Mistral models (`pykv convert`), written with the gguf
package. Facts followed (llama.cpp's GGUF conventions): tensors take GGUF's names; the query
and key projections are permuted from HF's rotate-half RoPE layout to the interleaved pairs
that GGUF Llama models use; norms stay float32; a byte-level BPE vocabulary is stored as
tokenizer.json spells it, with tokenizer.ggml.pre naming its pre-tokenizer, a SentencePiece
one as pieces, scores and token types; Llama 3's rope scaling becomes the rope_freqs divisors.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np

from .vocab import add_vocab
from .safetensors import read_safetensors, safetensors_files
from pykv.errors import ConvertError

__all__ = ["convert", "ConvertError", "ARCHITECTURES", "OUT_TYPES", "FILE_TYPES"]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
# out type -> general.file_type (llama.cpp's llama_ftype); the quantized ones name a GGML type
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7}
OUT_TYPES = tuple(FILE_TYPES)


# ---- hyperparameters and tensors --------------------------------------------------------

def _config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise ConvertError(f"{model_dir} has no config.json: give a Hugging Face model folder")
    cfg = json.loads(path.read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ConvertError(f"architecture {arch} is not supported (pykv converts {', '.join(ARCHITECTURES)})")
    _, scaling = rope_config(cfg)
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


def _tensors(model_dir: Path, cfg: dict) -> List[Tuple[str, Tuple[int, ...], Callable[[], np.ndarray]]]:
    """(GGUF name, shape, load) of every tensor, from the files' headers: load() reads one
    tensor when it is written, so a conversion holds one tensor at a time."""
    import gguf

    n_layer, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_head_kv = cfg.get("num_key_value_heads", n_head)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layer)
    out = []
    for path in safetensors_files(model_dir):
        for name, shape, load in read_safetensors(path):
            if name.endswith("rotary_emb.inv_freq"):
                continue
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ConvertError(f"tensor {name} has no GGUF name for a Llama model")
            if name.endswith("q_proj.weight"):
                load = functools.partial(_permuted, load, n_head)
            elif name.endswith("k_proj.weight"):
                load = functools.partial(_permuted, load, n_head_kv)
            out.append((new, shape, load))
    return out


def _permuted(load: Callable[[], np.ndarray], n_head: int) -> np.ndarray:
    return _permute_rope(load(), n_head)


def _stored_type(shape: Tuple[int, ...], out_type: str):
    """The GGML type a tensor is written in: vectors stay float32, matrices take out_type
    where their rows split into whole blocks, else f16."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) == 1 or out_type == "f32":
        return T.F32
    qtype = T[out_type.upper()]
    return qtype if qtype == T.F16 or shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else T.F16


def _add_info(w, name: str, shape: Tuple[int, ...], qtype) -> None:
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * block_bytes
    float_dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
    if qtype in float_dtype:
        w.add_tensor_info(name, shape, np.dtype(float_dtype[qtype]), nbytes)
    else:   # element shape, bytes of blocks
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)


def _encoded(arr: np.ndarray, qtype) -> np.ndarray:
    import gguf

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return arr
    if qtype == gguf.GGMLQuantizationType.F16:
        return arr.astype(np.float16)
    return gguf.quants.quantize(arr, qtype)


# ---- the file ------------------------------------------------------------------------------

def convert(model_dir, out_path, out_type: str = "f16", pre: Optional[str] = None, progress=sys.stderr) -> Path:
    """Write the GGUF of the HF model in model_dir to out_path; returns out_path."""
    try:
        import gguf
    except ImportError as exc:
        raise ConvertError("pykv convert needs the gguf package: pip install gguf "
                           "(or pip install '.[hf]' in a pykv checkout, as README says)") from exc
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
        w.add_file_type(FILE_TYPES[out_type])
        w.add_quantization_version(2)
        add_vocab(w, model_dir, cfg["vocab_size"], pre)

        tensors = _tensors(model_dir, cfg)
        if scaling:
            factors = llama3_rope_factors(theta, scaling, head_dim)
            tensors.insert(0, ("rope_freqs.weight", factors.shape, lambda: factors))
        if not any(name == "output.weight" for name, _, _ in tensors) and not cfg.get("tie_word_embeddings", False):
            raise ConvertError("the model has no lm_head.weight and does not tie its embeddings")
        types = [_stored_type(shape, out_type) for _, shape, _ in tensors]
        for (name, shape, _), qtype in zip(tensors, types):
            _add_info(w, name, shape, qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, ((name, shape, load), qtype) in enumerate(zip(tensors, types)):
            w.write_tensor_data(_encoded(load(), qtype))
            if progress:
                print(f"pykv: [{i + 1:4d}/{len(tensors)}] {name:32s} {str(tuple(shape)):16s} -> {qtype.name}",
                      file=progress)
        w.close()
        tmp.replace(out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
