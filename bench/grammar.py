"""The cost of grammar-constrained decoding: pykv and llama-cpp-python on the same GGUF,
threads, prompt and GBNF text, greedy, run alternately in fresh processes.

    python bench/grammar.py --model M.gguf --threads 2 --reps 5 \
        --llamacpp-python /path/to/venv/bin/python

Modes: `none` (no grammar), `json` (pykv.grammar.JSON_GBNF, any JSON object) and `schema`
(a JSON Schema's grammar as pykv writes it; both engines get the same text). A run streams
the reply and times it from its first token to its last, so the figure is the decode step
with the sampler and grammar included, and the prompt left out. Medians of --reps runs with
the spread (min..max), the ratio pykv / llama.cpp, and each engine's slowdown against its own
run without a grammar."""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = ("<|im_start|>user\nList ten animals with their usual weight in kilograms and their colour, "
          "as JSON.<|im_end|>\n<|im_start|>assistant\n")
SCHEMA = {"type": "object", "required": ["animals"], "properties": {"animals": {
    "type": "array", "maxItems": 10, "items": {"type": "object", "required": ["name", "kg", "colour"],
                                               "properties": {"name": {"type": "string"},
                                                              "kg": {"type": "number"},
                                                              "colour": {"type": "string"}}}}}}


def worker(args):
    grammar = Path(args.grammar).read_text() if args.grammar else None
    if args.engine == "pykv":
        from pykv import Llama, LlamaGrammar
        llm = Llama(args.model, n_ctx=1024, n_threads=args.threads, verbose=False)
        g = LlamaGrammar.from_string(grammar) if grammar else None

        def pieces():
            for chunk in llm.generate(PROMPT, max_tokens=args.max_tokens, temperature=0, grammar=g, stream=True):
                yield chunk.text
    else:
        from llama_cpp import Llama, LlamaGrammar
        llm = Llama(args.model, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
        g = LlamaGrammar.from_string(grammar, verbose=False) if grammar else None

        def pieces():
            for chunk in llm.create_completion(PROMPT, max_tokens=args.max_tokens, temperature=0, grammar=g,
                                               stream=True):
                yield chunk["choices"][0]["text"]
    times, text = [], ""
    for piece in pieces():
        times.append(time.perf_counter())
        text += piece
    n = len(times)
    print(json.dumps({"tps": (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0, "pieces": n, "text": text}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--modes", default="none,json,schema")
    ap.add_argument("--llamacpp-python", help="interpreter with llama-cpp-python (omit: pykv only)")
    ap.add_argument("--worker", dest="engine", help=argparse.SUPPRESS)
    ap.add_argument("--grammar", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return worker(args)

    try:
        Path("/proc/self/autogroup").write_text("-20")
    except OSError:
        pass
    from pykv.grammar.json_schema import schema_to_gbnf
    from pykv.grammar import JSON_GBNF
    tmp = Path(tempfile.mkdtemp())
    texts = {"none": "", "json": JSON_GBNF, "schema": schema_to_gbnf(SCHEMA)}
    engines = [("pykv", sys.executable)] + ([("llama.cpp", args.llamacpp_python)] if args.llamacpp_python else [])
    results = {}
    for mode in args.modes.split(","):
        path = tmp / f"{mode}.gbnf"
        path.write_text(texts[mode])
        for _ in range(args.reps):
            for name, python in engines:
                cmd = [python, __file__, "--worker", "pykv" if name == "pykv" else "llamacpp", "--model", args.model,
                       "--threads", str(args.threads), "--max-tokens", str(args.max_tokens)]
                if texts[mode]:
                    cmd += ["--grammar", str(path)]
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                results.setdefault((mode, name), []).append(out)
    print("| mode | engine | pieces | tok/s median (min..max) | ratio pykv / llama.cpp | vs own no-grammar |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for name, _ in engines:
            runs = results[(mode, name)]
            tps = [r["tps"] for r in runs]
            med = statistics.median(tps)
            other = results.get((mode, "llama.cpp"))
            ratio = f"{med / statistics.median(r['tps'] for r in other):.2f}" if name == "pykv" and other else ""
            base = results.get(("none", name))
            own = f"{med / statistics.median(r['tps'] for r in base):.2f}" if base and mode != "none" else ""
            print(f"| {mode} | {name} | {runs[-1]['pieces']} | {med:.1f} ({min(tps):.1f}..{max(tps):.1f}) | {ratio} | {own} |")
    for mode in args.modes.split(","):
        for name, _ in engines:
            print(f"\n{mode} / {name}: {results[(mode, name)][-1]['text'][:300]!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
