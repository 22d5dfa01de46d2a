"""``pykv info``: GGUF header, metadata, hyperparameters, tensors, chat template and KV memory
estimates; ``--system`` and ``--policies`` describe the native library."""

from __future__ import annotations

import json
import sys

from .main import EXIT_OK, resolve_model_arg

MAX_VALUE_CHARS = 100
CTX_SIZES = (512, 2048, 4096, 8192, 32768)
BUDGETS = (64, 128, 256, 512, 1024, 2048)
KV_ELEMENT_BYTES = 2  # the default cache holds K and V as f16 (--cache-type f32 doubles it, q8_0: 34/64 of it)


def kv_bytes_per_entry(info: dict) -> int:
    """Bytes of one cached token in one (layer, KV head): K and V in the default f16 cache."""
    return int(info["head_dim"]) * 2 * KV_ELEMENT_BYTES


def kv_bytes_per_token(info: dict) -> int:
    """Bytes of one token's K and V over every layer and KV head (the full cache)."""
    return int(info["n_layer"]) * int(info["n_head_kv"]) * kv_bytes_per_entry(info)


def kv_estimates(info: dict) -> dict:
    per_token = kv_bytes_per_token(info)
    ctxs = sorted({*CTX_SIZES, int(info.get("n_ctx_train") or 0)} - {0})
    return {
        "bytes_per_token": per_token,
        "full": {n: n * per_token for n in ctxs},
        "budget": {b: b * per_token for b in BUDGETS},
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _truncate(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    text = text.replace("\n", "\\n")
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def _shape(t: dict) -> str:
    return "x".join(str(d) for d in t["shape"])


def _print_system() -> None:
    import pykv
    print(pykv.system_info())


def _policy_lines(info: dict) -> list:
    """What `pykv info --policies` says of one policy, after its name and description."""
    from ..policies import default_budget_text
    if not info["runs_on_gpu"]:
        gpu = "GPU: no; with -ngl a context keeps every layer on the CPU"
    else:
        gpu = "GPU: runs with the layers on the GPU (-ngl)" + (", scoring and evicting there" if info["evicts"] else "")
    if not info["evicts"]:
        return [f"choose: {info['choose']}", gpu]
    reading = ("yes: it evicts after every prefill chunk, so -c bounds the cache, not the prompt"
               if info["evicts_while_reading"] else "with evict_every_chunk=1 (--evict-every-chunk)")
    return [f"options: {info['options']}",
            f"budget: default {default_budget_text(info)}; a share (N%) is raised to at least "
            f"{info['budget_floor']} entries or the policy's window",
            f"decode: {'evicts every step (the cache stays at the budget)' if info['evicts_every_step'] else 'the cache grows'}; "
            f"prompts longer than -c: {reading}",
            gpu,
            f"choose: {info['choose']}"]


def _print_policies() -> None:
    from ..policies import policy_info
    rows = policy_info()
    width = max((len(r["name"]) for r in rows), default=4)
    print("policies (--policy NAME; options go through --policy-arg K=V):")
    for info in rows:
        print(f"  {info['name']:<{width}}  {info['description']}")
        for line in _policy_lines(info):
            print(f"  {'':<{width}}    {line}")


def load_info(path, n_gpu_layers: int = 0, main_gpu: int = 0) -> dict:
    """Everything `pykv info` shows, read through the pykv.Llama API; with n_gpu_layers the
    weights are loaded and offloaded too, to show what goes to the GPU."""
    import warnings

    from .. import Llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # print_info says why nothing was offloaded
        llm = (Llama(str(path), n_ctx=16, n_gpu_layers=n_gpu_layers, main_gpu=main_gpu) if n_gpu_layers
               else Llama(str(path), vocab_only=True))
    try:
        info = dict(llm.model_info)
        return {
            "path": str(path),
            "model_info": info,
            "metadata": dict(llm.metadata),
            "tensors": list(llm.tensors),
            "chat_template": llm.chat_template,
            "kv_estimate": kv_estimates(info),
            "gpu_layers_asked": n_gpu_layers,
        }
    finally:
        llm.close()


def print_info(d: dict, out=sys.stdout) -> None:
    info, meta, tensors = d["model_info"], d["metadata"], d["tensors"]
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(f"file: {d['path']}")
    w(f"GGUF version {info.get('gguf_version')}, {len(meta)} metadata keys, {len(tensors)} tensors, "
      f"{info.get('n_params', 0):,} parameters, {_mib(int(info.get('n_bytes', 0)))} of tensor data")
    w()
    w("metadata:")
    kw = max((len(k) for k in meta), default=0)
    for key, value in meta.items():
        w(f"  {key:<{kw}} = {_truncate(str(value))}")
    w()
    w("hyperparameters:")
    for key in ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim",
                "n_ff", "rope_freq_base", "rms_eps", "tied_output"):
        if key in info:
            w(f"  {key:<15} {info[key]}")
    if d.get("gpu_layers_asked"):
        w()
        w(f"GPU offload (-ngl {d['gpu_layers_asked']}):")
        if info.get("n_gpu_layers"):
            w(f"  {info['n_gpu_layers']} of {info['n_layer']} layers{' and the classifier' if info['gpu_output'] else ''} "
              f"on CUDA device {info['gpu_device']}: {_mib(int(info['gpu_bytes']))} of weights")
        else:
            from ..llama import _gpu_absence
            w(f"  none: {_gpu_absence()}")
    w()
    w(f"tensors ({len(tensors)}):")
    nw = max((len(t["name"]) for t in tensors), default=4)
    sw = max((len(_shape(t)) for t in tensors), default=5)
    tw = max([len("type")] + [len(str(t["type"])) for t in tensors])
    w(f"  {'name':<{nw}}  {'type':<{tw}}  {'shape':<{sw}}  {'bytes':>12}")
    for t in tensors:
        w(f"  {t['name']:<{nw}}  {str(t['type']):<{tw}}  {_shape(t):<{sw}}  {int(t['n_bytes']):>12,}")
    w()
    template = d["chat_template"]
    if template:
        w("chat template:")
        for line in template.splitlines():
            w(f"  {line}")
    else:
        w("chat template: none")
    w()
    kv = d["kv_estimate"]
    w(f"KV cache estimate (f16 K and V, the default; x2 with --cache-type f32, x0.53 with q8_0; {info['n_layer']} layers x {info['n_head_kv']} KV heads "
      f"x head_dim {info['head_dim']}): {kv['bytes_per_token']:,} bytes per token")
    w("  policy full:")
    for n, b in kv["full"].items():
        tag = " (training context)" if n == info.get("n_ctx_train") else ""
        w(f"    n_ctx {n:>7}: {_mib(b):>14}{tag}")
    w("  with an eviction policy, budget B entries per (layer, KV head), whatever the prompt length:")
    for n, b in kv["budget"].items():
        w(f"    budget {n:>6}: {_mib(b):>14}")


def run_info(args) -> int:
    from ..pull import default_model_path, pull

    if args.system:
        _print_system()
    if args.policies:
        _print_policies()
    model = resolve_model_arg(args)
    if model is None and (args.system or args.policies):
        return EXIT_OK
    path = pull(model) if model else default_model_path()
    d = load_info(path, args.n_gpu_layers, args.main_gpu)
    if args.json:
        print(json.dumps(d, default=str, ensure_ascii=False, indent=1))
    else:
        if args.system or args.policies:
            print()
        print_info(d)
    return EXIT_OK
