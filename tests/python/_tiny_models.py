"""Tiny random-weight Llama / Mistral GGUF files for tests.

Each variant is described by a ``TinySpec``; ``write_tiny_gguf(spec, path)`` writes it
with ``gguf.GGUFWriter``.  Weights are drawn from a seeded NumPy generator and stored as
F32, F16, Q8_0, Q4_0 or Q4_1 (quantized with ``gguf.quants.quantize``); norms are F32.
Every file carries a small but valid SentencePiece-style ("llama") vocabulary:
<unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF> and a few scored word pieces.

Mistral GGUFs use general.architecture "llama" too; the Mistral-shaped variants differ
only by their hyper-parameters (rope base 1e6, GQA 4:1, untied output).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

# ---- vocabulary -------------------------------------------------------------------

_PIECES = [
    "\u2581", "\u2581t", "he", "\u2581the", "\u2581a", "in", "er", "an", "on", "\u2581o",
    "\u2581s", "re", "at", "en", "\u2581c", "\u2581w", "is", "it", "or", "es",
    "\u2581of", "\u2581and", "\u2581to", "\u2581in", "ing", "\u2581is", "\u2581cat", "\u2581dog",
    "\u2581Hello", "\u2581world", "e", "t", "a", "o", "i", "n", "s", "r", "h", "l", "d",
]

# gguf token types (llama.cpp llama_token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_BYTE = 1, 2, 3, 6

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
N_VOCAB = 3 + 256 + len(_PIECES)  # 300


def random_tokens(n: int, seed: int) -> list:
    """n token ids drawn uniformly from the tiny vocabulary (seeded)."""
    return np.random.default_rng(seed).integers(0, N_VOCAB, n).tolist()


def tiny_vocab(n_vocab: int = N_VOCAB):
    """Return (tokens, scores, token_types) of the tiny SentencePiece vocabulary, padded with
    never-chosen pieces to n_vocab entries (a model of a real vocabulary's size)."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TT_UNKNOWN, TT_CONTROL, TT_CONTROL]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TT_BYTE)
        scores.append(0.0)
    for i, p in enumerate(_PIECES):
        tokens.append(p)
        types.append(TT_NORMAL)
        scores.append(-float(i + 1))  # earlier pieces are preferred
    assert len(tokens) == N_VOCAB
    for i in range(n_vocab - N_VOCAB):
        tokens.append(f"<extra_{i}>")
        types.append(TT_NORMAL)
        scores.append(-1e4)
    return tokens, scores, types


# ---- model specs --------------------------------------------------------------------

@dataclass(frozen=True)
class TinySpec:
    name: str
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 128
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = False          # True: no output.weight, the output reuses token_embd
    wtype: str = "F32"          # type of the 2-D matrices
    embd_type: str | None = None  # type of token_embd (defaults to wtype)
    n_ctx_train: int = 16384   # above every n_ctx the tests use (a larger one warns)
    seed: int = 0
    omit: tuple = ()            # tensor names left out (for bad-input tests)
    tensor_types: tuple = ()    # (name part, type): the first pair whose part is in a tensor's name wins
    pooling_type: int | None = None   # llama.pooling_type, when given (llama.cpp's enum)
    fim: tuple = ()             # (prefix, suffix, middle) token ids written as the FIM markers
    vocab_size: int = 0         # more than the tiny vocabulary's 300: padded to this size

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_vocab(self) -> int:
        return max(N_VOCAB, self.vocab_size)


VARIANTS = {
    s.name: s
    for s in [
        TinySpec("llama_f32_h4kv4", n_embd=64, n_head=4, n_head_kv=4, n_ff=128,
                 wtype="F32", tied=False, rope_base=10000.0, rms_eps=1e-5, seed=1),
        TinySpec("llama_f16_h4kv2_tied", n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                 wtype="F16", tied=True, rope_base=10000.0, rms_eps=1e-6, seed=2),
        TinySpec("llama_q8_0_h8kv2", n_embd=128, n_layer=3, n_head=8, n_head_kv=2, n_ff=192,
                 wtype="Q8_0", tied=False, rope_base=500000.0, rms_eps=1e-5, seed=3),
        TinySpec("llama_q4_0_h6kv1_tied", n_embd=96, n_head=6, n_head_kv=1, n_ff=96,
                 wtype="Q4_0", embd_type="Q8_0", tied=True, rope_base=10000.0,
                 rms_eps=1e-6, seed=4),
        TinySpec("llama_q4_1_h4kv2_tied", n_embd=64, n_layer=3, n_head=4, n_head_kv=2,
                 n_ff=160, wtype="Q4_1", embd_type="Q8_0", tied=True, rope_base=100000.0,
                 rms_eps=1e-5, seed=5),
        TinySpec("mistral_q4_0_h8kv2", n_embd=128, n_head=8, n_head_kv=2, n_ff=224,
                 wtype="Q4_0", embd_type="Q4_0", tied=False, rope_base=1e6, rms_eps=1e-5,
                 seed=6),
        TinySpec("mistral_f16_h4kv1", n_embd=128, n_layer=3, n_head=4, n_head_kv=1,
                 n_ff=256, wtype="F16", tied=False, rope_base=1e6, rms_eps=1e-5, seed=7),
        # the K-quant and IQ4 types, which gguf cannot quantize: random blocks (see below)
        TinySpec("llama_kquants_h4kv2", n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512,
                 wtype="Q4_K", embd_type="Q6_K", tied=False, rope_base=10000.0, rms_eps=1e-5, seed=8,
                 tensor_types=(("attn_q", "Q2_K"), ("attn_k", "Q3_K"), ("attn_v", "IQ4_NL"),
                               ("attn_output", "Q5_K"), ("ffn_gate", "IQ4_XS"), ("ffn_up", "Q3_K"),
                               ("ffn_down", "Q2_K"), ("output.weight", "Q6_K"))),
    ]
}
DEFAULT_VARIANT = "llama_f32_h4kv4"


def grammar_takes(matcher, text: str) -> bool:
    """Whether a grammar matcher (bound to a tiny model) takes text in full, fed as the tiny
    vocabulary's byte tokens, from its start."""
    from pykv._ffi import lib
    names = tiny_vocab()[0]
    if lib.pykv_grammar_reset(matcher) != lib.PYKV_OK:
        raise AssertionError("pykv_grammar_reset failed")
    for b in text.encode():
        if lib.pykv_grammar_accept(matcher, names.index(f"<0x{b:02X}>")) != lib.PYKV_OK:
            return False
    return bool(lib.pykv_grammar_is_complete(matcher))

def variant(name: str, **changes) -> TinySpec:
    spec = VARIANTS[name]
    return replace(spec, **changes) if changes else spec


# ---- weights ------------------------------------------------------------------------

def _weights(spec: TinySpec) -> dict:
    """Float32 weights in NumPy (row-major) shape: linear (n_out, n_in), norms (n,)."""
    rng = np.random.default_rng(spec.seed)
    E, F, D = spec.n_embd, spec.n_ff, spec.head_dim
    kv = spec.n_head_kv * D

    def lin(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((spec.n_vocab, E)).astype(np.float32)}
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w[p + "attn_norm.weight"] = norm(E)
        w[p + "attn_q.weight"] = lin(spec.n_head * D, E)
        w[p + "attn_k.weight"] = lin(kv, E)
        w[p + "attn_v.weight"] = lin(kv, E)
        w[p + "attn_output.weight"] = lin(E, spec.n_head * D)
        w[p + "ffn_norm.weight"] = norm(E)
        w[p + "ffn_gate.weight"] = lin(F, E)
        w[p + "ffn_up.weight"] = lin(F, E)
        w[p + "ffn_down.weight"] = lin(E, F)
    w["output_norm.weight"] = norm(E)
    if not spec.tied:
        w["output.weight"] = lin(spec.n_vocab, E)
    return w


_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K": 15}

# Byte offsets of the f16 scale fields in the blocks of the types gguf cannot quantize.
_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                 "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _random_blocks(arr: np.ndarray, qtype, seed: int) -> np.ndarray:
    """Blocks of random bytes in arr's shape whose scale fields are set so that the weights
    they stand for have arr's RMS (the values are whatever the bytes say: the reference reads
    them back with gguf's dequantizer, so the tests compare the same weights)."""
    import gguf
    from gguf.quants import dequantize

    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(arr.size // block, block_bytes), dtype=np.uint8)

    def set_scales(value):
        for off in _SCALE_FIELDS[qtype.name]:
            raw[:, off:off + 2] = np.full(len(raw), value, dtype=np.float16).view(np.uint8).reshape(-1, 2)

    set_scales(1.0)
    rms = float(np.sqrt(np.mean(dequantize(raw.reshape(-1), qtype) ** 2)))
    set_scales(float(np.sqrt(np.mean(arr.astype(np.float64) ** 2))) / rms)
    return raw.reshape(arr.shape[0], -1)


def _add_tensor(writer, name: str, arr: np.ndarray, qtype_name: str, seed: int = 0) -> None:
    import gguf
    from gguf.quants import quantize

    if arr.ndim == 1 or qtype_name == "F32":
        writer.add_tensor(name, arr.astype(np.float32))
    elif qtype_name == "F16":
        writer.add_tensor(name, arr.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[qtype_name]
        data = _random_blocks(arr, qtype, seed) if qtype_name in _SCALE_FIELDS else quantize(arr, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)


def write_tiny_gguf(spec: TinySpec, path) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` and return the path."""
    import gguf

    path = Path(path)
    arch = "llama"
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"pykv-tiny-{spec.name}")
    wr.add_context_length(spec.n_ctx_train)
    wr.add_embedding_length(spec.n_embd)
    wr.add_block_count(spec.n_layer)
    wr.add_feed_forward_length(spec.n_ff)
    wr.add_head_count(spec.n_head)
    wr.add_head_count_kv(spec.n_head_kv)
    wr.add_rope_dimension_count(spec.head_dim)
    wr.add_rope_freq_base(spec.rope_base)
    wr.add_layer_norm_rms_eps(spec.rms_eps)
    wr.add_vocab_size(spec.n_vocab)
    wr.add_file_type(_FILE_TYPE[spec.wtype])
    if spec.pooling_type is not None:
        wr.add_pooling_type(gguf.PoolingType(spec.pooling_type))
    for role, token in zip(("pre", "suf", "mid"), spec.fim):
        wr.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", token)

    tokens, scores, types = tiny_vocab(spec.n_vocab)
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_bos_token_id(BOS_ID)
    wr.add_eos_token_id(EOS_ID)
    wr.add_unk_token_id(UNK_ID)
    wr.add_add_bos_token(True)
    wr.add_add_eos_token(False)

    for name, arr in _weights(spec).items():
        if name in spec.omit:
            continue
        if name == "token_embd.weight":
            qt = spec.embd_type or spec.wtype
        else:
            qt = next((t for part, t in spec.tensor_types if part in name), spec.wtype)
        _add_tensor(wr, name, arr, qt, seed=spec.seed * 1000 + len(name) + sum(map(ord, name)))

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
