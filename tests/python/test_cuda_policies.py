"""The eviction policies with the layers on the GPU, checked against the CPU path.

Every policy runs there (policy_ops.device_lists) and scores on the device (the observation
window, TAKE's and FINCH's probes, the attention sums, LAVa's value norms, the keys and values
of knorm, keydiff and lagkv, expected_attention's query statistics and expected logits,
criticalkv's value weights, KVzip's reconstruction passes), random from positions alone; EMS
merges at a prompt's end on the device (each to-be-merged entry's most similar centre found
there, only the merging rows brought down), a later prompt's merged entries expanded by the
GPU's attention and attention sums; all compact the lists in GPU memory. SnapKV, PyramidKV,
Ada-KV, knorm, keydiff, lagkv and expected_attention select on the device too, the decode steps
of h2o, tova, cake and ems take their attention sums from the recorded decode step, and EMS's
decode steps merge on the device.
Each is run on the same prompt by a context with every layer on the GPU and by one on the
CPU's exact path, and compared: the positions every (layer, KV head) list keeps, the byte
counts of kv_stats, the budget, and the logits.

Positions chosen by position alone (streamingllm, random) must be equal. Those chosen by
scores may differ where two candidates' scores are closer than the two sides' rounding (the
GPU's 8-bit and f16 products against the CPU's floats): such near-ties are counted, and
bounded to a small share of the kept entries. Without a GPU every test skips with the reason.
"""
from __future__ import annotations

import numpy as np
import pytest

from _tiny_models import random_tokens
from test_cuda import LOGIT_RTOL, SMOL_SHAPE, _close_enough, _device_bytes_bound, _open, model_path, needs_gpu  # noqa: F401

# The policies whose hooks run on GPU lists, with arguments that make them evict here.
SCORED = ["snapkv", "pyramidkv", "adakv", "chunkkv", "lava", "take", "cake", "h2o", "tova", "knorm", "keydiff", "lagkv", "finch",
          "criticalkv", "criticaladakv", "expected_attention", "kvzip", "ems"]
BY_POSITION = ["streamingllm", "random"]
BUDGET = 48
# Kept entries of scored policies that may differ between GPU and CPU (near-ties), as a share
# of the kept entries.
NEAR_TIE_SHARE = 0.03
# Lists whose decode step evicted another entry on the GPU than on the CPU from the same
# cache (policies that evict while decoding), as a share of the lists stepped.
DECODE_NEAR_TIE_SHARE = 0.05


def test_policy_info_says_which_policies_run_on_the_gpu():
    """pykv_policy_info's runs_on_gpu, and `pykv info --policies`, name the policies a
    context runs on the GPU: every one, each tested here."""
    from pykv.policies import policy_info
    from test_cuda import _cli
    on_gpu = {p["name"] for p in policy_info() if p["runs_on_gpu"]}
    assert on_gpu == {p["name"] for p in policy_info()} == set(SCORED + BY_POSITION + ["full"])
    out = _cli("info", "--policies")
    assert out.returncode == 0, out.stderr
    blocks, name = {}, None
    for line in out.stdout.splitlines():   # "  NAME  description", then its lines indented further
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
        elif name:
            blocks[name] = blocks.get(name, "") + line.strip() + "\n"
    assert "GPU: runs with the layers on the GPU (-ngl), scoring and evicting there" in blocks["snapkv"]
    assert "GPU: runs with the layers on the GPU (-ngl)\n" in blocks["full"]


def _positions(llm):
    info = llm.model_info
    return [[llm.kv_positions(layer, g) for g in range(info["n_head_kv"])] for layer in range(info["n_layer"])]


def _differing(a, b):
    """Entries kept by one side and not the other, over every list; and the entries kept."""
    diff = kept = 0
    for la, lb in zip(a, b):
        for pa, pb in zip(la, lb):
            diff += len(set(pa) ^ set(pb))
            kept += len(pa)
    return diff, kept


def _pair(path, policy, layers=-1, **kw):
    kw.setdefault("n_ctx", 512)
    kw.setdefault("budget", BUDGET)
    return _open(path, exact_matmul=True, policy=policy, **kw), _open(path, layers, policy=policy, **kw)


def _check_same_cache(cpu, gpu, policy, exact):
    a, b = _positions(cpu), _positions(gpu)
    diff, kept = _differing(a, b)
    if exact:
        assert a == b, f"{policy}: the GPU kept other positions than the CPU"
    else:
        assert diff <= NEAR_TIE_SHARE * kept, f"{policy}: {diff} of {kept} kept entries differ"
    sa, sb = cpu.kv_stats(), gpu.kv_stats()
    assert sb["evicted"] > 0 and sa["entries"] + sa["evicted"] == sb["entries"] + sb["evicted"]
    # a near-tie across heads (Ada-KV's, LAVa's and CAKE's budgets) moves an entry between lists
    moved = sum(abs(x - y) for ra, rb in zip(sa["entries_per_head"], sb["entries_per_head"]) for x, y in zip(ra, rb))
    assert moved <= diff, f"{policy}: {moved} entries kept in other lists than on the CPU, {diff} differ"
    # the rooms follow every selection on the way, so a near-tie at an earlier one (CAKE's and
    # LAVa's cascades select each layer many times) may leave another room behind even where
    # the final counts agree: they are equal where the kept sets are
    if diff == 0:
        assert sa["bytes"] == sb["bytes"], "the lists' room differs"
    return diff


def _decode_from_the_gpu_state(cpu, gpu, steps, after_step=None):
    """`steps` greedy decode steps, the CPU taking each from the GPU's cache state (so that one
    near-tie does not carry into every later step), the logits within the tolerance at each.
    Returns the lists whose kept positions differed after a step, summed over the steps."""
    flips = 0
    for step in range(steps):
        cpu.load_state(gpu.save_state())
        token = int(np.argmax(gpu.logits()))
        cpu.eval([token])
        gpu.eval([token])
        assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL, step
        a, b = _positions(cpu), _positions(gpu)
        flips += sum(pa != pb for la, lb in zip(a, b) for pa, pb in zip(la, lb))
        if after_step:
            after_step(step)
    return flips


@needs_gpu
@pytest.mark.parametrize("name", ["llama_q8_0_h8kv2", "mistral_f16_h4kv1", "llama_q4_0_h6kv1_tied"])
@pytest.mark.parametrize("policy", SCORED + BY_POSITION)
def test_policy_on_the_gpu_keeps_what_the_cpu_keeps(model_path, name, policy):
    """A 200-token prompt in chunks of 64 (the window's queries in the last one): the same
    kept positions and byte counts, the budget held, the logits within the offload tolerance
    where the kept sets agree. Then 16 decode steps, each from the same cache on both sides
    (the GPU's state loaded into the CPU context first, so that one near-tie does not carry
    into every later step): the lists whose step evicted another entry are counted."""
    path = model_path(name)
    cpu, gpu = _pair(path, policy, n_batch=64)
    with cpu, gpu:
        prompt = random_tokens(200, seed=21)
        cpu.eval(prompt)
        gpu.eval(prompt)
        diff = _check_same_cache(cpu, gpu, policy, exact=policy in BY_POSITION)
        lists = gpu.model_info["n_layer"] * gpu.model_info["n_head_kv"]
        assert gpu.kv_stats()["entries"] <= BUDGET * lists   # the budget is the lists' average
        assert 0 < gpu.kv_stats()["device_bytes"] <= _device_bytes_bound(gpu, lists)
        if diff == 0:
            assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL
        if policy == "ems":   # merged entries, which the GPU's attention expands
            assert gpu.kv_stats()["merged"] > 0
        flips = _decode_from_the_gpu_state(cpu, gpu, 16)
        assert flips <= (0 if policy in BY_POSITION else DECODE_NEAR_TIE_SHARE * 16 * lists), flips


@needs_gpu
@pytest.mark.parametrize("kwargs", [{"lag": 16}, {"lag": 16, "cross": 1}, {"lag": 8, "sink": 0}])
def test_lagkv_partitions_on_the_gpu_keep_what_the_cpu_keeps(model_path, kwargs):
    """LagKV with partitions short enough that a 200-token prompt has a dozen of them, each
    scored against the next on the device: the kept positions and byte counts are the CPU's
    (near-ties aside), and the logits agree where the kept sets do."""
    path = model_path("llama_q8_0_h8kv2")
    cpu, gpu = _pair(path, "lagkv", n_batch=64, policy_kwargs=kwargs)
    with cpu, gpu:
        prompt = random_tokens(200, seed=36)
        cpu.eval(prompt)
        gpu.eval(prompt)
        diff = _check_same_cache(cpu, gpu, "lagkv", exact=False)
        lists = gpu.model_info["n_layer"] * gpu.model_info["n_head_kv"]
        assert gpu.kv_stats()["entries"] == BUDGET * lists
        if diff == 0:
            assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL


@needs_gpu
def test_streamingllm_decode_evicts_in_place_at_a_fixed_budget(model_path):
    """Every decode step appends and evicts on the GPU (in place, the lists keep their room):
    the positions stay the CPU's for 150 steps, the device bytes stay fixed, and the logits
    stay within the tolerance, through the recorded decode step."""
    path = model_path("llama_q8_0_h8kv2")
    cpu, gpu = _pair(path, "streamingllm", budget=64, sink=4)
    with cpu, gpu:
        prompt = random_tokens(100, seed=22)
        cpu.eval(prompt)
        gpu.eval(prompt)
        device_bytes = None
        for step in range(150):
            assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL, step
            token = int(np.argmax(cpu.logits()))
            cpu.eval([token])
            gpu.eval([token])
            if step % 25 == 24:
                assert _positions(gpu) == _positions(cpu), step
            if step == 10:
                device_bytes = gpu.kv_stats()["device_bytes"]
        assert gpu.kv_stats()["device_bytes"] == device_bytes
        assert gpu.kv_positions(0, 0)[:4] == [0, 1, 2, 3] and len(gpu.kv_positions(0, 0)) == 64


@needs_gpu
@pytest.mark.parametrize("policy", ["h2o", "tova", "cake"])
def test_decode_sums_come_from_the_recorded_step(model_path, policy):
    """The policies that rank by a decode step's attention evict at every step of the recorded
    decode step, which computes those sums itself: 60 steps, the CPU taking each from the
    GPU's cache state (so a near-tie does not carry on); the lists stay at the budget in place
    (device bytes fixed), the evicted entry is the CPU's in all but a few lists, the logits
    within the tolerance."""
    path = model_path("mistral_f16_h4kv1")
    cpu, gpu = _pair(path, policy, budget=48, n_batch=64)
    with cpu, gpu:
        prompt = random_tokens(120, seed=30)
        cpu.eval(prompt)
        gpu.eval(prompt)
        lists = gpu.model_info["n_layer"] * gpu.model_info["n_head_kv"]
        seen = {}

        def fixed_size(step):   # from step 5 on the lists stay as they are, in place
            now = (gpu.kv_stats()["device_bytes"], gpu.kv_stats()["entries"])
            if step == 5:
                seen["size"] = now
            elif step > 5:
                assert now == seen["size"], step

        flips = _decode_from_the_gpu_state(cpu, gpu, 60, fixed_size)
        assert seen["size"][1] <= 48 * lists
        assert flips <= DECODE_NEAR_TIE_SHARE * 60 * lists, flips


@needs_gpu
def test_ems_second_prompt_over_merged_entries(model_path):
    """A second prompt after the first was compressed: its chunks' attention sums, computed
    on the device, expand the merged entries into their members, and its end merges on the
    device lists again: both prompts in several chunks keep what the CPU keeps."""
    path = model_path("llama_q8_0_h8kv2")
    cpu, gpu = _pair(path, "ems", budget=48, n_batch=64)
    with cpu, gpu:
        for part in (random_tokens(200, seed=33), random_tokens(150, seed=34)):
            cpu.eval(part)
            gpu.eval(part)
            diff, kept = _differing(_positions(cpu), _positions(gpu))
            assert diff <= NEAR_TIE_SHARE * kept, f"{diff} of {kept} kept entries differ"
            # whether an entry merges or goes is a threshold on its similarity: a near-tie too
            merged_cpu, merged_gpu = cpu.kv_stats()["merged"], gpu.kv_stats()["merged"]
            assert merged_gpu > 0 and abs(merged_gpu - merged_cpu) <= max(2, merged_cpu // 10)
            assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL


@needs_gpu
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_ems_decodes_and_starts_again(model_path, monkeypatch, graphs):
    """EMS's decode steps: through the recorded step, every list's step done on the device
    together once it is done (ems-gpu.c); without CUDA graphs, each layer's lists staged in
    host buffers kept from one step to the next (kv_layer_stage). 40 decode steps that merge,
    and a reset to a new prompt, each step from the GPU's state on the CPU side; positions and
    logits as the CPU's."""
    monkeypatch.setenv("PYKV_CUDA_GRAPHS", graphs)
    path = model_path("llama_q8_0_h8kv2")
    cpu, gpu = _pair(path, "ems", budget=48, n_batch=64)
    with cpu, gpu:
        lists = gpu.model_info["n_layer"] * gpu.model_info["n_head_kv"]
        for seed in (31, 32):
            gpu.reset()
            cpu.reset()
            prompt = random_tokens(150, seed=seed)
            cpu.eval(prompt)
            gpu.eval(prompt)
            _check_same_cache(cpu, gpu, "ems", exact=False)
            merged = gpu.kv_stats()["merged"]
            flips = _decode_from_the_gpu_state(cpu, gpu, 40)
            assert gpu.kv_stats()["merged"] > merged   # the decode steps merged too
            assert flips <= DECODE_NEAR_TIE_SHARE * 40 * lists, flips


@needs_gpu
def test_ems_decode_on_the_device_matches_the_cpu_over_many_steps(model_path):
    """EMS decoding on its own for 120 steps on each side (no state copied across), with a
    short window and a low merge threshold so that most steps merge and the lists' member
    counts reach their cap (gamma B): the same entries per list, the same number of merged
    tokens within a few, the kept positions apart at near-ties only, and the device bytes
    fixed once the lists are at the budget."""
    path = model_path("mistral_f16_h4kv1")
    cpu, gpu = _pair(path, "ems", budget=40, n_batch=64, policy_kwargs={"window": 8, "tau": 0.05, "gamma": 2})
    with cpu, gpu:
        prompt = random_tokens(120, seed=35)
        cpu.eval(prompt)
        gpu.eval(prompt)
        merged = gpu.kv_stats()["merged"]
        sizes = []
        for _ in range(120):
            token = int(np.argmax(cpu.logits()))
            cpu.eval([token])
            gpu.eval([token])
            sizes.append(gpu.kv_stats()["device_bytes"])
        sa, sb = cpu.kv_stats(), gpu.kv_stats()
        assert sa["entries_per_head"] == sb["entries_per_head"]
        assert sb["merged"] > merged and abs(sb["merged"] - sa["merged"]) <= max(4, sa["merged"] // 10)
        diff, kept = _differing(_positions(cpu), _positions(gpu))
        assert diff <= 0.1 * kept, f"{diff} of {kept} kept entries differ"
        assert max(sizes[10:]) == min(sizes[10:])


@needs_gpu
def test_eviction_gives_device_memory_back(model_path):
    """After a compressing prefill the lists hold their budget in GPU memory, not the prompt."""
    path = model_path("llama_q8_0_h8kv2")
    prompt = random_tokens(400, seed=23)
    with _open(path, -1, n_ctx=512) as full, _open(path, -1, n_ctx=512, policy="snapkv", budget=40) as snap:
        full.eval(prompt)
        snap.eval(prompt)
        a, b = full.kv_stats()["device_bytes"], snap.kv_stats()["device_bytes"]
        assert b * 5 < a, (a, b)
        assert snap.kv_stats()["peak_bytes"] >= full.kv_stats()["bytes"] * 0.9


@needs_gpu
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("policy", ["snapkv", "ems"])
def test_partial_offload_with_a_policy(model_path, layers, policy):
    """Layers on the CPU and on the GPU under one policy: each keeps what the CPU keeps, and
    goes on doing so through decode steps (EMS's merge on the host for the CPU's layers, on the
    device for the GPU's, in the same step); a state the CPU saved with merged entries then
    loads into the GPU context and decodes there as on the CPU."""
    path = model_path("llama_q8_0_h8kv2")
    cpu, gpu = _pair(path, policy, layers=layers, n_batch=64)
    with cpu, gpu:
        prompt = random_tokens(160, seed=24)
        cpu.eval(prompt)
        gpu.eval(prompt)
        gpu_lists = layers * gpu.model_info["n_head_kv"]
        assert 0 < gpu.kv_stats()["device_bytes"] <= _device_bytes_bound(gpu, gpu_lists)
        _check_same_cache(cpu, gpu, policy, exact=False)
        lists = gpu.model_info["n_layer"] * gpu.model_info["n_head_kv"]
        flips = _decode_from_the_gpu_state(cpu, gpu, 12)
        assert flips <= DECODE_NEAR_TIE_SHARE * 12 * lists, flips
        gpu.load_state(cpu.save_state())   # the other way: the CPU's merged entries into device lists
        for _ in range(4):
            token = int(np.argmax(cpu.logits()))
            cpu.eval([token])
            gpu.eval([token])
            assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL
        if policy == "ems":
            assert gpu.kv_stats()["merged"] > 0


@needs_gpu
@pytest.mark.parametrize("policy", ["snapkv", "adakv"])
def test_question_after_the_context_and_every_chunk(model_path, policy):
    """Question-aware (a second prefill call compresses again with its own window) and
    question-agnostic (evict_every_chunk=1: every chunk compresses) orders."""
    path = model_path("mistral_q4_0_h8kv2")
    context, question = random_tokens(180, seed=25), random_tokens(40, seed=26)
    cpu, gpu = _pair(path, policy, n_batch=64)
    with cpu, gpu:
        for part in (context, question):
            cpu.eval(part)
            gpu.eval(part)
        _check_same_cache(cpu, gpu, policy, exact=False)
    cpu, gpu = _pair(path, policy, n_batch=64, policy_kwargs={"evict_every_chunk": 1})
    with cpu, gpu:
        cpu.eval(context)
        gpu.eval(context)
        _check_same_cache(cpu, gpu, policy, exact=False)


@needs_gpu
def test_chunked_prefill_without_eviction_equals_one_shot(model_path):
    """A prompt that fits the budget is not evicted: chunk sizes change nothing on the GPU."""
    path = model_path("llama_f16_h4kv2_tied")
    prompt = random_tokens(60, seed=27)
    with _open(path, -1, n_batch=8, policy="snapkv", budget=64) as small, \
            _open(path, -1, n_batch=64, policy="snapkv", budget=64) as whole:
        small.eval(prompt)
        whole.eval(prompt)
        assert small.kv_stats()["evicted"] == whole.kv_stats()["evicted"] == 0
        assert _positions(small) == _positions(whole)
        assert _close_enough(small.logits(), whole.logits()) < LOGIT_RTOL


@needs_gpu
def test_state_of_a_policy_context_crosses_to_the_cpu(model_path):
    path = model_path("llama_q4_1_h4kv2_tied")
    cpu, gpu = _pair(path, "streamingllm")
    with cpu, gpu:
        gpu.eval(random_tokens(150, seed=28))
        cpu.load_state(gpu.save_state())
        assert _positions(cpu) == _positions(gpu)
        gpu.eval([5])
        cpu.eval([5])
        assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL
        assert _positions(cpu) == _positions(gpu)


@needs_gpu
@pytest.mark.parametrize("policy", ["snapkv", "adakv", "cake", "lava"])
def test_smollm2_shape_with_a_policy(model_path, policy):
    """SmolLM2-135M's shape, a 300-token prompt kept at 64 entries per list: 30 layers, so
    CAKE's and LAVa's cascades re-select earlier layers many times (compacting them only now
    and then) and Ada-KV ranks 3 heads together."""
    cpu, gpu = _pair(model_path(SMOL_SHAPE), policy, budget=64, n_batch=128)
    with cpu, gpu:
        prompt = random_tokens(300, seed=29)
        cpu.eval(prompt)
        gpu.eval(prompt)
        _check_same_cache(cpu, gpu, policy, exact=False)


@needs_gpu
@pytest.mark.parametrize("layers,warmup_layers", [(-1, 0), (-1, 1), (-1, 3), (1, None)])
def test_take_evicts_without_waiting_for_the_gpu(model_path, layers, warmup_layers):
    """TAKE's GPU layers that decide for no layer below them queue their selection and
    compaction and learn the kept positions at the chunk's end; the key layer waits for its
    own, which the layers below it take. Every layer scored (warmup_layers 0), the key layer
    first or last, or on the CPU with one GPU layer after it: the kept positions are the CPU's
    (near-ties aside), the byte counts, their peak and the evictions equal, the logits within
    tolerance. With layers on the CPU the reference takes the same fast path for them as the
    GPU context does (exact_matmul would move its every layer to the CPU)."""
    path = model_path("llama_q8_0_h8kv2")
    kw = dict(policy="take", n_ctx=512, n_batch=64, budget=40)
    if warmup_layers is not None:
        kw["policy_kwargs"] = {"warmup_layers": warmup_layers}
    with _open(path, exact_matmul=layers == -1, **kw) as cpu, _open(path, layers, **kw) as gpu:
        prompt = random_tokens(330, seed=37)
        cpu.eval(prompt)
        gpu.eval(prompt)
        diff = _check_same_cache(cpu, gpu, "take", exact=False)
        a, b = cpu.kv_stats(), gpu.kv_stats()
        assert (a["bytes"], a["peak_bytes"], a["evicted"]) == (b["bytes"], b["peak_bytes"], b["evicted"])
        if diff == 0:
            assert _close_enough(gpu.logits(), cpu.logits()) < LOGIT_RTOL


@needs_gpu
def test_take_reads_a_prompt_longer_than_the_cache(model_path):
    """TAKE evicts after every chunk, its probe scored on the GPU: a prompt three times n_ctx
    goes through, the device memory stays within the cache, and the kept positions are the
    CPU's (near-ties aside)."""
    path = model_path("llama_q8_0_h8kv2")
    cpu, gpu = _pair(path, "take", n_ctx=200, budget=40, n_batch=64)
    with cpu, gpu:
        prompt = random_tokens(600, seed=30)
        cpu.eval(prompt)
        gpu.eval(prompt)
        _check_same_cache(cpu, gpu, "take", exact=False)
        assert gpu.kv_stats()["peak_bytes"] == cpu.kv_stats()["peak_bytes"]
        with _open(path, -1, n_ctx=640, n_batch=64) as full:
            full.eval(prompt)
            assert gpu.kv_stats()["peak_bytes"] < 0.6 * full.kv_stats()["bytes"]
