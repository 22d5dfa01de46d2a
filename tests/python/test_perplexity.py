"""pykv.perplexity.perplexity and `pykv perplexity`: llama-perplexity's chunks (each from an
empty context, its first token BOS, its second half scored), checked against the NumPy
float64 reference on tiny models and against transformers on SmolLM2 (exact path)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import _reference
from _compare import EXACT
from _tiny_models import BOS_ID, random_tokens
from pykv import ContextOverflowError, InvalidArgumentError, Llama
from pykv.cli import main
from pykv.perplexity import perplexity


def reference_nll(logits_fn, tokens, size, n_chunks, bos):
    """The scored tokens' negative log-likelihoods, chunk by chunk, from full-sequence logits."""
    out = []
    for i in range(n_chunks):
        chunk = list(tokens[i * size:(i + 1) * size])
        if bos is not None:
            chunk[0] = bos
        logits = logits_fn(chunk)
        x = logits - logits.max(axis=1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
        first = size // 2
        out += [-logp[j][chunk[j + 1]] for j in range(first, size - 1)]
    return np.array(out)


def ppl_and_err(nll):
    mean = nll.mean()
    var = (nll * nll).mean() - mean * mean
    return math.exp(mean), math.exp(mean) * math.sqrt(var / (len(nll) - 1))


@pytest.mark.parametrize("decode", [False, True])
def test_tiny_perplexity_equals_the_reference(tiny_model, decode):
    path = tiny_model()
    tokens = random_tokens(70, 21)   # 4 chunks of 16, 6 tokens left over
    nll = reference_nll(lambda c: _reference.forward(path, c), tokens, 16, 4, BOS_ID)
    want, want_err = ppl_and_err(nll)
    seen = []
    with Llama(str(path), n_ctx=32, n_batch=4, **EXACT) as llm:
        res = perplexity(llm, tokens, chunk_size=16, decode=decode, progress=lambda i, n, p: seen.append((i, n, p)))
        assert llm.n_past == 0
    assert res.n_scored == 4 * 7 and len(res.chunks) == 4
    assert abs(res.ppl - want) < 1e-6 * want and abs(res.ppl_err - want_err) < 1e-5 * want_err
    assert abs(res.nll - nll.mean()) < 1e-6
    assert [s[:2] for s in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)] and seen[-1][2] == res.ppl
    first_chunk, _ = ppl_and_err(nll[:7])
    assert abs(res.chunks[0] - first_chunk) < 1e-6 * first_chunk


def test_chunk_limits_and_refusals(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=32, **EXACT) as llm:
        tokens = random_tokens(70, 22)
        assert perplexity(llm, tokens, chunk_size=16, max_chunks=2).n_scored == 14
        assert perplexity(llm, tokens).chunk_size == 32   # the context size by default
        with pytest.raises(ContextOverflowError, match="n_ctx=32"):
            perplexity(llm, tokens, chunk_size=64)
        with pytest.raises(InvalidArgumentError, match="fewer than one chunk"):
            perplexity(llm, tokens[:15], chunk_size=16)
        for bad in (dict(chunk_size=3), dict(chunk_size=True), dict(max_chunks=0), dict(max_chunks=1.5)):
            with pytest.raises(InvalidArgumentError):
                perplexity(llm, tokens, **bad)


def test_an_evicting_policy_changes_what_is_scored(tiny_model):
    """Under snapkv the first half is compressed before the second is scored: a different,
    finite figure; full gives the reference's."""
    path = str(tiny_model())
    tokens = random_tokens(128, 23)
    with Llama(path, n_ctx=64, **EXACT) as full, \
            Llama(path, n_ctx=64, policy="snapkv", budget=12, window=4, **EXACT) as snap:
        a = perplexity(full, tokens, chunk_size=64)
        b = perplexity(snap, tokens, chunk_size=64)
        assert math.isfinite(b.ppl) and b.ppl != a.ppl
        assert b.kv_stats["evicted"] > 0 and a.kv_stats["evicted"] == 0


def test_cli(tiny_model, tmp_path, capsys):
    path = tiny_model()
    text = "the cat and the dog is in the world " * 12
    src = tmp_path / "text.txt"
    src.write_text(text)
    assert main(["perplexity", str(path), "-f", str(src), "-c", "16", "--chunks", "3", "--exact-matmul",
                 "--cache-type", "f32", "--json"]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    with Llama(str(path), n_ctx=16, **EXACT) as llm:
        tokens = llm.tokenize(text, add_bos=True)
        want = perplexity(llm, tokens, chunk_size=16, max_chunks=3)
    assert got["ppl"] == want.ppl and got["n_scored"] == 21 and got["chunk_size"] == 16
    assert "[1]" in err and "[3]" in err
    assert main(["perplexity", str(path), "-f", str(src), "-c", "16", "--chunks", "1", "--kv-stats"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Final estimate: PPL = ") and "kv cache: policy full" in err
    for bad in (["-c", "2"], ["--chunks", "0"], ["-c", "4096"]):
        assert main(["perplexity", str(path), "-f", str(src), *bad]) == 1, bad
        err = capsys.readouterr().err
        assert "pykv: error:" in err and "chunks of" not in err   # no header before the refusal
    assert "fewer than one chunk of -c 4096" in err


@pytest.mark.model
def test_smollm2_perplexity_matches_transformers(smollm2_path):
    from _torch_reference import reference_logits
    text = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
            "step. All that glitters is not gold, and not all those who wander are lost. ") * 5
    with Llama(str(smollm2_path), n_ctx=64, **EXACT) as llm:
        tokens = llm.tokenize(text, add_bos=True)
        assert len(tokens) >= 128
        res = perplexity(llm, tokens, chunk_size=64, max_chunks=2)
    nll = reference_nll(lambda c: reference_logits(smollm2_path, c, positions=range(len(c))), tokens, 64, 2, None)
    want, _ = ppl_and_err(nll)
    assert res.n_scored == 62
    assert abs(res.ppl - want) < 5e-5 * want, (res.ppl, want)   # measured 1.6e-6
