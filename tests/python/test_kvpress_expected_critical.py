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


def _report(what, found):
    print(f"{what}: min IoU {min(found.values()):.4f}, mean {np.mean(list(found.values())):.4f}")
    return found


# ---- expected_attention ---------------------------------------------------------------------

def _expected_attention(budget, **kwargs):
    from kvpress import ExpectedAttentionPress

    return ExpectedAttentionPress(compression_ratio=ref.compression_ratio(budget, N_TOKENS), **kwargs)


@pytest.mark.parametrize("budget", BUDGETS)
def test_expected_attention_matches_kvpress(model, budget):
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(budget))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", budget)
    assert all(len(v) == budget and set(range(4)) <= set(v.tolist()) for v in ours.values())   # the 4 sinks
    _report(f"expected_attention B={budget}", ref.assert_overlap(ours, theirs, what=f"expected_attention B={budget}"))


def test_expected_attention_chunked_prefill_matches_kvpress(model):
    """Query statistics merged chunk by chunk equal those of the whole prompt."""
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", 100, n_batch=96)
    _report("expected_attention B=100 n_batch=96", ref.assert_overlap(ours, theirs, what="chunked expected_attention"))


def test_expected_attention_options_match_kvpress(model):
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100, use_covariance=False, n_future_positions=64,
                                                                  n_sink=2, use_vnorm=True, epsilon=0.01))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", 100,
                         policy_kwargs={"use_covariance": 0, "n_future_positions": 64, "sink": 2, "epsilon": 0.01})
    _report("expected_attention options", ref.assert_overlap(ours, theirs, what="expected_attention with options"))


def test_expected_attention_comparison_tells_the_options_apart(model):
    """Without the value norms pykv keeps other entries than kvpress's default: the overlap
    above is not one any scoring would reach."""
    theirs = ref.kvpress_kept(model, TOKENS, _expected_attention(100))
    ours = ref.pykv_kept(model, TOKENS, "expected_attention", 100, policy_kwargs={"use_vnorm": 0})
    assert min(ref.ious(ours, theirs).values()) < 0.8


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
