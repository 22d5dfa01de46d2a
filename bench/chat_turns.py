"""A multi-turn chat on one model: seconds per turn for pykv (keeping the earlier turns, the
default with `full`), pykv starting afresh every turn (reset(), what an evicting policy does)
and llama-cpp-python (which keeps the earlier turns too), run alternately in fresh processes.

    python bench/chat_turns.py --model M.gguf --threads 2 --reps 3 \
        --llamacpp-python /path/to/venv/bin/python

The conversation: a system message carrying a document of --doc-words words, then --turns
short questions, each reply greedy and capped at --reply tokens. A turn's time is
create_chat_completion's wall time (its prompt evaluation and its reply). Reported: the median
over --reps runs of each turn and of the whole conversation, and the ratios.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_llamacpp import raise_priority  # noqa: E402

QUESTIONS = ["Summarise the document in one sentence.", "Who is mentioned first?", "What happened next?",
             "Name one place from the text.", "What is the mood of the text?", "Give it a title."]
WORDS = ("the river town kept its old mill while travellers from the coast brought salt wool and news "
         "of storms a miller named Ada counted sacks each morning and wrote letters to her brother in the "
         "hills about prices weather and the slow repair of the stone bridge").split()


def document(n_words):
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words)) + "."


def converse(engine, args):
    """Run the conversation once in this process; one JSON line per turn."""
    if engine == "llamacpp":
        from llama_cpp import Llama
        llm = Llama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                    verbose=False)
    else:
        from pykv import Llama
        llm = Llama(args.model, n_ctx=args.n_ctx, n_threads=args.threads)
    messages = [{"role": "system", "content": "Answer from this document.\n" + document(args.doc_words)}]
    turns = []
    for question in QUESTIONS[:args.turns]:
        messages.append({"role": "user", "content": question})
        if engine == "pykv-afresh":
            llm.reset()
        t0 = time.perf_counter()
        out = llm.create_chat_completion(messages, temperature=0.0, max_tokens=args.reply)
        turns.append({"s": time.perf_counter() - t0, "prompt_tokens": out["usage"]["prompt_tokens"]})
        messages.append(out["choices"][0]["message"])
    print(json.dumps(turns))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--turns", type=int, default=len(QUESTIONS))
    p.add_argument("--doc-words", type=int, default=1200)
    p.add_argument("--reply", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--llamacpp-python", help="interpreter of an environment with llama-cpp-python")
    p.add_argument("--engine", help=argparse.SUPPRESS)   # worker mode
    args = p.parse_args()
    if args.engine:
        return converse(args.engine, args)
    raise_priority()
    engines = {"pykv": sys.executable, "pykv-afresh": sys.executable}
    if args.llamacpp_python:
        engines["llamacpp"] = args.llamacpp_python
    runs = {name: [] for name in engines}
    flags = ["--model", args.model, "--threads", str(args.threads), "--turns", str(args.turns),
             "--doc-words", str(args.doc_words), "--reply", str(args.reply), "--n-ctx", str(args.n_ctx)]
    for rep in range(args.reps):
        for name, python in engines.items():
            out = subprocess.run([python, __file__, "--engine", name, *flags], check=True, capture_output=True,
                                 text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"rep {rep + 1}/{args.reps} {name}: {sum(t['s'] for t in runs[name][-1]):.2f} s", file=sys.stderr)

    def median_s(name, turn=None):
        return statistics.median(sum(t["s"] for t in run) if turn is None else run[turn]["s"] for run in runs[name])

    names = list(engines)
    print("| turn | prompt tokens | " + " | ".join(f"{n} s" for n in names) + " | pykv-afresh / pykv |"
          + (" pykv / llamacpp |" if "llamacpp" in engines else ""))
    print("|---" * (len(names) + 3 + ("llamacpp" in engines)) + "|")
    for turn in range(args.turns):
        cells = [median_s(n, turn) for n in names]
        row = f"| {turn + 1} | {runs['pykv'][0][turn]['prompt_tokens']} | " + " | ".join(f"{c:.2f}" for c in cells)
        row += f" | {cells[1] / cells[0]:.2f} |" + (f" {cells[0] / cells[2]:.2f} |" if len(cells) > 2 else "")
        print(row)
    totals = [median_s(n) for n in names]
    print("| all | | " + " | ".join(f"{c:.2f}" for c in totals) + f" | {totals[1] / totals[0]:.2f} |"
          + (f" {totals[0] / totals[2]:.2f} |" if len(totals) > 2 else ""))


if __name__ == "__main__":
    main()
