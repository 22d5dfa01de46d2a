"""The pull-based prompt evaluation of the C API: pykv_decode_begin, then pykv_decode_step until
it stops returning PYKV_PENDING (pykv.h). A step runs one chunk of n_ubatch tokens; the
chunks, and so the logits, are pykv_decode's. Between two steps the context is idle but
mid-prompt: a cancel stops the next step with nothing run, and the calls that change the
context are refused until the decode ends. The Python package drives these calls itself and
installs no C callback (cffi's callbacks need writable and executable memory, which hardened
systems refuse)."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pykv import Llama
from pykv.errors import GenerationCancelled
from pykv._ffi import ffi, lib, new_params

N_UBATCH = 16
TOKENS = [int(t) for t in np.random.default_rng(8).integers(1, 200, size=100)]
PACKAGE = Path(__file__).resolve().parents[2] / "pykv"


class Ctx:
    """A model and one context on it, through the C API alone."""

    def __init__(self, path, n_ctx=256, **params):
        mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
        out = ffi.new("pykv_model **")
        assert lib.pykv_model_load(str(path).encode(), mparams, out) == lib.PYKV_OK
        self.model = out[0]
        cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
        cparams.n_ctx, cparams.n_ubatch, cparams.n_threads = n_ctx, N_UBATCH, 1
        self._keep = []
        for name, value in params.items():
            if isinstance(value, str):
                value = ffi.new("char[]", value.encode())
                self._keep.append(value)
            setattr(cparams, name, value)
        ctx = ffi.new("pykv_context **")
        assert lib.pykv_context_init(self.model, cparams, ctx) == lib.PYKV_OK, self.error()
        self.ctx = ctx[0]
        self.n_vocab = lib.pykv_vocab_n_tokens(self.model)
        self.n_done = ffi.new("int32_t *")

    def close(self):
        lib.pykv_context_free(self.ctx)
        lib.pykv_model_free(self.model)

    @staticmethod
    def error():
        return ffi.string(lib.pykv_last_error()).decode()

    def begin(self, tokens):
        self.arr = ffi.new("pykv_token[]", max(len(tokens), 1))
        self.arr[0:len(tokens)] = tokens
        return lib.pykv_decode_begin(self.ctx, self.arr, len(tokens))

    def step(self):
        self.n_done[0] = -1
        return lib.pykv_decode_step(self.ctx, self.n_done), self.n_done[0]

    def decode(self, tokens):
        arr = ffi.new("pykv_token[]", tokens)
        return lib.pykv_decode(self.ctx, arr, len(tokens))

    def logits(self):
        ptr = lib.pykv_get_logits(self.ctx)
        assert ptr != ffi.NULL
        return np.frombuffer(ffi.buffer(ptr, 4 * self.n_vocab), dtype=np.float32).copy()

    def positions(self, layer=0, head=0):
        n = lib.pykv_kv_head_entries(self.ctx, layer, head)
        out, n_out = ffi.new("pykv_pos[]", max(n, 1)), ffi.new("int32_t *")
        assert lib.pykv_kv_head_positions(self.ctx, layer, head, out, n, n_out) == lib.PYKV_OK
        return list(ffi.unpack(out, n_out[0]))

    def steps_to_the_end(self):
        """[(status, n_done)] of every step until one returns something but PYKV_PENDING."""
        seen = [self.step()]
        while seen[-1][0] == lib.PYKV_PENDING:
            seen.append(self.step())
        return seen


@pytest.fixture
def pair(tiny_model):
    """Two contexts on the tiny model: one for the steps, one for pykv_decode."""
    a, b = Ctx(tiny_model()), Ctx(tiny_model())
    yield a, b
    a.close()
    b.close()


def test_steps_run_the_chunks_of_pykv_decode(pair):
    """100 tokens in chunks of 16: six steps return PYKV_PENDING, the seventh PYKV_OK, n_done
    counting 16, 32, ... 96, 100; the logits and the cache are pykv_decode's, bit for bit."""
    stepped, whole = pair
    assert stepped.begin(TOKENS) == lib.PYKV_OK
    assert lib.pykv_decode_pending(stepped.ctx)
    assert lib.pykv_n_past(stepped.ctx) == 0   # begin runs nothing
    seen = stepped.steps_to_the_end()
    n_chunks = -(-len(TOKENS) // N_UBATCH)
    assert [s for s, _ in seen] == [lib.PYKV_PENDING] * (n_chunks - 1) + [lib.PYKV_OK]
    assert [n for _, n in seen] == [min(N_UBATCH * (i + 1), len(TOKENS)) for i in range(n_chunks)]
    assert not lib.pykv_decode_pending(stepped.ctx)
    assert whole.decode(TOKENS) == lib.PYKV_OK
    np.testing.assert_array_equal(stepped.logits(), whole.logits())
    assert stepped.positions() == whole.positions() == list(range(len(TOKENS)))
    t = new_params("struct pykv_timings")
    lib.pykv_get_timings(stepped.ctx, t)
    assert t.n_prefill == len(TOKENS) and t.t_prefill_ms > 0
    # a step with no decode begun is an error, not PYKV_OK again
    assert stepped.step() == (lib.PYKV_ERR_INVALID_ARG, 0)
    assert "no decode is begun" in stepped.error()


def test_pending_is_no_error(pair):
    """PYKV_PENDING leaves no message behind, and is none of the error statuses."""
    stepped, _ = pair
    assert lib.PYKV_PENDING not in (lib.PYKV_OK, lib.PYKV_ERR_INVALID_ARG, lib.PYKV_ERR_CANCELLED,
                                    lib.PYKV_ERR_CONTEXT_FULL, lib.PYKV_ERR_INTERNAL)
    stepped.begin([300] + TOKENS[1:])   # out of range: sets an error message
    assert stepped.error()
    assert stepped.begin(TOKENS) == lib.PYKV_OK
    assert stepped.step() == (lib.PYKV_PENDING, N_UBATCH)
    assert stepped.error() == ""


@pytest.mark.parametrize("policy", [{}, {"policy": "snapkv", "budget": 24, "window": 8}, {"policy": "take", "budget": 24}])
def test_steps_and_the_progress_callback_see_the_same_chunks(tiny_model, policy):
    """With an evicting policy the chunks are the policy's (its window arrives in the last):
    each step ends where pykv_decode's progress callback says a chunk ended, and the result
    is the same."""
    stepped, whole = Ctx(tiny_model(), **policy), Ctx(tiny_model(), **policy)
    try:
        boundaries = []

        @ffi.callback("pykv_progress_callback")
        def on_chunk(n_done, n_total, _user):
            boundaries.append(n_done)
            return 1

        lib.pykv_set_progress_callback(whole.ctx, on_chunk, ffi.NULL)
        assert whole.decode(TOKENS) == lib.PYKV_OK
        assert stepped.begin(TOKENS) == lib.PYKV_OK
        seen = stepped.steps_to_the_end()
        assert [n for _, n in seen] == boundaries and boundaries[-1] == len(TOKENS)
        assert seen[-1][0] == lib.PYKV_OK
        np.testing.assert_array_equal(stepped.logits(), whole.logits())
        info = new_params("struct pykv_model_info")
        assert lib.pykv_model_get_info(stepped.model, info) == lib.PYKV_OK
        for layer in range(info.n_layer):
            for g in range(info.n_head_kv):
                assert stepped.positions(layer, g) == whole.positions(layer, g)
    finally:
        stepped.close()
        whole.close()


def test_a_cancel_between_steps_stops_the_next_with_nothing_run(pair):
    """pykv_cancel between two steps: the next step returns PYKV_ERR_CANCELLED having run
    nothing, so the chunks done stay and the cache holds exactly their positions; the decode
    has ended and the cancel is spent. The rest of the prompt then gives the uncancelled
    logits (the same chunks in the same order)."""
    stepped, whole = pair
    assert whole.decode(TOKENS) == lib.PYKV_OK
    assert stepped.begin(TOKENS) == lib.PYKV_OK
    for i in range(3):
        assert stepped.step() == (lib.PYKV_PENDING, N_UBATCH * (i + 1))
    lib.pykv_cancel(stepped.ctx)
    assert stepped.step() == (lib.PYKV_ERR_CANCELLED, 3 * N_UBATCH)
    assert lib.pykv_n_past(stepped.ctx) == 3 * N_UBATCH
    assert stepped.positions() == list(range(3 * N_UBATCH))
    assert lib.pykv_get_logits(stepped.ctx) == ffi.NULL
    assert not lib.pykv_decode_pending(stepped.ctx)
    t = new_params("struct pykv_timings")
    lib.pykv_get_timings(stepped.ctx, t)
    assert t.n_prefill == 3 * N_UBATCH   # the chunks that stay
    assert stepped.decode(TOKENS[3 * N_UBATCH:]) == lib.PYKV_OK   # not cancelled again
    np.testing.assert_array_equal(stepped.logits(), whole.logits())


def test_a_cancel_before_the_last_step_lets_nothing_run(pair):
    stepped, _ = pair
    assert stepped.begin(TOKENS[:20]) == lib.PYKV_OK
    assert stepped.step() == (lib.PYKV_PENDING, 16)
    lib.pykv_cancel(stepped.ctx)
    assert stepped.step() == (lib.PYKV_ERR_CANCELLED, 16)
    assert lib.pykv_n_past(stepped.ctx) == 16


@pytest.mark.parametrize("case", ["token out of range", "negative count", "no array", "overflow"])
def test_bad_input_at_begin_begins_nothing(tiny_model, case):
    c = Ctx(tiny_model(), n_ctx=64)
    try:
        assert c.decode(TOKENS[:10]) == lib.PYKV_OK
        before = c.logits()
        if case == "token out of range":
            status, message = c.begin(TOKENS[:5] + [c.n_vocab] + TOKENS[5:20]), "out of range"
        elif case == "negative count":
            status, message = lib.pykv_decode_begin(c.ctx, ffi.new("pykv_token[]", 4), -1), "invalid token array"
        elif case == "no array":
            status, message = lib.pykv_decode_begin(c.ctx, ffi.NULL, 4), "invalid token array"
        else:
            status, message = c.begin(TOKENS[:60]), "do not fit in the context"
        want = lib.PYKV_ERR_CONTEXT_FULL if case == "overflow" else lib.PYKV_ERR_INVALID_ARG
        assert status == want and message in c.error()
        assert not lib.pykv_decode_pending(c.ctx)
        assert c.step()[0] == lib.PYKV_ERR_INVALID_ARG and "no decode is begun" in c.error()
        assert lib.pykv_n_past(c.ctx) == 10
        np.testing.assert_array_equal(c.logits(), before)   # nothing changed
    finally:
        c.close()


def test_calls_that_change_the_context_wait_for_the_begun_decode(pair):
    """While a begun decode is unfinished a new one (pykv_decode or pykv_decode_begin) and the
    other calls that change the context are refused with a message saying so; it goes on
    unharmed to the result of one pykv_decode."""
    stepped, whole = pair
    assert stepped.begin(TOKENS) == lib.PYKV_OK
    assert stepped.step() == (lib.PYKV_PENDING, N_UBATCH)
    probe = ffi.new("pykv_token[]", [5, 6])
    refused = {
        "pykv_decode_begin": lambda: lib.pykv_decode_begin(stepped.ctx, probe, 2),
        "pykv_decode": lambda: lib.pykv_decode(stepped.ctx, probe, 1),
        "pykv_truncate": lambda: lib.pykv_truncate(stepped.ctx, 4),
        "pykv_set_probe": lambda: lib.pykv_set_probe(stepped.ctx, probe, 2),
        "pykv_set_logits_all": lambda: lib.pykv_set_logits_all(stepped.ctx, 1),
        "pykv_set_embeddings": lambda: lib.pykv_set_embeddings(stepped.ctx, 1),
        "pykv_context_set_threads": lambda: lib.pykv_context_set_threads(stepped.ctx, 2),
        "pykv_state_load": lambda: lib.pykv_state_load(stepped.ctx, probe, 8),
    }
    for name, call in refused.items():
        assert call() == lib.PYKV_ERR_INVALID_ARG, name
        assert re.search(rf"{name}: a decode begun with pykv_decode_begin is unfinished \(16 of its 100 tokens",
                         stepped.error()), (name, stepped.error())
    assert lib.pykv_decode_pending(stepped.ctx) and lib.pykv_n_past(stepped.ctx) == N_UBATCH
    assert stepped.steps_to_the_end()[-1] == (lib.PYKV_OK, len(TOKENS))
    assert whole.decode(TOKENS) == lib.PYKV_OK
    np.testing.assert_array_equal(stepped.logits(), whole.logits())


def test_reset_ends_a_begun_decode(pair):
    stepped, whole = pair
    assert stepped.begin(TOKENS) == lib.PYKV_OK
    assert stepped.step()[0] == lib.PYKV_PENDING
    lib.pykv_reset(stepped.ctx)
    assert not lib.pykv_decode_pending(stepped.ctx) and lib.pykv_n_past(stepped.ctx) == 0
    assert stepped.step()[0] == lib.PYKV_ERR_INVALID_ARG
    assert stepped.decode(TOKENS) == lib.PYKV_OK and whole.decode(TOKENS) == lib.PYKV_OK
    np.testing.assert_array_equal(stepped.logits(), whole.logits())


def test_begin_copies_the_tokens(pair):
    """The caller's array may change or go once begin has returned."""
    stepped, whole = pair
    assert stepped.begin(TOKENS) == lib.PYKV_OK
    stepped.arr[0:len(TOKENS)] = [7] * len(TOKENS)
    assert stepped.steps_to_the_end()[-1] == (lib.PYKV_OK, len(TOKENS))
    assert whole.decode(TOKENS) == lib.PYKV_OK
    np.testing.assert_array_equal(stepped.logits(), whole.logits())


def test_an_empty_begin_ends_at_its_first_step(pair):
    stepped, _ = pair
    assert stepped.begin([]) == lib.PYKV_OK
    assert stepped.step() == (lib.PYKV_OK, 0)
    assert not lib.pykv_decode_pending(stepped.ctx) and lib.pykv_n_past(stepped.ctx) == 0


def test_a_single_token_is_one_step(pair):
    stepped, whole = pair
    assert stepped.decode(TOKENS[:20]) == lib.PYKV_OK and whole.decode(TOKENS[:20]) == lib.PYKV_OK
    assert whole.decode(TOKENS[20:21]) == lib.PYKV_OK   # a decode step
    assert stepped.begin(TOKENS[20:21]) == lib.PYKV_OK
    assert stepped.step() == (lib.PYKV_OK, 1)
    np.testing.assert_array_equal(stepped.logits(), whole.logits())
    t = new_params("struct pykv_timings")
    lib.pykv_get_timings(stepped.ctx, t)
    assert t.n_decode == 1 and t.n_prefill == 20


FREE_BETWEEN_STEPS = """
import sys
from pykv._ffi import ffi, lib, new_params
mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
model = ffi.new("pykv_model **")
assert lib.pykv_model_load(sys.argv[1].encode(), mparams, model) == lib.PYKV_OK
cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
cparams.n_ctx, cparams.n_ubatch, cparams.n_threads = 256, 16, 1
ctx = ffi.new("pykv_context **")
assert lib.pykv_context_init(model[0], cparams, ctx) == lib.PYKV_OK
tokens = ffi.new("pykv_token[]", [1 + i % 200 for i in range(100)])
assert lib.pykv_decode_begin(ctx[0], tokens, 100) == lib.PYKV_OK
n_done = ffi.new("int32_t *")
assert lib.pykv_decode_step(ctx[0], n_done) == lib.PYKV_PENDING
lib.pykv_context_free(ctx[0])   # mid-prompt: nothing runs, so at once
lib.pykv_model_free(model[0])
print("ok", n_done[0])
"""


def test_free_between_steps(tiny_model):
    """A context freed between two steps (its held tokens with it): no wait, no leak or error
    (run under AddressSanitizer by tests/run.sh)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(FREE_BETWEEN_STEPS), str(tiny_model())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "16"], r.stderr[-2000:]


STEP_FROM_THE_PROGRESS_CALLBACK = """
import sys
from pykv._ffi import ffi, lib, new_params
mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
model = ffi.new("pykv_model **")
assert lib.pykv_model_load(sys.argv[1].encode(), mparams, model) == lib.PYKV_OK
cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
cparams.n_ctx, cparams.n_ubatch, cparams.n_threads = 256, 16, 1
ctx = ffi.new("pykv_context **")
assert lib.pykv_context_init(model[0], cparams, ctx) == lib.PYKV_OK
answers, n_done = [], ffi.new("int32_t *")

@ffi.callback("pykv_progress_callback")
def on_chunk(done, total, user):
    answers.append((lib.pykv_decode_step(ctx[0], n_done), ffi.string(lib.pykv_last_error()).decode()))
    if len(answers) == 2:
        lib.pykv_context_free(ctx[0])   # deferred to the end of the step
    return 1

lib.pykv_set_progress_callback(ctx[0], on_chunk, ffi.NULL)
tokens = ffi.new("pykv_token[]", [1 + i % 200 for i in range(100)])
assert lib.pykv_decode_begin(ctx[0], tokens, 100) == lib.PYKV_OK
first = lib.pykv_decode_step(ctx[0], n_done)
second = lib.pykv_decode_step(ctx[0], n_done)
message = ffi.string(lib.pykv_last_error()).decode()
lib.pykv_model_free(model[0])
print(first == lib.PYKV_PENDING, second == lib.PYKV_ERR_CANCELLED, n_done[0], answers[0][0] == lib.PYKV_ERR_INVALID_ARG)
print(answers[0][1])
print(message)
"""


def test_the_progress_callback_inside_a_step(tiny_model):
    """The C progress callback runs inside the step: a step from it is refused, and a free
    from it is carried out as that step returns PYKV_ERR_CANCELLED."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(STEP_FROM_THE_PROGRESS_CALLBACK),
                        str(tiny_model())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    flags, refused, message = r.stdout.splitlines()
    assert flags == "True True 32 True"
    assert "pykv_decode_step: not while a decode runs on this context (from its progress callback)" in refused
    assert "freed from the call's progress callback" in message


# ---------------------------------------------------------------- the Python package


def test_the_package_installs_no_c_callback():
    """pykv/ drives the steps itself: no ffi.callback (nor the C progress callback) anywhere."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"ffi\s*\.\s*callback|pykv_set_progress_callback|\bdef_extern\b", line)]
    assert found == []


def test_eval_steps_with_progress_between(tiny_model):
    """Llama.eval over the steps: progress sees each boundary, in this thread, and the logits
    are those of one pykv_decode."""
    import threading
    whole = Ctx(tiny_model())
    try:
        assert whole.decode(TOKENS) == lib.PYKV_OK
        with Llama(str(tiny_model()), n_ctx=256, n_batch=N_UBATCH, n_threads=1) as llm:
            calls = []
            llm.eval(TOKENS, progress=lambda done, total: calls.append((done, total, threading.get_ident())))
            assert [(d, t) for d, t, _ in calls] == [(min(n, 100), 100) for n in range(16, 113, 16)]
            assert {ident for _, _, ident in calls} == {threading.get_ident()}
            np.testing.assert_array_equal(llm.logits(), whole.logits())
    finally:
        whole.close()


def test_keyboard_interrupt_from_progress_ends_the_begun_decode(tiny_model):
    """An interrupt between two steps (Ctrl-C lands in Python there) ends the begun decode at
    that boundary and is raised; the next eval runs whole, with nothing pending."""
    with Llama(str(tiny_model()), n_ctx=256, n_batch=N_UBATCH, n_threads=1) as llm:
        def interrupt(done, total):
            if done == 2 * N_UBATCH:
                raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            llm.eval(TOKENS, progress=interrupt)
        assert llm.n_past == 2 * N_UBATCH and llm.input_ids == TOKENS[:2 * N_UBATCH]
        assert not lib.pykv_decode_pending(llm._ctx)
        llm.eval(TOKENS[2 * N_UBATCH:])
        assert llm.n_past == len(TOKENS)


def test_a_library_without_the_steps_evaluates_in_one_call(tiny_model, monkeypatch):
    """A stale libpykv from before the stepped decode: eval() runs the prompt in one
    pykv_decode and reports its progress once, at the end (False from it still cancels)."""
    import pykv.llama as llama_module
    real = llama_module._optional_lib_function
    monkeypatch.setattr(llama_module, "_optional_lib_function",
                        lambda name: None if name == "pykv_decode_begin" else real(name))
    whole = Ctx(tiny_model())
    try:
        assert whole.decode(TOKENS) == lib.PYKV_OK
        with Llama(str(tiny_model()), n_ctx=256, n_batch=N_UBATCH, n_threads=1) as llm:
            calls = []
            llm.eval(TOKENS, progress=lambda done, total: calls.append((done, total)))
            assert calls == [(100, 100)]
            np.testing.assert_array_equal(llm.logits(), whole.logits())
            llm.reset()
            with pytest.raises(GenerationCancelled):
                llm.eval(TOKENS, progress=lambda done, total: False)
            assert llm.n_past == len(TOKENS)
    finally:
        whole.close()
