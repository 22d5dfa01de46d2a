#!/usr/bin/env bash
# Downloads, here, the wheels of the Python packages tests/gpu/run.sh needs that the lent GPU
# machine's image lacks (cffi, pycparser, gguf; Python 3.12, x86-64) into .whl/, which git
# ignores locally; name .whl in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "cffi==2.0.0" "pycparser==3.0" "gguf==0.19.0"
ls .whl
