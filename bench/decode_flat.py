"""Does decoding stay as fast at depth as at depth 0? Both measured in one process, interleaved.

    python bench/decode_flat.py --policies ems,cake --budget 256 --depth 7680 --blocks 24
    python bench/decode_flat.py --policies snapkv,adakv,lava,take --budget 256 --depth 512 --refill

`pykv bench -d 0,7680` measures depth 0 and then depth 7680 a minute later; on a shared machine
the load changes in between by more than the difference we look for. Here two contexts of the
same model run side by side: `deep` has evaluated --depth tokens (its policy compressed them to
the budget), `shallow` one token. The script alternates blocks of --steps single-token decode
steps between them (shallow, deep, shallow, ...), so both see the same load; `shallow` restarts
from one token before each block (untimed), so it decodes at depths 1..steps like tg32 at depth
0. A fixed-budget policy (ems, cake, streamingllm, h2o) keeps `deep` at its budget block after
block. A policy whose lists grow while decoding (snapkv, adakv, pyramidkv, lava, take: one
entry per step) would drift to longer lists; --refill re-evaluates the --depth tokens before
every deep block (untimed), so each block starts from the compressed prompt as tg32 @ dD does.
That costs a prefill per block: use it with a depth just past the budget (512 for 256), where
the lists are as long as after 7680 tokens (neither the positions nor n_ctx change a decode
step's work). Per block pair the ratio is deep t/s / shallow t/s; the figure is the median
over --blocks pairs with the spread (min..max), each side's median t/s, and the deep side's
entries before and after its first and last block. Token ids are pseudo-random (fixed seed),
as in `pykv bench`.
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pykv import Llama
from pykv.cli import KV_CACHE_TYPES
from pykv.eval.config import split_spec
from pykv.pull import pull

from compare_llamacpp import raise_priority   # bench/ is the script's directory


def tokens(n, n_vocab, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, n_vocab - 10) for _ in range(n)]


def timed_steps(llm, toks):
    t0 = time.perf_counter()
    for t in toks:
        llm.eval([t])
    return len(toks) / (time.perf_counter() - t0)


def measure(model, policy, args):
    budget = None if policy == "full" else args.budget
    n_steps = args.blocks * args.steps
    name, kwargs = split_spec(policy)
    kw = dict(n_threads=args.threads, policy=name, budget=budget, policy_kwargs=kwargs or None, kv_type=args.cache_type)
    deep_ctx = args.depth + (args.steps if args.refill else n_steps + args.steps) + 16
    with Llama(model, n_ctx=deep_ctx, **kw) as deep, Llama(model, n_ctx=args.steps + 16, **kw) as shallow:
        context = tokens(args.depth, deep.n_vocab, 1)
        t0 = time.perf_counter()
        deep.eval(context)
        print(f"decode_flat: {policy}: {args.depth}-token prefill {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        steps = tokens(n_steps + args.steps, deep.n_vocab, 2)
        timed_steps(deep, steps[:args.steps])   # warm-up, both sides
        shallow.eval(tokens(1, shallow.n_vocab, 3))
        timed_steps(shallow, steps[:args.steps])
        pairs, entries = [], []
        for b in range(args.blocks):
            block = steps[args.steps * (b + 1):args.steps * (b + 2)]
            shallow.reset()
            shallow.eval(tokens(1, shallow.n_vocab, 3))
            if args.refill:
                deep.reset()
                deep.eval(context)
            before = deep.kv_stats()["entries"]
            s = timed_steps(shallow, block)
            d = timed_steps(deep, block)
            pairs.append((s, d))
            entries.append((before, deep.kv_stats()["entries"]))
    ratios = [d / s for s, d in pairs]
    return {
        "policy": policy, "budget": budget, "depth": args.depth, "steps": args.steps, "blocks": args.blocks,
        "refill": args.refill,
        "shallow_tps": statistics.median(s for s, _ in pairs), "deep_tps": statistics.median(d for _, d in pairs),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "deep_entries": entries, "pairs": pairs,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF path (default: pykv pull smollm2)")
    p.add_argument("--policies", default="ems", help="comma separated; a policy's arguments follow its name: ems+tau=1")
    p.add_argument("--budget", default="256")
    p.add_argument("--depth", type=int, default=7680)
    p.add_argument("--steps", type=int, default=32, help="decode steps per block (tg32)")
    p.add_argument("--blocks", type=int, default=24, help="block pairs per policy")
    p.add_argument("--refill", action="store_true", help="re-evaluate the depth tokens before every deep block")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-type", default="f16", choices=KV_CACHE_TYPES, help="K and V storage, both sides")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    raise_priority()
    model = args.model
    if model is None:
        model = str(pull("smollm2"))
    rows = [measure(model, pol, args) for pol in args.policies.split(",") if pol]
    print(f"| policy | budget | t/s at depth 0 | t/s at depth {args.depth} | ratio, median (min..max) | "
          "deep entries, first and last block |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        (a0, a1), (z0, z1) = r["deep_entries"][0], r["deep_entries"][-1]
        print(f"| {r['policy']} | {r['budget'] or '-'} | {r['shallow_tps']:.1f} | {r['deep_tps']:.1f} | "
              f"{r['ratio']:.2f} ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) | {a0}->{a1}, {z0}->{z1} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
