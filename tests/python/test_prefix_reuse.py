"""Cutting the cache back to a prefix (Llama.truncate, pykv_truncate) and generate()'s reuse
of the prefix a context already holds (llama-cpp-python's prefix match).

With the `full` policy a cut leaves exactly what a fresh run over the prefix leaves, so
evaluating more tokens after it must give the independent reference's logits for the
prefix plus those tokens (NumPy float64 on tiny models, torch on SmolLM2). An evicting
policy chose its entries with the later tokens in view: the cut is refused and nothing
changes, and generate() then evaluates the whole prompt afresh.
"""

from __future__ import annotations

import numpy as np
import pytest

import _reference
from _compare import EXACT, assert_logits_close
from _tiny_models import random_tokens
from _torch_reference import greedy_continuation
from pykv import InvalidArgumentError, Llama
from pykv.errors import GenerationCancelled

TINY_ATOL, TINY_RTOL = 1e-6, 2e-6   # vs the float64 reference, as test_chunked_prefill
GREEDY = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)
NEAR_TIE = 1e-3


@pytest.mark.parametrize("name,n_batch", [("llama_f32_h4kv4", 512), ("mistral_q4_0_h8kv2", 7)])
def test_cut_then_eval_equals_the_reference(tiny_model, name, n_batch):
    path = tiny_model(name)
    a, b, c = random_tokens(40, 1), random_tokens(30, 2), random_tokens(20, 3)
    with Llama(str(path), n_ctx=128, n_batch=n_batch, **EXACT) as llm:
        llm.eval(a + b)
        llm.truncate(len(a))
        assert llm.n_past == len(a) and llm.input_ids == a
        with pytest.raises(InvalidArgumentError, match="no logits"):
            llm.logits()   # they were the forgotten token's
        llm.eval(c)
        ref = _reference.forward(path, a + c)[-1]
        assert_logits_close(llm.logits(), ref, atol=TINY_ATOL, rtol_scale=TINY_RTOL, what=f"{name} cut + eval")
        stats = llm.kv_stats()
        assert stats["evicted"] == 0
        assert stats["entries"] == len(a + c) * sum(len(heads) for heads in stats["entries_per_head"])
        for layer, heads in enumerate(stats["entries_per_head"]):
            for head in range(len(heads)):
                assert llm.kv_positions(layer, head) == list(range(len(a + c)))


def test_cut_gives_the_memory_back(tiny_model):
    path = tiny_model()
    with Llama(str(path), n_ctx=1024, **EXACT) as llm, Llama(str(path), n_ctx=1024, **EXACT) as fresh:
        llm.eval(random_tokens(1000, 4))
        long = llm.kv_stats()
        llm.truncate(10)
        fresh.eval(random_tokens(10, 4))
        cut = llm.kv_stats()
        assert cut["bytes"] == fresh.kv_stats()["bytes"] < long["bytes"] / 20
        assert cut["peak_bytes"] == long["peak_bytes"]   # the peak since init stays


def test_cut_to_everything_keeps_the_logits(tiny_model):
    with Llama(str(tiny_model()), n_ctx=128, **EXACT) as llm:
        llm.eval(random_tokens(30, 5))
        before = llm.logits()
        llm.truncate(30)   # full: nothing to cut, allowed
        assert llm.n_past == 30
        np.testing.assert_array_equal(llm.logits(), before)


@pytest.mark.parametrize("n_keep", [-1, 31, 2.0, True, None])
def test_bad_cut_is_refused_and_changes_nothing(tiny_model, n_keep):
    with Llama(str(tiny_model()), n_ctx=128, **EXACT) as llm:
        tokens = random_tokens(30, 6)
        llm.eval(tokens)
        before = llm.logits()
        with pytest.raises(InvalidArgumentError, match="n_keep"):
            llm.truncate(n_keep)
        assert llm.n_past == 30 and llm.input_ids == tokens
        np.testing.assert_array_equal(llm.logits(), before)


@pytest.mark.parametrize("policy", ["snapkv", "streamingllm", "ems", "take"])
def test_evicting_policy_refuses_a_cut(tiny_model, policy):
    with Llama(str(tiny_model()), n_ctx=256, policy=policy, budget=40, **EXACT) as llm:
        tokens = random_tokens(120, 7)
        llm.eval(tokens)
        before, positions = llm.logits(), llm.kv_positions(0, 0)
        assert llm.kv_stats()["evicted"] > 0
        with pytest.raises(InvalidArgumentError, match=f"'{policy}' policy .* cannot be cut back"):
            llm.truncate(60)
        assert llm.n_past == 120 and llm.input_ids == tokens
        assert llm.kv_positions(0, 0) == positions
        np.testing.assert_array_equal(llm.logits(), before)
        with pytest.raises(InvalidArgumentError, match="cannot be cut back"):
            llm.truncate(120)   # refused even with nothing to cut: generate() then starts afresh
        assert llm.n_past == 120
        llm.truncate(0)     # a reset: allowed for any policy
        assert llm.n_past == 0 and llm.input_ids == [] and llm.kv_stats()["entries"] == 0


def test_cut_forgets_a_pending_cancel(tiny_model):
    with Llama(str(tiny_model()), n_ctx=128, **EXACT) as llm:
        llm.eval(random_tokens(20, 8))
        llm.cancel()
        with pytest.raises(GenerationCancelled):
            llm.eval([1])   # a pending cancel stops the next call
        llm.cancel()
        llm.truncate(10)
        llm.eval([1, 2])    # ... unless a cut came first, as a reset would
        assert llm.n_past == 12


# ---- generate() on SmolLM2 ----

@pytest.mark.model
def test_second_turn_reuses_the_first_and_matches_torch(smollm2_path):
    """A prompt that extends the previous call's tokens evaluates only the new ones, and its
    greedy continuation is torch's greedy continuation of the whole prompt."""
    with Llama(str(smollm2_path), n_ctx=512, **EXACT) as llm:
        first = llm.generate("The three primary colours are", max_tokens=24, **GREEDY)
        held = list(llm.input_ids)   # the prompt and every reply token but the last
        assert first.cached_tokens == 0 and len(held) == first.prompt_tokens + len(first.tokens) - 1
        prompt = held + first.tokens[-1:] + llm.tokenize(" In short,", add_bos=False)
        second = llm.generate(prompt, max_tokens=16, **GREEDY)
        assert second.cached_tokens == len(held)
        assert second.timings["prompt_n"] == len(prompt) - len(held)
        ref, gaps = greedy_continuation(smollm2_path, prompt, 16)
    n = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
    assert n >= 8, f"the reference has a near-tie at step {n}"
    assert second.tokens[:n] == ref[:n]


@pytest.mark.model
def test_reuse_needs_a_matching_prefix_and_the_full_policy(smollm2_path):
    prompt = "The capital of France is"
    with Llama(str(smollm2_path), n_ctx=512, **EXACT) as llm:
        a = llm.generate(prompt, max_tokens=8, **GREEDY)
        assert len(a.tokens) == 8
        again = llm.generate(prompt, max_tokens=8, **GREEDY)
        assert again.cached_tokens == a.prompt_tokens - 1   # the last is evaluated for its logits
        assert again.tokens == a.tokens
        # one token left to evaluate: the prompt's, as llama.cpp's server counts the tokens it
        # processed; the eight generated tokens take seven decode steps after it
        assert again.timings["prompt_n"] == 1 and again.timings["predicted_n"] == 7
        other = llm.generate("The capital of Spain is", max_tokens=8, **GREEDY)
        n_common = next(i for i, (x, y) in enumerate(zip(llm.tokenize(prompt), llm.tokenize("The capital of Spain")))
                        if x != y)
        assert other.cached_tokens == n_common > 0
        llm.reset()   # the way to start afresh
        assert llm.generate(prompt, max_tokens=8, **GREEDY).cached_tokens == 0
    with Llama(str(smollm2_path), n_ctx=512, policy="snapkv", budget=40, **EXACT) as llm:
        a = llm.generate(prompt, max_tokens=8, **GREEDY)
        b = llm.generate(prompt, max_tokens=8, **GREEDY)
        assert b.cached_tokens == 0 and b.timings["prompt_n"] == b.prompt_tokens
        assert b.tokens == a.tokens


@pytest.mark.model
def test_reuse_after_a_cancelled_generation(smollm2_path):
    """A cancelled generation leaves the tokens it evaluated: the next call reuses only those."""
    prompt = "List the days of the week:"
    with Llama(str(smollm2_path), n_ctx=512, **EXACT) as llm, Llama(str(smollm2_path), n_ctx=512, **EXACT) as fresh:
        with pytest.raises(GenerationCancelled):
            for i, _ in enumerate(llm.generate(prompt, max_tokens=30, stream=True, **GREEDY)):
                if i == 4:
                    llm.cancel()   # stops the next decode step at its start
        assert llm.last_result.finish_reason == "cancelled"
        assert llm.n_past == len(llm.input_ids)
        got = llm.generate(prompt, max_tokens=12, **GREEDY)
        assert 0 < got.cached_tokens < got.prompt_tokens
        assert got.tokens == fresh.generate(prompt, max_tokens=12, **GREEDY).tokens


@pytest.mark.model
def test_chat_turns_report_cached_tokens(smollm2_path):
    with Llama(str(smollm2_path), n_ctx=1024, **EXACT) as llm, Llama(str(smollm2_path), n_ctx=1024, **EXACT) as fresh:
        messages = [{"role": "user", "content": "Name a fruit."}]
        reply = llm.create_chat_completion(messages, max_tokens=12, temperature=0.0, seed=0)
        assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "And a vegetable?"}]
        second = llm.create_chat_completion(messages, max_tokens=12, temperature=0.0, seed=0)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > reply["usage"]["prompt_tokens"]
        alone = fresh.create_chat_completion(messages, max_tokens=12, temperature=0.0, seed=0)
        assert second["choices"][0]["message"] == alone["choices"][0]["message"]
