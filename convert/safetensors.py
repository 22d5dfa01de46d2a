"""Reading safetensors checkpoints (one file or an index of shards) as float arrays, mapped
rather than read and loaded one at a time; for pykv convert."""
from __future__ import annotations

import functools
import json
import struct
from pathlib import Path
from typing import Callable, Iterator, Tuple

import numpy as np

from pykv.errors import ConvertError

# dtypes that can be read (BF16 is widened to float32 by a shift)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def safetensors_files(model_dir: Path):
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"no *.safetensors files in {model_dir} (pytorch .bin checkpoints are not read)")
    return files


def read_safetensors(path: Path) -> Iterator[Tuple[str, Tuple[int, ...], Callable[[], np.ndarray]]]:
    """(name, shape, load) for every tensor of one file, checked against the file's size;
    load() gives the float array, mapped rather than read (BF16 widened to float32 then)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConvertError(f"{path.name}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ConvertError(f"{path.name}: the header claims {n} bytes, more than the file holds")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConvertError(f"{path.name}: corrupt safetensors header ({exc})") from exc
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ConvertError(f"{path.name}: tensor {name} has dtype {info.get('dtype')}; F32, F16 and BF16 are read")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end > data.size or end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ConvertError(f"{path.name}: tensor {name} lies outside the file or has the wrong size")
        yield name, shape, functools.partial(_load, data, start, end, dtype, shape)


def _load(data: np.ndarray, start: int, end: int, dtype, shape) -> np.ndarray:
    arr = data[start:end].view(dtype).reshape(shape)
    return (arr.astype(np.uint32) << 16).view(np.float32) if dtype is np.uint16 else arr
