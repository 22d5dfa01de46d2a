"""llama-cpp-python's Llama() keywords that pykv has no argument of its own for, so that
code written for it runs unchanged.

- Followed: the cache's ggml types (type_k, type_v) become kv_type and kv_type_v; chat_format
  names a prompt layout (pykv._chat_formats); rope_freq_base and rope_freq_scale override the
  model's RoPE base and scale positions linearly; kv_overrides replace the GGUF metadata
  values pykv reads as hyperparameters (see KV_OVERRIDES); last_n_tokens_size is the window
  of the repeat, frequency and presence penalties of create_completion,
  create_chat_completion and sample().
- Taken with a warning when they ask for something pykv does not do: use_mlock, numa,
  rpc_servers, chat_handler (pykv renders chats with
  templates), tokenizer (pykv uses the GGUF's), draft_model (no speculative decoding: the
  output is the same without it), spm_infill, rope_scaling_type other than none or linear,
  and yarn_* other than their defaults.
- Taken and left to pykv: choices it makes itself (flash_attn, n_threads_batch, offload_kqv,
  split_mode, tensor_split, mul_mat_q, ...). n_gpu_layers and main_gpu are Llama's own.
- Refused: lora_path (pykv does not apply LoRA adapters).
Any other keyword is a TypeError, as Python raises for a misspelt one."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from . import errors

# ggml_type numbers of the cache types pykv stores
_GGML_CACHE_TYPES = {0: "f32", 1: "f16", 8: "q8_0"}
# taken and left to pykv: its prefill attention is always block-wise (flash style), one
# thread count serves prefill and decode, an offloaded layer's KV cache is on its GPU, one GPU
# holds every offloaded layer, quantised weights always take integer dot products unless
# exact_matmul, and timings are always kept
_IGNORED = ("flash_attn", "n_threads_batch", "offload_kqv", "split_mode", "tensor_split",
            "mul_mat_q", "op_offload", "swa_full", "no_perf", "lora_base", "lora_scale")
# keyword: (its default, what pykv does instead when another value is given)
_WARNED = {
    "use_mlock": (False, "pykv does not lock the model's pages in memory"),
    "numa": (False, "pykv does not place memory or threads by NUMA node"),
    "rpc_servers": (None, "pykv runs on this machine only"),
    "chat_handler": (None, "pykv renders chats with the chat template (chat_format, chat_template or the "
                           "model's own) and handles tools itself; the handler is not used"),
    "tokenizer": (None, "pykv tokenizes with the GGUF's own vocabulary; the tokenizer is not used"),
    "draft_model": (None, "pykv has no speculative decoding; the output is the same without it"),
    "spm_infill": (False, "pykv writes infill prompts prefix first (pykv.server.fim)"),
    "yarn_ext_factor": (-1.0, "pykv does not implement YaRN"),
    "yarn_attn_factor": (1.0, "pykv does not implement YaRN"),
    "yarn_beta_fast": (32.0, "pykv does not implement YaRN"),
    "yarn_beta_slow": (1.0, "pykv does not implement YaRN"),
    "yarn_orig_ctx": (0, "pykv does not implement YaRN"),
}
_OWN = ("type_k", "type_v", "chat_format", "rope_freq_base", "rope_freq_scale",
        "rope_scaling_type", "kv_overrides", "last_n_tokens_size", "lora_path")
# llama.cpp's rope scaling types: -1 unspecified (the model's), 0 none, 1 linear, 2 YaRN, 3 LongRoPE
_ROPE_SCALING_TYPES = {-1: "unspecified", 0: "none", 1: "linear", 2: "yarn", 3: "longrope"}


@dataclass
class Options:
    """What the keywords come to: cache types, a chat template from chat_format, RoPE
    overrides (0: the model's), kv_overrides still to apply, the penalties' window."""
    kv_type: str = "f16"
    kv_type_v: Optional[str] = None
    chat_format: Optional[str] = None
    chat_template: Optional[str] = None
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    kv_overrides: dict = field(default_factory=dict)
    last_n_tokens_size: int = 64


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


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _rope_value(name: str, value) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise errors.InvalidArgumentError(f"{name} must be a number >= 0 (0 = the model's), got {value!r}")
    return float(value)


def resolve(options: dict, kv_type: Optional[str], kv_type_v: Optional[str],
            chat_template: Optional[str] = None) -> Options:
    """The Options of llama-cpp-python's keywords (checked before anything loads)."""
    unknown = sorted(set(options) - set(_IGNORED) - set(_WARNED) - set(_OWN))
    if unknown:
        raise TypeError(f"Llama() got an unexpected keyword argument {unknown[0]!r}")
    out = Options()
    out.kv_type = _fold("kv_type", kv_type, "type_k", options.get("type_k")) or "f16"
    out.kv_type_v = _fold("kv_type_v", kv_type_v, "type_v", options.get("type_v"))
    for name, (default, why) in _WARNED.items():
        if name in options and options[name] != default and options[name] is not None:
            _warn(f"{name if options[name] is True else f'{name}={options[name]!r}'}: {why}")
    if options.get("lora_path") is not None:
        raise errors.InvalidArgumentError(
            f"lora_path={options['lora_path']!r}: pykv does not apply LoRA adapters; merge the adapter into the "
            "model (llama.cpp's llama-export-lora writes a merged GGUF) and load that")

    fmt = options.get("chat_format")
    if fmt is not None:
        from ._chat_formats import chat_format_template
        if chat_template is not None:
            raise errors.InvalidArgumentError("give chat_format or chat_template, not both")
        out.chat_format, out.chat_template = fmt, chat_format_template(fmt)

    out.rope_freq_base = _rope_value("rope_freq_base", options.get("rope_freq_base"))
    out.rope_freq_scale = _rope_value("rope_freq_scale", options.get("rope_freq_scale"))
    scaling = options.get("rope_scaling_type")
    if scaling is not None:
        if isinstance(scaling, bool) or not isinstance(scaling, int) or scaling not in _ROPE_SCALING_TYPES:
            raise errors.InvalidArgumentError(
                f"rope_scaling_type must be one of {sorted(_ROPE_SCALING_TYPES)} (llama.cpp's "
                f"{', '.join(_ROPE_SCALING_TYPES.values())}), got {scaling!r}")
        if scaling == 0 and out.rope_freq_scale not in (0.0, 1.0):
            raise errors.InvalidArgumentError("rope_scaling_type=0 (none) and a rope_freq_scale disagree")
        if scaling >= 2:
            _warn(f"rope_scaling_type={scaling} ({_ROPE_SCALING_TYPES[scaling]}): pykv implements linear scaling "
                  "only (rope_freq_scale); positions are scaled linearly, if at all")

    overrides = options.get("kv_overrides")
    if overrides is not None:
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            raise errors.InvalidArgumentError("kv_overrides must be a dict of GGUF metadata keys to values")
        for key, value in overrides.items():
            if not isinstance(value, (bool, int, float, str)):
                raise errors.InvalidArgumentError(
                    f"kv_overrides[{key!r}] must be a bool, int, float or str, got {type(value).__name__}")
        out.kv_overrides = dict(overrides)

    window = options.get("last_n_tokens_size", 64)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise errors.InvalidArgumentError(f"last_n_tokens_size must be an integer >= 0, got {window!r}")
    out.last_n_tokens_size = window
    return out


# kv_overrides keys pykv applies ({arch} is general.architecture): each to what it sets
KV_OVERRIDES = {
    "{arch}.rope.freq_base": "rope_freq_base",
    "{arch}.rope.scaling.factor": "rope_freq_scale (its inverse, linear scaling)",
    "{arch}.rope.scale_linear": "rope_freq_scale (its inverse)",
}


def apply_kv_overrides(opts: Options, metadata: dict) -> None:
    """opts with the kv_overrides pykv can apply folded in (an explicit rope_freq_base or
    rope_freq_scale wins); a warning names each one it cannot."""
    arch = metadata.get("general.architecture", "llama")
    for key, value in opts.kv_overrides.items():
        name = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        numeric = not isinstance(value, (bool, str))
        if name == "rope.freq_base" and numeric:
            if opts.rope_freq_base == 0.0:
                opts.rope_freq_base = _rope_value(key, value)
        elif name in ("rope.scaling.factor", "rope.scale_linear") and numeric:
            factor = _rope_value(key, value)
            if factor > 0 and opts.rope_freq_scale == 0.0:
                opts.rope_freq_scale = 1.0 / factor
        else:
            _warn(f"kv_overrides[{key!r}]: pykv does not apply this override (it applies "
                  f"{', '.join(k.format(arch=arch) for k in KV_OVERRIDES)})")
