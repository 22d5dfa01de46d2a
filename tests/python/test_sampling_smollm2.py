"""generate()'s logprobs, logit bias and frequency/presence penalties on SmolLM2, checked
against transformers' float32 logits for the same token sequence (one forward pass over the
prompt and what pykv generated), with the penalties redone in NumPy.

Exact path (float activations, f32 cache): logits within 2e-4 of transformers', so
log-probabilities within 1e-3 and every greedy pick equal to the reference's argmax except
where its top two are closer than NEAR_TIE.
"""

from __future__ import annotations

import numpy as np
import pytest

from _compare import EXACT
from _torch_reference import reference_logits
from pykv import Llama
from pykv.errors import InvalidArgumentError

pytestmark = pytest.mark.model

PROMPT = "Write a list of fruits: apple, banana,"
N_NEW = 24
NEAR_TIE = 2e-3
LOGPROB_ATOL = 5e-4


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with Llama(str(smollm2_path), n_ctx=256, **EXACT) as model:
        yield model


def _reference_rows(path, prompt_ids, generated):
    """transformers' logits at each step that chose a generated token."""
    seq = prompt_ids + generated
    positions = range(len(prompt_ids) - 1, len(seq) - 1)
    return reference_logits(path, seq[:-1], positions)


def test_logprobs_match_transformers(llm, smollm2_path):
    res = llm.generate(PROMPT, max_tokens=N_NEW, temperature=0.0, logprobs=5)
    prompt_ids = llm.tokenize(PROMPT, add_bos=True, special=True)
    assert len(res.logprobs) == len(res.tokens) == N_NEW
    ref = log_softmax(_reference_rows(smollm2_path, prompt_ids, res.tokens))
    for step, (entry, row) in enumerate(zip(res.logprobs, ref)):
        assert entry.token == res.tokens[step]
        assert abs(entry.logprob - row[entry.token]) < LOGPROB_ATOL, step
        assert len(entry.top) == 5
        got_ids = [t for t, _ in entry.top]
        for t, lp in entry.top:
            assert abs(lp - row[t]) < LOGPROB_ATOL, (step, t)
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        ranked = np.sort(row)[::-1]
        if ranked[4] - ranked[5] > 2 * LOGPROB_ATOL:   # the reference's top 5 is well defined
            assert set(got_ids) == set(np.argsort(-row)[:5].tolist()), step
        assert got_ids[0] == entry.token or row[got_ids[0]] - row[entry.token] < 2 * LOGPROB_ATOL


def test_logprobs_zero_alternatives_and_off(llm):
    res = llm.generate(PROMPT, max_tokens=4, temperature=0.0, logprobs=0)
    assert [e.top for e in res.logprobs] == [[]] * 4
    assert llm.generate(PROMPT, max_tokens=4, temperature=0.0).logprobs is None
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        llm.generate(PROMPT, max_tokens=1, logprobs=-1)
    for bad in (1.5, True):   # not an integer: a TypeError naming the argument
        with pytest.raises(TypeError, match="'logprobs' must be an integer"):
            llm.generate(PROMPT, max_tokens=1, logprobs=bad)


def test_penalties_and_bias_follow_the_reference(llm, smollm2_path):
    """Every greedy pick under repeat, frequency and presence penalties and a logit bias is the
    argmax of transformers' logits with the same chain redone in NumPy."""
    prompt_ids = llm.tokenize(PROMPT, add_bos=True, special=True)
    comma = llm.tokenize(",", add_bos=False)[0]
    bias = {comma: -2.0, llm.tokenize(" orange", add_bos=False)[0]: 3.0}
    cfg = dict(repeat_penalty=1.15, frequency_penalty=0.5, presence_penalty=0.4, repeat_last_n=32)
    res = llm.generate(prompt_ids, max_tokens=N_NEW, temperature=0.0, logit_bias=bias, **cfg)
    plain = llm.generate(prompt_ids, max_tokens=N_NEW, temperature=0.0)
    assert res.tokens != plain.tokens, "the penalties and bias should change this continuation"
    rows = _reference_rows(smollm2_path, prompt_ids, res.tokens)
    seq = list(prompt_ids)
    checked = 0
    for step, row in enumerate(rows):
        x = row.copy()
        for t, b in bias.items():
            x[t] += b
        tokens, counts = np.unique(seq[-cfg["repeat_last_n"]:], return_counts=True)
        for t, n in zip(tokens, counts):
            x[t] = x[t] * cfg["repeat_penalty"] if x[t] <= 0 else x[t] / cfg["repeat_penalty"]
            x[t] -= n * cfg["frequency_penalty"] + cfg["presence_penalty"]
        top2 = np.sort(x)[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            break   # past a near-tie the two sequences may part: stop comparing
        assert res.tokens[step] == int(np.argmax(x)), step
        seq.append(res.tokens[step])
        checked += 1
    assert checked >= 8


def test_logit_bias_bans_and_forces(llm, smollm2_path):
    prompt_ids = llm.tokenize(PROMPT, add_bos=True, special=True)
    row = reference_logits(smollm2_path, prompt_ids)[0]
    first, second = np.argsort(-row)[:2]
    assert row[first] - row[second] > NEAR_TIE
    banned = llm.generate(prompt_ids, max_tokens=1, temperature=0.0, logit_bias={str(first): float("-inf")})
    assert banned.tokens == [int(second)]   # OpenAI's string keys work too
    forced = llm.generate(prompt_ids, max_tokens=3, temperature=0.7, seed=3, logit_bias={123: 100.0})
    assert forced.tokens == [123, 123, 123]
    for bad, needle in (({llm.n_vocab: 1.0}, "outside the vocabulary"), ({"x": 1.0}, "not a token id"),
                        ({5: float("nan")}, "finite"), ({5: "big"}, "not a number")):
        with pytest.raises(InvalidArgumentError, match=needle):
            llm.generate(prompt_ids, max_tokens=1, logit_bias=bad)


def test_completion_logprobs_shape(llm):
    out = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0, logprobs=3)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == len(PROMPT)
    for i in range(1, len(lp["tokens"])):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == value and 3 <= len(top) <= 4   # the 3 best and the chosen token
        assert value <= 0
    streamed = list(llm.create_completion(PROMPT, max_tokens=8, temperature=0.0, logprobs=3, stream=True))
    merged = {k: [] for k in lp}
    for chunk in streamed:
        part = chunk["choices"][0]["logprobs"]
        for k in merged:
            merged[k] += part[k] if part else []
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    np.testing.assert_allclose(merged["token_logprobs"], lp["token_logprobs"], atol=1e-9)
    assert llm.create_completion(PROMPT, max_tokens=2)["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape(llm):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = llm.create_chat_completion(messages, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
    for c in content:
        assert bytes(c["bytes"]).decode("utf-8", "ignore") == c["token"]
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-12
    with pytest.raises(InvalidArgumentError, match="top_logprobs"):
        llm.create_chat_completion(messages, max_tokens=1, top_logprobs=2)
