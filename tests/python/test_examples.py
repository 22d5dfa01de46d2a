"""Every Python example in examples/ runs on SmolLM2 and prints what the Python API computes
for it (examples/simple.c and simple-chat.c: test_example_simple.py)."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pykv import Llama, list_policies

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TESTED = ["generate.py", "stream.py", "chat.py", "policy_sweep.py", "openai_client.py"]


def run_example(name: str, model: Path, timeout: float = 120) -> str:
    """The example's stdout, run as a reader would run it, on model; it must exit with 0."""
    run = subprocess.run([sys.executable, str(EXAMPLES / name), str(model)], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_every_python_example_is_tested_and_says_how_to_run_it():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(TESTED)
    for name in TESTED:
        doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
        assert doc, name
        assert f"usage: python examples/{name} [MODEL]" in doc.splitlines(), name


@pytest.mark.model
def test_generate(smollm2_path):
    out = run_example("generate.py", smollm2_path)
    with Llama(str(smollm2_path), n_ctx=2048) as llm:
        want = llm.generate("The capital of France is", max_tokens=32, temperature=0.0).text
    assert want.strip()
    assert out == want + "\n"


@pytest.mark.model
def test_stream(smollm2_path):
    out = run_example("stream.py", smollm2_path)
    with Llama(str(smollm2_path), n_ctx=2048) as llm:
        want = llm.generate("Once upon a time", max_tokens=48, temperature=0.0).text   # not streamed
    assert want.strip()
    assert out == want + "\n"


@pytest.mark.model
def test_chat(smollm2_path):
    """Two turns, the second seeing the first's reply: what create_chat_completion answers."""
    out = run_example("chat.py", smollm2_path)
    messages = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}]
    want = ""
    with Llama(str(smollm2_path), n_ctx=2048) as llm:
        for question in ("Hello! Who are you?", "Name three colors."):
            messages.append({"role": "user", "content": question})
            reply = llm.create_chat_completion(messages, temperature=0.0, max_tokens=64)["choices"][0]["message"]
            assert reply["content"].strip()
            messages.append({"role": "assistant", "content": reply["content"]})
            want += f"user: {question}\nassistant: {reply['content']}\n\n"
    assert out == want


@pytest.mark.model
def test_policy_sweep(smollm2_path):
    """A row per policy of the registry, in its order: the evicting ones, at a budget of about
    a sixth of the prompt, hold well under half of full's KV memory; full's answer is the
    Python API's."""
    lines = run_example("policy_sweep.py", smollm2_path, timeout=300).splitlines()
    assert lines[0].split() == ["policy", "KV", "cache", "of", "full", "answer"]
    rows = [re.fullmatch(r"(\S+) +(\d+) KiB +(\d+)% +(.*)", line) for line in lines[1:]]
    assert all(rows), lines
    policies = [row[1] for row in rows]
    assert policies == list_policies()
    size = {row[1]: int(row[2]) for row in rows}
    share = {row[1]: int(row[3]) for row in rows}
    answer = {row[1]: row[4] for row in rows}
    assert share["full"] == 100
    for policy in policies:
        assert answer[policy].strip(), policy
        assert abs(share[policy] - 100 * size[policy] / size["full"]) <= 1, policy
        if policy != "full":
            assert 0 < size[policy] < size["full"] / 2, (policy, size)

    colours = ["blue", "green", "grey", "white", "yellow", "brown"]   # the example's document
    rooms = [f"Room {n} is painted {colours[n % 6]} and holds {n + 2} chairs." for n in range(1, 25)]
    rooms[19] += " The spare key is hidden under the red lamp in room 20."
    question = " ".join(rooms) + "\n\nWhere is the spare key hidden?"
    with Llama(str(smollm2_path), n_ctx=2048) as llm:
        reply = llm.create_chat_completion([{"role": "user", "content": question}], temperature=0.0, max_tokens=16)
    assert answer["full"] == " ".join(reply["choices"][0]["message"]["content"].split())


@pytest.mark.model
def test_openai_client(smollm2_path):
    """The openai package's replies from `pykv serve` are the Python API's at temperature 0
    (the two requests in the server's order: the second starts from what the first left)."""
    try:
        import openai  # noqa: F401
    except ImportError:
        pytest.skip("the openai package is not installed (pip install openai, or pip install '.[test]')")
    out = run_example("openai_client.py", smollm2_path)
    with Llama(str(smollm2_path), n_ctx=2048) as llm:
        want = [llm.create_chat_completion([{"role": "user", "content": question}], temperature=0.0,
                                           max_tokens=24)["choices"][0]["message"]["content"]
                for question in ("Name three colors.", "Hello! Who are you?")]
    assert all(text.strip() for text in want)
    assert out == f"reply: {want[0]}\nstreamed: {want[1]}\n"
