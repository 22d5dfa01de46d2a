"""`pykv chat`: user messages on stdin, replies on stdout, each equal to the Python API's
greedy chat completion of the conversation so far; /reset, continued lines, and a turn that
outgrows the context reported without ending the session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pykv import Llama

pytestmark = pytest.mark.model
TIMEOUT = 300
GREEDY = ["--temp", "0", "-n", "12", "-t", "2", "-c", "512"]


def chat(model, stdin, *flags):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "pykv", "chat", str(model), *GREEDY, *flags], input=stdin,
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def api_replies(model, turns, system=None):
    """The replies the Python API gives, turn by turn, to the same conversation."""
    history = [{"role": "system", "content": system}] if system else []
    replies = []
    with Llama(str(model), n_ctx=512, n_threads=2) as llm:
        for text in turns:
            history.append({"role": "user", "content": text})
            out = llm.create_chat_completion(history, temperature=0.0, max_tokens=12)
            replies.append(out["choices"][0]["message"]["content"])
            history.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_a_conversation_matches_the_api(smollm2_path):
    r = chat(smollm2_path, "What is the capital of France?\nAnd of \\\nGermany?\n", "-sys", "Answer briefly.")
    assert r.returncode == 0, r.stderr
    expected = api_replies(smollm2_path, ["What is the capital of France?", "And of \nGermany?"], "Answer briefly.")
    assert r.stdout == "".join(reply + "\n" for reply in expected)
    assert "pykv: 2 replies" in r.stderr


def test_reset_forgets_the_conversation(smollm2_path):
    r = chat(smollm2_path, "My name is Ada.\n/reset\n\nHi\n/exit\nnot read\n")
    assert r.returncode == 0, r.stderr
    first = api_replies(smollm2_path, ["My name is Ada."])[0]
    fresh = api_replies(smollm2_path, ["Hi"])[0]
    assert r.stdout == f"{first}\n{fresh}\n"


def test_a_turn_too_long_for_the_context_is_an_error_and_the_session_goes_on(smollm2_path):
    r = chat(smollm2_path, "word " * 600 + "\nHi\n")
    assert r.returncode == 3
    errors = [line for line in r.stderr.splitlines() if line.startswith("pykv: error:")]
    assert len(errors) == 1 and "leaves no room for a reply in n_ctx=512" in errors[0] and "/reset" in errors[0]
    assert r.stdout == api_replies(smollm2_path, ["Hi"])[0] + "\n"   # the long turn is not kept


def test_a_turn_longer_than_the_context_goes_through_a_bounded_cache(smollm2_path):
    # take compresses while it reads, so n_ctx bounds the cache, not the turn
    r = chat(smollm2_path, "The cat sat on the mat. " * 120 + "\n", "--policy", "take", "--budget", "128")
    assert r.returncode == 0, r.stderr
    assert not [line for line in r.stderr.splitlines() if line.startswith("pykv: error:")]
    assert r.stdout.strip()


def test_bad_sampling_flag_before_loading(smollm2_path):
    r = chat(smollm2_path, "Hi\n", "--top-p", "0")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().startswith("pykv: error: sampler params: top_p")


def test_ctrl_c_cuts_a_reply_short_and_the_session_goes_on(smollm2_path):
    import signal
    import time

    from _signals import sigint_as_at_a_terminal

    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pykv", "chat", str(smollm2_path), "-n", "2000", "-c", "4096",
                             "-t", "2", "-s", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, preexec_fn=sigint_as_at_a_terminal)
    try:
        proc.stdin.write(b"Write a very long story about a dragon and a knight, with many chapters.\n")
        proc.stdin.flush()
        got, deadline = b"", time.monotonic() + TIMEOUT
        while len(got) < 40 and time.monotonic() < deadline:
            chunk = os.read(proc.stdout.fileno(), 256)
            if not chunk:
                break
            got += chunk
        assert len(got) >= 40, "the reply did not stream before the interrupt"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(b"Hi\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode(errors="replace")
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "pykv: 2 replies" in err
    assert (got + rest).decode(errors="replace").count("\n") >= 2   # the cut reply ended, the next one came


@pytest.mark.parametrize("policy,kept", [("full", True), ("snapkv", False)])
def test_a_turn_keeps_the_earlier_turns_with_full(smollm2_path, policy, kept):
    budget = [] if policy == "full" else ["--budget", "64"]   # a budget with full is an error
    r = chat(smollm2_path, "Name a colour.\nAnd another?\n", "-v", "--policy", policy, *budget)
    assert r.returncode == 0, r.stderr
    counts = [int(line.split("(")[1].split()[0]) for line in r.stderr.splitlines() if "kept from the last turn" in line]
    assert len(counts) == 2 and counts[0] == 0
    assert (counts[1] > 0) == kept
