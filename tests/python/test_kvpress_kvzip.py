"""pykv's kvzip against kvpress 0.5.5's KVzipPress (the outside reference): the positions each
(layer, KV head) keeps after one prompt, on a tiny random Llama with grouped-query attention
(8 query heads over 2 KV heads, 3 layers, f32 weights), pykv with float matrix products and an
f32 cache, kvpress in transformers (float32).

KVzipPress tokenizes its repeat prompt with ``AutoTokenizer`` of the model's name; a GGUF loaded
by transformers has none, so the press gets pykv's tokenizer of the same file (no chat
template: the plain-text prompt pykv uses, the documented difference for models with one).
kvpress ranks entries across all layers and heads together; its ``compression_ratio`` is set so
that it keeps as many entries in all as pykv's budget (B per list on average).

The choices kvzip.c documents are tested on their own: a reconstruction pass bounded by the
prefill chunk (kvpress with the same shorter chunk keeps the same entries), several
reconstruction chunks, chunked prefill, the layer-wise split, evict_every_chunk, reset,
cancellation and bad arguments. On SmolLM2 (model, slow): the same comparison on the real
model, and kvzip finding a needle in the question-agnostic setting (the document compressed
before the question comes) more often than snapkv.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import _kvpress_reference as ref
from _tiny_models import random_tokens
from pykv import ContextOverflowError, InvalidArgumentError, Llama
from pykv.errors import GenerationCancelled

N_TOKENS = 300
TOKENS = random_tokens(N_TOKENS, seed=47)
BUDGETS = (75, 150)   # 25% and 50% of the prompt, entries per (layer, KV head) on average
N_LAYER, N_HEAD_KV = 3, 2
FIRST_TEXT = "\n\nRepeat the previous context exactly."
NEXT_TEXT = "\n\nRepeat the part of the previous context exactly, starting with"
PREV_TAIL = 8


@pytest.fixture(scope="module")
def model(tiny_model):
    ref.skip_without_kvpress()
    return tiny_model("llama_q8_0_h8kv2", wtype="F32")


class _PykvTokenizer:
    """What KVzipPress asks of a transformers tokenizer, answered by pykv's tokenizer."""

    chat_template = None

    def __init__(self, path):
        self._llm = Llama(str(path), vocab_only=True)

    def encode(self, text, return_tensors=None, add_special_tokens=False):
        import torch

        ids = self._llm.tokenize(text, add_bos=add_special_tokens)
        return torch.tensor([ids], dtype=torch.long) if return_tensors == "pt" else ids


@pytest.fixture(scope="module")
def tokenizer(model):
    return _PykvTokenizer(model)


@pytest.fixture
def kvzip_press(monkeypatch, tokenizer):
    """KVzipPress(**kwargs) whose AutoTokenizer is pykv's tokenizer of the model."""
    from kvpress import KVzipPress
    from kvpress.presses import kvzip_press as module

    class _Auto:
        @staticmethod
        def from_pretrained(*_args, **_kwargs):
            return tokenizer

    monkeypatch.setattr(module, "AutoTokenizer", _Auto)
    return KVzipPress


def global_ratio(budget, n_tokens, n_lists=N_LAYER * N_HEAD_KV):
    """kvpress prunes int(numel * r) of all numel entries: r that keeps budget * n_lists."""
    numel = n_lists * n_tokens
    return (numel - budget * n_lists + 0.5) / numel


def layer_ratio(budget, n_tokens):
    """layerwise: int(n_head_kv * n * r) pruned per layer, keeping budget * n_head_kv."""
    per_layer = N_HEAD_KV * n_tokens
    return (per_layer - budget * N_HEAD_KV + 0.5) / per_layer


def pass_overhead(tokenizer):
    """Tokens of a pass that are not the chunk's (kvzip.c's pass_chunk_len)."""
    first, nxt, suffix = (len(tokenizer.encode(t)) for t in (FIRST_TEXT, NEXT_TEXT, "\n"))
    return max(first + suffix, nxt + PREV_TAIL + suffix)


def _total(kept):
    return sum(len(v) for v in kept.values())


# ---- the same entries as kvpress -------------------------------------------------------------

@pytest.mark.parametrize("budget", BUDGETS)
def test_kvzip_matches_kvpress(model, kvzip_press, budget):
    """One reconstruction chunk (the prompt fits kvpress's 2048 and pykv's n_batch)."""
    theirs = ref.kvpress_kept(model, TOKENS, kvzip_press(compression_ratio=global_ratio(budget, N_TOKENS)))
    ours = ref.pykv_kept(model, TOKENS, "kvzip", budget, n_ctx=1024, n_batch=512)
    assert _total(ours) == _total(theirs) == budget * N_LAYER * N_HEAD_KV
    assert len({len(v) for v in ours.values()}) > 1, "the global ranking gave every list the same share"
    for kept in ours.values():
        assert set(range(4)) <= set(kept.tolist()), "a sink was evicted"
    ref.report(f"kvzip B={budget}", ref.assert_overlap(ours, theirs, what=f"kvzip B={budget}"))


def test_kvzip_layerwise_matches_kvpress(model, kvzip_press):
    budget = BUDGETS[0]
    press = kvzip_press(compression_ratio=layer_ratio(budget, N_TOKENS), layerwise=True)
    theirs = ref.kvpress_kept(model, TOKENS, press)
    ours = ref.pykv_kept(model, TOKENS, "kvzip", budget, n_ctx=1024, n_batch=512, policy_kwargs={"layerwise": 1})
    for layer in range(N_LAYER):
        assert sum(len(ours[(layer, h)]) for h in range(N_HEAD_KV)) == budget * N_HEAD_KV
    ref.report("kvzip layerwise", ref.assert_overlap(ours, theirs, what="kvzip layerwise"))


def test_kvzip_several_chunks_match_kvpress(model, kvzip_press):
    """Reconstruction in chunks of 64: later passes repeat the chunk before's last 8 tokens,
    and attend the sinks beside their own chunk."""
    budget = BUDGETS[0]
    theirs = ref.kvpress_kept(model, TOKENS, kvzip_press(compression_ratio=global_ratio(budget, N_TOKENS),
                                                         chunk_size=64))
    ours = ref.pykv_kept(model, TOKENS, "kvzip", budget, n_ctx=1024, n_batch=512, policy_kwargs={"chunk_size": 64})
    ref.report("kvzip chunk 64", ref.assert_overlap(ours, theirs, what="kvzip chunk_size=64"))


def test_kvzip_pass_bounded_by_prefill_chunk(model, kvzip_press, tokenizer):
    """The documented choice: a pass fits one prefill chunk, so with n_batch=96 and the
    default chunk_size (2048) pykv reconstructs 96 - overhead tokens at a time, as kvpress
    does with that chunk_size; the prompt's own chunked prefill (96 at a time) changes nothing."""
    budget, n_batch = BUDGETS[0], 96
    chunk = n_batch - pass_overhead(tokenizer)
    theirs = ref.kvpress_kept(model, TOKENS, kvzip_press(compression_ratio=global_ratio(budget, N_TOKENS),
                                                         chunk_size=chunk))
    ours = ref.pykv_kept(model, TOKENS, "kvzip", budget, n_ctx=1024, n_batch=n_batch)
    ref.report(f"kvzip n_batch={n_batch}", ref.assert_overlap(ours, theirs, what=f"kvzip n_batch={n_batch}"))
    default = ref.kvpress_kept(model, TOKENS, kvzip_press(compression_ratio=global_ratio(budget, N_TOKENS)))
    assert np.mean(list(ref.ious(ours, default).values())) < 0.99, "the chunk bound made no difference here"


# ---- pykv's own behaviour --------------------------------------------------------------------

def _positions(llm):
    per_head = llm.kv_stats()["entries_per_head"]
    return {(l, h): llm.kv_positions(l, h) for l in range(len(per_head)) for h in range(len(per_head[l]))}


def test_kvzip_reset_and_threads(model):
    """pykv_reset forgets the scores: the same prompt again keeps the same entries, with one
    thread or two."""
    with Llama(str(model), n_ctx=512, n_threads=2, policy="kvzip", budget=75) as llm:
        llm.eval(TOKENS)
        first = _positions(llm)
        llm.reset()
        llm.eval(TOKENS)
        assert _positions(llm) == first
    with Llama(str(model), n_ctx=512, n_threads=1, policy="kvzip", budget=75) as llm:
        llm.eval(TOKENS)
        assert _positions(llm) == first


def test_kvzip_evict_every_chunk(model):
    """A prompt three times n_ctx goes through a cache bounded by n_ctx: every chunk is
    reconstructed and each list cut to its own top B, the sinks kept."""
    toks = random_tokens(600, seed=3)
    with Llama(str(model), n_ctx=200, n_batch=64, policy="kvzip", budget=60, evict_every_chunk=True) as llm:
        llm.eval(toks)
        for (layer, head), pos in _positions(llm).items():
            assert len(pos) == 60, (layer, head)
            assert pos[:4] == [0, 1, 2, 3] and pos[-1] < 600
        llm.eval([5])   # decode after it
        assert llm.n_tokens == 601


def test_kvzip_later_call_keeps_earlier_scores(model):
    """A second prompt is reconstructed alone; the first call's entries compete with their
    own scores, and the cache ends at the budget again."""
    with Llama(str(model), n_ctx=512, policy="kvzip", budget=60) as llm:
        llm.eval(TOKENS[:200])
        llm.eval(TOKENS[200:])
        kept = _positions(llm)
        assert _total(kept) == 60 * N_LAYER * N_HEAD_KV
        assert any(min(p[4:]) < 200 for p in kept.values()) and any(max(p) >= 200 for p in kept.values())


def test_kvzip_cancel_during_passes_rolls_back(model):
    """A cancel that lands while the reconstruction runs undoes the prompt's last chunk (here
    its only one), as a cancelled chunk is undone; one that lands later reports the call
    cancelled with its tokens evaluated and compressed. Either way the context stays usable:
    the same tokens evaluated again give the uncancelled result."""
    toks = random_tokens(1000, seed=5)
    with Llama(str(model), n_ctx=2048, n_batch=2048, n_threads=1, policy="kvzip", budget=200) as llm:
        llm.eval(toks)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks)
        whole = time.perf_counter() - t0
        expected = _positions(llm)
        rolled_back = 0
        for frac in (0.55, 0.7, 0.85):
            llm.reset()
            timer = threading.Timer(whole * frac, llm.cancel)
            timer.start()
            try:
                llm.eval(toks)
            except GenerationCancelled:
                if llm.n_tokens == 0:
                    rolled_back += 1
                    assert llm.kv_stats()["entries"] == 0
                else:
                    assert llm.n_tokens == len(toks) and _positions(llm) == expected
            finally:
                timer.join()
            llm.reset()
            llm.eval(toks)
            assert _positions(llm) == expected
        if not rolled_back:
            pytest.skip("no timed cancel landed inside the reconstruction pass")


@pytest.mark.parametrize("args,budget,message", [
    ({"chunk_size": 0}, 64, "chunk_size"),
    ({"n_sink": -1}, 64, "n_sink"),
    ({"layerwise": 2}, 64, "layerwise"),
    ({"window": 8}, 64, "window"),
    ({"n_sink": 80}, 64, "n_sink"),
])
def test_kvzip_bad_arguments(model, args, budget, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Llama(str(model), n_ctx=256, policy="kvzip", budget=budget, policy_kwargs=args)


def test_kvzip_no_room_for_the_pass(model):
    """A prefill chunk too small for the repeat prompt is refused with a clear error."""
    with Llama(str(model), n_ctx=256, n_batch=16, policy="kvzip", budget=64) as llm:
        with pytest.raises(ContextOverflowError, match="no room for its reconstruction pass"):
            llm.eval(TOKENS[:100])


# ---- the question-agnostic needle on SmolLM2 -------------------------------------------------

@pytest.mark.model
@pytest.mark.slow
def test_kvzip_finds_the_needle_agnostic_more_often_than_snapkv(smollm2_path):
    """1K-token needle samples of pykv eval, the context compressed to 25% before the
    question comes (eval(context), then eval(question)): kvzip keeps what repeating the text
    needs, the passkey included; snapkv's window is the end of the document, which does not
    point at the passkey."""
    from pykv.eval.needle import answer
    from pykv.eval.samples import make_needle_sample

    with Llama(smollm2_path, n_ctx=1100, vocab_only=True) as llm:
        samples = [make_needle_sample(llm, 1024, i, depth, seed=0) for i, depth in ((0, 0.1), (1, 0.3))]
    hits = {}
    for policy in ("kvzip", "snapkv"):
        hits[policy] = []
        for sample in samples:
            budget = round(len(sample.context) * 0.25)
            with Llama(smollm2_path, n_ctx=1100, n_threads=2, policy=policy, budget=budget) as llm:
                hits[policy].append(sample.hit(answer(llm, sample, "agnostic", 24)[0]))
    assert sum(hits["kvzip"]) > sum(hits["snapkv"]), hits
    assert all(hits["kvzip"]), hits


@pytest.mark.model
@pytest.mark.slow
def test_kvzip_matches_kvpress_on_smollm2(smollm2_path, monkeypatch):
    """The same comparison on the real model (30 layers, 9 query heads over 3 KV heads, its BPE
    tokenizer), 300 tokens of pykv eval's haystack text, the repeat prompt without the chat template (the
    documented difference: kvpress would use SmolLM2's)."""
    ref.skip_without_kvpress()
    from kvpress import KVzipPress
    from kvpress.presses import kvzip_press as module

    tokenizer = _PykvTokenizer(smollm2_path)
    monkeypatch.setattr(module, "AutoTokenizer", type("Auto", (), {
        "from_pretrained": staticmethod(lambda *_args, **_kwargs: tokenizer)}))
    from pykv.eval import haystack_text
    tokens = tokenizer.encode(haystack_text())[:300]
    budget, n_lists = 75, 30 * 3
    theirs = ref.kvpress_kept(smollm2_path, tokens,
                              KVzipPress(compression_ratio=global_ratio(budget, len(tokens), n_lists)))
    ours = ref.pykv_kept(smollm2_path, tokens, "kvzip", budget, n_ctx=1024, n_batch=512)
    ref.report("kvzip SmolLM2", ref.assert_overlap(ours, theirs, what="kvzip SmolLM2"))
