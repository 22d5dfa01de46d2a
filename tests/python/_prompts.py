"""Deterministic English-like prompt texts of any length (no data files needed)."""

from __future__ import annotations

import random

SHORT = "The capital of France is"

_SUBJECTS = [
    "The old lighthouse keeper", "A young engineer", "The river", "Our neighbour's cat",
    "The committee", "A small bakery", "The museum guide", "Every student in the class",
    "The northern train", "A curious child", "The city council", "The orchestra",
]
_VERBS = [
    "carefully examined", "quietly repaired", "walked past", "wrote a letter about",
    "painted", "argued over", "measured", "remembered", "photographed", "described",
    "ignored", "celebrated",
]
_OBJECTS = [
    "the broken clock on the wall", "a map of the harbour", "the first snow of winter",
    "the price of fresh bread", "an unfinished bridge", "the history of the valley",
    "a box of forgotten photographs", "the schedule for next week", "the tallest tree",
    "the sound of distant bells", "a recipe for apple pie", "the results of the election",
]
_ENDINGS = [
    "before the sun went down.", "while everyone else was asleep.", "with great patience.",
    "for the third time that year.", "although nobody had asked.", "and then went home.",
    "because it seemed important.", "in the middle of the afternoon.",
]


def prose(n_sentences: int, seed: int = 0) -> str:
    """Return ``n_sentences`` pseudo-random sentences (deterministic for a seed)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        out.append(s)
        if i % 6 == 5:
            out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n")


def hf_prompt_ids(model_path, n_tokens: int, seed: int) -> list:
    """Exactly ``n_tokens`` ids of prose tokenized by the HF tokenizer of the GGUF."""
    from _torch_reference import hf_tokenize

    n_sentences = max(2, n_tokens // 10)
    ids = hf_tokenize(model_path, prose(n_sentences, seed=seed))
    assert len(ids) >= n_tokens, (len(ids), n_tokens)
    return ids[:n_tokens]
