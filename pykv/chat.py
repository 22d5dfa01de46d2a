"""Chat prompts: a model's chat template (GGUF `tokenizer.chat_template`, Jinja2) rendered in a
sandbox, with the variables and helpers that transformers' apply_chat_template gives templates.
A model without a template gets ChatML, llama.cpp's fallback.
"""
from __future__ import annotations

import json
import time
from datetime import datetime
from typing import List, Optional, Sequence

from . import errors

# What one rendering of a template may do, as the sandbox bounds what it may reach: loop
# iterations and calls (macros, filters called as functions, range) together, seconds, and
# characters of output (far more than any context holds). A template beyond them is refused
# with InvalidArgumentError instead of running for minutes.
MAX_TEMPLATE_STEPS = 1_000_000
MAX_TEMPLATE_SECONDS = 10.0
MAX_TEMPLATE_CHARS = 16 << 20

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def check_messages(messages) -> List[dict]:
    """OpenAI-style messages as plain dicts: a role and text content each (content given as a
    list of text parts is joined, as chat servers do)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise errors.InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise errors.InvalidArgumentError(f"message {i} needs a 'role' string, got {m!r}")
        content = m.get("content")
        if isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise errors.InvalidArgumentError(f"message {i}: only text content parts are supported")
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise errors.InvalidArgumentError(f"message {i}: 'content' must be text, got {type(content).__name__}")
        out.append(dict(m, content=content))
    return out


def _raise_exception(message):
    raise errors.InvalidArgumentError(f"the chat template refused the messages: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


class _Budget:
    """The work one rendering has done: each loop iteration and call is a step."""

    def __init__(self):
        self.steps = 0
        self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_TEMPLATE_STEPS:
            raise errors.InvalidArgumentError(f"the chat template does too much work: more than {MAX_TEMPLATE_STEPS} "
                                              "loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise errors.InvalidArgumentError(f"the chat template ran for more than {MAX_TEMPLATE_SECONDS:g} seconds")

    def counted(self, iterable):
        """The items of a template's for loop, each a step."""
        for item in iterable:
            self.step()
            yield item


_COUNTED = "__pykv_counted"   # the global that every for loop of a template iterates through


def _bounded_environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with a budget (a fresh one per rendering: see _environment): calls
        and for loops take steps, and '*' may not build a string or list longer than the
        output may be."""
        intercepted_binops = frozenset(["*"])

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
            __self.budget.step()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_CHARS:
                    raise errors.InvalidArgumentError(f"the chat template builds a value longer than "
                                                      f"{MAX_TEMPLATE_CHARS} with '*'")
            return super().call_binop(context, operator, left, right)

        def _parse(self, source, name, filename):
            """The template's tree with every for loop iterating through the budget."""
            from jinja2 import nodes
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Call(nodes.Name(_COUNTED, "load", lineno=loop.lineno), [loop.iter], [], None, None,
                                       lineno=loop.lineno)
            return tree

    return BoundedEnvironment


def _environment():
    from jinja2.ext import loopcontrols

    # trim_blocks/lstrip_blocks as transformers renders: templates are written for them
    env = _bounded_environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.budget = _Budget()
    env.globals[_COUNTED] = env.budget.counted
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


TEMPLATE_NAMES = {"chatml": CHATML}


def resolve_template(template: str) -> str:
    """A chat template given by the user: Jinja2 text, or a name of TEMPLATE_NAMES; checked to
    parse, so that a mistake is refused before any chat."""
    import jinja2

    if not isinstance(template, str) or not template:
        raise errors.InvalidArgumentError(f"a chat template is Jinja2 text or a name, got {template!r}")
    if template in TEMPLATE_NAMES:
        return TEMPLATE_NAMES[template]
    if "{" not in template:   # a bare word would render as itself: a name pykv does not know
        raise errors.InvalidArgumentError(
            f"unknown chat template name {template!r}: give Jinja2 text or one of {sorted(TEMPLATE_NAMES)}")
    try:
        _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise errors.InvalidArgumentError(f"the chat template does not parse: line {exc.lineno}: {exc.message}") \
            from None
    return template


def render(template: Optional[str], messages, *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, **extra) -> str:
    """The prompt text for messages: template (CHATML when None) rendered in a Jinja2 sandbox.
    A template that fails to parse, reaches outside the sandbox, raises or does more work
    than MAX_TEMPLATE_STEPS, MAX_TEMPLATE_SECONDS and MAX_TEMPLATE_CHARS allow gives
    InvalidArgumentError."""
    import jinja2

    messages = check_messages(messages)
    try:
        compiled = _environment().from_string(template if template is not None else CHATML)
        pieces, n_chars = [], 0
        for piece in compiled.generate(messages=messages, bos_token=bos_token, eos_token=eos_token,
                                       add_generation_prompt=add_generation_prompt, **extra):
            n_chars += len(piece)
            if n_chars > MAX_TEMPLATE_CHARS:
                raise errors.InvalidArgumentError(f"the chat template writes more than {MAX_TEMPLATE_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    except errors.PykvError:
        raise
    except jinja2.TemplateError as exc:
        raise errors.InvalidArgumentError(f"the chat template cannot be rendered: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a template's own error (a bad operand, a missing key)
        raise errors.InvalidArgumentError(
            f"the chat template cannot be rendered: {type(exc).__name__}: {exc}") from exc
