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


@pytest.fixture(scope="module")
def model(tiny_model):
    ref.skip_without_kvpress()
    return tiny_model("llama_q8_0_h8kv2", wtype="F32")



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
    ours = ref.pykv_kept(model, TOKENS, "chunkkv", budget, policy_kwargs=ref.SNAPKV_ARGS)
    assert all(len(v) == budget for v in ours.values())
    _whole_chunks(ours, N_TOKENS)
    ref.report(f"chunkkv B={budget}", ref.assert_overlap(ours, theirs, what=f"chunkkv B={budget}"))


def test_chunkkv_question_aware_with_a_short_last_chunk_matches_kvpress(model):
    """Prompt + question in one pass: 424 tokens, so the last chunk holds 4 tokens; it is in
    the window and both sides keep it with the chunks before it."""
    question = random_tokens(24, seed=48)
    n = N_TOKENS + len(question)
    theirs = ref.kvpress_kept(model, TOKENS, _chunkkv_press(100, n), question=question)
    ours = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs=ref.SNAPKV_ARGS, question=question)
    _whole_chunks(ours, n)
    assert all(set(range(n - 4, n)) <= set(v.tolist()) and len(v) == 84 for v in ours.values())
    ref.report("chunkkv aware B=100", ref.assert_overlap(ours, theirs, what="chunkkv with a question"))


def test_chunkkv_layer_index_reuse_is_the_rule_over_kvpress_selection(model):
    """reuse=2 (the paper's layer-wise index reuse; kvpress 0.5.5 scores every layer): layer 1
    keeps the chunks layer 0 chose and layer 2 chooses its own. In a one-pass prefill a
    layer's eviction does not change the next layer's input, so the rule written out over
    kvpress's per-layer selections is the expected result."""
    theirs = ref.kvpress_kept(model, TOKENS, _chunkkv_press(100, N_TOKENS))
    expected = {(layer, head): theirs[(layer - layer % 2, head)] for (layer, head) in theirs}
    ours = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs={**ref.SNAPKV_ARGS, "reuse": 2})
    _whole_chunks(ours, N_TOKENS)
    assert _chunks_of(theirs[(1, 0)]) != _chunks_of(theirs[(0, 0)]), "layers 0 and 1 agree: reuse is not tested"
    ref.report("chunkkv reuse=2 B=100", ref.assert_overlap(ours, expected, what="chunkkv reuse=2"))
    with_reuse_3 = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs={**ref.SNAPKV_ARGS, "reuse": 3})
    assert all(np.array_equal(with_reuse_3[(layer, h)], theirs[(0, h)]) for (layer, h) in theirs)


@pytest.mark.parametrize("n_batch", (64, 150))
def test_chunkkv_chunked_prefill_keeps_the_one_chunk_selection(model, n_batch):
    """A prompt read in chunks of n_batch tokens is compressed once at its end, with the same
    result as one chunk (the window's queries arrive in the last chunk)."""
    one = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs=ref.SNAPKV_ARGS)
    chunked = ref.pykv_kept(model, TOKENS, "chunkkv", 100, policy_kwargs=ref.SNAPKV_ARGS, n_batch=n_batch)
    assert all(np.array_equal(one[key], chunked[key]) for key in one)


def test_chunkkv_evict_every_chunk_reads_a_prompt_longer_than_the_cache(model):
    """evict_every_chunk=1: every chunk is compressed as a prompt's end is, so 400 tokens go
    through a 160-entry cache; every list then holds whole chunks, at most B entries."""
    from pykv import Llama

    with Llama(str(model), n_ctx=160, n_batch=64, n_threads=2, policy="chunkkv", budget=80,
               evict_every_chunk=True) as llm:
        assert llm.cache_bounded
        llm.eval(TOKENS)
        per_head = llm.kv_stats()["entries_per_head"]
        kept = {(l, h): np.asarray(llm.kv_positions(l, h)) for l in range(N_LAYER) for h in range(N_HEAD_KV)}
    assert max(n for layer in per_head for n in layer) <= 80
    _whole_chunks(kept, N_TOKENS)


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


# ---- finch -------------------------------------------------------------------------------

QUESTION = random_tokens(24, seed=48)
N_ALL = N_TOKENS + len(QUESTION)
FINCH_ARGS = {"window": len(QUESTION)}   # the question's length (kvpress finds it from a delimiter)


def _finch_press(budget, **kwargs):
    from kvpress import FinchPress

    return FinchPress(compression_ratio=ref.compression_ratio(budget, N_ALL), **kwargs)


@pytest.mark.parametrize("budget", (100, 200))
def test_finch_one_chunk_matches_kvpress(model, budget):
    """Prompt + question in one chunk: the question keeps itself and picks the rest.
    rerotate_keys=False: the kept entries are the same with it (next test), and kvpress's
    cache then holds the keys at their positions, which identify every kept row."""
    theirs = ref.kvpress_kept(model, TOKENS, _finch_press(budget, rerotate_keys=False), question=QUESTION)
    ours = ref.pykv_kept(model, TOKENS, "finch", budget, policy_kwargs=FINCH_ARGS, question=QUESTION)
    assert all(len(v) == budget and set(range(N_TOKENS, N_ALL)) <= set(v.tolist()) for v in ours.values())
    ref.report(f"finch B={budget}", ref.assert_overlap(ours, theirs, what=f"finch B={budget}"))


def test_finch_without_normalize_matches_kvpress(model):
    theirs = ref.kvpress_kept(model, TOKENS, _finch_press(100, rerotate_keys=False, normalize_scores=False),
                              question=QUESTION)
    ours = ref.pykv_kept(model, TOKENS, "finch", 100, policy_kwargs={**FINCH_ARGS, "normalize": 0},
                         question=QUESTION)
    ref.report("finch normalize=0 B=100", ref.assert_overlap(ours, theirs, what="finch normalize=0"))


def test_finch_key_rerotation_keeps_the_same_entries(model):
    """kvpress's default rerotate_keys=True moves the kept keys to positions 0 .. B-1 after
    choosing them; pykv keeps the original positions. The choice is the same: past layer 0
    (where a row's value depends on its token only, so repeated tokens cannot be told apart)
    the rotated cache's rows are the same positions, and in layer 0 the same tokens."""
    rotated = ref.kvpress_kept(model, TOKENS, _finch_press(100), question=QUESTION)
    plain = ref.kvpress_kept(model, TOKENS, _finch_press(100, rerotate_keys=False), question=QUESTION)
    ids = np.asarray(TOKENS + QUESTION)
    for (layer, head), pos in rotated.items():
        if layer > 0:
            assert np.array_equal(pos, plain[(layer, head)])
        else:
            assert sorted(ids[pos]) == sorted(ids[plain[(layer, head)]])
    ours = ref.pykv_kept(model, TOKENS, "finch", 100, policy_kwargs=FINCH_ARGS, question=QUESTION)
    assert all(v[-len(QUESTION):].tolist() == list(range(N_TOKENS, N_ALL)) for v in ours.values())


def _layer0_queries_keys(model_path, ids, positions):
    """Layer 0's post-RoPE queries (n, H, D) and keys (n, Hkv, D) of tokens ids at positions,
    from the transformers model (they depend on the token and its position only)."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = ref.hf_model(model_path)
    attn = hf.model.layers[0].self_attn
    D = attn.head_dim
    with torch.no_grad():
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(torch.tensor([ids])))
        q = attn.q_proj(x).view(1, len(ids), -1, D).transpose(1, 2)
        k = attn.k_proj(x).view(1, len(ids), -1, D).transpose(1, 2)
        cos, sin = hf.model.rotary_emb(x, torch.tensor([positions]))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1).double().numpy(), k[0].transpose(0, 1).double().numpy()


def _finch_chunk_rule(qs, ks, kept, question_pos, budget, n_question_kept):
    """One step of the per-chunk rule written out for one KV head: kept = candidate positions,
    ks/qs = {position: key (G, D) query} dicts; question rows attend causally over the
    candidates and the question's own keys; each row times the entries it sees; mean over
    rows and over the query heads; the best budget - n_question_kept candidates stay."""
    cols = sorted(kept) + list(question_pos)
    K = np.stack([ks[p] for p in cols])
    D = K.shape[1]
    total = np.zeros(len(kept))
    for r, p in enumerate(question_pos):
        seen = len(kept) + r + 1
        logits = qs[p] @ K[:seen].T / np.sqrt(D)              # (G, seen)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        total += seen * w[:, :len(kept)].mean(axis=0)
    scores = total / len(question_pos)
    k = budget - n_question_kept
    if len(kept) <= k:
        return sorted(kept)
    order = sorted(range(len(kept)), key=lambda i: (-scores[i], i))
    return sorted(np.asarray(sorted(kept))[order[:k]].tolist())


def test_finch_chunked_prefill_layer0_is_the_per_chunk_rule(model):
    """n_batch 128: chunks of 104 tokens, each followed by the question (24 tokens) at the
    positions after it, compress the cache as they are read; the last chunk holds the
    question itself. Layer 0's queries and keys do not depend on the compressed cache, so
    its kept positions are the per-chunk rule restated over transformers' layer 0."""
    budget, n_batch, nq = 100, 128, len(QUESTION)
    ids = TOKENS + QUESTION
    step = n_batch - nq
    bounds = [0]   # chunks of n_batch - nq tokens while more than n_batch remain; the last takes the rest
    while N_ALL - bounds[-1] > n_batch:
        bounds.append(bounds[-1] + step)
    bounds.append(N_ALL)
    assert bounds == [0, 104, 208, 312, N_ALL]
    # every position a question row or a key of layer 0 takes: the prompt, then the probe after each chunk
    toks, poss = list(ids), list(range(N_ALL))
    for end in bounds[1:-1]:
        toks += QUESTION
        poss += list(range(end, end + nq))
    q, k = _layer0_queries_keys(model, toks, poss)
    G = q.shape[1] // k.shape[1]
    ours = ref.pykv_kept(model, TOKENS, "finch", budget, policy_kwargs=FINCH_ARGS, question=QUESTION,
                         n_batch=n_batch)
    found = {}
    for head in range(k.shape[1]):
        real_q = {p: q[p, head * G:(head + 1) * G] for p in range(N_ALL)}
        real_k = {p: k[p, head] for p in range(N_ALL)}
        kept = []
        for c, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            cand = kept + list(range(start, end))
            if end < N_ALL:   # the probe: the question at the positions after the chunk
                at = N_ALL + (c * nq)
                qs = {end + r: q[at + r, head * G:(head + 1) * G] for r in range(nq)}
                ks = {**real_k, **{end + r: k[at + r, head] for r in range(nq)}}
                kept = _finch_chunk_rule(qs, ks, cand, range(end, end + nq), budget, 0)
            else:             # the last chunk: its own tail is the question, kept
                cand = [p for p in cand if p < N_TOKENS]
                kept = _finch_chunk_rule(real_q, real_k, cand, range(N_TOKENS, N_ALL), budget, nq)
                kept += list(range(N_TOKENS, N_ALL))
        found[(0, head)] = np.asarray(kept)
    got = {key: v for key, v in ours.items() if key[0] == 0}
    ref.report("finch n_batch=128 layer 0 vs the rule", ref.assert_overlap(got, found, what="finch chunked, layer 0"))


def _finch_llama(model, **kwargs):
    from pykv import Llama

    kw = {"n_ctx": 512, "n_batch": 128, "n_threads": 2, "exact_matmul": True, "kv_type": "f32", "policy": "finch",
          "budget": 100, "policy_kwargs": FINCH_ARGS, **kwargs}
    return Llama(str(model), **kw)


def _positions(llm):
    per_head = llm.kv_stats()["entries_per_head"]
    return [[llm.kv_positions(l, h) for h in range(len(per_head[l]))] for l in range(len(per_head))]


def test_finch_question_given_as_the_probe(model):
    """set_probe(question) appends the question itself after each chunk: with the question
    also at the prompt's end that is the default probe (the call's last W tokens), so the
    same entries are kept."""
    with _finch_llama(model) as llm:
        llm.eval(TOKENS + QUESTION)
        default = _positions(llm)
    with _finch_llama(model) as llm:
        llm.set_probe(QUESTION)
        llm.eval(TOKENS + QUESTION)
        assert _positions(llm) == default


def test_finch_reads_a_prompt_longer_than_the_cache(model):
    """Evicting after every chunk, a 424-token prompt goes through a 256-entry cache and keeps
    what it keeps with room to spare; the cache never held more than B + a chunk + the probe."""
    with _finch_llama(model) as llm:
        llm.eval(TOKENS + QUESTION)
        roomy = _positions(llm)
    with _finch_llama(model, n_ctx=256) as llm:
        llm.eval(TOKENS + QUESTION)
        assert _positions(llm) == roomy
        st = llm.kv_stats()
        per_entry = st["bytes"] / st["entries"]
        n_lists = N_LAYER * N_HEAD_KV
        assert st["peak_bytes"] <= (100 + 128) * n_lists * per_entry
        llm.eval([5])   # a decode step appends
        assert {n for layer in llm.kv_stats()["entries_per_head"] for n in layer} == {101}


def test_finch_question_agnostic_compresses_each_call(model):
    """eval(context) then eval(question): the context is compressed by its own last W tokens,
    then the question's call is a new FINCH prefill over the compressed context, keeping the
    question."""
    with _finch_llama(model) as llm:
        llm.eval(TOKENS)
        assert all(len(p) == 100 and p[-24:] == list(range(N_TOKENS - 24, N_TOKENS))
                   for layer in _positions(llm) for p in layer)
        llm.eval(QUESTION)
        assert all(len(p) == 100 and p[-24:] == list(range(N_TOKENS, N_ALL)) for layer in _positions(llm) for p in layer)


def test_finch_bad_arguments_are_clear_errors(model):
    from pykv import InvalidArgumentError, Llama

    for kwargs, match in [({"policy_kwargs": {"window": 0}}, "window"),
                          ({"policy_kwargs": {"normalize": 2}}, "normalize"),
                          ({"policy_kwargs": {"question": 4}}, "question"),
                          ({"window": 8, "policy_kwargs": {"window": 16}}, "disagree"),
                          ({"budget": 24, "policy_kwargs": {"window": 24}}, "larger than the window")]:
        kwargs.setdefault("budget", 100)
        with pytest.raises(InvalidArgumentError, match=match):
            Llama(str(model), n_ctx=512, policy="finch", **kwargs)
    with _finch_llama(model, budget=32) as llm:   # a probe longer than W is the question kept: B must exceed it
        llm.set_probe(random_tokens(40, seed=49))
        with pytest.raises(InvalidArgumentError, match="larger than the window W=40"):
            llm.eval(TOKENS)
