"""Perplexity of a text, as llama.cpp's llama-perplexity measures it, under the context's KV
cache policy.

The tokens are cut into chunks of `chunk_size`; each chunk starts from an empty context (its
first token replaced by BOS when the model adds one) and only its second half is scored, so
every scored token has at least half a chunk before it. Here the first half is evaluated
as a prompt (the policy compresses it on its schedule) and the second half continues it:
as one more prefill call (default), or token by token as decode steps (`decode=True`, which
is what a policy that evicts while generating acts on). With `full` both give llama.cpp's
numbers for the same chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import numpy as np

from . import errors
from ._ffi import lib
from ._sampling import log_softmax


@dataclass
class PerplexityResult:
    ppl: float                  # exp(mean negative log-likelihood of the scored tokens)
    ppl_err: float              # its standard error (llama.cpp's estimate)
    n_scored: int               # tokens scored
    chunk_size: int
    chunks: List[float] = field(default_factory=list)   # the running estimate after each chunk
    nll: float = 0.0            # mean negative log-likelihood (nats)
    kv_stats: dict = field(default_factory=dict)   # the cache after the last chunk


def _token_nll(rows: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(row)[target] per row, in float64."""
    return -log_softmax(rows)[np.arange(len(targets)), np.asarray(targets)]


def _estimate(nll_sum: float, nll2_sum: float, n: int):
    mean = nll_sum / n
    var = max(nll2_sum / n - mean * mean, 0.0)
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / (n - 1)) if n > 1 else float("nan"), mean


def _chunk_nll(llm, chunk: List[int], decode: bool) -> np.ndarray:
    first = len(chunk) // 2
    llm.reset()
    llm.eval(chunk[:first])
    rest = chunk[first:]
    if decode:
        rows = []
        for token in rest[:-1]:
            llm.eval([token])
            rows.append(llm.logits())
        return _token_nll(np.stack(rows), rest[1:])
    with llm._keeping_all_logits():
        rows = llm._eval_logit_rows(rest)
        return _token_nll(rows[:-1], rest[1:])


def perplexity(llm, text: Union[str, bytes, Sequence[int]], chunk_size: Optional[int] = None,
               max_chunks: Optional[int] = None, decode: bool = False,
               progress: Optional[Callable[[int, int, float], None]] = None) -> PerplexityResult:
    """Perplexity of text (or token ids) over its first len // chunk_size chunks (at most
    max_chunks); chunk_size defaults to the context size and may not exceed it.
    progress(i, n_chunks, running_ppl) is called after each chunk. The context is left empty."""
    size = llm.n_ctx if chunk_size is None else chunk_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 4:
        raise errors.InvalidArgumentError(f"chunk_size must be an integer of at least 4 tokens, got {chunk_size!r}")
    if size > llm.n_ctx:
        raise errors.ContextOverflowError(f"chunk_size {size} is larger than the context size n_ctx={llm.n_ctx}")
    if max_chunks is not None and (isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1):
        raise errors.InvalidArgumentError(f"max_chunks must be a positive integer, got {max_chunks!r}")
    if isinstance(text, (str, bytes)):
        tokens = llm.tokenize(text, add_bos=True)   # llama-perplexity's: BOS first when the model adds one
    else:
        tokens = [int(t) for t in text]
    n_chunks = len(tokens) // size
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise errors.InvalidArgumentError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of {size}: give a longer text or a smaller chunk")
    bos = llm.token_bos() if lib.pykv_vocab_add_bos(llm._need_model()) else -1
    result = PerplexityResult(ppl=float("nan"), ppl_err=float("nan"), n_scored=0, chunk_size=size)
    nll_sum = nll2_sum = 0.0
    try:
        for i in range(n_chunks):
            chunk = tokens[i * size:(i + 1) * size]
            if bos >= 0:
                chunk[0] = bos   # as llama-perplexity: each chunk starts like a document
            nll = _chunk_nll(llm, chunk, decode)
            nll_sum += float(nll.sum())
            nll2_sum += float((nll * nll).sum())
            result.n_scored += len(nll)
            result.ppl, result.ppl_err, result.nll = _estimate(nll_sum, nll2_sum, result.n_scored)
            result.chunks.append(result.ppl)
            result.kv_stats = llm.kv_stats()
            if progress is not None:
                progress(i + 1, n_chunks, result.ppl)
    finally:
        llm.reset()
    return result
