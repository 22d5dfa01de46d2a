"""pykv imported from a source checkout: the converter is the repository's top-level convert/,
which the wheel ships as pykv/convert (pyproject.toml's wheel.packages). This finder gives
`pykv.convert` that folder, so `pykv convert` and `from pykv import convert` work the same
from a checkout as from an installed package; it is registered only where pykv/ has no
convert/ of its own and the repository's is beside it."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_REPO_CONVERT = _PACKAGE.parent / "convert"


class _ConverterFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "pykv.convert":
            return None
        return importlib.util.spec_from_file_location(
            name, _REPO_CONVERT / "__init__.py", submodule_search_locations=[str(_REPO_CONVERT)])


def install_converter_finder() -> None:
    if (_PACKAGE / "convert").is_dir() or not (_REPO_CONVERT / "__init__.py").is_file():
        return
    if not any(isinstance(f, _ConverterFinder) for f in sys.meta_path):
        sys.meta_path.append(_ConverterFinder())
