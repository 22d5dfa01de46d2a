"""The cffi ABI-mode binding: declarations from the marked region of the installed pykv.h,
functions from the installed libpykv.so (which one: _find_library). The token loop runs in
Python over the C API (docs/architecture.md)."""
import os
import re
import sys
from pathlib import Path

from cffi import FFI

from . import errors

_LIB_NAMES = ("libpykv.so", "libpykv.dylib", "pykv.dll")
_PACKAGE_DIR = Path(__file__).resolve().parent


def _package_dirs():
    """This package's own folders: one for an ordinary install; for an editable install,
    the source folder and the folder that holds the built library and header."""
    package = sys.modules.get(__package__)
    return [Path(p) for p in getattr(package, "__path__", [_PACKAGE_DIR])]


def _installed_lib_dir():
    """The lib/ folder of the pykv distribution pip installed (None: none is installed)."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution
    except ImportError:   # pragma: no cover - Python < 3.8
        return None
    try:
        return Path(distribution("pykv").locate_file("pykv/lib"))
    except (PackageNotFoundError, TypeError, ValueError):
        return None


def _find_library(env=None, package_dirs=None, source_root=None, installed_dir=None):
    """The library to load: $PYKV_LIBRARY when set (it overrides everything, so a test run
    can point at its own build), else the one installed with this package (its lib/
    folder). Imported from a source checkout (tests run from the repository after
    `pip install .`), then the library of the installed pykv distribution, else the CMake
    build in build/. No other folder on sys.path is searched: an older copy of pykv there
    must not be loaded in place of this one (and the ABI check below refuses a library
    that does not match the header)."""
    env = os.environ.get("PYKV_LIBRARY") if env is None else env
    if env:
        path = Path(env)
        if not path.is_file():
            raise ImportError(f"pykv: PYKV_LIBRARY={env} is not a file")
        return path
    package_dirs = _package_dirs() if package_dirs is None else package_dirs
    source_root = _PACKAGE_DIR.parent if source_root is None else Path(source_root)
    directories = [Path(d) / "lib" for d in package_dirs]
    if (source_root / "native" / "include" / "pykv.h").is_file():   # a source checkout
        installed_dir = _installed_lib_dir() if installed_dir is None else installed_dir
        directories += [installed_dir, source_root / "build"] if installed_dir else [source_root / "build"]
    for directory in directories:
        for name in _LIB_NAMES:
            if (directory / name).is_file():
                return directory / name
    raise ImportError(
        "pykv: the native library libpykv was not found; install the package with "
        "`pip install .` (it builds libpykv with CMake) or set PYKV_LIBRARY")


def _find_header(library):
    env = os.environ.get("PYKV_HEADER")
    for path in (Path(env) if env else None,
                 library.parent.parent / "include" / "pykv.h",
                 _PACKAGE_DIR / "include" / "pykv.h",
                 _PACKAGE_DIR.parent / "native" / "include" / "pykv.h"):
        if path is not None and path.is_file():
            return path
    raise ImportError(f"pykv: pykv.h was not found next to {library}")


def _cdef_source(header_text):
    match = re.search(r"/\* --- cffi begin --- \*/(.*)/\* --- cffi end --- \*/", header_text, re.S)
    if not match:
        raise ImportError("pykv: pykv.h has no cffi region")
    return match.group(1).replace("PYKV_API ", "")


LIBRARY_PATH = _find_library()
HEADER_PATH = _find_header(LIBRARY_PATH)

ffi = FFI()
ffi.cdef(_cdef_source(HEADER_PATH.read_text()))
lib = ffi.dlopen(str(LIBRARY_PATH))

if lib.pykv_abi_version() != lib.PYKV_ABI_VERSION:
    raise ImportError(f"pykv: {LIBRARY_PATH} has ABI {lib.pykv_abi_version()}, "
                      f"{HEADER_PATH} declares {lib.PYKV_ABI_VERSION}")

_STATUS_ERRORS = {
    lib.PYKV_ERR_INVALID_ARG: errors.InvalidArgumentError,
    lib.PYKV_ERR_IO: errors.ModelLoadError,
    lib.PYKV_ERR_FORMAT: errors.ModelLoadError,
    lib.PYKV_ERR_UNSUPPORTED: errors.ModelLoadError,
    lib.PYKV_ERR_NOMEM: errors.BackendError,
    lib.PYKV_ERR_CONTEXT_FULL: errors.ContextOverflowError,
    lib.PYKV_ERR_CANCELLED: errors.GenerationCancelled,
    lib.PYKV_ERR_INTERNAL: errors.BackendError,
}


def last_error():
    return ffi.string(lib.pykv_last_error()).decode("utf-8", "replace")


def check(status, what=None):
    """Raise the exception for a failed pykv_status, with the C library's message."""
    if status == lib.PYKV_OK:
        return
    message = last_error() or f"pykv error {status}"
    if what:
        message = f"{what}: {message}"
    raise _STATUS_ERRORS.get(status, errors.BackendError)(message, status)


def new_params(ctype, default_fn=None):
    """A params struct with struct_size set, filled by its *_default_params function."""
    params = ffi.new(ctype + " *")
    params.struct_size = ffi.sizeof(ctype)
    if default_fn is not None:
        default_fn(params)
    return params


def call_string(fn, *args, initial=256):
    """Call a (..., buf, cap, *n_out) function, growing the buffer when it says so."""
    cap = initial
    n_out = ffi.new("int32_t *")
    while True:
        buf = ffi.new("char[]", cap)
        status = fn(*args, buf, cap, n_out)
        if status == lib.PYKV_ERR_BUFFER_TOO_SMALL and n_out[0] > cap:
            cap = n_out[0]
            continue
        check(status)
        return ffi.unpack(buf, n_out[0])
