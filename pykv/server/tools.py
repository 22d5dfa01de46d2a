"""Function calling in chat completions: OpenAI's "tools" and "tool_choice" (and the older
"functions" and "function_call"), as llama-cpp-python and llama-server take them.

A call is the JSON object {"name": <a tool's name>, "arguments": <its arguments>}, the form
most chat models are trained on. How the tools reach the model: a chat template that reads
`tools` gets them; for one that does not, they are described in the system message.

- tool_choice "none": the tools are shown, the reply is text.
- a named function ({"type": "function", "function": {"name": ...}}) or "required": the
  reply is constrained by a grammar to a call of that function (of one of the tools), its
  arguments following the function's "parameters" schema; it comes back as "tool_calls".
- "auto" (the default with tools): the model chooses. A reply that is a call, a list of calls
  or calls inside <tool_call>...</tool_call> tags, naming given tools with object arguments,
  comes back as "tool_calls"; anything else as text.

A call cut short (max_tokens reached, a stop string, the context full) is never handed back as
"tool_calls" with arguments that do not parse: the whole reply comes back as the message's
"content", the text as generated, with the finish_reason that cut it ("length" for
max_tokens), as for any other reply that is not a complete call. A stream sends a bound call's
arguments as they are generated, as OpenAI's stream does; one cut short ends with that
finish_reason, never "tool_calls", and its argument deltas then join to incomplete JSON.
The grammar's whitespace between JSON tokens is one space, or one newline and a little
indentation (pykv.grammar.JSON_GBNF), so a finished call cannot be padded up to max_tokens.
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from typing import List, Optional, Tuple

from .. import errors
from ..grammar.gbnf import LlamaGrammar

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tools(tools, functions) -> Optional[List[dict]]:
    """The tools as [{"type": "function", "function": {"name", "description"?, "parameters"}}];
    legacy functions ([{"name", ...}]) become tools. None when neither is given."""
    if tools is not None and functions is not None:
        raise errors.InvalidArgumentError("give tools or functions, not both")
    if functions is not None:
        if not isinstance(functions, list):
            raise errors.InvalidArgumentError("functions must be a list of {'name': ..., 'parameters': ...}")
        tools = [{"type": "function", "function": f} for f in functions]
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise errors.InvalidArgumentError("tools must be a non-empty list of {'type': 'function', 'function': ...}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise errors.InvalidArgumentError(f"tool {i} must be {{'type': 'function', 'function': {{...}}}}")
        fn = dict(tool["function"])
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise errors.InvalidArgumentError(
                f"tool {i}: the function name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise errors.InvalidArgumentError(f"tool {i}: the function name {name!r} is given twice")
        names.add(name)
        params = fn.setdefault("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise errors.InvalidArgumentError(f"tool {name!r}: parameters must be a JSON schema object")
        out.append({"type": "function", "function": fn})
    return out


def choose(tools: Optional[List[dict]], tool_choice, function_call) -> Tuple[str, List[dict]]:
    """("none" | "auto" | "call", the tools a call may name). "call" constrains the reply to a
    call of one of those tools."""
    if tool_choice is not None and function_call is not None:
        raise errors.InvalidArgumentError("give tool_choice or function_call, not both")
    if isinstance(function_call, dict):   # the legacy form: "none", "auto" or {"name": ...}
        tool_choice = {"type": "function", "function": function_call}
    elif function_call is not None:
        tool_choice = function_call
    if tools is None:
        if tool_choice not in (None, "none"):
            raise errors.InvalidArgumentError("tool_choice needs tools")
        return "none", []
    if tool_choice is None or tool_choice == "auto":
        return "auto", tools
    if tool_choice == "none":
        return "none", tools
    if tool_choice == "required":
        return "call", tools
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name is None:
        raise errors.InvalidArgumentError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
            f"got {tool_choice!r}")
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise errors.InvalidArgumentError(f"tool_choice names {name!r}, which is not among the tools")
    return "call", chosen


def _namespaced(schema, prefix: str, defs: dict):
    """schema with its $defs moved into defs under prefix-NAME and its local $refs renamed to
    match, so that several tools' schemas can sit in one."""
    own = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            own.update(schema[key])
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rename(node):
        if isinstance(node, list):
            return [rename(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rename(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            m = re.fullmatch(r"#/(?:\$defs|definitions)/(.+)", ref)
            out["$ref"] = f"#/$defs/{prefix}" if ref == "#" else f"#/$defs/{prefix}-{m.group(1)}" if m else ref
        return out

    defs[prefix] = rename(body)   # what "#" referred to
    for key, sub in own.items():
        defs[f"{prefix}-{key}"] = rename(sub)
    return defs[prefix]


def call_grammar(tools: List[dict]) -> LlamaGrammar:
    """A grammar for one call {"name": ..., "arguments": ...} of one of tools."""
    defs: dict = {}
    options = [{"type": "object", "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": _namespaced(t["function"]["parameters"], f"tool{i}", defs)}}
               for i, t in enumerate(tools)]
    schema = dict(options[0] if len(options) == 1 else {"anyOf": options}, **{"$defs": defs})
    return LlamaGrammar.from_json_schema(schema)


@lru_cache(maxsize=8)   # asked on every chat prompt; a long template takes a while to parse
def template_reads_tools(template: Optional[str]) -> bool:
    """Whether a chat template renders `tools` itself (None: pykv's ChatML, which does not)."""
    if template is None:
        return False
    import jinja2
    from jinja2 import meta
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False   # the render refuses it with its own message


def _decoded(arguments):
    """A call's arguments given as JSON text (OpenAI's form), decoded; anything else as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return arguments


def _call_text(call) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    return json.dumps({"name": fn.get("name"), "arguments": _decoded(fn.get("arguments", {}))}, ensure_ascii=False)


def _tools_text(tools: List[dict]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (f"You can call these tools:\n{listing}\nTo call a tool, reply with only the JSON object "
            '{"name": <the tool\'s name>, "arguments": <its arguments>}.')


def prepare_messages(messages: List[dict], tools: Optional[List[dict]], template_tools: bool):
    """The messages as the template should see them. Earlier calls' arguments given as JSON
    text become objects, as templates are written for; a template that does not read tools gets
    them described in the system message, and earlier calls as their JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            if template_tools:
                m = dict(m, tool_calls=[_with_object_arguments(c) for c in calls])
            else:
                text = "\n".join(_call_text(c) for c in calls)
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
        out.append(m)
    if tools is None or template_tools:
        return out
    described = _tools_text(tools)
    if out and out[0].get("role") == "system":
        first = out[0].get("content") or ""
        return [dict(out[0], content=f"{first}\n\n{described}" if first else described)] + out[1:]
    return [{"role": "system", "content": described}] + out


def _with_object_arguments(call):
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    parsed = _decoded(args)
    if isinstance(args, str) and isinstance(parsed, dict):
        return dict(call, function=dict(call["function"], arguments=parsed))
    return call


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


def parse_calls(text: str, tools: List[dict]) -> Optional[List[Tuple[str, str]]]:
    """(name, arguments JSON) of each call when the whole reply is calls of given tools: one
    call object, a list of them, or calls inside <tool_call>...</tool_call>; else None."""
    names = {t["function"]["name"] for t in tools}
    text = text.strip()
    tagged = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S)
    if tagged and not re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip():
        blocks = tagged
    elif text.startswith(("{", "[")):
        blocks = [text]
    else:
        return None
    calls = []
    for block in blocks:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or call.get("name") not in names:
                return None
            args = _decoded(call.get("arguments", call.get("parameters")))
            if not isinstance(args, dict):
                return None
            calls.append((call["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def bound_call(text: str, finish_reason: str) -> Optional[Tuple[str, str]]:
    """(name, arguments JSON) of a grammar-bound call's reply when the call is complete (the
    generation stopped on its own and the arguments parse as an object); None when it was cut
    short, so that the reply goes back as text."""
    stream = CallStream()
    args = stream.push(text) + stream.finish(complete=finish_reason == "stop")
    if stream.name is None or finish_reason != "stop":
        return None
    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        return None
    return (stream.name, args) if isinstance(parsed, dict) else None


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_HELD = re.compile(r"[\s}]*\Z")


class CallStream:
    """Splits the text of a grammar-constrained call, as it arrives, into the function's name
    (once its "arguments" key has come) and the arguments' text. The call's closing brace
    cannot be told from the arguments' own until the end, so a trailing run of braces and
    whitespace is held back until more text or finish() comes."""

    def __init__(self):
        self.text = ""
        self.name: Optional[str] = None
        self.start = 0   # where the arguments begin in text
        self.sent = 0    # arguments' characters handed out so far

    def push(self, piece: str) -> str:
        """Adds piece; returns the arguments' text that is now certain (self.name is set first)."""
        self.text += piece
        if self.name is None:
            m = _HEAD.match(self.text)
            if m is None:
                return ""
            self.name, self.start = json.loads(m.group(1)), m.end()
            self.sent = self.start
        if self.sent == self.start:   # nothing sent yet: whitespace before the arguments is not theirs
            self.sent = self.start = len(self.text) - len(self.text[self.start:].lstrip())
        end = _HELD.search(self.text, self.sent).start()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self, complete: bool) -> str:
        """The rest of the arguments: without the call's closing brace when complete."""
        rest = self.text[self.sent:]
        if complete:
            rest = rest.rstrip()
            rest = rest[:-1].rstrip() if rest.endswith("}") else rest
        self.sent = len(self.text)
        return rest if self.name is not None else ""
