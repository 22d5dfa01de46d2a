"""tests/gpu/bench-summary.py, which the GPU scripts end with: its table sets each row beside
llama.cpp's H100 figure for the same shape and test, a policy's prefill against full's time on
the same prompt and its decode at depth against pykv's decode at depth 0."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "bench-summary.py"


def _row(model, test, policy, t_s, budget=None):
    return {"model": model, "test": test, "policy": policy, "budget": budget, "t_s": t_s, "t_s_sd": 1.0,
            "t_s_median": t_s, "kv_MiB": 2.5, "kv_peak_MiB": 4.0}


def test_the_table_compares_with_llama_cpp_and_with_full(tmp_path):
    rows = [_row("llama8b-shape-q4_0.gguf", "tg128", "full", 400.0),
            _row("llama8b-shape-q4_0.gguf", "tg32 @ d65536", "full", 150.0),
            _row("llama8b-shape-q4_0.gguf", "tg32 @ d65536", "take", 360.0, 1024),
            _row("llama8b-shape-q4_0.gguf", "pp65536", "full", 6000.0),
            _row("llama8b-shape-q4_0.gguf", "pp65536", "take", 5000.0, 1024)]
    path = tmp_path / "bench-gpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(SCRIPT), "--markdown", str(path)], capture_output=True, text=True,
                         check=True).stdout
    table = {tuple(c.strip() for c in line.strip("|").split("|")[1:4]): [c.strip() for c in line.strip("|").split("|")]
             for line in out.splitlines() if line.startswith("| llama8b")}
    assert table[("tg128", "full", "-")][5:7] == ["322", f"{400 / 322:.2f}x"]
    assert table[("tg32 @ d65536", "take", "1024")][5:8] == ["137", f"{360 / 137:.2f}x", f"{360 / 400:.2f}x of d0"]
    assert table[("pp65536", "take", "1024")][5:8] == ["-", "-", f"{6000 / 5000:.2f}x time"]
    assert sum(line.startswith("bench ") for line in out.splitlines()) == len(rows)
