"""Arguments of the wrong type to generate(), create_completion() and
create_chat_completion() are a TypeError naming the argument, raised before any work, not an
error from deep inside the sampler or the generation loop; right types of every kind a user
passes (numpy scalars, tuples, None where allowed) still work."""

from __future__ import annotations

import numpy as np
import pytest

from pykv import Llama

MESSAGES = [{"role": "user", "content": "hi"}]

WRONG = [
    ("max_tokens", "5"), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", "hot"), ("temperature", None),
    ("top_k", 4.0), ("top_p", [0.5]), ("min_p", "0"), ("seed", "7"), ("stop", 5), ("stop", ["a", 1]),
    ("stream", "yes"), ("logit_bias", [[1, 2.0]]), ("mirostat_mode", "2"), ("typical_p", b"1"),
    ("repeat_penalty", {}), ("frequency_penalty", "0"), ("presence_penalty", object()),
]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with Llama(str(tiny_model()), n_ctx=64) as model:
        yield model


def _calls(llm, **kwargs):
    return {"generate": lambda: llm.generate("the cat", **kwargs),
            "create_completion": lambda: llm.create_completion("the cat", **kwargs),
            "create_chat_completion": lambda: llm.create_chat_completion(MESSAGES, **kwargs)}


@pytest.mark.parametrize("name,value", WRONG)
def test_a_wrong_type_is_a_type_error_naming_the_argument(llm, name, value):
    for method, call in _calls(llm, **{name: value}).items():
        llm.reset()
        with pytest.raises(TypeError, match=rf"^{method}\(\): '{name}' must be "):
            call()
        assert llm.n_past == 0, method   # refused before the prompt was evaluated


def test_per_method_types(llm):
    with pytest.raises(TypeError, match="'prompt' must be"):
        llm.generate({"text": "the cat"})
    with pytest.raises(TypeError, match="'prompt' must be"):
        llm.create_completion(["the", "cat"])
    with pytest.raises(TypeError, match="'logprobs' must be an integer"):
        llm.create_completion("the cat", logprobs="2")
    with pytest.raises(TypeError, match="'logprobs' must be True or False"):
        llm.create_chat_completion(MESSAGES, logprobs="yes")
    with pytest.raises(TypeError, match="'top_logprobs' must be an integer"):
        llm.create_chat_completion(MESSAGES, logprobs=True, top_logprobs=1.5)
    with pytest.raises(TypeError, match="'echo' must be True or False"):
        llm.create_completion("the cat", echo="no")
    with pytest.raises(TypeError, match="'suffix' must be a string"):
        llm.create_completion("the cat", suffix=3)
    with pytest.raises(TypeError, match="'prompt_logprobs' must be an integer"):
        llm.generate("the cat", prompt_logprobs=0.5)


def test_right_types_still_work(llm):
    """numpy scalars and arrays, tuples of stops, None for optional values, 0/1 as flags."""
    want = llm.generate("the cat", max_tokens=3, temperature=0.0, seed=1).tokens
    got = llm.generate(np.array(llm.tokenize("the cat"), dtype=np.int32), max_tokens=np.int64(3),
                       temperature=np.float32(0.0), top_k=np.int32(40), seed=np.uint32(1), stop=("zzz",),
                       stream=0, logit_bias={}, mirostat_mode=0).tokens
    assert got == want and len(got) == 3
    out = llm.create_completion("the cat", max_tokens=None, temperature=0, seed=None, stop=None, logprobs=None)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    out = llm.create_chat_completion(MESSAGES, max_tokens=2, temperature=0, logprobs=1, top_logprobs=2)
    assert len(out["choices"][0]["logprobs"]["content"]) <= 2
