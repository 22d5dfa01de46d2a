"""Embeddings, as llama-cpp-python's Llama.embed and create_embedding: each text is run through
the model on its own (the context is cleared before and after) and its tokens' hidden states
after the output norm are pooled (llama.cpp's embeddings of a decoder model)."""
from __future__ import annotations

from typing import List, Union

import numpy as np

from . import errors

# llama.cpp's enum llama_pooling_type, which llama-cpp-python passes as pooling_type
POOLING_NAMES = {-1: None, 0: "none", 1: "mean", 2: "cls", 3: "last"}


def pooling_name(pooling_type, model_metadata: dict) -> str:
    """'none' | 'mean' | 'cls' | 'last' from a name or llama.cpp's number; None (or -1) takes
    the model's `<arch>.pooling_type` and, as llama.cpp, 'none' when it has none."""
    if isinstance(pooling_type, bool):
        pooling_type = str(pooling_type)   # refused below
    if isinstance(pooling_type, int):
        if pooling_type not in POOLING_NAMES:
            raise errors.InvalidArgumentError(
                f"pooling_type {pooling_type} is not supported: use none (0), mean (1), cls (2) or last (3)")
        pooling_type = POOLING_NAMES[pooling_type]
    if pooling_type is None:
        arch = model_metadata.get("general.architecture", "llama")
        declared = model_metadata.get(f"{arch}.pooling_type")
        return POOLING_NAMES.get(int(declared), "none") if declared is not None and declared.isdigit() else "none"
    name = str(pooling_type).lower()
    if name not in ("none", "mean", "cls", "last"):
        raise errors.InvalidArgumentError(
            f"pooling_type {pooling_type!r} is not supported: use 'none', 'mean', 'cls' or 'last'")
    return name


def pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One vector per text from its tokens' rows (n_tokens, n_embd); 'none' keeps the rows."""
    if pooling == "mean":
        return rows.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling == "cls":
        return rows[0]
    if pooling == "last":
        return rows[-1]
    return rows


def normalized(vectors: np.ndarray, p: int = 2) -> np.ndarray:
    """Each vector (the last axis) divided by its p-norm (llama.cpp's --embd-normalize: 2
    Euclidean, 1 taxicab, any p > 2; 0 scales the largest magnitude to 32760, as int16;
    -1 leaves it); zero vectors stay zero."""
    x = np.asarray(vectors, dtype=np.float64)
    if p < 0:
        return np.asarray(vectors, dtype=np.float32)
    if p == 0:
        norm = np.abs(x).max(axis=-1, keepdims=True) / 32760.0
    else:
        norm = (np.abs(x) ** p).sum(axis=-1, keepdims=True) ** (1.0 / p)
    return (x / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def _text_tokens(llm, text, truncate: bool) -> List[int]:
    if not isinstance(text, (str, bytes)):
        raise errors.InvalidArgumentError(f"embed: each input must be a string, got {type(text).__name__}")
    tokens = llm.tokenize(text, add_bos=True, special=False)
    if not tokens:
        raise errors.InvalidArgumentError(
            "embed: an input has no tokens" + (" (it is empty)" if not text else ""))
    if len(tokens) > llm.n_ctx:
        if not truncate:
            raise errors.ContextOverflowError(
                f"embed: an input has {len(tokens)} tokens, more than the context size n_ctx={llm.n_ctx} "
                "(truncate=True keeps its first n_ctx tokens)")
        tokens = tokens[:llm.n_ctx]
    return tokens


def embed(llm, input: Union[str, bytes, List[str]], normalize: bool, truncate: bool, return_count: bool):
    if not llm.embedding:
        raise errors.InvalidArgumentError("embed: create the Llama with embedding=True to compute embeddings")
    texts = [input] if isinstance(input, (str, bytes)) else list(input)
    token_lists = [_text_tokens(llm, text, truncate) for text in texts]   # all checked before any runs
    vectors, total = [], 0
    try:
        for tokens in token_lists:
            llm.reset()
            llm.eval(tokens)
            vector = pool(llm.embeddings(), llm.pooling_type)
            vectors.append((normalized(vector) if normalize else vector).tolist())
            total += len(tokens)
    finally:
        llm.reset()
    output = vectors[0] if isinstance(input, (str, bytes)) else vectors
    return (output, total) if return_count else output


def create_embedding(llm, input, model=None) -> dict:
    """The OpenAI embeddings response: {"object": "list", "data": [{"object": "embedding",
    "embedding", "index"}], "model", "usage"}."""
    vectors, total = embed(llm, [input] if isinstance(input, (str, bytes)) else input,
                           normalize=False, truncate=True, return_count=True)
    return {"object": "list",
            "data": [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)],
            "model": model if model is not None else llm.model_path,
            "usage": {"prompt_tokens": total, "total_tokens": total}}
