"""A memory-mapped model file cut short while in use.

With use_mmap (the default) the weights are read straight from the mapped file. If the file
is truncated in place afterwards (a download or copy that rewrites it, `truncate`), reading
a page past its new end raises SIGBUS and kills the process, as it does in llama.cpp. So the
file is checked before each evaluation: the same file (device and inode) at its path, now
smaller than when it was loaded, is refused with ModelLoadError instead. A file replaced by
another (renamed over, deleted) is harmless: the mapping keeps the old one. The check cannot
see a truncation that happens while an evaluation runs; that still ends in SIGBUS.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

from . import errors

Identity = Tuple[str, int, int, int]   # (absolute path, st_dev, st_ino, st_size)


def identity(path) -> Optional[Identity]:
    """What check() compares against, taken right after the model is loaded."""
    try:
        path = os.path.abspath(path)
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_dev, st.st_ino, st.st_size


def check(loaded: Optional[Identity]) -> None:
    """ModelLoadError when the file loaded as `loaded` has been cut short since."""
    if loaded is None:
        return
    path, dev, ino, size = loaded
    try:
        st = os.stat(path)
    except OSError:
        return   # removed or renamed: the mapping still holds the file
    if (st.st_dev, st.st_ino) == (dev, ino) and st.st_size < size:
        raise errors.ModelLoadError(
            f"the model file '{path}' was truncated while in use ({st.st_size} of its {size} bytes are left): "
            "reading its weights would crash the process (SIGBUS); load the model again")
