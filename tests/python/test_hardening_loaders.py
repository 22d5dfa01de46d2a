"""The limits every input needs: a GGUF tensor whose size overflows, saved states with
repeated or disordered positions or token ids outside the vocabulary, a chat template that
would run for minutes, policy_kwargs values that would smuggle in more arguments, and a
model file cut short while it is mapped. Each is refused with a clear error."""
from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from _tiny_models import N_VOCAB, random_tokens
from pykv import Llama
from pykv._state import LlamaState
from pykv.chat import MAX_TEMPLATE_STEPS, render
from pykv.errors import InvalidArgumentError, ModelLoadError
from pykv.policies import policy_args

EXACT = dict(n_threads=1, exact_matmul=True, kv_type="f32")


# ---- GGUF: a tensor size that wraps ----

def _gguf_with_tensor(path, dims, type_id=0):
    """A GGUF v3 with no metadata and one tensor `big` of the given dimensions at offset 0,
    followed by 128 bytes of data (the layout of tests/c/test_gguf.c's builder)."""
    name = b"big"
    out = struct.pack("<IIQQ", 0x46554747, 3, 1, 0)
    out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, 0)
    out += b"\0" * (-len(out) % 32) + b"\0" * 128
    path.write_bytes(out)
    return path


@pytest.mark.parametrize("dims", [(32, 2**32, 2**32), (2**40, 2**30, 1), (64, 2**36, 2**36, 2**8)])
def test_tensor_whose_size_overflows_is_refused(tmp_path, dims):
    """Each dimension is within the reader's bound (2^40), the product of the row count and
    the row size is not: [32, 2^32, 2^32] once wrapped to 0 bytes and was accepted."""
    exact = 4 * int(np.prod([float(d) for d in dims]))   # the true size, as floats: > 2^64
    assert exact >= 2**64
    with pytest.raises(ModelLoadError, match="overflows 64 bits"):
        Llama(str(_gguf_with_tensor(tmp_path / "big.gguf", dims)), n_ctx=32)


# ---- saved states ----

def _first_list(data: bytes):
    """(offset of the first list's positions, their count, the merged flag) in a saved state
    (layout: native/src/kv/state.h)."""
    head = np.frombuffer(data[12:44], dtype=np.int32)
    off = 44 + 16
    off += 4 + int(np.frombuffer(data[off:off + 4], dtype=np.int32)[0])   # the policy identity
    off += 4 * int(head[3]) * int(head[6])                               # the logits
    n, merged = (int(x) for x in np.frombuffer(data[off:off + 8], dtype=np.int32))
    return off + 8, n, merged


def _with_positions(state, positions):
    at, n, _ = _first_list(state.data)
    assert len(positions) == n
    data = bytearray(state.data)
    data[at:at + 4 * n] = np.asarray(positions, dtype=np.int32).tobytes()
    return LlamaState(state.input_ids, bytes(data))


def _refused(llm, state, needle):
    before = (llm.n_past, list(llm.input_ids))
    with pytest.raises(InvalidArgumentError, match=needle):
        llm.load_state(state)
    assert (llm.n_past, list(llm.input_ids)) == before   # a refused state changes nothing


def test_state_positions_out_of_order_or_repeated_are_refused(tiny_model):
    """The `full` policy holds every position in order (truncate() cuts lists at their tail):
    a state whose list has two positions swapped, or one twice, is refused. An evicting
    policy may hold its entries in any order, but never one position twice."""
    with Llama(str(tiny_model()), n_ctx=64, **EXACT) as llm:
        llm.eval(random_tokens(20, 3))
        state = llm.save_state()
        at, n, merged = _first_list(state.data)
        positions = list(np.frombuffer(state.data[at:at + 4 * n], dtype=np.int32))
        assert positions == list(range(20)) and merged == 0
        llm.reset()
        swapped = positions[:]
        swapped[3], swapped[4] = swapped[4], swapped[3]
        _refused(llm, _with_positions(state, swapped), "positions are out of order")
        _refused(llm, _with_positions(state, positions[:5] + [4] + positions[6:]), "out of order")
        llm.load_state(state)   # the intact state loads
        assert llm.n_past == 20

    with Llama(str(tiny_model()), n_ctx=64, policy="h2o", budget=8, **EXACT) as llm:
        llm.eval(random_tokens(30, 4))
        state = llm.save_state()
        at, n, _ = _first_list(state.data)
        kept = [int(p) for p in np.frombuffer(state.data[at:at + 4 * n], dtype=np.int32)]
        assert 0 < n < 30 and len(set(kept)) == n
        llm.reset()
        _refused(llm, _with_positions(state, kept[:1] + kept[:1] + kept[2:]), "a position appears twice")
        llm.load_state(_with_positions(state, kept[::-1]))   # another order of distinct positions loads
        assert llm.n_past == 30


@pytest.mark.parametrize("bad", [N_VOCAB, -1, 2**40, 3.0, "7", True])
def test_state_token_ids_outside_the_vocabulary_are_refused(tiny_model, bad):
    with Llama(str(tiny_model()), n_ctx=64, **EXACT) as llm:
        tokens = random_tokens(12, 5)
        llm.eval(tokens)
        state = llm.save_state()
        llm.reset()
        ids = list(state.input_ids)
        ids[7] = bad
        _refused(llm, LlamaState(ids, state.data), "token id .* at index 7 is not a token of the vocabulary")
        llm.load_state(LlamaState([np.int64(t) for t in state.input_ids], state.data))   # NumPy ints are ids
        assert llm.input_ids == tokens and all(type(t) is int for t in llm.input_ids)


# ---- chat templates ----

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for i in range(99999) %}{% for j in ['a'] * 99999 %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{% endfor %}",
])
def test_a_template_that_loops_for_minutes_fails_fast(template):
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="too much work"):
        render(template, MESSAGES)
    assert time.monotonic() - start < 10


def test_a_template_that_builds_a_huge_value_is_refused():
    with pytest.raises(InvalidArgumentError, match="longer than"):
        render("{{ 'abcd' * 1000000000 }}", MESSAGES)
    with pytest.raises(InvalidArgumentError, match="more than .* characters"):
        render("{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}", MESSAGES)


def test_templates_within_the_budget_render_as_before():
    """Loops over the messages, loop.last, namespaces and 'x' * n of moderate size are
    untouched; a loop of just under the budget still renders, with the right count."""
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}"
                "{{ '-' * 3 }}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render(template, msgs) == "user:a|assistant:b---"
    n = MAX_TEMPLATE_STEPS // 2
    counted = ("{% set ns = namespace(n=0) %}{% for i in range(" + str(n // 10) + ") %}{% for j in range(10) %}"
               "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}")
    assert render(counted, MESSAGES) == str(n // 10 * 10)


# ---- policy arguments ----

@pytest.mark.parametrize("kwargs,needle", [({"tau": "1,kernel=3"}, "value '1,kernel=3'"),
                                           ({"tau": "kernel=3"}, "value 'kernel=3'"),
                                           ({"tau,kernel": 3}, "name 'tau,kernel'"),
                                           ({"kernel=3,tau": 1}, "name 'kernel=3,tau'"),
                                           ({3: 1}, "names must be non-empty strings")])
def test_policy_kwargs_cannot_smuggle_arguments(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        policy_args(kwargs)


def test_policy_kwargs_comma_is_refused_by_llama(tiny_model):
    """Through Llama: {'tau': '1,kernel=3'} once set kernel=3 behind the caller's back."""
    with pytest.raises(InvalidArgumentError, match="contains ',' or '='"):
        Llama(str(tiny_model()), n_ctx=64, policy="snapkv", budget=8, policy_kwargs={"window": "4,kernel=3"})
    assert policy_args({"window": 4, "kernel": 3}) == ("window=4,kernel=3", None)   # plain values pass


# ---- a mapped model file cut short ----

TRUNCATED_WHILE_MAPPED = """
import os, shutil, sys
from pykv import Llama
from pykv.errors import ModelLoadError

src, path = sys.argv[1], sys.argv[2]
shutil.copyfile(src, path)
llm = Llama(path, n_ctx=64, n_threads=1)
first = llm.generate([1, 2, 3], max_tokens=4, ignore_eos=True, temperature=0.0).tokens
os.truncate(path, os.path.getsize(path) // 2)   # in place: the same inode, mapped
try:
    llm.generate([1, 2, 3], max_tokens=4, ignore_eos=True, temperature=0.0)
    print("ran")
except ModelLoadError as e:
    print("refused:", e)
# a file replaced under the name (a new inode) is harmless: the mapping keeps the old one
shutil.copyfile(src, path)
llm = Llama(path, n_ctx=64, n_threads=1)
with open(path + ".new", "wb") as f:
    f.write(b"GGUF")
os.replace(path + ".new", path)
print("after a replace:", llm.generate([1, 2, 3], max_tokens=4, ignore_eos=True, temperature=0.0).tokens == first)
"""


def test_a_mapped_model_file_truncated_in_place_is_refused(tiny_model, tmp_path):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TRUNCATED_WHILE_MAPPED), str(tiny_model()),
                        str(tmp_path / "model.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit code {r.returncode} (SIGBUS is -7)\n{r.stderr[-2000:]}"
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused: the model file") and "was truncated while in use" in lines[0], lines
    assert lines[1] == "after a replace: True", lines
