#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with an NVIDIA GPU (the project's lent H100/H200;
# any CUDA machine with Python, numpy, pytest and CMake will do):
#   1. build libpykv with the CUDA backend for this card (or take a build made elsewhere);
#   2. the kernel tests (tests/c/test_cuda_*: every kernel against its CPU twin) under
#      compute-sanitizer's memcheck;
#   3. the model tests (tests/python/test_cuda.py: tiny random models and a SmolLM2-shaped one,
#      GPU against CPU; test_cuda_policies.py: the eviction policies' kept positions);
#   4. the GPU benchmark: `pykv bench -ngl 99` on random-weight files of SmolLM2-135M's and
#      Llama-3.1-8B's shapes (bench/gpu_models.py): pp512, pp2048, tg128 and tg32 at depth
#      8192, llama-bench's tests for the same shapes and types; then the policies: decode at depth 32768 with 256 entries a list, and pp4096 against full.
# Prints one line per check ("PASS name" / "FAIL name (why)") and a summary; everything goes
# to $OUT/gpu.log (or build-gpu/gpu.log), the benchmark rows to bench-gpu.jsonl beside it.
#
#   bash tests/gpu/run.sh                 # everything
#   PREBUILT=build-gpu/prebuilt bash tests/gpu/run.sh   # use a CUDA build already made instead
#                  # of building: tests/gpu/prebuild.sh makes one for Hopper on a machine without
#                  # a GPU (any build dir configured with -DPYKV_BUILD_TESTS=ON will do)
#   SKIP_BENCH=1 bash tests/gpu/run.sh    # the tests only
#
# Python packages the device image lacks (cffi, pycparser, gguf) travel as wheels in .whl/
# (tests/gpu/fetch-wheels.sh writes them; name .whl in the call's carry).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUTDIR=${OUT:-$ROOT/build-gpu}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu.log
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
failures=0
results=()

check() {   # check NAME TIMEOUT_S COMMAND...: run it, record PASS/FAIL
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "==> $name"
    timeout "$limit" "$@"
    local rc=$?
    local line
    if [ $rc -eq 0 ]; then line="PASS $name ($((SECONDS - t0)) s)"
    elif [ $rc -eq 124 ]; then line="FAIL $name (over its ${limit} s limit)"; failures=$((failures + 1))
    else line="FAIL $name (exit $rc)"; failures=$((failures + 1)); fi
    echo "$line"
    results+=("$line")
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pykv-site .whl/*.whl
    export PYTHONPATH=/tmp/pykv-site:$ROOT
else
    export PYTHONPATH=$ROOT
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

BUILD=${PREBUILT:-build-gpu/build}
if [ -z "${PREBUILT:-}" ]; then
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
    check "build (sm_${arch:-90})" 400 bash -c "cmake -S . -B $BUILD -DPYKV_CUDA=ON -DPYKV_BUILD_TESTS=ON \
        -DCMAKE_CUDA_ARCHITECTURES=${arch:-90} -DCMAKE_CUDA_COMPILER=\$(bash tests/cuda-toolchain.sh) >/dev/null \
        && cmake --build $BUILD -j $JOBS"
fi
export PYKV_LIBRARY=$ROOT/$BUILD/libpykv.so
head=$(git rev-parse HEAD 2>/dev/null || true)
if [ -f "$BUILD/commit" ] && [ -n "$head" ] && [ "$(cat "$BUILD/commit")" != "$head" ]; then
    echo "warning: $BUILD was built from commit $(cat "$BUILD/commit"), not from this checkout's HEAD ($head)"
fi
"$PYTHON" -c "import pykv; print(pykv.system_info())"

for t in "$BUILD"/tests/c/test_cuda_*; do
    [ -x "$t" ] || continue
    check "$(basename "$t") (memcheck)" 240 compute-sanitizer --tool memcheck --error-exitcode 99 "$t"
done
check "test_cuda.py" 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda.py
check "test_cuda_policies.py" 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_policies.py

if [ -z "${SKIP_BENCH:-}" ]; then
    MODELS=/tmp/pykv-gpu-models
    check "random-weight benchmark models" 200 "$PYTHON" bench/gpu_models.py "$MODELS"
    bench() {   # bench NAME ARGS...: pykv bench with the rows kept as JSON lines
        "$PYTHON" -m pykv bench -ngl 99 -r 3 -o jsonl "$@" | tee -a "$OUTDIR/bench-gpu.jsonl"
    }
    check "bench smollm2 pp512 pp2048 tg128" 200 bench "$MODELS/smollm2-shape-q4_1.gguf" -p 512,2048 -n 128
    check "bench smollm2 tg32 @ d8192" 200 bench "$MODELS/smollm2-shape-q4_1.gguf" -p 0 -n 32 -d 8192
    check "bench llama8b pp2048 tg128" 300 bench "$MODELS/llama8b-shape-q4_0.gguf" -p 2048 -n 128
    check "bench llama8b tg32 @ d8192" 300 bench "$MODELS/llama8b-shape-q4_0.gguf" -p 0 -n 32 -d 8192
    POLICIES=full,snapkv,adakv,cake,lava,ems,take
    check "bench smollm2 policies tg32 @ d32768" 300 bench "$MODELS/smollm2-shape-q4_1.gguf" -p 0 -n 32 -d 32768 \
        --policy $POLICIES --budget 256
    check "bench smollm2 policies pp4096" 200 bench "$MODELS/smollm2-shape-q4_1.gguf" -p 4096 -n 0 \
        --policy $POLICIES --budget 1024
    "$PYTHON" - "$OUTDIR/bench-gpu.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"bench {r['model']:>26} {r['test']:>14} {r['policy']:>7} {r['budget'] or '-':>5}: {r['t_s']:10.1f} "
          f"± {r['t_s_sd']:.1f} t/s (median {r['t_s_median']:.1f}), KV {r['kv_MiB']:.1f} MiB, peak {r['kv_peak_MiB']:.1f}")
EOF
fi

echo
echo "==> summary"
printf '%s\n' "${results[@]}"
echo "$failures failed"
exit $((failures > 0))
