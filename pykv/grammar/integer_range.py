"""GBNF for the JSON integers between two bounds (a JSON Schema's minimum and maximum).

The digit strings are split by length; a range within one length is written digit by digit:
the shared leading digits, then the first digit's own value followed by the rest up to 9...9,
the digits strictly between followed by anything, and the last digit's value followed by
0...0 up to the rest. Negative integers are "-" and a magnitude range. An open side stops at
16 digits, as JSON_GBNF's `integer` does, so a model cannot write digits forever."""
from __future__ import annotations

from typing import List, Optional

OPEN_DIGITS = 16


def _digits(lo: int, hi: int) -> str:
    return f'"{lo}"' if lo == hi else f"[{lo}-{hi}]"


def _same_length(a: str, b: str) -> str:
    """The digit strings of len(a) == len(b) from a to b (a <= b; leading zeros taken as written)."""
    common = 0
    while common < len(a) and a[common] == b[common]:
        common += 1
    if common == len(a):
        return f'"{a}"'
    head = f'"{a[:common]}" ' if common else ""
    a, b = a[common:], b[common:]
    rest = len(a) - 1
    any_rest = "" if rest == 0 else " [0-9]" if rest == 1 else f" [0-9]{{{rest}}}"
    a_low, b_high = a[1:] == "0" * rest, b[1:] == "9" * rest
    parts = []
    if not a_low:
        parts.append(f'"{a[0]}" ' + _same_length(a[1:], "9" * rest))
    lo, hi = int(a[0]) + (not a_low), int(b[0]) - (not b_high)
    if lo <= hi:
        parts.append(_digits(lo, hi) + any_rest)
    if not b_high:
        parts.append(f'"{b[0]}" ' + _same_length("0" * rest, b[1:]))
    return head + (parts[0] if len(parts) == 1 else "( " + " | ".join(parts) + " )")


def _non_negative(lo: int, hi: Optional[int]) -> List[str]:
    """Alternatives for the integers lo..hi (hi None: up to OPEN_DIGITS digits or lo's length)."""
    lo_len = len(str(lo))
    hi_len = len(str(hi)) if hi is not None else max(OPEN_DIGITS, lo_len)
    parts = []
    for length in range(lo_len, hi_len + 1):
        first = lo if length == lo_len else 10 ** (length - 1)
        if hi is None and length > lo_len:   # every longer length, to the cap, in one piece
            more = f"{length - 1},{hi_len - 1}" if length < hi_len else f"{length - 1}"
            parts.append(f"[1-9] [0-9]{{{more}}}")
            break
        last = hi if length == hi_len and hi is not None else 10 ** length - 1
        parts.append(_same_length(str(first), str(last)))
    return parts


def integer_range(lo: Optional[int], hi: Optional[int]) -> str:
    """A GBNF expression for the JSON integers lo..hi (None: open on that side). "-0" is taken
    when 0 is in range, as a JSON Schema validator takes it."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError("empty range")
    parts = []
    if hi is None or hi >= 0:
        parts += _non_negative(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo <= 0:
        magnitudes = _non_negative(max(-hi, 0) if hi is not None else 0, -lo if lo is not None else None)
        parts.append('"-" ( ' + " | ".join(magnitudes) + " )")
    return "( " + " | ".join(parts) + " )"
