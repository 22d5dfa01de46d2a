"""Grammars and JSON schemas as an attacker or a careless user writes them: groups nested
100k deep, chains of 100k rules, grammars that reach the same point along 2^40 paths, schemas
3,000 levels deep or with 10,000 properties. Each ends in a clear error or a working grammar,
never a crash, a RecursionError or a stall.

The cases are a corpus: tests/corpus/grammars/*.gbnf (the expected outcome in `# expect:`
comments, texts the grammar takes and refuses in `# takes:` / `# refuses:`), tests/corpus/
schemas/*.json ({"expect", "schema", "valid", "invalid"}) and tests/corpus/generated.py for
the large ones. The crashes are run in a subprocess (on a thread with a 512 KiB stack too).
Tiny models only, so the file also runs against the sanitized library (tests/run.sh)."""
from __future__ import annotations

import faulthandler
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jsonschema
import pytest

from _compare import EXACT
from _tiny_models import grammar_takes
from pykv import InvalidArgumentError, Llama, LlamaGrammar
from pykv.grammar import bind

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
_spec = importlib.util.spec_from_file_location("corpus_generated", CORPUS / "generated.py")
generated = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generated)

GRAMMAR_FILES = sorted((CORPUS / "grammars").glob("*.gbnf"))
SCHEMA_FILES = sorted((CORPUS / "schemas").glob("*.json"))
WATCHDOG_S = 120   # a case that stalls ends the test process instead of holding CI


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    with Llama(str(tiny_model()), n_ctx=128, **EXACT) as llm:
        yield llm


@pytest.fixture
def watchdog():
    """A stall inside C cannot be interrupted from Python: faulthandler's timer thread ends the
    process instead, so a regression fails loudly rather than hanging the suite."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def expect_outcome(expected: str, make):
    """make() under the expected outcome: "ok" (its value is returned) or "error: <part of the
    message>" (an InvalidArgumentError saying so)."""
    if expected == "ok":
        return make()
    assert expected.startswith("error: "), expected
    with pytest.raises(InvalidArgumentError, match=re.escape(expected[len("error: "):])):
        make()
    return None


def grammar_header(text: str):
    """The `# expect:`, `# takes:` and `# refuses:` comments at the top of a corpus grammar."""
    expected, takes, refuses = None, [], []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line[1:].partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key.strip() == "expect":
            expected = value.strip()
        elif key.strip() == "takes":
            takes.append(value)
        elif key.strip() == "refuses":
            refuses.append(value)
    assert expected, "a corpus grammar starts with `# expect: ok` or `# expect: error: ...`"
    return expected, takes, refuses


@pytest.mark.parametrize("path", GRAMMAR_FILES, ids=[p.stem for p in GRAMMAR_FILES])
def test_grammar_corpus_file(tiny_llm, watchdog, path):
    text = path.read_text(encoding="utf-8")
    expected, takes, refuses = grammar_header(text)
    grammar = expect_outcome(expected, lambda: LlamaGrammar(text))
    assert grammar is not None or not (takes or refuses), "texts to try need a grammar that parses"
    if grammar is not None:
        matcher = bind(tiny_llm._model, grammar)
        for t in takes:
            assert grammar_takes(matcher, t), t
        for t in refuses:
            assert not grammar_takes(matcher, t), t


@pytest.mark.parametrize("name", sorted(generated.GRAMMARS))
def test_grammar_corpus_generated(tiny_model, name):
    """In a subprocess each: some of these crashed the process. A grammar that parses is also
    bound to a vocabulary, so the matcher's first expansion runs too."""
    code = """
    import sys
    sys.path.insert(0, sys.argv[1])
    from generated import GRAMMARS
    from pykv import InvalidArgumentError, Llama, LlamaGrammar
    from pykv.grammar import bind
    try:
        grammar = LlamaGrammar(GRAMMARS[sys.argv[3]][0]())
        with Llama(sys.argv[2], n_ctx=64) as llm:
            bind(llm._model, grammar)
        print("ok")
    except InvalidArgumentError as e:
        print("error:", e)
    """
    proc = run_python(code, args=[str(CORPUS), str(tiny_model()), name], timeout=WATCHDOG_S)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    expected = generated.GRAMMARS[name][1]
    if expected == "ok":
        assert proc.stdout.strip() == "ok"
    else:
        assert proc.stdout.startswith("error: ") and expected[len("error: "):] in proc.stdout, proc.stdout


def valid_json(schema, text: str) -> bool:
    """The jsonschema validator's verdict (the schema itself is not checked against the
    metaschema: a careless schema, such as a type listed twice, is still one to follow)."""
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


def check_texts(tiny_llm, schema, grammar, valid, invalid):
    """The grammar takes the valid texts and refuses the invalid ones; the jsonschema validator
    agrees on each, except that the grammar also refuses members out of the schema's order,
    which the validator allows (where a case lists such a text, the validator is not asked)."""
    matcher = bind(tiny_llm._model, grammar)
    for text in valid:
        assert valid_json(schema, text), text
        assert grammar_takes(matcher, text), text
    for text in invalid:
        assert not in_schema_order(schema, text) or not valid_json(schema, text), text
        assert not grammar_takes(matcher, text), text


def in_schema_order(schema, text: str) -> bool:
    """Whether text's top-level members are all among schema's properties, in their order."""
    value = json.loads(text)
    order = list(schema.get("properties", {})) if isinstance(schema, dict) else []
    if not isinstance(value, dict) or not order:
        return True
    if any(k not in order for k in value):
        return False
    at = [order.index(k) for k in value]
    return at == sorted(at)


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=[p.stem for p in SCHEMA_FILES])
def test_schema_corpus_file(tiny_llm, watchdog, path):
    case = json.loads(path.read_text(encoding="utf-8"))
    schema = case["schema"]
    grammar = expect_outcome(case["expect"], lambda: LlamaGrammar.from_json_schema(schema))
    if grammar is not None:
        check_texts(tiny_llm, schema, grammar, case.get("valid", []), case.get("invalid", []))


@pytest.mark.parametrize("name", sorted(generated.SCHEMAS))
def test_schema_corpus_generated(tiny_llm, watchdog, name):
    make_schema, expected, valid, invalid = generated.SCHEMAS[name]
    schema = make_schema()
    grammar = expect_outcome(expected, lambda: LlamaGrammar.from_json_schema(schema))
    if grammar is not None:
        check_texts(tiny_llm, schema, grammar, valid, invalid)


# ---- what used to crash or stall the process: each in its own ----

def run_python(*code: str, args=(), timeout: float = 120) -> subprocess.CompletedProcess:
    """The pieces of code (each dedented) in a fresh interpreter with the same pykv library and
    sanitizer settings (through the environment); a crash shows as a signal in returncode."""
    program = "".join(textwrap.dedent(piece) for piece in code)
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).resolve().parent)


def assert_ran(proc: subprocess.CompletedProcess, *expected_lines: str):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.stdout.split() == list(expected_lines), proc.stdout


PARSE = """
    import sys, threading
    sys.path.insert(0, sys.argv[1])
    from generated import nested_groups, rule_chain
    from pykv import InvalidArgumentError, LlamaGrammar

    def parse(text):
        try:
            LlamaGrammar(text)
            print("ok")
        except InvalidArgumentError as e:
            print("refused:", "nested-more-than-256" if "groups nested more than 256 deep" in str(e) else e)
"""


def test_groups_nested_100k_deep_are_refused_not_a_stack_overflow():
    proc = run_python(PARSE, "parse(nested_groups(100000))\n", args=[str(CORPUS)])
    assert_ran(proc, "refused:", "nested-more-than-256")


def test_a_thread_with_a_512_kib_stack_parses_at_the_limit_and_refuses_past_it():
    """10k groups crashed a 512 KiB thread at once; 256 (the limit) must fit with room to spare."""
    code = """
    def run():
        parse(nested_groups(256))
        parse(nested_groups(10000))
    threading.stack_size(512 * 1024)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    """
    assert_ran(run_python(PARSE, code, args=[str(CORPUS)]), "ok", "refused:", "nested-more-than-256")


def test_a_chain_of_100k_rules_is_followed_on_a_512_kib_stack(tiny_model):
    """The matcher expands the 100k rules before "a" at its first step: on the heap, not the
    thread's stack (which held one C frame per rule)."""
    code = """
    import sys, threading
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, ".")
    from generated import rule_chain
    from _tiny_models import grammar_takes
    from pykv import Llama, LlamaGrammar
    from pykv.grammar import bind

    def run(llm):
        matcher = bind(llm._model, LlamaGrammar(rule_chain(100000)))
        print(grammar_takes(matcher, "a"), grammar_takes(matcher, "b"), grammar_takes(matcher, "aa"))
    with Llama(sys.argv[2], n_ctx=64) as llm:
        threading.stack_size(512 * 1024)
        t = threading.Thread(target=run, args=(llm,))
        t.start()
        t.join()
    """
    assert_ran(run_python(code, args=[str(CORPUS), str(tiny_model())]), "True", "False", "False")


def test_parsing_large_grammars_takes_bounded_time(watchdog):
    """Parsing is linear: 200 KB of groups 255 deep, a 100k-rule chain and 100k alternatives
    take well under a second each; the bound is generous (at the old quadratic cost the first
    alone took minutes)."""
    texts = [generated.GRAMMARS[name][0]() for name in ("groups-255-deep-200kb", "chain-100k-rules",
                                                         "alternatives-100k")]
    start = time.perf_counter()
    for text in texts:
        LlamaGrammar(text)
    assert time.perf_counter() - start < 20


def test_schema_text_nested_too_deep_to_read():
    with pytest.raises(InvalidArgumentError, match="nests too deep to read"):
        LlamaGrammar.from_json_schema("[" * 100000 + "]" * 100000)


def test_a_schema_that_contains_itself_is_refused():
    schema = {"type": "object", "properties": {}}
    schema["properties"]["self"] = schema
    with pytest.raises(InvalidArgumentError, match="schemas nested more than 64 levels deep"):
        LlamaGrammar.from_json_schema(schema)
