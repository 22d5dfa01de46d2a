"""Peak memory and time to first token of a long prefill, per policy, each in a fresh process.

    python bench/peak_memory.py --n-prompt 8192 --budget 256 --policies full,snapkv,take

Each policy runs in its own child process, so the process's peak resident set (ru_maxrss)
is that policy's alone. Reported: peak RSS, the KV cache's peak and final bytes (kv_stats),
and the prefill time (time to first token) of an --n-prompt token licence-text prompt.
"""
import argparse
import json
import resource
import subprocess
import sys
import time


def child(args):
    from pykv import Llama
    from pykv.eval import haystack_text
    with Llama(args.model, n_ctx=args.n_prompt + 16, n_threads=args.threads, n_batch=args.n_batch,
               policy=args.policy, budget=None if args.policy == "full" else args.budget) as llm:
        tokens = llm.tokenize(haystack_text() * 4, add_bos=True)[: args.n_prompt]
        t0 = time.perf_counter()
        llm.eval(tokens)
        ttft = time.perf_counter() - t0
        kv = llm.kv_stats()
    print(json.dumps({"policy": args.policy, "ttft_s": ttft, "kv_peak_MiB": kv["peak_bytes"] / 2**20,
                      "kv_MiB": kv["bytes"] / 2**20,
                      "peak_RSS_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n-prompt", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--policies", default="full,snapkv,take")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from pykv.pull import pull
        args.model = str(pull("smollm2"))
    if args.policy:
        child(args)
        return
    print(f"| policy | prefill {args.n_prompt} (s) | peak RSS MiB | KV peak MiB | KV after MiB |")
    print("|---|---|---|---|---|")
    for policy in args.policies.split(","):
        cmd = [sys.executable, __file__, "--policy", policy, "--model", args.model, "--n-prompt", str(args.n_prompt),
               "--budget", str(args.budget), "--threads", str(args.threads), "--n-batch", str(args.n_batch)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(f"| {policy} | {r['ttft_s']:.1f} | {r['peak_RSS_MiB']:.0f} | {r['kv_peak_MiB']:.1f} | {r['kv_MiB']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
