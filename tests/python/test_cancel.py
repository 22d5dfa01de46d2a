"""Cancelling a running eval() from another thread (Llama.cancel, pykv_cancel).

The call stops with GenerationCancelled; the chunks it finished stay (n_past and input_ids
count them) and the chunk it stopped in is rolled back exactly: every list holds each
position below n_past once and nothing at or past it, so evaluation goes on as if the call
had been cut at that chunk boundary. With the full cache, finishing the prompt afterwards
gives the same logits as one uncancelled call (the same chunks in the same order).
Policies that work layer by layer stop only at a chunk boundary, since their hooks change
the earlier layers' lists while a chunk runs; a cancel during the last chunk (a decode step
is one) lets the call finish and still raises, and one between two calls stops the next,
so a generation loop always stops.
"""
import threading
import time

import numpy as np
import pytest

from pykv import Llama
from pykv.errors import GenerationCancelled

pytestmark = pytest.mark.model

N_PROMPT, N_BATCH = 640, 64
PROMPT = [int(t) for t in np.random.default_rng(5).integers(100, 40000, size=N_PROMPT)]


def _open(path, policy="full", **kw):
    return Llama(str(path), n_ctx=N_PROMPT + 64, n_batch=N_BATCH, n_threads=2, verbose=False, policy=policy,
                 **kw)


def assert_consistent(llm):
    """Every list holds distinct positions, all below n_past; input_ids has n_past tokens."""
    n = llm.n_past
    assert len(llm.input_ids) == n
    info = llm.model_info
    for layer in range(info["n_layer"]):
        for g in range(info["n_head_kv"]):
            pos = list(llm.kv_positions(layer, g))
            assert len(pos) == len(set(pos)), (layer, g)
            assert all(0 <= p < n for p in pos), (layer, g, n, [p for p in pos if p >= n][:4])


def eval_cancelled_at_chunk(llm, tokens, k):
    """eval(tokens), calling cancel() from its progress callback once k chunks are done (the
    chunks' sizes are the policy's own): the next chunk stops before its first layer, so the
    call ends exactly at that chunk boundary, whatever the machine's speed. Returns the
    boundaries the progress callback reported."""
    boundaries = []

    def on_chunk(n_done, _n_total):
        boundaries.append(n_done)
        if len(boundaries) == k:
            llm.cancel()

    with pytest.raises(GenerationCancelled):
        llm.eval(tokens, progress=on_chunk)
    return boundaries


def eval_cancelled_after(llm, tokens, seconds):
    """eval(tokens) with a cancel from another thread after `seconds`; True if it raised."""
    timer = threading.Timer(seconds, llm.cancel)
    timer.start()
    try:
        llm.eval(tokens)
        return False
    except GenerationCancelled:
        return True
    finally:
        timer.cancel()
        timer.join()   # a cancel that fired after the call returned stays for the next call


@pytest.mark.parametrize("policy", ["full", "ems"])
def test_cancel_between_calls_stops_the_next(smollm2_path, policy):
    """A cancel that arrives between two eval() calls (a generation loop samples between
    steps) stops the next call before it evaluates anything; reset() forgets one."""
    with _open(smollm2_path, policy, **({"budget": 48} if policy != "full" else {})) as llm:
        llm.eval(PROMPT[:100])
        llm.cancel()
        with pytest.raises(GenerationCancelled):
            llm.eval([PROMPT[100]])
        assert llm.n_past == 100
        assert_consistent(llm)
        llm.eval([PROMPT[100]])   # reported once: the next call runs
        assert llm.n_past == 101
        llm.cancel()
        llm.reset()
        llm.eval(PROMPT[:8])
        assert llm.n_past == 8


@pytest.mark.parametrize("policy,kw", [("full", {}), ("cake", {"budget": 96}), ("ems", {"budget": 96}),
                                       ("take", {"budget": 96})])
def test_cancel_at_a_chunk_boundary_keeps_the_chunks_done(smollm2_path, policy, kw):
    """A cancel between two chunks of a prefill (from the progress callback, so at a known
    boundary) stops the call there: exactly the chunks done stay evaluated, and evaluating
    the rest gives a consistent cache (and, with the full cache, the uncancelled logits)."""
    with _open(smollm2_path, policy, **kw) as llm:
        llm.eval(PROMPT)
        want = llm.logits()
        for k in (2, 6):
            llm.reset()
            boundaries = eval_cancelled_at_chunk(llm, PROMPT, k)
            assert len(boundaries) == k and 0 < boundaries[-1] < N_PROMPT
            assert llm.n_past == boundaries[-1]
            assert llm.input_ids == PROMPT[:llm.n_past]
            assert_consistent(llm)
            if policy == "full":
                for g in range(llm.model_info["n_head_kv"]):
                    assert list(llm.kv_positions(0, g)) == list(range(llm.n_past))
            llm.eval(PROMPT[llm.n_past:])
            assert llm.n_past == N_PROMPT
            assert_consistent(llm)
            if policy == "full" and boundaries[-1] % N_BATCH == 0:
                np.testing.assert_array_equal(llm.logits(), want)


@pytest.mark.parametrize("policy,kw", [("full", {}), ("cake", {"budget": 96}), ("ems", {"budget": 96}),
                                       ("take", {"budget": 96})])
def test_cancelled_prefill_rolls_back_to_a_chunk_boundary(smollm2_path, policy, kw):
    with _open(smollm2_path, policy, **kw) as llm:
        t0 = time.perf_counter()
        llm.eval(PROMPT)
        whole = time.perf_counter() - t0
        want = llm.logits()
        stopped = 0
        for frac in (0.15, 0.5, 0.85):
            llm.reset()
            if not eval_cancelled_after(llm, PROMPT, frac * whole):
                continue
            stopped += 1
            assert_consistent(llm)
            if llm.n_past < N_PROMPT:   # else it landed in the last chunk, which finished
                if policy == "full":   # nothing was compressed: the cache is the prompt so far
                    for g in range(llm.model_info["n_head_kv"]):
                        assert list(llm.kv_positions(0, g)) == list(range(llm.n_past))
                llm.eval(PROMPT[llm.n_past:])   # goes on from where it stopped
            assert llm.n_past == N_PROMPT
            assert_consistent(llm)
            if policy == "full" and llm.n_past % N_BATCH == 0:
                np.testing.assert_array_equal(llm.logits(), want)
        assert stopped > 0, "no cancel landed inside the prefill"


@pytest.mark.parametrize("policy", ["full", "ems", "cake", "streamingllm"])
def test_cancelled_decode_steps_leave_no_trace(smollm2_path, policy):
    """Decode steps with cancels fired at random moments: a step that raises either
    completed (layer-by-layer policies: a decode-time eviction is never half applied) or
    left the cache as it was; the lists stay consistent either way."""
    rng = np.random.default_rng(3)
    with _open(smollm2_path, policy, budget=None if policy == "full" else 48) as llm:
        llm.eval(PROMPT[:160])
        t0 = time.perf_counter()
        llm.eval([PROMPT[160]])
        step = time.perf_counter() - t0
        stopped = 0
        for i in range(40):
            before = llm.n_past
            if eval_cancelled_after(llm, [PROMPT[161 + i]], float(rng.uniform(0.0, 1.5)) * step):
                stopped += 1
                # finished (layer-by-layer policies), or stopped at a layer boundary or at
                # its start (a cancel that came after the previous step) and rolled back
                assert llm.n_past in (before, before + 1)
            assert_consistent(llm)
        n_past = llm.n_past
        try:
            llm.eval([PROMPT[300]])
        except GenerationCancelled:   # the last cancel came after its step: it stops this one
            assert llm.n_past == n_past   # before evaluating anything
            llm.eval([PROMPT[300]])   # reported once: the next call runs
        assert llm.n_past == n_past + 1
        assert_consistent(llm)
        assert stopped > 0, "no cancel landed inside a decode step"


@pytest.mark.parametrize("policy", ["full", "ems"])
def test_cancel_stops_a_generation(smollm2_path, policy):
    """generate() raises GenerationCancelled soon after cancel() from another thread; the
    result says so. The other thread cancels once a few tokens have streamed (not after a
    fixed time, which a busy machine can spend before the first token)."""
    with _open(smollm2_path, policy, **({"budget": 48} if policy != "full" else {})) as llm:
        streaming = threading.Event()
        canceller = threading.Thread(target=lambda: streaming.wait(60) and llm.cancel())
        canceller.start()
        n_chunks = 0
        try:
            with pytest.raises(GenerationCancelled):
                for _ in llm.generate(PROMPT[:64], max_tokens=N_PROMPT, ignore_eos=True, temperature=0.0,
                                      stream=True):
                    n_chunks += 1
                    if n_chunks == 4:
                        streaming.set()
        finally:
            streaming.set()
            canceller.join()
        res = llm.last_result
        assert res.finish_reason == "cancelled"
        assert 4 <= len(res.tokens) < N_PROMPT - 64
        assert_consistent(llm)


def test_take_starts_afresh_after_a_cancelled_prefill(smollm2_path):
    """TAKE carries its probe scores (an EMA) from chunk to chunk of one call. A call cut
    short by a cancel must not hand them to the next call, even one of the same length that
    starts where the cancelled one stopped: the next call selects exactly what a context
    restored from the same cache (so with no TAKE history) selects. The cancel comes from
    the progress callback after the third chunk, so it lands between two chunks every time."""
    other = [int(t) for t in np.random.default_rng(6).integers(100, 40000, size=N_PROMPT)]
    kw = dict(n_ctx=2 * N_PROMPT + 64, n_batch=N_BATCH, n_threads=2, verbose=False, policy="take", budget=96)
    with Llama(str(smollm2_path), **kw) as llm, Llama(str(smollm2_path), **kw) as fresh:
        eval_cancelled_at_chunk(llm, PROMPT, 3)
        assert 0 < llm.n_past < N_PROMPT
        fresh.load_state(llm.save_state())
        llm.eval(other)
        fresh.eval(other)
        info = llm.model_info
        for layer in range(info["n_layer"]):
            for g in range(info["n_head_kv"]):
                assert llm.kv_positions(layer, g) == fresh.kv_positions(layer, g), (layer, g)
        np.testing.assert_array_equal(llm.logits(), fresh.logits())
