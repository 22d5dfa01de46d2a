"""The progress line of an evaluation on stderr: runs and cells done, and the time left.

On a terminal the line is redrawn in place as a bar; in a log (stderr not a terminal) a line is
printed every `log_every` seconds instead. The time left is the elapsed time per token
evaluated so far times the tokens still to evaluate (runs differ in length)."""
from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    def __init__(self, runs: int, tokens: int, cells: int, stream=None, width: int = 24, log_every: float = 60.0):
        self.runs, self.tokens, self.cells = runs, max(tokens, 1), cells
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width, self.log_every = width, log_every
        self.runs_done = self.tokens_done = self.cells_done = 0
        self.start = time.monotonic()
        self._last_log = self.start
        self._shown = False
        self._printed = None

    def skip(self, tokens: int, cells_done: int) -> None:
        """A run already in the results (resumed): counted done, not in the rate."""
        self.runs_done += 1
        self.tokens -= tokens
        self.cells_done = cells_done

    def step(self, tokens: int, cells_done: int) -> None:
        self.runs_done += 1
        self.tokens_done += tokens
        self.cells_done = cells_done
        self.draw()

    def line(self) -> str:
        frac = self.runs_done / self.runs if self.runs else 1.0
        elapsed = time.monotonic() - self.start
        if self.tokens_done:
            left = _duration(elapsed / self.tokens_done * max(self.tokens - self.tokens_done, 0))
        else:
            left = "?"
        bar = ""
        if self.tty:
            filled = int(round(frac * self.width))
            bar = "[" + "#" * filled + "." * (self.width - filled) + "] "
        return (f"pykv eval: {bar}{self.runs_done}/{self.runs} runs, {self.cells_done}/{self.cells} cells, "
                f"{_duration(elapsed)} elapsed, {left} left")

    def draw(self, force: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
            self._shown = True
        elif force or time.monotonic() - self._last_log >= self.log_every:
            self._last_log = time.monotonic()
            self._print(self.line())

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self._shown = False
        self._print(self.line())

    def _print(self, line: str) -> None:
        if line != self._printed:   # the last line is not said twice in a log
            self._printed = line
            print(line, file=self.stream, flush=True)
