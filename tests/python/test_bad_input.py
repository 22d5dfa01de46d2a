"""Bad input never crashes pykv: corrupt GGUF files, overflowing contexts and invalid
arguments raise pykv exceptions (PykvError subclasses) whose message names the problem.

Argument conventions (pykv/llama.py): n_threads=None means "all cores", n_threads < 1 is
invalid; n_ctx < 0 is invalid.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import _gguf_patch as patch
from _tiny_models import N_VOCAB
from pykv import Llama
from pykv.errors import ContextOverflowError, InvalidArgumentError, ModelLoadError, PykvError


def _load_error(path, pattern):
    with pytest.raises(ModelLoadError) as ei:
        Llama(str(path), n_ctx=32, verbose=False)
    assert isinstance(ei.value, PykvError) and isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert re.search(pattern, msg, re.I), f"message does not name the problem: {msg!r}"
    return msg


def test_error_hierarchy():
    for cls in (ModelLoadError, ContextOverflowError, InvalidArgumentError):
        assert issubclass(cls, PykvError)
        assert issubclass(cls, ValueError)


def test_missing_file(tmp_path):
    _load_error(tmp_path / "nope.gguf", r"nope\.gguf|no such file|not found|does not exist")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _load_error(p, r"truncat|end of file|eof|too (small|short)|empty|magic")


def test_wrong_magic(tiny_model, tmp_path):
    p = patch.bad_magic_copy(tiny_model(), tmp_path / "magic.gguf")
    _load_error(p, r"magic|not a gguf")


TRUNCATED = (r"truncat|end of (the )?file|eof|too (small|short)|past the end|beyond|"
             r"out of (range|bounds)|exceed|more than the file|file can hold|file size")

# (layout anchor, byte delta): cut inside the header, the KVs, the tensor infos, the data
TRUNCATION_POINTS = [("start", 4), ("kv_start", 0), ("kv_start", 37), ("tensor_info_start", -3000),
                     ("tensor_info_start", -1), ("tensor_info_start", 10),
                     ("data_start", 0), ("data_start", 1000), ("data_end", -1)]


@pytest.mark.parametrize("anchor,delta", TRUNCATION_POINTS,
                         ids=[f"{a}{d:+d}" for a, d in TRUNCATION_POINTS])
def test_truncated_file(tiny_model, tmp_path, anchor, delta):
    src = tiny_model()
    n = dict(patch.layout(src), start=0)[anchor] + delta
    p = patch.truncated_copy(src, tmp_path / "cut.gguf", n)
    _load_error(p, TRUNCATED)


def test_tensor_offset_past_end(tiny_model, tmp_path):
    p = patch.tensor_offset_copy(tiny_model(), tmp_path / "offset.gguf",
                                 "blk.1.ffn_up.weight", 1 << 40)
    _load_error(p, r"offset|past the end|beyond|out of (range|bounds)|exceed|truncat")


def test_unknown_tensor_type(tiny_model, tmp_path):
    p = patch.tensor_type_copy(tiny_model(), tmp_path / "type.gguf", "blk.0.attn_k.weight", 200)
    _load_error(p, r"'blk\.0\.attn_k\.weight' has tensor type 200 \(unknown\)")


def test_unsupported_ggml_type_is_named(tiny_model, tmp_path):
    p = patch.tensor_type_copy(tiny_model(), tmp_path / "type.gguf", "blk.0.attn_q.weight", 16)
    _load_error(p, r"'blk\.0\.attn_q\.weight' has tensor type 16 \(iq2_xxs\), which pykv does not support")


def test_missing_required_tensor(tiny_model):
    p = tiny_model(omit=("blk.1.ffn_up.weight",))
    _load_error(p, r"blk\.1\.ffn_up\.weight")


@pytest.mark.parametrize("exact_matmul", [False, True])
@pytest.mark.parametrize("variant", ["llama_q8_0_h8kv2", "llama_kquants_h4kv2"])   # K-quant prefill: the integer GEMM
def test_weights_that_overflow_give_nan_logits_and_a_clear_error(tiny_model, tmp_path, variant, exact_matmul):
    """A norm weight of inf and one of NaN (a model whose conversion overflowed) make the
    activations non-finite. The 8-bit activation quantizer must not turn a NaN into an int
    (undefined behaviour: the sanitized run of this file watches it), and the logits come
    out NaN on both paths, prefill and decode, so that sampling refuses them by name. The
    inf and the NaN sit in the two halves of a block of 32, whose quant sums are added."""
    payload = np.zeros(17, np.float32)
    payload[0], payload[16] = np.inf, np.nan
    src = tiny_model(variant)
    p = patch.tensor_data_copy(src, tmp_path / "overflow.gguf", "blk.1.ffn_norm.weight", 0, payload.tobytes())
    with Llama(str(p), n_ctx=64, verbose=False, exact_matmul=exact_matmul) as llm:
        tokens = llm.tokenize("the cat and the dog")
        llm.eval(tokens)                 # prefill: a chunk of tokens through the matrix products
        assert np.isnan(llm.logits()).all()
        llm.eval([tokens[1]])            # a decode step
        assert np.isnan(llm.logits()).all()
        llm.reset()
        with pytest.raises(InvalidArgumentError, match=r"logit of token \d+ is nan; .*weights are corrupt or overflow"):
            llm.generate("the cat", max_tokens=2)
    with Llama(str(src), n_ctx=64, verbose=False, exact_matmul=exact_matmul) as llm:   # the same file, unpatched
        llm.eval(llm.tokenize("the cat and the dog"))
        assert np.isfinite(llm.logits()).all()


def test_prompt_longer_than_n_ctx(tiny_model):
    with Llama(str(tiny_model()), n_ctx=16, verbose=False) as llm:
        with pytest.raises(ContextOverflowError) as ei:
            llm.eval(list(range(3, 20)))
        assert re.search(r"context|n_ctx", str(ei.value), re.I), str(ei.value)


def test_eval_overflow_after_partial_context(tiny_model):
    with Llama(str(tiny_model()), n_ctx=16, verbose=False) as llm:
        llm.eval(list(range(3, 13)))
        with pytest.raises(ContextOverflowError):
            llm.eval(list(range(3, 10)))
        # the context is still usable afterwards
        llm.reset()
        llm.eval([5, 6, 7])
        assert llm.n_past == 3
        assert np.all(np.isfinite(llm.logits()))


def test_generate_prompt_longer_than_n_ctx(tiny_model):
    with Llama(str(tiny_model()), n_ctx=16, verbose=False) as llm:
        with pytest.raises(ContextOverflowError):
            llm.generate("the cat " * 40, max_tokens=4)


def test_context_past_training_length_warns(tiny_model):
    path = str(tiny_model(n_ctx_train=64))
    with pytest.warns(RuntimeWarning, match=r"n_ctx=100 is larger than the model's training context \(64"):
        Llama(path, n_ctx=100, verbose=False).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Llama(path, n_ctx=64, verbose=False).close()
        Llama(path, n_ctx=0, verbose=False).close()   # 0 = the training context


def test_cli_prints_the_warning_in_one_line(tiny_model):
    r = subprocess.run([sys.executable, "-m", "pykv", "generate", str(tiny_model(n_ctx_train=64)), "-c", "80",
                        "-p", "ab", "-n", "1", "--temp", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "training context" in line]
    assert len(lines) == 1 and lines[0].startswith("pykv: warning: n_ctx=80"), r.stderr


def test_negative_n_ctx(tiny_model):
    with pytest.raises(InvalidArgumentError) as ei:
        Llama(str(tiny_model()), n_ctx=-5, verbose=False)
    assert "n_ctx" in str(ei.value)


@pytest.mark.parametrize("n_threads", [0, -1, -2])
def test_invalid_n_threads(tiny_model, n_threads):
    with pytest.raises(InvalidArgumentError) as ei:
        Llama(str(tiny_model()), n_ctx=32, n_threads=n_threads, verbose=False)
    assert "n_threads" in str(ei.value)


@pytest.mark.parametrize("bad", [N_VOCAB, N_VOCAB + 1000, -1])
def test_bad_token_id(tiny_model, bad):
    with Llama(str(tiny_model()), n_ctx=32, verbose=False) as llm:
        llm.eval([1, 5])
        with pytest.raises(InvalidArgumentError) as ei:
            llm.eval([7, bad])
        assert re.search(r"token", str(ei.value), re.I), str(ei.value)
        assert llm.n_past == 2, "a rejected eval must not change the context"


def test_corrupt_files_in_subprocess_do_not_abort(tiny_model, tmp_path):
    """Load every kind of corrupt file in a child process: it must exit normally."""
    src = tiny_model()
    lay = patch.layout(src)
    files = [
        patch.bad_magic_copy(src, tmp_path / "a.gguf"),
        patch.truncated_copy(src, tmp_path / "b.gguf", lay["tensor_info_start"] + 5),
        patch.truncated_copy(src, tmp_path / "c.gguf", lay["size"] // 2),
        patch.tensor_offset_copy(src, tmp_path / "d.gguf", "blk.0.attn_q.weight", 1 << 40),
        patch.tensor_type_copy(src, tmp_path / "e.gguf", "blk.0.attn_q.weight", 0xFFFF),
        tiny_model(omit=("output_norm.weight",)),
    ]
    code = textwrap.dedent(
        """
        import sys
        from pykv import Llama
        from pykv.errors import PykvError
        for p in sys.argv[1:]:
            try:
                Llama(p, n_ctx=32, verbose=False)
                print("LOADED", p)
            except PykvError as e:
                print("ERROR", type(e).__name__)
        print("DONE")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code, *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    lines = proc.stdout.split("\n")
    assert lines.count("ERROR ModelLoadError") == len(files), proc.stdout + proc.stderr
    assert "DONE" in lines
