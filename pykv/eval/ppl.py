"""`pykv eval ppl`: perplexity under each policy and budget (pykv.perplexity's measurement).

A sample is a chunk of `length` tokens of the text: its first half is one prompt, which the
policy compresses (a share budget is a share of that half), and its second half is scored,
as llama-perplexity scores a chunk. A run's value is the mean negative log-likelihood of the
scored tokens; a cell's perplexity is exp of the mean over its samples.
"""
from __future__ import annotations

import time
from typing import List, Optional

from ..perplexity import perplexity
from .config import EvalConfig, runs_of
from .grid import run_grid
from .progress import Progress
from .results import ResultStore
from .samples import SampleSet, TextSample


def make_samples(cfg: EvalConfig, sample_set: SampleSet, text: str) -> List[TextSample]:
    with cfg.tokenizer(max(cfg.lengths)) as tok:
        samples = [sample_set.text_sample(tok, text, n, i, cfg.seed) for n in cfg.lengths for i in range(cfg.samples)]
    sample_set.save()
    return samples


def run_ppl(cfg: EvalConfig, store: ResultStore, samples: List[TextSample], decode: bool = False,
            progress: Optional[Progress] = None) -> None:
    def measure(record, sample, spec):
        t0 = time.perf_counter()
        with cfg.llama(spec, record["budget_entries"], sample.length) as llm:
            result = perplexity(llm, sample.tokens, chunk_size=sample.length, max_chunks=1, decode=decode)
        record.update(nll=result.nll, ppl=result.ppl, n_scored=result.n_scored,
                      kv_bytes=result.kv_stats.get("bytes"), seconds=round(time.perf_counter() - t0, 3))
        return record

    jobs = []
    for sample in samples:
        for spec, budget, _ in runs_of(cfg, [None]):
            record = {"kind": "ppl", "model": cfg.model_name, "policy": spec,
                      "args": cfg.run_args(spec) if spec != "full" else {},
                      "budget": budget.label if budget else None,
                      "budget_entries": budget.of(sample.length // 2) if budget else None,
                      "length": sample.length, "decode": decode, "setting": None,
                      "sample": sample.index, "seed": sample.seed}
            jobs.append((record, sample.length, lambda r, sample=sample, spec=spec: measure(r, sample, spec)))
    run_grid(store, jobs, len(jobs), sum(t for _, t, _ in jobs), cfg.samples, progress)
