"""DIR/results.json: one record per sample run, written as the run goes, read back to resume.

The file is one JSON object: {"version", "kind", "model", what ran it ("runtime" and its
version), "records": [...]}. A record holds
what identifies its run (kind, policy, args, budget, length, setting, sample, seed) and what
it measured (hit and answer, or kl, or nll), with kv_bytes and seconds. Cells group records
that differ only in their sample.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

RESULTS_VERSION = 1
# What identifies a run; a cell is the same without sample (and depth, which follows from it).
RUN_KEY = ("kind", "policy", "budget", "length", "setting", "sample", "seed")
CELL_KEY = ("kind", "policy", "budget", "length", "setting")


def run_key(record: dict) -> tuple:
    return tuple(record.get(k) for k in RUN_KEY)


def cell_key(record: dict) -> tuple:
    return tuple(record.get(k) for k in CELL_KEY)


class ResultStore:
    """The records of one output folder. add() keeps a record and writes the file at most
    every `every` seconds (and on flush), atomically, so an interrupted run loses at most the
    runs of the last few seconds and never the file."""

    def __init__(self, path: Optional[Path], kind: str, model: str, meta: Optional[dict] = None, every: float = 5.0):
        self.path, self.kind, self.model, self.every = path, kind, model, every
        self.meta = dict(meta or {})   # written beside the records: what ran them
        self.records: List[dict] = []
        self._done = set()
        self._written = time.monotonic()
        if path is not None and path.exists():
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if data.get("version") != RESULTS_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {RESULTS_VERSION}")
            if data.get("kind") != self.kind:
                raise ValueError(f"it holds a '{data.get('kind')}' run, not '{self.kind}'")
            if data.get("model") != self.model:
                raise ValueError(f"it holds a run of the model {data.get('model')!r}, not {self.model!r}")
            records = data["records"]
            if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                raise ValueError("its records are not a list of objects")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} cannot be resumed: {exc} (give another --out, or delete it)") from exc
        self.records = records
        self._done = {run_key(r) for r in records}

    def done(self, key: tuple) -> bool:
        return key in self._done

    def add(self, record: dict) -> None:
        self.records.append(record)
        self._done.add(run_key(record))
        if time.monotonic() - self._written >= self.every:
            self.flush()

    def flush(self) -> None:
        self._written = time.monotonic()
        if self.path is None:
            return
        data = {"version": RESULTS_VERSION, "kind": self.kind, "model": self.model, **self.meta,
                "records": self.records}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=0))
        tmp.replace(self.path)


def load_records(path) -> dict:
    """A results.json (of pykv eval or bench/kvpress_needle.py) as its JSON object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a results file: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: not a results file of pykv eval (no 'records' list)")
    return data


@dataclass
class Cell:
    """A cell's estimate: the mean of its samples' values and its standard error."""
    mean: float
    se: float
    n: int


def estimate(values: Iterable[float], binary: bool = False) -> Cell:
    """Mean and standard error of the mean. For hits (binary), sqrt(p (1 - p) / n): zero when
    every sample agrees, which says the samples did, not that the cell is certain. For other
    values, the sample standard deviation over sqrt(n) (nan for one sample)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Cell(math.nan, math.nan, 0)
    mean = sum(xs) / n
    if binary:
        return Cell(mean, math.sqrt(mean * (1 - mean) / n), n)
    if n == 1:
        return Cell(mean, math.nan, 1)
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return Cell(mean, math.sqrt(var / n), n)


def value_of(record: dict) -> Optional[float]:
    """The value a record contributes to its cell: the hit, the KL, or the mean NLL."""
    kind = record.get("kind")
    if record.get("error"):
        return None
    if kind == "needle":
        return 1.0 if record.get("hit") else 0.0
    if kind == "kl":
        return record.get("kl")
    if kind == "ppl":
        return record.get("nll")
    return None


def cells(records: Iterable[dict], by=cell_key) -> Dict[tuple, Cell]:
    """Each cell's estimate (by groups records; default the cell key)."""
    groups: Dict[tuple, List[float]] = {}
    kinds: Dict[tuple, str] = {}
    for r in records:
        v = value_of(r)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        k = by(r)
        groups.setdefault(k, []).append(v)
        kinds[k] = r.get("kind")
    return {k: estimate(vs, binary=kinds[k] == "needle") for k, vs in groups.items()}
