"""Quality under compression: the needle-in-a-haystack, KL and perplexity grids of `pykv eval`.

    from pykv.eval import EvalConfig, evaluate, parse_budgets
    cfg = EvalConfig(model, out=Path("runs/needle"), lengths=[2048], budgets=parse_budgets("10%,25%"),
                     policies=["snapkv", "take"], samples=20)
    records = evaluate("needle", cfg)

An evaluation writes DIR/samples.json (the token ids of every sample), DIR/results.json (one
record per run, rewritten as the run goes; a second call with the same DIR skips what is in
it), DIR/summary.md (the tables) and, with matplotlib installed, the pictures (plots.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from .compare import compare
from .config import Budget, EvalConfig, parse_budgets, parse_depths, parse_lengths, parse_policies, parse_settings
from .report import tables
from .results import ResultStore, cells, estimate, load_records
from .samples import SampleSet, haystack_text

KINDS = ("needle", "kl", "ppl")

__all__ = ["Budget", "EvalConfig", "KINDS", "cells", "compare", "estimate", "evaluate", "haystack_text",
           "load_records", "parse_budgets", "parse_depths", "parse_lengths", "parse_policies", "parse_settings",
           "tables", "write_outputs"]


def evaluate(kind: str, cfg: EvalConfig, text: Optional[str] = None, kl_tokens: int = 64, decode: bool = False,
             progress=None) -> List[dict]:
    """Run the grid of one kind (needle, kl or ppl) into cfg.out (None: in memory only) and
    return every record of that folder. text: the passage source of kl and ppl (default the
    shipped haystack)."""
    if kind not in KINDS:
        raise ValueError(f"unknown evaluation {kind!r} (one of {', '.join(KINDS)})")
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
    sample_set = SampleSet(cfg.out / "samples.json" if cfg.out else None, cfg.model_name)
    store = ResultStore(cfg.out / "results.json" if cfg.out else None, kind, cfg.model_name,
                        meta={"runtime": "pykv", "pykv": _version()})
    if kind == "needle":
        from .needle import make_samples, run_needle
        run_needle(cfg, store, make_samples(cfg, sample_set), progress)
    elif kind == "kl":
        from .kl import make_samples, run_kl
        run_kl(cfg, store, make_samples(cfg, sample_set, text or haystack_text(), kl_tokens), kl_tokens, progress)
    else:
        from .ppl import make_samples, run_ppl
        run_ppl(cfg, store, make_samples(cfg, sample_set, text or haystack_text()), decode, progress)
    return store.records


def _version() -> str:
    from .. import __version__
    return __version__


def write_outputs(records: List[dict], out: Optional[Path], plots: bool = True) -> tuple:
    """The tables (markdown, also DIR/summary.md) and the pictures' paths (None when
    matplotlib is missing or plots is False)."""
    text = tables(records)
    pictures = None
    if out is not None:
        (out / "summary.md").write_text(text.lstrip("\n") + "\n")
        if plots:
            from .plots import plot_all
            pictures = plot_all(records, out)
    return text, pictures
