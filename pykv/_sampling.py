"""What generate() needs around the C sampler: building the chain (logit bias, penalties,
filters, a seeded draw) with its arguments checked, and the log-probabilities that
logprobs=... reports for each generated token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Tuple

import numpy as np

from . import errors
from ._ffi import check, ffi, lib, new_params


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (the softmax of its logits, before
    any penalty, bias or filter, as llama-cpp-python reports it) and the `top` most likely
    tokens at that step, best first, as (token, logprob) pairs."""
    token: int
    logprob: float
    top: List[Tuple[int, float]] = field(default_factory=list)


def logit_bias_items(logit_bias: Optional[Mapping], n_vocab: Optional[int] = None):
    """(tokens, biases) from {token id: bias}; ids may be ints or numeric strings (the OpenAI
    form); a bias of -inf bans the token. InvalidArgumentError names an id that is not one, or
    lies outside the vocabulary (or int32 without n_vocab), or a bias that is not a number; the
    C sampler refuses NaN and +inf biases itself."""
    tokens, biases = [], []
    for key, value in (logit_bias or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(f"logit_bias: {key!r} is not a token id") from None
        if not 0 <= token < (n_vocab if n_vocab is not None else 2**31):
            raise errors.InvalidArgumentError(
                f"logit_bias: token id {token} is outside the vocabulary" +
                (f" (0..{n_vocab - 1})" if n_vocab is not None else ""))
        try:
            bias = float(value)
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(f"logit_bias: the bias of token {token} is {value!r}, not a number") from None
        tokens.append(token)
        biases.append(bias)
    return tokens, biases


def make_sampler(temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logit_bias: Optional[Mapping] = None, n_vocab: Optional[int] = None,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 typical_p: float = 1.0):
    """A C sampler chain; InvalidArgumentError names the first parameter out of range
    (logit_bias ids are checked against n_vocab when it is given). mirostat_mode 1 or 2
    replaces top-k, top-p and min-p with Mirostat (target surprise mirostat_tau bits,
    learning rate mirostat_eta), as llama.cpp. typical_p < 1 keeps the locally typical tokens
    after top-k (llama.cpp's typical sampling)."""
    params = new_params("struct pykv_sampler_params", lib.pykv_sampler_default_params)
    params.temperature = temperature
    params.top_k = top_k
    params.top_p = top_p
    params.min_p = min_p
    params.repeat_penalty = repeat_penalty
    params.repeat_last_n = repeat_last_n
    params.frequency_penalty = frequency_penalty
    params.presence_penalty = presence_penalty
    params.seed = seed & 0xFFFFFFFF
    if isinstance(mirostat_mode, bool) or not isinstance(mirostat_mode, int):
        raise errors.InvalidArgumentError(f"mirostat_mode must be 0, 1 or 2, got {mirostat_mode!r}")
    params.mirostat = max(-1, min(mirostat_mode, 3))   # out of range either way: the C check names it
    params.mirostat_tau = mirostat_tau
    params.mirostat_eta = mirostat_eta
    params.typical_p = typical_p
    tokens, biases = logit_bias_items(logit_bias, n_vocab)
    out = ffi.new("pykv_sampler **")
    check(lib.pykv_sampler_init(params, out))
    sampler = ffi.gc(out[0], lib.pykv_sampler_free)
    if tokens:
        check(lib.pykv_sampler_set_logit_bias(sampler, len(tokens), ffi.new("pykv_token[]", tokens),
                                              ffi.new("float[]", biases)))
    return sampler


def check_n_logprobs(n, name: str = "logprobs") -> Optional[int]:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise errors.InvalidArgumentError(f"{name} must be None or a number of alternatives >= 0, got {n!r}")
    return n


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64 (one new array: the rows may be many)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """The log-softmax of logits (computed in float64) at token, and its n_top best entries."""
    logp = log_softmax(logits)
    top: List[Tuple[int, float]] = []
    if n_top > 0:
        n_top = min(n_top, len(logp))
        best = np.argpartition(-logp, n_top - 1)[:n_top]
        best = best[np.lexsort((best, -logp[best]))]   # higher first, lower id on ties
        top = [(int(t), float(logp[t])) for t in best]
    return TokenLogprob(int(token), float(logp[token]), top)
