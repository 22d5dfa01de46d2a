"""llama-cpp-python's spellings beside pykv's: n_ctx(), n_vocab() and n_embd() called as
methods as well as read as numbers, and set_seed() for the generations given no seed."""
from __future__ import annotations

from gguf import GGUFReader

from pykv import Llama


def test_sizes_read_and_called(tiny_model):
    path = tiny_model()
    fields = GGUFReader(str(path)).fields
    with Llama(str(path), n_ctx=96) as llm:
        assert llm.n_ctx == llm.n_ctx() == 96
        assert llm.n_vocab == llm.n_vocab() == len(fields["tokenizer.ggml.tokens"].data)
        assert llm.n_embd == llm.n_embd() == int(fields["llama.embedding_length"].contents())
        assert llm.n_ctx + 1 == 97 and isinstance(llm.n_vocab(), int)


def test_set_seed_repeats_unseeded_generations(tiny_model):
    with Llama(str(tiny_model()), n_ctx=96) as llm:
        runs = []
        for seed in (5, 5, 6):
            llm.set_seed(seed)
            runs.append([llm.generate("a", max_tokens=8, temperature=1.5, ignore_eos=True).tokens for _ in range(2)])
        assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0][0] != runs[0][1]


def test_sample_after_eval(tiny_model):
    """sample() draws from the last eval()'s logits: greedy is their argmax, with the repeat
    penalty over the context's last 64 tokens as the NumPy reference applies it, and through a
    logits processor; before any eval it is a clear error."""
    import numpy as np
    import pytest

    from pykv import InvalidArgumentError
    from test_sampler import ref_logits
    with Llama(str(tiny_model()), n_ctx=256, exact_matmul=True, kv_type="f32") as llm:
        with pytest.raises(InvalidArgumentError, match="eval"):
            llm.sample()
        llm.eval(llm.tokenize("the cat sat on the mat"))
        while int(np.argmax(llm.logits())) not in llm.input_ids[-64:]:   # until the penalty has a say
            llm.eval([int(np.argmax(llm.logits()))])
        tokens, logits = list(llm.input_ids), llm.logits()
        assert llm.sample(temp=0) == int(np.argmax(logits))
        penalised = ref_logits(logits, repeat_penalty=20.0, history=tokens[-64:])
        assert llm.sample(temp=0, repeat_penalty=20.0) == int(np.argmax(penalised)) != int(np.argmax(logits))
        assert llm.sample(temp=0.7, logits_processor=lambda ids, s: np.where(np.arange(len(s)) == 9, 0.0, -np.inf)) == 9
        assert llm.sample(temp=1.0, seed=3) == llm.sample(temp=1.0, seed=3)
        assert llm.n_tokens == len(tokens)   # nothing evaluated by sampling
