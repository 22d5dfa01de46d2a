#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with an NVIDIA GPU (the project's lent H100/H200;
# any CUDA machine with Python, numpy, pytest and CMake will do):
#   1. build libpykv with the CUDA backend for this card (or take a build made elsewhere);
#   2. the kernel tests (tests/c/test_cuda_*: every kernel against its CPU twin) under
#      compute-sanitizer's memcheck, BG_JOBS (4) at a time beside test_cuda_policies.py (the
#      eviction policies' kept positions);
#   3. test_cuda.py (tiny random models and a SmolLM2-shaped one, GPU against CPU), alone;
#   4. the GPU benchmark: `pykv bench -ngl 99` on random-weight files of SmolLM2-135M's and
#      Llama-3.1-8B's shapes (bench/gpu_models.py): pp512, pp2048, tg128 and tg32 at depth
#      8192, llama-bench's tests for the same shapes and types; then the policies: decode at depth 32768 with 256
#      entries a list, and pp4096 against full (tests/gpu/bench-long.sh has the long-context figures);
#   5. where the GPU's time goes: PYKV_CUDA_TIMINGS' tables by stage, in the log.
# Prints one line per check ("PASS name" / "FAIL name (why)") and a summary; everything goes
# to $OUT/gpu.log (or build-gpu/gpu.log), the benchmark rows to bench-gpu.jsonl beside it.
#
#   bash tests/gpu/run.sh                 # everything
#   PREBUILT=build-gpu/prebuilt bash tests/gpu/run.sh   # use a CUDA build already made instead
#                  # of building: tests/gpu/prebuild.sh makes one for Hopper on a machine without
#                  # a GPU (any build dir configured with -DPYKV_BUILD_TESTS=ON will do)
#   SKIP_BENCH=1 bash tests/gpu/run.sh    # the tests only
#   SKIP_TESTS=1 bash tests/gpu/run.sh    # the benchmark and the timings only
#   GPU_END=$(( $(date +%s) + 540 )) bash tests/gpu/run.sh   # the summary by then: checks that
#                  # would not fit are cut short or not started (setup.sh), e.g. within a device
#                  # call's limit; bench-long.sh after it in the same call may share the end
#
# Python packages the device image lacks (cffi, pycparser, gguf) travel as wheels in .whl/
# (tests/gpu/fetch-wheels.sh writes them; name .whl in the call's carry).
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG_NAME=gpu.log
source tests/gpu/setup.sh

# the model tests skip without a GPU: here that is a failure
check "pykv sees the GPU" 60 "$PYTHON" -c "import sys, pykv; sys.exit('CUDA = 1' not in pykv.system_info())"
if [ -z "${SKIP_TESTS:-}" ]; then
    # compute-sanitizer refuses some machines' GPUs (seen on gVisor: "Device not supported"): when
    # it fails on the first test program but the program passes alone, the kernel tests run
    # without it, and the summary says so
    SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    MEMCHECK=("$SANITIZER" --tool memcheck --error-exitcode 99)
    # the tests check every CUDA call's status themselves, and test_cuda_device's out-of-memory
    # path fails an allocation on purpose: memcheck reports memory errors, not API errors; and
    # the host-only programs (test_cuda_blocks, test_cuda_kv_rows, ...) never start CUDA
    SANITIZER_HELP=$("$SANITIZER" --help 2>&1)
    [[ $SANITIZER_HELP == *--report-api-errors* ]] && MEMCHECK+=(--report-api-errors no)
    [[ $SANITIZER_HELP == *--require-cuda-init* ]] && MEMCHECK+=(--require-cuda-init no)
    check "test_cuda_device (memcheck)" 240 "${MEMCHECK[@]}" "$BUILD/tests/c/test_cuda_device"
    if [[ ${results[-1]} == FAIL* && ${results[-1]} != *"exit 99"* ]] && timeout 60 "$BUILD/tests/c/test_cuda_device" >/dev/null 2>&1; then
        echo "compute-sanitizer does not run here: the kernel tests run without it"
        unset 'results[-1]'
        failures=$((failures - 1))
        MEMCHECK=()
        check "test_cuda_device (no memcheck: compute-sanitizer does not run here)" 240 "$BUILD/tests/c/test_cuda_device"
    fi
    # The checks that measure the GPU's free memory run alone (test_cuda_device, test_cuda.py's
    # create/close cycles); the others share the GPU, BG_JOBS at a time.
    check_bg "test_cuda_policies.py" 400 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_policies.py
    for t in "$BUILD"/tests/c/test_cuda_*; do
        [ -x "$t" ] && [ "$(basename "$t")" != test_cuda_device ] || continue
        check_bg "$(basename "$t")${MEMCHECK:+ (memcheck)}" 300 ${MEMCHECK[@]+"${MEMCHECK[@]}"} "$t"
    done
    check_wait
    check "test_cuda.py" 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda.py
fi

if [ -z "${SKIP_BENCH:-}" ]; then
    MODELS=/tmp/pykv-gpu-models
    check "random-weight benchmark models" 200 "$PYTHON" bench/gpu_models.py "$MODELS"
    check "bench smollm2 pp512 pp2048 tg128" 200 bash tests/gpu/bench.sh -r 3 "$MODELS/smollm2-shape-q4_1.gguf" -p 512,2048 -n 128
    check "bench smollm2 tg32 @ d8192" 200 bash tests/gpu/bench.sh -r 3 "$MODELS/smollm2-shape-q4_1.gguf" -p 0 -n 32 -d 8192
    check "bench llama8b pp2048 tg128" 300 bash tests/gpu/bench.sh -r 3 "$MODELS/llama8b-shape-q4_0.gguf" -p 2048 -n 128
    check "bench llama8b tg32 @ d8192" 300 bash tests/gpu/bench.sh -r 3 "$MODELS/llama8b-shape-q4_0.gguf" -p 0 -n 32 -d 8192
    POLICIES=full,snapkv,adakv,cake,lava,take
    check "bench smollm2 policies tg32 @ d32768" 300 bash tests/gpu/bench.sh -r 1 "$MODELS/smollm2-shape-q4_1.gguf" -p 0 -n 32 -d 32768 \
        --policy $POLICIES --budget 256
    check "bench smollm2 policies pp4096" 200 bash tests/gpu/bench.sh -r 3 "$MODELS/smollm2-shape-q4_1.gguf" -p 4096 -n 0 \
        --policy $POLICIES,ems --budget 1024
    # where the GPU's time goes: a table by stage per context in the log (PYKV_CUDA_TIMINGS),
    # decode steps by kernel (so without CUDA graphs: not figures for BENCHMARKS.md)
    TIMINGS=(env PYKV_CUDA_TIMINGS=1 PYKV_CUDA_GRAPHS=0 "$PYTHON" -m pykv bench -ngl 99 -r 1)
    for m in smollm2-shape-q4_1 llama8b-shape-q4_0; do
        check "stage timings ${m%%-*} pp2048" 90 "${TIMINGS[@]}" "$MODELS/$m.gguf" -p 2048 -n 0
        check "stage timings ${m%%-*} tg32" 90 "${TIMINGS[@]}" "$MODELS/$m.gguf" -p 0 -n 32
    done
    check "stage timings smollm2 policies pp4096" 120 "${TIMINGS[@]}" "$MODELS/smollm2-shape-q4_1.gguf" -p 4096 -n 0 \
        --policy full,snapkv,cake,take,ems --budget 1024
    # last: EMS's prefill is the slowest by far (its merges), so its long-context figure comes
    # with the time that is left
    check "bench smollm2 ems tg32 @ d32768" 300 bash tests/gpu/bench.sh -r 1 "$MODELS/smollm2-shape-q4_1.gguf" -p 0 -n 32 -d 32768 \
        --policy ems --budget 256
fi
summary
