"""`pykv eval needle`: needle-in-a-haystack retrieval under each policy and budget.

Each run evaluates one sample's prompt under one policy, budget and setting, then answers
greedily (at most cfg.answer_tokens tokens, stopping at an end-of-generation token):
  aware     one eval of the whole prompt, the question included (the policy sees it);
  agnostic  eval(context), then eval(question): the context is compressed before the question
            is known, as a document cached once and asked many questions.
A share budget is a share of the context (entries per layer and KV head). A run that fails
(a budget below a policy's least, say) is recorded with its error and counts in no cell.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from .config import EvalConfig, runs_of
from .progress import Progress
from .grid import run_grid
from .results import ResultStore
from .samples import NeedleSample, SampleSet, depth_of

ANSWER_ROOM = 32   # context beyond the prompt: the answer's tokens


def answer(llm, sample: NeedleSample, setting: str, n_new: int) -> tuple:
    """The greedy answer of llm to the sample (the context's previous content is dropped),
    and the KV cache's bytes once the prompt is in."""
    llm.reset()
    if setting == "aware":
        llm.eval(sample.context + sample.question)
    else:
        llm.eval(sample.context)
        llm.eval(sample.question)
    kv_bytes = llm.kv_stats()["bytes"]
    out: List[int] = []
    for _ in range(n_new):
        tok = int(np.argmax(llm.logits()))
        if llm.is_eog(tok):
            break
        out.append(tok)
        llm.eval([tok])
    return llm.detokenize(out).decode("utf-8", "replace"), kv_bytes


def make_samples(cfg: EvalConfig, sample_set: SampleSet) -> List[NeedleSample]:
    with cfg.tokenizer(max(cfg.lengths) + ANSWER_ROOM) as tok:
        samples = [sample_set.needle_sample(tok, n, i, depth_of(i, cfg.depths), cfg.seed)
                   for n in cfg.lengths for i in range(cfg.samples)]
    sample_set.save()
    return samples


def run_needle(cfg: EvalConfig, store: ResultStore, samples: List[NeedleSample],
               progress: Optional[Progress] = None) -> None:
    """Every run of the grid not yet in store, sample by sample (an interrupted run has every
    cell's first samples), into store."""
    runs = runs_of(cfg, cfg.settings)
    jobs = [(_record(cfg, sample, spec, budget, setting), sample.n_prompt,
             lambda record, sample=sample, spec=spec: _run(cfg, sample, spec, record))
            for sample in samples for spec, budget, setting in runs]
    run_grid(store, jobs, len(jobs), sum(t for _, t, _ in jobs), cfg.samples, progress)


def _record(cfg: EvalConfig, sample: NeedleSample, spec: str, budget, setting: str) -> dict:
    return {"kind": "needle", "model": cfg.model_name, "policy": spec, "args": cfg.run_args(spec) if spec != "full" else {},
            "budget": budget.label if budget is not None else None,
            "budget_entries": budget.of(len(sample.context)) if budget is not None else None,
            "length": sample.length, "n_context": len(sample.context), "n_prompt": sample.n_prompt,
            "setting": setting, "sample": sample.index, "seed": sample.seed, "depth": sample.depth,
            "passkey": sample.passkey}


def _run(cfg: EvalConfig, sample: NeedleSample, spec: str, record: dict) -> dict:
    t0 = time.perf_counter()
    with cfg.llama(spec, record["budget_entries"], sample.n_prompt + ANSWER_ROOM) as llm:
        text, kv_bytes = answer(llm, sample, record["setting"], cfg.answer_tokens)
    record.update(hit=sample.hit(text), answer=text, kv_bytes=kv_bytes, seconds=round(time.perf_counter() - t0, 3))
    return record
