"""Shared fixtures: the real SmolLM2 model (via pykv.pull) and tiny random GGUFs."""

from __future__ import annotations

import os
import socket
import urllib.error

import pytest

import _tiny_models

# transformers' GGUF loader draws tqdm bars; keep test logs readable.
os.environ.setdefault("TQDM_DISABLE", "1")

_NETWORK_HINTS = (
    "network is unreachable", "temporary failure in name resolution",
    "name or service not known", "failed to establish a new connection",
    "connection refused", "connection reset", "timed out", "no route to host",
    "could not resolve", "nodename nor servname", "max retries exceeded",
    "no matching distribution found", "could not find a version that satisfies",
)


def _is_network_failure(exc: BaseException) -> bool:
    """True if ``exc`` (or anything in its cause chain) says the network is missing."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (urllib.error.URLError, socket.gaierror, socket.timeout,
                            ConnectionError, TimeoutError)):
            return True
        text = str(exc).lower()
        for attr in ("stderr", "output"):
            extra = getattr(exc, attr, None)
            if isinstance(extra, bytes):
                extra = extra.decode("utf-8", "replace")
            if isinstance(extra, str):
                text += " " + extra.lower()
        if any(h in text for h in _NETWORK_HINTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF, downloaded once by pykv.pull.

    Skips only when the download fails for lack of network; any other failure of
    pull() is a test failure."""
    from pykv.pull import pull

    try:
        path = pull("smollm2", quiet=True)
    except Exception as exc:  # noqa: BLE001 - classified below
        if _is_network_failure(exc):
            pytest.skip(f"SmolLM2 model unavailable (no network): pull('smollm2') failed: {exc}")
        raise
    assert path.exists(), f"pull('smollm2') returned a missing path: {path}"
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: ``tiny_model(name=DEFAULT_VARIANT, **spec_changes) -> Path``.

    Writes the tiny GGUF once per session for each distinct (name, changes)."""
    root = tmp_path_factory.mktemp("tiny_models")
    made = {}

    def make(name: str = _tiny_models.DEFAULT_VARIANT, **changes):
        key = (name, tuple(sorted(changes.items())))
        if key not in made:
            spec = _tiny_models.variant(name, **changes)
            fname = name if not changes else f"{name}-{len(made)}"
            made[key] = _tiny_models.write_tiny_gguf(spec, root / f"{fname}.gguf")
        return made[key]

    return make
