"""Saving and restoring a context (Llama.save_state / load_state, pykv_state_save / load) and
`pykv generate --prompt-cache`.

A restored context must continue as the saved one would: evaluating more tokens after a load
gives the independent reference's logits for the saved tokens plus the new ones (NumPy
float64 on tiny models), and greedy generation after a load equals transformers'. A state
that does not fit (another model shape, KV type, a short n_ctx, damaged bytes, an earlier
format) is refused with a message and the context stays as it was. Evicting policies' states:
test_state_policies.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import _reference
from _compare import EXACT, assert_logits_close
from _tiny_models import random_tokens
from _torch_reference import greedy_continuation
from pykv import ContextOverflowError, InvalidArgumentError, Llama
from pykv._ffi import ffi, lib
from pykv._state import LlamaState, read_state_file, write_state_file

TINY_ATOL, TINY_RTOL = 1e-6, 2e-6   # vs the float64 reference, as test_prefix_reuse


@pytest.mark.parametrize("name,kv_type", [("llama_f32_h4kv4", "f32"), ("mistral_q4_0_h8kv2", "f16")])
def test_load_then_eval_equals_the_reference(tiny_model, name, kv_type):
    path = tiny_model(name)
    a, b = random_tokens(50, 1), random_tokens(20, 2)
    opts = dict(n_ctx=128, exact_matmul=True, kv_type=kv_type)
    with Llama(str(path), **opts) as saved, Llama(str(path), **opts) as restored:
        saved.eval(a)
        state = saved.save_state()
        assert state.input_ids == a and state.n_tokens == 50
        restored.eval(random_tokens(10, 3))   # whatever it held before is replaced
        restored.load_state(state)
        assert restored.n_past == 50 and restored.input_ids == a
        np.testing.assert_array_equal(restored.logits(), saved.logits())
        assert restored.kv_stats()["bytes"] == saved.kv_stats()["bytes"]
        restored.eval(b)
        saved.eval(b)
        np.testing.assert_array_equal(restored.logits(), saved.logits())
        if kv_type == "f32":
            ref = _reference.forward(path, a + b)[-1]
            assert_logits_close(restored.logits(), ref, atol=TINY_ATOL, rtol_scale=TINY_RTOL, what=f"{name} load + eval")


def test_empty_and_logit_less_states(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=64, **EXACT) as llm, Llama(path, n_ctx=64, **EXACT) as other:
        empty = llm.save_state()
        llm.eval(random_tokens(20, 4))
        llm.truncate(12)   # no logits: they were the forgotten token's
        other.load_state(llm.save_state())
        assert other.n_past == 12
        with pytest.raises(InvalidArgumentError, match="no logits"):
            other.logits()
        other.load_state(empty)
        assert other.n_past == 0 and other.input_ids == [] and other.kv_stats()["entries"] == 0


def _refused(llm, state, needle, error=InvalidArgumentError):
    before, ids, logits = llm.n_past, list(llm.input_ids), llm.logits()
    with pytest.raises(error, match=needle):
        llm.load_state(state)
    assert llm.n_past == before and llm.input_ids == ids
    np.testing.assert_array_equal(llm.logits(), logits)


def test_states_that_do_not_fit_are_refused(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=128, **EXACT) as src:
        src.eval(random_tokens(60, 5))
        state = src.save_state()
    with Llama(path, n_ctx=128, exact_matmul=True, kv_type="f16") as llm:
        llm.eval(random_tokens(5, 6))
        _refused(llm, state, "KV cache of f32; this context has .* f16")
    with Llama(path, n_ctx=32, **EXACT) as llm:
        llm.eval(random_tokens(5, 6))
        _refused(llm, state, "60 tokens, more than n_ctx=32", ContextOverflowError)
    with Llama(str(tiny_model("mistral_q4_0_h8kv2")), n_ctx=128, **EXACT) as llm:
        llm.eval(random_tokens(5, 6))
        _refused(llm, state, "KV heads")
        _refused(llm, "not a state", "LlamaState")


def test_damaged_bytes_are_refused(tiny_model):
    path = str(tiny_model())
    with Llama(path, n_ctx=128, **EXACT) as llm:
        llm.eval(random_tokens(30, 7))
        state = llm.save_state()
        data = state.data
        cuts = sorted(set([0, 1, 8, 12, 20, 40, len(data) // 2, len(data) - 1] +
                          np.random.default_rng(0).integers(0, len(data), 20).tolist()))
        for cut in cuts:
            _refused(llm, LlamaState(state.input_ids, data[:cut]), "not a usable state")
        _refused(llm, LlamaState(state.input_ids, data + b"\0"), "not where the state ends")
        bad_magic = b"X" + data[1:]
        _refused(llm, LlamaState(state.input_ids, bad_magic), "header")
        _refused(llm, LlamaState(state.input_ids, b"PYKVSTA1" + data[8:]), "earlier pykv")
        header = 8 + 4   # magic, byte order; then n_layer .. has_logits
        for field, value, needle in ((5, 1 << 30, "more than n_ctx"), (5, -1, "out of range"),
                                     (6, 2, "out of range"), (0, 5, "layers")):   # n_past, has_logits, n_layer
            patched = bytearray(data)
            patched[header + 4 * field:header + 4 * field + 4] = np.int32(value).tobytes()
            # through the C call: Llama.load_state would already refuse a token count that
            # differs from the state's ids
            assert lib.pykv_state_load(llm._ctx, ffi.from_buffer(bytes(patched)), len(patched)) != lib.PYKV_OK
            assert needle in ffi.string(lib.pykv_last_error()).decode()
            assert llm.n_past == 30
        _refused(llm, LlamaState(state.input_ids[:-1], data), "29 token ids for 30")
        llm.load_state(state)   # the intact state still loads
        assert llm.n_past == 30


def _first_key_offset(data: bytes) -> int:
    """Where the first list's first key starts in a saved state (layout: native/src/kv/state.h)."""
    head = np.frombuffer(data[12:44], dtype=np.int32)   # after the magic and the byte order
    off = 44 + 16                                        # the header, then the two cache counters
    off += 4 + int(np.frombuffer(data[off:off + 4], dtype=np.int32)[0])   # the policy identity
    off += 4 * int(head[3]) * int(head[6])               # n_vocab logits when it has them
    n = int(np.frombuffer(data[off:off + 4], dtype=np.int32)[0])
    return off + 8 + 4 * n                               # length, merged flag, positions


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_non_finite_keys_and_values_are_refused(tiny_model, kv_type):
    """f32, f16: the first key's element 3 made inf or NaN. q8_0 (a model with whole blocks):
    its first block's half scale, the only part of a block that can be non-finite (int8
    bytes that would spell an f16 inf still load)."""
    kw = dict(EXACT, kv_type=kv_type)
    with Llama(str(tiny_model("mistral_f16_h4kv1" if kv_type == "q8_0" else "llama_f32_h4kv4")), n_ctx=64, **kw) as llm:
        llm.eval(random_tokens(20, 8))
        state = llm.save_state()
        at = _first_key_offset(state.data)
        size = 4 if kv_type == "f32" else 2
        bad_at = at if kv_type == "q8_0" else at + 3 * size
        assert any(state.data[at:at + size])   # a real key is there
        for bad in (np.inf, -np.inf, np.nan):
            patched = bytearray(state.data)
            patched[bad_at:bad_at + size] = np.array(bad, dtype=np.float32 if size == 4 else np.float16).tobytes()
            _refused(llm, LlamaState(state.input_ids, bytes(patched)), "a key or value is not finite")
        # the check is on the values, not on the bytes changing: another finite key loads
        patched = bytearray(state.data)
        patched[at:at + size] = np.array(0.5, dtype=np.float32 if size == 4 else np.float16).tobytes()
        if kv_type == "q8_0":
            patched[at + 2:at + 4] = np.array(np.inf, dtype=np.float16).tobytes()   # two int8 quants
        llm.load_state(LlamaState(state.input_ids, bytes(patched)))
        assert llm.n_past == 20


def test_token_count_from_the_header(tiny_model):
    """pykv_state_n_tokens reads n_past from the header alone (load_state checks the ids with it)."""
    path = str(tiny_model())
    with Llama(path, n_ctx=64, **EXACT) as llm:
        llm.eval(random_tokens(17, 8))
        data = bytes(llm.save_state().data)
    n = ffi.new("int32_t *", -5)
    assert lib.pykv_state_n_tokens(ffi.from_buffer(data), len(data), n) == lib.PYKV_OK and n[0] == 17
    header_end = 8 + 4 + 8 * 4
    assert lib.pykv_state_n_tokens(ffi.from_buffer(data), header_end, n) == lib.PYKV_OK and n[0] == 17
    assert lib.pykv_state_n_tokens(ffi.from_buffer(data), header_end - 1, n) == lib.PYKV_ERR_INVALID_ARG
    assert "cut short" in ffi.string(lib.pykv_last_error()).decode() and n[0] == 0
    assert lib.pykv_state_n_tokens(ffi.from_buffer(data), len(data), ffi.NULL) == lib.PYKV_ERR_INVALID_ARG
    negative = bytearray(data)
    negative[8 + 4 + 5 * 4:8 + 4 + 6 * 4] = np.int32(-1).tobytes()
    with Llama(path, n_ctx=64, **EXACT) as llm:
        llm.eval(random_tokens(3, 9))
        _refused(llm, LlamaState(random_tokens(17, 8), negative), "negative")


def test_state_file_names_its_model(tiny_model, tmp_path):
    path = str(tiny_model())
    with Llama(path, n_ctx=64, **EXACT) as llm:
        llm.eval(random_tokens(20, 9))
        write_state_file(tmp_path / "s.bin", llm.save_state(), path)
    state = read_state_file(tmp_path / "s.bin", path)
    assert state.input_ids == random_tokens(20, 9)
    with pytest.raises(ValueError, match="another model"):
        read_state_file(tmp_path / "s.bin", str(tiny_model("mistral_q4_0_h8kv2")))
    (tmp_path / "junk.bin").write_bytes(b"PYKVPC1\n\xff\xff\x00\x00{")
    with pytest.raises(ValueError, match="damaged"):
        read_state_file(tmp_path / "junk.bin", path)
    assert list(tmp_path.iterdir()) != [] and not list(tmp_path.glob("*.tmp*"))


# ---- SmolLM2 ----

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)


@pytest.mark.model
def test_generation_after_a_load_matches_torch(smollm2_path):
    with Llama(str(smollm2_path), n_ctx=256, **EXACT) as src:
        prompt = src.tokenize(PROMPT, add_bos=True, special=True)
        src.eval(prompt)
        state = src.save_state()
    ref, gaps = greedy_continuation(smollm2_path, prompt, 16)
    with Llama(str(smollm2_path), n_ctx=256, **EXACT) as llm:
        llm.load_state(state)
        res = llm.generate(prompt, max_tokens=16, **GREEDY)
    assert res.cached_tokens == len(prompt)   # nothing evaluated again: the state's logits were used
    n = next((i for i, g in enumerate(gaps) if g < 1e-3), len(gaps))
    assert n >= 8 and res.tokens[:n] == ref[:n]


def _generate(path, *flags):
    r = subprocess.run([sys.executable, "-m", "pykv", "generate", str(path), "-n", "8", "--temp", "0",
                        "--no-display-prompt", "-t", "2", *map(str, flags)], capture_output=True, text=True,
                       timeout=300)
    return r


@pytest.mark.model
def test_cli_prompt_cache(smollm2_path, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Paris is the capital of France. " * 30 + "What is the capital of France?")
    cache = tmp_path / "doc.cache"
    fresh = _generate(smollm2_path, "-f", doc)
    first = _generate(smollm2_path, "-f", doc, "--prompt-cache", cache)
    assert first.returncode == 0 and cache.exists(), first.stderr
    assert "prompt cache: 0 of" in first.stderr
    second = _generate(smollm2_path, "-f", doc, "--prompt-cache", cache)
    n_prompt = second.stderr.split("prompt cache: ")[1].split(" of ")[1].split()[0]
    assert f"prompt cache: {n_prompt} of {n_prompt} prompt tokens reused" in second.stderr, second.stderr
    assert fresh.stdout == first.stdout == second.stdout   # identical to a run without the cache

    longer = tmp_path / "longer.txt"
    longer.write_text(doc.read_text() + " Answer in one word.")
    before = cache.stat().st_mtime_ns, cache.stat().st_size
    ro = _generate(smollm2_path, "-f", longer, "--prompt-cache", cache, "--prompt-cache-ro")
    assert ro.returncode == 0 and f"prompt cache: {n_prompt} of" in ro.stderr, ro.stderr
    assert (cache.stat().st_mtime_ns, cache.stat().st_size) == before   # read-only: not rewritten

    cache.write_bytes(b"garbage")
    damaged = _generate(smollm2_path, "-f", doc, "--prompt-cache", cache)
    assert damaged.returncode == 0 and "pykv: warning: prompt cache" in damaged.stderr
    assert damaged.stdout == fresh.stdout and cache.read_bytes().startswith(b"PYKVPC1\n")


@pytest.mark.model
def test_cli_prompt_cache_with_an_evicting_policy(smollm2_path, tmp_path):
    """The file holds the compressed cache: the same prompt reuses all of it and answers as a
    run without the file; other settings or a longer prompt evaluate afresh."""
    doc = tmp_path / "doc.txt"
    doc.write_text("Paris is the capital of France. " * 30 + "What is the capital of France?")
    cache = tmp_path / "doc.cache"
    snap = ("--policy", "snapkv", "--budget", 64)
    fresh = _generate(smollm2_path, "-f", doc, *snap)
    first = _generate(smollm2_path, "-f", doc, "--prompt-cache", cache, *snap)
    assert first.returncode == 0 and "prompt cache: 0 of" in first.stderr, first.stderr
    second = _generate(smollm2_path, "-f", doc, "--prompt-cache", cache, *snap)
    n_prompt = second.stderr.split("prompt cache: ")[1].split(" of ")[1].split()[0]
    assert f"prompt cache: {n_prompt} of {n_prompt} prompt tokens reused" in second.stderr, second.stderr
    assert fresh.stdout == first.stdout == second.stdout

    full_size = cache.stat().st_size
    other = _generate(smollm2_path, "-f", doc, "--prompt-cache", cache, "--prompt-cache-ro", "--policy", "snapkv",
                      "--budget", 48)
    assert other.returncode == 0 and "saved with the policy 'snapkv budget=64" in other.stderr, other.stderr
    assert "prompt cache: 0 of" in other.stderr
    with Llama(str(smollm2_path), n_ctx=2048) as full:
        full.eval(full.tokenize(doc.read_text(), add_bos=True, special=True))
        assert full_size < len(full.save_state().data) / 2   # the compressed cache, not the prompt's
