"""Every token's outputs: Llama(logits_all=True).all_logits(), Llama(embedding=True).embeddings()
and embed()/create_embedding(), generate(prompt_logprobs=N) and create_completion(echo=True).

Tiny models on the exact path are checked against the NumPy float64 reference (every row of
logits, every hidden state after the output norm); SmolLM2 against transformers (logits rows,
last_hidden_state, log-softmax of the prompt's tokens).
"""

from __future__ import annotations


import numpy as np
import pytest

import _reference
from _compare import EXACT, assert_logits_close
from _tiny_models import random_tokens
from pykv import ContextOverflowError, InvalidArgumentError, Llama
from pykv._ffi import ffi, lib

TINY_ATOL, TINY_RTOL = 1e-6, 2e-6   # vs the float64 reference, as test_state / test_prefix_reuse
HIDDEN_ATOL = 1e-5                  # hidden states are O(1..10)


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ---- the C outputs on tiny models ----------------------------------------------------

@pytest.mark.parametrize("name", ["llama_f32_h4kv4", "mistral_q4_0_h8kv2"])
def test_all_logits_over_chunks_and_a_decode_step(tiny_model, name):
    path = tiny_model(name)
    prompt, nxt = random_tokens(45, 11), random_tokens(1, 12)
    ref = _reference.forward(path, prompt + nxt)
    with Llama(str(path), n_ctx=64, n_batch=16, logits_all=True, **EXACT) as llm:   # 3 chunks
        llm.eval(prompt)
        rows = llm.all_logits()
        assert rows.shape == (45, llm.n_vocab)
        for i in range(45):
            assert_logits_close(rows[i], ref[i], atol=TINY_ATOL, rtol_scale=TINY_RTOL, what=f"{name} row {i}")
        np.testing.assert_allclose(rows[-1], llm.logits(), rtol=0, atol=1e-5)
        llm.eval(nxt)   # a decode step: one row
        step = llm.all_logits()
        assert step.shape == (1, llm.n_vocab)
        assert_logits_close(step[0], ref[45], atol=TINY_ATOL, rtol_scale=TINY_RTOL, what=f"{name} decode row")


@pytest.mark.parametrize("name", ["llama_f32_h4kv4", "llama_f16_h4kv2_tied"])
def test_embeddings_are_the_normed_hidden_states(tiny_model, name):
    path = tiny_model(name)
    tokens = random_tokens(40, 13)
    ref = _reference.forward(path, tokens, hidden=True)
    with Llama(str(path), n_ctx=64, n_batch=16, embedding=True, **EXACT) as llm:
        llm.eval(tokens)
        rows = llm.embeddings()
        assert rows.shape == (40, llm.model_info["n_embd"])
        np.testing.assert_allclose(rows, ref, rtol=0, atol=HIDDEN_ATOL)
        with pytest.raises(InvalidArgumentError, match="logits_all=True"):
            llm.all_logits()
        # embeddings leave generation as it was: the last token's logits are still there
        assert_logits_close(llm.logits(), _reference.forward(path, tokens)[-1], atol=TINY_ATOL,
                            rtol_scale=TINY_RTOL, what="logits in embedding mode")


def test_rows_are_the_last_calls_only(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=32, logits_all=True, embedding=True, **EXACT) as llm:
        with pytest.raises(InvalidArgumentError, match="no logits"):
            llm.all_logits()
        llm.eval(random_tokens(10, 1))
        assert llm.all_logits().shape[0] == llm.embeddings().shape[0] == 10
        with pytest.raises(ContextOverflowError):
            llm.eval(random_tokens(30, 2))   # refused: the rows are gone with the call
        with pytest.raises(InvalidArgumentError, match="no logits"):
            llm.all_logits()
        llm.eval(random_tokens(5, 3))
        llm.truncate(12)
        with pytest.raises(InvalidArgumentError, match="no embeddings"):
            llm.embeddings()
        llm.eval(random_tokens(2, 4))
        llm.reset()
        with pytest.raises(InvalidArgumentError, match="no logits"):
            llm.all_logits()


def test_switching_outputs_in_c(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=32, **EXACT) as llm:
        ctx, n = llm._ctx, ffi.new("int32_t *", -1)
        llm.eval(random_tokens(4, 5))
        assert lib.pykv_get_logits_all(ctx, n) == ffi.NULL and n[0] == 0   # off by default
        assert lib.pykv_set_logits_all(ctx, 1) == lib.PYKV_OK
        llm.eval(random_tokens(6, 6))
        assert lib.pykv_get_logits_all(ctx, n) != ffi.NULL and n[0] == 6
        assert lib.pykv_get_embeddings(ctx, n) == ffi.NULL and n[0] == 0
        assert lib.pykv_set_logits_all(ctx, 0) == lib.PYKV_OK   # off: rows and memory gone
        assert lib.pykv_get_logits_all(ctx, n) == ffi.NULL and n[0] == 0
    assert lib.pykv_set_logits_all(ffi.NULL, 1) == lib.PYKV_ERR_INVALID_ARG
    assert b"NULL" in ffi.string(lib.pykv_last_error())
    assert lib.pykv_set_embeddings(ffi.NULL, 1) == lib.PYKV_ERR_INVALID_ARG
    assert lib.pykv_get_embeddings(ffi.NULL, ffi.NULL) == ffi.NULL


def test_a_cancelled_call_leaves_no_rows(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=512, n_batch=8, logits_all=True, **EXACT) as llm:
        llm.cancel()   # pending: stops the next call before it evaluates anything
        with pytest.raises(Exception, match="cancel"):
            llm.eval(random_tokens(100, 7))
        with pytest.raises(InvalidArgumentError, match="no logits"):
            llm.all_logits()


@pytest.mark.parametrize("policy,kwargs", [("snapkv", dict(budget=24, window=4)),
                                           ("take", dict(budget=24, policy_kwargs={"probe": [5, 6, 7]}))])
def test_rows_under_an_evicting_policy(tiny_model, policy, kwargs):
    """One row per token of the call (a probe's tokens have none); the first chunk runs
    before any eviction, so its rows are the full cache's."""
    path = tiny_model()
    tokens = random_tokens(48, 8)
    ref = _reference.forward(path, tokens)
    with Llama(str(path), n_ctx=64, n_batch=16, logits_all=True, policy=policy, **kwargs, **EXACT) as llm:
        llm.eval(tokens)
        rows = llm.all_logits()
        assert rows.shape == (48, llm.n_vocab)
        assert np.all(np.isfinite(rows))
        for i in range(16):
            assert_logits_close(rows[i], ref[i], atol=TINY_ATOL, rtol_scale=TINY_RTOL, what=f"{policy} row {i}")
        np.testing.assert_allclose(rows[-1], llm.logits(), rtol=0, atol=1e-5)


# ---- embed / create_embedding ---------------------------------------------------------

TEXTS = ["Hello world", "the cat and the dog", "a"]


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none", 1, 2, 3, 0])
def test_embed_pools_the_reference_rows(tiny_model, pooling):
    path = tiny_model()
    with Llama(str(path), n_ctx=64, embedding=True, pooling_type=pooling, **EXACT) as llm:
        got = llm.embed(TEXTS)
        assert llm.n_past == 0   # the context is left empty
        for text, vec in zip(TEXTS, got):
            rows = _reference.forward(path, llm.tokenize(text, add_bos=True), hidden=True)
            want = {"mean": rows.mean(axis=0), "cls": rows[0], "last": rows[-1], "none": rows}[llm.pooling_type]
            np.testing.assert_allclose(np.array(vec), want, rtol=0, atol=HIDDEN_ATOL)


def test_embed_options(tiny_model):
    path = tiny_model()
    with Llama(str(path), n_ctx=16, embedding=True, pooling_type="mean", **EXACT) as llm:
        one = llm.embed("Hello world")
        assert isinstance(one, list) and len(one) == llm.model_info["n_embd"] and isinstance(one[0], float)
        unit = np.array(llm.embed("Hello world", normalize=True))
        np.testing.assert_allclose(unit, np.array(one) / np.linalg.norm(one), rtol=0, atol=1e-6)
        assert abs(np.linalg.norm(unit) - 1) < 1e-6
        vecs, count = llm.embed(["Hello world", "the cat"], return_count=True)
        assert count == len(llm.tokenize("Hello world")) + len(llm.tokenize("the cat"))
        long_text = "the cat and the dog " * 10
        ids = llm.tokenize(long_text)
        assert len(ids) > 16
        cut = llm.embed(long_text)   # truncate=True: the first n_ctx tokens
        want = _reference.forward(path, ids[:16], hidden=True).mean(axis=0)
        np.testing.assert_allclose(np.array(cut), want, rtol=0, atol=HIDDEN_ATOL)
        with pytest.raises(ContextOverflowError, match="truncate"):
            llm.embed(["Hello", long_text], truncate=False)
        r = llm.create_embedding(["Hello world", "the cat"])
        assert r["object"] == "list" and [d["index"] for d in r["data"]] == [0, 1]
        assert all(d["object"] == "embedding" for d in r["data"])
        np.testing.assert_array_equal(np.array(r["data"][0]["embedding"]), np.array(one))
        assert r["usage"] == {"prompt_tokens": count, "total_tokens": count}
        assert r["model"] == str(path)
        assert llm.create_embedding("Hello world", model="m")["model"] == "m"
        # generation still works on an embedding Llama, and embed() does not disturb it after
        res = llm.generate(random_tokens(5, 9), max_tokens=3, temperature=0)
        assert len(res.tokens) == 3


def test_embed_refusals(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=16, **EXACT) as llm:
        with pytest.raises(InvalidArgumentError, match="embedding=True"):
            llm.embed("Hello")
        with pytest.raises(InvalidArgumentError, match="embedding=True"):
            llm.embeddings()
    for bad in ("max", 4, "rank", -2, True):
        with pytest.raises(InvalidArgumentError, match="pooling_type"):
            Llama(path, n_ctx=16, embedding=True, pooling_type=bad)
    with Llama(path, n_ctx=16, embedding=True) as llm:
        assert llm.pooling_type == "none"   # as llama.cpp, for a model that declares none
        with pytest.raises(InvalidArgumentError, match="must be a string"):
            llm.embed([1, 2, 3])


def test_pooling_declared_by_the_model(tiny_model):
    """A GGUF's `llama.pooling_type` is the default (llama.cpp reads the same key); an
    explicit pooling_type wins."""
    path = str(tiny_model(pooling_type=3))
    with Llama(path, n_ctx=16, embedding=True) as llm:
        assert llm.metadata["llama.pooling_type"] == "3"
        assert llm.pooling_type == "last"
    with Llama(path, n_ctx=16, embedding=True, pooling_type="mean") as llm:
        assert llm.pooling_type == "mean"


# ---- prompt logprobs and echo ------------------------------------------------------------

def test_prompt_logprobs_equal_the_reference(tiny_model):
    path = tiny_model()
    prompt = random_tokens(30, 10)
    ref = log_softmax(_reference.forward(path, prompt))
    with Llama(str(path), n_ctx=64, n_batch=8, **EXACT) as llm:
        llm.eval(prompt[:20])   # a held prefix is not reused: every row is needed
        res = llm.generate(prompt, max_tokens=2, temperature=0, prompt_logprobs=3)
        assert res.cached_tokens == 0
        lp = res.prompt_logprobs
        assert len(lp) == 30 and lp[0] is None
        for i in range(1, 30):
            assert lp[i].token == prompt[i]
            assert abs(lp[i].logprob - ref[i - 1][prompt[i]]) < 1e-5, i
            want_top = np.argsort(-ref[i - 1], kind="stable")[:3]
            assert [t for t, _ in lp[i].top] == want_top.tolist()
        # the temporary logits_all is off again: the context does not keep rows
        assert lib.pykv_get_logits_all(llm._ctx, ffi.NULL) == ffi.NULL
        # streaming: the first chunk carries them
        chunks = list(llm.generate(prompt, max_tokens=2, temperature=0, prompt_logprobs=0, stream=True))
        assert [e.logprob if e else None for e in chunks[0].prompt_logprobs] == [e.logprob if e else None for e in lp]
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
            llm.generate(prompt, prompt_logprobs=-1)


def test_echo(tiny_model):
    path = tiny_model()
    with Llama(str(path), n_ctx=64, **EXACT) as llm:
        prompt = "the cat and the dog"
        ids = llm.tokenize(prompt, add_bos=True)
        assert ids[0] == llm.token_bos()
        plain = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]
        echoed = llm.create_completion(prompt, max_tokens=4, temperature=0, echo=True)["choices"][0]
        assert echoed["text"] == prompt + plain["text"] and echoed["logprobs"] is None
        out = llm.create_completion(prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)["choices"][0]
        lp = out["logprobs"]
        ref = log_softmax(_reference.forward(path, ids + llm.last_result.tokens))
        # BOS left out; the first remaining token has none (OpenAI's form); then every token,
        # the prompt's and the completion's, under the row before it
        n = len(ids) - 1 + 4
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        seq = ids + llm.last_result.tokens
        for j in range(1, n):
            k = j + 1   # index in seq
            assert abs(lp["token_logprobs"][j] - ref[k - 1][seq[k]]) < 1e-5, j
            assert len(lp["top_logprobs"][j]) >= 2
        assert lp["tokens"][:len(ids) - 1] == [llm.token_to_piece(t).decode() for t in ids[1:]]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        streamed = list(llm.create_completion(prompt, max_tokens=4, temperature=0, echo=True, stream=True))
        assert streamed[0]["choices"][0]["text"].startswith(prompt)
        assert "".join(c["choices"][0]["text"] for c in streamed) == echoed["text"]
        # an end of generation at once: the prompt alone, then the finish
        stop_now = dict(max_tokens=4, temperature=0, echo=True, logit_bias={llm.token_eos(): 1e4})
        nothing = list(llm.create_completion(prompt, stream=True, **stop_now))
        assert [c["choices"][0]["text"] for c in nothing] == [prompt, ""]
        assert nothing[-1]["choices"][0]["finish_reason"] == "stop"
        with_lp = list(llm.create_completion(prompt, stream=True, logprobs=1, **stop_now))
        assert with_lp[0]["choices"][0]["text"] == prompt
        assert len(with_lp[0]["choices"][0]["logprobs"]["tokens"]) == len(ids) - 1


# ---- SmolLM2 against transformers -----------------------------------------------------------

@pytest.mark.model
def test_smollm2_rows_and_embeddings_match_transformers(smollm2_path):
    from _torch_reference import reference_hidden, reference_logits
    text = "The quick brown fox jumps over the lazy dog. It was a sunny day"
    with Llama(str(smollm2_path), n_ctx=128, n_batch=8, logits_all=True, embedding=True, **EXACT) as llm:
        ids = llm.tokenize(text, add_bos=True)
        llm.eval(ids)
        rows, hidden = llm.all_logits(), llm.embeddings()
    ref = reference_logits(smollm2_path, ids, positions=range(len(ids)))
    for i in range(len(ids)):
        assert_logits_close(rows[i], ref[i], atol=2e-4, what=f"SmolLM2 row {i}")
    ref_hidden = reference_hidden(smollm2_path, ids)
    scale = np.abs(ref_hidden).max()
    np.testing.assert_allclose(hidden, ref_hidden, rtol=0, atol=1e-5 * scale)


@pytest.mark.model
def test_smollm2_echo_logprobs_match_transformers(smollm2_path):
    from _torch_reference import reference_logits
    prompt = "The capital of France is"
    with Llama(str(smollm2_path), n_ctx=128, **EXACT) as llm:
        ids = llm.tokenize(prompt, add_bos=True)
        out = llm.create_completion(prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)["choices"][0]
        seq = ids + llm.last_result.tokens
    lp = out["logprobs"]
    ref = log_softmax(reference_logits(smollm2_path, seq, positions=range(len(seq))))
    assert out["text"].startswith(prompt)
    assert "".join(lp["tokens"]) == out["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:j])) for j in range(len(seq))]
    assert len(lp["token_logprobs"]) == len(seq) and lp["token_logprobs"][0] is None   # SmolLM2 adds no BOS
    for j in range(1, len(seq)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1][seq[j]]) < 5e-4, j


# ---- pykv embed (llama-embedding) ------------------------------------------------------------

def test_cli_embed(tiny_model, capsys):
    import json

    from pykv.cli import main
    path = tiny_model()
    texts = ["Hello world", "the cat and the dog"]
    exact = ["--exact-matmul", "--cache-type", "f32", "-c", "64"]
    with Llama(str(path), n_ctx=64, **EXACT) as llm:
        raw = [_reference.forward(path, llm.tokenize(t, add_bos=True), hidden=True).mean(axis=0) for t in texts]
    for p, scale in ((2, lambda v: np.linalg.norm(v)), (1, lambda v: np.abs(v).sum()),
                     (-1, lambda v: 1.0), (0, lambda v: np.abs(v).max() / 32760.0), (3, lambda v: (np.abs(v) ** 3).sum() ** (1 / 3))):
        assert main(["embed", str(path), "-p", "\n".join(texts), "--pooling", "mean", "--embd-normalize", str(p),
                     "--embd-output-format", "array", *exact]) == 0
        got = json.loads(capsys.readouterr().out)
        assert len(got) == 2
        for vec, want in zip(got, raw):
            np.testing.assert_allclose(np.array(vec), want / scale(want), rtol=2e-5, atol=1e-5 * abs(want / scale(want)).max())
    assert main(["embed", str(path), "-p", "Hello world|the cat", "--embd-separator", "|", "--pooling", "last",
                 "--embd-output-format", "json", *exact]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["index"] for d in out["data"]] == [0, 1] and out["usage"]["prompt_tokens"] > 2
    assert main(["embed", str(path), "-p", "\n".join(texts), "--pooling", "mean", *exact]) == 0
    out = capsys.readouterr().out
    assert out.startswith("embedding 0: ") and "cosine similarity matrix" in out
    assert main(["embed", str(path), "-p", "Hello", *exact]) == 0   # no pooling: a line per token
    assert "embedding 0 token 1: " in capsys.readouterr().out
    for bad in (["-p", " \n "], ["-p", "x", "--embd-normalize", "-2"], ["-p", "x", "--pooling", "max"]):
        assert main(["embed", str(path), *bad]) == 1, bad
        assert "pykv: error:" in capsys.readouterr().err
