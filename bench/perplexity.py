"""Perplexity under each KV cache policy and budget, next to llama.cpp's full-cache figure.

    python bench/perplexity.py --model M.gguf --llamacpp-python /tmp/lcpp-venv/bin/python \\
        --chunk 1024 --chunks 4 --budgets 128,256 --threads 2

The text is pykv eval's haystack (pykv/eval/data), cut into
llama-perplexity's chunks (pykv.perplexity). llama.cpp's figure comes from llama-cpp-python
on the same GGUF and tokens (logits_all=True, each chunk from an empty context, its second
half scored), computed the same way: the two full-cache figures should agree to the
quantised paths' rounding. Each policy then runs on the same chunks, with the second half
as one more prefill ("prefill") and as decode steps ("decode").
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_llamacpp import raise_priority  # noqa: E402

from pykv import Llama, list_policies  # noqa: E402
from pykv.eval import haystack_text  # noqa: E402
from pykv.perplexity import perplexity  # noqa: E402

LLAMACPP_SCRIPT = r"""
import json, math, sys
import numpy as np
from llama_cpp import Llama
model, chunk, n_chunks, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokens = json.loads(sys.stdin.read())
llm = Llama(model, n_ctx=chunk, n_batch=512, logits_all=True, n_threads=threads, verbose=False)
nll = []
for i in range(n_chunks):
    c = tokens[i * chunk:(i + 1) * chunk]
    llm.reset()
    llm.eval(c)
    rows = np.asarray(llm.scores[:chunk], dtype=np.float64)
    for j in range(chunk // 2, chunk - 1):
        x = rows[j] - rows[j].max()
        nll.append(math.log(np.exp(x).sum()) - x[c[j + 1]])
nll = np.array(nll)
print(json.dumps({"ppl": math.exp(nll.mean()), "n_scored": len(nll)}))
"""


def llamacpp_ppl(args, tokens):
    r = subprocess.run([args.llamacpp_python, "-c", LLAMACPP_SCRIPT, args.model, str(args.chunk), str(args.chunks),
                        str(args.threads)], input=json.dumps(tokens), capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def pykv_ppl(args, tokens, policy, budget, decode):
    with Llama(args.model, n_ctx=args.chunk, n_threads=args.threads, policy=policy,
               budget=budget if policy != "full" else None) as llm:
        t0 = time.perf_counter()
        res = perplexity(llm, tokens, chunk_size=args.chunk, max_chunks=args.chunks, decode=decode)
        return res, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--llamacpp-python", default=None, help="python of the environment with llama-cpp-python")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--budgets", default="128,256")
    p.add_argument("--policies", default=",".join(n for n in list_policies() if n != "full"))
    p.add_argument("--modes", default="prefill,decode")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    raise_priority()
    with Llama(args.model, vocab_only=True) as vocab:
        tokens = vocab.tokenize(haystack_text(), add_bos=True)
    need = args.chunk * args.chunks
    if len(tokens) < need:
        sys.exit(f"the text has {len(tokens)} tokens, fewer than {args.chunks} chunks of {args.chunk}")
    tokens = tokens[:need]
    print(f"{args.chunks} chunks of {args.chunk} tokens, {args.chunks * (args.chunk // 2 - 1)} scored, "
          f"{args.threads} threads, {Path(args.model).name}\n")
    print("| policy | budget | mode | PPL | vs full | seconds |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    if args.llamacpp_python:
        ref = llamacpp_ppl(args, tokens)
        print(f"| llama.cpp full | - | prefill | {ref['ppl']:.4f} | | |")
    base = {}
    for mode in args.modes.split(","):
        res, secs = pykv_ppl(args, tokens, "full", None, mode == "decode")
        base[mode] = res.ppl
        print(f"| full | - | {mode} | {res.ppl:.4f} +/- {res.ppl_err:.4f} | 1.000 | {secs:.1f} |", flush=True)
    for policy in args.policies.split(","):
        for budget in args.budgets.split(","):
            for mode in args.modes.split(","):
                res, secs = pykv_ppl(args, tokens, policy, budget, mode == "decode")
                print(f"| {policy} | {budget} | {mode} | {res.ppl:.4f} | {res.ppl / base[mode]:.3f} | {secs:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
