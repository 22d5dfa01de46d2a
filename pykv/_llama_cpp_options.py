"""llama-cpp-python's Llama() keywords that pykv has no argument of its own for, so that
code written for it runs unchanged: the cache's ggml types (type_k, type_v) become kv_type
and kv_type_v; the GPU keywords are taken, and asking for layers on a GPU warns, since pykv
runs on the CPU, as does use_mlock=True; the rest name choices pykv makes itself. Any other
keyword is a TypeError, as Python raises for a misspelt one."""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

from . import errors

# ggml_type numbers of the cache types pykv stores
_GGML_CACHE_TYPES = {0: "f32", 1: "f16", 8: "q8_0"}
# taken and left to pykv: its prefill attention is always block-wise (flash style), one
# thread count serves prefill and decode, and nothing is offloaded
_IGNORED = ("flash_attn", "n_threads_batch", "offload_kqv", "main_gpu", "split_mode", "tensor_split", "use_mlock")


def _fold(ours: str, mine: Optional[str], theirs: str, value) -> Optional[str]:
    """Our cache type argument once llama-cpp-python's (a ggml type number, or None) is
    folded in; the two must agree when both are given."""
    if value is None:
        return mine
    if isinstance(value, str):
        given = value.lower()
    elif isinstance(value, bool) or not isinstance(value, int) or value not in _GGML_CACHE_TYPES:
        known = ", ".join(f"{n} ({t})" for t, n in _GGML_CACHE_TYPES.items())
        raise errors.InvalidArgumentError(
            f"{theirs} must be a ggml type pykv stores its cache in: {known}; got {value!r}")
    else:
        given = _GGML_CACHE_TYPES[value]
    if mine is not None and str(mine).lower() != given:
        raise errors.InvalidArgumentError(f"{ours}={mine!r} and {theirs}={value!r} disagree")
    return given


def resolve(options: dict, kv_type: Optional[str], kv_type_v: Optional[str]) -> Tuple[str, Optional[str]]:
    """The cache types once type_k/type_v are folded in (kv_type None: not given)."""
    unknown = sorted(set(options) - set(_IGNORED) - {"type_k", "type_v", "n_gpu_layers"})
    if unknown:
        raise TypeError(f"Llama() got an unexpected keyword argument {unknown[0]!r}")
    kv_type = _fold("kv_type", kv_type, "type_k", options.get("type_k"))
    kv_type_v = _fold("kv_type_v", kv_type_v, "type_v", options.get("type_v"))
    layers = options.get("n_gpu_layers", 0)
    if isinstance(layers, bool) or not isinstance(layers, int):
        raise errors.InvalidArgumentError(f"n_gpu_layers must be an integer, got {layers!r}")
    if layers != 0:
        warnings.warn(f"n_gpu_layers={layers}: pykv runs every layer on the CPU", RuntimeWarning, stacklevel=3)
    if options.get("use_mlock"):
        warnings.warn("use_mlock: pykv does not lock the model's pages in memory", RuntimeWarning, stacklevel=3)
    return kv_type or "f16", kv_type_v
