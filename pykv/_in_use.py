"""Which threads are running native code on a Llama, so that close() never frees a model or
context that a call is still using.

A context is used by one thread at a time: a call that uses it (eval, generate, reset, ...)
holds it for its thread, and the same call from another thread meanwhile is refused with
InvalidArgumentError ("this Llama is already generating in another thread"). Calls that only
read the model (tokenize, metadata, ...) may run beside anything. close() marks the Llama as
closing (calls that start afterwards are refused), cancels a running evaluation, and waits
until no call runs before it frees anything.
"""
from __future__ import annotations

import functools
import threading

from . import errors


class InUse:
    def __init__(self):
        self._cond = threading.Condition()
        self._owner = None      # threading.get_ident() of the thread holding the context
        self._depth = 0         # its nested holds (a call inside a call)
        self._activity = ""     # what the outermost hold does: "generating", "evaluating", ...
        self._readers = 0       # calls on the model running now
        self._closing = False
        self._close_lock = threading.Lock()

    def holds_context(self) -> bool:
        """Whether the calling thread holds the context (is inside a call that uses it)."""
        return self._owner == threading.get_ident()

    def hold_context(self, activity: str) -> None:
        me = threading.get_ident()
        if self._owner == me:   # only this thread sets or clears its own ownership
            self._depth += 1
            return
        with self._cond:
            if self._owner is not None:
                raise errors.InvalidArgumentError(f"this Llama is already {self._activity} in another thread")
            if self._closing:
                raise errors.InvalidArgumentError("this Llama is closed")
            self._owner, self._depth, self._activity = me, 1, activity

    def release_context(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            with self._cond:
                self._owner, self._activity = None, ""
                self._cond.notify_all()

    def hold_model(self) -> bool:
        """Count a call on the model; False when the thread already holds the context (which
        keeps close() waiting anyway) and nothing was counted."""
        if self.holds_context():
            return False
        with self._cond:
            if self._closing:
                raise errors.InvalidArgumentError("this Llama is closed")
            self._readers += 1
        return True

    def release_model(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def close(self, cancel, free) -> None:
        """Refuse new calls from now on, cancel() a running one, wait until no call runs on
        the model or the context, then free(). A second close() finds nothing left to free."""
        with self._close_lock:
            with self._cond:
                self._closing = True
            cancel()
            with self._cond:
                while self._owner is not None or self._readers:
                    self._cond.wait()
            free()

    def unless_closing(self, action) -> None:
        """action() (quick, with no callbacks) unless the Llama is closing or closed."""
        with self._cond:
            if not self._closing:
                action()


def using_context(activity: str):
    """The method holds the Llama's context while it runs (see InUse)."""
    def decorate(method):
        @functools.wraps(method)
        def held(self, *args, **kwargs):
            self._in_use.hold_context(activity)
            try:
                return method(self, *args, **kwargs)
            finally:
                self._in_use.release_context()
        return held
    return decorate


def using_model(method):
    """The method only reads the model: it runs beside other calls, and close() waits for it."""
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        counted_now = self._in_use.hold_model()
        try:
            return method(self, *args, **kwargs)
        finally:
            if counted_now:
                self._in_use.release_model()
    return counted


def hold_each_step(in_use: InUse, steps, activity: str):
    """A generator's steps (the code between two yields) each run holding the context; the
    context is free while the consumer has the chunk."""
    try:
        while True:
            in_use.hold_context(activity)
            try:
                chunk = next(steps)
            except StopIteration:
                return
            finally:
                in_use.release_context()
            yield chunk
    finally:
        # an abandoned stream: its generator records the cancelled result, on the context;
        # when the Llama is closed or busy in another thread, the collector closes it later
        if steps.gi_frame is not None:
            try:
                in_use.hold_context(activity)
            except errors.InvalidArgumentError:
                pass
            else:
                try:
                    steps.close()
                finally:
                    in_use.release_context()
