"""JSON Schemas as grammars (LlamaGrammar.from_json_schema, response_format): the grammar
accepts a JSON text exactly when the `jsonschema` validator does (texts written with the
properties in the schema's order, enum strings as written), checked byte by byte through the C
matcher; SmolLM2's
constrained replies validate; what cannot be followed is refused by name."""
from __future__ import annotations

import json

import jsonschema
import pytest

from _compare import EXACT
from _tiny_models import grammar_takes
from pykv import InvalidArgumentError, Llama, LlamaGrammar
from pykv.grammar import JSON_GBNF, bind

PERSON = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
LIST = {"$defs": {"node": {"type": "object", "required": ["v", "next"], "properties": {
    "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
    "$ref": "#/$defs/node"}

# (schema, JSON texts to try: the validator decides which are valid)
CASES = [
    (PERSON, ['{"name": "x"}', '{"name": "x", "age": 3}', '{"name": "\\u00e9t\\u00e9", "tags": ["a", "b"]}',
              '{"name":"x","age":-12,"tags":[]}', '{}', '{"age": 3}', '{"name": "123456789"}',
              '{"name": "x", "tags": ["c"]}', '{"name": "x", "tags": ["a", "a", "a"]}', '{"name": 1}',
              '{"name": "x", "age": 1.5}', '{"name": "x",}']),
    (LIST, ['{"v": 1, "next": null}', '{"v": 1, "next": {"v": 2, "next": null}}', '{"v": 1}',
            '{"v": 1, "next": {"v": 2}}', '{"v": true, "next": null}']),
    ({"properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}},
     ['{}', '{"a": true}', '{"b": null}', '{"a": false, "b": null}', '{,}', '{"a": true,}', '{"b": 1}']),
    ({"type": "object", "additionalProperties": {"type": "integer"}},
     ['{"x": 1, "y": 2}', '{}', '{"x": "s"}', '{"x": 1.5}']),
    ({"type": "array", "items": {"type": "number"}, "minItems": 2},
     ['[1, 2.5]', '[1e3, -2, 0]', '[1]', '[]', '[1, "2"]', '[01, 2]']),
    ({"anyOf": [{"type": "string", "minLength": 2}, {"type": ["boolean", "null"]}, {"const": {"k": [1]}}]},
     ['"ab"', '"a"', 'true', 'null', '{"k": [1]}', '{"k": [2]}', '3']),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
     ['["a", 1]', '["a", "b"]']),
    (True, ['{"a": [1, {"b": null}]}', '"s"', '-0.5e-3', '[1,]']),
    ({"enum": ["\u00e9t\u00e9", 'a"b', 3]}, ['"\u00e9t\u00e9"', '"a\\"b"', '3', '"ete"', '4']),
    ({"type": "integer", "minimum": 18, "maximum": 99}, ['17', '18', '50', '99', '100', '-18', '018', '1.5']),
    ({"type": "integer", "exclusiveMinimum": -10.5, "exclusiveMaximum": 0}, ['-10', '-11', '-1', '0', '-0', '3']),
    ({"type": ["integer", "null"], "minimum": 1000}, ['1000', '999', 'null', '123456', '-1000']),
]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    with Llama(str(tiny_model()), n_ctx=128, **EXACT) as llm:
        yield llm


@pytest.mark.parametrize("schema,texts", CASES, ids=[f"schema{i}" for i in range(len(CASES))])
def test_grammar_accepts_what_the_validator_accepts(tiny_llm, schema, texts):
    matcher = bind(tiny_llm._model, LlamaGrammar.from_json_schema(schema))
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema if schema is not True else {})
            valid = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            valid = False
        assert grammar_takes(matcher, text) == valid, text


# (minimum, maximum): both bounds, one, either sign, digits of every length in between
INTEGER_BOUNDS = [(0, 9), (7, 7), (-5, 1234), (-999, -100), (-70, 0), (3, 100000), (1999, 2001), (450, None),
                  (None, -38), (None, 0), (-1, None), (10 ** 20, 10 ** 20 + 15)]


@pytest.mark.parametrize("lo,hi", INTEGER_BOUNDS, ids=[f"{lo}..{hi}" for lo, hi in INTEGER_BOUNDS])
def test_integer_bounds_take_what_the_validator_takes(tiny_llm, lo, hi):
    """Every integer near the bounds and near each power of ten, as written and with a
    leading zero, and -0: the grammar takes a text exactly when the validator does."""
    schema = {"type": "integer", **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}
    matcher = bind(tiny_llm._model, LlamaGrammar.from_json_schema(schema))
    near = {v + d for v in (0, lo, hi) if v is not None for d in range(-12, 13)}
    near |= {s * 10 ** k + d for s in (1, -1) for k in range(1, 7) for d in (-1, 0, 1)}
    texts = {str(v) for v in near} | {"0" + str(v) for v in near if v > 0} | {"-0", "-00", "00"}
    for text in sorted(texts):
        try:
            valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        except json.JSONDecodeError:   # a leading zero
            valid = False
        assert grammar_takes(matcher, text) == valid, text


def test_an_open_integer_bound_stops_at_16_digits(tiny_llm):
    """As JSON_GBNF's integer does, so a model cannot write digits forever; a bound with more
    digits than that is followed to its own length."""
    open_above = bind(tiny_llm._model, LlamaGrammar.from_json_schema({"type": "integer", "minimum": 5}))
    assert grammar_takes(open_above, "9" * 16) and not grammar_takes(open_above, "1" + "0" * 16)
    long_low = bind(tiny_llm._model, LlamaGrammar.from_json_schema({"type": "integer", "minimum": 10 ** 18}))
    assert grammar_takes(long_low, "1" + "0" * 18) and grammar_takes(long_low, "9" * 19)
    assert not grammar_takes(long_low, "9" * 18) and not grammar_takes(long_low, "1" + "0" * 19)


def test_json_gbnf_takes_json_objects(tiny_llm):
    matcher = bind(tiny_llm._model, LlamaGrammar(JSON_GBNF))
    for text, ok in [('{"a": [1, 2.5e-3, "x\\n\\u00e9", true, null, {}]}', True), ('{}', True),
                     ('[1]', False), ('{"a": 01}', False), ('{"a": "\x01"}', False), ("{'a': 1}", False)]:
        assert grammar_takes(matcher, text) == ok, text


def test_refused_schemas():
    for schema, needle in [({"type": "string", "pattern": "^a"}, "'pattern' is not supported"),
                           ({"allOf": [{"type": "string"}]}, "'allOf' is not supported"),
                           ({"$ref": "http://x/y"}, "not a local"),
                           ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required"),
                           ({"type": "array", "minItems": -1}, "minItems"),
                           ({"type": "array", "minItems": 3, "maxItems": 1}, "below"),
                           ({"type": "date"}, "unknown type"),
                           ({"enum": []}, "non-empty"),
                           ({"type": "number", "minimum": 0}, "'minimum' is followed on integers only"),
                           ({"maximum": 3}, "without \"type\": \"integer\""),
                           ({"type": "integer", "enum": [1, 5], "maximum": 3}, "next to 'enum'"),
                           ({"type": "integer", "minimum": 2.5, "maximum": 2.9}, "no integer lies"),
                           ({"type": "integer", "exclusiveMinimum": True}, "finite number"),
                           ({"type": "integer", "maximum": float("nan")}, "finite number"),
                           ({"type": "integer", "multipleOf": 2}, "'multipleOf' is not supported"),
                           ("{not json", "not JSON")]:
        with pytest.raises(InvalidArgumentError, match=needle):
            LlamaGrammar.from_json_schema(schema)


def test_response_format_refusals(tiny_llm):
    messages = [{"role": "user", "content": "hi"}]
    for fmt, needle in [({"type": "xml"}, "not one of"), ("json", "object with"),
                        ({"type": "json_schema"}, "json_schema")]:
        with pytest.raises(InvalidArgumentError, match=needle):
            tiny_llm.create_chat_completion(messages, response_format=fmt)
    with pytest.raises(InvalidArgumentError, match="not both"):
        tiny_llm.create_chat_completion(messages, response_format={"type": "json_object"}, grammar='root ::= "x"')


@pytest.mark.model
def test_smollm2_replies_in_the_schema(smollm2_path):
    schema = {"type": "object", "required": ["name", "age", "colors"], "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 1, "maximum": 30},
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}}
    messages = [{"role": "user", "content": "Invent a cat: its name, age and favourite colors, as JSON."}]
    with Llama(str(smollm2_path), n_ctx=512, n_threads=2) as llm:
        for fmt in ({"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
                    {"type": "json_object", "schema": schema}):
            reply = llm.create_chat_completion(messages, temperature=0, max_tokens=120, response_format=fmt)
            assert reply["choices"][0]["finish_reason"] == "stop"
            jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)
        # Sampled, this small model often repeats itself until max_tokens (measured: 8 of 40
        # seeds end within 200 tokens at temperature 0.7, 8 of 20 with repeat_penalty 1.3):
        # a reply that ends is an object. Seeds are tried until one ends.
        for seed in range(3, 13):
            reply = llm.create_chat_completion(messages, temperature=0.7, repeat_penalty=1.3, seed=seed,
                                               max_tokens=200, response_format={"type": "json_object"})
            if reply["choices"][0]["finish_reason"] == "stop":
                break
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(reply["choices"][0]["message"]["content"]), dict)
