"""examples/simple.c builds with the command line its comment documents (the library's and
the header's folders standing for build/ and native/include/: those Python loaded, so the
test needs no CMake build of its own) and greedy-generates what the Python API generates."""
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
SOURCE = ROOT / "examples" / "simple.c"


def documented(command: str) -> str:
    """The line of simple.c's comment that starts with command."""
    lines = [line[2:].strip() for line in SOURCE.read_text().splitlines() if line.startswith("//")]
    (line,) = [line for line in lines if line.startswith(command + " ")]
    return line


def test_readme_and_comment_agree():
    readme = (ROOT / "README.md").read_text()
    for command in ("cmake", "cc"):
        assert documented(command) in readme


def test_simple_c_builds_and_generates_as_the_api(tiny_model, tmp_path):
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or $CC) on this machine")
    line = documented("cc")
    assert re.search(r"-Inative/include -Lbuild -lpykv -Wl,-rpath,\"\$PWD/build\" -o simple$", line), line
    line = line.replace('"$PWD/build"', shlex.quote(str(LIBRARY_PATH.parent))).replace(
        "-Lbuild", "-L" + shlex.quote(str(LIBRARY_PATH.parent))).replace(
        "-Inative/include", "-I" + shlex.quote(str(HEADER_PATH.parent))).replace("-o simple", "-o " + shlex.quote(
            str(tmp_path / "simple")))
    argv = shlex.split(line)
    argv[0] = compiler
    built = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    model = tiny_model()
    run = subprocess.run([str(tmp_path / "simple"), str(model), "ab", "6"], capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    with Llama(str(model), n_ctx=2048) as llm:
        want = llm.generate("ab", max_tokens=6, temperature=0.0).tokens
        text = b"".join(llm.token_to_piece(t) for t in want)
    assert run.stdout == b"ab" + text + b"\n"
    assert re.search(rb"prefill: \d+ tokens, [0-9.]+ tok/s \| decode: \d+ tokens", run.stderr), run.stderr
