"""Needle-in-a-haystack with NVIDIA kvpress 0.5.5, on the same token ids as bench/needle.py.

    bash bench/setup_kvpress.sh                       # venv at /tmp/kvpress-venv (path as $1)
    /tmp/kvpress-venv/bin/python bench/kvpress_needle.py --lengths 2048,4096,7168 --budgets 2,5,10,25 --samples 5 --json kvpress.json
    /tmp/kvpress-venv/bin/python bench/kvpress_needle.py --lengths 1024 --budgets 25 --samples 2 --presses full,snapkv

The tasks (haystack, passkey, depth, question, chat template) are needle.py's Task objects,
tokenized by a pykv Llama exactly as needle.py does, so both benchmarks see identical ids.
The same GGUF is loaded into transformers, dequantized to float32, and run on CPU.

Per sample, mirroring kvpress's KVPressTextGenerationPipeline (pipeline.py):
  aware    - the whole prompt (context + question) is prefilled under the press;
  agnostic - the context is prefilled under the press, then the question is fed without it,
             at its original positions (position_ids = context length + i, as the pipeline does).
Then greedy decoding of up to 24 tokens without the press, positions continuing from the
uncompressed prompt length, stopping at an end-of-generation token; a hit is Task.hit.
A budget of p percent is kvpress's compression_ratio = 1 - p/100 of the prefilled tokens.

Attention: sdpa, except ObservedAttentionPress, which needs eager (it scores with the attention
weights); AdaKVPress refuses eager. A press that raises is reported as an error cell.
Results print as markdown tables in needle.py's layout (plus wall seconds per cell) and, with
--json, as one JSON object ("kept": mean physical KV entries per layer / prefill length).
"""
import argparse
import os
import sys
import time
from importlib.metadata import version
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import needle  # noqa: E402  (Task, tokenizer-side helpers; imports pykv)

import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress import (AdaKVPress, ObservedAttentionPress, PyramidKVPress,  # noqa: E402
                     SnapKVPress, StreamingLLMPress)
from pykv import Llama  # noqa: E402
from pykv.pull import pull  # noqa: E402

PRESSES = {
    "full": None,
    "streaming_llm": lambda cr: StreamingLLMPress(compression_ratio=cr),
    "snapkv": lambda cr: SnapKVPress(compression_ratio=cr),
    "adakv_snapkv": lambda cr: AdaKVPress(SnapKVPress(compression_ratio=cr)),
    "pyramidkv": lambda cr: PyramidKVPress(compression_ratio=cr),
    "observed_attention": lambda cr: ObservedAttentionPress(compression_ratio=cr),
}
EAGER = {"observed_attention"}


def load_model(path: str):
    p = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def answer(model, llm, task, press, aware: bool, n_new: int = 24):
    """Greedy answer and the fraction of prefill entries physically kept (mean over layers)."""
    for layer in model.model.layers:            # AdaKV leaves its mask on the modules
        layer.self_attn.masked_key_indices = None
    cache = transformers.DynamicCache()
    prompt = task.context + task.question
    with press(model) if press is not None else nullcontext():
        if aware:
            out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1)
        else:
            model.model(input_ids=torch.tensor([task.context]), past_key_values=cache)
    n_pre = len(prompt) if aware else len(task.context)
    kept = sum(layer.keys.shape[2] for layer in cache.layers) / len(cache.layers) / n_pre
    if not aware:                               # the question, uncompressed, at its true positions
        pos = torch.arange(len(task.context), len(prompt)).unsqueeze(0)
        out = model(input_ids=torch.tensor([task.question]), past_key_values=cache,
                    position_ids=pos, logits_to_keep=1)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    toks = []
    for i in range(n_new):
        tok = int(out.logits[0, -1].argmax())
        if llm.is_eog(tok) or tok in eos:
            break
        toks.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                    position_ids=torch.tensor([[len(prompt) + i]]))
    return llm.detokenize(toks).decode("utf-8", "replace"), kept


def print_tables(results, presses, budgets, lengths, settings):
    """needle.py's table layout; an error cell reads 'err N' with the message below the table."""
    for setting in settings:
        for title, table, fmt in (("Needle retrieval", "accuracy", lambda v: f"{100 * v:.0f}%"),
                                  ("Wall seconds per cell", "seconds", lambda v: f"{v:.0f}")):
            print(f"\n### kvpress {results['kvpress']}: {title}, question-{setting} "
                  f"({results['samples']} samples per cell)\n")
            cols = [f"{n} @ {b}%" for n in lengths for b in budgets]
            print("| press | " + " | ".join(cols) + " |")
            print("|---|" + "---|" * len(cols))
            notes = []
            for press in presses:
                cells = []
                for n in lengths:
                    for b in budgets:
                        key = f"{press}|{None if press == 'full' else b}|{n}|{setting}"
                        v = results[table].get(key)
                        if key in results["errors"] and table == "accuracy":
                            notes.append(f"{key}: {results['errors'][key]}")
                            cells.append(f"err {len(notes)}")
                        else:
                            cells.append("-" if v is None else fmt(v))
                print(f"| {press} | " + " | ".join(cells) + " |")
            for i, note in enumerate(notes, 1):
                print(f"\nerr {i}: {note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: pykv pull smollm2)")
    ap.add_argument("--lengths", default="2048,4096,7168")
    ap.add_argument("--budgets", default="2,5,10,25", help="percent of the prefill kept")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--first-sample", type=int, default=0, help="sample index to start at (as needle.py)")
    ap.add_argument("--settings", default="aware,agnostic")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model_path = args.model or str(pull("smollm2"))
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    presses = args.presses.split(",")
    settings = args.settings.split(",")
    samples = range(args.first_sample, args.first_sample + args.samples)
    results = {"model": os.path.basename(model_path), "samples": args.samples, "sample_ids": list(samples),
               "kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__,
               "threads": args.threads, "accuracy": {}, "hits": {}, "errors": {}, "seconds": {}, "kept": {}}
    t0 = time.time()
    model = load_model(model_path)
    with Llama(model_path, n_ctx=max(lengths) + 64, n_threads=args.threads) as llm:
        tasks = {n: [needle.Task(llm, n, s) for s in samples] for n in lengths}
        for name in presses:
            model.set_attn_implementation("eager" if name in EAGER else "sdpa")
            for pct in ([None] if name == "full" else budgets):
                for n in lengths:
                    for setting in settings:
                        key, t1 = f"{name}|{pct}|{n}|{setting}", time.time()
                        hit_ids, kept = [], []
                        for sample, task in zip(samples, tasks[n]):
                            press = None if pct is None else PRESSES[name](1 - pct / 100)
                            try:
                                text, k = answer(model, llm, task, press, setting == "aware")
                                if task.hit(text):
                                    hit_ids.append(sample)
                                kept.append(k)
                            except Exception as e:   # kvpress limitations: reported, not fatal
                                results["errors"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                        if kept:
                            results["accuracy"][key] = len(hit_ids) / len(tasks[n])
                            results["hits"][key] = hit_ids
                            results["kept"][key] = sum(kept) / len(kept)
                        results["seconds"][key] = time.time() - t1
                        status = results["errors"].get(key, f"{len(hit_ids)}/{len(tasks[n])} {hit_ids}")
                        print(f"{key}: {status}  ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
                        needle.save(args.json, results)   # a long run that is stopped keeps what it measured
    print_tables(results, presses, budgets, lengths, settings)
    needle.save(args.json, results)


if __name__ == "__main__":
    main()
