"""Fill in the middle (create_completion(suffix=...)): the prompt is llama.cpp's infill layout,
[BOS] <prefix marker> prompt <suffix marker> suffix <middle marker>, with the markers from the
GGUF's FIM keys or, failing them, from the vocabulary's marker texts; the completion is the
greedy continuation of exactly those tokens; a model without markers is a clear error."""
from __future__ import annotations

from pathlib import Path

import pytest

import _vocab_fixtures as vf
from _compare import EXACT
from _tiny_models import BOS_ID
from pykv import InvalidArgumentError, Llama
from pykv.server.fim import infill_prompt

MARKERS = (40, 41, 42)   # three ordinary tiny-vocabulary tokens, named as the FIM markers


def test_infill_prompt_and_completion(tiny_model):
    with Llama(str(tiny_model(fim=MARKERS)), n_ctx=256, **EXACT) as llm:
        pre, suf, mid = MARKERS
        want = [BOS_ID, pre] + llm.tokenize("def f(", add_bos=False) + [suf] + \
            llm.tokenize("return x", add_bos=False) + [mid]
        assert infill_prompt(llm, "def f(", "return x") == want
        assert infill_prompt(llm, "", "") == [BOS_ID, pre, suf, mid]
        out = llm.create_completion("def f(", suffix="return x", max_tokens=6, temperature=0)
        assert llm.input_ids[:len(want)] == want
        assert out["choices"][0]["text"] == llm.generate(want, max_tokens=6, temperature=0).text
        assert out["usage"]["prompt_tokens"] == len(want)
        for kwargs, needle in [(dict(echo=True), "echo and suffix"), (dict(prompt=[5, 6]), "must be text")]:
            with pytest.raises(InvalidArgumentError, match=needle):
                llm.create_completion(**dict(dict(prompt="a", suffix="b"), **kwargs))
    with Llama(str(tiny_model()), n_ctx=64) as llm:
        with pytest.raises(InvalidArgumentError, match="FIM prefix token, and this model has none"):
            llm.create_completion("a", suffix="b")


@pytest.mark.model
def test_markers_found_by_their_text(smollm2_path, tmp_path):
    """A GGUF without the FIM keys whose vocabulary spells the markers <fim_prefix>... (SmolLM2's
    vocabulary with three control tokens renamed) gets them by text, as in llama.cpp."""
    vocab = vf.read_bpe_vocab(Path(smollm2_path))
    tokens = list(vocab["tokens"])
    for i, name in zip((4, 5, 6), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")):
        tokens[i] = name
    path = vf.bpe_gguf_variant(dict(vocab, tokens=tokens), "smollm", tmp_path / "fim.gguf")
    with Llama(str(path), vocab_only=True) as llm:
        assert infill_prompt(llm, "a = ", "\nprint(a)") == [4] + llm.tokenize("a = ", add_bos=False) + [5] + \
            llm.tokenize("\nprint(a)", add_bos=False) + [6]
