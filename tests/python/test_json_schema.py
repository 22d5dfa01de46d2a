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
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
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
