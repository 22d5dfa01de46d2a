"""``pykv bench``: llama-bench's tests and table for pykv, with policy and budget sweeps.

Every list flag takes ``a,b,c`` and the cartesian product runs. Tests:
  ppN          prefill N tokens in one call (chunks of -b);
  tgN          N single-token decode steps after a one-token prompt;
  ... @ dD     the same after D tokens of context were evaluated first (untimed).
Token ids are pseudo-random (fixed seed), as in llama-bench; tokenization and sampling are
not timed. Each test runs -r times after a warm-up; t/s is the mean with its standard
deviation (llama-bench's "t/s ± sd"), plus the median. kv_MiB is the KV cache's allocation
after the test, peak_RSS_MiB the process's peak resident memory so far.
"""
from __future__ import annotations

import json
import random
import resource
import statistics
import sys
import time


def _ints(text: str, flag: str) -> list:
    try:
        return [int(x) for x in str(text).split(",") if x != ""]
    except ValueError:
        from .main import UsageError
        raise UsageError(f"{flag} takes integers separated by commas, got {text!r}") from None


def add_bench_parser(sub):
    p = sub.add_parser("bench", help="measure prefill and decode speed (llama-bench style)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="GGUF path or model name (default smollm2)")
    p.add_argument("-m", "--model", help="same as MODEL")
    p.add_argument("-p", "--n-prompt", default="512", help="prompt sizes (default 512); note: an integer here, "
                   "not the prompt text as in generate")
    p.add_argument("-n", "--n-gen", default="128", help="generated tokens (default 128)")
    p.add_argument("-d", "--n-depth", default="0", help="context depth before each test (default 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="runs per test (default 5)")
    p.add_argument("-t", "--threads", default=None, help="thread counts (default: physical cores)")
    p.add_argument("-b", "--batch-size", default="512", help="prefill chunk sizes (default 512)")
    p.add_argument("-ngl", "--n-gpu-layers", default="0",
                   help="layers on the GPU, as llama-bench's -ngl (default 0; 99 = all of the model)")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, help="the CUDA device (default 0)")
    p.add_argument("--policy", default="full", help="policies (default full)")
    p.add_argument("--budget", default="", help="budgets for evicting policies (entries or N%%); "
                   "separate several with commas")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                   help="a policy-specific option for the evicting policies (repeatable, as generate's); "
                        "rows show them after the policy's name")
    p.add_argument("--evict-every-chunk", action="store_true",
                   help="evicting policies cut the cache back to the budget after every prefill chunk "
                        "(as generate's flag); rows show the policy as POLICY+chunk")
    p.add_argument("--cache-type", default="",
                   help="KV cache types, keys and values alike: f16 (default), f32, q8_0")
    p.add_argument("-ctk", "--cache-type-k", default="",
                   help="the keys' cache types, as llama-bench's -ctk (default: --cache-type, else f16)")
    p.add_argument("-ctv", "--cache-type-v", default="",
                   help="the values' cache types, as llama-bench's -ctv (default: --cache-type, else f16)")
    p.add_argument("-o", "--output", choices=["md", "json", "jsonl"], default="md")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--progress", action="store_true", help="print each run on stderr")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(run="bench")


def _tokens(n: int, n_vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(10, n_vocab - 10) for _ in range(n)]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def _one_run(llm, kind: str, size: int, depth: int, seed: int) -> float:
    """Seconds of one timed test."""
    llm.reset()
    if depth:
        llm.eval(_tokens(depth, llm.n_vocab, seed + 1))
    if kind == "pp":
        tokens = _tokens(size, llm.n_vocab, seed)
        t0 = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - t0
    if not depth:
        llm.eval(_tokens(1, llm.n_vocab, seed + 2))
    steps = _tokens(size, llm.n_vocab, seed)
    t0 = time.perf_counter()
    for t in steps:
        llm.eval([t])
    return time.perf_counter() - t0


def run_bench(args, model_path: str) -> int:
    from ..llama import Llama
    prompts, gens = _ints(args.n_prompt, "-p"), _ints(args.n_gen, "-n")
    depths, batches = _ints(args.n_depth, "-d"), _ints(args.batch_size, "-b")
    threads = _ints(args.threads, "-t") if args.threads else [None]
    gpu_layers = _ints(args.n_gpu_layers, "-ngl") or [0]
    policies = [p for p in args.policy.split(",") if p]
    budgets = [b for b in args.budget.split(",") if b] or [None]
    from .generate import parse_policy_args
    policy_kwargs = parse_policy_args(args.policy_arg)
    args_label = ",".join(f"{k}={v}" for k, v in policy_kwargs.items())
    from .main import KV_CACHE_TYPES, UsageError
    def types(flag, text):
        names = [c.lower() for c in text.split(",") if c]
        if any(c not in KV_CACHE_TYPES for c in names):
            raise UsageError(f"{flag} takes {', '.join(KV_CACHE_TYPES[:-1])} or {KV_CACHE_TYPES[-1]} separated by "
                             f"commas, got {text!r}")
        return names
    both = types("--cache-type", args.cache_type)
    keys, values = types("-ctk", args.cache_type_k), types("-ctv", args.cache_type_v)
    if keys or values:   # as llama-bench: every key type with every value type
        pairs = [(k, v) for k in keys or both or ["f16"] for v in values or both or ["f16"]]
    else:                # --cache-type sweeps the two together
        pairs = [(c, c) for c in both or ["f16"]]
    tests = [("pp", n) for n in prompts if n > 0] + [("tg", n) for n in gens if n > 0]
    rows = []
    for policy, (kv_type, kv_type_v) in ((p, c) for p in policies for c in pairs):
        for budget in (budgets if policy != "full" else [None]):
            for n_threads, ngl in ((t, g) for t in threads for g in gpu_layers):
                for n_batch in batches:
                    for depth in depths:
                        n_ctx = depth + max([n for _, n in tests] or [1]) + 16
                        every_chunk = args.evict_every_chunk and policy != "full"
                        kwargs = policy_kwargs if policy != "full" and policy_kwargs else None
                        with Llama(model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch,
                                   policy=policy, budget=budget, kv_type=kv_type, kv_type_v=kv_type_v,
                                   evict_every_chunk=every_chunk, n_gpu_layers=ngl, main_gpu=args.main_gpu,
                                   policy_kwargs=kwargs) as llm:
                            if not args.no_warmup:
                                llm.eval(_tokens(min(16, n_ctx - 1), llm.n_vocab, 99))
                            for kind, size in tests:
                                speeds = []
                                for rep in range(args.repetitions):
                                    sec = _one_run(llm, kind, size, depth, seed=rep)
                                    speeds.append(size / sec)
                                    if args.progress:
                                        print(f"pykv bench: {kind}{size} d{depth} {policy} rep {rep + 1}: "
                                              f"{speeds[-1]:.1f} t/s", file=sys.stderr)
                                kv = llm.kv_stats()
                                rows.append({
                                    "model": llm.model_path.rsplit("/", 1)[-1],
                                    "test": f"{kind}{size}" + (f" @ d{depth}" if depth else ""),
                                    "policy": policy + (f"[{args_label}]" if kwargs else "") +
                                              ("+chunk" if every_chunk else ""),
                                    "budget": budget, "type_k": kv_type, "type_v": kv_type_v,
                                    "threads": llm.n_threads, "n_gpu_layers": llm.model_info["n_gpu_layers"],
                                    "n_batch": n_batch, "t_s": statistics.mean(speeds),
                                    "t_s_sd": statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
                                    "t_s_median": statistics.median(speeds),
                                    "kv_MiB": kv["bytes"] / 2**20, "kv_peak_MiB": kv["peak_bytes"] / 2**20, "evicted": kv["evicted"],
                                    "peak_RSS_MiB": _peak_rss_mib(), "samples": speeds,
                                })
                                if args.output == "jsonl":   # a row as it is measured, as llama-bench
                                    print(json.dumps(rows[-1]), flush=True)
    if args.output != "jsonl":
        _print(rows, args.output)
    return 0


def _print(rows, form):
    if form == "json":
        print(json.dumps(rows, indent=1))
        return
    # a column only when not the default, as llama-bench
    types = [t for t in ("type_k", "type_v") if any(r[t] != "f16" for r in rows)]
    types += ["n_gpu_layers"] if any(r["n_gpu_layers"] for r in rows) else []
    print("| test | policy | budget | " + "".join(f"{'ngl' if t == 'n_gpu_layers' else t} | " for t in types) +
          "threads | n_batch | t/s | median | kv_MiB | evicted | peak_RSS_MiB |")
    print("|---|---|---|" + "---|" * len(types) + "---|---|---|---|---|---|---|")
    for r in rows:
        kv = "".join(f"{r[t]} | " for t in types)
        print(f"| {r['test']} | {r['policy']} | {r['budget'] or '-'} | {kv}{r['threads']} | {r['n_batch']} | "
              f"{r['t_s']:.2f} ± {r['t_s_sd']:.2f} | {r['t_s_median']:.2f} | {r['kv_MiB']:.2f} | "
              f"{r['evicted']} | {r['peak_RSS_MiB']:.0f} |")
