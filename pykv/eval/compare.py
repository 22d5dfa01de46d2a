"""`pykv eval compare A.json B.json`: two runs' cells side by side.

Cells are matched by kind, policy, budget, length and setting (two commits, two models, pykv
against bench/kvpress_needle.py's results on the same samples). Each row gives both estimates,
the difference B - A, its standard error, and whether the difference is larger than that. When
both cells hold the same samples (same ids and seed), the difference's standard error is that
of the per-sample differences (paired: the samples' own difficulty cancels); otherwise
sqrt(se_A^2 + se_B^2). Accuracies are in percentage points, KL in nats, perplexities as
perplexity (standard errors by the delta method).
"""
from __future__ import annotations

import math
from typing import List

from .report import budget_order, cell_text
from .results import Cell, cell_key, cells, estimate, load_records, value_of


def _scaled(kind: str, cell: Cell) -> tuple:
    if kind == "needle":
        return 100 * cell.mean, 100 * cell.se
    if kind == "ppl":
        p = math.exp(cell.mean)
        return p, p * cell.se
    return cell.mean, cell.se


def compare(path_a, path_b) -> str:
    a, b = load_records(path_a), load_records(path_b)
    ca, cb = cells(a["records"]), cells(b["records"])
    pa, pb = _per_sample(a["records"]), _per_sample(b["records"])
    name_a, name_b = _label(a, path_a), _label(b, path_b)
    common = [k for k in ca if k in cb]
    order = {lab: i for i, lab in enumerate(budget_order(a["records"] + b["records"]))}
    common.sort(key=lambda k: (k[0], k[4] or "", k[1] != "full", k[1], k[3], order.get(k[2], -1)))
    lines = [f"A: {name_a}", f"B: {name_b}", "",
             "| kind | setting | policy | length | budget | A | B | B - A | se | beyond se |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    beyond = 0
    for key in common:
        kind, policy, budget, length, setting = key
        (ma, sa), (mb, sb) = _scaled(kind, ca[key]), _scaled(kind, cb[key])
        diff = mb - ma
        se = _paired_se(kind, pa.get(key, {}), pb.get(key, {}))
        if se is None:
            se = math.sqrt((sa if not math.isnan(sa) else 0.0) ** 2 + (sb if not math.isnan(sb) else 0.0) ** 2)
        big = abs(diff) > se and diff != 0
        beyond += big
        unit = " pp" if kind == "needle" else ""
        lines.append(f"| {kind} | {setting or '-'} | {policy} | {length} | {budget or '-'} | "
                     f"{cell_text(kind, ca[key])} | {cell_text(kind, cb[key])} | {diff:+.3g}{unit} | {se:.3g} | "
                     f"{'yes' if big else 'no'} |")
    only_a = sorted(set(ca) - set(cb), key=str)
    only_b = sorted(set(cb) - set(ca), key=str)
    lines.append("")
    lines.append(f"{len(common)} cells in both, {beyond} differ by more than their standard error; "
                 f"{len(only_a)} only in A, {len(only_b)} only in B.")
    return "\n".join(lines)


def _per_sample(records) -> dict:
    """{cell key: {(sample, seed): value}}."""
    out: dict = {}
    for r in records:
        v = value_of(r)
        if v is not None:
            out.setdefault(cell_key(r), {})[(r.get("sample"), r.get("seed"))] = v
    return out


def _paired_se(kind: str, a: dict, b: dict):
    """The standard error of the mean per-sample difference, in the cell's shown unit, when
    both cells hold the same two or more samples; None otherwise."""
    if len(a) < 2 or set(a) != set(b):
        return None
    d = estimate([b[k] - a[k] for k in a])
    if kind == "needle":
        return 100 * d.se
    if kind == "ppl":   # delta method around the mean of both
        return math.exp((sum(a.values()) + sum(b.values())) / (2 * len(a))) * d.se
    return d.se


def _label(data: dict, path) -> str:
    parts: List[str] = [str(path)]
    for k in ("model", "runtime", "pykv", "kvpress"):
        if data.get(k):
            parts.append(f"{k} {data[k]}")
    return ", ".join(parts)
