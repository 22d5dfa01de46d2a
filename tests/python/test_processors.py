"""logits_processor and stopping_criteria (llama-cpp-python's callbacks): greedy generation
under a processor follows the argmax of the processed logits, computed here step by step with
NumPy from the context's own logits; the callbacks see the prompt and the tokens so far; a
criterion ends the generation after the token it saw; bad callbacks are refused clearly."""
from __future__ import annotations

import numpy as np
import pytest

from _compare import EXACT
from pykv import InvalidArgumentError, Llama, LogitsProcessorList, StoppingCriteriaList


@pytest.fixture(scope="module")
def llm(tiny_model):
    with Llama(str(tiny_model()), n_ctx=256, **EXACT) as llm:
        yield llm


def ban_best(ids, scores):
    """A processor that depends on its inputs: it bans the raw best token and favours the last id's."""
    out = scores.copy()
    out[int(np.argmax(scores))] = -np.inf
    out[ids[-1]] += 1.0
    return out


def test_greedy_follows_the_processed_argmax(llm):
    prompt = llm.tokenize("the cat")
    got = llm.generate(prompt, max_tokens=12, temperature=0, logits_processor=ban_best).tokens
    llm.reset()
    llm.eval(prompt)
    want, ids = [], list(prompt)
    for _ in range(12):   # the reference: the same processor applied to the context's logits by hand
        token = int(np.argmax(ban_best(np.array(ids), llm.logits().astype(np.float64))))
        if llm.is_eog(token):
            break
        want.append(token)
        ids.append(token)
        llm.eval([token])
    assert got == want and len(want) >= 6
    assert got != llm.generate(prompt, max_tokens=12, temperature=0).tokens


def test_callbacks_see_the_context(llm):
    """Each call gets the prompt and the tokens so far (a criterion: this step's token too) and
    the raw logits of the step; a list of processors runs in order."""
    seen, stops = [], []

    def record(ids, scores):
        seen.append((ids.tolist(), scores.copy()))
        return scores

    def only_70(ids, scores):
        return np.where(np.arange(len(scores)) == 70, 0.0, -np.inf).astype(np.float32)

    def next_of_best(ids, scores):   # the token after the best one of the scores it is given
        out = np.full_like(scores, -np.inf)
        out[int(np.argmax(scores)) + 1] = 0.0
        return out

    prompt = llm.tokenize("a b")
    tokens = llm.generate(prompt, max_tokens=6, temperature=0.9, seed=1, logits_processor=LogitsProcessorList(
        [record, only_70, next_of_best]),
        stopping_criteria=lambda ids, logits: stops.append((ids.tolist(), logits)) and False).tokens
    assert tokens == [71] * 6   # next_of_best saw only_70's scores
    assert [ids for ids, _ in seen] == [prompt + tokens[:k] for k in range(6)]
    assert [ids for ids, _ in stops] == [prompt + tokens[:k + 1] for k in range(6)]
    for (_, raw), (_, logits) in zip(seen, stops):
        np.testing.assert_array_equal(raw, logits)


def test_stopping_criteria_end_the_generation(llm):
    prompt = llm.tokenize("hello")
    n = len(prompt)
    result = llm.generate(prompt, max_tokens=20, temperature=0, stopping_criteria=lambda ids, _: len(ids) >= n + 4)
    assert len(result.tokens) == 4 and result.finish_reason == "stop"
    full = llm.generate(prompt, max_tokens=20, temperature=0, ignore_eos=True).tokens
    assert result.tokens == full[:4]
    target = full[2]
    either = StoppingCriteriaList([lambda ids, _: False, lambda ids, _: ids[-1] == target])
    chunks = list(llm.generate(prompt, max_tokens=20, temperature=0, stopping_criteria=either, stream=True))
    assert llm.last_result.tokens == full[:full.index(target) + 1] and llm.last_result.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == llm.last_result.text
    out = llm.create_completion(prompt, max_tokens=20, temperature=0, stopping_criteria=either)
    assert out["choices"][0]["finish_reason"] == "stop" and llm.last_result.tokens[-1] == target
    chat = llm.create_chat_completion([{"role": "user", "content": "x"}], max_tokens=20,
                                      stopping_criteria=lambda ids, _: True)
    assert chat["choices"][0]["finish_reason"] == "stop" and len(llm.last_result.tokens) == 1


def test_bad_callbacks_are_refused(llm):
    for kwargs, needle in [(dict(logits_processor=lambda ids, s: s[:5]), r"shape \(5,\), not"),
                           (dict(logits_processor=lambda ids, s: np.full_like(s, np.nan)), "nan"),
                           (dict(logits_processor=lambda ids, s: np.full_like(s, -np.inf)), "every logit is -inf"),
                           (dict(logits_processor=3), "callable"), (dict(stopping_criteria=[len, 2]), "callable")]:
        with pytest.raises(InvalidArgumentError, match=needle):
            llm.generate("a", max_tokens=3, **kwargs)

    def broken(ids, scores):
        raise RuntimeError("processor bug")
    with pytest.raises(RuntimeError, match="processor bug"):
        llm.generate("a", max_tokens=3, logits_processor=broken)
    assert len(llm.generate("a", max_tokens=3, temperature=0, ignore_eos=True).tokens) == 3   # still usable
