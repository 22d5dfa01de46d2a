"""Fill in the middle (create_completion's `suffix`): the prompt llama.cpp builds for its
infill, [BOS] <FIM prefix> prefix <FIM suffix> suffix <FIM middle>, after which the model
writes what goes between the two texts. The three marker tokens come from the GGUF
(tokenizer.ggml.fim_pre/suf/mid_token_id, or the older prefix/suffix/middle_token_id) or,
as llama.cpp does, from the vocabulary's known marker texts."""
from __future__ import annotations

from typing import List, Tuple

from .. import errors

_KEYS = {"prefix": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
         "suffix": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
         "middle": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id")}
_TEXTS = {"prefix": ("<fim_prefix>", "<|fim_prefix|>", "<fim-prefix>", "<PRE>", "▁<PRE>", "[PREFIX]"),
          "suffix": ("<fim_suffix>", "<|fim_suffix|>", "<fim-suffix>", "<SUF>", "▁<SUF>", "[SUFFIX]"),
          "middle": ("<fim_middle>", "<|fim_middle|>", "<fim-middle>", "<MID>", "▁<MID>", "[MIDDLE]")}


def _marker(llm, metadata: dict, role: str) -> int:
    for key in _KEYS[role]:
        value = metadata.get(key, "")
        if value.lstrip("-").isdigit() and 0 <= int(value) < llm.n_vocab:
            return int(value)
    for text in _TEXTS[role]:
        ids = llm.tokenize(text, add_bos=False, special=True)
        if len(ids) == 1 and llm.token_to_piece(ids[0], special=True).decode("utf-8", "replace") == text:
            return ids[0]
    raise errors.InvalidArgumentError(
        f"suffix (fill in the middle) needs the model's FIM {role} token, and this model has none")


def fim_tokens(llm) -> Tuple[int, int, int]:
    """The model's (prefix, suffix, middle) marker tokens; InvalidArgumentError without them."""
    metadata = llm.metadata
    return tuple(_marker(llm, metadata, role) for role in ("prefix", "suffix", "middle"))


def infill_prompt(llm, prefix, suffix) -> List[int]:
    """The token ids of the infill prompt for the text before (prefix) and after (suffix) the
    gap; the texts' own special-token spellings are taken as plain text."""
    for name, value in (("prompt", prefix), ("suffix", suffix)):
        if not isinstance(value, (str, bytes)):
            raise errors.InvalidArgumentError(f"with a suffix, the {name} must be text, got {type(value).__name__}")
    pre, suf, mid = fim_tokens(llm)
    bos = llm.tokenize("", add_bos=True)   # [BOS] when the model adds one, else []

    def text(value):
        return llm.tokenize(value, add_bos=False, special=False) if value else []
    return bos + [pre] + text(prefix) + [suf] + text(suffix) + [mid]
