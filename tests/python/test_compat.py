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
