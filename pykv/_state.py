"""Saved context states (Llama.save_state / load_state) and the prompt-cache files of
`pykv generate --prompt-cache` (llama.cpp's): the tokens a context holds with the C library's
bytes for their keys, values, logits and the policy's own state, and, in a file, which model
they belong to."""
from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Union

import numpy as np

from . import errors
from ._ffi import check, ffi, lib

FILE_MAGIC = b"PYKVPC1\n"
_FINGERPRINT_BYTES = 4 << 20


@dataclass
class LlamaState:
    """What Llama.save_state() returns: the tokens the context holds, in order, and the C
    library's state bytes (pykv_state_save; any bytes-like object), to give to load_state()
    of a Llama on the same model with the same KV type, policy and policy settings."""
    input_ids: List[int]
    data: Union[bytes, bytearray, memoryview]

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


def save_state(llm) -> LlamaState:
    ctx = llm._need_ctx()
    size = ffi.new("size_t *")
    check(lib.pykv_state_size(ctx, size))
    data = bytearray(size[0])   # written in place: one copy of the state, not two
    written = ffi.new("size_t *")
    check(lib.pykv_state_save(ctx, ffi.from_buffer(data), size[0], written))
    return LlamaState(list(llm.input_ids), data)


def load_state(llm, state: LlamaState) -> None:
    ctx = llm._need_ctx()
    if not isinstance(state, LlamaState):
        raise errors.InvalidArgumentError(f"load_state expects a LlamaState, got {type(state).__name__}")
    data = memoryview(state.data).cast("B")
    n_past = ffi.new("int32_t *")
    check(lib.pykv_state_n_tokens(ffi.from_buffer(data), len(data), n_past))
    if n_past[0] != len(state.input_ids):
        raise errors.InvalidArgumentError(f"the state holds {len(state.input_ids)} token ids for "
                                          f"{n_past[0]} evaluated tokens")
    input_ids = _checked_token_ids(state.input_ids, llm.n_vocab)
    check(lib.pykv_state_load(ctx, ffi.from_buffer(data), len(data)))
    llm.input_ids = input_ids


def _checked_token_ids(ids, n_vocab: int) -> List[int]:
    """A state's token ids as ints, each a token of the vocabulary (InvalidArgumentError else):
    they go to the sampler and the prefix match of later generations."""
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < n_vocab:
            raise errors.InvalidArgumentError(f"the state's token id {t!r} at index {i} is not a token of the "
                                              f"vocabulary (0..{n_vocab - 1})")
        out.append(int(t))
    return out


def model_fingerprint(model_path) -> str:
    """The model file's size and a hash of its first 4 MiB (header, metadata, first tensors):
    enough to tell two GGUFs of the same shape apart without reading all of either."""
    import hashlib   # here: importing it maps OpenSSL's libcrypto, ~4 MiB of every process's RSS
    path = Path(model_path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
    return f"{path.stat().st_size}:{h.hexdigest()[:32]}"


def write_state_file(path, state: LlamaState, model_path) -> None:
    """FILE_MAGIC, a u32 length, a JSON header (model fingerprint, token ids), the state bytes;
    written to a new temporary file in the same folder and renamed, so a reader never sees
    half a file. The temporary file is created exclusively under a random name (mkstemp), so
    a link planted in the folder is never followed nor overwritten."""
    header = json.dumps({"model": model_fingerprint(model_path), "tokens": state.input_ids}).encode()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(FILE_MAGIC + struct.pack("<I", len(header)) + header)
            f.write(state.data)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _read_regular_file(path) -> bytes:
    """The bytes of path, which must be a regular file: a FIFO, a device (/dev/zero) or a
    folder is refused with ValueError before anything is read (opened without blocking, so a
    FIFO with no writer does not hang), and no more than the size it had when opened is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(info.st_size)
    finally:
        os.close(fd)
    if len(data) != info.st_size:
        raise ValueError(f"{path} changed while it was read")
    return data


def read_state_file(path, model_path) -> LlamaState:
    """The state in a prompt-cache file; ValueError says why it cannot be used with this model
    (also for a path that is not a regular file)."""
    data = _read_regular_file(path)
    if not data.startswith(FILE_MAGIC) or len(data) < len(FILE_MAGIC) + 4:
        raise ValueError(f"{path} is not a pykv prompt cache")
    (n,) = struct.unpack_from("<I", data, len(FILE_MAGIC))
    start = len(FILE_MAGIC) + 4
    if n > len(data) - start:
        raise ValueError(f"{path}: the prompt cache's header is damaged")
    try:
        header = json.loads(data[start:start + n])
        tokens = [int(t) for t in header["tokens"]]
        model = header["model"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(f"{path}: the prompt cache's header is damaged") from None
    if model != model_fingerprint(model_path):
        raise ValueError(f"{path} was written for another model file")
    return LlamaState(tokens, memoryview(data)[start + n:])   # a view: the state is not copied
