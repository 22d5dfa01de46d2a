"""Small things a user of `pykv generate`, `pykv bench` and `pykv convert` sees: the output
ends with one newline (none added to an empty output or one that already ends with one),
a one-token prompt is timed as a prompt, bench's threads column gives the real count, and
convert's install hint is README's."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args):
    env = dict(os.environ, PYTHONIOENCODING="utf-8",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pykv", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def physical_cores() -> int:
    """The reference: distinct (package, core) pairs in sysfs, else the CPU count."""
    seen = set()
    for cpu in range(os.cpu_count() or 1):
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = int((base / "core_id").read_text())
        except OSError:
            return os.cpu_count() or 1
        try:
            pkg = int((base / "physical_package_id").read_text())
        except OSError:
            pkg = 0
        seen.add((pkg, core))
    return len(seen) or os.cpu_count() or 1


def test_generate_ends_its_output_with_one_newline(tiny_model):
    model = tiny_model()
    common = ["generate", model, "-t", 1, "--temp", 0]
    for flags, want in [(["-p", "ab", "--grammar", 'root ::= "hi\\n"'], "abhi\n"),
                        (["-p", "ab", "--grammar", 'root ::= "hi\\n"', "--no-stream"], "abhi\n"),
                        (["-p", "ab", "--grammar", 'root ::= "hi"', "--no-stream"], "abhi\n"),
                        (["-p", "ab", "--grammar", 'root ::= "hi"'], "abhi\n"),
                        (["-p", "ab", "--grammar", 'root ::= "hi"', "--no-display-prompt"], "hi\n"),
                        (["-p", "ab", "-n", 0, "--no-display-prompt"], ""),
                        (["-p", "ab", "-n", 0], "ab\n")]:
        r = run_cli(*common, *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout == want, (flags, r.stdout)


def test_one_token_prompt_is_timed_as_the_prompt(tiny_model):
    """An empty prompt is BOS alone: one prompt token, timed as the prompt's (a positive
    prefill rate), and every generated token's step counted under eval, none twice."""
    r = run_cli("generate", tiny_model(), "-p", "", "-n", 4, "--ignore-eos", "--temp", 0, "-t", 1, "--json")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["timings"]
    # the first generated token comes from the prompt's logits: 4 tokens, 3 decode steps
    assert (t["prompt_n"], t["predicted_n"]) == (1, 3) and t["prompt_ms"] > 0, t
    r = run_cli("generate", tiny_model(), "-p", "", "-n", 4, "--ignore-eos", "--temp", 0, "-t", 1)
    line = next(x for x in r.stderr.splitlines() if x.startswith("pykv: prefill"))
    rate = float(re.match(r"pykv: prefill ([0-9.]+) tok/s", line).group(1))
    assert rate > 0, line
    assert re.search(r"prompt eval time = +[0-9.]+ ms / +1 tokens", r.stderr), r.stderr
    zero = run_cli("generate", tiny_model(), "-p", "", "-n", 0, "-t", 1)
    assert re.search(r"pykv: prefill [0-9.]+ tok/s, decode - tok/s", zero.stderr), zero.stderr


def test_bench_threads_column_is_the_real_count(tiny_model):
    model = tiny_model()
    for flags, want in [([], physical_cores()), (["-t", "1"], 1)]:
        r = run_cli("bench", model, "-p", "8", "-n", "", "-r", "1", "--no-warmup", "-o", "json", *flags)
        assert r.returncode == 0, r.stderr
        assert [row["threads"] for row in json.loads(r.stdout)] == [want]
    md = run_cli("bench", model, "-p", "8", "-n", "", "-r", "1", "--no-warmup")
    assert "auto" not in md.stdout and f"| {physical_cores()} |" in md.stdout, md.stdout


def test_install_hints_match_readme(monkeypatch):
    """The extra's install line that README gives ('.[hf]' from a checkout: pykv is not on a
    package index) is the one convert's and pull's messages give."""
    readme = (ROOT / "README.md").read_text()
    (line,) = set(re.findall(r"pip install '[^']*\[hf\]'", readme))
    import pytest
    from pykv import convert, pull
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(convert.ConvertError) as err:
        convert.convert("nowhere", "out.gguf")
    assert line in str(err.value)
    with pytest.raises(pull.PullError) as err:
        pull.pull("hf://owner/repo/model.gguf", quiet=True)
    assert line in str(err.value)
    assert line in " ".join(run_cli("convert", "--help").stdout.split())


def chat_cli(model, stdin, *flags):
    env = dict(os.environ, PYTHONIOENCODING="utf-8",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pykv", "chat", str(model), "--temp", "0", "-t", "1", "-c", "512",
                           *map(str, flags)], input=stdin, capture_output=True, text=True, timeout=120, env=env)


def test_chat_starts_from_a_document(tiny_model, tmp_path):
    """-f FILE: the first user message is the document, a blank line and the typed message;
    the replies are the API's greedy replies to that conversation, and /reset brings the
    document back for the next first message."""
    from pykv import Llama
    doc = tmp_path / "doc.txt"
    doc.write_text("Alpha beta gamma.\n")
    model = tiny_model()
    r = chat_cli(model, "Sum it up\nmore\n/reset\nagain\n", "-f", doc, "-n", 6, "-v")
    assert r.returncode == 0, r.stderr
    first = "Alpha beta gamma.\n\nSum it up"
    with Llama(str(model), n_ctx=512, n_threads=1) as llm:
        def reply(history):
            return llm.create_chat_completion(history, temperature=0.0, max_tokens=6)["choices"][0]["message"]["content"]
        one = reply([{"role": "user", "content": first}])
        two = reply([{"role": "user", "content": first}, {"role": "assistant", "content": one},
                     {"role": "user", "content": "more"}])
        three = reply([{"role": "user", "content": "Alpha beta gamma.\n\nagain"}])
        n_first = len(llm.chat_prompt([{"role": "user", "content": first}]))
    assert r.stdout == f"{one}\n{two}\n{three}\n"
    assert f"pykv: prompt {n_first} tokens" in r.stderr, r.stderr
    missing = chat_cli(model, "hi\n", "-f", tmp_path / "nope.txt")
    assert missing.returncode == 1 and "cannot read -f/--file" in missing.stderr, missing.stderr


def test_chat_ignore_eos(tiny_model):
    """--ignore-eos: with EOS made certain by a logit bias a reply still runs to -n tokens;
    without it the reply ends at once."""
    from pykv import Llama
    model = tiny_model()
    with Llama(str(model), vocab_only=True) as llm:
        eos = llm.token_eos()
    counts = {}
    for flags in ([], ["--ignore-eos"]):
        r = chat_cli(model, "hi\n", "-n", 5, "-v", "-l", f"{eos}+100", *flags)
        assert r.returncode == 0, r.stderr
        counts[bool(flags)] = int(re.search(r"reply (\d+) tokens", r.stderr).group(1))
    assert counts == {False: 0, True: 5}


def test_pip_build_logs_its_steps():
    """pyproject.toml asks scikit-build-core for its INFO log (its steps, CMake's progress),
    which `pip install -v .` shows, and the settings are valid ones of the installed backend."""
    import pytest
    pytest.importorskip("scikit_build_core")
    from scikit_build_core.settings.skbuild_read_settings import SettingsReader
    reader = SettingsReader.from_file(ROOT / "pyproject.toml", state="wheel")
    reader.validate_may_exit()
    assert reader.settings.logging.level == "INFO"
    assert "pip install -v ." in (ROOT / "README.md").read_text()
