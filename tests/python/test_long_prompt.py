"""Prompts longer than n_ctx: with a policy that evicts while the prompt is read (TAKE, or any
evicting policy with evict_every_chunk=True), n_ctx bounds the cache, not the prompt.

Checked: a prompt of 4 x n_ctx goes through and every (layer, KV head) list stays within
n_ctx entries, the cache's peak memory within what the full cache of n_ctx tokens takes;
a policy that keeps the prompt until its end still gets ContextOverflowError; decoding after
such a prompt stops when a growing list reaches n_ctx; positions past the model's training
context warn once. evict_every_chunk is checked against its rule written out: every chunk
is compressed as the end of a call is, which is what evaluating each chunk in its own
eval() call does (with an absolute budget and chunks at least as long as the window)."""
import subprocess
import sys
import warnings

import numpy as np
import pytest

from pykv import Llama
from pykv.errors import ContextOverflowError

N_CTX, N_BATCH, BUDGET = 256, 64, 64
EVICTING = ["streamingllm", "h2o", "snapkv", "pyramidkv", "adakv", "cake", "lava", "ems", "take",
            "expected_attention", "criticalkv", "criticaladakv", "kvzip"]
MODEL = "llama_q8_0_h8kv2"   # 3 layers, 2 KV heads


def prompt(n, seed=5):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def largest_list(llm):
    return max(max(layer) for layer in llm.kv_stats()["entries_per_head"])


@pytest.fixture(scope="module")
def full_cache_peak(tiny_model):
    """The peak bytes of the full cache holding n_ctx tokens: what "the memory of n_ctx
    entries" means for this model."""
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH) as llm:
        llm.eval(prompt(N_CTX))
        return llm.kv_stats()["peak_bytes"]


@pytest.mark.parametrize("policy", EVICTING)
def test_a_prompt_of_four_n_ctx_goes_through(tiny_model, full_cache_peak, policy):
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy=policy, budget=BUDGET,
               evict_every_chunk=policy != "take") as llm:
        assert llm.cache_bounded
        res = llm.generate(prompt(4 * N_CTX), max_tokens=8, temperature=0.0)
        assert len(res.tokens) == 8 and llm.n_past == 4 * N_CTX + 7
        assert largest_list(llm) <= N_CTX
        assert res.kv_stats["peak_bytes"] <= full_cache_peak


@pytest.mark.parametrize("policy", ["streamingllm", "h2o", "snapkv"])
def test_evict_every_chunk_bounds_peak_memory_by_budget_and_chunk(tiny_model, policy):
    """These keep the same count in every list: at most budget + one chunk at any time."""
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy=policy, budget=BUDGET,
               evict_every_chunk=True, kv_type="f32") as llm:
        llm.eval(prompt(4 * N_CTX))
        stats = llm.kv_stats()
    head_dim, lists = 128 // 8, 3 * 2
    entry = 2 * head_dim * 4 + 4   # f32 key and value, and the position
    assert stats["peak_bytes"] <= (BUDGET + N_BATCH) * entry * lists


@pytest.mark.parametrize("policy", ["full", "snapkv", "h2o"])
def test_a_policy_that_keeps_the_prompt_still_overflows(tiny_model, policy):
    kwargs = {} if policy == "full" else {"budget": BUDGET}
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy=policy, **kwargs) as llm:
        assert not llm.cache_bounded
        with pytest.raises(ContextOverflowError, match="n_ctx=256"):
            llm.generate(prompt(N_CTX + 1), max_tokens=2)
        with pytest.raises(ContextOverflowError, match="n_ctx=256"):
            llm.eval(prompt(N_CTX + 1))
        assert llm.n_past == 0


@pytest.mark.parametrize("policy", ["snapkv", "adakv", "h2o"])
def test_evict_every_chunk_is_each_chunk_compressed_as_a_call_end(tiny_model, policy):
    tokens = prompt(4 * N_BATCH)
    path = str(tiny_model(MODEL))
    with Llama(path, n_ctx=1024, n_batch=N_BATCH, policy=policy, budget=BUDGET, evict_every_chunk=True) as llm:
        llm.eval(tokens)
        got = [llm.kv_positions(layer, head) for layer in range(3) for head in range(2)]
        got_logits = np.array(llm.logits())
    with Llama(path, n_ctx=1024, n_batch=N_BATCH, policy=policy, budget=BUDGET) as llm:
        for start in range(0, len(tokens), N_BATCH):
            llm.eval(tokens[start:start + N_BATCH])
        want = [llm.kv_positions(layer, head) for layer in range(3) for head in range(2)]
        want_logits = np.array(llm.logits())
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5)


def test_evict_every_chunk_evicts_before_the_prompt_ends(tiny_model):
    """Without it SnapKV holds the whole prompt until its last chunk: the peak is the prompt's."""
    path = str(tiny_model(MODEL))
    peaks = {}
    for every in (False, True):
        with Llama(path, n_ctx=1024, n_batch=N_BATCH, policy="snapkv", budget=BUDGET, evict_every_chunk=every) as llm:
            llm.eval(prompt(512))
            peaks[every] = llm.kv_stats()["peak_bytes"]
    assert peaks[True] * 3 < peaks[False]


def test_decoding_after_a_long_prompt_stops_when_a_list_is_full(tiny_model):
    budget = 200
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy="take", budget=budget) as llm:
        res = llm.generate(prompt(3 * N_CTX), max_tokens=200, temperature=0.0, ignore_eos=True)
        # TAKE lets decoding grow its lists: budget entries after the prompt, one more per
        # evaluated token; the last drawn token is not evaluated
        assert res.finish_reason == "length"
        assert len(res.tokens) == N_CTX - budget + 1
        assert largest_list(llm) == N_CTX


def test_the_default_budget_leaves_half_of_n_ctx_to_generate(tiny_model):
    """No budget, a prompt longer than n_ctx: max(256, a quarter of 1024) = 256 entries, at
    most half of n_ctx = 128; decoding then fills the other half."""
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy="take") as llm:
        llm.eval(prompt(4 * N_CTX))
        assert {n for layer in llm.kv_stats()["entries_per_head"] for n in layer} == {N_CTX // 2}
        llm.reset()
        res = llm.generate(prompt(4 * N_CTX), max_tokens=500, temperature=0.0, ignore_eos=True)
        assert len(res.tokens) == N_CTX // 2 + 1


def test_a_fixed_budget_policy_decodes_past_n_ctx(tiny_model):
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy="streamingllm", budget=BUDGET,
               evict_every_chunk=True) as llm:
        res = llm.generate(prompt(2 * N_CTX), max_tokens=300, temperature=0.0, ignore_eos=True)
        assert len(res.tokens) == 300
        assert largest_list(llm) <= BUDGET


def test_positions_past_the_training_context_warn_once(tiny_model):
    path = str(tiny_model(MODEL, n_ctx_train=512))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Llama(path, n_ctx=N_CTX, n_batch=N_BATCH, policy="take", budget=BUDGET) as llm:
            llm.eval(prompt(400))
            assert not caught
            llm.reset()
            llm.eval(prompt(700))
            llm.reset()
            llm.eval(prompt(800))
    said = [str(w.message) for w in caught if "training context" in str(w.message)]
    assert len(said) == 1 and "512" in said[0]


def test_a_budget_larger_than_n_ctx_is_cut_to_it_with_a_warning(tiny_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy="take", budget=1000) as llm:
            llm.eval(prompt(4 * N_CTX))
            assert largest_list(llm) == N_CTX
    assert sum("n_ctx=256" in str(w.message) for w in caught) == 1


def test_cli_reads_a_prompt_longer_than_ctx_size(tiny_model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"word{i}" for i in range(600)))   # byte tokens: several thousand
    base = [sys.executable, "-m", "pykv", "generate", str(tiny_model(MODEL)), "-f", str(doc), "-n", "4",
            "--temp", "0", "-c", "512", "-b", "128", "--kv-stats"]
    ok = subprocess.run(base + ["--policy", "take", "--budget", "128"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    every = subprocess.run(base + ["--policy", "snapkv", "--budget", "128", "--evict-every-chunk"],
                           capture_output=True, text=True, timeout=120)
    assert every.returncode == 0, every.stderr
    refused = subprocess.run(base + ["--policy", "snapkv", "--budget", "128"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "n_ctx=512" in refused.stderr


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_reads_6k_tokens_with_a_1k_context(smollm2_path):
    from pykv.eval import haystack_text
    text = haystack_text()   # the shipped text, not one of the operating system's
    with Llama(str(smollm2_path), n_ctx=1024, policy="take", budget=256) as llm:
        tokens = llm.tokenize(text)[:6000]
        res = llm.generate(tokens, max_tokens=8, temperature=0.0)
        assert llm.n_past == 6007 and len(res.tokens) == 8
        assert largest_list(llm) <= 1024


@pytest.mark.parametrize("policy", ["take", "snapkv"])
def test_a_state_saved_after_a_long_prompt_loads_and_continues(tiny_model, policy):
    """A state holding more tokens than n_ctx (its lists within n_ctx) loads into a context of
    the same settings and continues as the saved one does; a context that keeps whole prompts
    refuses it with ContextOverflowError."""
    settings = dict(n_ctx=N_CTX, n_batch=N_BATCH, policy=policy, budget=BUDGET, evict_every_chunk=policy != "take")
    with Llama(str(tiny_model(MODEL)), **settings) as saved:
        saved.eval(prompt(3 * N_CTX))
        state = saved.save_state()
        saved.eval(prompt(5, seed=9))
        expected = saved.logits()
    with Llama(str(tiny_model(MODEL)), **settings) as restored:
        restored.load_state(state)
        assert restored.n_past == 3 * N_CTX
        restored.eval(prompt(5, seed=9))
        np.testing.assert_array_equal(restored.logits(), expected)
    with Llama(str(tiny_model(MODEL)), n_ctx=N_CTX, n_batch=N_BATCH, policy=policy, budget=BUDGET) as small:
        if not small.cache_bounded:
            with pytest.raises(ContextOverflowError, match="more than n_ctx"):
                small.load_state(state)
