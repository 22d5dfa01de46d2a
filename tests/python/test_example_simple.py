"""examples/simple.c and examples/simple-chat.c build with the command lines their comments
document (the library's and the header's folders standing for build/ and native/include/:
those Python loaded, so the test needs no CMake build of its own) and greedy-generate what the
Python API generates."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pykv import Llama
from pykv._ffi import HEADER_PATH, LIBRARY_PATH

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def documented(source: str, command: str) -> str:
    """The line of the example's comment that starts with command."""
    lines = [line[2:].strip() for line in (EXAMPLES / source).read_text().splitlines() if line.startswith("//")]
    (line,) = [line for line in lines if line.startswith(command + " ")]
    return line


def build(source: str, out_dir: Path) -> Path:
    """The program built by the `cc` line of source's comment, pointed at the loaded library."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or $CC) on this machine")
    name = source[:-2]
    line = documented(source, "cc")
    assert re.search(rf"^cc examples/{re.escape(source)} -Inative/include -Lbuild -lpykv "
                     rf"-Wl,-rpath,\"\$PWD/build\" -o {re.escape(name)}$", line), line
    program = out_dir / name
    line = line.replace('"$PWD/build"', shlex.quote(str(LIBRARY_PATH.parent))).replace(
        "-Lbuild", "-L" + shlex.quote(str(LIBRARY_PATH.parent))).replace(
        "-Inative/include", "-I" + shlex.quote(str(HEADER_PATH.parent))).replace(
        "-o " + name, "-o " + shlex.quote(str(program)))
    argv = shlex.split(line)
    argv[0] = compiler
    built = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    return program


@pytest.mark.parametrize("source", ["simple.c", "simple-chat.c"])
def test_readme_and_comment_agree(source):
    readme = (ROOT / "README.md").read_text()
    for command in ("cmake", "cc"):
        assert documented(source, command) in readme


def test_simple_c_builds_and_generates_as_the_api(tiny_model, tmp_path):
    simple = build("simple.c", tmp_path)
    model = tiny_model()
    run = subprocess.run([str(simple), str(model), "ab", "6"], capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    with Llama(str(model), n_ctx=2048) as llm:
        want = llm.generate("ab", max_tokens=6, temperature=0.0).tokens
        text = b"".join(llm.token_to_piece(t) for t in want)
    assert run.stdout == b"ab" + text + b"\n"
    assert re.search(rb"prefill: \d+ tokens, [0-9.]+ tok/s \| decode: \d+ tokens", run.stderr), run.stderr


SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MESSAGES = ["Hello! Who are you?", "Name three colors."]


@pytest.mark.model
def test_simple_chat_replies_as_the_chat_api(smollm2_path, tmp_path):
    """Two lines on stdin, two greedy replies on stdout, each what create_chat_completion
    answers at temperature 0 to the conversation so far (the earlier reply included)."""
    chat = build("simple-chat.c", tmp_path)
    run = subprocess.run([str(chat), str(smollm2_path), SYSTEM], input="\n".join(MESSAGES).encode() + b"\n",
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    with Llama(str(smollm2_path), n_ctx=2048) as llm:
        for text in MESSAGES:
            messages.append({"role": "user", "content": text})
            result = llm.create_chat_completion(messages, temperature=0.0, max_tokens=256)
            assert result["choices"][0]["finish_reason"] == "stop"   # the reply ended its turn
            reply = result["choices"][0]["message"]["content"]
            assert reply.strip()
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
    assert run.stdout.decode() == "".join(reply + "\n" for reply in replies)
    assert run.stderr.decode() == "> " * (len(MESSAGES) + 1) + "\n"   # a prompt per line, one at the end


@pytest.mark.model
def test_simple_chat_without_input_says_nothing(smollm2_path, tmp_path):
    chat = build("simple-chat.c", tmp_path)
    run = subprocess.run([str(chat), str(smollm2_path)], input=b"", capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == b""


def test_simple_chat_usage_and_a_missing_model(tmp_path):
    chat = build("simple-chat.c", tmp_path)
    run = subprocess.run([str(chat)], capture_output=True, timeout=30)
    assert run.returncode == 1 and b"usage:" in run.stderr
    run = subprocess.run([str(chat), str(tmp_path / "absent.gguf")], input=b"hi\n", capture_output=True, timeout=30)
    assert run.returncode == 1 and run.stderr.startswith(b"load: ") and b"absent.gguf" in run.stderr, run.stderr
