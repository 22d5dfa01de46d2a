"""What the sampler's filters cost per token without a top-k (top_k=0 hands the whole
vocabulary to top-p and typical sampling): one draw from 49,152 random logits (a flat,
worst-case distribution), and SmolLM2's decode speed with the reply's real logits.

    python bench/sampler_cost.py --model M.gguf --threads 2 --reps 5

Medians of --reps with the spread (min..max)."""
import argparse
import statistics
import time

import numpy as np

from pykv import Llama
from pykv._ffi import ffi, lib
from pykv._sampling import make_sampler

CONFIGS = [dict(), dict(typical_p=0.9), dict(top_k=0, top_p=1.0, min_p=0.0), dict(top_k=0),
           dict(top_k=0, typical_p=0.9), dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=0.9)]


def spread(values, fmt):
    return f"{fmt % statistics.median(values)} ({fmt % min(values)}..{fmt % max(values)})"


def draw_ms(cfg, reps, n=100):
    logits = np.random.default_rng(1).normal(0, 2, 49152).astype(np.float32)
    buf, out = ffi.from_buffer("float[]", logits), ffi.new("pykv_token *")
    sampler = make_sampler(seed=1, **cfg)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            lib.pykv_sampler_sample(sampler, buf, len(logits), out)
        times.append((time.perf_counter() - start) / n * 1e3)
    return times


def decode_tps(llm, cfg, reps, n=64):
    prompt = "Write a short story about a robot who learns to paint."
    speeds = []
    for r in range(reps):
        llm.reset()
        llm.eval(llm.tokenize(prompt))   # the prompt is kept: the timing is the decode loop
        start = time.perf_counter()
        llm.generate(prompt, max_tokens=n, ignore_eos=True, seed=r, **cfg)
        speeds.append(n / (time.perf_counter() - start))
    return speeds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llm = Llama(args.model, n_ctx=512, n_threads=args.threads)
    print("| settings (defaults otherwise) | ms per draw, 49,152 random logits | SmolLM2 decode tok/s |")
    print("|---|---|---|")
    for cfg in CONFIGS:
        name = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "defaults (top_k=40)"
        print(f"| {name} | {spread(draw_ms(cfg, args.reps), '%.3f')} | "
              f"{spread(decode_tps(llm, cfg, args.reps), '%.1f')} |", flush=True)


if __name__ == "__main__":
    main()
