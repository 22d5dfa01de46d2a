"""One timing run of one engine, printed as JSON; run by compare_llamacpp.py in a fresh process.

Prefill: evaluate n_prompt tokens at once. Decode: n_gen single-token steps after the prefill
(tg @ depth d evaluates d tokens first, untimed). --continue: decode right after the timed
prompt instead (time to first token, then n_gen steps: the long-prompt memory test). Token
ids are the same pseudo-random ids for both engines, as llama-bench does; sampling and
tokenization are not timed. The process's peak resident set is reported too."""
import argparse
import json
import random
import resource
import time


LLAMA_CPP_Q8_0 = 8   # ggml_type


def token_ids(n, n_vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, n_vocab - 100) for _ in range(n)]


def run_pykv(args):
    from pykv import Llama
    budget = None if args.policy == "full" else args.budget
    llm = Llama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_batch=args.n_batch,
                policy=args.policy, budget=budget, kv_type=args.cache_type, kv_type_v=args.cache_type_v)
    return llm, llm.n_vocab, llm.eval, llm.reset


def run_llamacpp(args):
    from llama_cpp import Llama
    ggml_type = {"f32": 0, "f16": 1, "q8_0": LLAMA_CPP_Q8_0}
    kv = dict(type_k=ggml_type[args.cache_type], type_v=ggml_type[args.cache_type_v])
    if args.cache_type_v == "q8_0":   # llama.cpp stores a quantized V only with flash attention on
        kv["flash_attn"] = True
    llm = Llama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=args.n_batch, n_ubatch=args.n_batch, verbose=False, **kv)
    return llm, llm.n_vocab(), llm.eval, llm.reset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["pykv", "llamacpp"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--policy", default="full", help="pykv's KV policy")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--cache-type", default="f16", choices=["f16", "f32", "q8_0"], help="K and V storage, both engines")
    p.add_argument("--cache-type-v", default=None, choices=["f16", "f32", "q8_0"], help="V storage (default: --cache-type)")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="decode right after the timed prompt (no reset)")
    args = p.parse_args()
    args.cache_type_v = args.cache_type_v or args.cache_type
    args.n_ctx = (args.n_prompt if args.cont else max(args.n_prompt, args.depth)) + args.n_gen + 16
    llm, n_vocab, evaluate, reset = (run_pykv if args.engine == "pykv" else run_llamacpp)(args)
    result = {"engine": args.engine}
    # warm-up: touch every weight page once
    evaluate(token_ids(8, n_vocab, 0))
    reset()
    if args.n_prompt:
        tokens = token_ids(args.n_prompt, n_vocab, 1)
        t0 = time.perf_counter()
        evaluate(tokens)
        result["ttft_s"] = time.perf_counter() - t0
        result["pp_tps"] = args.n_prompt / result["ttft_s"]
        if not args.cont:
            reset()
    if args.n_gen:
        if not args.cont:
            evaluate(token_ids(args.depth or 1, n_vocab, 2))
        steps = token_ids(args.n_gen, n_vocab, 3)
        t0 = time.perf_counter()
        for t in steps:
            evaluate([t])
        result["tg_tps"] = args.n_gen / (time.perf_counter() - t0)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


if __name__ == "__main__":
    main()
