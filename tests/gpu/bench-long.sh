#!/usr/bin/env bash
# The long-context GPU figures of the eviction policies (issue "CUDA II"), on a machine with an
# NVIDIA GPU, after tests/gpu/run.sh (the same carry: .whl, and build-gpu/prebuilt with
# PREBUILT=build-gpu/prebuilt):
#   * Llama-3.1-8B's shape, Q4_0: decode (tg32) at depth 65536, the full cache and each
#     benchmark policy with 1024 entries a list; the policies' t/s against llama.cpp's full
#     cache at that depth (../shared/gpu-anchor.md) and against pykv's own depth-0 decode
#     (run.sh's tg128);
#   * the same shape, a 65536-token prompt (pp65536) with the full cache and with take at
#     1024 (also with a warm-up budget of 8 B): time to first token, the cache's bytes at the
#     end (kv_MiB) and its peak (kv_peak_MiB).
# Each prompt of 65536 tokens is read once per repetition, so the checks are long: REPS
# (default 1) repetitions, DEPTH (default 65536), POLICIES to narrow the list. The rows go
# to $OUT/bench-gpu.jsonl and the log to $OUT/gpu-long.log.
#
#   PREBUILT=build-gpu/prebuilt bash tests/gpu/bench-long.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG_NAME=gpu-long.log
source tests/gpu/setup.sh

MODELS=/tmp/pykv-gpu-models
MODEL=$MODELS/llama8b-shape-q4_0.gguf
REPS=${REPS:-1}
DEPTH=${DEPTH:-65536}
POLICIES=${POLICIES:-full,snapkv,adakv,cake,lava,ems,take}
[ -f "$MODEL" ] || check "random-weight model (llama8b)" 200 "$PYTHON" bench/gpu_models.py "$MODELS" --only llama8b
check "bench llama8b policies tg32 @ d$DEPTH" 580 bash tests/gpu/bench.sh -r "$REPS" "$MODEL" -p 0 -n 32 -d "$DEPTH" \
    --policy "$POLICIES" --budget 1024
check "bench llama8b full, take pp$DEPTH" 580 bash tests/gpu/bench.sh -r "$REPS" "$MODEL" -p "$DEPTH" -n 0 \
    --policy full,take --budget 1024
# TAKE's warm-up layers hold min(prompt, 20 B) entries while the prompt is read (about 17% of
# the full cache here); with 8 B, the lists' room included, the peak should be about 9%
check "bench llama8b take[warmup_budget=8192] pp$DEPTH" 400 bash tests/gpu/bench.sh -r "$REPS" "$MODEL" \
    -p "$DEPTH" -n 0 --policy take --budget 1024 --policy-arg warmup_budget=8192
summary
