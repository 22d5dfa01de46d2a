"""Python callbacks in generation, as llama-cpp-python takes them: logits processors, which
change a step's logits before the sampler sees them, and stopping criteria, which end a
generation. Each receives the context's token ids (a NumPy intc array) and the step's logits
(float32, n_vocab)."""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import numpy.typing as npt

from . import errors

LogitsProcessor = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], npt.NDArray[np.single]]
StoppingCriteria = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], bool]


class LogitsProcessorList(List[LogitsProcessor]):
    """Processors applied in order, each to the scores the one before returned."""

    def __call__(self, input_ids, scores):
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class StoppingCriteriaList(List[StoppingCriteria]):
    """Stops when any of its criteria says so."""

    def __call__(self, input_ids, logits) -> bool:
        return any([criterion(input_ids, logits) for criterion in self])


def as_callback(value, kind: type, what: str) -> Optional[Callable]:
    """value (None, one callable or a list of them) as one callable of kind's behaviour."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if callable(value) and not isinstance(value, (list, tuple)):
        return value
    if isinstance(value, (list, tuple)) and all(callable(v) for v in value):
        return value if isinstance(value, kind) else kind(value)
    raise errors.InvalidArgumentError(f"{what} must be a callable or a list of callables, got {value!r}")


def processed_logits(processor: Callable, input_ids, logits: np.ndarray) -> np.ndarray:
    """processor's scores for a copy of logits, as the contiguous float32 vector the sampler
    reads; InvalidArgumentError when they have another shape."""
    scores = np.ascontiguousarray(processor(input_ids, logits.copy()), dtype=np.float32)
    if scores.shape != logits.shape:
        raise errors.InvalidArgumentError(
            f"logits_processor returned scores of shape {scores.shape}, not {logits.shape}")
    return scores
