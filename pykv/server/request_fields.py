"""The server's request bodies (pykv/server/http.py) checked field by field before any work: each
field has a type and a range, and one that is wrong is a 400 naming it, so that no request
reaches the model with a value it would answer with a 500 (an integer too large for C, a list
where a dict belongs) or that would run away (max_tokens -5, a 50 MB prompt)."""
from __future__ import annotations

import math

from ..grammar.gbnf import LlamaGrammar

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty",
             "presence_penalty", "logit_bias", "seed", "stop", "stream", "mirostat_mode", "mirostat_tau",
             "mirostat_eta", "typical_p")
FIELDS = {
    "/v1/completions": ("prompt",) + _SAMPLING + ("logprobs", "echo", "grammar", "json_schema", "suffix"),
    "/v1/chat/completions": ("messages",) + _SAMPLING + ("logprobs", "top_logprobs", "grammar", "response_format",
                                                         "tools", "tool_choice", "functions", "function_call"),
    "/v1/embeddings": ("input",),
    "/v1/tokenize": ("content", "add_special"),
    "/v1/detokenize": ("tokens",),
}
MAX_DEPTH = 100          # levels of nested JSON arrays and objects in a body
MAX_STOPS = 64           # strings in "stop"
_INT32 = (-(1 << 31), (1 << 31) - 1)
_FLOAT_MAX = 3.4028234663852886e38   # the largest float32: sampler parameters are C floats
_TOKEN_IDS = (0, _INT32[1])


class RequestError(Exception):
    """A request the server refuses: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _bad(name: str, what: str, value) -> RequestError:
    shown = repr(value)
    return RequestError(400, f"'{name}' must be {what}, got {shown if len(shown) <= 60 else shown[:57] + '...'}")


def _integer(name, value, low=_INT32[0], high=_INT32[1]):
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    if not low <= value <= high:
        raise _bad(name, f"an integer from {low} to {high}", value)
    return value


def _number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, "a number", value)
    if not (math.isfinite(value) and abs(value) <= _FLOAT_MAX):
        raise _bad(name, "a finite number", value)
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _string(name, value):
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _object(name, value):
    if not isinstance(value, dict):
        raise _bad(name, "a JSON object", value)
    return value


def _list(name, value):
    if not isinstance(value, list):
        raise _bad(name, "a list", value)
    return value


def _string_or_object(name, value):
    if not isinstance(value, (str, dict)):
        raise _bad(name, "a string or a JSON object", value)
    return value


def _token_ids(name, value, what="a list of token ids"):
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              and _TOKEN_IDS[0] <= t <= _TOKEN_IDS[1] for t in value):
        raise _bad(name, what, value)
    return value


def _max_tokens(name, value):
    """-1 (documented: until end of generation or a full context) or a count >= 0 (0 as
    llama-cpp-python: no limit either); the server clamps counts to the context."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    if value < -1:
        raise _bad(name, "-1 (no limit) or a number of tokens >= 0", value)
    return value


def _stop(name, value):
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad(name, "a string or a list of strings", value)
    if len(value) > MAX_STOPS:
        raise RequestError(400, f"'{name}' has {len(value)} strings, more than {MAX_STOPS}")
    return value


def _logit_bias(name, value):
    _object(name, value)
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(400, f"'{name}': {key!r} is not a token id") from None
        if not _TOKEN_IDS[0] <= token <= _TOKEN_IDS[1]:
            raise RequestError(400, f"'{name}': {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise RequestError(400, f"'{name}': the bias of token {key} must be a finite number, got {bias!r}")
    return value


def _prompt(name, value):
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        return _token_ids(name, value, "a string or a non-empty list of token ids")
    raise _bad(name, "a string or a non-empty list of token ids", value)


def _embedding_input(name, value):
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
        return value
    raise _bad(name, "a string or a non-empty list of strings", value)


def _json_schema(name, value):
    if not isinstance(value, (dict, bool)):
        raise _bad(name, "a JSON schema (an object or a boolean)", value)
    return value


def _seed(name, value):
    return _integer(name, value, -(1 << 63), (1 << 64) - 1)


def _count(name, value):
    return _integer(name, value, 0, _INT32[1])


_CHECKS = {
    "prompt": _prompt, "messages": lambda _name, value: value,   # chat's check_messages says what is wrong
    "input": _embedding_input, "content": _string, "add_special": _flag,
    "tokens": _token_ids,
    "max_tokens": _max_tokens, "temperature": _number, "top_p": _number, "min_p": _number, "top_k": _integer,
    "repeat_penalty": _number, "frequency_penalty": _number, "presence_penalty": _number,
    "logit_bias": _logit_bias, "seed": _seed, "stop": _stop, "stream": _flag, "mirostat_mode": _integer,
    "mirostat_tau": _number, "mirostat_eta": _number, "typical_p": _number,
    "logprobs": _count, "top_logprobs": _count, "echo": _flag, "grammar": _string, "json_schema": _json_schema,
    "suffix": _string, "response_format": _object, "tools": _list, "functions": _list,
    "tool_choice": _string_or_object, "function_call": _string_or_object,
}


def nesting_depth_exceeds(obj, limit: int = MAX_DEPTH) -> bool:
    """Whether obj (parsed JSON) nests arrays and objects deeper than limit levels; iterative,
    so that the check itself cannot run out of stack."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _text_size(value) -> int:
    """The characters of every string in value (a prompt, messages, embedding input), keys of
    objects included; a token id counts as one."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            total += 1
    return total


def request_arguments(path: str, body, max_prompt_chars: int, n_ctx: int) -> dict:
    """The method's keyword arguments from a request body; RequestError (a 400 naming the
    field) for what cannot be. Fields the path does not take are ignored, null ones take the
    method's default; max_tokens above n_ctx is cut to n_ctx (a context cannot hold more)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    required = FIELDS[path][0]
    if body.get(required) is None:
        raise RequestError(400, f"'{required}' is required")
    if body.get("n", 1) != 1:
        raise RequestError(400, "only n=1 is supported")
    if body.get("stream_options") is not None:
        _object("stream_options", body["stream_options"])
    body = dict(body)
    if "mirostat" in body and "mirostat_mode" not in body:   # llama-server's name
        body["mirostat_mode"] = body["mirostat"]
    kwargs = {k: body[k] for k in FIELDS[path] if k in body and body[k] is not None}
    if path == "/v1/chat/completions" and "logprobs" in kwargs:
        _flag("logprobs", kwargs["logprobs"])   # chat's is a flag, with top_logprobs the count
    for name, value in kwargs.items():
        if not (path == "/v1/chat/completions" and name == "logprobs"):
            _CHECKS[name](name, value)
    size = _text_size(kwargs[required]) + (len(kwargs["suffix"]) if "suffix" in kwargs else 0)
    if size > max_prompt_chars:
        raise RequestError(400, f"'{required}' is longer than this server takes: {size} characters, more than "
                                f"{max_prompt_chars} (pykv serve --max-prompt-chars)")
    if kwargs.get("max_tokens", 0) > n_ctx:
        kwargs["max_tokens"] = n_ctx
    if "json_schema" in kwargs:   # llama-server's: JSON that the schema allows
        if "grammar" in kwargs:
            raise RequestError(400, "give 'grammar' or 'json_schema', not both")
        kwargs["grammar"] = LlamaGrammar.from_json_schema(kwargs.pop("json_schema"))
    return kwargs
