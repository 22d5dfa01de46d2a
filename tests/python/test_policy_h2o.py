"""H2O against an independent NumPy reimplementation of its score (docs/policies.md#h2o).

Reference: float64 forward (``_policy_reference.capture_qk``), full causal softmax of every
prompt query of each query head, column sums (the attention each key has received), mean
over the query heads of a KV head; each list keeps its ``recent`` newest entries plus the
top ``B - recent`` of the others (ties to the lower position). pykv computes the same sums
in float32, so equality is required except where the float64 scores at the selection
boundary are within 1e-4 relative (genuine near-ties, ``same_selection``).
"""
import numpy as np
import pytest

from _compare import EXACT
from pykv import Llama
from pykv.errors import InvalidArgumentError

import _policy_reference as pref

RTOL_TIE = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(11).integers(3, 250, size=160)]


def h2o_scores(q, k):
    """(Hkv, N) accumulated attention per key: causal softmax rows summed, GQA mean."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    mask = np.triu(np.ones((N, N), dtype=bool), 1)
    sums = np.empty((Hq, N))
    for h in range(Hq):
        z = q[:, h, :] @ k[:, h // group, :].T / np.sqrt(D)
        z[mask] = -np.inf
        a = np.exp(z - z.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        sums[h] = a.sum(axis=0)
    return sums.reshape(Hkv, group, N).mean(axis=1)


@pytest.mark.parametrize("variant", ["llama_q8_0_h8kv2", "mistral_f16_h4kv1"])
@pytest.mark.parametrize("budget,recent", [(40, None), (64, 8)])
def test_h2o_selection_matches_numpy(tiny_model, variant, budget, recent):
    path = tiny_model(variant)
    kwargs = {"recent": recent} if recent is not None else None
    with Llama(str(path), **EXACT, n_ctx=256, n_batch=256, policy="h2o", budget=budget, policy_kwargs=kwargs) as llm:
        llm.eval(PROMPT)
        hp, qs, ks = pref.capture_qk(path, PROMPT)
        N, R = len(PROMPT), (recent if recent is not None else budget // 2)
        for layer in range(hp.n_layer):
            s = h2o_scores(qs[layer], ks[layer])
            for g in range(hp.n_head_kv):
                cand = s[g][:N - R]
                want = pref.keep_set(pref.select_top(cand, budget - R), N - R, N)
                got = llm.kv_positions(layer, g)
                assert len(got) == budget
                assert pref.same_selection(got, want, cand, budget - R, RTOL_TIE), (layer, g)


def test_h2o_chunked_prefill_equals_one_shot(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2")
    kept = []
    for n_batch in (256, 48):
        with Llama(str(path), **EXACT, n_ctx=256, n_batch=n_batch, policy="h2o", budget=40) as llm:
            llm.eval(PROMPT)
            kept.append([llm.kv_positions(l, g) for l in range(3) for g in range(2)])
    assert kept[0] == kept[1]


def test_h2o_decode_keeps_budget_and_recent(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2")
    budget, recent = 40, 10
    with Llama(str(path), **EXACT, n_ctx=256, policy="h2o", budget=budget, policy_kwargs={"recent": recent}) as llm:
        llm.eval(PROMPT)
        held = []
        for step in range(12):
            llm.eval([5 + step])
            stats = llm.kv_stats()
            assert stats["entries"] == budget * 3 * 2
            n_past = len(PROMPT) + step + 1
            for layer in range(3):
                pos = llm.kv_positions(layer, 0)
                assert pos == sorted(pos)
                assert pos[-recent:] == list(range(n_past - recent, n_past))
            held.append(stats["bytes"])
    # Each list keeps one growth step of room (an eighth) while decoding, reusing it every
    # step: the bytes held stop changing after the first step (no shrink-and-regrow).
    exact = stats["entries"] * (2 * llm.model_info["head_dim"] * 4 + 4)
    assert exact <= held[-1] <= 1.125 * exact + 3 * 2 * 2 * (2 * llm.model_info["head_dim"] * 4 + 4)
    assert len(set(held[1:])) == 1, held


def test_h2o_budget_at_least_prompt_equals_full(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2")
    logits = []
    for policy, budget in (("full", None), ("h2o", len(PROMPT) + 20)):
        with Llama(str(path), **EXACT, n_ctx=256, policy=policy, budget=budget) as llm:
            llm.eval(PROMPT)
            llm.eval([7])
            logits.append(llm.logits())
    assert np.array_equal(logits[0], logits[1])


def test_h2o_bad_recent(tiny_model):
    path = tiny_model("llama_q8_0_h8kv2")
    with pytest.raises(InvalidArgumentError, match="recent"):
        Llama(str(path), **EXACT, n_ctx=256, policy="h2o", budget=32, policy_kwargs={"recent": 32})
    with pytest.raises(InvalidArgumentError, match="recent"):
        Llama(str(path), **EXACT, n_ctx=256, policy="h2o", budget=32, policy_kwargs={"window": 4})
