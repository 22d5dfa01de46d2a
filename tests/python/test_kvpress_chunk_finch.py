"""pykv's chunkkv and finch against kvpress 0.5.5 (ChunkKVPress over SnapKVPress, FinchPress):
the positions each (layer, KV head) keeps after one prompt, on a tiny random Llama with
grouped-query attention (8 query heads over 2 KV heads, 3 layers, f32 weights), pykv with
float matrix products and an f32 cache, kvpress in transformers (float32).

Where pykv departs from kvpress by a choice its policy header documents, that choice is
tested on its own: chunkkv's layer-wise index reuse (kvpress 0.5.5 has none) against the
rule written out over kvpress's own chunk selection, and finch's chunked prefill (kvpress
scores the whole prompt at once) against a restatement of the per-chunk rule in torch.
"""

from __future__ import annotations

import numpy as np
import pytest

import _kvpress_reference as ref
from _tiny_models import random_tokens

N_TOKENS = 400
TOKENS = random_tokens(N_TOKENS, seed=47)
N_LAYER = 3
N_HEAD_KV = 2
CHUNK = 20   # ChunkKVPress's chunk_length default
# kvpress's SnapKVPress defaults, as pykv policy arguments
SNAPKV_ARGS = {"window": 64, "pool": "avg", "kernel": 5, "gqa": "mean"}


@pytest.fixture(scope="module")
def model(tiny_model):
    ref.skip_without_kvpress()
    return tiny_model("llama_q8_0_h8kv2", wtype="F32")


def _report(what, found):
    print(f"{what}: min IoU {min(found.values()):.4f}, mean {np.mean(list(found.values())):.4f}")
    return found


def _chunks_of(positions, chunk=CHUNK):
    return sorted({int(p) // chunk for p in positions})


def _whole_chunks(kept, n_tokens, chunk=CHUNK):
    """Every list holds whole chunks (the last chunk may be shorter), the same in every head
    of a layer."""
    for (layer, head), pos in kept.items():
        chunks = _chunks_of(pos, chunk)
        expected = [p for c in chunks for p in range(c * chunk, min((c + 1) * chunk, n_tokens))]
        assert pos.tolist() == expected, f"layer {layer} head {head} keeps part of a chunk"
        assert chunks == _chunks_of(kept[(layer, 0)], chunk)


def _chunkkv_press(budget, n_tokens, chunk=CHUNK):
    from kvpress import ChunkKVPress, SnapKVPress

    n_chunks = -(-n_tokens // chunk)
    inner = SnapKVPress(compression_ratio=ref.compression_ratio(budget // chunk, n_chunks), window_size=64,
                        kernel_size=5)
    return ChunkKVPress(press=inner, chunk_length=chunk)


# ---- chunkkv -----------------------------------------------------------------------------

@pytest.mark.parametrize("budget", (100, 200))
def test_chunkkv_matches_kvpress(model, budget):
    theirs = ref.kvpress_kept(model, TOKENS, _chunkkv_press(budget, N_TOKENS))
    ours = ref.pykv_kept(model, TOKENS, "chunkkv", budget, policy_kwargs=SNAPKV_ARGS)
    assert all(len(v) == budget for v in ours.values())
    _whole_chunks(ours, N_TOKENS)
    _report(f"chunkkv B={budget}", ref.assert_overlap(ours, theirs, what=f"chunkkv B={budget}"))


def test_chunkkv_question_aware_with_a_short_last_chunk_matches_kvpress(model):
    """Prompt + question in one pass: 424 tokens, so the last chunk holds 4 tokens; it is in
    the window and both sides keep it with the chunks before it."""
    question = random_tokens(24, seed=48)
    n = N_TOKENS + len(question)
    theirs = ref.kvpress_kept(model, TOKENS, _chunkkv_press(100, n), question=question)
    ours = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs=SNAPKV_ARGS, question=question)
    _whole_chunks(ours, n)
    assert all(set(range(n - 4, n)) <= set(v.tolist()) and len(v) == 84 for v in ours.values())
    _report("chunkkv aware B=100", ref.assert_overlap(ours, theirs, what="chunkkv with a question"))


def test_chunkkv_layer_index_reuse_is_the_rule_over_kvpress_selection(model):
    """reuse=2 (the paper's layer-wise index reuse; kvpress 0.5.5 scores every layer): layer 1
    keeps the chunks layer 0 chose and layer 2 chooses its own. In a one-pass prefill a
    layer's eviction does not change the next layer's input, so the rule written out over
    kvpress's per-layer selections is the expected result."""
    theirs = ref.kvpress_kept(model, TOKENS, _chunkkv_press(100, N_TOKENS))
    expected = {(layer, head): theirs[(layer - layer % 2, head)] for (layer, head) in theirs}
    ours = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs={**SNAPKV_ARGS, "reuse": 2})
    _whole_chunks(ours, N_TOKENS)
    assert _chunks_of(theirs[(1, 0)]) != _chunks_of(theirs[(0, 0)]), "layers 0 and 1 agree: reuse is not tested"
    _report("chunkkv reuse=2 B=100", ref.assert_overlap(ours, expected, what="chunkkv reuse=2"))
    with_reuse_3 = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs={**SNAPKV_ARGS, "reuse": 3})
    assert all(np.array_equal(with_reuse_3[(layer, h)], theirs[(0, h)]) for (layer, h) in theirs)


@pytest.mark.parametrize("n_batch", (64, 150))
def test_chunkkv_chunked_prefill_keeps_the_one_chunk_selection(model, n_batch):
    """A prompt read in chunks of n_batch tokens is compressed once at its end, with the same
    result as one chunk (the window's queries arrive in the last chunk)."""
    one = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs=SNAPKV_ARGS)
    chunked = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs=SNAPKV_ARGS, n_batch=n_batch)
    assert all(np.array_equal(one[key], chunked[key]) for key in one)


def test_chunkkv_bad_arguments_are_clear_errors(model):
    from pykv import InvalidArgumentError, Llama

    for kwargs, match in [({"policy_kwargs": {"chunk": 0}}, "chunk"),
                          ({"policy_kwargs": {"reuse": 0}}, "reuse"),
                          ({"policy_kwargs": {"chunks": 4}}, "chunks"),
                          ({"budget": 16, "policy_kwargs": {"window": 8}}, "at least one chunk"),
                          ({"budget": 32}, "larger than the window")]:
        kwargs.setdefault("budget", 100)
        with pytest.raises(InvalidArgumentError, match=match):
            Llama(str(model), n_ctx=512, policy="chunkkv", **kwargs)
