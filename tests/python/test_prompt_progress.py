"""Progress of a long prompt (Llama.eval(progress=) over pykv_decode_step, generate(prompt_progress=),
`pykv generate` on a terminal) and stopping one between chunks:
progress returning False, an exception from it, or Ctrl-C stop the call at the next chunk
boundary; the chunks done stay evaluated, so finishing the prompt afterwards gives what one
uninterrupted call gives."""
import os
import re
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _signals import sigint_as_at_a_terminal
from pykv import Llama
from pykv.errors import GenerationCancelled

pytestmark = pytest.mark.model

N_PROMPT, N_BATCH = 300, 64
PROMPT = [int(t) for t in np.random.default_rng(11).integers(100, 40000, size=N_PROMPT)]
PROGRESS_LINE = re.compile(rb"pykv: prompt (\d+)/(\d+) tokens \(\d+%\)")


def _open(path, **kw):
    return Llama(str(path), n_ctx=1024, n_batch=N_BATCH, n_threads=2, verbose=False, **kw)


def test_progress_after_each_chunk(smollm2_path):
    with _open(smollm2_path) as llm:
        calls = []
        llm.eval(PROMPT, progress=lambda done, total: calls.append((done, total)))
        assert calls == [(n, N_PROMPT) for n in range(N_BATCH, N_PROMPT, N_BATCH)] + [(N_PROMPT, N_PROMPT)]
        calls.clear()
        llm.eval([PROMPT[0]], progress=lambda done, total: calls.append((done, total)))
        assert calls == []   # a decode step is no prompt
        llm.reset()
        res = llm.generate(PROMPT, max_tokens=2, temperature=0.0,
                           prompt_progress=lambda done, total: calls.append((done, total)))
        assert calls[-1] == (N_PROMPT, N_PROMPT) and len(calls) == 5
        assert res.prompt_tokens == N_PROMPT


@pytest.mark.parametrize("policy", ["full", "snapkv"])
def test_progress_false_stops_at_the_next_chunk(smollm2_path, policy):
    kw = {} if policy == "full" else {"policy": policy, "budget": 96}
    with _open(smollm2_path, **kw) as whole, _open(smollm2_path, **kw) as llm:
        whole.eval(PROMPT)
        with pytest.raises(GenerationCancelled):
            llm.eval(PROMPT, progress=lambda done, total: done < 2 * N_BATCH)
        assert llm.n_past == 2 * N_BATCH and len(llm.input_ids) == 2 * N_BATCH
        timings = llm.timings()   # the chunks that stay evaluated count, the stopped one not
        assert timings["prompt_n"] == 2 * N_BATCH and timings["prompt_ms"] > 0
        llm.eval(PROMPT[llm.n_past:])   # goes on from where it stopped
        assert llm.n_past == N_PROMPT
        if policy == "full":   # the same chunks in the same order: the same logits
            np.testing.assert_array_equal(llm.logits(), whole.logits())
        # on the last chunk, False still lets it finish, and is reported
        llm.reset()
        with pytest.raises(GenerationCancelled):
            llm.eval(PROMPT, progress=lambda done, total: done < total)
        assert llm.n_past == N_PROMPT


def test_an_exception_from_progress_stops_the_call_and_is_raised(smollm2_path):
    with _open(smollm2_path) as llm:
        def fail(done, total):
            if done == 3 * N_BATCH:
                raise ValueError("stop here")
        with pytest.raises(ValueError, match="stop here"):
            llm.eval(PROMPT, progress=fail)
        assert llm.n_past == 3 * N_BATCH and llm.input_ids == PROMPT[:3 * N_BATCH]
        llm.eval(PROMPT[llm.n_past:])   # nothing pending: the next call runs whole
        assert llm.n_past == N_PROMPT


# ---------------------------------------------------------------- the command on a terminal

WORDS = ("the of and a to in is that it was for on are as with his they at be this from have or by one "
         "had not but what all were when we there can an your which their said if do will each").split()


def _prompt_file(tmp_path, n_words):
    rng = np.random.default_rng(4)
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n_words)))
    return path


def _on_a_terminal(*args, stdin=None):
    """`python -m pykv ARGS` with stderr on a pseudo-terminal; the process and the pty's end."""
    master, slave = os.openpty()
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pykv", *map(str, args)], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=slave, env=env, preexec_fn=sigint_as_at_a_terminal)
    os.close(slave)
    return proc, master


def _generate_on_a_terminal(smollm2_path, prompt_file, *flags):
    return _on_a_terminal("generate", smollm2_path, "-f", prompt_file, "-b", N_BATCH, "-t", 2, "--temp", 0, *flags)


def _read_terminal(master, proc, until=None, timeout=120):
    """What the pty shows until `until` matches it, or until the process has exited."""
    got, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and not (until and until.search(got)):
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 4096)
            except OSError:   # the process closed its end
                break
            if not data:
                break
            got += data
        elif proc.poll() is not None:
            break
    return got


def _run_to_the_end(proc, master, stdin_text=None):
    """(what the terminal showed, stdout) of a run that must succeed."""
    try:
        if stdin_text is not None:
            proc.stdin.write(stdin_text.encode())
            proc.stdin.close()
        shown = _read_terminal(master, proc)
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=60) == 0, shown
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return shown, out


def _assert_progress_shown_then_erased(shown):
    steps = [(int(a), int(b)) for a, b in PROGRESS_LINE.findall(shown)]
    assert len(steps) >= 3 and all(done < total for done, total in steps), shown
    assert [done for done, _ in steps] == sorted(done for done, _ in steps)
    last = list(PROGRESS_LINE.finditer(shown))[-1]
    assert shown[last.end():].startswith(b"\r\x1b[K")   # erased before anything else


def test_command_shows_and_erases_prompt_progress(smollm2_path, tmp_path):
    path = _prompt_file(tmp_path, 400)
    shown, out = _run_to_the_end(*_generate_on_a_terminal(smollm2_path, path, "-n", "4"))
    _assert_progress_shown_then_erased(shown)
    assert out.startswith(path.read_text())   # the prompt is echoed after its evaluation
    assert len(out) > len(path.read_text())


def test_no_progress_lines_in_a_log(smollm2_path, tmp_path):
    path = _prompt_file(tmp_path, 400)
    r = subprocess.run([sys.executable, "-m", "pykv", "generate", str(smollm2_path), "-f", str(path), "-b",
                        str(N_BATCH), "-n", "2", "--temp", "0"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not PROGRESS_LINE.search(r.stderr) and b"\x1b[K" not in r.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery")
def test_ctrl_c_stops_a_long_prompt_at_the_next_chunk(smollm2_path, tmp_path):
    """Before, Ctrl-C waited for the whole prompt (28 s for 8K tokens here); it now stops at
    the chunk after the one it arrives in."""
    path = _prompt_file(tmp_path, 3000)
    proc, master = _generate_on_a_terminal(smollm2_path, path, "-n", "4", "-c", "4096")
    try:
        shown = _read_terminal(master, proc, until=PROGRESS_LINE)
        assert PROGRESS_LINE.search(shown), shown
        proc.send_signal(signal.SIGINT)
        shown += _read_terminal(master, proc)
        assert proc.wait(timeout=60) == 130, shown
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    steps = [(int(a), int(b)) for a, b in PROGRESS_LINE.findall(shown)]
    done, total = steps[-1]
    assert total > 2000 and done <= 4 * N_BATCH, steps   # stopped long before the end
    assert b"interrupted" in shown and b"Traceback" not in shown


def test_chat_shows_the_progress_of_a_long_turn(smollm2_path, tmp_path):
    """A pasted document in `pykv chat`: its turn's progress on the terminal, then the reply."""
    proc, master = _on_a_terminal("chat", smollm2_path, "-b", N_BATCH, "-n", 4, "--temp", 0, "-t", 2,
                                  stdin=subprocess.PIPE)
    shown, out = _run_to_the_end(proc, master, "Summarise: " + _prompt_file(tmp_path, 300).read_text() + "\n")
    _assert_progress_shown_then_erased(shown)
    assert out.strip()   # the reply


@pytest.mark.parametrize("call", ["eval", "reset", "close", "truncate", "load_state", "set_probe", "set_threads"])
def test_progress_cannot_change_the_context_under_its_call(smollm2_path, call):
    """What progress may not do to the context its call is evaluating: each refuses with
    InvalidArgumentError, which stops the call as any exception does; the context stays
    consistent and usable."""
    from pykv.errors import InvalidArgumentError
    with _open(smollm2_path) as llm:
        llm.eval(PROMPT[:10])
        state = llm.save_state()
        actions = {"eval": lambda: llm.eval(PROMPT[:5]), "reset": llm.reset, "close": llm.close,
                   "truncate": lambda: llm.truncate(3), "load_state": lambda: llm.load_state(state),
                   "set_probe": lambda: llm.set_probe([5, 6]), "set_threads": lambda: llm.set_threads(1)}

        def meddle(done, total):
            if done == 2 * N_BATCH:
                actions[call]()
        with pytest.raises(InvalidArgumentError, match="progress callback"):
            llm.eval(PROMPT, progress=meddle)
        assert llm.n_past == 10 + 2 * N_BATCH and llm.input_ids == PROMPT[:10] + PROMPT[:2 * N_BATCH]
        for g in range(llm.model_info["n_head_kv"]):
            assert list(llm.kv_positions(0, g)) == list(range(llm.n_past))
        llm.eval(PROMPT[:4])   # usable: the next call runs
        assert llm.n_past == 14 + 2 * N_BATCH
