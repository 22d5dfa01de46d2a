"""Saved states with evicting policies: the compressed cache, merged entries and the policy's
own state (H2O's and EMS's scores, CAKE's frozen sizes, StreamingLLM's budget) come back, so
a restored context continues exactly as the saved one does, through later prefills and
decode steps; states of another policy or other settings are refused. Also
pykv_is_single_run, which lets generate() reuse a context that holds exactly its prompt, and
pykv_reset leaving CAKE and StreamingLLM as a fresh context would.

The oracle is the uninterrupted context itself: the restored one must give the same logits
bit for bit at every step (the policies' numbers are checked against their references in
the policy tests)."""

from __future__ import annotations

import numpy as np
import pytest

import _gguf_patch
from _compare import EXACT
from _tiny_models import random_tokens
from pykv import InvalidArgumentError, Llama
from pykv._ffi import ffi, lib
from pykv._state import LlamaState

BUDGET = 40
# (policy, policy_kwargs, budget): every evicting policy; EMS also with tau=0, so that it
# merges; StreamingLLM also with a fractional budget, which its prefill fixes for decoding.
POLICIES = [("streamingllm", None, BUDGET), ("streamingllm", None, 0.25), ("h2o", None, BUDGET),
            ("snapkv", None, BUDGET), ("pyramidkv", None, BUDGET), ("adakv", None, BUDGET), ("cake", None, BUDGET),
            ("lava", None, BUDGET), ("ems", None, BUDGET), ("ems", {"tau": 0.0}, BUDGET), ("take", None, BUDGET),
            ("knorm", None, BUDGET), ("keydiff", None, BUDGET), ("random", None, BUDGET), ("tova", None, BUDGET),
            ("tova", None, 0.25), ("lagkv", {"lag": 16}, BUDGET), ("expected_attention", None, BUDGET),
            ("criticalkv", None, BUDGET), ("criticaladakv", None, BUDGET), ("kvzip", None, BUDGET)]


def _llama(path, policy, kwargs, **extra):
    opts = dict(n_ctx=512, n_batch=64, policy=policy, budget=BUDGET, policy_kwargs=kwargs, **EXACT)
    opts.update(extra)
    return Llama(str(path), **opts)


def _steps(llm, tokens):
    """Each token as a decode step; the logits after each."""
    out = []
    for t in tokens:
        llm.eval([t])
        out.append(llm.logits())
    return np.array(out)


def _continue(llm, seed):
    """A later prefill, then decode steps: the logits at the end of each."""
    llm.eval(random_tokens(30, seed))
    first = llm.logits()
    return np.vstack([first[None], _steps(llm, random_tokens(24, seed + 1))])


def _same_cache(a, b):
    sa, sb = a.kv_stats(), b.kv_stats()
    for key in ("entries", "evicted", "merged"):
        assert sa[key] == sb[key], (key, sa, sb)


@pytest.mark.parametrize("policy,kwargs,budget", POLICIES,
                         ids=[f"{p}{''.join(f'+{a}{v:g}' for a, v in (k or {}).items())}-{b}" for p, k, b in POLICIES])
def test_restored_context_continues_exactly(tiny_model, policy, kwargs, budget):
    path = tiny_model("mistral_q4_0_h8kv2")
    with _llama(path, policy, kwargs, budget=budget) as saved, _llama(path, policy, kwargs, budget=budget) as restored, \
            _llama(path, policy, kwargs, budget=budget) as late:
        saved.eval(random_tokens(150, 11))
        assert saved.kv_stats()["evicted"] > 0
        after_prefill = saved.save_state()
        restored.eval(random_tokens(30, 12))   # whatever it held is replaced
        restored.load_state(after_prefill)
        np.testing.assert_array_equal(restored.logits(), saved.logits())
        _same_cache(restored, saved)
        assert bytes(restored.save_state().data) == bytes(after_prefill.data)

        np.testing.assert_array_equal(_continue(restored, 13), _continue(saved, 13))
        _same_cache(restored, saved)
        if policy == "ems" and kwargs:   # EMS with tau=0 merges: its merged entries came back with their members
            assert saved.kv_stats()["merged"] > 0

        mid_decode = saved.save_state()   # after decode steps: EMS's step counts, H2O's decode scores
        late.load_state(mid_decode)
        tail = random_tokens(12, 14)
        np.testing.assert_array_equal(_steps(late, tail), _steps(saved, tail))
        _same_cache(late, saved)


def test_compressed_state_is_small(tiny_model):
    """The state holds the budget's entries, not the prompt's."""
    path = tiny_model("mistral_q4_0_h8kv2")
    prompt = random_tokens(400, 15)
    with _llama(path, "snapkv", None) as snap, Llama(str(path), n_ctx=512, **EXACT) as full:
        snap.eval(prompt)
        full.eval(prompt)
        small, big = len(snap.save_state().data), len(full.save_state().data)
    assert small < 0.2 * big, (small, big)


def _refused(llm, state, needle):
    before, logits, entries = llm.n_past, llm.logits(), llm.kv_stats()["entries"]
    with pytest.raises(InvalidArgumentError, match=needle):
        llm.load_state(state)
    assert llm.n_past == before and llm.kv_stats()["entries"] == entries
    np.testing.assert_array_equal(llm.logits(), logits)


def test_other_policies_and_settings_are_refused(tiny_model):
    path = tiny_model("mistral_q4_0_h8kv2")
    prompt = random_tokens(120, 16)
    with _llama(path, "h2o", None) as h2o:
        h2o.eval(prompt)
        state = h2o.save_state()
    with Llama(str(path), n_ctx=512, **EXACT) as full:
        full.eval(prompt)
        full_state = full.save_state()
    others = [("snapkv", None, {}), ("h2o", None, {"budget": 48}), ("h2o", {"recent": 4}, {}),
              ("full", None, {"budget": None})]
    for policy, kwargs, extra in others:
        with _llama(path, policy, kwargs, **extra) as llm:
            llm.eval(random_tokens(5, 17))
            _refused(llm, state, "saved with the policy 'h2o budget=40")
            if policy != "full":
                _refused(llm, full_state, "saved with the policy 'full'; this context has")
    with _llama(path, "take", {"probe": [5, 6, 7]}) as probed, _llama(path, "take", {"probe": [5, 6, 8]}) as other:
        probed.eval(prompt)
        other.eval(random_tokens(5, 18))
        _refused(other, probed.save_state(), "probe=3 tokens")


def test_damaged_policy_part_is_refused(tiny_model):
    path = tiny_model("mistral_q4_0_h8kv2")
    with _llama(path, "h2o", None) as llm:
        llm.eval(random_tokens(120, 19))
        data = bytes(llm.save_state().data)
        ids = list(llm.input_ids)
        n_scores = llm.kv_stats()["entries"]   # one score per entry
        policy_bytes = 4 + 4 * n_scores   # the budget, then the scores
        start = len(data) - policy_bytes
        assert np.frombuffer(data[start - 8:start], np.int64)[0] == policy_bytes
        for cut in (1, 3, policy_bytes // 2, policy_bytes - 1):
            _refused(llm, LlamaState(ids, data[:-cut]), "not a usable state")
        nan = bytearray(data)
        nan[start + 4:start + 8] = np.float32(np.nan).tobytes()
        _refused(llm, LlamaState(ids, bytes(nan)), "h2o policy's score")
        negative = bytearray(data)
        negative[start:start + 4] = np.int32(-3).tobytes()
        _refused(llm, LlamaState(ids, bytes(negative)), "h2o policy's budget")
        llm.load_state(LlamaState(ids, data))   # the intact state still loads


def test_single_run_lets_generate_reuse_the_context(tiny_model):
    path = tiny_model("mistral_q4_0_h8kv2")
    a, b = random_tokens(100, 20), random_tokens(30, 21)
    greedy = dict(max_tokens=6, temperature=0.0, seed=0)
    with _llama(path, "snapkv", None) as llm, _llama(path, "snapkv", None) as fresh:
        assert lib.pykv_is_single_run(llm._ctx)   # empty
        llm.eval(a)
        assert lib.pykv_is_single_run(llm._ctx)
        reused = llm.generate(a, **greedy)
        assert reused.cached_tokens == len(a)   # nothing evaluated again
        assert not lib.pykv_is_single_run(llm._ctx)   # decode steps met a compressed cache
        again = llm.generate(a, **greedy)
        assert again.cached_tokens == 0 and again.tokens == reused.tokens == fresh.generate(a, **greedy).tokens

        llm.reset()
        llm.eval(a)
        llm.eval(b)   # a second call: a fresh eval of a + b would have compressed differently
        assert not lib.pykv_is_single_run(llm._ctx)
        assert llm.generate(a + b, **greedy).cached_tokens == 0
    with Llama(str(path), n_ctx=512, **EXACT) as full:
        full.eval(a)
        full.eval(b)
        assert lib.pykv_is_single_run(full._ctx)   # `full` keeps everything: any history is a fresh run
    assert lib.pykv_is_single_run(ffi.NULL) == 0


def test_reset_decodes_as_a_fresh_context(tiny_model):
    """After a prefill froze CAKE's layer sizes, pykv_reset forgets them: decode steps then
    evict to the budget as in a context never used."""
    path = tiny_model("mistral_q4_0_h8kv2")
    steps = random_tokens(70, 23)
    with _llama(path, "cake", None) as used, _llama(path, "cake", None) as fresh:
        used.eval(random_tokens(200, 22))
        used.reset()
        np.testing.assert_array_equal(_steps(used, steps), _steps(fresh, steps))
        _same_cache(used, fresh)


def test_reset_forgets_a_fractional_budget(tiny_model):
    """StreamingLLM's budget fixed by a prefill from budget=0.25 (100 entries of 400) is
    forgotten by pykv_reset: decode steps with no prefill then keep what a fresh context
    keeps (a quarter of a one-token call, raised to the floor of 64 entries) instead of the
    old budget."""
    path = tiny_model("mistral_q4_0_h8kv2")
    with _llama(path, "streamingllm", None, budget=0.25) as used, \
            _llama(path, "streamingllm", None, budget=0.25) as fresh:
        used.eval(random_tokens(400, 22))
        assert used.kv_stats()["entries_per_head"][0][0] == 100
        used.reset()
        for llm in (used, fresh):
            with pytest.warns(RuntimeWarning, match="raised to 64"):
                _steps(llm, random_tokens(80, 23))
            assert {n for layer in llm.kv_stats()["entries_per_head"] for n in layer} == {64}


def test_flipped_bytes_load_or_are_refused(tiny_model):
    """Random damage anywhere in a state with merged entries and scores: each load either
    succeeds (keys, values and scores are any finite numbers), and evaluating after it is
    safe, or is refused; nothing reads past the buffer (the suite also runs under ASan +
    UBSan)."""
    path = tiny_model("mistral_q4_0_h8kv2")
    with _llama(path, "ems", {"tau": 0.0}) as src, _llama(path, "ems", {"tau": 0.0}) as llm:
        src.eval(random_tokens(150, 24))
        state = src.save_state()
        data = bytes(state.data)
        rng = np.random.default_rng(25)
        llm.eval(random_tokens(30, 26))
        for pos in rng.integers(0, len(data), 80):
            damaged = bytearray(data)
            damaged[pos] ^= 0xFF
            try:
                llm.load_state(LlamaState(state.input_ids, bytes(damaged)))
            except InvalidArgumentError as exc:
                assert "pykv_state_load" in str(exc)
                continue
            llm.eval(random_tokens(20, 27))   # a loaded state, however odd, is safe to go on with
            _steps(llm, random_tokens(3, 28))
        llm.load_state(state)
        np.testing.assert_array_equal(llm.logits(), src.logits())


@pytest.mark.parametrize("policy", ["lava", "ems"])
def test_nan_keys_rank_last(tiny_model, tmp_path, policy):
    """A state with NaN keys is refused (test_state.py), but a model can still make them: here
    the first Q4_0 block of layer 0's K projection has a NaN scale, so every key of its first
    KV head is NaN in one dimension. The context still evaluates past the budget: NaN scores
    rank below every other (a total order for the sort), and the budget holds."""
    path = _gguf_patch.tensor_data_copy(tiny_model("mistral_q4_0_h8kv2"), tmp_path / "nan-key.gguf",
                                        "blk.0.attn_k.weight", 0, np.array(np.nan, np.float16).tobytes())
    with _llama(path, policy, None) as llm:
        llm.eval(random_tokens(120, 30))   # a prefill past the budget: scores rank, entries go
        assert np.isnan(llm.logits()).all()   # the NaN did reach the keys, and everything after
        assert llm.kv_stats()["entries"] == BUDGET * 2 * 2   # 2 layers x 2 KV heads
