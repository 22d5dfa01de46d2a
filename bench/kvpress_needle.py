"""Needle-in-a-haystack with NVIDIA kvpress 0.5.5 on the samples of a `pykv eval needle` run.

    pykv eval needle --lengths 2k,4k --budgets 10%,25% --samples 20 --out runs/needle
    bash bench/setup_kvpress.sh                       # venv at /tmp/kvpress-venv (path as $1)
    /tmp/kvpress-venv/bin/python bench/kvpress_needle.py runs/needle --budgets 10%,25% --out runs/kvpress
    pykv eval compare runs/kvpress/results.json runs/needle/results.json

The token ids come from the run's samples.json (made by pykv with the model's chat template),
so kvpress sees exactly the prompts pykv saw; the same GGUF is loaded into transformers,
dequantized to float32, and run on the CPU. Results go to OUT/results.json in pykv eval's record
format, under pykv's policy names (the press each stands for is in the records' "press"), so
`pykv eval compare` puts the two side by side cell by cell; a stopped run resumes from OUT.

Per sample, as kvpress's KVPressTextGenerationPipeline does:
  aware    - the whole prompt (context + question) is prefilled under the press;
  agnostic - the context is prefilled under the press, then the question without it, at its
             own positions.
Then greedy decoding of up to 24 tokens without the press, stopping at an end-of-generation
token. A budget of B entries (pykv's: a share of the context, rounded) is kvpress's
compression_ratio = 1 - B / prefilled tokens, so both keep the same number of entries.
Attention: sdpa, except ObservedAttentionPress (eager: it scores with the attention weights).
"""
import argparse
import json
import sys
import time
from contextlib import nullcontext
from importlib.metadata import version
from pathlib import Path

import torch  # noqa: E402
import transformers  # noqa: E402
import kvpress  # noqa: E402

from pykv import Llama  # noqa: E402
from pykv.eval import parse_budgets, parse_lengths, parse_settings  # noqa: E402
from pykv.eval.grid import run_grid  # noqa: E402
from pykv.eval.results import ResultStore  # noqa: E402
from pykv.eval.samples import SampleSet  # noqa: E402

ANSWER_TOKENS = 24


def _snap(cr):
    return kvpress.SnapKVPress(compression_ratio=cr)


# pykv's policy name -> the kvpress press it stands for (built for a compression ratio)
PRESSES = {
    "streamingllm": lambda cr: kvpress.StreamingLLMPress(compression_ratio=cr),
    "h2o": lambda cr: kvpress.ObservedAttentionPress(compression_ratio=cr),
    "snapkv": _snap,
    "pyramidkv": lambda cr: kvpress.PyramidKVPress(compression_ratio=cr),
    "adakv": lambda cr: kvpress.AdaKVPress(_snap(cr)),
    "knorm": lambda cr: kvpress.KnormPress(compression_ratio=cr),
    "keydiff": lambda cr: kvpress.KeyDiffPress(compression_ratio=cr),
    "tova": lambda cr: kvpress.TOVAPress(compression_ratio=cr),
    "lagkv": lambda cr: kvpress.LagKVPress(compression_ratio=cr),
    "random": lambda cr: kvpress.RandomPress(compression_ratio=cr),
    "expected_attention": lambda cr: kvpress.ExpectedAttentionPress(compression_ratio=cr),
    "criticalkv": lambda cr: kvpress.CriticalKVPress(_snap(cr)),
    "criticaladakv": lambda cr: kvpress.CriticalAdaKVPress(_snap(cr)),
    "chunkkv": lambda cr: kvpress.ChunkKVPress(_snap(cr)),
}
EAGER = {"h2o"}


def load_model(path: str):
    p = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@torch.no_grad()
def answer(model, llm, sample, press, aware: bool):
    """Greedy answer and the fraction of prefill entries physically kept (mean over layers)."""
    for layer in model.model.layers:            # AdaKV leaves its mask on the modules
        layer.self_attn.masked_key_indices = None
    cache = transformers.DynamicCache()
    prompt = sample.context + sample.question
    with press(model) if press is not None else nullcontext():
        if aware:
            out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, logits_to_keep=1)
        else:
            model.model(input_ids=torch.tensor([sample.context]), past_key_values=cache)
    if not aware:                               # the question, uncompressed, at its own positions
        pos = torch.arange(len(sample.context), len(prompt)).unsqueeze(0)
        out = model(input_ids=torch.tensor([sample.question]), past_key_values=cache,
                    position_ids=pos, logits_to_keep=1)
    toks = []
    for i in range(ANSWER_TOKENS):
        tok = int(out.logits[0, -1].argmax())
        if llm.is_eog(tok):
            break
        toks.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache,
                    position_ids=torch.tensor([[len(prompt) + i]]))
    return llm.detokenize(toks).decode("utf-8", "replace")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a pykv eval needle output folder (its samples.json and model)")
    ap.add_argument("--model", default=None, help="the GGUF (default: the pulled file of the run's model)")
    ap.add_argument("--lengths", default=None, help="only these lengths (default: all of the run's)")
    ap.add_argument("--samples", type=int, default=None, help="only the first N samples of each length")
    ap.add_argument("--budgets", default="10%,25%")
    ap.add_argument("--policies", default=",".join(PRESSES), help="pykv names of the presses to run")
    ap.add_argument("--setting", default="aware,agnostic")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="results folder (resumed when it holds results)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    run = Path(args.run)
    meta = json.loads((run / "samples.json").read_text())
    model_path = args.model or str(Path.home() / ".cache" / "pykv" / "models" / meta["model"])
    samples = list(SampleSet(run / "samples.json", meta["model"]).needle.values())
    if args.lengths:
        keep = set(parse_lengths(args.lengths))
        samples = [s for s in samples if s.length in keep]
    if args.samples is not None:
        samples = [s for s in samples if s.index < args.samples]
    budgets, settings = parse_budgets(args.budgets), parse_settings(args.setting)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in PRESSES and p != "full"]
    if unknown:
        sys.exit(f"no kvpress press for {', '.join(unknown)} (known: {', '.join(PRESSES)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    versions = {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__}
    store = ResultStore(out / "results.json", "needle", meta["model"], meta={"runtime": "kvpress", **versions})
    model = load_model(model_path)

    with Llama(model_path, n_ctx=64, vocab_only=True) as llm:
        def measure(record, sample, policy):
            n_pre = sample.n_prompt if record["setting"] == "aware" else len(sample.context)
            press = None
            if policy != "full":
                press = PRESSES[policy]((n_pre - record["budget_entries"]) / n_pre)
            model.set_attn_implementation("eager" if policy in EAGER else "sdpa")
            t0 = time.perf_counter()
            text = answer(model, llm, sample, press, record["setting"] == "aware")
            record.update(hit=sample.hit(text), answer=text, seconds=round(time.perf_counter() - t0, 3))
            return record

        jobs = []
        for sample in sorted(samples, key=lambda s: (s.length, s.index)):
            for policy in ["full"] + [p for p in policies if p != "full"]:
                for budget in ([None] if policy == "full" else budgets):
                    for setting in settings:
                        record = {"kind": "needle", "model": meta["model"], "policy": policy, "press": "none" if policy == "full" else
                                  type(PRESSES[policy](0.5)).__name__, "args": {},
                                  "budget": budget.label if budget else None,
                                  "budget_entries": budget.of(len(sample.context)) if budget else None,
                                  "length": sample.length, "n_context": len(sample.context),
                                  "n_prompt": sample.n_prompt, "setting": setting, "sample": sample.index,
                                  "seed": sample.seed, "depth": sample.depth, "passkey": sample.passkey}
                        jobs.append((record, sample.n_prompt,
                                     lambda r, sample=sample, policy=policy: measure(r, sample, policy)))
        per_cell = max(1, len({(s.length, s.index) for s in samples}) // max(1, len({s.length for s in samples})))
        run_grid(store, jobs, len(jobs), sum(t for _, t, _ in jobs), per_cell)
    from pykv.eval import tables
    print(tables(store.records))


if __name__ == "__main__":
    main()
