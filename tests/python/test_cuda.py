"""The CUDA backend (n_gpu_layers) checked against the CPU path, which is the reference.

Without a GPU (CI, any CPU-only machine) only the fallback runs here: layers asked of a GPU
stay on the CPU with one warning and the results are the CPU's. On a GPU (tests/gpu/run.sh)
every tiny model and every weight type the kernels read is run with all layers on the GPU,
with part of them, and with the classifier there or not, against the same model on the CPU's
exact path:
logits within tolerance, greedy tokens equal for 64 steps (steps whose two best CPU logits
are closer than the tolerance aside), saved states crossing between the two, the prompt
cache, cancellation, the KV cache's byte counts, and decode steps replayed as CUDA graphs. The kernels themselves are compared
with their CPU twins by the C tests tests/c/test_cuda_*.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import pykv
from pykv import Llama
from pykv.errors import GenerationCancelled

from _tiny_models import random_tokens, variant, write_tiny_gguf

HAS_GPU = "CUDA = 1" in pykv.system_info()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU here: " + pykv.system_info().split("|")[-1].strip()
                               + " (tests/gpu/run.sh runs these on a lent GPU)")

# Every layout the kernels must take: GQA ratios 1:1 to 6:1, head sizes 16 to 64, tied and
# untied classifiers, and every weight type (the K-quant variant also holds Q2_K, Q3_K,
# IQ4_NL and IQ4_XS, which are converted to f16 on upload).
TINY = ["llama_f32_h4kv4", "llama_f16_h4kv2_tied", "llama_q8_0_h8kv2", "llama_q4_0_h6kv1_tied",
        "llama_q4_1_h4kv2_tied", "mistral_q4_0_h8kv2", "mistral_f16_h4kv1", "llama_kquants_h4kv2"]
# the types no tiny variant has: BF16, Q5_0, Q5_1 (head size 32)
from dataclasses import replace  # noqa: E402

EXTRA_TYPES = replace(variant("llama_q8_0_h8kv2"), name="llama_q5_bf16_h4kv2", n_head=4, n_head_kv=2,
                      tensor_types=(("attn_q", "Q5_0"), ("attn_k", "Q5_1"), ("attn_v", "BF16"),
                                    ("attn_output", "Q5_1"), ("ffn_gate", "Q5_0"), ("ffn_up", "BF16"),
                                    ("ffn_down", "Q5_0")))
# SmolLM2-135M's exact shape with random weights (the real file is too large to carry to a GPU)
SMOL_SHAPE = replace(variant("llama_q4_1_h4kv2_tied"), name="smollm2_shape", n_embd=576, n_layer=30, n_head=9,
                     n_head_kv=3, n_ff=1536, rope_base=1e5, vocab_size=49152, wtype="Q4_1", embd_type="Q8_0")

# Logits of the GPU against the CPU's exact path (float activations, exact_matmul): the GPU
# takes 8-bit activations in decode products and f16 tiles in prefill ones (and converts the
# weight types it has no kernel for to f16), so it differs by rounding, relative to the logits'
# spread. The CPU's default path rounds differently again (8-bit activations on every weight
# type), so it is not the reference.
LOGIT_RTOL = 2e-2


def _model(tmp_path_factory, spec):
    path = tmp_path_factory.getbasetemp() / f"{spec.name}.gguf"
    if not path.exists():
        write_tiny_gguf(spec, path)
    return str(path)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return lambda spec: _model(tmp_path_factory, variant(spec) if isinstance(spec, str) else spec)


def _open(path, n_gpu_layers=0, **kw):
    kw.setdefault("n_ctx", 256)
    kw.setdefault("n_threads", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if n_gpu_layers and not HAS_GPU else "error")
        return Llama(path, n_gpu_layers=n_gpu_layers, **kw)


def _close_enough(gpu: np.ndarray, cpu: np.ndarray) -> float:
    """The largest difference relative to the CPU logits' spread."""
    return float(np.max(np.abs(gpu - cpu)) / (np.max(cpu) - np.min(cpu)))


# A device list's GPU rows: its room rounded up to steps of this many, or half as much again
# as it had when it outgrows them (native/src/kv/kv-cache.c, kv_device_rows)
DEVICE_ROOM_STEP = 256


def _device_row_bytes(llm) -> float:
    return 2 * llm.model_info["head_dim"] * llm.kv_stats()["bytes_per_element"]


def _device_bytes_bound(llm, gpu_lists: int) -> float:
    """The most GPU memory the lists may hold: a list keeps its rows while its room is more than
    half of them and grows them to at most half as much again, so its rows stay under twice
    its room plus one step."""
    return 2 * llm.kv_stats()["bytes"] + gpu_lists * DEVICE_ROOM_STEP * _device_row_bytes(llm)


def _greedy_agreement(path, n_gpu_layers, steps=64, n_prompt=24, **kw):
    """Feed the CPU's greedy tokens to both sides; return (steps compared, disagreements at
    steps whose two best CPU logits are further apart than the tolerance, worst logit error)."""
    prompt = random_tokens(n_prompt, seed=3)
    with _open(path, exact_matmul=True, **kw) as cpu, _open(path, n_gpu_layers, **kw) as gpu:
        cpu.eval(prompt)
        gpu.eval(prompt)
        bad, worst = 0, 0.0
        for _ in range(steps):
            a, b = cpu.logits().copy(), gpu.logits().copy()
            worst = max(worst, _close_enough(b, a))
            top2 = np.sort(a)[-2:]
            tol = LOGIT_RTOL * (np.max(a) - np.min(a))
            if top2[1] - top2[0] > tol and int(np.argmax(b)) != int(np.argmax(a)):
                bad += 1
            token = int(np.argmax(a))
            cpu.eval([token])
            gpu.eval([token])
        return steps, bad, worst


def test_layers_asked_of_a_missing_gpu_run_on_the_cpu(model_path):
    """Without a GPU (or without the CUDA backend), n_gpu_layers warns once and changes
    nothing: the logits are the CPU's, bit for bit."""
    if HAS_GPU:
        pytest.skip("this machine has a GPU: the offload tests below run instead")
    path = model_path("llama_q8_0_h8kv2")
    tokens = random_tokens(20, seed=1)
    with _open(path) as cpu:
        cpu.eval(tokens)
        want = cpu.logits().copy()
    with pytest.warns(RuntimeWarning, match=r"n_gpu_layers=-1: .*every layer runs on the CPU"):
        llm = Llama(path, n_ctx=64, n_threads=2, n_gpu_layers=-1)
    with llm:
        assert llm.model_info["n_gpu_layers"] == 0 and llm.model_info["gpu_device"] == -1
        llm.eval(tokens)
        np.testing.assert_array_equal(llm.logits(), want)
        assert llm.kv_stats()["device_bytes"] == 0


def _cli(*args):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pykv", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_gpu_flags(model_path):
    """-ngl on generate gives the CPU's greedy text (on a GPU within the tolerance's near-ties,
    which a tiny model's 8 greedy tokens do not meet); info names what goes to the GPU."""
    path = model_path("llama_q8_0_h8kv2")
    cpu = _cli("generate", path, "-p", "the cat", "-n", "8", "--temp", "0", "-t", "2", "--no-display-prompt")
    gpu = _cli("generate", path, "-p", "the cat", "-n", "8", "--temp", "0", "-t", "2", "--no-display-prompt",
               "-ngl", "99", "-mg", "0")
    assert cpu.returncode == 0 and gpu.returncode == 0, gpu.stderr
    assert gpu.stdout == cpu.stdout
    info = _cli("info", path, "-ngl", "99")
    assert info.returncode == 0, info.stderr
    system = _cli("info", "--system")
    if HAS_GPU:
        assert "3 of 3 layers and the classifier on CUDA device 0" in info.stdout
        assert "| GPU 0 = " in system.stdout and "GiB free of" in system.stdout
    else:
        assert "n_gpu_layers=99" in gpu.stderr and "every layer runs on the CPU" in gpu.stderr
        assert "GPU offload (-ngl 99):\n  none: " in info.stdout
        assert "CUDA = 0" in system.stdout


def test_bad_gpu_arguments_are_clear_errors(model_path):
    path = model_path("llama_q8_0_h8kv2")
    with pytest.raises(pykv.InvalidArgumentError, match="n_gpu_layers must be an integer >= -1"):
        Llama(path, n_gpu_layers=-2)
    with pytest.raises(pykv.InvalidArgumentError, match="main_gpu must be an integer >= 0"):
        Llama(path, main_gpu="0")
    if HAS_GPU:
        with pytest.raises(pykv.InvalidArgumentError, match="main_gpu = 99, but this machine has"):
            Llama(path, n_gpu_layers=-1, main_gpu=99)


@needs_gpu
@pytest.mark.parametrize("name", TINY + [EXTRA_TYPES.name])
def test_all_layers_on_the_gpu_match_the_cpu(model_path, name):
    """Prefill (chunks of 16, so the tensor-core path and the causal attention run) and 64
    greedy decode steps, the classifier on the GPU."""
    path = model_path(EXTRA_TYPES if name == EXTRA_TYPES.name else name)
    tokens = random_tokens(40, seed=2)
    with _open(path, n_batch=16, exact_matmul=True) as cpu, _open(path, -1, n_batch=16) as gpu:
        info = gpu.model_info
        assert info["n_gpu_layers"] == info["n_layer"] and info["gpu_output"] == 1 and info["gpu_bytes"] > 0
        cpu.eval(tokens)
        gpu.eval(tokens)
        assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL
    steps, bad, worst = _greedy_agreement(path, -1)
    assert bad == 0, f"{bad} of {steps} greedy steps differ (worst logit error {worst:.3g})"
    assert worst < LOGIT_RTOL


@needs_gpu
def test_smollm2_shaped_model_matches_the_cpu(model_path):
    """SmolLM2-135M's shape (Q4_1, 30 layers, 9 heads over 3 KV heads, vocabulary 49152)."""
    path = model_path(SMOL_SHAPE)
    steps, bad, worst = _greedy_agreement(path, -1, n_prompt=100, n_ctx=512)
    assert bad == 0, f"{bad} of {steps} greedy steps differ (worst logit error {worst:.3g})"
    assert worst < LOGIT_RTOL


@needs_gpu
@pytest.mark.parametrize("layers", [2, -1])
def test_decode_graph_replays_the_plain_steps_exactly(model_path, monkeypatch, layers):
    """A decode step recorded as a CUDA graph runs the same kernels as the step queued kernel
    by kernel (PYKV_CUDA_GRAPHS=0): the same logits bit for bit, through list growth (each
    reallocation records the step again), with part of the layers on the CPU too."""
    path = model_path("llama_q8_0_h8kv2")
    prompt = random_tokens(10, seed=12)
    with _open(path, layers, n_ctx=512) as graphed:
        monkeypatch.setenv("PYKV_CUDA_GRAPHS", "0")
        with _open(path, layers, n_ctx=512) as plain:
            graphed.eval(prompt)
            plain.eval(prompt)
            for step in range(300):
                a, b = graphed.logits(), plain.logits()
                np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
                token = int(np.argmax(a))
                graphed.eval([token])
                plain.eval([token])


# Run in a child process: PYKV_CUDA_TIMINGS is read once per process. Prints the wall time
# from before the first call to after the context is freed, which bounds the GPU's.
_TIMINGS_CHILD = r"""
import json, sys, time
from pykv import Llama
path, prompt, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_gpu_layers=-1, n_ctx=256, n_batch=16, n_threads=2)
t0 = time.perf_counter()
llm.eval(prompt)
for _ in range(steps):
    llm.eval([int(llm.logits().argmax())])
llm.close()
print(json.dumps({"wall_ms": (time.perf_counter() - t0) * 1e3}))
"""


def _stage_table(stderr: str) -> tuple:
    """(title, {stage: (calls, total_ms, ms_per_call, share)}, all_ms) from the table."""
    lines = stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("pykv: GPU time by stage, "))
    title = lines[at][len("pykv: GPU time by stage, "):]
    assert lines[at + 1].split() == ["stage", "calls", "total", "ms", "ms/call", "share"]
    rows, all_ms = {}, None
    for line in lines[at + 2:]:
        parts = line.split()
        if parts[0] == "all":
            all_ms = float(parts[1])
            break
        name = line[:37].strip()   # names have spaces; the numbers are the last four fields
        rows[name] = (int(parts[-4]), float(parts[-3]), float(parts[-2]), float(parts[-1].rstrip("%")))
    return title, rows, all_ms


@needs_gpu
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_stage_timings_account_for_every_layer_and_step(model_path, graphs):
    """PYKV_CUDA_TIMINGS=1: when the context closes, a table on stderr gives the GPU's time by
    stage. Every layer of each prefill chunk counts once in its stages; a decode step is one
    replayed graph, or (PYKV_CUDA_GRAPHS=0) its layers stage by stage. The times add up to
    the total, which the wall time bounds."""
    import json
    import os
    import subprocess
    import sys
    path = model_path("llama_q8_0_h8kv2")   # 3 layers
    n_layer, prompt, steps = 3, random_tokens(40, seed=8), 5   # chunks of 16: 16, 16, 8
    env = dict(os.environ, PYKV_CUDA_TIMINGS="1", PYKV_CUDA_GRAPHS=graphs)
    done = subprocess.run([sys.executable, "-c", _TIMINGS_CHILD, path, json.dumps(prompt), str(steps)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wall_ms = json.loads(done.stdout.splitlines()[-1])["wall_ms"]
    title, rows, all_ms = _stage_table(done.stderr)
    assert title == f"policy full, layers 0 to {n_layer - 1} of {n_layer}"
    chunks = 3 + (0 if graphs == "1" else steps)
    for stage in ("q|k|v product", "rope, kv append", "attention", "gate|up product", "swiglu"):
        assert rows[stage][0] == n_layer * chunks, (stage, rows[stage])
    assert rows["norm"][0] == 2 * n_layer * chunks
    if graphs == "1":
        assert rows["decode step (CUDA graph)"][0] == steps
    else:
        assert "decode step (CUDA graph)" not in rows
    assert rows["classifier"][0] >= 1 + (0 if graphs == "1" else steps)
    for name, (calls, total, per_call, share) in rows.items():
        assert total >= 0 and abs(per_call - total / calls) <= 1e-3 + 1e-3 * total, name
        assert abs(share - 100 * total / all_ms) <= 0.1, name
    assert abs(sum(r[1] for r in rows.values()) - all_ms) <= 1e-3 * len(rows) + 1e-6 * all_ms
    assert 0 < all_ms <= wall_ms + 1.0


@needs_gpu
@pytest.mark.parametrize("layers", ["one", "half", "all_but_output", "all"])
def test_partial_offload_gives_the_same_tokens(model_path, layers):
    path = model_path("llama_q8_0_h8kv2")   # 3 layers
    n = {"one": 1, "half": 2, "all_but_output": 3, "all": 4}[layers]
    with _open(path, n) as llm:
        assert llm.model_info["n_gpu_layers"] == min(n, 3)
        assert llm.model_info["gpu_output"] == (n > 3)
    steps, bad, worst = _greedy_agreement(path, n)
    assert bad == 0 and worst < LOGIT_RTOL, (bad, worst)


@needs_gpu
def test_per_token_logits_and_chunk_sizes(model_path):
    """logits_all reads every token's row (the residual stream comes back from the GPU), and
    the chunk size does not change the result beyond rounding."""
    path = model_path("mistral_q4_0_h8kv2")
    tokens = random_tokens(70, seed=4)
    with _open(path, logits_all=True, n_batch=32, exact_matmul=True) as cpu, \
            _open(path, -1, logits_all=True, n_batch=32) as gpu, \
            _open(path, -1, n_batch=7) as small:
        cpu.eval(tokens)
        gpu.eval(tokens)
        small.eval(tokens)
        rows_cpu, rows_gpu = cpu.all_logits(), gpu.all_logits()
        assert rows_gpu.shape == rows_cpu.shape == (70, cpu.n_vocab)
        for r in range(70):
            assert _close_enough(rows_gpu[r], rows_cpu[r]) < LOGIT_RTOL, r
        assert _close_enough(small.logits(), cpu.logits()) < LOGIT_RTOL


@needs_gpu
def test_states_cross_between_gpu_and_cpu(model_path):
    """A state saved with the layers on the GPU loads into a CPU context and the reverse;
    either continues as the context that saved it."""
    path = model_path("llama_q4_1_h4kv2_tied")
    tokens = random_tokens(30, seed=5)
    with _open(path, exact_matmul=True) as cpu, _open(path, -1) as gpu:
        gpu.eval(tokens)
        state = gpu.save_state()
        cpu.load_state(state)
        assert cpu.n_past == 30
        gpu.eval([7])
        cpu.eval([7])
        assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL
        cpu.reset()
        cpu.eval(tokens)
        back = cpu.save_state()
        gpu.load_state(back)
        gpu.eval([9])
        cpu.eval([9])
        assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL


@needs_gpu
def test_kv_stats_count_device_bytes(model_path):
    path = model_path("llama_q8_0_h8kv2")
    tokens = random_tokens(50, seed=6)
    with _open(path) as cpu, _open(path, 2) as part, _open(path, -1) as gpu:
        for llm in (cpu, part, gpu):
            llm.eval(tokens)
        a, b, c = cpu.kv_stats(), part.kv_stats(), gpu.kv_stats()
        assert a["bytes"] == b["bytes"] == c["bytes"] and a["entries"] == c["entries"]
        assert a["device_bytes"] == 0 < b["device_bytes"] < c["device_bytes"]
        # 50 entries a list: every device list holds one step of GPU rows
        heads, row = gpu.model_info["n_head_kv"], _device_row_bytes(gpu)
        assert b["device_bytes"] == 2 * heads * DEVICE_ROOM_STEP * row
        assert c["device_bytes"] == gpu.model_info["n_layer"] * heads * DEVICE_ROOM_STEP * row
        gpu.reset()
        assert gpu.kv_stats()["device_bytes"] == 0


@needs_gpu
def test_prompt_cache_and_truncation_on_the_gpu(model_path):
    """Reusing a prefix cuts the GPU lists back (pykv_truncate) and goes on as a fresh run."""
    path = model_path("llama_f16_h4kv2_tied")
    a, b = random_tokens(40, seed=7), random_tokens(12, seed=8)
    with _open(path, -1) as gpu, _open(path, -1) as fresh:
        gpu.eval(a + b)
        gpu.truncate(40)
        gpu.eval(b[::-1])
        fresh.eval(a + b[::-1])
        assert _close_enough(gpu.logits(), fresh.logits()) < 1e-5


@needs_gpu
def test_cancelled_prefill_leaves_the_gpu_context_usable(model_path):
    path = model_path("llama_q8_0_h8kv2")
    tokens = random_tokens(120, seed=9)
    with _open(path, -1, n_batch=16) as gpu, _open(path, n_batch=16, exact_matmul=True) as cpu:
        def stop(done, total):
            return done < 32   # False stops the prefill at the next chunk boundary
        with pytest.raises(GenerationCancelled):
            gpu.eval(tokens, progress=stop)
        kept = gpu.n_past
        assert 32 <= kept < 120
        gpu.eval(tokens[kept:])
        cpu.eval(tokens)
        assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL


@needs_gpu
def test_exact_matmul_keeps_the_layers_on_the_cpu(model_path):
    """exact_matmul (float activations everywhere) is the CPU's: such a context runs every layer
    there, with one warning, and gives the CPU's logits bit for bit."""
    path = model_path("llama_q8_0_h8kv2")
    tokens = random_tokens(50, seed=10)
    with pytest.warns(RuntimeWarning, match="exact_matmul runs on the CPU: this context runs every layer there"):
        llm = Llama(path, n_ctx=256, n_gpu_layers=-1, exact_matmul=True)
    with llm, _open(path, exact_matmul=True) as cpu:
        llm.eval(tokens)
        cpu.eval(tokens)
        assert llm.kv_stats()["device_bytes"] == 0
        np.testing.assert_array_equal(llm.logits(), cpu.logits())


@needs_gpu
def test_create_and_close_cycles_give_gpu_memory_back(model_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    path = model_path("llama_q4_0_h6kv1_tied")

    def cycle():
        with _open(path, -1) as llm:
            llm.eval(random_tokens(64, seed=11))
    cycle()   # the CUDA runtime's own first-use allocations
    free_before = torch.cuda.mem_get_info()[0]
    for _ in range(10):
        cycle()
    assert free_before - torch.cuda.mem_get_info()[0] < 8 << 20
