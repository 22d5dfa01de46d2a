"""`pykv bench`: llama-bench's rows for every combination of the list flags, as JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pykv", "bench", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_bench_rows_cover_the_product(tiny_model):
    model = str(tiny_model("llama_q8_0_h8kv2"))
    out = bench(model, "-p", "32,64", "-n", "4", "-d", "0,80", "-r", "2", "--policy", "full,snapkv",
                "--budget", "40", "-o", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    names = [(r["policy"], r["test"]) for r in rows]
    for policy in ("full", "snapkv"):
        for test in ("pp32", "pp64", "tg4", "pp32 @ d80", "pp64 @ d80", "tg4 @ d80"):
            assert (policy, test) in names
    assert all(r["t_s"] > 0 and len(r["samples"]) == 2 for r in rows)
    # with depth 80 and budget 40 snapkv holds 40 entries per list + the 4 decoded, in lists
    # that grow by an eighth at a time
    tg = next(r for r in rows if r["policy"] == "snapkv" and r["test"] == "tg4 @ d80")
    per_entry = 2 * 16 * 4 + 4
    assert tg["evicted"] > 0 and tg["kv_MiB"] * 2**20 <= 1.125 * (40 + 4) * 3 * 2 * per_entry
    full = next(r for r in rows if r["policy"] == "full" and r["test"] == "tg4 @ d80")
    assert full["evicted"] == 0 and full["kv_MiB"] > tg["kv_MiB"]


def test_bench_evict_every_chunk_bounds_the_peak(tiny_model):
    """--evict-every-chunk cuts the cache after each 32-token chunk of a 256-token prompt, so
    its peak holds about the budget plus one chunk per list, where the end-of-prompt schedule
    holds the whole prompt first."""
    model = str(tiny_model("llama_q8_0_h8kv2"))
    args = (model, "-p", "256", "-n", "", "-r", "1", "-b", "32", "--policy", "full,snapkv", "--budget", "40",
            "-o", "json", "--no-warmup")
    plain, chunked = bench(*args), bench(*args, "--evict-every-chunk")
    assert plain.returncode == 0 and chunked.returncode == 0, plain.stderr + chunked.stderr
    end = {r["policy"]: r for r in json.loads(plain.stdout)}
    every = {r["policy"]: r for r in json.loads(chunked.stdout)}
    assert set(every) == {"full", "snapkv+chunk"}
    # a list grows by an eighth at a time: (budget + chunk) * 1.125 of 256 rows at most
    assert every["snapkv+chunk"]["kv_peak_MiB"] <= (40 + 32) * 1.125 / 256 * end["full"]["kv_peak_MiB"]
    assert end["snapkv"]["kv_peak_MiB"] >= 0.9 * end["full"]["kv_peak_MiB"]


def test_bench_policy_args_reach_the_policy(tiny_model):
    """--policy-arg passes options to the evicting policies and the rows name them; full, which
    takes none (an option would be its error), runs without them. An option the policy does
    not know is the policy's error, a malformed one a usage error."""
    model = str(tiny_model("llama_q8_0_h8kv2"))
    args = (model, "-p", "128", "-n", "", "-r", "1", "--policy", "full,snapkv", "--budget", "40", "-o", "json",
            "--no-warmup")
    plain, narrow = bench(*args), bench(*args, "--policy-arg", "window=8", "--policy-arg", "kernel=3")
    assert plain.returncode == 0 and narrow.returncode == 0, plain.stderr + narrow.stderr
    rows = {r["policy"]: r for r in json.loads(narrow.stdout)}
    assert set(rows) == {"full", "snapkv[window=8,kernel=3]"}
    assert rows["snapkv[window=8,kernel=3]"]["evicted"] > 0 and rows["full"]["evicted"] == 0
    bad = bench(*args, "--policy-arg", "no_such_option=1")
    assert bad.returncode != 0 and "no_such_option" in bad.stderr
    malformed = bench(*args, "--policy-arg", "window")
    assert malformed.returncode != 0 and "K=V" in malformed.stderr


def test_bench_cache_types(tiny_model):
    """-ctk and -ctv sweep the keys' and the values' cache types like llama-bench's, every
    pair; --cache-type sweeps the two together. An entry's bytes are its key's and its
    value's (f16 2 bytes per element, q8_0 34 per 32) and a 4-byte position; a bad type is a
    usage error before anything runs."""
    model = str(tiny_model("mistral_f16_h4kv1"))   # head size 32: whole Q8_0 blocks
    row_bytes = {"f16": 32 * 2, "q8_0": 34}
    out = bench(model, "-p", "", "-n", "4", "-d", "40", "-r", "1", "-ctk", "f16,q8_0", "-ctv", "f16,q8_0", "-o", "json")
    assert out.returncode == 0, out.stderr
    rows = {(r["type_k"], r["type_v"]): r for r in json.loads(out.stdout)}
    assert set(rows) == {(k, v) for k in row_bytes for v in row_bytes}
    per_entry = {kv: row_bytes[kv[0]] + row_bytes[kv[1]] + 4 for kv in rows}
    for kv, r in rows.items():
        assert r["kv_MiB"] * per_entry[("f16", "f16")] == pytest.approx(rows[("f16", "f16")]["kv_MiB"] * per_entry[kv])
    both = bench(model, "-p", "", "-n", "2", "-r", "1", "--cache-type", "f16,q8_0", "-o", "json")
    assert [(r["type_k"], r["type_v"]) for r in json.loads(both.stdout)] == [("f16", "f16"), ("q8_0", "q8_0")]
    md = bench(model, "-p", "", "-n", "2", "-r", "1", "-ctv", "q8_0")
    assert md.returncode == 0 and "| type_v |" in md.stdout and "| type_k |" not in md.stdout, md.stdout
    assert "| q8_0 |" in md.stdout, md.stdout
    bad = bench(model, "-ctk", "f16,q4_0")
    assert bad.returncode == 1 and "-ctk takes f16, f32 or q8_0" in bad.stderr, bad.stderr


def test_bench_bad_list_is_a_usage_error(tiny_model):
    out = bench(str(tiny_model("llama_q8_0_h8kv2")), "-p", "1,x")
    assert out.returncode == 1 and "pykv: error:" in out.stderr
