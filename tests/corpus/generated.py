"""Adversarial grammars and JSON schemas too large to keep as files, written at test time.

Like the files beside it (grammars/*.gbnf, schemas/*.json), each case has its expected outcome:
"ok", or "error: " and a part of the error's message. tests/python/test_hardening_grammar.py
runs both."""
from __future__ import annotations

from typing import Callable, Dict, Tuple


def nested_groups(depth: int) -> str:
    """root ::= ((( ... "a" ... ))) with depth groups."""
    return "root ::= " + "(" * depth + '"a"' + ")" * depth + "\n"


def rule_chain(n: int) -> str:
    """root ::= r0, r0 ::= r1, ..., r{n-1} ::= "a": the matcher expands n rules before the first
    character."""
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1} ::= "a"\n'


def _many_deep_groups() -> str:   # 400 groups 255 deep in a row: 200 KB, every group a rule
    return "root ::= " + ("(" * 255 + '"a"' + ")" * 255 + " ") * 400 + "\n"


def _many_alternatives() -> str:
    return "root ::= " + " | ".join(f"r{i % 1000}" for i in range(100000)) + "\n" + \
        "".join(f'r{i} ::= "a"\n' for i in range(1000))


def _many_rules_used_before_defined() -> str:
    return "root ::= " + " ".join(f"rule{i}" for i in range(20000)) + "\n" + \
        "".join(f'rule{i} ::= "a"\n' for i in range(20000))


# name -> (GBNF text maker, expected)
GRAMMARS: Dict[str, Tuple[Callable[[], str], str]] = {
    "nesting-100k": (lambda: nested_groups(100000), "error: groups nested more than 256 deep"),
    "chain-100k-rules": (lambda: rule_chain(100000), "ok"),
    "groups-255-deep-200kb": (_many_deep_groups, "ok"),
    "alternatives-100k": (_many_alternatives, "ok"),
    "rules-20k-used-before-defined": (_many_rules_used_before_defined, "ok"),
    "optional-items-9000": (lambda: "root ::= " + '"a"? ' * 9000 + "\n", "error: more than 8192 ways to continue"),
}


def nested_schema(depth: int, wrap: Callable[[object], object]) -> object:
    schema: object = {"type": "integer"}
    for _ in range(depth):
        schema = wrap(schema)
    return schema


def properties(n: int, required: Callable[[int], bool], key: Callable[[int], str] = lambda i: f"p{i}") -> dict:
    keys = [key(i) for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "integer"} for k in keys},
            "required": [k for i, k in enumerate(keys) if required(i)]}


def _deep_value(depth: int) -> object:
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


# name -> (schema maker, expected, JSON texts it takes, JSON texts it refuses)
SCHEMAS: Dict[str, Tuple[Callable[[], object], str, Tuple[str, ...], Tuple[str, ...]]] = {
    "properties-3000-deep": (lambda: nested_schema(3000, lambda v: {"type": "object", "properties": {"a": v}}),
                             "error: schemas nested more than 64 levels deep", (), ()),
    "items-3000-deep": (lambda: nested_schema(3000, lambda v: {"type": "array", "items": v}),
                        "error: schemas nested more than 64 levels deep", (), ()),
    "anyof-3000-deep": (lambda: nested_schema(3000, lambda v: {"anyOf": [v]}),
                        "error: schemas nested more than 64 levels deep", (), ()),
    # the grammar exists; matching past "{" would meet the matcher's bound of 8192 ways at once
    "properties-10k-optional": (lambda: properties(10000, lambda i: False), "ok", (), ()),
    "properties-10k-required": (lambda: properties(10000, lambda i: True), "ok", (), ('{"p0": 1}', '{}')),
    # 5000 optional members on either side of the required one: 5001 ways on at once (a comma
    # after a member, followed by any of thousands and by three kinds of space, would be more
    # than the matcher's 8192)
    "properties-10k-one-required": (lambda: properties(10000, lambda i: i == 5000), "ok",
                                    ('{"p5000": 1}',), ('{"p0": 1}', '{}', '{"p5000": "x"}')),
    # names the rules cannot use (all made "root-..."): numbering them must not rescan the taken ones
    "properties-10k-non-ascii-names": (lambda: properties(10000, lambda i: i == 5000, lambda i: chr(0x4E00 + i)),
                                       "ok", ('{"\u6188": 7}',), ('{"\u6188": "x"}', '{"\u4e00": 1}')),
    "const-5000-deep": (lambda: {"const": _deep_value(5000)}, "error: nested too deep to write out", (), ()),
}
