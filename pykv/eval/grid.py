"""The loop every evaluation shares: runs in order, those already in the results skipped,
each new record kept as soon as it is measured, progress on stderr."""
from __future__ import annotations

import time
from typing import Callable, Iterable, Tuple

from .. import errors
from .progress import Progress
from .results import ResultStore, cell_key, run_key

# A job: the record that identifies a run, the tokens it evaluates (for the time left), and
# the function that measures it (filling the record in and returning it).
Job = Tuple[dict, int, Callable[[dict], dict]]


def run_grid(store: ResultStore, jobs: Iterable[Job], n_jobs: int, n_tokens: int, samples_per_cell: int,
             progress: Progress = None) -> None:
    jobs = list(jobs)
    n_cells = len({cell_key(record) for record, _, _ in jobs})
    if progress is None:
        progress = Progress(n_jobs, n_tokens, n_cells)
    counts = {}
    try:
        for record, tokens, measure in jobs:
            key = cell_key(record)
            counts[key] = counts.get(key, 0) + 1
            cells_done = sum(1 for c in counts.values() if c == samples_per_cell)
            if store.done(run_key(record)):
                progress.skip(tokens, cells_done)
            else:
                store.add(_measured(measure, record))
                progress.step(tokens, cells_done)
    finally:
        store.flush()   # an interrupted run keeps every record measured
        progress.done()


def _measured(measure, record: dict) -> dict:
    """The record measure fills in; a run the library refuses (a budget below a policy's
    least, say) is kept with its error, so a resumed run does not retry it, and counts in no
    cell."""
    t0 = time.perf_counter()
    try:
        return measure(record)
    except (errors.InvalidArgumentError, errors.ContextOverflowError) as exc:
        record.update(error=f"{type(exc).__name__}: {exc}", seconds=round(time.perf_counter() - t0, 3))
        return record
