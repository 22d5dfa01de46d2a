"""The pykv command: `python -m pykv ...` in a subprocess on the real SmolLM2 model, plus
in-process main() calls for usage errors. Exit codes: 0 ok, 1 usage, 2 model/IO, 3 runtime,
130 interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _signals import sigint_as_at_a_terminal
from pykv.cli import main

PROMPT = "The capital of France is"
TIMEOUT = 300


def run_cli(*args, stdin=None):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "pykv", *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, input=stdin)


def error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.strip()]


# ---------------------------------------------------------------- usage errors (no model)

def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "chat", "perplexity", "embed", "serve", "info", "pull", "bench"):
        assert command in out


def test_generate_help_lists_llama_cpp_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--prompt", "--n-predict", "--ctx-size", "--threads", "--temp", "--top-k",
                 "--top-p", "--min-p", "--repeat-penalty", "--seed", "--policy", "--budget",
                 "--ubatch-size", "--json", "--no-stream", "--kv-stats", "--frequency-penalty",
                 "--presence-penalty", "--logit-bias"):
        assert flag in out


@pytest.mark.parametrize("argv", [
    ["generate", "--bogus-flag"],
    ["generate", "-p", "x", "-n", "many"],
    ["frobnicate"],
    [],
    ["generate", "-p", "x", "-f", "y.txt"],
    ["generate", "-p", "x", "--policy-arg", "novalue"],
    ["generate", "-p", "x", "-t", "0"],
    ["generate", "-p", "x", "-n", "-5"],
    ["generate", "-p", "x", "--top-p", "2"],      # sampler ranges are checked before a model loads
    ["generate", "-p", "x", "--temp", "nan"],
    ["generate", "-p", "x", "--presence-penalty", "inf"],
    ["generate", "-p", "x", "-l", "15043"],       # TOKEN_ID(+/-)BIAS
    ["generate", "-p", "x", "-l", "15043+inf"],
    ["generate", "-p", "x", "-l", "99999999999+1"],   # past int32: a usage error, not an OverflowError
    ["generate", "-p", "x", "--logit-bias", "the-1"],
])
def test_usage_errors_exit_1(argv, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1, err
    assert err.startswith("pykv: error: ")


def test_bad_flag_in_subprocess():
    r = run_cli("generate", "--no-such-flag")
    assert r.returncode == 1
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("pykv: error: ")


def test_missing_model_exit_2(tmp_path):
    r = run_cli("generate", tmp_path / "missing.gguf", "-p", "hi")
    assert r.returncode == 2
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("pykv: error: ") and "missing.gguf" in lines[0]
    assert r.stdout == ""


def test_corrupt_model_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    r = run_cli("info", bad)
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("pykv: error: ")


def test_unknown_model_name_exit_2():
    r = run_cli("pull", "no-such-model-name")
    assert r.returncode == 2
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "smollm2" in lines[0]


def test_info_system_and_policies():
    r = run_cli("info", "--system", "--policies")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[0]  # system info is not empty
    from pykv import list_policies
    listed = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed == list_policies()   # every policy of the registry, in its order
    assert r.stdout.count("budget: default") == len(listed) - 1   # each evicting policy's default budget


# ---------------------------------------------------------------- the real model

@pytest.mark.model
def test_pull_prints_path(smollm2_path):
    r = run_cli("pull", smollm2_path)
    assert r.returncode == 0
    assert r.stdout.strip() == str(smollm2_path)


@pytest.mark.model
def test_generate_greedy_streams_text_and_timings(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", PROMPT, "-n", 8, "--temp", 0, "-t", 2)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT)
    assert len(r.stdout.strip()) > len(PROMPT)
    assert "tokens per second" in r.stderr and "tok/s" in r.stderr
    assert "prompt eval time" in r.stderr and "eval time" in r.stderr
    # greedy is deterministic, and -m is the same as the positional MODEL
    again = run_cli("generate", "-m", smollm2_path, "-p", PROMPT, "-n", 8, "--temp", 0, "-t", 2)
    assert again.returncode == 0 and again.stdout == r.stdout


@pytest.mark.model
def test_generate_json_matches_python_api(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", PROMPT, "-n", 6, "--temp", 0, "--json", "-t", 2)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert 1 <= len(data["tokens"]) <= 6
    assert data["finish_reason"] in ("length", "stop")
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_per_second"):
        assert key in data["timings"]
    assert data["kv_stats"]["policy"] == "full"

    from pykv import Llama
    with Llama(str(smollm2_path), n_ctx=512, n_threads=2) as llm:
        res = llm.generate(PROMPT, max_tokens=6, temperature=0.0, stream=False)
    assert res.tokens == data["tokens"]
    assert res.text == data["text"]


@pytest.mark.model
def test_generate_exact_matmul_flag_matches_python_api(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", PROMPT, "-n", 6, "--temp", 0, "--json", "-t", 2, "--exact-matmul")
    assert r.returncode == 0, r.stderr
    from pykv import Llama
    with Llama(str(smollm2_path), n_ctx=512, n_threads=2, exact_matmul=True) as llm:
        res = llm.generate(PROMPT, max_tokens=6, temperature=0.0, stream=False)
    assert res.tokens == json.loads(r.stdout)["tokens"]


@pytest.mark.model
def test_generate_penalty_and_logit_bias_flags_match_python_api(smollm2_path):
    flags = ("--frequency-penalty", 0.6, "--presence-penalty", 0.3, "-l", "7042-inf", "--logit-bias", "30+1.5")
    r = run_cli("generate", smollm2_path, "-p", PROMPT, "-n", 8, "--temp", 0, "--json", "-t", 2, *flags)
    assert r.returncode == 0, r.stderr
    from pykv import Llama
    with Llama(str(smollm2_path), n_ctx=512, n_threads=2) as llm:
        res = llm.generate(PROMPT, max_tokens=8, temperature=0.0, frequency_penalty=0.6, presence_penalty=0.3,
                           logit_bias={7042: float("-inf"), 30: 1.5})
        plain = llm.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert res.tokens == json.loads(r.stdout)["tokens"]
    assert plain.tokens[0] == 7042 and 7042 not in res.tokens   # " Paris", banned


@pytest.mark.model
def test_generate_no_stream_and_stop(smollm2_path, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    r = run_cli("generate", smollm2_path, "-f", prompt_file, "-n", 8, "--temp", 0, "--no-stream",
                "--no-display-prompt", "--kv-stats", "-s", 1)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.startswith(PROMPT)
    assert "kv cache: policy full" in r.stderr


@pytest.mark.model
def test_sampler_value_error_exit_1(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", PROMPT, "-n", 2, "--top-p", 2)
    assert r.returncode == 1, r.stderr
    lines = error_lines(r.stderr)
    assert lines == [lines[-1]] and lines[-1].startswith("pykv: error: ") and "top_p" in lines[-1]
    assert r.stdout == ""   # the prompt is not echoed ahead of the error


@pytest.mark.model
def test_prompt_longer_than_context_is_not_echoed(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", PROMPT, "-c", 3, "-n", 2)
    assert r.returncode != 0 and r.stdout == ""
    assert error_lines(r.stderr)[-1].startswith("pykv: error: the prompt has 5 tokens")


@pytest.mark.model
def test_empty_prompt_starts_from_bos(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", "", "-n", 4, "--temp", 0, "--json", "-t", 2)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["prompt_tokens"] == 1 and len(data["tokens"]) >= 1
    from pykv import Llama
    with Llama(str(smollm2_path), n_ctx=64, n_threads=2) as llm:
        res = llm.generate([llm.token_bos()], max_tokens=4, temperature=0.0)
    assert data["tokens"] == res.tokens


@pytest.mark.model
def test_prompt_file_that_is_not_utf8_reaches_the_tokenizer_as_bytes(smollm2_path, tmp_path):
    raw = b"The capital of Fran\xe7e is"   # Latin-1, not UTF-8
    prompt_file = tmp_path / "latin1.txt"
    prompt_file.write_bytes(raw)
    for source, stdin in ((prompt_file, None), ("-", raw)):
        r = subprocess.run([sys.executable, "-m", "pykv", "generate", str(smollm2_path), "-f", str(source), "-n", "4",
                            "--temp", "0", "--json", "-t", "2"], capture_output=True, timeout=TIMEOUT, input=stdin)
        assert r.returncode == 0, r.stderr
        assert b"not valid UTF-8 (byte 0xe7 at offset 19)" in r.stderr
        data = json.loads(r.stdout)
        from pykv import Llama
        with Llama(str(smollm2_path), n_ctx=64, n_threads=2, vocab_only=True) as vocab:
            n_prompt = len(vocab.tokenize(raw, add_bos=True, special=True))
            assert vocab.detokenize(vocab.tokenize(raw, add_bos=False)) == raw   # spelled with byte tokens
        assert data["prompt_tokens"] == n_prompt
        with Llama(str(smollm2_path), n_ctx=64, n_threads=2) as llm:
            assert llm.generate(raw, max_tokens=4, temperature=0.0).tokens == data["tokens"]


@pytest.mark.model
def test_info_prints_tensor_table(smollm2_path):
    r = run_cli("info", smollm2_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "general.architecture" in out and "llama" in out
    assert "tensors (" in out and "token_embd.weight" in out and "blk.0.attn_q.weight" in out
    assert "q4_1" in out
    assert "chat template:" in out and "im_start" in out
    # SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64 x (K, V) x 2 bytes (the default f16 cache)
    assert f"{30 * 3 * 64 * 2 * 2:,} bytes per token" in out
    assert "budget" in out


@pytest.mark.model
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery")
def test_ctrl_c_stops_cleanly(smollm2_path):
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pykv", "generate", str(smollm2_path), "-p", PROMPT,
                             "-n", "-1", "--ignore-eos", "-c", "2048", "-t", "2", "-s", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=sigint_as_at_a_terminal)
    try:
        got = b""
        deadline = time.monotonic() + TIMEOUT
        while len(got) < len(PROMPT) + 20 and time.monotonic() < deadline:
            chunk = os.read(proc.stdout.fileno(), 256)
            if not chunk:
                break
            got += chunk
        assert len(got) > len(PROMPT), "no tokens streamed before the interrupt"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode(errors="replace")
    err = err.decode(errors="replace")
    assert "interrupted" in err and "Traceback" not in err
    assert "tokens per second" in err  # timings of what was generated
    assert (got + rest).decode(errors="replace").startswith(PROMPT)


def test_mirostat_and_typical_flags_match_python_api(tiny_model):
    """--mirostat, --mirostat-ent (tau) and --mirostat-lr (eta) with a seed give what
    generate(mirostat_mode=, mirostat_tau=, mirostat_eta=) gives; a bad mode is a usage error;
    --typical gives what typical_p= gives; bad values of both are refused before the model loads."""
    from _compare import EXACT
    from pykv import Llama
    path = tiny_model()
    flags = ("--mirostat", 2, "--mirostat-ent", 3.5, "--mirostat-lr", 0.3, "-s", 7, "--temp", 1.2)
    r = run_cli("generate", path, "-p", "a", "-n", 12, "--json", "--exact-matmul", "--cache-type", "f32", *flags)
    assert r.returncode == 0, r.stderr
    with Llama(str(path), n_ctx=4096, **EXACT) as llm:
        want = llm.generate("a", max_tokens=12, temperature=1.2, seed=7, mirostat_mode=2, mirostat_tau=3.5,
                            mirostat_eta=0.3)
        plain = llm.generate("a", max_tokens=12, temperature=1.2, seed=7)
    assert json.loads(r.stdout)["tokens"] == want.tokens != plain.tokens
    r = run_cli("generate", path, "-p", "a", "-n", 2, "--mirostat", 3)
    assert r.returncode == 1 and "mirostat" in r.stderr
    r = run_cli("generate", path, "-p", "a", "-n", 12, "--json", "--exact-matmul", "--cache-type", "f32",
                "--typical", 0.3, "--top-k", 0, "-s", 7, "--temp", 1.2)
    assert r.returncode == 0, r.stderr
    with Llama(str(path), n_ctx=4096, **EXACT) as llm:
        want = llm.generate("a", max_tokens=12, temperature=1.2, seed=7, top_k=0, typical_p=0.3)
        plain = llm.generate("a", max_tokens=12, temperature=1.2, seed=7, top_k=0)
    assert json.loads(r.stdout)["tokens"] == want.tokens != plain.tokens
    for flag, value in (("--typical", 2), ("--mirostat-ent", 0)):   # refused before the model is looked for
        r = run_cli("generate", str(path) + ".missing", "-p", "a", flag, value)
        assert r.returncode == 1 and ("typical_p" if flag == "--typical" else "mirostat_tau") in r.stderr, r.stderr
