"""An independent reference for grammar-constrained sampling: which tokens may come next, by
brute force over the vocabulary with a regular expression equivalent to the grammar (the
`regex` module's partial matching), and Python's strict UTF-8 decoder for text that ends
inside a character."""
from __future__ import annotations

import codecs
from typing import Iterable, List, Set

import regex


def _could_become(first_bytes: bytes) -> range:
    """The code points a character starting with first_bytes may encode (before the strict
    decoder's limits, which the caller applies by decoding)."""
    b0 = first_bytes[0]
    n = 2 if b0 >> 5 == 6 else 3 if b0 >> 4 == 14 else 4
    v = b0 & (0x7F >> n)
    for b in first_bytes[1:]:
        v = (v << 6) | (b & 0x3F)
    missing = 6 * (n - len(first_bytes))
    return range(v << missing, ((v << missing) | ((1 << missing) - 1)) + 1)


def allowed_tokens(pattern: str, text: bytes, pieces: List[bytes], eog: Set[int], points: Iterable[int]) -> Set[int]:
    """Tokens that may follow text (bytes generated so far) under pattern: the new text is
    UTF-8 up to a cut-off last character and a prefix of a match; an end-of-generation token
    when text is a full match. A cut-off character is tried as its first possible code point
    and every point of `points` (the bounds of the pattern's character ranges) it may become."""
    compiled = regex.compile(pattern)
    points = sorted(set(points))
    out = set()
    whole = text.decode("utf-8", errors="strict") if _complete_utf8(text) else None
    for t, piece in enumerate(pieces):
        if t in eog:
            if whole is not None and compiled.fullmatch(whole):
                out.add(t)
            continue
        if not piece:
            continue
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            s = decoder.decode(text + piece, final=False)
        except UnicodeDecodeError:
            continue
        tail = decoder.getstate()[0]
        if not tail:
            if compiled.fullmatch(s, partial=True):
                out.add(t)
            continue
        span = _could_become(tail)
        tries = [cp for cp in [span.start, _least(tail[0])] + points if cp in span]
        for cp in tries:
            try:   # the strict decoder decides whether tail can become cp at all
                if not chr(cp).encode("utf-8").startswith(tail):
                    continue
            except UnicodeEncodeError:
                continue
            if compiled.fullmatch(s + chr(cp), partial=True):
                out.add(t)
                break
    return out


def _least(lead: int) -> int:
    """The smallest code point a sequence with this lead byte may encode without being overlong."""
    return 0x80 if lead >> 5 == 6 else 0x800 if lead >> 4 == 14 else 0x10000


def _complete_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8", errors="strict")
        return True
    except UnicodeDecodeError:
        return False


def boundary_points(*ranges) -> List[int]:
    """Points for allowed_tokens: each (lo, hi) range's lo and hi + 1."""
    return [p for lo, hi in ranges for p in (lo, hi + 1)]
