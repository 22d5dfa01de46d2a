"""Chat prompts: a model's chat template (GGUF `tokenizer.chat_template`, Jinja2) rendered in a
sandbox, with the variables and helpers that transformers' apply_chat_template gives templates.
A model without a template gets ChatML, llama.cpp's fallback.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import List, Optional, Sequence

from . import errors

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


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # trim_blocks/lstrip_blocks as transformers renders: templates are written for them
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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
    A template that fails to parse, reaches outside the sandbox or raises gives
    InvalidArgumentError."""
    import jinja2

    messages = check_messages(messages)
    try:
        compiled = _environment().from_string(template if template is not None else CHATML)
        return compiled.render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=add_generation_prompt, **extra)
    except errors.PykvError:
        raise
    except jinja2.TemplateError as exc:
        raise errors.InvalidArgumentError(f"the chat template cannot be rendered: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a template's own error (a bad operand, a missing key)
        raise errors.InvalidArgumentError(
            f"the chat template cannot be rendered: {type(exc).__name__}: {exc}") from exc
