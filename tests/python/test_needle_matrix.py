"""bench/needle_matrix.py pools needle results the way BENCHMARKS.md's matrix says: runs over
disjoint samples add up, a later run over the same samples replaces the earlier one, files
without sample ids count as samples 0..n-1, kvpress rows keep their own names, a
press that raised shows as an error."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import needle_matrix  # noqa: E402


def write(tmp_path, name, res):
    path = tmp_path / name
    path.write_text(json.dumps(res))
    return path


def test_pooling_and_replacement(tmp_path, capsys):
    old = write(tmp_path, "a.json", {"samples": 3, "accuracy": {"snapkv|10.0|7168|aware": 2 / 3,
                                                                "full|None|7168|aware": 2 / 3}})
    more = write(tmp_path, "b.json", {"samples": 2, "sample_ids": [3, 4],
                                      "accuracy": {"snapkv|10.0|7168|aware": 0.5},
                                      "hits": {"snapkv|10.0|7168|aware": [4]}})
    rerun = write(tmp_path, "c.json", {"samples": 3, "sample_ids": [0, 1, 2],
                                       "accuracy": {"full|None|7168|aware": 1.0},
                                       "hits": {"full|None|7168|aware": [0, 1, 2]}})
    press = write(tmp_path, "d.json", {"kvpress": "0.5.5", "samples": 3,
                                       "accuracy": {"snapkv|10.0|7168|aware": 0.0},
                                       "errors": {"pyramidkv|10.0|7168|aware": "RuntimeError"}})
    measured = write(tmp_path, "e.json", {"kvpress": "0.5.5", "samples": 3,
                                          "accuracy": {"observed_attention|10.0|7168|aware": 1 / 3}})
    raised = write(tmp_path, "f.json", {"kvpress": "0.5.5", "samples": 3, "accuracy": {},
                                        "errors": {"observed_attention|10.0|7168|aware": "RuntimeError"}})
    cells, raised_cells = needle_matrix.cell_runs([old, more, rerun, press, raised, measured])
    assert needle_matrix.hits(cells[("kvpress observed_attention", "10.0", 7168, "aware")]) == "1/3"
    assert needle_matrix.hits(cells[("snapkv", "10.0", 7168, "aware")]) == "3/5"
    assert needle_matrix.hits(cells[("full", "None", 7168, "aware")]) == "3/3"
    assert needle_matrix.hits(cells[("kvpress snapkv", "10.0", 7168, "aware")]) == "0/3"
    needle_matrix.print_matrix(cells, raised_cells)
    out = capsys.readouterr().out
    assert "The full cache: pykv aware 3/3." in out
    assert "| snapkv | 3/5 |" in out and "| kvpress snapkv | 0/3 |" in out
    assert "| kvpress pyramidkv | error |" in out
