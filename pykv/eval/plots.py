"""Pictures of an evaluation (matplotlib, an optional extra: pip install 'pykv[plot]').

needle-<policy>.png  the classic heatmap: needle depth (rows) x prompt length (columns),
                     one panel per setting and budget
needle-budgets.png   policy (rows) x budget (columns), one panel per length and setting
kl.png, ppl.png      the measure against the budget, one line per policy, one panel per length
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional

from .report import budget_order, policy_order
from .results import cells

PLOT_HINT = "pictures need matplotlib: pip install 'pykv[plot]' (the tables and results.json are written)"


def matplotlib_pyplot():
    """pyplot on the file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_=." else "_" for c in name)


def plot_all(records: List[dict], out: Path) -> Optional[List[Path]]:
    """Every picture of the records into out; None when matplotlib is missing."""
    plt = matplotlib_pyplot()
    if plt is None:
        return None
    written = []
    needle = [r for r in records if r.get("kind") == "needle"]
    if needle:
        for policy in policy_order(needle):
            written.append(_needle_heatmap(plt, needle, policy, out / f"needle-{_safe(policy)}.png"))
        written.append(_needle_budgets(plt, needle, out / "needle-budgets.png"))
    for kind, label in (("kl", "mean KL(full || policy), nats"), ("ppl", "perplexity")):
        rs = [r for r in records if r.get("kind") == kind]
        if rs:
            written.append(_budget_lines(plt, rs, kind, label, out / f"{kind}.png"))
    return written


def _heat(ax, plt, grid, rows, cols, title):
    import numpy as np
    data = np.array([[math.nan if v is None else v for v in row] for row in grid], dtype=float)
    im = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_title(title, fontsize=9)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if v is None else f"{100 * v:.0f}", ha="center", va="center", fontsize=7)
    return im


def _needle_heatmap(plt, records, policy, path):
    rs = [r for r in records if r["policy"] == policy]
    settings = sorted({r["setting"] for r in rs}, key=lambda s: s != "aware")
    budgets = [None] if policy == "full" else budget_order(rs)
    lengths = sorted({r["length"] for r in rs})
    depths = sorted({r["depth"] for r in rs})
    est = cells(rs, by=lambda r: (r["setting"], r.get("budget"), r["length"], r["depth"]))
    fig, axes = plt.subplots(len(settings), len(budgets), squeeze=False, layout="constrained",
                             figsize=(2.2 + (0.5 + 0.7 * len(lengths)) * len(budgets),
                                      1.0 + (0.6 + 0.35 * len(depths)) * len(settings)))
    im = None
    for i, s in enumerate(settings):
        for j, b in enumerate(budgets):
            grid = [[_mean(est.get((s, b, n, d))) for n in lengths] for d in depths]
            im = _heat(axes[i][j], plt, grid, [f"{100 * d:.0f}%" for d in depths], lengths,
                       f"{s}" + ("" if b is None else f", {b}"))
            if j == 0:
                axes[i][j].set_ylabel("needle depth")
            if i == len(settings) - 1:
                axes[i][j].set_xlabel("prompt tokens")
    fig.suptitle(f"{policy}: needle found (%)", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _needle_budgets(plt, records, path):
    settings = sorted({r["setting"] for r in records}, key=lambda s: s != "aware")
    lengths = sorted({r["length"] for r in records})
    budgets = budget_order(records)
    policies = policy_order(records)
    est = cells(records, by=lambda r: (r["setting"], r["policy"], r.get("budget"), r["length"]))
    fig, axes = plt.subplots(len(settings), len(lengths), squeeze=False, layout="constrained",
                             figsize=(2.8 + (1.2 + 0.7 * len(budgets)) * len(lengths),
                                      1.0 + (0.6 + 0.3 * len(policies)) * len(settings)))
    im = None
    for i, s in enumerate(settings):
        for j, n in enumerate(lengths):
            grid = [[_mean(est.get((s, p, None if p == "full" else b, n))) for b in budgets] for p in policies]
            im = _heat(axes[i][j], plt, grid, policies, budgets, f"{n} tokens, {s}")
    fig.suptitle("needle found (%) by policy and budget", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _budget_lines(plt, records, kind, label, path):
    lengths = sorted({r["length"] for r in records})
    budgets = budget_order(records)
    est = cells(records, by=lambda r: (r["policy"], r.get("budget"), r["length"]))
    fig, axes = plt.subplots(1, len(lengths), squeeze=False, layout="constrained", figsize=(1.5 + 4.2 * len(lengths), 3.6))
    xs = list(range(len(budgets)))
    for j, n in enumerate(lengths):
        ax = axes[0][j]
        for policy in policy_order(records):
            if policy == "full":
                c = est.get(("full", None, n))
                if c is not None:
                    ax.axhline(_shown(kind, c.mean), color="black", linestyle="--", linewidth=1, label="full")
                continue
            pts = [(x, est.get((policy, b, n))) for x, b in zip(xs, budgets)]
            pts = [(x, c) for x, c in pts if c is not None]
            if pts:
                ax.errorbar([x for x, _ in pts], [_shown(kind, c.mean) for _, c in pts],
                            yerr=[_shown_err(kind, c) for _, c in pts], marker="o", markersize=3, capsize=2,
                            linewidth=1, label=policy)
        ax.set_xticks(xs, budgets)
        ax.set_xlabel("budget")
        ax.set_title(f"{n} tokens", fontsize=9)
        if kind == "kl":
            ax.set_yscale("log")
        if j == 0:
            ax.set_ylabel(label)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean(cell):
    return None if cell is None or cell.n == 0 else cell.mean


def _shown(kind, mean):
    return math.exp(mean) if kind == "ppl" else mean


def _shown_err(kind, cell):
    if math.isnan(cell.se):
        return 0.0
    return math.exp(cell.mean) * cell.se if kind == "ppl" else cell.se
