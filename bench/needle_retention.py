"""Where did the needle go? For needle tasks (bench/needle.py), the share of (layer, KV head)
lists that still hold the passkey's tokens after the prompt, per policy, in three layer bands,
next to whether the answer was right. It separates "evicted the needle" from "kept it but
the model did not use it".

    python bench/needle_retention.py --length 1024 --budget 25 --samples 3
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from needle import Task, answer  # noqa: E402

from pykv import Llama, list_policies  # noqa: E402
from pykv.pull import pull  # noqa: E402


def needle_positions(llm, task):
    """Positions in the prompt of the passkey's digit tokens."""
    digits = {t for t in llm.tokenize(task.passkey, add_bos=False) if llm.detokenize([t]).strip().isdigit()}
    ids = task.context
    hits = [i for i, t in enumerate(ids) if t in digits]
    # the passkey's digits are consecutive: keep the longest run
    runs, cur = [], []
    for i in hits:
        if cur and i != cur[-1] + 1:
            runs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        runs.append(cur)
    return max(runs, key=len) if runs else []


def retention(llm, positions):
    """Share of lists holding every needle position, per third of the layers."""
    per_head = llm.kv_stats()["entries_per_head"]
    n_layer = len(per_head)
    bands = [[], [], []]
    for layer in range(n_layer):
        for head in range(len(per_head[layer])):
            kept = set(llm.kv_positions(layer, head))
            bands[min(2, 3 * layer // n_layer)].append(all(p in kept for p in positions))
    return [float(np.mean(b)) for b in bands]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=25.0, help="percent of the context")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--policies", default=",".join(p for p in list_policies() if p != "full"))
    ap.add_argument("--agnostic", action="store_true", help="question after compression")
    args = ap.parse_args()
    model = args.model or str(pull("smollm2"))
    with Llama(model, n_ctx=args.length + 64) as tok_llm:
        tasks = [Task(tok_llm, args.length, s) for s in range(args.samples)]
        needles = [needle_positions(tok_llm, t) for t in tasks]
    print(f"| policy | sample | needle at | kept: layers 1-10 / 11-20 / 21-30 | answer |")
    print("|---|---|---|---|---|")
    for policy in ["full"] + args.policies.split(","):
        for s, (task, pos) in enumerate(zip(tasks, needles)):
            budget = None if policy == "full" else max(1, round(len(task.context) * args.budget / 100))
            with Llama(model, n_ctx=args.length + 64, policy=policy, budget=budget) as llm:
                if args.agnostic:
                    llm.eval(task.context)
                    kept = retention(llm, pos)
                    out = answer_after(llm, task)
                else:
                    out = answer(llm, task, aware=True)
                    kept = retention(llm, pos)
            mark = "hit" if task.hit(out) else f"miss ({out.strip()[:20]!r})"
            where = f"{pos[0]}/{len(task.context)}" if pos else "?"
            print(f"| {policy} | {s} | {where} | {' / '.join(f'{100 * k:.0f}%' for k in kept)} | {mark} |", flush=True)


def answer_after(llm, task, n_new=24):
    llm.eval(task.question)
    out = []
    for _ in range(n_new):
        tok = int(np.argmax(llm.logits()))
        if llm.is_eog(tok):
            break
        out.append(tok)
        llm.eval([tok])
    return llm.detokenize(out).decode("utf-8", "replace")


if __name__ == "__main__":
    main()
