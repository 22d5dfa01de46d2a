"""A JSON Schema as a GBNF grammar (LlamaGrammar.from_json_schema, response_format's schemas).

Followed: "type" (one or a list; object, array, string, number, integer, boolean, null),
"properties" with "required" (properties come in the schema's order; optional ones may be
left out), "additionalProperties" as a schema when there are no "properties", "items",
"prefixItems", "minItems"/"maxItems", "minLength"/"maxLength", "minimum"/"maximum" and
"exclusiveMinimum"/"exclusiveMaximum" on integers, "enum", "const", "anyOf", "oneOf" and
local "$ref"s (#/$defs/..., #/definitions/..., recursion allowed). "enum" and
"const" values are written as JSON writes them, with non-ASCII characters as they are. Annotations
("title", "description", "default", "examples", "format") are ignored. Refused, by name:
what a grammar of this kind cannot follow ("pattern", "allOf", "not", "if", bounds on
numbers that may have fractions, "multipleOf"...),
rather than generating JSON the schema would reject."""
from __future__ import annotations

import json
import math
import re
from typing import Dict, List

from .. import errors
from .integer_range import integer_range
from .gbnf import JSON_GBNF

_UNSUPPORTED = ("pattern", "patternProperties", "allOf", "not", "if", "then", "else", "dependentSchemas",
                "dependentRequired", "multipleOf",
                "minProperties", "maxProperties", "uniqueItems", "contains", "propertyNames",
                "unevaluatedProperties", "unevaluatedItems")
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_MAX_REPEAT = 4096   # the C parser's bound on {m,n}
_MAX_DEPTH = 64      # schemas inside schemas (properties, items, anyOf, $ref...): far past real ones,
                     # far inside Python's recursion limit (each level is a few frames)


def literal(json_text: str) -> str:
    """A GBNF string literal matching json_text exactly (JSON text has no raw control characters)."""
    return '"' + json_text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _generic_rules() -> Dict[str, str]:
    """The rules of JSON_GBNF but root: any JSON value, for schemas that do not narrow it."""
    rules = {}
    for line in JSON_GBNF.strip().splitlines():
        name, body = line.split("::=", 1)
        if name.strip() != "root":
            rules[name.strip()] = body.strip()
    return rules


class _Converter:
    def __init__(self, schema):
        self.top = schema
        self.rules: Dict[str, str] = _generic_rules()   # any JSON value, and the pieces of one
        self.refs: Dict[str, str] = {}
        self.suffix: Dict[str, int] = {}   # per name, the last numbered variant tried
        self.depth = 0                     # schemas being visited, one inside the next

    def add(self, name: str, body: str) -> str:
        name = re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "rule"
        unique, i = name, self.suffix.get(name, 1)   # numbering goes on where it stopped: linear in the rules
        while unique in self.rules:
            i += 1
            unique = f"{name}-{i}"
        self.suffix[name] = i
        self.rules[unique] = body
        return unique

    def ref(self, target: str) -> str:
        if target in self.refs:
            return self.refs[target]
        m = re.fullmatch(r"#/(\$defs|definitions)/(.+)", target)
        if target == "#":
            schema = self.top
        elif m and isinstance(self.top.get(m.group(1)), dict) and m.group(2) in self.top[m.group(1)]:
            schema = self.top[m.group(1)][m.group(2)]
        else:
            raise errors.InvalidArgumentError(f"JSON schema: $ref {target!r} is not a local #/$defs/... definition")
        name = self.add("ref-" + (m.group(2) if m else "root"), "")   # reserved first: it may refer to itself
        self.refs[target] = name
        self.rules[name] = self.visit(schema, name)
        return name

    def visit(self, schema, name: str) -> str:
        """A GBNF expression for the values schema allows (named rules added for the parts);
        refused past _MAX_DEPTH schemas inside one another (a RecursionError otherwise)."""
        if self.depth == _MAX_DEPTH:
            where = name if len(name) <= 80 else name[:40] + "..." + name[-37:]
            raise errors.InvalidArgumentError(
                f"JSON schema: {where}: schemas nested more than {_MAX_DEPTH} levels deep")
        self.depth += 1
        try:
            return self.visit_schema(schema, name)
        finally:
            self.depth -= 1

    def visit_schema(self, schema, name: str) -> str:
        if schema is True or schema == {}:
            return "value"
        if not isinstance(schema, dict):
            raise errors.InvalidArgumentError(f"JSON schema: {name}: a schema is an object or true, got {schema!r}")
        for key in _UNSUPPORTED:
            if key in schema:
                raise errors.InvalidArgumentError(f"JSON schema: {name}: {key!r} is not supported in grammars")
        self.check_bounds_apply(schema, name)
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return literal(json.dumps(schema["const"], ensure_ascii=False)) + " ws"
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise errors.InvalidArgumentError(f"JSON schema: {name}: enum must be a non-empty list")
            return "(" + " | ".join(literal(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]) + ") ws"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if not isinstance(schema[key], list) or not schema[key]:
                    raise errors.InvalidArgumentError(f"JSON schema: {name}: {key} must be a non-empty list")
                return self.alternatives(schema[key], name)
        kind = schema.get("type")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if isinstance(kind, list):   # each type once: repeats would multiply the work at every level
            kinds, seen = [], set()
            for k in kind:
                if not isinstance(k, str):
                    kinds.append(k)   # refused as an unknown type
                elif k not in seen:
                    seen.add(k)
                    kinds.append(k)
            return self.alternatives([dict(schema, type=k) for k in kinds], name)
        if kind is None:
            return "value"
        if kind not in _TYPES:
            raise errors.InvalidArgumentError(f"JSON schema: {name}: unknown type {kind!r}")
        if kind == "object":
            return self.object(schema, name)
        if kind == "array":
            return self.array(schema, name)
        if kind == "string":
            return self.string(schema, name)
        if kind == "integer":
            return self.integer(schema, name)
        return {"number": "number", "boolean": "boolean", "null": "null"}[kind]

    @staticmethod
    def check_bounds_apply(schema, name: str) -> None:
        """Numeric bounds are followed where the value can only be an integer (or a type they
        do not constrain): a number's bound has no finite grammar over fractions and exponents,
        and alongside enum, const, anyOf or $ref they would narrow a grammar made elsewhere."""
        bound = next((key for key in _NUMBER_BOUNDS if key in schema), None)
        if bound is None:
            return
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        other = next((key for key in ("$ref", "const", "enum", "anyOf", "oneOf") if key in schema), None)
        if other or "number" in kinds or None in kinds:
            why = f"next to {other!r}" if other else 'without "type": "integer"'
            raise errors.InvalidArgumentError(
                f"JSON schema: {name}: {bound!r} is followed on integers only, not {why}")

    def integer(self, schema, name: str) -> str:
        lo = hi = None
        for key, value in schema.items():
            if key not in _NUMBER_BOUNDS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= 1e308:
                raise errors.InvalidArgumentError(
                    f"JSON schema: {name}: {key} must be a finite number, at most 1e308 in magnitude")
            if key == "minimum" or key == "exclusiveMinimum":
                first = math.floor(value) + 1 if key == "exclusiveMinimum" else math.ceil(value)
                lo = first if lo is None else max(lo, first)
            else:
                last = math.ceil(value) - 1 if key == "exclusiveMaximum" else math.floor(value)
                hi = last if hi is None else min(hi, last)
        if lo is None and hi is None:
            return "integer ws"
        if lo is not None and hi is not None and lo > hi:
            raise errors.InvalidArgumentError(f"JSON schema: {name}: no integer lies within its bounds")
        return integer_range(lo, hi) + " ws"

    def alternatives(self, schemas: List, name: str) -> str:
        return "(" + " | ".join(self.add(f"{name}-{i}", self.visit(s, f"{name}-{i}"))
                                for i, s in enumerate(schemas)) + ")"

    def object(self, schema, name: str) -> str:
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return '"{" ws "}" ws'
            value = "value" if extra is True else self.add(f"{name}-value", self.visit(extra, f"{name}-value"))
            member = f'string ":" ws {value}'
            return f'"{{" ws ( {member} ( "," ws {member} )* )? "}}" ws'
        if not isinstance(props, dict):
            raise errors.InvalidArgumentError(f"JSON schema: {name}: properties must be an object")
        required = schema.get("required", [])
        unknown = [r for r in required if r not in props]
        if unknown:
            raise errors.InvalidArgumentError(f"JSON schema: {name}: required {unknown} not among the properties")
        members = [(literal(json.dumps(key, ensure_ascii=False)) + ' ws ":" ws ' +
                    self.add(f"{name}-{key}", self.visit(sub, f"{name}-{key}")), key in required)
                   for key, sub in props.items()]
        # rest(i, first): members i.. in order, the optional ones may be missing; commas only
        # between members present. One rule per (i, first), so the size stays linear. Made from
        # the last member back, so a rule's successors exist before it (no recursion over the
        # properties): rest(k, True) is needed up to the first required member k, rest(i, False)
        # from 1 on.
        rest_names: Dict[tuple, str] = {}

        def rest(i: int, first: bool) -> str:
            return rest_names[(i, first)] if i < len(members) else ""

        def make_rest(i: int, first: bool) -> None:
            member, needed = members[i]
            lead = "" if first else '"," ws '
            if needed:
                body = f"{lead}{member} {rest(i + 1, False)}"
            elif first:
                alone = rest(i + 1, True)   # this member left out: the next one is first
                body = f"{member} {rest(i + 1, False)}" + (f" | {alone}" if alone else "")
                body = body if alone else f"( {body} )?"
            else:
                body = f"( {lead}{member} )? {rest(i + 1, False)}"
            rest_names[(i, first)] = self.add(f"{name}-rest-{i}{'-first' if first else ''}", body)

        if members:
            k = next((i for i, (_, needed) in enumerate(members) if needed), len(members) - 1)
            for i in range(len(members) - 1, k, -1):
                make_rest(i, False)
            make_rest(k, True)
            for i in range(k - 1, -1, -1):
                make_rest(i + 1, False)
                make_rest(i, True)
        return f'"{{" ws {rest(0, True)} "}}" ws'

    def array(self, schema, name: str) -> str:
        lo, hi = self.bounds(schema, "minItems", "maxItems", name)
        prefix = schema.get("prefixItems")
        if prefix is not None:
            parts = [self.add(f"{name}-{i}", self.visit(s, f"{name}-{i}")) for i, s in enumerate(prefix)]
            return '"[" ws ' + ' "," ws '.join(parts) + ' "]" ws' if parts else '"[" ws "]" ws'
        item = self.add(f"{name}-item", self.visit(schema.get("items", True), f"{name}-item"))
        if hi == 0:
            return '"[" ws "]" ws'
        more = f'( "," ws {item} )' + self.count(max(lo - 1, 0), None if hi is None else hi - 1)
        body = f"{item} {more}"
        return f'"[" ws {body} "]" ws' if lo >= 1 else f'"[" ws ( {body} )? "]" ws'

    def string(self, schema, name: str) -> str:
        lo, hi = self.bounds(schema, "minLength", "maxLength", name)
        return '"\\"" char' + self.count(lo, hi) + ' "\\"" ws'

    @staticmethod
    def count(lo: int, hi) -> str:
        if hi is None:
            return "*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"
        return f"{{{lo},{hi}}}"

    @staticmethod
    def bounds(schema, lo_key: str, hi_key: str, name: str):
        lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
        for key, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_REPEAT):
                raise errors.InvalidArgumentError(f"JSON schema: {name}: {key} must be an integer 0..{_MAX_REPEAT}")
        if hi is not None and hi < lo:
            raise errors.InvalidArgumentError(f"JSON schema: {name}: {hi_key} is below {lo_key}")
        return lo, hi


def schema_to_gbnf(schema) -> str:
    """GBNF text whose root matches the JSON texts schema allows (see the module's notes)."""
    conv = _Converter(schema)
    try:
        root = conv.visit(schema, "root")
    except RecursionError:   # past the depth bound: an enum or const value nested too deep for json.dumps
        raise errors.InvalidArgumentError("JSON schema: a value nested too deep to write out") from None
    conv.rules = {"root": root, **{k: v for k, v in conv.rules.items() if k != "root"}}
    return "".join(f"{name} ::= {body}\n" for name, body in conv.rules.items())
