"""A fast slice of bench/needle.py in CI, so that a policy broken in a way the unit tests
miss cannot land: 1K-token licence-text haystacks with a passkey at depths 10% and 30%,
question in the prompt, SmolLM2, greedy. The full cache finds both; so do the policies and
budgets below, which retrieved every sample of the first benchmark run (BENCHMARKS.md).
The outcome is deterministic (greedy decoding, thread-count-independent kernels), but a
change of rounding anywhere moves the logits: the smallest margin of a passkey digit over
the next token is ~5 logits with the full cache, 0.25-0.3 for adakv at 25% (sample 0), and
was 0.12 for take at 25%, which the 8-bit prefill of the 576-wide products turned into -0.01;
take is checked at 35%, where both samples clear 2 logits with or without that change."""
import sys
from pathlib import Path

import pytest

from pykv import Llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import needle  # noqa: E402

CASES = [("full", None), ("adakv", 25), ("take", 35), ("snapkv", 50), ("lava", 50)]


@pytest.fixture(scope="module")
def tasks(smollm2_path):
    with Llama(smollm2_path, n_ctx=1100, vocab_only=True) as llm:
        return [needle.Task(llm, 1024, sample) for sample in (0, 1)]


@pytest.mark.parametrize("policy,percent", CASES)
def test_policy_finds_the_needle(smollm2_path, tasks, policy, percent):
    for task in tasks:
        budget = None if percent is None else round(len(task.context) * percent / 100)
        with Llama(smollm2_path, n_ctx=1100, n_threads=2, policy=policy, budget=budget) as llm:
            answer = needle.answer(llm, task, aware=True)
            assert task.hit(answer), f"{policy} at {percent}%: {answer!r} (passkey {task.passkey})"
