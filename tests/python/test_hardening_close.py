"""Closing a Llama, or freeing a context, while another thread uses it; two threads on one Llama.

close() from another thread cancels the running call and waits for it to stop before it frees
the context and the model (Llama and pykv_context_free alike); a second thread's generate()
is refused while one runs, with a message that says so. The crash cases run in a subprocess
(a use after free kills the process, or is what AddressSanitizer reports)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from pykv import Llama
from pykv.errors import GenerationCancelled, InvalidArgumentError

# large enough that a token takes a while, so that close() lands inside native code
SLOW = dict(n_embd=256, n_ff=512, n_layer=4)


def run_child(code: str, *args, timeout=120):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"exit code {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r.stdout


CLOSE_DURING_GENERATE = """
import random, sys, threading, time
from pykv import Llama
from pykv.errors import GenerationCancelled, InvalidArgumentError

path, trials = sys.argv[1], int(sys.argv[2])
rng = random.Random(7)
outcomes = []
for trial in range(trials):
    llm = Llama(path, n_ctx=512, n_batch=32, n_threads=1)
    started, ended = threading.Event(), []

    def run(stream=trial % 2 == 0):
        prompt = [1 + (i * 7) % 200 for i in range(96)]
        try:
            if stream:
                for _ in llm.generate(prompt, max_tokens=300, ignore_eos=True, temperature=0.0, stream=True,
                                      prompt_progress=lambda done, total: started.set()):
                    pass
            else:
                llm.generate(prompt, max_tokens=300, ignore_eos=True, temperature=0.0,
                             prompt_progress=lambda done, total: started.set())
            ended.append("finished")
        except GenerationCancelled:
            ended.append("cancelled")
        except InvalidArgumentError as e:
            assert "this Llama is closed" in str(e), e
            ended.append("closed")

    thread = threading.Thread(target=run)
    thread.start()
    started.wait(30)
    time.sleep(rng.random() * 0.02)   # in the prompt's chunks or in the token loop
    llm.close()
    thread.join(60)
    assert not thread.is_alive()
    outcomes.append(ended[0])
    try:
        llm.n_past
        raise AssertionError("a closed Llama answered")
    except InvalidArgumentError as e:
        assert "closed" in str(e)
print(" ".join(outcomes))
"""


def test_close_from_another_thread_during_generate(tiny_model):
    """20 trials, streamed and not: close() lands in the prompt's evaluation or the token loop;
    the generating thread ends with GenerationCancelled (or "closed" at its next step), never a
    crash, and close() returns only once it has stopped."""
    out = run_child(CLOSE_DURING_GENERATE, tiny_model(**SLOW), 20).split()
    assert len(out) == 20
    assert set(out) <= {"cancelled", "closed", "finished"}
    assert out.count("cancelled") + out.count("closed") >= 10, out   # close() came while it ran


C_FREE_DURING_DECODE = """
import sys, threading
from pykv._ffi import ffi, lib, new_params

path, trials = sys.argv[1], int(sys.argv[2])
statuses = []
for trial in range(trials):
    mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
    model = ffi.new("pykv_model **")
    assert lib.pykv_model_load(path.encode(), mparams, model) == lib.PYKV_OK
    cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
    cparams.n_ctx, cparams.n_ubatch, cparams.n_threads = 512, 16, 1
    ctx = ffi.new("pykv_context **")
    assert lib.pykv_context_init(model[0], cparams, ctx) == lib.PYKV_OK
    chunks = threading.Semaphore(0)

    @ffi.callback("pykv_progress_callback")
    def on_chunk(done, total, user):
        chunks.release()
        return 1

    lib.pykv_set_progress_callback(ctx[0], on_chunk, ffi.NULL)
    tokens = ffi.new("pykv_token[]", [1 + (i * 7) % 200 for i in range(400)])
    result = []
    thread = threading.Thread(target=lambda: result.append(lib.pykv_decode(ctx[0], tokens, 400)))
    thread.start()
    for _ in range(1 + trial % 3):
        chunks.acquire()
    lib.pykv_context_free(ctx[0])    # cancels the decode and waits for it to return
    lib.pykv_model_free(model[0])    # nothing uses the model any more
    thread.join()
    statuses.append(result[0])
assert all(s == lib.PYKV_ERR_CANCELLED for s in statuses), statuses
print("ok")
"""


def test_c_context_free_from_another_thread_waits_for_the_decode(tiny_model):
    """pykv_context_free while another thread's pykv_decode runs cancels that call and returns
    only after it has (so freeing the model next is safe too)."""
    assert run_child(C_FREE_DURING_DECODE, tiny_model(**SLOW), 10).strip() == "ok"


C_FREE_FROM_CALLBACK = """
import sys
from pykv._ffi import ffi, lib, new_params

path = sys.argv[1]
mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
model = ffi.new("pykv_model **")
assert lib.pykv_model_load(path.encode(), mparams, model) == lib.PYKV_OK
cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
cparams.n_ctx, cparams.n_ubatch, cparams.n_threads = 256, 16, 1
ctx = ffi.new("pykv_context **")
assert lib.pykv_context_init(model[0], cparams, ctx) == lib.PYKV_OK
calls = []

@ffi.callback("pykv_progress_callback")
def on_chunk(done, total, user):
    calls.append(done)
    if len(calls) == 2:
        lib.pykv_context_free(ctx[0])   # deferred: the decode frees it as it returns
    return 1

lib.pykv_set_progress_callback(ctx[0], on_chunk, ffi.NULL)
tokens = ffi.new("pykv_token[]", [1 + i % 200 for i in range(160)])
status = lib.pykv_decode(ctx[0], tokens, 160)
message = ffi.string(lib.pykv_last_error()).decode()
lib.pykv_model_free(model[0])
print(status == lib.PYKV_ERR_CANCELLED, calls, message)
"""


def test_c_context_free_from_the_progress_callback_is_deferred(tiny_model):
    """From the decode's own progress callback the free cannot wait for the call (it is that
    call): the decode stops after that chunk and frees the context as it returns."""
    out = run_child(C_FREE_FROM_CALLBACK, tiny_model()).strip()
    assert out.startswith("True [16, 32] "), out
    assert "freed from the call's progress callback" in out


def _blocking_processor(entered: threading.Event, release: threading.Event):
    """A logits processor that, on its first call, signals and waits: the generating thread
    then holds the Llama inside generate()."""
    def processor(ids, logits):
        if not entered.is_set():
            entered.set()
            assert release.wait(30)
        return logits
    return processor


def test_two_threads_generating_on_one_llama(tiny_model):
    """While one thread generates, another thread's generate() (and eval, reset) is refused
    with a message that says so, and the first generation is not disturbed; calls that only
    read the model go on. Once it ends the other thread may generate."""
    with Llama(str(tiny_model()), n_ctx=128, n_threads=1) as llm:
        alone = llm.generate([1, 2, 3, 4], max_tokens=12, ignore_eos=True, temperature=0.0).tokens
        llm.reset()
        entered, release = threading.Event(), threading.Event()
        results = []
        first = threading.Thread(target=lambda: results.append(llm.generate(
            [1, 2, 3, 4], max_tokens=12, ignore_eos=True, temperature=0.0,
            logits_processor=_blocking_processor(entered, release))))
        first.start()
        try:
            assert entered.wait(30)
            for call in (lambda: llm.generate([5, 6, 7], max_tokens=4),
                         lambda: llm.create_completion([5, 6, 7], max_tokens=4),
                         lambda: llm.eval([5]), llm.reset):
                with pytest.raises(InvalidArgumentError, match="this Llama is already generating in another thread"):
                    call()
            with pytest.raises(InvalidArgumentError, match="this Llama is already generating in another thread"):
                next(iter(llm.generate([5, 6, 7], max_tokens=4, stream=True)))
            assert llm.tokenize(b"the cat", add_bos=False) == llm.tokenize(b"the cat", add_bos=False)
            assert llm.n_ctx == 128
        finally:
            release.set()
            first.join(30)
        assert results and results[0].tokens == alone
        assert llm.generate([1, 2, 3, 4], max_tokens=12, ignore_eos=True, temperature=0.0).tokens == alone


def test_close_from_a_callback_is_refused(tiny_model):
    """close() inside generate()'s own callbacks cannot wait for the call it is part of."""
    with Llama(str(tiny_model()), n_ctx=64, n_threads=1) as llm:
        def closer(ids, logits):
            llm.close()
        with pytest.raises(InvalidArgumentError, match="close\\(\\) cannot run inside"):
            llm.generate([1, 2, 3], max_tokens=2, logits_processor=closer)
        assert llm.generate([1, 2, 3], max_tokens=2, ignore_eos=True).tokens   # still open


def test_close_waits_for_a_running_generate_in_process(tiny_model):
    """close() while a generate() in another thread sits in a callback: close() cancels and
    waits; the generation stops with GenerationCancelled, after which close() frees."""
    llm = Llama(str(tiny_model()), n_ctx=128, n_threads=1)
    entered, release = threading.Event(), threading.Event()
    raised = []

    def run():
        try:
            llm.generate([1, 2, 3, 4], max_tokens=50, ignore_eos=True,
                         logits_processor=_blocking_processor(entered, release))
        except BaseException as e:  # noqa: BLE001 - reported below
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert entered.wait(30)
    threading.Timer(0.3, release.set).start()
    llm.close()   # returns once the generation has stopped
    assert release.is_set(), "close() returned while generate() was still running"
    thread.join(30)
    assert len(raised) == 1 and isinstance(raised[0], GenerationCancelled), raised
    with pytest.raises(InvalidArgumentError, match="closed"):
        llm.generate([1, 2], max_tokens=2)
    llm.close()   # twice is fine


ABANDONED_STREAMS = """
import gc, sys, threading
from pykv import Llama

llm = Llama(sys.argv[1], n_ctx=128, n_threads=1)
stream = llm.generate([1, 2, 3], max_tokens=50, ignore_eos=True, stream=True)
next(stream)
llm.close()
del stream   # closed with the Llama: nothing runs on the freed context, nothing is reported
gc.collect()

llm = Llama(sys.argv[1], n_ctx=128, n_threads=1)
stream = llm.generate([1, 2, 3], max_tokens=50, ignore_eos=True, stream=True)
next(stream)
entered, release = threading.Event(), threading.Event()

def hold(ids, logits):
    entered.set()
    release.wait(30)
    return logits

other = threading.Thread(target=lambda: llm.generate([4, 5], max_tokens=2, logits_processor=hold))
other.start()
entered.wait(30)
del stream   # the other thread holds the context: the abandoned stream leaves it alone
gc.collect()
release.set()
other.join()
print(llm.last_result.finish_reason, len(llm.last_result.tokens))
"""


def test_abandoned_streams_leave_the_context_alone(tiny_model):
    """A stream dropped after close(), or while another thread generates, is closed without
    touching the context (its result is not recorded) and without an error report."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(ABANDONED_STREAMS), str(tiny_model())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    assert r.stdout.split() == ["length", "2"]


def test_c_calls_from_another_thread_during_a_decode_are_refused(tiny_model):
    """pykv_decode and pykv_reset from a second thread while a decode runs (here paused in its
    progress callback) are refused with a message naming the other thread, not the callback."""
    from pykv._ffi import ffi, lib, new_params

    mparams = new_params("struct pykv_model_params", lib.pykv_model_default_params)
    model = ffi.new("pykv_model **")
    assert lib.pykv_model_load(str(tiny_model()).encode(), mparams, model) == lib.PYKV_OK
    cparams = new_params("struct pykv_context_params", lib.pykv_context_default_params)
    cparams.n_ctx, cparams.n_ubatch, cparams.n_threads = 128, 16, 1
    ctx = ffi.new("pykv_context **")
    assert lib.pykv_context_init(model[0], cparams, ctx) == lib.PYKV_OK
    entered, release = threading.Event(), threading.Event()

    @ffi.callback("pykv_progress_callback")
    def on_chunk(done, total, user):
        entered.set()
        release.wait(30)
        return 1

    lib.pykv_set_progress_callback(ctx[0], on_chunk, ffi.NULL)
    tokens = ffi.new("pykv_token[]", list(range(1, 41)))
    result = []
    thread = threading.Thread(target=lambda: result.append(lib.pykv_decode(ctx[0], tokens, 40)))
    thread.start()
    try:
        assert entered.wait(30)
        assert lib.pykv_decode(ctx[0], tokens, 1) == lib.PYKV_ERR_INVALID_ARG
        message = ffi.string(lib.pykv_last_error()).decode()
        assert "another thread is running pykv_decode" in message, message
        lib.pykv_reset(ctx[0])
        assert "another thread is running pykv_decode" in ffi.string(lib.pykv_last_error()).decode()
    finally:
        release.set()
        thread.join(30)
    assert result == [lib.PYKV_OK] and lib.pykv_n_past(ctx[0]) == 40   # the first call was not disturbed
    lib.pykv_set_progress_callback(ctx[0], ffi.NULL, ffi.NULL)
    lib.pykv_context_free(ctx[0])
    lib.pykv_model_free(model[0])
