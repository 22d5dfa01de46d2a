"""pykv's expected_attention, criticalkv and criticaladakv against kvpress 0.5.5 (the outside
reference: ExpectedAttentionPress, CriticalKVPress(SnapKVPress), CriticalAdaKVPress(SnapKVPress)):
the positions each (layer, KV head) keeps after one prompt, on a tiny random Llama with
grouped-query attention (8 query heads over 2 KV heads, 3 layers), pykv with float matrix
products and an f32 cache, kvpress in transformers (float32).

criticalkv's and criticaladakv's window arguments are set to kvpress's SnapKVPress defaults
(window 64, average pooling with kernel 5). Where pykv departs from kvpress by a choice its
policy header documents, the choice is tested on its own.
"""

from __future__ import annotations

import numpy as np
import pytest

import _kvpress_reference as ref
from _tiny_models import random_tokens
from pykv import InvalidArgumentError, Llama

N_TOKENS = 400
TOKENS = random_tokens(N_TOKENS, seed=47)
BUDGETS = (100, 200)   # 25% and 50% of the prompt, entries per (layer, KV head)


@pytest.fixture(scope="module")
def model(tiny_model):
    ref.skip_without_kvpress()
    return tiny_model("llama_q8_0_h8kv2", wtype="F32")



# ---- expected_attention ---------------------------------------------------------------------

def _expected_attention(budget, **kwargs):
    from kvpress import ExpectedAttentionPress

    return ExpectedAttentionPress(compression_ratio=ref.compression_ratio(budget, N_TOKENS), **kwargs)


@pytest.mark.parametrize("budget", BUDGETS)
def test_expected_attention_matches_kvpress(model, budget):
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(budget))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", budget)
    assert all(len(v) == budget and set(range(4)) <= set(v.tolist()) for v in ours.values())   # the 4 sinks
    ref.report(f"expected_attention B={budget}", ref.assert_overlap(ours, theirs, what=f"expected_attention B={budget}"))


def test_expected_attention_chunked_prefill_matches_kvpress(model):
    """Query statistics merged chunk by chunk equal those of the whole prompt."""
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", 100, n_batch=96)
    ref.report("expected_attention B=100 n_batch=96", ref.assert_overlap(ours, theirs, what="chunked expected_attention"))


def test_expected_attention_options_match_kvpress(model):
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100, use_covariance=False, n_future_positions=64,
                                                                  n_sink=2, use_vnorm=True, epsilon=0.01))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", 100,
                         policy_kwargs={"use_covariance": 0, "n_future_positions": 64, "sink": 2, "epsilon": 0.01})
    ref.report("expected_attention options", ref.assert_overlap(ours, theirs, what="expected_attention with options"))


def test_expected_attention_comparison_tells_the_options_apart(model):
    """Without the value norms pykv keeps other entries than kvpress's default: the overlap
    above is not one any scoring would reach."""
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", 100, policy_kwargs={"use_vnorm": 0})
    assert min(ref.ious(ours, theirs).values()) < 0.8


def test_expected_attention_sink_from_the_constructor(model):
    """sink= (the constructor's, also --sink) is the policy argument sink=, kvpress's n_sink;
    both given must agree."""
    by_constructor = ref.pykv_kept(model, TOKENS, "expected_attention", 100, sink=6)
    by_argument = ref.pykv_kept(model, TOKENS, "expected_attention", 100, policy_kwargs={"sink": 6})
    assert by_constructor.keys() == by_argument.keys()
    assert all(np.array_equal(by_constructor[k], by_argument[k]) for k in by_argument)
    assert all(set(range(6)) <= set(v.tolist()) for v in by_argument.values())
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100, n_sink=6))
    ref.report("expected_attention sink=6", ref.assert_overlap(by_constructor, theirs, what="expected_attention sink=6"))
    with pytest.raises(InvalidArgumentError, match="disagree"):
        Llama(str(model), n_ctx=512, policy="expected_attention", budget=64, sink=6, policy_kwargs={"sink": 4})


@pytest.mark.parametrize("kwargs,match", [
    ({"budget": 4}, "larger than the 4 sink tokens"),
    ({"budget": 10, "policy_kwargs": {"sink": 10}}, "larger than the 10 sink tokens"),
    ({"budget": 64, "window": 8}, "has no window"),
    ({"budget": 64, "policy_kwargs": {"use_vnorm": 2}}, "use_vnorm"),
    ({"budget": 64, "policy_kwargs": {"n_future_positions": 0}}, "n_future_positions"),
    ({"budget": 64, "policy_kwargs": {"epsilon": -1}}, "epsilon"),
    ({"budget": 64, "policy_kwargs": {"window": 8}}, "has no argument .window."),
])
def test_expected_attention_bad_arguments(model, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Llama(str(model), n_ctx=512, policy="expected_attention", **kwargs)


# ---- criticalkv, criticaladakv ---------------------------------------------------------------



def _snapkv(budget):
    from kvpress import SnapKVPress

    return SnapKVPress(compression_ratio=ref.compression_ratio(budget, N_TOKENS), window_size=64, kernel_size=5)


@pytest.fixture(scope="module", params=["Q4_0", "Q5_K"])
def quantized_output_model(request, tiny_model):
    """Output projections (what criticalkv weighs values with) stored quantized: transformers
    reads them dequantized, pykv dequantizes them itself. Q4_0: the model above with only
    attn_output quantized; Q5_K: the K-quant tiny model (4 query heads over 2 KV heads, head
    dim 64), where one 256-value block holds the columns of four heads."""
    ref.skip_without_kvpress()
    if request.param == "Q4_0":
        return tiny_model("llama_q8_0_h8kv2", wtype="F32", tensor_types=(("attn_output", "Q4_0"),))
    return tiny_model("llama_kquants_h4kv2")


@pytest.mark.parametrize("budget", BUDGETS)   # first stage: none at 100 (the window fills it), 36 at 200
def test_criticalkv_matches_kvpress(model, budget):
    from kvpress import CriticalKVPress

    theirs = ref.kvpress_kept(model, TOKENS, CriticalKVPress(_snapkv(budget)))
    ours = ref.pykv_kept(model, TOKENS, "criticalkv", budget, policy_kwargs=ref.SNAPKV_ARGS)
    assert all(len(v) == budget and set(range(N_TOKENS - 64, N_TOKENS)) <= set(v.tolist()) for v in ours.values())
    ref.report(f"criticalkv B={budget}", ref.assert_overlap(ours, theirs, what=f"criticalkv B={budget}"))


def test_criticalkv_options_and_chunked_prefill_match_kvpress(model):
    from kvpress import CriticalKVPress

    theirs = ref.kvpress_kept(model, TOKENS, CriticalKVPress(_snapkv(200), epsilon=0.01, first_stage_ratio=0.8))
    ours = ref.pykv_kept(model, TOKENS, "criticalkv", 200, n_batch=96,
                         policy_kwargs={**ref.SNAPKV_ARGS, "epsilon": 0.01, "first_stage_ratio": 0.8})
    ref.report("criticalkv options, n_batch=96", ref.assert_overlap(ours, theirs, what="criticalkv with options"))


def test_criticalkv_quantized_output_projection_matches_kvpress(quantized_output_model):
    from kvpress import CriticalKVPress

    theirs = ref.kvpress_kept(quantized_output_model, TOKENS, CriticalKVPress(_snapkv(100)))
    ours = ref.pykv_kept(quantized_output_model, TOKENS, "criticalkv", 100, policy_kwargs=ref.SNAPKV_ARGS)
    ref.report("criticalkv quantized W_o B=100",
            ref.assert_overlap(ours, theirs, what="criticalkv, quantized output projection"))


def test_criticalkv_weights_decide_the_entries(model):
    """SnapKV's own choice (first_stage_ratio=1: the first stage takes everything) is far from
    kvpress's CriticalKV: the overlap above comes from the value weights."""
    from kvpress import CriticalKVPress

    theirs = ref.kvpress_kept(model, TOKENS, CriticalKVPress(_snapkv(100)))
    ours = ref.pykv_kept(model, TOKENS, "criticalkv", 100, policy_kwargs={**ref.SNAPKV_ARGS, "first_stage_ratio": 1.0})
    assert min(ref.ious(ours, theirs).values()) < 0.8


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("alpha", [0.0, 0.2])   # 0: the same head budgets as kvpress by construction
def test_criticaladakv_matches_kvpress(model, budget, alpha):
    from kvpress import CriticalAdaKVPress

    theirs = ref.kvpress_kept(model, TOKENS, CriticalAdaKVPress(_snapkv(budget), alpha_safeguard=alpha))
    ours = ref.pykv_kept(model, TOKENS, "criticaladakv", budget, policy_kwargs={**ref.SNAPKV_ARGS, "alpha": alpha})
    for layer in range(3):
        assert sum(len(v) for (l, _), v in ours.items() if l == layer) == 2 * budget
    ref.report(f"criticaladakv alpha={alpha} B={budget}",
            ref.assert_overlap(ours, theirs, what=f"criticaladakv alpha={alpha} B={budget}"))


def test_criticaladakv_head_budgets_are_adakvs(model):
    """The documented choice: each head keeps as many entries as adakv gives it (its
    safeguard's blend, not kvpress's per-head reserve) under the same scores and alpha."""
    kw = {**ref.SNAPKV_ARGS, "alpha": 0.2}
    ours = ref.pykv_kept(model, TOKENS, "criticaladakv", 100, policy_kwargs=kw)
    adakv = ref.pykv_kept(model, TOKENS, "adakv", 100, policy_kwargs=kw)
    assert {k: len(v) for k, v in ours.items()} == {k: len(v) for k, v in adakv.items()}
    assert len({len(v) for v in ours.values()}) > 1   # the heads' counts do differ


@pytest.mark.parametrize("policy", ["criticalkv", "criticaladakv"])
@pytest.mark.parametrize("kwargs,match", [
    ({"budget": 32}, "larger than the window W=32"),
    ({"budget": 64, "policy_kwargs": {"first_stage_ratio": 1.5}}, "first_stage_ratio"),
    ({"budget": 64, "policy_kwargs": {"epsilon": -1}}, "epsilon"),
    ({"budget": 64, "policy_kwargs": {"kernel": 4}}, "odd"),
    ({"budget": 64, "policy_kwargs": {"beta": 1}}, "has no argument .beta."),
])
def test_critical_bad_arguments(model, policy, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Llama(str(model), n_ctx=512, policy=policy, **kwargs)


def test_criticaladakv_alpha_out_of_range(model):
    with pytest.raises(InvalidArgumentError, match="alpha"):
        Llama(str(model), n_ctx=512, policy="criticaladakv", budget=64, policy_kwargs={"alpha": 1.5})
