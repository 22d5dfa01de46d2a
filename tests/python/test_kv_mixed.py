"""Keys and values stored in different types (kv_type, kv_type_v; llama.cpp's -ctk and -ctv).

- Tiny random GGUFs whose head size is whole Q8_0 blocks, exact matrix products, against
  the NumPy reference with the keys stored one way and the values the other. The tolerance
  is the f16 cache's (test_kv_f16), or the q8_0 cache's one step where a Q8_0 rounding sits
  near its edge (test_kv_q8). The reference with the two types swapped, or with both of
  either type, is far further away, so the check sees which side got which type.
- SmolLM2 against transformers with q8_0 keys and f16 values: within the q8_0 cache's KL.
- Memory: an entry is a key row, a value row and a 4-byte position, checked exactly.
- Every policy runs on such a cache; a saved state loads back bit for bit, and into a
  context with other types it is refused naming both.
- The command line: -ctk and -ctv set one side each, as llama.cpp's do (-ctk q8_0 alone
  leaves the values f16); --cache-type sets both.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import _reference
from _compare import kl_from_transformers, prompt_then_steps_logits
from _tiny_models import N_VOCAB, VARIANTS, random_tokens
from pykv import InvalidArgumentError, Llama, list_policies
from test_kv_f16 import F16_REL
from test_kv_q8 import NEAR_EDGE, ONE_STEP_REL, Q8_VARIANTS, SMOLLM2_KL_MAX, state_round_trip

PAIRS = [("q8_0", "f16"), ("f16", "q8_0"), ("f32", "q8_0"), ("q8_0", "f32")]
ROW_BYTES = {"f32": 4, "f16": 2, "q8_0": 34 / 32}   # per element


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("name", Q8_VARIANTS)
def test_tiny_mixed_cache_matches_reference(tiny_model, name, pair):
    path = tiny_model(name)
    rel, rel_other = [], []
    others = {(pair[1], pair[0]), (pair[0], pair[0]), (pair[1], pair[1])}
    for seed in (51, 52):
        tokens, start = np.random.default_rng(seed).integers(0, N_VOCAB, 20).tolist(), 10
        got = prompt_then_steps_logits(path, tokens, start, kv_type=pair[0], kv_type_v=pair[1])
        margins = []
        ref = _reference.forward(path, tokens, kv_types=pair, q8_margins=margins)[start - 1:]
        scale = np.max(np.abs(ref), axis=1)
        r = np.max(np.abs(got - ref), axis=1) / scale
        assert np.max(r) <= (ONE_STEP_REL if min(margins) < NEAR_EDGE else F16_REL), (seed, min(margins), r)
        rel += list(r)
        for other in others:
            wrong = _reference.forward(path, tokens, kv_types=other)[start - 1:]
            rel_other.append(np.median(np.max(np.abs(got - wrong), axis=1) / scale))
    assert min(rel_other) > 20 * np.median(rel), (rel, rel_other)


@pytest.mark.model
def test_smollm2_q8_keys_f16_values_close_to_transformers(smollm2_path):
    kls = kl_from_transformers(smollm2_path, "q8_0", "f16")
    assert max(kls) <= SMOLLM2_KL_MAX, kls


def test_bytes_per_entry(tiny_model):
    path = str(tiny_model(Q8_VARIANTS[0]))
    tokens = random_tokens(40, 9)
    for k, v in PAIRS + [("f16", "f16")]:
        with Llama(path, n_ctx=64, kv_type=k, kv_type_v=v) as llm:
            info = llm.model_info
            llm.eval(tokens)
            s = llm.kv_stats()
        d = info["head_dim"]
        per_entry = int(d * ROW_BYTES[k] + d * ROW_BYTES[v]) + 4
        assert (s["kv_type"], s["kv_type_v"]) == (k, v)
        assert s["bytes_per_element"] == (ROW_BYTES[k] + ROW_BYTES[v]) / 2
        assert s["entries"] == 40 * info["n_layer"] * info["n_head_kv"]
        assert s["bytes"] % per_entry == 0 and s["bytes"] // per_entry >= 40 * info["n_layer"] * info["n_head_kv"]


@pytest.mark.parametrize("policy", list_policies())
def test_every_policy_runs_on_a_mixed_cache(tiny_model, policy):
    """A sanity check as test_kv_q8's: past the budget and a few decode steps, the logits
    are finite and near the same policy's on an f16 cache (a policy reading a key or value
    in the other side's type lands at O(1))."""
    path = str(tiny_model(Q8_VARIANTS[0]))
    tokens = random_tokens(160, 10)
    out = {}
    for pair in (("f16", "f16"), ("q8_0", "f16"), ("f16", "q8_0")):
        with Llama(path, n_ctx=192, kv_type=pair[0], kv_type_v=pair[1], policy=policy,
                   budget=None if policy == "full" else 48) as llm:
            llm.eval(tokens[:150])
            for t in tokens[150:]:
                llm.eval([t])
            out[pair] = llm.logits().copy()
    ref = out.pop(("f16", "f16"))
    for pair, logits in out.items():
        assert np.all(np.isfinite(logits)), pair
        assert np.max(np.abs(logits - ref)) <= 0.1 * np.max(np.abs(ref)), pair


def test_state_round_trip_and_refusal(tiny_model):
    path = str(tiny_model(Q8_VARIANTS[0]))
    a, b = random_tokens(30, 11), random_tokens(10, 12)
    state, _ = state_round_trip(path, a, b, n_ctx=64, exact_matmul=True, kv_type="q8_0", kv_type_v="f16",
                                policy="snapkv", budget=24, window=8)
    for k, v in (("q8_0", "q8_0"), ("f16", "q8_0"), ("f16", "f16")):
        with Llama(path, n_ctx=64, kv_type=k, kv_type_v=v, policy="snapkv", budget=24, window=8) as other:
            with pytest.raises(InvalidArgumentError, match="KV cache of q8_0 keys and f16 values; this context"):
                other.load_state(state)


def test_bad_value_type_is_a_clear_error(tiny_model):
    with pytest.raises(InvalidArgumentError, match="kv_type_v must be one of"):
        Llama(str(tiny_model()), n_ctx=32, kv_type_v="q4_0")
    name = next(n for n, spec in sorted(VARIANTS.items()) if spec.head_dim % 32)
    with pytest.raises(InvalidArgumentError, match="multiple of 32.*asked for the values"):
        Llama(str(tiny_model(name)), n_ctx=32, kv_type="f16", kv_type_v="q8_0")


def test_command_line_flags(tiny_model):
    from test_cli import run_cli
    path = tiny_model(Q8_VARIANTS[0])
    want = {}
    for pair in (("q8_0", "f16"), ("f16", "q8_0"), ("q8_0", "q8_0")):
        with Llama(str(path), n_ctx=4096, exact_matmul=True, kv_type=pair[0], kv_type_v=pair[1]) as llm:
            want[pair] = llm.generate("a", max_tokens=12, temperature=0).tokens
    for flags, pair, shown in ((("-ctk", "q8_0"), ("q8_0", "f16"), "K q8_0, V f16"),
                               (("-ctv", "q8_0"), ("f16", "q8_0"), "K f16, V q8_0"),
                               (("--cache-type", "q8_0", "-ctv", "f16"), ("q8_0", "f16"), "K q8_0, V f16"),
                               (("-ctk", "q8_0", "-ctv", "q8_0"), ("q8_0", "q8_0"), "(q8_0)"),
                               (("--cache-type", "q8_0"), ("q8_0", "q8_0"), "(q8_0)")):
        r = run_cli("generate", path, "-p", "a", "-n", 12, "--temp", 0, "--json", "--exact-matmul", "--kv-stats", *flags)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tokens"] == want[pair], flags
        assert shown in r.stderr, (flags, r.stderr)   # the cache's own report of its types
