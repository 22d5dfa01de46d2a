"""Exceptions raised by pykv. Every C error becomes one of these, carrying the C message."""


class PykvError(Exception):
    """Base class of every pykv error; ``status`` is the C library's pykv_status code."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class ModelLoadError(PykvError, ValueError):
    """The model file could not be read: missing, truncated, corrupt or unsupported."""


class ContextOverflowError(PykvError, ValueError):
    """The tokens do not fit in the context (n_ctx)."""


class InvalidArgumentError(PykvError, ValueError):
    """An argument is out of range or of the wrong kind."""


class BackendError(PykvError, RuntimeError):
    """The runtime failed: out of memory or an internal error."""


class GenerationCancelled(PykvError):
    """A running evaluation was cancelled (internal: generate() reports finish_reason="cancelled")."""


class ConvertError(ValueError):
    """pykv convert cannot convert the model folder; the message says why."""
