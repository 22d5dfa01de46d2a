"""llama-cpp-python's Llama() keywords and attributes beyond pykv's own: chat formats by name
(each checked against its layout written out here), RoPE overrides (against the NumPy
reference with another base, and with positions scaled), kv_overrides, scores and
eval_tokens (against the reference's logits), the prompt caches, create_*completion's model
and tfs_z, last_n_tokens_size; what does not apply warns, lora_path is refused, and a
keyword neither library has is a TypeError."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import _reference
from _compare import EXACT, assert_logits_close
from _tiny_models import N_VOCAB
from pykv import InvalidArgumentError, Llama, LlamaDiskCache, LlamaRAMCache
from pykv._chat_formats import CHAT_FORMATS
from pykv.chat import render

TOKENS = np.random.default_rng(5).integers(0, N_VOCAB, 20).tolist()

CONVERSATION = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Q2"}]
# each format's layout of CONVERSATION, bos "<s>" and eos "</s>", with the generation prompt
LAYOUTS = {
    "chatml": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
              "<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n",
    "llama-2": "<s>[INST] <<SYS>>\nSYS\n<</SYS>>\n\nHi [/INST] Hello </s><s>[INST] Q2 [/INST]",
    "llama-3": "<s><|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|><|start_header_id|>user"
               "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|><|start_header_id|>assistant"
               "<|end_header_id|>\n\n",
    "mistral-instruct": "<s>[INST] SYS\n\nHi [/INST]Hello</s>[INST] Q2 [/INST]",
    "gemma": "<s><start_of_turn>user\nSYS\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
             "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\n",
    "phi-3": "<s><|system|>\nSYS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nQ2<|end|>\n"
             "<|assistant|>\n",
    "zephyr": "<|system|>\nSYS</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello</s>\n<|user|>\nQ2</s>\n<|assistant|>\n",
    "vicuna": "SYS USER: Hi ASSISTANT: Hello</s>USER: Q2 ASSISTANT:",
    "alpaca": "SYS\n\n### Instruction:\nHi\n\n### Response:\nHello\n\n### Instruction:\nQ2\n\n### Response:\n",
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_chat_formats_write_their_layouts(tiny_model, name):
    assert render(CHAT_FORMATS[name], CONVERSATION, bos_token="<s>", eos_token="</s>") == LAYOUTS[name]
    with Llama(str(tiny_model()), vocab_only=True, chat_format=name) as llm:
        assert llm.chat_template == CHAT_FORMATS[name] and llm.chat_format == name


def test_chat_format_choices_and_refusals(tiny_model):
    path = str(tiny_model())
    assert CHAT_FORMATS["chatml-function-calling"] == CHAT_FORMATS["chatml"]
    with pytest.raises(InvalidArgumentError, match=r"unknown chat_format 'llama2'.*chatml.*llama-2.*zephyr"):
        Llama(path, vocab_only=True, chat_format="llama2")
    with pytest.raises(InvalidArgumentError, match="chat_format or chat_template, not both"):
        Llama(path, vocab_only=True, chat_format="chatml", chat_template="chatml")
    with Llama(path, vocab_only=True) as llm:   # no chat_format: the model's own template (none here)
        assert llm.chat_format is None and llm.chat_template is None


def test_keywords_taken_warned_and_refused(tiny_model):
    path = str(tiny_model())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # defaults and choices pykv makes itself warn of nothing
        Llama(path, n_ctx=32, mul_mat_q=True, numa=False, chat_handler=None, tokenizer=None, draft_model=None,
              rope_scaling_type=-1, yarn_ext_factor=-1.0, yarn_attn_factor=1.0, yarn_beta_fast=32.0,
              yarn_beta_slow=1.0, yarn_orig_ctx=0, lora_base=None, lora_scale=1.0, lora_path=None,
              op_offload=True, swa_full=False, no_perf=False, rpc_servers=None, spm_infill=False,
              last_n_tokens_size=64, kv_overrides={}, rope_freq_base=0.0, rope_freq_scale=0.0).close()
    for kwargs, message in [(dict(numa=True), "numa: pykv does not place"),
                            (dict(chat_handler=object()), "chat_handler=.*the handler is not used"),
                            (dict(tokenizer=object()), "tokenizer=.*GGUF's own vocabulary"),
                            (dict(draft_model=object()), "draft_model=.*no speculative decoding"),
                            (dict(yarn_ext_factor=1.0), "yarn_ext_factor=1.0: pykv does not implement YaRN"),
                            (dict(rope_scaling_type=2), r"rope_scaling_type=2 \(yarn\): pykv implements linear"),
                            (dict(kv_overrides={"tokenizer.ggml.add_bos_token": False}),
                             r"kv_overrides\['tokenizer.ggml.add_bos_token'\]: pykv does not apply")]:
        with pytest.warns(RuntimeWarning, match=message):
            Llama(path, n_ctx=32, **kwargs).close()
    for kwargs, message in [(dict(lora_path="adapter.gguf"), "pykv does not apply LoRA adapters"),
                            (dict(rope_freq_base=-1.0), "rope_freq_base must be a number >= 0"),
                            (dict(rope_freq_scale=float("nan")), "rope_freq_scale must be a number >= 0"),
                            (dict(rope_scaling_type=7), "rope_scaling_type must be one of"),
                            (dict(kv_overrides=[1]), "kv_overrides must be a dict"),
                            (dict(last_n_tokens_size=-1), "last_n_tokens_size must be an integer >= 0")]:
        with pytest.raises(InvalidArgumentError, match=message):
            Llama(path, n_ctx=32, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rope_base'"):
        Llama(path, rope_base=1.0)


def _logits_all(path, tokens, **kwargs):
    with Llama(str(path), n_ctx=64, logits_all=True, **EXACT, **kwargs) as llm:
        llm.eval(tokens)
        return llm.all_logits()


def test_rope_freq_base_and_scale_against_the_reference(tiny_model, monkeypatch):
    """rope_freq_base replaces the model's base; rope_freq_scale rotates position p as
    p * scale: both against the NumPy reference, which computes the angles in float64."""
    path = tiny_model()
    model = _reference.load(path)
    base = _reference.forward(model, TOKENS)
    other = dataclasses.replace(model, hp=dataclasses.replace(model.hp, rope_base=model.hp.rope_base * 7.5))
    want_base = _reference.forward(other, TOKENS)
    rope = _reference.rope_adjacent
    monkeypatch.setattr(_reference, "rope_adjacent", lambda x, pos, n_rot, b: rope(x, pos * 0.25, n_rot, b))
    want_scaled = _reference.forward(model, TOKENS)
    assert np.abs(want_base - base).max() > 1e-3 and np.abs(want_scaled - base).max() > 1e-3
    got_base = _logits_all(path, TOKENS, rope_freq_base=model.hp.rope_base * 7.5)
    got_scaled = _logits_all(path, TOKENS, rope_freq_scale=0.25)
    for i in range(len(TOKENS)):
        assert_logits_close(got_base[i], want_base[i], atol=1e-5, rtol_scale=1e-5, what=f"base, row {i}")
        assert_logits_close(got_scaled[i], want_scaled[i], atol=1e-5, rtol_scale=1e-5, what=f"scale, row {i}")
    # the same through kv_overrides (the GGUF keys), and scale 1 is no scaling
    arch = "llama"
    over = _logits_all(path, TOKENS, kv_overrides={f"{arch}.rope.freq_base": model.hp.rope_base * 7.5,
                                                   f"{arch}.rope.scaling.factor": 4.0})
    both = _logits_all(path, TOKENS, rope_freq_base=model.hp.rope_base * 7.5, rope_freq_scale=0.25)
    assert np.array_equal(over, both)
    assert np.array_equal(_logits_all(path, TOKENS, rope_freq_scale=1.0), _logits_all(path, TOKENS))


def test_scores_and_eval_tokens(tiny_model):
    """With logits_all, scores (n_ctx, n_vocab) holds each evaluated position's logits (the
    reference's), across eval calls; rows not evaluated stay zero. Without it, scores is
    (n_batch, n_vocab), as llama-cpp-python's. eval_tokens is what the context holds."""
    path = tiny_model()
    ref = _reference.forward(path, TOKENS)
    with Llama(str(path), n_ctx=48, logits_all=True, **EXACT) as llm:
        llm.eval(TOKENS[:12])
        llm.eval(TOKENS[12:13])
        llm.eval(TOKENS[13:])
        assert llm.scores.shape == (48, N_VOCAB) and llm.scores.dtype == np.float32
        for i in range(len(TOKENS)):
            assert_logits_close(llm.scores[i], ref[i], atol=1e-6, rtol_scale=2e-6, what=f"row {i}")
        assert not llm.scores[len(TOKENS):].any()
        assert list(llm.eval_tokens) == TOKENS and llm.eval_tokens.maxlen == 48
        assert len(llm.eval_logits) == len(TOKENS)
    with Llama(str(path), n_ctx=48, n_batch=16) as llm:
        llm.eval(TOKENS)
        assert llm.scores.shape == (16, N_VOCAB)
        assert len(llm.eval_logits) == 1


def _completion(llm, prompt, **kwargs):
    return llm.create_completion(prompt, **{"max_tokens": 6, "temperature": 0.0, **kwargs})


@pytest.mark.parametrize("kind", ["ram", "disk"])
def test_prompt_cache_starts_from_the_longest_saved_prefix(tiny_model, tmp_path, kind):
    """After a completion its state is saved; a fresh context given a longer prompt with that
    prefix loads it and evaluates only the rest, and completes as without a cache. A state of
    another model is not used; the least recently used states go past capacity_bytes."""
    path = str(tiny_model())
    prompt = TOKENS[:12]
    longer = TOKENS[:12] + TOKENS[14:18]
    with Llama(path, n_ctx=64) as plain:
        want = _completion(plain, longer)["choices"][0]["text"]

    def make_cache(capacity=2 << 30):
        return LlamaRAMCache(capacity) if kind == "ram" else LlamaDiskCache(str(tmp_path / "cache"), capacity)
    cache = make_cache()
    with Llama(path, n_ctx=64) as llm:
        llm.set_cache(cache)
        _completion(llm, prompt)
        saved = list(llm.input_ids)
        assert saved[:12] == prompt and saved in cache and cache[longer].input_ids == saved
        assert cache.cache_size > 0
        llm.reset()
        out = _completion(llm, longer)
        assert out["choices"][0]["text"] == want
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
    if kind == "disk":   # another process's Llama finds the files
        with Llama(path, n_ctx=64) as again:
            again.set_cache(make_cache())
            # all but the last prompt token, evaluated again for its logits
            assert _completion(again, longer)["usage"]["prompt_tokens_details"]["cached_tokens"] == 15
    with Llama(str(tiny_model("mistral_f16_h4kv1")), n_ctx=64) as other:
        other.set_cache(cache)
        assert _completion(other, longer)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    small = make_cache(capacity=1)
    with Llama(path, n_ctx=64) as llm:
        llm.set_cache(small)
        _completion(llm, prompt)
        _completion(llm, TOKENS[2:10])
        assert TOKENS[:3] not in small and TOKENS[2:4] in small   # only the newest state is left
    with pytest.raises(InvalidArgumentError, match="set_cache takes"):
        Llama(path, vocab_only=True).set_cache({})


def test_completion_model_tfs_z_and_penalty_window(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=64, last_n_tokens_size=1) as llm:
        out = _completion(llm, TOKENS, model="my-model")
        assert out["model"] == "my-model"
        assert {c["model"] for c in _completion(llm, TOKENS, model="m2", stream=True)} == {"m2"}
        chat = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2, model="m3")
        assert chat["model"] == "m3"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _completion(llm, TOKENS, tfs_z=1.0)
        with pytest.warns(RuntimeWarning, match="tfs_z=0.9: pykv has no tail-free sampling"):
            _completion(llm, TOKENS, tfs_z=0.9)
        # the penalties' window: token 100 is favoured, and penalised while it is among the
        # last last_n_tokens_size tokens: with a window of one it comes every other token
        favour = dict(logit_bias={100: 30.0}, presence_penalty=60.0, max_tokens=8)
        _completion(llm, TOKENS, **favour)
        assert llm.last_result.tokens[0::2] == [100] * 4 and 100 not in llm.last_result.tokens[1::2]
        wide = llm.generate(TOKENS, temperature=0.0, repeat_last_n=64, **favour).tokens
        assert wide.count(100) == 1
