"""Turning a stream of token bytes into text safely: incomplete UTF-8 sequences and text that
may be the start of a stop string are held back until they are resolved."""


def _utf8_complete_prefix(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 sequence."""
    n = len(data)
    # look back at most 3 bytes for the lead byte of an unfinished sequence
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte & 0xC0 == 0x80:          # continuation byte: keep looking for the lead
            continue
        if byte & 0x80 == 0:             # ASCII: complete
            return n
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return n if back >= need else n - back
    return n


class TextStream:
    """Feed token bytes with push(); get back the text that is safe to show.

    finished() returns the matched stop string once one appears (the text before it has been
    emitted, the stop string and anything after it never are)."""

    def __init__(self, stop=()):
        self._pending = b""     # bytes not yet decoded (an incomplete UTF-8 tail)
        self._held = ""         # decoded text that might begin a stop string
        self._stop = [s for s in stop if s]
        self.stopped_by = None
        self.text = ""          # everything emitted so far

    def push(self, data: bytes) -> str:
        self._pending += data
        cut = _utf8_complete_prefix(self._pending)
        self._held += self._pending[:cut].decode("utf-8", "replace")
        self._pending = self._pending[cut:]
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: release whatever is held (a broken UTF-8 tail becomes U+FFFD)."""
        if self._pending:
            self._held += self._pending.decode("utf-8", "replace")
            self._pending = b""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped_by is not None:
            return ""
        for stop in self._stop:
            at = self._held.find(stop)
            if at >= 0:
                out = self._held[:at]
                self._held = ""
                self.stopped_by = stop
                self.text += out
                return out
        keep = 0 if final else self._partial_stop_len()
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        self.text += out
        return out

    def _partial_stop_len(self) -> int:
        """The longest tail of the held text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:k]):
                    best = k
                    break
        return best
