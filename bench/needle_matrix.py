"""The needle matrix at a glance: every cell that bench/needle.py and bench/kvpress_needle.py
have measured, pooled from their JSON results, one table per prompt length.

    python bench/needle_matrix.py bench/results/needle-*-pykv-*.json bench/results/needle-*-kvpress-*.json

A cell shows hits/samples. Runs over disjoint samples of the same cell are pooled; a later file
on the command line replaces an earlier one's result for the same samples (a re-run). Older
result files, which did not record their sample ids, count as samples 0..samples-1. kvpress's
rows are named "kvpress <press>"; a press that raised shows "error".
"""
import argparse
import json
from pathlib import Path


def cell_runs(paths):
    """({(engine policy, budget, length, setting): [(sample ids, hits)]}, later runs replacing
    overlaps; the set of cells whose press raised and that no file measured)."""
    cells, raised = {}, set()
    for path in paths:
        res = json.loads(Path(path).read_text())
        prefix = "kvpress " if "kvpress" in res else ""
        ids = tuple(res.get("sample_ids") or range(res["samples"]))
        for key, acc in res["accuracy"].items():
            policy, budget, length, setting = key.split("|")
            hits = res.get("hits", {}).get(key)
            n_hit = len(hits) if hits is not None else round(acc * len(ids))
            cell = (prefix + policy, budget, int(length), setting)
            cells[cell] = [r for r in cells.get(cell, []) if not set(r[0]) & set(ids)] + [(ids, n_hit)]
        for key in res.get("errors", {}):
            policy, budget, length, setting = key.split("|")
            raised.add((prefix + policy, budget, int(length), setting))
    return cells, raised - cells.keys()


def hits(runs):
    return "-" if not runs else f"{sum(h for _, h in runs)}/{sum(len(i) for i, _ in runs)}"


def print_matrix(cells, raised=frozenset()):
    policies = list(dict.fromkeys(k[0] for k in sorted([*cells, *raised], key=lambda k: k[0].startswith("kvpress"))))
    budgets = sorted({k[1] for k in cells if k[1] != "None"}, key=float)
    for length in sorted({k[2] for k in cells}):
        settings = [s for s in ("aware", "agnostic") if any(k[2] == length and k[3] == s for k in cells)]
        cols = [(s, b) for s in settings for b in budgets]
        fulls = [f"{engine} {s} {hits(cells.get((name, 'None', length, s)))}"
                 for engine, name in (("pykv", "full"), ("kvpress", "kvpress full")) for s in settings
                 if (name, "None", length, s) in cells]
        print(f"\n**{length} tokens** (hits/samples; '-' not run). The full cache: {', '.join(fulls)}.\n")
        print("| policy | " + " | ".join(f"{s} {float(b):g}%" for s, b in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for policy in policies:
            row = ["error" if (policy, b, length, s) in raised else hits(cells.get((policy, b, length, s)))
                   for s, b in cols]
            if any(c != "-" for c in row):
                print(f"| {policy} | " + " | ".join(row) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="JSON files of needle.py / kvpress_needle.py, oldest first")
    print_matrix(*cell_runs(ap.parse_args().results))


if __name__ == "__main__":
    main()
