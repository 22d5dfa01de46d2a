"""pykv logits on the real SmolLM2-135M-Instruct Q4_1 vs torch/transformers (float32, CPU).

Both sides load the same GGUF and dequantize the same Q4_1/Q8_0 blocks to float32, so
quantization error cancels out; what is left is float32 rounding and summation order
over 30 layers (n_embd 576, ff 1536).  Our NumPy float64 reference agrees with
transformers to 4.3e-5 (max abs, logits up to ~35) on this model.  Measured pykv vs
transformers: max abs 5.0e-5 over all checked positions of the 5-, 200- and 2000-token
prompts (all argmax equal); ATOL is 4x that.

Token ids come from the HF tokenizer built from the GGUF, so this file does not depend
on pykv's tokenizer.  Several positions are checked: some reached by (chunked) prefill,
the last ones by single-token decode steps.
"""

from __future__ import annotations

import pytest

from _compare import assert_logits_close, EXACT
from _prompts import SHORT, hf_prompt_ids
from _torch_reference import hf_tokenize, reference_logits
from pykv import Llama

pytestmark = pytest.mark.model

ATOL = 2e-4   # absolute, logits are O(10..35)
N_CTX = 2048


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with Llama(str(smollm2_path), n_ctx=N_CTX, verbose=False, **EXACT) as model:
        yield model


def c_logits_at(llm, ids, positions):
    """Feed ``ids`` in segments ending at each position; return pykv logits per position."""
    llm.reset()
    out, done = [], 0
    for p in sorted(positions):
        llm.eval(ids[done:p + 1])
        done = p + 1
        assert llm.n_past == done
        out.append(llm.logits().copy())
    return out


def _check(llm, path, ids, positions, label):
    ref = reference_logits(path, ids, positions)
    got = c_logits_at(llm, ids, positions)
    for row, (p, g) in enumerate(zip(sorted(positions), got)):
        assert_logits_close(g, ref[row], atol=ATOL, what=f"{label}, position {p}")


def test_short_prompt(llm, smollm2_path):
    ids = hf_tokenize(smollm2_path, SHORT)
    assert len(ids) == 5
    n = len(ids)
    _check(llm, smollm2_path, ids, [n - 3, n - 2, n - 1], "5-token prompt")


def test_200_token_prompt(llm, smollm2_path):
    ids = hf_prompt_ids(smollm2_path, 200, seed=1)
    _check(llm, smollm2_path, ids, [49, 197, 198, 199], "200-token prompt")


def test_2000_token_prompt(llm, smollm2_path):
    ids = hf_prompt_ids(smollm2_path, 2000, seed=2)
    _check(llm, smollm2_path, ids, [999, 1997, 1998, 1999], "2000-token prompt")
