#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install pykv with its test extras, build and
# run the C unit tests under AddressSanitizer + UndefinedBehaviorSanitizer, every policy's
# threaded decode under ThreadSanitizer, fetch the SmolLM2 model once, then run pytest.
# Exits nonzero on any failure.
#
#   bash tests/run.sh            # everything
#   PYTHON=python3.12 bash tests/run.sh
#   bash tests/run.sh -k sampler # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
ASAN_BUILD=build/ctest-asan   # not build/ itself: pykv/_ffi.py may load a library from there

echo "==> installing pykv with its test extras"
"$PYTHON" -m pip install --disable-pip-version-check '.[test]'

echo "==> C unit tests (ASan + UBSan)"
if ! command -v cmake >/dev/null 2>&1; then
    "$PYTHON" -m pip install --disable-pip-version-check cmake
fi
cmake -S . -B "$ASAN_BUILD" -DPYKV_BUILD_TESTS=ON -DPYKV_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$ASAN_BUILD" -j "$JOBS"
(cd "$ASAN_BUILD" && UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --output-on-failure -j "$JOBS")

echo "==> the CUDA build: compiles, and runs on the CPU where there is no GPU"
# nvcc from this machine, else CUDA 13.0's compiler wheels (tests/cuda-toolchain.sh), for the
# default architectures (sm_80 to sm_90 and PTX). Without a GPU the kernel tests skip, the host
# twins of the device code run, and the Python checks see layers asked of a GPU run on the CPU
# with one warning.
CUDA_BUILD=build/ctest-cuda
cmake -S . -B "$CUDA_BUILD" -DPYKV_CUDA=ON -DPYKV_BUILD_TESTS=ON -DCMAKE_CUDA_COMPILER="$(bash tests/cuda-toolchain.sh)" \
    >/dev/null
cmake --build "$CUDA_BUILD" -j "$JOBS"
(cd "$CUDA_BUILD" && ctest --output-on-failure -j "$JOBS" -R cuda)
PYKV_LIBRARY="$PWD/$CUDA_BUILD/libpykv.so" "$PYTHON" -m pytest -q -p no:cacheprovider tests/python/test_cuda.py \
    tests/python/test_cuda_policies.py tests/python/test_compat.py tests/python/test_forward_tiny.py

echo "==> damaged models, saved states and grammars through the C API (ASan + UBSan, tiny models)"
# Seeded mutations (tests/c/fuzz_inputs.c): most iterations must end in a clean error, the rest
# run; any sanitizer report fails the step.
seed=0
for variant in llama_q8_0_h8kv2 llama_kquants_h4kv2; do
    header=$("$PYTHON" -c "import sys; sys.path.insert(0, 'tests/python'); import _tiny_models as t, gguf; \
t.write_tiny_gguf(t.variant(sys.argv[1]), sys.argv[2]); print(gguf.GGUFReader(sys.argv[2]).data_offset)" \
        "$variant" "$ASAN_BUILD/$variant.gguf")
    for mode in "model $ASAN_BUILD/$variant.gguf $header 1500" "state $ASAN_BUILD/$variant.gguf 3000" \
                "grammar $ASAN_BUILD/$variant.gguf 3000"; do
        seed=$((seed + 1))
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$ASAN_BUILD/tests/c/fuzz_inputs" $mode $seed
    done
done

echo "==> every policy's threaded decode under ThreadSanitizer (tiny model)"
# The decode step runs each list's policy work on whichever thread finishes the list while
# the other thread attends: decode_threads drives that for every policy on a TSan build.
TSAN_BUILD=build/ctest-tsan
cmake -S . -B "$TSAN_BUILD" -DPYKV_BUILD_TESTS=ON -DPYKV_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$TSAN_BUILD" -j "$JOBS" --target decode_threads test_threadpool
"$PYTHON" -c "import sys; sys.path.insert(0, 'tests/python'); import _tiny_models as t; \
t.write_tiny_gguf(t.variant('llama_q8_0_h8kv2'), sys.argv[1])" "$TSAN_BUILD/tiny.gguf"
TSAN_OPTIONS=halt_on_error=1 "$TSAN_BUILD/tests/c/test_threadpool"
TSAN_OPTIONS=halt_on_error=1 "$TSAN_BUILD/tests/c/decode_threads" "$TSAN_BUILD/tiny.gguf"

echo "==> the native code behind the Python API (forward pass, policies) under ASan + UBSan"
# The sanitized libpykv is loaded into Python with the sanitizer runtimes preloaded; the
# tiny-model suites exercise the loader, forward pass, KV cache and every policy.
SAN_PRELOAD="$(${CC:-cc} -print-file-name=libasan.so):$(${CC:-cc} -print-file-name=libubsan.so)"
LD_PRELOAD="$SAN_PRELOAD" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    PYKV_LIBRARY="$PWD/$ASAN_BUILD/libpykv.so" \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/python/test_bad_input.py tests/python/test_forward_tiny.py \
    tests/python/test_dequant.py tests/python/test_sampler.py $(ls tests/python/test_polic*.py)
# Saved states (damaged buffers), cuts of the cache, per-token outputs, grammars, tool calls,
# Python logits processors handing their arrays to the sampler, and keys and values of
# different types, tiny models only.
LD_PRELOAD="$SAN_PRELOAD" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    PYKV_LIBRARY="$PWD/$ASAN_BUILD/libpykv.so" \
    "$PYTHON" -m pytest -q -p no:cacheprovider -m "not model" tests/python/test_state.py tests/python/test_state_policies.py tests/python/test_prefix_reuse.py tests/python/test_outputs.py tests/python/test_perplexity.py \
    tests/python/test_grammar.py tests/python/test_json_schema.py tests/python/test_tools.py \
    tests/python/test_processors.py tests/python/test_kv_mixed.py
# The adversarial corpus (grammars, schemas, HTTP requests), closing a busy context from another
# thread, damaged loader inputs and prompt caches, prompts longer than n_ctx, the
# llama-cpp-python keywords that reach the C context (RoPE overrides), prompts run chunk by
# chunk through pykv_decode_begin / pykv_decode_step.
LD_PRELOAD="$SAN_PRELOAD" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    PYKV_LIBRARY="$PWD/$ASAN_BUILD/libpykv.so" \
    "$PYTHON" -m pytest -q -p no:cacheprovider -m "not model" tests/python/test_hardening_grammar.py \
    tests/python/test_hardening_server.py tests/python/test_hardening_close.py tests/python/test_hardening_loaders.py \
    tests/python/test_hardening_prompt_cache.py tests/python/test_argument_types.py tests/python/test_long_prompt.py \
    tests/python/test_llama_cpp_keywords.py tests/python/test_decode_steps.py

echo "==> fetching the SmolLM2 model (once; cached afterwards)"
"$PYTHON" -m pykv pull smollm2

echo "==> pytest"
"$PYTHON" -m pytest tests/python -ra "$@"
