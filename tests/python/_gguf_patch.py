"""Make corrupt copies of a valid GGUF file for bad-input tests.

Offsets are found with gguf.GGUFReader on the valid file: a tensor-info record is
name (u64 length + bytes), n_dims (u32), dims (u64 x n_dims), type (u32), offset (u64).
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path


def _tensor_info(src, name: str):
    from gguf import GGUFReader

    r = GGUFReader(str(src))
    for t in r.tensors:
        if t.name == name:
            parts = t.field.parts
            # parts: name_len, name, n_dims, dims, type, offset
            type_off = t.field.offset + sum(int(p.nbytes) for p in parts[:4])
            data_off_field = type_off + int(parts[4].nbytes)
            return type_off, data_off_field, int(parts[5][0])
    raise KeyError(name)


def layout(src) -> dict:
    """Byte offsets in ``src``: start of the KVs, of the tensor infos, of the data
    section, the end of the last tensor's data and the file size."""
    from gguf import GGUFReader

    r = GGUFReader(str(src))
    first_tensor_info = min(t.field.offset for t in r.tensors)
    return {
        "kv_start": 24,  # magic(4) version(4) n_tensors(8) n_kv(8)
        "tensor_info_start": first_tensor_info,
        "data_start": int(r.data_offset),
        "data_end": max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors),
        "size": Path(src).stat().st_size,
    }


def truncated_copy(src, dst, n_bytes: int) -> Path:
    with open(src, "rb") as f:
        data = f.read(n_bytes)
    Path(dst).write_bytes(data)
    return Path(dst)


def _patched_copy(src, dst, offset: int, payload: bytes) -> Path:
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(payload)
    return Path(dst)


def bad_magic_copy(src, dst) -> Path:
    return _patched_copy(src, dst, 0, b"GGML")


def tensor_type_copy(src, dst, tensor_name: str, type_id: int) -> Path:
    type_off, _, _ = _tensor_info(src, tensor_name)
    return _patched_copy(src, dst, type_off, struct.pack("<I", type_id))


def tensor_offset_copy(src, dst, tensor_name: str, data_offset: int) -> Path:
    """Set the tensor's data offset (relative to the data section) to ``data_offset``."""
    _, off_field, _ = _tensor_info(src, tensor_name)
    return _patched_copy(src, dst, off_field, struct.pack("<Q", data_offset))


def tensor_data_copy(src, dst, tensor_name: str, at: int, payload: bytes) -> Path:
    """Overwrite bytes ``at`` onwards of the tensor's data with ``payload``."""
    _, _, data_offset = _tensor_info(src, tensor_name)
    return _patched_copy(src, dst, layout(src)["data_start"] + data_offset + at, payload)
