"""Markdown tables of an evaluation's cells: one row per policy, one column per length and
budget, each cell its mean ± standard error (needle: accuracy in %, kl: nats, ppl: perplexity).
The full cache's row repeats its value under every budget of a length: the reference."""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from .results import Cell, cells


def budget_order(records) -> List[Optional[str]]:
    """The budgets in the order of their entries' size (shares before counts)."""
    labels = {r.get("budget") for r in records if r.get("budget") is not None}

    def key(label):
        if label.endswith("%"):
            return (0, float(label[:-1]))
        return (1, float(label))
    return sorted(labels, key=key)


def policy_order(records) -> List[str]:
    out = ["full"] if any(r.get("policy") == "full" for r in records) else []
    for r in records:
        if r.get("policy") not in out:
            out.append(r.get("policy"))
    return out


def cell_text(kind: str, cell: Optional[Cell]) -> str:
    if cell is None or cell.n == 0:
        return "-"
    if kind == "needle":
        return f"{100 * cell.mean:.0f}% ± {100 * cell.se:.0f}"
    if kind == "ppl":
        ppl = math.exp(cell.mean)
        return f"{ppl:.2f} ± {ppl * cell.se:.2f}" if not math.isnan(cell.se) else f"{ppl:.2f}"
    return f"{cell.mean:.3f} ± {cell.se:.3f}" if not math.isnan(cell.se) else f"{cell.mean:.3f}"


TITLES = {
    "needle": "Needle retrieval, question-{setting}: accuracy ± standard error",
    "kl": "Mean KL(full || policy) of next-token distributions, nats ± standard error",
    "ppl": "Perplexity ± standard error",
}


def tables(records: List[dict]) -> str:
    """Every table of the records (one per kind and setting) as markdown."""
    out = []
    for kind in ("needle", "kl", "ppl"):
        rs = [r for r in records if r.get("kind") == kind]
        if not rs:
            continue
        for setting in sorted({r.get("setting") for r in rs}, key=lambda s: (s is None, s != "aware", s)):
            sub = [r for r in rs if r.get("setting") == setting]
            out.append(_table(kind, setting, sub))
    return "\n".join(out)


def _table(kind: str, setting, records: List[dict]) -> str:
    est: Dict[tuple, Cell] = cells(records)
    lengths = sorted({r["length"] for r in records})
    budgets = budget_order(records)
    ns = sorted({c.n for c in est.values()})
    n_text = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}" if ns else "0"
    lines = [f"\n### {TITLES[kind].format(setting=setting)} ({n_text} samples per cell)\n"]
    cols = [(n, b) for n in lengths for b in budgets]
    lines.append("| policy | " + " | ".join(f"{n} @ {b}" for n, b in cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    for policy in policy_order(records):
        row = []
        for n, b in cols:
            key = (kind, policy, None if policy == "full" else b, n, setting)
            row.append(cell_text(kind, est.get(key)))
        lines.append(f"| {policy} | " + " | ".join(row) + " |")
    errors = sorted({(r["policy"], r.get("budget"), r["error"]) for r in records if r.get("error")})
    for policy, budget, message in errors:
        lines.append(f"\n{policy} at {budget}: {message} (no cell)")
    return "\n".join(lines)
