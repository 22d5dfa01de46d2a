"""`pykv eval kl`: how far each policy's next-token distributions move from the full cache's.

A sample is a passage of `length` + `tokens` tokens of the text. Its first `length` tokens
are one prompt, which the policy compresses (a share budget is a share of it); then the
remaining tokens are fed one by one, teacher-forced, and the distribution before each is
compared with the full cache's at the same place: the run's value is the mean over those
tokens of KL(full || policy), in nats. The full cache's distributions are computed once per
sample.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from .._sampling import log_softmax
from .config import EvalConfig, runs_of
from .grid import run_grid
from .progress import Progress
from .results import ResultStore
from .samples import SampleSet, TextSample

ROOM = 8


def teacher_forced_log_probs(llm, follow) -> np.ndarray:
    """The log-distribution of the next token before each of follow's tokens, feeding them one
    at a time after what llm already holds (float64, one row per token)."""
    rows = []
    for t in follow:
        rows.append(log_softmax(llm.logits()))
        llm.eval([int(t)])
    return np.array(rows)


def mean_kl(log_p: np.ndarray, log_q: np.ndarray) -> float:
    """Mean over rows of KL(p || q) = sum p (log p - log q)."""
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=1)))


def make_samples(cfg: EvalConfig, sample_set: SampleSet, text: str, follow: int) -> List[TextSample]:
    with cfg.tokenizer(max(cfg.lengths) + follow + ROOM) as tok:
        samples = [sample_set.text_sample(tok, text, n + follow, i, cfg.seed)
                   for n in cfg.lengths for i in range(cfg.samples)]
    sample_set.save()
    return samples


def run_kl(cfg: EvalConfig, store: ResultStore, samples: List[TextSample], follow: int,
           progress: Optional[Progress] = None) -> None:
    full_cache = {}   # the current sample's full-cache log-distributions

    def reference(sample, prefix, rest):
        key = (sample.length, sample.index)
        if key not in full_cache:
            full_cache.clear()
            with cfg.llama("full", None, sample.length + ROOM) as llm:
                llm.eval(prefix)
                full_cache[key] = teacher_forced_log_probs(llm, rest)
        return full_cache[key]

    def measure(record, sample, spec):
        n = sample.length - follow
        prefix, rest = sample.tokens[:n], sample.tokens[n:]
        t0 = time.perf_counter()
        ref = reference(sample, prefix, rest)
        with cfg.llama(spec, record["budget_entries"], sample.length + ROOM) as llm:
            llm.eval(prefix)
            kv_bytes = llm.kv_stats()["bytes"]
            got = teacher_forced_log_probs(llm, rest)
        record.update(kl=mean_kl(ref, got), kv_bytes=kv_bytes, seconds=round(time.perf_counter() - t0, 3))
        return record

    runs = [(spec, b) for spec, b, _ in runs_of(cfg, [None]) if spec != "full"]
    jobs = []
    for sample in samples:
        n = sample.length - follow
        for spec, budget in runs:
            record = {"kind": "kl", "model": cfg.model_name, "policy": spec, "args": cfg.run_args(spec),
                      "budget": budget.label, "budget_entries": budget.of(n), "length": n, "tokens": follow,
                      "setting": None, "sample": sample.index, "seed": sample.seed}
            jobs.append((record, sample.length, lambda r, sample=sample, spec=spec: measure(r, sample, spec)))
    run_grid(store, jobs, len(jobs), sum(t for _, t, _ in jobs), cfg.samples, progress)
