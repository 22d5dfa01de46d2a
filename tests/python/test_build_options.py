"""CMake options of the native build, configured in a scratch folder (no compile)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not on PATH")
def test_cuda_option_without_kernels_is_a_clear_configure_error(tmp_path):
    if (ROOT / "ggml-cuda" / "CMakeLists.txt").exists():
        pytest.skip("this tree has CUDA kernels")
    r = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"), "-DPYKV_CUDA=ON"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    out = " ".join((r.stdout + r.stderr).split())   # CMake wraps its messages
    assert "PYKV_CUDA=ON: this tree has no CUDA kernels yet" in out
    assert "not an existing directory" not in out
