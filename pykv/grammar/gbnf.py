"""Grammar-constrained generation with llama.cpp's GBNF grammars, as llama-cpp-python's
LlamaGrammar: generate(grammar=...) then only samples tokens whose text continues a match of
the grammar, and ends generation only where the text is a complete match.

    grammar = LlamaGrammar.from_string('root ::= "yes" | "no"')
    llm.generate("Is the sky blue? ", grammar=grammar)
    llm.create_chat_completion(messages, response_format={"type": "json_object"})

The matcher is C (native/src/sample/grammar.c); this module parses up front (so a bad grammar is
refused where it is written) and binds a grammar to a model's vocabulary for one generation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from .. import errors
from .._ffi import check, ffi, lib

# Any JSON object (llama-cpp-python's response_format={"type": "json_object"}): the JSON
# grammar of RFC 8259 with whitespace between tokens bounded to one space, or one newline and
# up to 12 indentation characters (six levels of two-space indentation), so that a model can
# lay a value out but cannot pad a finished one into max_tokens.
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | boolean | null
object ::= "{" ws ( member ( "," ws member )* )? "}" ws
member ::= string ":" ws value
array  ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" char* "\"" ws
char   ::= [^"\\\x00-\x1F\x7F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )? ws
integer ::= "-"? ( "0" | [1-9] [0-9]{0,15} )
boolean ::= ( "true" | "false" ) ws
null   ::= "null" ws
ws     ::= ( " " | "\n" [ \t]{0,12} )?
"""


class LlamaGrammar:
    """A GBNF grammar, checked when made; `text` is its source and `root` its start rule."""

    def __init__(self, text: str, root: str = "root"):
        if not isinstance(text, str):
            raise errors.InvalidArgumentError(f"a grammar is GBNF text, got {type(text).__name__}")
        self.text = text
        self.root = root
        lib.pykv_grammar_free(_c_grammar(ffi.NULL, self))   # parsed now: a mistake is refused here

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        return cls(grammar)

    @classmethod
    def from_file(cls, file: Union[str, Path], verbose: bool = True) -> "LlamaGrammar":
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as e:
            raise errors.InvalidArgumentError(f"cannot read grammar file {file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise errors.InvalidArgumentError(f"grammar file {file} is not UTF-8 text") from None
        return cls(text)

    @classmethod
    def from_json_schema(cls, json_schema: Union[str, dict], verbose: bool = True) -> "LlamaGrammar":
        """JSON text that validates against json_schema (a dict or its JSON text); see
        pykv.grammar.json_schema for what of JSON Schema is followed."""
        from .json_schema import schema_to_gbnf
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as e:
                raise errors.InvalidArgumentError(f"the JSON schema is not JSON: {e}") from None
            except RecursionError:
                raise errors.InvalidArgumentError("the JSON schema nests too deep to read") from None
        return cls(schema_to_gbnf(json_schema))

    def __repr__(self) -> str:
        return f"LlamaGrammar({self.text!r})"


def as_grammar(grammar: Union[None, str, LlamaGrammar]) -> Optional[LlamaGrammar]:
    """grammar as a LlamaGrammar: GBNF text is parsed; None stays None."""
    if grammar is None or isinstance(grammar, LlamaGrammar):
        return grammar
    return LlamaGrammar(grammar)


def response_format_grammar(response_format) -> Optional[LlamaGrammar]:
    """The grammar OpenAI's response_format asks for: {"type": "text"} none, {"type":
    "json_object"} any JSON object, or with "schema" that schema's; {"type": "json_schema",
    "json_schema": {"schema": ...}} the schema's."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise errors.InvalidArgumentError('response_format must be an object with a "type"')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return LlamaGrammar(JSON_GBNF) if schema is None else LlamaGrammar.from_json_schema(schema)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise errors.InvalidArgumentError('response_format "json_schema" needs {"json_schema": {"schema": ...}}')
        return LlamaGrammar.from_json_schema(spec["schema"])
    raise errors.InvalidArgumentError(
        f'response_format type {kind!r} is not one of "text", "json_object", "json_schema"')


def _c_grammar(model, grammar: LlamaGrammar):
    """pykv_grammar_init's handle (model NULL: the text checked only); the caller frees it."""
    handle = ffi.new("pykv_grammar **")
    check(lib.pykv_grammar_init(model, grammar.text.encode("utf-8"), grammar.root.encode("utf-8"), handle))
    return handle[0]


def bind(model, grammar: LlamaGrammar):
    """The C matcher of grammar over model's vocabulary (a pykv_model handle), at its start."""
    return ffi.gc(_c_grammar(model, grammar), lib.pykv_grammar_free)
