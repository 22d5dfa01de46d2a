"""GBNF grammars (pykv.LlamaGrammar, generate(grammar=...)): the tokens the C matcher allows
at each step equal a brute-force reference (a regular expression for the same language over
every token of the vocabulary, text split inside characters included), on the tiny model's
byte-token vocabulary and on SmolLM2's; greedy constrained generation picks the best allowed
token; sampling draws from the allowed tokens with the masked distribution, through both of
the sampler's ways (checking the best tokens one by one, masking the vocabulary); and the
refusals."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import regex

from _compare import EXACT
from _grammar_reference import allowed_tokens, boundary_points
from _tiny_models import tiny_vocab
from pykv import InvalidArgumentError, Llama, LlamaGrammar
from pykv._ffi import check, ffi, lib
from pykv._sampling import make_sampler
from pykv.grammar import JSON_GBNF, bind

# (GBNF, an equivalent regular expression, the bounds of its character ranges)
CASES = {
    "choice": ('root ::= ("yes" | "no") "."', r"(?:yes|no)\.", []),
    "words": ('root ::= [a-z]+ (" " [a-z]+){0,3}', r"[a-z]+(?: [a-z]+){0,3}", [(97, 122)]),
    "accents": ('root ::= "\\u00e9" [^a-z\\u00e0-\\u00ff]* "\\u00fc"?', r"\u00e9[^a-z\u00e0-\u00ff]*\u00fc?",
                [(97, 122), (0xE0, 0xFF), (0xE9, 0xE9), (0xFC, 0xFC)]),
    "record": ('root ::= "{" ws "\\"n\\"" ws ":" ws [0-9]+ ws "}"\nws ::= [ \\n]*',
               r'\{[ \n]*"n"[ \n]*:[ \n]*[0-9]+[ \n]*\}', [(48, 57), (10, 10), (32, 32)]),
}


def pieces_of(llm):
    return [llm.token_to_piece(t) for t in range(llm.n_vocab)], {t for t in range(llm.n_vocab) if llm.is_eog(t)}


def allowed_now(matcher, n_vocab):
    buf = ffi.new("uint8_t[]", n_vocab)
    check(lib.pykv_grammar_allowed(matcher, buf, n_vocab))
    return {t for t in range(n_vocab) if buf[t]}


def walk_and_compare(llm, case, path):
    """Accept the tokens of path one by one; before each and at the end, the allowed set must
    equal the reference's."""
    gbnf, pattern, ranges = CASES[case]
    pieces, eog = pieces_of(llm)
    matcher = bind(llm._model, LlamaGrammar(gbnf))
    text = b""
    for token in list(path) + [None]:
        got = allowed_now(matcher, llm.n_vocab)
        want = allowed_tokens(pattern, text, pieces, eog, boundary_points(*ranges))
        assert got == want, (case, text, sorted(got ^ want)[:10])
        if token is None:
            break
        assert token in got
        check(lib.pykv_grammar_accept(matcher, token))
        text += pieces[token]
    complete = bool(lib.pykv_grammar_is_complete(matcher))
    assert complete == bool(regex.fullmatch(pattern, text.decode("utf-8", "replace")))


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    with Llama(str(tiny_model()), n_ctx=512, **EXACT) as llm:
        yield llm


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with Llama(str(smollm2_path), n_ctx=512, n_threads=2) as llm:
        yield llm


def byte_tokens(llm, data: bytes):
    """The tiny vocabulary's byte tokens (<0xHH>) for data, one per byte (splitting characters)."""
    names = tiny_vocab()[0]
    return [names.index(f"<0x{b:02X}>") for b in data]


@pytest.mark.parametrize("case,text", [("choice", "no."), ("words", "ab cd"), ("record", '{ "n":12}'),
                                       ("accents", "\u00e9\u00fc")])
def test_allowed_tokens_match_the_reference_on_byte_tokens(tiny_llm, case, text):
    """The tiny vocabulary: 256 byte tokens and a few words; non-ASCII text arrives a byte at a
    time, so the matcher holds partial characters between tokens."""
    walk_and_compare(tiny_llm, case, byte_tokens(tiny_llm, text.encode()))


@pytest.mark.model
@pytest.mark.parametrize("case,text", [("choice", "yes."), ("words", "the quick brown fox"),
                                       ("record", '{"n": 42}'), ("accents", "\u00e9 12 \u00fc")])
def test_allowed_tokens_match_the_reference_on_smollm2(smol, case, text):
    walk_and_compare(smol, case, smol.tokenize(text, add_bos=False))


@pytest.mark.model
def test_greedy_takes_the_best_allowed_token(smol):
    """Each greedy step under the grammar is the argmax of the logits over the reference's
    allowed tokens (the logits read back by replaying the output)."""
    gbnf, pattern, ranges = CASES["words"]
    prompt = smol.tokenize("List three animals in lowercase:", add_bos=True)
    result = smol.generate(prompt, max_tokens=12, temperature=0, grammar=gbnf)
    assert result.tokens and regex.fullmatch(pattern, result.text, partial=True)
    pieces, eog = pieces_of(smol)
    smol.reset()
    smol.eval(prompt)
    text = b""
    for token in result.tokens + ([] if result.finish_reason == "length" else [smol.token_eos()]):
        logits = smol.logits()
        allowed = sorted(allowed_tokens(pattern, text, pieces, eog, boundary_points(*ranges)))
        assert allowed[int(np.argmax(logits[allowed]))] == token or (token in eog and
                                                                    any(t in eog for t in allowed))
        if token in eog:
            break
        text += pieces[token]
        smol.eval([token])
    assert result.text == text.decode()


def sample_counts(llm, matcher, logits, n, **params):
    sampler = make_sampler(seed=1234, n_vocab=llm.n_vocab, **params)
    check(lib.pykv_sampler_set_grammar(sampler, matcher))
    out = ffi.new("pykv_token *")
    ptr = ffi.cast("float *", ffi.from_buffer(logits))
    counts = np.zeros(llm.n_vocab)
    for _ in range(n):
        check(lib.pykv_sampler_sample(sampler, ptr, llm.n_vocab, out))
        counts[out[0]] += 1
    return counts


@pytest.mark.parametrize("top_k", [5, 0])
@pytest.mark.parametrize("favour", ["allowed", "refused"])
def test_sampling_draws_from_the_masked_distribution(tiny_llm, top_k, favour):
    """Temperature sampling under a grammar: every draw allowed, frequencies as softmax(logits
    / T) over the allowed tokens (and their top-k), within 5 standard errors. top_k=5 checks
    the best tokens one by one; with the refused tokens ranked first (more than the sampler
    checks singly) it masks the rest; top_k=0 masks the whole vocabulary."""
    gbnf, pattern, ranges = CASES["words"]
    matcher = bind(tiny_llm._model, LlamaGrammar(gbnf))
    pieces, eog = pieces_of(tiny_llm)
    allowed = sorted(allowed_tokens(pattern, b"", pieces, eog, boundary_points(*ranges)))
    rng = np.random.default_rng(7)
    logits = rng.standard_normal(tiny_llm.n_vocab).astype(np.float32)
    mask = np.zeros(tiny_llm.n_vocab, bool)
    mask[allowed] = True
    logits[~mask if favour == "refused" else mask] += 6.0
    n, temp = 4000, 0.7
    counts = sample_counts(tiny_llm, matcher, logits, n, temperature=temp, top_k=top_k, top_p=1.0, min_p=0.0)
    assert counts[~mask].sum() == 0
    keep = np.array(allowed)
    if top_k:
        keep = keep[np.argsort(-logits[keep], kind="stable")[:top_k]]
    p = np.zeros(tiny_llm.n_vocab)
    z = np.exp((logits[keep] - logits[keep].max()) / temp)
    p[keep] = z / z.sum()
    assert counts[p == 0].sum() == 0
    err = np.abs(counts / n - p)
    assert np.all(err <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3), err.max()


def test_generation_stays_in_the_language(tiny_llm):
    """Random weights, any sampling settings: the output is always a prefix of a match, and a
    full match when generation ended by itself."""
    for case, (gbnf, pattern, _) in CASES.items():
        grammar = LlamaGrammar.from_string(gbnf)
        for seed in range(4):
            r = tiny_llm.generate("a", max_tokens=24, temperature=1.5, top_k=0 if seed % 2 else 40,
                                  seed=seed, grammar=grammar)
            assert regex.fullmatch(pattern, r.text, partial=True), (case, r.text)
            if r.finish_reason == "stop":
                assert regex.fullmatch(pattern, r.text), (case, r.text)


def test_streaming_and_json_object(tiny_llm):
    """A streamed constrained generation is the same text; JSON_GBNF's output parses as an object."""
    chunks = list(tiny_llm.generate("a", max_tokens=20, temperature=0, grammar=CASES["record"][0], stream=True))
    assert "".join(c.text for c in chunks) == tiny_llm.last_result.text
    finished = 0
    for seed in range(4):   # random weights: some runs close the object within the limit
        choice = tiny_llm.create_completion("a", max_tokens=400, temperature=0.9, seed=seed,
                                            grammar=JSON_GBNF)["choices"][0]
        assert choice["text"].startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
            finished += 1
    assert finished


def test_refusals(tiny_llm, tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"line 2, column 11: rule 'missing' is used but not defined"):
        LlamaGrammar.from_string('root ::= a\na ::= "x" missing')
    with pytest.raises(InvalidArgumentError, match="left-recursive"):
        LlamaGrammar.from_string('root ::= root "x" | "y"')
    with pytest.raises(InvalidArgumentError, match="cannot read grammar file"):
        LlamaGrammar.from_file(tmp_path / "none.gbnf")
    with pytest.raises(InvalidArgumentError, match="GBNF text"):
        tiny_llm.generate("a", grammar=42)
    with pytest.raises(InvalidArgumentError, match="unterminated"):
        tiny_llm.generate("a", grammar='root ::= "x')
    (tmp_path / "g.gbnf").write_text('root ::= "x"+\n')
    assert LlamaGrammar.from_file(tmp_path / "g.gbnf").text == 'root ::= "x"+\n'
    # a token the grammar does not allow is refused and changes nothing
    matcher = bind(tiny_llm._model, LlamaGrammar('root ::= "x" "y"'))
    before = allowed_now(matcher, tiny_llm.n_vocab)
    assert lib.pykv_grammar_accept(matcher, byte_tokens(tiny_llm, b"y")[0]) != lib.PYKV_OK
    assert "does not continue the grammar" in ffi.string(lib.pykv_last_error()).decode()
    assert allowed_now(matcher, tiny_llm.n_vocab) == before
    # every allowed token banned by the logit bias: a clear error, not a token outside the grammar
    x = byte_tokens(tiny_llm, b"x")[0]
    with pytest.raises(InvalidArgumentError, match="grammar allows"):
        tiny_llm.generate("a", max_tokens=3, temperature=0, grammar='root ::= "x"', logit_bias={x: -math.inf})


def test_cli_grammar_flags(tiny_model, tmp_path):
    """pykv generate's --grammar, --grammar-file, -j and -jf give what generate(grammar=...)
    gives; an unreadable file or a bad grammar is an error (exit 1) before the model loads."""
    import subprocess
    import sys
    path = str(tiny_model())
    gbnf = CASES["words"][0]
    (tmp_path / "g.gbnf").write_text(gbnf)
    schema = '{"type": "array", "items": {"type": "integer"}, "maxItems": 3}'
    (tmp_path / "s.json").write_text(schema)

    def run(*flags, model=path):
        return subprocess.run([sys.executable, "-m", "pykv", "generate", model, "-p", "a", "-n", "12", "--temp", "0",
                               "--json", "--exact-matmul", "--cache-type", "f32", *flags],
                              capture_output=True, text=True, timeout=120)

    with Llama(path, n_ctx=4096, **EXACT) as llm:
        by_text = llm.generate("a", max_tokens=12, temperature=0, grammar=gbnf).tokens
        by_schema = llm.generate("a", max_tokens=12, temperature=0, grammar=LlamaGrammar.from_json_schema(schema)).tokens
    for flags, want in [(("--grammar", gbnf), by_text), (("--grammar-file", tmp_path / "g.gbnf"), by_text),
                        (("-j", schema), by_schema), (("-jf", tmp_path / "s.json"), by_schema)]:
        r = run(*map(str, flags))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tokens"] == want, flags
    for flags, needle in [(("--grammar", "root ::= x"), "not defined"),
                          (("--grammar-file", str(tmp_path / "none")), "cannot read grammar file"),
                          (("-jf", str(tmp_path / "none")), "cannot read --json-schema-file"),
                          (("--grammar", gbnf, "-j", "{}"), "not allowed with")]:
        r = run(*flags, model=str(tmp_path / "absent.gguf"))   # refused before the model is looked for
        assert r.returncode == 1 and needle in r.stderr and r.stdout == "", (flags, r.stderr)
