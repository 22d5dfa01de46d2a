"""The types of generate()'s, create_completion()'s and create_chat_completion()'s arguments,
checked where they come in: a wrong one is a TypeError that names it (max_tokens="5"), not
an error from deep inside the sampler or the generation loop. Values of the right type but
out of range are left to the checks that know the range (the C sampler, check_n_logprobs)."""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import numpy as np


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _flag(value) -> bool:
    return isinstance(value, (bool, np.bool_)) or (_integer(value) and value in (0, 1))


def _text(value) -> bool:
    return isinstance(value, str)


def _stop(value) -> bool:
    return isinstance(value, str) or (isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray))
                                      and all(isinstance(s, str) for s in value))


def _prompt(value) -> bool:
    if isinstance(value, (str, bytes)):
        return True
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
    return isinstance(value, Sequence) and all(_integer(t) for t in value)


def _mapping(value) -> bool:
    return isinstance(value, Mapping)


# name: (test, what it must be, whether None is allowed)
_KINDS = {
    "prompt": (_prompt, "a string, bytes or a sequence of token ids", False),
    "max_tokens": (_integer, "an integer", True),
    "top_k": (_integer, "an integer", False),
    "repeat_last_n": (_integer, "an integer", False),
    "seed": (_integer, "an integer", True),
    "mirostat_mode": (_integer, "an integer (0, 1 or 2)", False),
    "prompt_logprobs": (_integer, "an integer", True),
    "top_logprobs": (_integer, "an integer", True),
    "temperature": (_real, "a number", False),
    "top_p": (_real, "a number", False),
    "min_p": (_real, "a number", False),
    "typical_p": (_real, "a number", False),
    "repeat_penalty": (_real, "a number", False),
    "frequency_penalty": (_real, "a number", False),
    "presence_penalty": (_real, "a number", False),
    "mirostat_tau": (_real, "a number", False),
    "mirostat_eta": (_real, "a number", False),
    "stream": (_flag, "True or False", False),
    "echo": (_flag, "True or False", False),
    "ignore_eos": (_flag, "True or False", False),
    "stop": (_stop, "a string or a list of strings", True),
    "logit_bias": (_mapping, "a dict {token id: bias}", True),
    "suffix": (_text, "a string", True),
}
# the same name with another type in one method: (method, name) -> kind
_METHOD_KINDS = {
    ("create_chat_completion", "logprobs"): (_flag, "True or False", True),
    ("generate", "logprobs"): (_integer, "an integer", True),
    ("create_completion", "logprobs"): (_integer, "an integer", True),
}


def check_argument_types(method: str, arguments: Mapping) -> None:
    """TypeError for the first of arguments (a method's locals(), at its start) whose type is
    not what method takes; names it does not know are left alone."""
    for name, value in arguments.items():
        kind = _METHOD_KINDS.get((method, name)) or _KINDS.get(name)
        if kind is None:
            continue
        test, what, optional = kind
        if value is None and optional:
            continue
        if not test(value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise TypeError(f"{method}(): '{name}' must be {what}{' or None' if optional else ''}, "
                            f"got {type(value).__name__} {shown}")
