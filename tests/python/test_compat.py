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


def test_llama_cpp_python_constructor_keywords(tiny_model):
    """Code written for llama-cpp-python runs unchanged: type_k/type_v (ggml type numbers)
    choose the cache types, the GPU keywords are taken (without a GPU, layers asked of one
    warn that every layer runs on the CPU), and a keyword neither knows is a TypeError. Bad values are clear errors
    before anything loads."""
    import warnings

    import pytest

    import pykv
    from pykv import InvalidArgumentError
    path = str(tiny_model("mistral_f16_h4kv1"))   # head size 32: whole Q8_0 blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # n_gpu_layers=0 and the rest warn of nothing
        with Llama(path, n_ctx=32, n_gpu_layers=0, flash_attn=True, type_k=8, type_v=1, n_threads_batch=2,
                   offload_kqv=True, main_gpu=0, use_mlock=False) as llm:
            stats = llm.kv_stats()
    assert (stats["kv_type"], stats["kv_type_v"]) == ("q8_0", "f16")
    with Llama(path, n_ctx=32, type_v=0) as llm:   # keys keep the default
        assert (llm.kv_stats()["kv_type"], llm.kv_stats()["kv_type_v"]) == ("f16", "f32")
    if "CUDA = 1" not in pykv.system_info():   # no GPU: the layers asked of one stay on the CPU, said once
        with pytest.warns(RuntimeWarning, match="n_gpu_layers=-1: .*every layer runs on the CPU"):
            Llama(path, n_ctx=32, n_gpu_layers=-1).close()
    with pytest.warns(RuntimeWarning, match="use_mlock: pykv does not lock"):
        Llama(path, n_ctx=32, use_mlock=True).close()
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_gpu_layer'"):
        Llama(path, n_gpu_layer=0)
    with pytest.raises(InvalidArgumentError, match=r"type_k must be a ggml type .*f32 \(0\), f16 \(1\), q8_0 \(8\); got 2"):
        Llama(path, type_k=2)
    with pytest.raises(InvalidArgumentError, match="kv_type='f16' and type_k=8 disagree"):
        Llama(path, kv_type="f16", type_k=8)
    with Llama(path, n_ctx=32, kv_type="Q8_0", type_k=8) as llm:   # the same type twice is fine
        assert llm.kv_stats()["kv_type"] == "q8_0"
    with Llama(path, n_ctx=32, kv_type_v="q8_0", type_v="Q8_0") as llm:   # by name, in any case
        assert llm.kv_stats()["kv_type_v"] == "q8_0"
