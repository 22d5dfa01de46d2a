#!/usr/bin/env bash
# Builds, on a machine without a GPU, the CUDA library and the kernel tests for Hopper
# (sm_90a: the lent H100 and H200) into build-gpu/prebuilt/ (about 15 MB, git-ignored), so that
# the device's time goes to the checks rather than to nvcc:
#
#   bash tests/gpu/fetch-wheels.sh && bash tests/gpu/prebuild.sh          # here
#   PREBUILT=build-gpu/prebuilt bash tests/gpu/run.sh                     # on the GPU machine,
#                                       # with .whl and build-gpu/prebuilt carried along
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=build-gpu/build-sm90a
OUTDIR=build-gpu/prebuilt
cmake -S . -B "$BUILD" -DPYKV_CUDA=ON -DPYKV_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_CUDA_COMPILER="$(bash tests/cuda-toolchain.sh)" >/dev/null
cmake --build "$BUILD" -j "$(nproc)"
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/tests/c"
cp "$BUILD/libpykv.so" "$OUTDIR/"
cp "$BUILD"/tests/c/test_cuda_* "$OUTDIR/tests/c/"
git rev-parse HEAD > "$OUTDIR/commit"
du -sh "$OUTDIR"
