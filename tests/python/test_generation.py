"""Greedy generation on SmolLM2: deterministic, thread-count independent, and equal to
the greedy (argmax) continuation computed by torch/transformers.

Where the torch reference has a near-tie (top-2 logit gap < NEAR_TIE) at some step,
float32 summation-order differences may legitimately flip the choice, so tokens are
compared only up to (not including) the first such step.
"""

from __future__ import annotations

import numpy as np
import pytest

from _torch_reference import greedy_continuation
from _compare import EXACT
from pykv import Llama

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
N_NEW = 32
NEAR_TIE = 1e-3
GREEDY = dict(max_tokens=N_NEW, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0,
              repeat_penalty=1.0, seed=0)


def _open(path, **kw):
    return Llama(str(path), n_ctx=256, verbose=False, **EXACT, **kw)


def _eos_id(path):
    from gguf import GGUFReader

    return int(GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"].contents())


def _comparable_prefix(gaps):
    """Number of leading steps whose reference choice is not a near-tie."""
    for i, g in enumerate(gaps):
        if g < NEAR_TIE:
            return i
    return len(gaps)


@pytest.fixture(scope="module")
def torch_greedy(smollm2_path):
    with _open(smollm2_path) as llm:
        prompt_ids = llm.tokenize(PROMPT, add_bos=True, special=True)  # as generate()
    ids, gaps = greedy_continuation(smollm2_path, prompt_ids, N_NEW, eos_id=_eos_id(smollm2_path))
    return prompt_ids, ids, gaps


def test_greedy_is_deterministic_across_runs(smollm2_path):
    with _open(smollm2_path) as llm:
        a = llm.generate(PROMPT, **GREEDY)
        b = llm.generate(PROMPT, **GREEDY)
    assert len(a.tokens) > 0
    assert a.tokens == b.tokens
    assert a.text == b.text


def test_greedy_same_for_1_and_2_threads(smollm2_path):
    with _open(smollm2_path, n_threads=1) as llm:
        one = llm.generate(PROMPT, **GREEDY)
    with _open(smollm2_path, n_threads=2) as llm:
        two = llm.generate(PROMPT, **GREEDY)
    assert one.tokens == two.tokens
    assert one.text == two.text


def test_generate_matches_torch_greedy(smollm2_path, torch_greedy):
    _, ref_ids, gaps = torch_greedy
    n = _comparable_prefix(gaps)
    assert n >= 8, f"reference has a near-tie at step {n}; prompt too ambiguous for this test"
    with _open(smollm2_path) as llm:
        res = llm.generate(PROMPT, **GREEDY)
        # generate() stops before an end-of-generation token and does not return it
        eog_at = next((i for i, t in enumerate(ref_ids) if llm.is_eog(t)), None)
    ref = ref_ids if eog_at is None else ref_ids[:eog_at]
    got = list(res.tokens)
    assert got[:n] == ref[:n], f"pykv {got[:n]} != torch {ref[:n]} (compared {n} steps)"
    if n == len(gaps):  # no near-tie anywhere: the whole continuation must match
        assert got == ref
        # pykv reports an end-of-generation token as "stop" (llama-cpp-python's habit)
        assert res.finish_reason == ("stop" if eog_at is not None else "length")


def test_eval_argmax_loop_matches_torch_greedy(smollm2_path, torch_greedy):
    """Same check through eval()/logits(), independent of pykv's sampler."""
    prompt_ids, ref_ids, gaps = torch_greedy
    n = _comparable_prefix(gaps)
    got = []
    with _open(smollm2_path) as llm:
        llm.eval(prompt_ids)
        for _ in range(n):
            nxt = int(np.argmax(llm.logits()))
            got.append(nxt)
            llm.eval([nxt])
    assert got == ref_ids[:n]


def test_empty_prompt_starts_from_bos_like_torch(smollm2_path):
    """An empty text prompt starts from BOS (llama-cpp-python's rule): SmolLM2 adds no BOS
    itself, so without it there is nothing to evaluate."""
    with _open(smollm2_path) as llm:
        assert llm.tokenize("", add_bos=True) == []
        bos = llm.token_bos()
        res = llm.generate("", **dict(GREEDY, max_tokens=8))
        assert res.prompt_tokens == 1
        ref_ids, gaps = greedy_continuation(smollm2_path, [bos], 8, eos_id=_eos_id(smollm2_path))
        n = _comparable_prefix(gaps)
        eog_at = next((i for i, t in enumerate(ref_ids) if llm.is_eog(t)), len(ref_ids))
        n = min(n, eog_at)
        assert n >= 4 and list(res.tokens)[:n] == ref_ids[:n]
        # bytes that no token spells leave no prompt: an error, not a silent BOS
        with pytest.raises(ValueError, match="no tokens"):
            llm.generate(b"\xff", max_tokens=2)
        with pytest.raises(ValueError, match="empty"):
            llm.generate([], max_tokens=2)
