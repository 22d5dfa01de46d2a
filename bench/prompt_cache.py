"""Time to first token for a long document with and without `pykv generate --prompt-cache`:
each run is a fresh `pykv generate -n 1` process (model load included), alternating a cold
run (no cache file: the prompt is evaluated and saved) and a warm one (the file is read and
nothing is evaluated), and a run with the document plus a new question (the document's
tokens come from the file, the question's are evaluated; with an evicting policy the file is
of the document alone, so the question's run evaluates everything again).

    python bench/prompt_cache.py --model M.gguf --words 6000 --threads 2 --reps 3
    python bench/prompt_cache.py --model M.gguf --words 6000 --policy take --budget 256

Reported: median wall seconds per kind (with the spread), the prompt's tokens, the cache
file's size, and warm / cold.
"""
import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_turns import document  # noqa: E402
from compare_llamacpp import raise_priority  # noqa: E402


def run(args, prompt_file, cache):
    cmd = [sys.executable, "-m", "pykv", "generate", args.model, "-f", str(prompt_file), "-n", "1", "--temp", "0",
           "-t", str(args.threads), "-c", str(args.n_ctx), "--no-display-prompt", "--prompt-cache", str(cache),
           "--policy", args.policy]
    if args.budget:
        cmd += ["--budget", str(args.budget)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"pykv generate failed:\n{r.stderr}")
    reused = re.search(r"prompt cache: (\d+) of (\d+)", r.stderr)
    return seconds, int(reused.group(1)), int(reused.group(2))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--words", type=int, default=6000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=8448)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--policy", default="full")
    p.add_argument("--budget", type=int, default=0)
    args = p.parse_args()
    raise_priority()
    with tempfile.TemporaryDirectory() as tmp:
        doc, question, cache = Path(tmp) / "doc.txt", Path(tmp) / "question.txt", Path(tmp) / "doc.cache"
        doc.write_text(document(args.words))
        question.write_text(document(args.words) + "\nWhat did Ada count each morning?")
        times = {"cold": [], "warm": [], "new question": []}
        for _ in range(args.reps):
            cache.unlink(missing_ok=True)
            s, _, n_prompt = run(args, doc, cache)
            times["cold"].append(s)
            size = cache.stat().st_size
            s, reused, _ = run(args, doc, cache)
            assert reused == n_prompt, (reused, n_prompt)
            times["warm"].append(s)
            s, reused_q, n_q = run(args, question, cache)
            times["new question"].append(s)
    print(f"policy {args.policy}{f' budget {args.budget}' if args.budget else ''}: prompt {n_prompt} tokens "
          f"({args.words} words), cache file {size / 2**20:.2f} MiB, {args.threads} threads, {args.reps} runs "
          f"each; the question run reuses {reused_q} of {n_q}")
    print("| run | seconds, median (min..max) |")
    print("|---|---|")
    for kind, values in times.items():
        print(f"| {kind} | {statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f}) |")
    print(f"warm / cold: {statistics.median(times['warm']) / statistics.median(times['cold']):.3f}")


if __name__ == "__main__":
    main()
