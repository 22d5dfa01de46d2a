"""Independent torch/transformers reference for a GGUF model (float32, CPU).

transformers loads the GGUF itself (``from_pretrained(dir, gguf_file=name)``): it
dequantizes every tensor with the gguf package and undoes llama.cpp's Q/K permutation,
then runs its own Llama implementation.  Nothing here imports pykv.

Results are cached as .npy/.npz files under tests/models/ref/ (gitignored), keyed by a
hash of the model file and of the request (token ids, positions, ...), so that reruns
do not load torch models again.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

CACHE_DIR = Path(__file__).resolve().parents[1] / "models" / "ref"


# ---- cache keys ---------------------------------------------------------------------

@lru_cache(maxsize=16)
def _digest_cached(path: str, _mtime: int, _size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:20]


def file_digest(path) -> str:
    st = os.stat(path)
    return _digest_cached(os.fspath(path), st.st_mtime_ns, st.st_size)


def _cache_path(path, kind: str, request) -> Path:
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:20]
    return CACHE_DIR / file_digest(path) / f"{kind}-{key}"


def _save(p: Path, **arrays) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, p.with_suffix(".npz"))


def _load(p: Path):
    f = p.with_suffix(".npz")
    if f.exists():
        try:
            with np.load(f) as z:
                return {k: z[k] for k in z.files}
        except Exception:  # a corrupt cache entry is recomputed
            return None
    return None


# ---- torch model --------------------------------------------------------------------

@lru_cache(maxsize=2)
def _model(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    p = Path(path)
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                             dtype=torch.float32)
    m.eval()
    return m


@lru_cache(maxsize=2)
def _tokenizer(path: str):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def _forward(path, tokens):
    import torch

    with torch.no_grad():
        out = _model(os.fspath(path))(torch.tensor([list(tokens)], dtype=torch.long))
    return out.logits[0].to(torch.float64).numpy()


@lru_cache(maxsize=4)
def _gguf_adds_bos(path: str):
    """tokenizer.ggml.add_bos_token of the GGUF, or None when it does not say."""
    import gguf

    field = gguf.GGUFReader(path).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.parts[field.data[0]][0])


# ---- public API ---------------------------------------------------------------------

def hf_tokenize(path, text: str) -> list:
    """Token ids of ``text`` from the HF tokenizer built from the GGUF (no special tokens
    added beyond what the GGUF's tokenizer config asks for)."""
    req = {"text": text}
    cp = _cache_path(path, "tok", req)
    hit = _load(cp)
    if hit is not None:
        return hit["ids"].tolist()
    tok = _tokenizer(os.fspath(path))
    adds_bos = _gguf_adds_bos(os.fspath(path))
    if adds_bos is None:
        ids = tok(text)["input_ids"]
    else:   # the GGUF's word (transformers 5.2's GGUF tokenizer adds BOS whatever it says)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if adds_bos and tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + list(ids)
    _save(cp, ids=np.asarray(ids, dtype=np.int64))
    return list(ids)


def reference_logits(path, tokens, positions=(-1,)) -> np.ndarray:
    """float64 logits at ``positions`` (rows) for a fresh context fed ``tokens``."""
    tokens = [int(t) for t in tokens]
    positions = [int(p) for p in positions]
    req = {"tokens": tokens, "positions": positions}
    cp = _cache_path(path, "logits", req)
    hit = _load(cp)
    if hit is not None:
        return hit["logits"].astype(np.float64)
    logits = _forward(path, tokens)[positions]
    _save(cp, logits=logits.astype(np.float32))
    # return what the cache will return next time (float32 storage)
    return logits.astype(np.float32).astype(np.float64)


def reference_hidden(path, tokens) -> np.ndarray:
    """float64 hidden states after the model's final norm (the base model's
    last_hidden_state), one row per token, for a fresh context fed ``tokens``."""
    import torch

    tokens = [int(t) for t in tokens]
    cp = _cache_path(path, "hidden", {"tokens": tokens})
    hit = _load(cp)
    if hit is not None:
        return hit["hidden"].astype(np.float64)
    with torch.no_grad():
        out = _model(os.fspath(path)).model(torch.tensor([tokens], dtype=torch.long))
    hidden = out.last_hidden_state[0].to(torch.float32).numpy()
    _save(cp, hidden=hidden)
    return hidden.astype(np.float64)


def greedy_continuation(path, tokens, n: int, eos_id=None):
    """Greedy (argmax) continuation of ``tokens`` for ``n`` steps, stopping after
    ``eos_id``.  Returns (generated ids, top-1 minus top-2 logit gap per step)."""
    tokens = [int(t) for t in tokens]
    req = {"tokens": tokens, "n": int(n), "eos": eos_id}
    cp = _cache_path(path, "greedy", req)
    hit = _load(cp)
    if hit is not None:
        return hit["ids"].tolist(), hit["gaps"].tolist()
    import torch

    model = _model(os.fspath(path))
    ids, gaps = [], []
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long), use_cache=True)
        for _ in range(n):
            last = out.logits[0, -1].to(torch.float64).numpy()
            top2 = np.sort(last)[-2:]
            nxt = int(np.argmax(last))
            ids.append(nxt)
            gaps.append(float(top2[1] - top2[0]))
            if eos_id is not None and nxt == eos_id:
                break
            out = model(torch.tensor([[nxt]], dtype=torch.long),
                        past_key_values=out.past_key_values, use_cache=True)
    _save(cp, ids=np.asarray(ids, dtype=np.int64), gaps=np.asarray(gaps))
    return ids, gaps
