"""Needle-in-a-haystack retrieval and KL divergence: the full cache against every policy.

    python bench/needle.py --lengths 2048,4096,7168 --budgets 2,5,10,25 --samples 5
    python bench/needle.py --lengths 2048 --policies full,snapkv,take --budgets 10 --samples 2

Haystack: licence texts shipped with Debian (/usr/share/common-licenses: GPL-3, Apache-2.0,
...), repeated and cut to the length asked. Needle: "The secret passkey is NNNNN." at a
depth that varies with the sample. Question: "What is the secret passkey?", asked through the
model's chat template; greedy decoding of 24 tokens (SmolLM2 spells digits one token each); a hit is the passkey's digits in the
answer.

Two settings (docs/policies.md#question-aware-and-question-agnostic-use):
  aware    - one eval() of the whole prompt, question included (the policy sees it);
  agnostic - eval(context) then eval(question): the context is compressed before the
             question is known.
Budgets are percentages of the context length (entries per layer and KV head).

KL: the mean KL(full || policy) of next-token distributions over --kl-tokens tokens of licence
text, teacher-forced after a --kl-prefix-token prefill that the policy compresses (the full
cache's distributions are computed once). --kl-only runs the KL table without needle cells.
Results print as markdown tables (stdout) and, with --json, as one JSON object.
"""
import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np

from pykv import Llama, list_policies
from pykv.pull import pull

LICENSES = Path("/usr/share/common-licenses")
FALLBACK_WORDS = ("the license grants each licensee a worldwide royalty free right to use copy modify merge "
                  "publish distribute sublicense and sell copies of the software subject to these conditions").split()


def haystack_text() -> str:
    texts = []
    for name in ("GPL-3", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "Artistic"):
        p = LICENSES / name
        if p.is_file():
            texts.append(p.read_text(errors="replace"))
    if texts:
        return "\n\n".join(texts)
    rng = random.Random(0)   # no licence files: deterministic filler
    return " ".join(rng.choice(FALLBACK_WORDS) for _ in range(20000))


def render_chat(llm, user: str) -> str:
    """The user's message in the model's chat template, ready for the assistant's answer."""
    import jinja2.sandbox
    template = llm.chat_template
    if not template:
        return user
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    return env.from_string(template).render(messages=[{"role": "user", "content": user}],
                                            add_generation_prompt=True)


class Task:
    def __init__(self, llm, n_tokens: int, sample: int):
        rng = random.Random(1000 * n_tokens + sample)
        self.passkey = str(rng.randrange(10000, 99999))
        depth = [0.1, 0.3, 0.5, 0.7, 0.9][sample % 5]
        question = "\n\nWhat is the secret passkey mentioned in the text above? Answer with the number only."
        needle = f" The secret passkey is {self.passkey}. Remember it. "
        words = re.findall(r"\S+\s*", haystack_text())
        # grow the document until the prompt reaches the target length
        lo, hi = 50, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._tokens(llm, words[:mid], needle, depth, question)[0]) + 30 <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        self.context, self.question = self._tokens(llm, words[:lo], needle, depth, question)

    @staticmethod
    def _tokens(llm, words, needle, depth, question):
        cut = int(len(words) * depth)
        doc = "".join(words[:cut]) + needle + "".join(words[cut:])
        full = render_chat(llm, doc + question)
        head = full[:full.index(question)] if question in full else full
        ctx = llm.tokenize(head, add_bos=True, special=True)
        q = llm.tokenize(full[len(head):], add_bos=False, special=True)
        return ctx, q

    def hit(self, answer: str) -> bool:
        return self.passkey in re.sub(r"\D", "", answer)


def answer(llm, task: Task, aware: bool, n_new: int = 24) -> str:
    llm.reset()
    if aware:
        llm.eval(task.context + task.question)
    else:
        llm.eval(task.context)
        llm.eval(task.question)
    out = []
    for _ in range(n_new):
        tok = int(np.argmax(llm.logits()))
        if llm.is_eog(tok):
            break
        out.append(tok)
        llm.eval([tok])
    return llm.detokenize(out).decode("utf-8", "replace")


def policy_spec(spec: str):
    """'cake' or 'cake+decode_evict=none+gamma=0' -> (name, policy_kwargs or None)."""
    name, *args = spec.split("+")
    return name, dict(a.split("=", 1) for a in args) or None


def teacher_forced_distributions(llm, follow):
    """The next-token distribution before each of the follow tokens, evaluated one at a time
    after what llm already holds."""
    rows = []
    for t in follow:
        z = llm.logits().astype(np.float64)
        z -= z.max()
        p = np.exp(z)
        rows.append(p / p.sum())
        llm.eval([t])
    return np.array(rows)


def next_token_distributions(model, policy, budget, prefix, follow, threads):
    """The next-token distribution before each teacher-forced token after a compressed prefix."""
    name, kwargs = policy_spec(policy)
    with Llama(model, n_ctx=len(prefix) + len(follow) + 8, n_threads=threads, policy=name, budget=budget,
               policy_kwargs=kwargs) as llm:
        llm.eval(prefix)
        return teacher_forced_distributions(llm, follow)


def kl_divergence(p, q):
    """Mean KL(p || q) over rows of next-token distributions."""
    return float(np.mean(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)), axis=1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: pykv pull smollm2)")
    ap.add_argument("--lengths", default="2048,4096,7168")
    ap.add_argument("--budgets", default="2,5,10,25", help="percent of the context")
    ap.add_argument("--policies", default=",".join(list_policies()),
                    help="comma list; a policy's arguments follow its name: cake+decode_evict=none+gamma=0")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--first-sample", type=int, default=0,
                    help="sample index to start at (another run's samples continue from its last)")
    ap.add_argument("--settings", default="aware,agnostic")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kl-prefix", type=int, default=2048)
    ap.add_argument("--kl-tokens", type=int, default=64)
    ap.add_argument("--no-kl", action="store_true")
    ap.add_argument("--kl-only", action="store_true", help="the KL table alone, no needle cells")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()
    model = args.model or str(pull("smollm2"))
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    policies = args.policies.split(",")
    settings = args.settings.split(",")
    samples = range(args.first_sample, args.first_sample + (0 if args.kl_only else args.samples))
    results = {"model": os.path.basename(model), "samples": len(samples), "sample_ids": list(samples),
               "accuracy": {}, "hits": {}, "kl": {}}
    t0 = time.time()
    with Llama(model, n_ctx=max(lengths) + 64, n_threads=args.threads) as tok_llm:
        tasks = {n: [Task(tok_llm, n, s) for s in samples] for n in lengths}
    for policy in (policies if samples else []):
        for pct in ([None] if policy == "full" else budgets):
            for n in lengths:
                for setting in settings:
                    hit_ids = []
                    for sample, task in zip(samples, tasks[n]):
                        budget = None if pct is None else max(1, int(round(len(task.context) * pct / 100)))
                        try:
                            name, kwargs = policy_spec(policy)
                            with Llama(model, n_ctx=n + 64, n_threads=args.threads, policy=name, budget=budget,
                                       policy_kwargs=kwargs) as llm:
                                if task.hit(answer(llm, task, setting == "aware")):
                                    hit_ids.append(sample)
                        except Exception as e:   # a budget below a policy's window, say
                            print(f"# {policy} {pct}% {n} {setting}: {e}", file=sys.stderr)
                    key = f"{policy}|{pct}|{n}|{setting}"
                    results["accuracy"][key] = len(hit_ids) / len(tasks[n])
                    results["hits"][key] = hit_ids   # which samples, so runs over other samples can be pooled
                    print(f"{key}: {len(hit_ids)}/{len(tasks[n])} {hit_ids}  ({time.time() - t0:.0f}s)",
                          file=sys.stderr, flush=True)
                    save(args.json, results)   # a long run that is stopped keeps what it measured
    if not args.no_kl:
        text = haystack_text()
        with Llama(model, n_ctx=args.kl_prefix + args.kl_tokens + 8, n_threads=args.threads) as llm:
            ids = llm.tokenize(text, add_bos=True)[: args.kl_prefix + args.kl_tokens]
        prefix, follow = ids[: args.kl_prefix], ids[args.kl_prefix:]
        full = next_token_distributions(model, "full", None, prefix, follow, args.threads)   # once for every cell
        for policy in policies:
            if policy == "full":
                continue
            for pct in budgets:
                budget = max(1, int(round(len(prefix) * pct / 100)))
                try:
                    q = next_token_distributions(model, policy, budget, prefix, follow, args.threads)
                    results["kl"][f"{policy}|{pct}"] = kl_divergence(full, q)
                    save(args.json, results)
                except Exception as e:
                    print(f"# KL {policy} {pct}%: {e}", file=sys.stderr)
    print_tables(results, policies, budgets, lengths, settings)
    save(args.json, results)


def save(path, results):
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def print_tables(results, policies, budgets, lengths, settings):
    acc = results["accuracy"]
    for setting in (settings if acc else []):
        print(f"\n### Needle retrieval, question-{setting} ({results['samples']} samples per cell)\n")
        cols = [f"{n} @ {b}%" for n in lengths for b in budgets]
        print("| policy | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for policy in policies:
            cells = []
            for n in lengths:
                for b in budgets:
                    v = acc.get(f"{policy}|{None if policy == 'full' else b}|{n}|{setting}")
                    cells.append("-" if v is None else f"{100 * v:.0f}%")
            print(f"| {policy} | " + " | ".join(cells) + " |")
    if results["kl"]:
        print("\n### Mean KL(full || policy) of next-token distributions (nats)\n")
        print("| policy | " + " | ".join(f"{b}%" for b in budgets) + " |")
        print("|---|" + "---|" * len(budgets))
        for policy in policies:
            if policy != "full":
                cells = [results["kl"].get(f"{policy}|{b}") for b in budgets]
                print(f"| {policy} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
