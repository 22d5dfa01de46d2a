"""Where did the needle go? For `pykv eval needle` samples, the share of (layer, KV head) lists
that still hold each of the passkey's tokens once the prompt is in, per policy, in three layer
bands, next to the answer. It separates "evicted the needle" from "kept it but the model did
not use it", and shows which digits go first.

    python bench/needle_retention.py --length 1024 --budget 25% --samples 3 --policies snapkv,take
    python bench/needle_retention.py --length 2048 --budget 10% --setting agnostic --seed 100

Rows: policy, sample, the needle's first position / context length, per digit the share of
all lists holding it, per layer band the share of lists holding every digit, the answer.
"""
import argparse

from pykv import Llama, list_policies
from pykv.eval import parse_budgets
from pykv.eval.needle import answer
from pykv.eval.samples import depth_of, make_needle_sample
from pykv.pull import pull


def needle_positions(llm, sample):
    """Positions in the context of the passkey's tokens: the run of tokens that spells it."""
    ids = sample.context
    for start in range(len(ids)):
        text = ""
        for end in range(start, min(start + 12, len(ids))):
            text += llm.detokenize([ids[end]]).decode("utf-8", "replace")
            if sample.passkey in text.replace(" ", ""):
                return list(range(start, end + 1)) if text.strip().startswith(sample.passkey[0]) else []
            if not sample.passkey.startswith(text.strip()):
                break
    return []


def retention(llm, positions):
    """Per needle token the share of lists that hold it; per third of the layers the share
    of lists that hold all of them."""
    per_head = llm.kv_stats()["entries_per_head"]
    n_layer = len(per_head)
    per_token = [0] * len(positions)
    bands = [[], [], []]
    n_lists = 0
    for layer in range(n_layer):
        for head in range(len(per_head[layer])):
            kept = set(llm.kv_positions(layer, head))
            n_lists += 1
            for i, p in enumerate(positions):
                per_token[i] += p in kept
            bands[min(2, 3 * layer // n_layer)].append(all(p in kept for p in positions))
    return [c / n_lists for c in per_token], [sum(b) / len(b) for b in bands]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--budget", default="25%", help="share of the context (10%%) or entries")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depths", default="10,30,50,70,90")
    ap.add_argument("--policies", default=",".join(p for p in list_policies() if p != "full"))
    ap.add_argument("--setting", default="aware", choices=["aware", "agnostic"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or str(pull("smollm2"))
    (budget,) = parse_budgets(args.budget)
    depths = [float(d) / 100 for d in args.depths.split(",")]
    with Llama(model, n_ctx=args.length + 64, vocab_only=True) as tok:
        samples = [make_needle_sample(tok, args.length, i, depth_of(i, depths), args.seed) for i in range(args.samples)]
        needles = [needle_positions(tok, s) for s in samples]
    print("| policy | sample | needle at | digits kept (share of lists) | all digits: layers 1/3, 2/3, 3/3 | answer |")
    print("|---|---|---|---|---|---|")
    for policy in ["full"] + args.policies.split(","):
        for sample, pos in zip(samples, needles):
            entries = None if policy == "full" else budget.of(len(sample.context))
            with Llama(model, n_ctx=sample.n_prompt + 32, n_threads=args.threads, policy=policy, budget=entries) as llm:
                if args.setting == "agnostic":
                    llm.reset()
                    llm.eval(sample.context)
                    per_token, bands = retention(llm, pos)
                    text, _ = _answer_after_question(llm, sample)
                else:
                    text, _ = answer(llm, sample, "aware", 24)
                    per_token, bands = retention(llm, pos)
            mark = "hit" if sample.hit(text) else f"miss ({text.strip()[-24:]!r})"
            where = f"{pos[0]}/{len(sample.context)}" if pos else "?"
            print(f"| {policy} | {sample.index} | {where} | {' '.join(f'{100 * k:.0f}' for k in per_token)} | "
                  f"{' / '.join(f'{100 * b:.0f}%' for b in bands)} | {mark} |", flush=True)


def _answer_after_question(llm, sample):
    """The rest of answer()'s agnostic path, after the context is in."""
    import numpy as np
    llm.eval(sample.question)
    out = []
    for _ in range(24):
        tok = int(np.argmax(llm.logits()))
        if llm.is_eog(tok):
            break
        out.append(tok)
        llm.eval([tok])
    return llm.detokenize(out).decode("utf-8", "replace"), None


if __name__ == "__main__":
    main()
