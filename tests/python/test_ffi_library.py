"""Which libpykv the binding loads (pykv._ffi._find_library): $PYKV_LIBRARY over everything,
then the library installed with the package, then, in a source checkout only, the installed
pykv distribution's library and build/; never another pykv found on sys.path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pykv import _ffi

REPO = Path(__file__).resolve().parents[2]


def _lib(folder):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "libpykv.so"
    path.write_bytes(b"not a library")
    return path


def _checkout(root):
    (root / "native" / "include").mkdir(parents=True)
    (root / "native" / "include" / "pykv.h").write_text("/* header */\n")
    return root


def test_pykv_library_overrides_the_packaged_one(tmp_path):
    packaged = _lib(tmp_path / "pkg" / "lib")
    mine = _lib(tmp_path / "mybuild")
    assert _ffi._find_library(str(mine), [tmp_path / "pkg"], tmp_path) == mine
    assert _ffi._find_library("", [tmp_path / "pkg"], tmp_path) == packaged


def test_pykv_library_that_is_not_a_file_is_refused(tmp_path):
    with pytest.raises(ImportError, match="PYKV_LIBRARY"):
        _ffi._find_library(str(tmp_path / "missing.so"), [tmp_path / "pkg"], tmp_path)


def test_packaged_library_comes_before_a_source_build(tmp_path):
    root = _checkout(tmp_path / "src")
    _lib(root / "build")
    packaged = _lib(tmp_path / "site" / "pykv" / "lib")
    # an editable install: the source folder and the installed one are both the package's
    dirs = [root / "pykv", tmp_path / "site" / "pykv"]
    assert _ffi._find_library("", dirs, root) == packaged


def test_build_folder_only_serves_a_source_checkout(tmp_path):
    root = _checkout(tmp_path / "src")
    built = _lib(root / "build")
    none_installed = tmp_path / "nothing-installed"
    assert _ffi._find_library("", [root / "pykv"], root, none_installed) == built
    other = tmp_path / "unpacked"          # a package that is not a source checkout
    _lib(other / "build")
    with pytest.raises(ImportError, match="not found"):
        _ffi._find_library("", [other / "pykv"], other, none_installed)


def test_a_source_checkout_loads_the_installed_distribution_first(tmp_path):
    """Tests run from the repository after `pip install .`: `import pykv` is the source
    folder, which holds no library; the installed pykv's is loaded, before a build/."""
    root = _checkout(tmp_path / "src")
    _lib(root / "build")
    installed = _lib(tmp_path / "site" / "pykv" / "lib")
    assert _ffi._find_library("", [root / "pykv"], root, installed.parent) == installed


def test_running_from_the_repository_after_install_imports(tmp_path):
    """The suite's own situation: python run in the repository's root, no PYKV_LIBRARY."""
    env = {k: v for k, v in os.environ.items() if k != "PYKV_LIBRARY"}
    out = subprocess.run([sys.executable, "-c", "import pykv, pykv._ffi as f; print(pykv.__file__); print(f.LIBRARY_PATH)"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.splitlines()[1]).is_file()


def test_a_stale_pykv_on_sys_path_is_not_loaded(tmp_path):
    """An older pykv/lib/libpykv.so in a folder on sys.path (an old checkout, a copied
    site-packages) is not what `import pykv` loads: the package's own library is."""
    stale = _lib(tmp_path / "pykv" / "lib")
    env = {k: v for k, v in os.environ.items() if k != "PYKV_LIBRARY"}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "from pykv import _ffi; print(_ffi.LIBRARY_PATH)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = Path(out.stdout.strip())
    assert loaded != stale and loaded.is_file()
    assert loaded.parent.name == "lib" or loaded.parent.name == "build"


def test_pykv_library_is_what_gets_loaded(tmp_path):
    """$PYKV_LIBRARY reaches the real import too (tests/run.sh relies on it)."""
    lib = Path(_ffi.LIBRARY_PATH)
    env = dict(os.environ, PYKV_LIBRARY=str(lib))
    out = subprocess.run([sys.executable, "-c", "from pykv import _ffi; print(_ffi.LIBRARY_PATH)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == lib
