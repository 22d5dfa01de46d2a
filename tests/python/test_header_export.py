"""pykv.h's PYKV_API: the library's own build (PYKV_BUILD) exports the API on Windows and a
program using the header imports it; with GCC and Clang the API has default visibility,
whether or not the includer defines PYKV_BUILD. Checked with the C preprocessor."""
import shutil
import subprocess
from pathlib import Path

import pytest

HEADER_DIR = Path(__file__).resolve().parents[2] / "native" / "include"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to preprocess pykv.h")


def expand(*defines):
    """What PYKV_API expands to, with the given -D and -U flags."""
    source = '#include "pykv.h"\nPYKV_API_IS: PYKV_API\n'
    out = subprocess.run([CC, "-E", "-P", *defines, "-I", str(HEADER_DIR), "-x", "c", "-"], input=source,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("PYKV_API_IS:"))
    return line.split(":", 1)[1].strip()


WINDOWS = ("-D_WIN32", "-U__GNUC__")


def test_windows_users_import_the_api():
    assert expand(*WINDOWS) == "__declspec(dllimport)"


def test_windows_library_build_exports_the_api():
    assert expand(*WINDOWS, "-DPYKV_BUILD") == "__declspec(dllexport)"


def test_windows_static_link_needs_neither():
    assert expand(*WINDOWS, "-DPYKV_STATIC") == ""


@pytest.mark.parametrize("build", [(), ("-DPYKV_BUILD",)])
def test_gcc_and_clang_give_default_visibility(build):
    assert expand(*build).replace(" ", "") == '__attribute__((visibility("default")))'
