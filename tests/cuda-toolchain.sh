#!/usr/bin/env bash
# Prints the path of an nvcc for the CUDA build: the one on this machine (/usr/local/cuda, or
# nvcc on PATH), else CUDA 13.0's compiler from PyPI's wheels, installed once under
# build/cuda-toolchain (the five wheels must come from the same release: mixed versions fail
# in ptxas).
#
#   cmake -S . -B build-cuda -DPYKV_CUDA=ON -DCMAKE_CUDA_COMPILER="$(bash tests/cuda-toolchain.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

for nvcc in "${CUDACXX:-}" /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null || true)"; do
    if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then
        echo "$nvcc"
        exit 0
    fi
done

dir=build/cuda-toolchain
nvcc="$PWD/$dir/nvidia/cu13/bin/nvcc"
if [ ! -x "$nvcc" ]; then
    echo "no nvcc on this machine: installing CUDA 13.0's compiler wheels into $dir" >&2
    "$PYTHON" -m pip install --disable-pip-version-check -q --no-deps --target "$dir" \
        "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" \
        "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" >&2
    # the wheels put the libraries in lib/, where nvcc looks in lib64/, and CMake's
    # FindCUDAToolkit wants the unversioned libcudart.so beside the static one
    ln -sfn lib "$dir/nvidia/cu13/lib64"
    ln -sf libcudart.so.13 "$dir/nvidia/cu13/lib/libcudart.so"
fi
echo "$nvcc"
