"""Independent NumPy float64 reference forward pass for Llama-architecture GGUF files.

This module never imports pykv.  It reads a GGUF file with the ``gguf`` package,
dequantizes every tensor with ``gguf.quants.dequantize`` and runs the textbook
Llama forward pass in float64:

    x = token_embd[tokens]
    per layer:
        h = rmsnorm(x) * attn_norm
        q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T
        q, k = rope(q), rope(k)          # adjacent pairs (x[2i], x[2i+1])
        a = softmax(q k^T / sqrt(d) + causal mask) v   (GQA: q head h uses kv head h // rep)
        x = x + a @ Wo.T
        h = rmsnorm(x) * ffn_norm
        x = x + (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T
    logits = rmsnorm(x) * output_norm @ W_out.T   (W_out = output.weight or token_embd)

RoPE convention: llama.cpp's converter permutes attn_q / attn_k rows so that, on the
GGUF tensors, rotation acts on ADJACENT pairs with theta_i = base^(-2i / n_rot)
(llama.cpp "normal" rope).  Dimensions >= n_rot are left unrotated.

Shapes: a GGUF tensor with ggml shape ne = [n_in, n_out] reads as a NumPy array of
shape (n_out, n_in), so a linear layer is ``y = x @ W.T``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    rope_base: float
    rms_eps: float


@dataclass
class RefModel:
    hp: HParams
    tensors: dict = field(repr=False)
    types: dict = field(default_factory=dict, repr=False)   # tensor name -> GGUF type name

    def has(self, name: str) -> bool:
        return name in self.tensors

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name]


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load(path: str | os.PathLike) -> RefModel:
    """Read and dequantize a GGUF file into float64 arrays (cached by path + mtime)."""
    st = os.stat(path)
    return _load_cached(os.fspath(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4)
def _load_cached(path: str, _mtime: int, _size: int) -> RefModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)
    arch = _field(r, "general.architecture")
    tensors, types = {}, {}
    for t in r.tensors:
        types[t.name] = t.tensor_type.name
        arr = dequantize(np.asarray(t.data), t.tensor_type)
        # ggml ne = [ne0, ne1, ...]; NumPy shape is reversed (row-major).
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        tensors[t.name] = np.asarray(arr, dtype=np.float64).reshape(shape)

    n_embd = int(_field(r, f"{arch}.embedding_length"))
    n_head = int(_field(r, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(r, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(r, f"{arch}.attention.key_length", n_embd // n_head))
    n_vocab = tensors["token_embd.weight"].shape[0]
    hp = HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=int(_field(r, f"{arch}.block_count")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=int(_field(r, f"{arch}.rope.dimension_count", head_dim)),
        n_ff=int(_field(r, f"{arch}.feed_forward_length")),
        rope_base=float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
    )
    return RefModel(hp=hp, tensors=tensors, types=types)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def rope_adjacent(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """Rotate adjacent pairs. x: (T, H, D); pos: (T,)."""
    out = x.copy()
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = base ** (-2.0 * i / n_rot)              # (n_rot/2,)
    ang = pos.astype(np.float64)[:, None] * inv_freq    # (T, n_rot/2)
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x0 = x[..., 0:n_rot:2]
    x1 = x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = x0 * cos - x1 * sin
    out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def _softmax(s: np.ndarray) -> np.ndarray:
    s = s - np.max(s, axis=-1, keepdims=True)
    e = np.exp(s)
    return e / np.sum(e, axis=-1, keepdims=True)


def attention(q, k, v, n_rep: int) -> np.ndarray:
    """Causal GQA attention. q: (T, Hq, D); k, v: (T, Hkv, D). Returns (T, Hq, D)."""
    T, Hq, D = q.shape
    scale = 1.0 / np.sqrt(D)
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    out = np.empty_like(q)
    for h in range(Hq):
        kh = h // n_rep
        s = (q[:, h, :] @ k[:, kh, :].T) * scale + mask
        out[:, h, :] = _softmax(s) @ v[:, kh, :]
    return out


# Weight types whose decode-step product pykv takes with 8-bit activations (quant-q8.h).
INT8_ACT_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                  "IQ4_XS"}


# Weight types whose prefill product (several tokens) pykv takes with 8-bit activations too,
# for rows of whole 256-element super-blocks (gemm-q8.h), or, for the types of 32-element
# blocks, of any whole number of blocks except in q/k/v (ops.h); the others take float ones.
# The types of 8-bit quants (INT8_PREFILL_8BIT) only on a CPU with AVX-512 VNNI.
INT8_PREFILL_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
INT8_PREFILL_8BIT = {"Q8_0", "IQ4_NL", "IQ4_XS"}
INT8_PREFILL_ANY_WIDTH = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}


def int8_prefill_takes(name: str, wtype: str, cols: int, eight_bit: bool = False) -> bool:
    """Whether pykv's prefill multiplies the weight `name` (rows of cols elements of wtype)
    with 8-bit activations; eight_bit: on a CPU where the 8-bit types are packed too."""
    if (wtype not in INT8_PREFILL_TYPES and not (eight_bit and wtype in INT8_PREFILL_8BIT)) or cols % 32:
        return False
    qkv = name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight"))
    return cols % 256 == 0 or (wtype in INT8_PREFILL_ANY_WIDTH and not qkv)


def q8_roundtrip(x: np.ndarray, half_scale: bool = False, margins: list | None = None) -> np.ndarray:
    """Rows of x quantised as pykv's fast path does (blocks of 32, d = max|x| / 127,
    round half to even, in float32) and turned back into numbers. half_scale=True: the
    scale is then stored as an IEEE half, as in a Q8_0 block (pykv's q8_0 KV cache).
    margins: gets the smallest distance of any x / d from a rounding boundary (in steps;
    below ~1e-5, pykv's float32 inputs may round the other way)."""
    x32 = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.max(np.abs(x32), axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    y = x32 * inv
    if margins is not None:
        margins.append(float(np.min(np.abs(np.abs(y - np.floor(y)) - 0.5))))
    q = np.rint(y)
    if half_scale:
        d = d.astype(np.float16)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def _stored(x, kind: str, margins):
    """Keys or values as a cache of this kind (f32, f16, q8_0) gives them back."""
    if kind == "f16":
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    return q8_roundtrip(x, half_scale=True, margins=margins) if kind == "q8_0" else x


def forward(model, tokens, int8_rows_from=None, kv_f16=False, hidden=False, int8_prefill=False,
            kv_q8_0=False, q8_margins: list | None = None, kv_types=None, int8_prefill_8bit=False) -> np.ndarray:
    """Return float64 logits of shape (len(tokens), n_vocab) for a fresh context; with
    hidden=True, the hidden states after the output norm instead, (len(tokens), n_embd).

    int8_rows_from=i: tokens i.. are decode steps on pykv's fast path, so the inputs of
    their products with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights are quantised first (the logits
    product too, for every row: pykv computes logits one row at a time).
    int8_prefill=True: the tokens before int8_rows_from (all of them without it) are one
    prefill chunk on pykv's fast path: the inputs of their products with the weights that
    int8_prefill_takes are quantised the same way (the logits product, one row at a time, as
    for decode steps); int8_prefill_8bit=True: Q8_0 and IQ4 weights among them (a CPU with
    AVX-512 VNNI, where pykv.system_info()'s kernels include "vnni").
    kv_f16=True: keys (after RoPE) and values are rounded to IEEE halves, as pykv's default
    cache stores them. kv_q8_0=True: they go through Q8_0 blocks instead (kv_type="q8_0"),
    and q8_margins (a list) gets each rounding's margin (q8_roundtrip). kv_types=(keys,
    values), each "f32", "f16" or "q8_0": the two stored differently (kv_type, kv_type_v)."""
    if kv_types is None:
        kv_types = ("f16",) * 2 if kv_f16 else ("q8_0",) * 2 if kv_q8_0 else ("f32",) * 2
    if not isinstance(model, RefModel):
        model = load(model)
    hp = model.hp

    def lin(h, name, rows_from=int8_rows_from):
        wtype = model.types.get(name)
        h = h.copy()
        if int8_prefill and int8_prefill_takes(name, wtype, h.shape[1], int8_prefill_8bit):
            stop = len(h) if rows_from is None else rows_from
            h[:stop] = q8_roundtrip(h[:stop])
        if rows_from is not None and wtype in INT8_ACT_TYPES:
            h[rows_from:] = q8_roundtrip(h[rows_from:])
        return h @ model.w(name).T
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos = np.arange(T)
    n_rep = hp.n_head // hp.n_head_kv

    x = model.w("token_embd.weight")[tokens]
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = rms_norm(x, model.w(p + "attn_norm.weight"), hp.rms_eps)
        q = lin(h, p + "attn_q.weight").reshape(T, hp.n_head, hp.head_dim)
        k = lin(h, p + "attn_k.weight").reshape(T, hp.n_head_kv, hp.head_dim)
        v = lin(h, p + "attn_v.weight").reshape(T, hp.n_head_kv, hp.head_dim)
        q = rope_adjacent(q, pos, hp.n_rot, hp.rope_base)
        k = rope_adjacent(k, pos, hp.n_rot, hp.rope_base)
        k, v = _stored(k, kv_types[0], q8_margins), _stored(v, kv_types[1], q8_margins)
        a = attention(q, k, v, n_rep).reshape(T, hp.n_head * hp.head_dim)
        x = x + lin(a, p + "attn_output.weight")

        h = rms_norm(x, model.w(p + "ffn_norm.weight"), hp.rms_eps)
        g = lin(h, p + "ffn_gate.weight")
        u = lin(h, p + "ffn_up.weight")
        silu = g / (1.0 + np.exp(-g))
        x = x + lin(silu * u, p + "ffn_down.weight")

    x = rms_norm(x, model.w("output_norm.weight"), hp.rms_eps)
    if hidden:
        return x
    out_name = "output.weight" if model.has("output.weight") else "token_embd.weight"
    return lin(x, out_name, None if int8_rows_from is None and not int8_prefill else 0)
