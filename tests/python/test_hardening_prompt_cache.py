"""Prompt-cache files (pykv._state, `pykv generate --prompt-cache`) against a hostile folder:
a link planted where the temporary file used to go is neither followed nor overwritten, and a
cache path that is a device (/dev/zero), a FIFO or a folder is refused with a clear error
instead of reading until memory runs out or waiting forever. The reads run in a subprocess
with a memory limit and a timeout, so that a regression fails the test instead of the machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pykv._state import FILE_MAGIC, LlamaState, read_state_file, write_state_file

TIMEOUT = 60
STATE = LlamaState([1, 2, 3], b"\x07" * 100)


@pytest.fixture
def model(tmp_path):
    """Any file stands for the model: the cache only records its size and a hash of its head."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return path


def test_a_link_planted_at_the_old_temporary_name_is_not_followed(tmp_path, model):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cache = tmp_path / "prompt.cache"
    planted = tmp_path / f"prompt.cache.tmp{os.getpid()}"
    planted.symlink_to(victim)
    write_state_file(cache, STATE, model)
    assert victim.read_text() == "precious"
    assert planted.is_symlink() and os.readlink(planted) == str(victim)
    back = read_state_file(cache, model)
    assert back.input_ids == STATE.input_ids and bytes(back.data) == STATE.data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "prompt.cache", planted.name, "victim.txt"]


def test_a_link_at_the_cache_path_is_replaced_not_written_through(tmp_path, model):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cache = tmp_path / "prompt.cache"
    cache.symlink_to(victim)
    write_state_file(cache, STATE, model)
    assert victim.read_text() == "precious"
    assert not cache.is_symlink() and read_state_file(cache, model).input_ids == STATE.input_ids


def test_the_temporary_file_is_private_and_removed_on_failure(tmp_path, model, monkeypatch):
    cache = tmp_path / "prompt.cache"
    write_state_file(cache, STATE, model)
    assert cache.stat().st_mode & 0o077 == 0   # the prompt's tokens: readable by its owner only

    def refuse(*_args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_state_file(tmp_path / "other.cache", STATE, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "prompt.cache"]


def _read_in_subprocess(path, model):
    """read_state_file(path) in a child limited to 1 GiB of memory and TIMEOUT seconds: (exit
    code, the exception's type and message it printed). Under AddressSanitizer (which maps far
    more address space than that) the limit is its allocator's largest allocation instead."""
    env = dict(os.environ)
    asan = "libasan" in env.get("LD_PRELOAD", "")
    if asan:
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), "max_allocation_size_mb=1024",
                                                     "allocator_may_return_null=1"]))
    code = textwrap.dedent(f"""
        import resource, sys
        if not {asan}:
            resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from pykv._state import read_state_file
        try:
            read_state_file({str(path)!r}, {str(model)!r})
        except Exception as exc:
            print(type(exc).__name__, exc)
            sys.exit(3)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path} as a prompt cache did not return within {TIMEOUT} s")
    return proc.returncode, proc.stdout.strip() + proc.stderr.strip()


def test_dev_zero_is_refused_not_read_until_memory_runs_out(model):
    code, out = _read_in_subprocess("/dev/zero", model)
    assert code == 3 and out.startswith("ValueError") and "not a regular file" in out, out


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, model):
    fifo = tmp_path / "prompt.cache"
    os.mkfifo(fifo)
    code, out = _read_in_subprocess(fifo, model)
    assert code == 3 and out.startswith("ValueError") and "not a regular file" in out, out


def test_a_folder_and_a_header_longer_than_the_file_are_refused(tmp_path, model):
    with pytest.raises(ValueError, match="not a regular file"):
        read_state_file(tmp_path, model)
    short = tmp_path / "short.cache"
    short.write_bytes(FILE_MAGIC + (1 << 31).to_bytes(4, "little") + b"{}")
    with pytest.raises(ValueError, match="damaged"):
        read_state_file(short, model)
    deep = tmp_path / "deep.cache"
    header = b"[" * 100_000
    deep.write_bytes(FILE_MAGIC + len(header).to_bytes(4, "little") + header)
    with pytest.raises(ValueError, match="damaged"):
        read_state_file(deep, model)


def test_cli_with_a_fifo_as_its_cache_warns_and_replaces_it(tiny_model, tmp_path):
    """`pykv generate --prompt-cache FIFO`: a warning, the run, and a regular cache file after."""
    fifo = tmp_path / "prompt.cache"
    os.mkfifo(fifo)
    try:
        proc = subprocess.run([sys.executable, "-m", "pykv", "generate", str(tiny_model()), "-p", "the cat",
                               "-n", "2", "-c", "64", "--prompt-cache", str(fifo)],
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail("pykv generate waited on a FIFO given as its prompt cache")
    assert proc.returncode == 0, proc.stderr
    assert "prompt cache" in proc.stderr and "not a regular file" in proc.stderr
    assert fifo.is_file() and fifo.read_bytes().startswith(FILE_MAGIC)
