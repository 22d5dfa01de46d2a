"""pykv eval: the grids' bookkeeping (records, resume, standard errors, compare, tables,
pictures) on a tiny model, and one real needle cell on SmolLM2."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pykv import Llama
from pykv.cli import main
from pykv.eval import EvalConfig, estimate, evaluate, parse_budgets
from pykv.eval import needle as needle_eval
from pykv.eval.compare import compare
from pykv.eval.kl import mean_kl
from pykv.eval.progress import Progress
from pykv.eval.report import tables
from pykv.eval.samples import make_needle_sample

MODEL = "llama_f16_h4kv2_tied"
NEEDLE_KEYS = {"kind": str, "model": str, "policy": str, "args": dict, "length": int, "n_context": int,
               "n_prompt": int, "setting": str, "sample": int, "seed": int, "depth": float, "passkey": str,
               "hit": bool, "answer": str, "kv_bytes": int, "seconds": float}


def tiny_cfg(path, out, **kw):
    cfg = dict(model=str(path), out=out, lengths=[320], budgets=parse_budgets("50%"),
               policies=["snapkv", "streamingllm"], samples=2, settings=["aware", "agnostic"],
               depths=[0.25, 0.75], threads=1, answer_tokens=3)
    cfg.update(kw)
    return EvalConfig(**cfg)


class StopAfter(Progress):
    """A progress line that interrupts the run after n measured runs, as Ctrl-C would."""

    def __init__(self, n, *a, **kw):
        super().__init__(*a, **kw)
        self.left = n

    def step(self, tokens, cells_done):
        super().step(tokens, cells_done)
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt


def test_estimate_is_the_mean_and_its_standard_error():
    hits = [1, 0, 1, 1, 0, 1, 1, 1]
    c = estimate(hits, binary=True)
    p = np.mean(hits)
    assert c.n == 8 and c.mean == pytest.approx(p)
    assert c.se == pytest.approx(math.sqrt(p * (1 - p) / 8))
    xs = [0.3, 0.1, 0.7, 0.25]
    c = estimate(xs)
    assert c.mean == pytest.approx(np.mean(xs))
    assert c.se == pytest.approx(np.std(xs, ddof=1) / math.sqrt(len(xs)))
    assert math.isnan(estimate([0.5]).se) and estimate([]).n == 0


def test_mean_kl_is_the_definition():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=3)
    q = rng.dirichlet(np.ones(7), size=3)
    want = np.mean([sum(p[i, j] * math.log(p[i, j] / q[i, j]) for j in range(7)) for i in range(3)])
    assert mean_kl(np.log(p), np.log(q)) == pytest.approx(want)
    assert mean_kl(np.log(p), np.log(p)) == 0


def test_needle_samples_fit_hold_the_passkey_and_are_reproducible(tiny_model):
    path = tiny_model(MODEL)
    with Llama(str(path), n_ctx=512, vocab_only=True) as tok:
        a = make_needle_sample(tok, 200, 3, 0.5, seed=0)
        b = make_needle_sample(tok, 200, 3, 0.5, seed=0)
        c = make_needle_sample(tok, 200, 3, 0.5, seed=1)
        text = tok.detokenize(a.context).decode()
    assert (a.context, a.question, a.passkey) == (b.context, b.question, b.passkey)
    assert (c.context, c.passkey) != (a.context, a.passkey)
    assert a.n_prompt <= 200 and a.n_prompt > 150   # the longest haystack that fits
    assert f"The secret passkey is {a.passkey}." in text
    assert a.hit(f"It is {a.passkey}.") and not a.hit("It is 12.")


def test_needle_grid_writes_one_record_per_run(tiny_model, tmp_path):
    cfg = tiny_cfg(tiny_model(MODEL), tmp_path / "run")
    records = evaluate("needle", cfg)
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    assert data["kind"] == "needle" and data["model"] == Path(cfg.model).name
    assert data["records"] == records
    # per sample and setting: the full cache once, then each policy at each budget
    assert len(records) == 2 * 2 * (1 + 2 * 1)
    for r in records:
        for key, kind in NEEDLE_KEYS.items():
            assert isinstance(r[key], kind), (key, r)
        assert r["n_prompt"] <= r["length"] == 320
        assert r["depth"] == [0.25, 0.75][r["sample"] % 2]
        if r["policy"] == "full":
            assert r["budget"] is None and r["budget_entries"] is None
        else:
            assert r["budget"] == "50%" and r["budget_entries"] == round(0.5 * r["n_context"])
    # the compressed caches hold fewer bytes than the full one
    full = max(r["kv_bytes"] for r in records if r["policy"] == "full")
    assert all(r["kv_bytes"] < full for r in records if r["policy"] != "full")
    samples = json.loads((tmp_path / "run" / "samples.json").read_text())
    assert len(samples["needle"]) == 2 and all(isinstance(t, int) for t in samples["needle"][0]["context"])
    summary = (tmp_path / "run" / "summary.md").read_text() if (tmp_path / "run" / "summary.md").exists() else ""
    assert summary == ""   # evaluate() writes records only; write_outputs writes the tables


def test_an_interrupted_grid_resumes_without_redoing_runs(tiny_model, tmp_path, monkeypatch):
    cfg = tiny_cfg(tiny_model(MODEL), tmp_path / "run", policies=["snapkv"])
    total = 2 * 2 * 2
    with pytest.raises(KeyboardInterrupt):
        evaluate("needle", cfg, progress=StopAfter(3, total, 1000, 4))
    before = json.loads((tmp_path / "run" / "results.json").read_text())["records"]
    assert len(before) == 3   # written on the way out
    measured = []
    real_run = needle_eval._run
    monkeypatch.setattr(needle_eval, "_run", lambda *a: measured.append(a[2]) or real_run(*a))
    after = evaluate("needle", cfg)
    assert len(measured) == total - 3 and len(after) == total
    assert after[:3] == before   # the first runs were kept, not redone
    # more samples later: only the new ones run
    measured.clear()
    cfg.samples = 3
    assert len(evaluate("needle", cfg)) == 3 * 2 * 2 and len(measured) == 2 * 2


def test_a_folder_of_another_model_is_not_resumed(tiny_model, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"version": 1, "kind": "needle", "model": "other.gguf",
                                                   "records": []}))
    with pytest.raises(ValueError, match="other.gguf"):
        evaluate("needle", tiny_cfg(tiny_model(MODEL), out))


def test_kl_and_ppl_grids_are_zero_cost_at_a_budget_that_keeps_everything(tiny_model, tmp_path):
    path = tiny_model(MODEL)
    cfg = tiny_cfg(path, tmp_path / "kl", lengths=[96], budgets=parse_budgets("25%,100%"), policies=["h2o"])
    kl = evaluate("kl", cfg, kl_tokens=6)
    assert len(kl) == 2 * 2 and all(r["kind"] == "kl" and r["kl"] > -1e-12 for r in kl)
    assert all(abs(r["kl"]) < 1e-12 for r in kl if r["budget"] == "100%")
    assert all(r["kv_bytes"] == 4 * next(q["kv_bytes"] for q in kl if q["budget"] == "25%")
               for r in kl if r["budget"] == "100%")
    cfg = tiny_cfg(path, tmp_path / "ppl", lengths=[128], budgets=parse_budgets("25%,100%"), policies=["h2o"])
    ppl = evaluate("ppl", cfg)
    full = {r["sample"]: r["nll"] for r in ppl if r["policy"] == "full"}
    assert len(ppl) == 2 * 3
    for r in ppl:
        assert r["ppl"] == pytest.approx(math.exp(r["nll"])) and r["n_scored"] == 63
        if r["budget"] == "100%":
            assert r["nll"] == pytest.approx(full[r["sample"]], abs=1e-9)


def _needle_records(policy, hits, samples=None, budget="10%", seed=0):
    samples = samples if samples is not None else range(len(hits))
    return [{"kind": "needle", "policy": policy, "budget": budget, "length": 2048, "setting": "aware",
             "sample": s, "seed": seed, "hit": bool(h)} for s, h in zip(samples, hits)]


def _results(path, records):
    path.write_text(json.dumps({"version": 1, "kind": "needle", "model": "m.gguf", "records": records}))
    return path


def test_compare_gives_the_difference_and_its_standard_error(tmp_path):
    a = _results(tmp_path / "a.json", _needle_records("snapkv", [1, 1, 0, 0]) + _needle_records("take", [1, 0, 1, 0]))
    b = _results(tmp_path / "b.json", _needle_records("snapkv", [1, 1, 1, 1]) + _needle_records("take", [1, 0, 1, 1]))
    text = compare(a, b)
    rows = {line.split("|")[3].strip(): line for line in text.splitlines() if line.startswith("| needle")}
    # same samples: the standard error of the per-sample differences (paired)
    d = np.array([0, 0, 1, 1])
    se = 100 * np.std(d, ddof=1) / 2
    cols = [c.strip() for c in rows["snapkv"].split("|")]
    assert cols[8] == "+50 pp" and float(cols[9]) == pytest.approx(se, abs=0.05) and cols[10] == "yes"
    cols = [c.strip() for c in rows["take"].split("|")]   # d = [0, 0, 0, 1]: 25 pp, se 25 pp: not beyond
    assert cols[8] == "+25 pp" and float(cols[9]) == pytest.approx(25.0) and cols[10] == "no"
    assert "2 cells in both, 1 differ by more than their standard error" in text
    # other samples: unpaired, sqrt(se_a^2 + se_b^2)
    c = _results(tmp_path / "c.json", _needle_records("snapkv", [1, 1, 1, 0], samples=[10, 11, 12, 13]))
    cols = [col.strip() for col in compare(a, c).splitlines()[5].split("|")]
    want = 100 * math.sqrt(0.5 * 0.5 / 4 + 0.75 * 0.25 / 4)
    assert cols[8] == "+25 pp" and float(cols[9]) == pytest.approx(want, abs=0.05)
    assert "0 only in A" not in compare(a, c)   # take is only in A


def test_tables_show_each_cell_with_its_standard_error():
    text = tables(_needle_records("full", [1, 1, 1, 1], budget=None) + _needle_records("snapkv", [1, 1, 0, 0]))
    assert "| policy | 2048 @ 10% |" in text
    assert "| full | 100% ± 0 |" in text and "| snapkv | 50% ± 25 |" in text
    assert "4 samples per cell" in text


def test_cli_eval_needle_tables_pictures_and_resume(tiny_model, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cli"
    argv = ["eval", "needle", str(tiny_model(MODEL)), "--lengths", "320", "--budgets", "50%", "--policies",
            "snapkv", "--samples", "2", "--depths", "20,80", "-t", "1", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "| policy | 320 @ 50% |" in captured.out and "| snapkv |" in captured.out
    assert "8/8 runs" in captured.err
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["needle-budgets.png", "needle-full.png", "needle-snapkv.png"]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000
    assert (out / "summary.md").read_text().startswith("### Needle retrieval")
    assert main(argv) == 0   # everything done: nothing runs again
    assert "8/8 runs" in capsys.readouterr().err


def test_cli_eval_without_matplotlib_writes_tables_and_says_how_to_get_pictures(tiny_model, tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails as if not installed
    out = tmp_path / "cli"
    assert main(["eval", "ppl", str(tiny_model(MODEL)), "--lengths", "64", "--budgets", "50%", "--policies",
                 "h2o", "--samples", "1", "-t", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "| h2o |" in captured.out and "pip install 'pykv[plot]'" in captured.err
    assert not list(out.glob("*.png")) and (out / "results.json").exists()


@pytest.mark.parametrize("flags,message", [
    (["--budgets", "0%"], "--budgets"), (["--policies", "nosuch"], "unknown policy"),
    (["--lengths", "2q"], "--lengths"), (["--setting", "both"], "--setting"), (["--samples", "0"], "--samples"),
])
def test_cli_eval_bad_arguments_are_usage_errors(tiny_model, tmp_path, capsys, flags, message):
    argv = ["eval", "needle", str(tiny_model(MODEL)), "--out", str(tmp_path / "x")] + flags
    assert main(argv) == 1
    assert message in capsys.readouterr().err


@pytest.mark.model
def test_smollm2_needle_cell(smollm2_path, tmp_path):
    """The fast real check (1K tokens, seed 0, 3 samples, question in the prompt): the full
    cache finds every passkey; take keeping 25% of the context finds at least 2 of the 3 and
    locates the needle in all 3 (its answers start the passkey: when it misses, the later
    digits were evicted, not the needle lost)."""
    cfg = EvalConfig(model=str(smollm2_path), out=tmp_path, lengths=[1024], budgets=parse_budgets("25%"),
                     policies=["take"], samples=3, settings=["aware"], threads=2)
    records = evaluate("needle", cfg)
    hits = {p: sum(r["hit"] for r in records if r["policy"] == p) for p in ("full", "take")}
    answers = [(r["passkey"], r["answer"]) for r in records if r["policy"] == "take"]
    assert hits["full"] == 3 and hits["take"] >= 2, answers
    assert all(key[:2] in "".join(c for c in text if c.isdigit()) for key, text in answers), answers


@pytest.mark.model
def test_smollm2_kl_cell_is_the_kl_of_the_teacher_forced_distributions(smollm2_path, tmp_path):
    """One KL run against the same measurement written out here with the Llama API and NumPy:
    the prefix compressed by h2o at 25%, then 8 tokens fed one at a time."""
    cfg = EvalConfig(model=str(smollm2_path), out=tmp_path, lengths=[256], budgets=parse_budgets("25%"),
                     policies=["h2o"], samples=1, threads=2)
    (record,) = evaluate("kl", cfg, kl_tokens=8)
    tokens = json.loads((tmp_path / "samples.json").read_text())["text"][0]["tokens"]
    assert len(tokens) == 264

    def log_probs(policy, budget):
        with Llama(str(smollm2_path), n_ctx=300, n_threads=2, policy=policy, budget=budget) as llm:
            llm.eval(tokens[:256])
            rows = []
            for t in tokens[256:]:
                z = llm.logits().astype(np.float64)
                rows.append(z - z.max() - np.log(np.exp(z - z.max()).sum()))
                llm.eval([t])
            return np.array(rows)

    p, q = log_probs("full", None), log_probs("h2o", 64)
    want = np.mean(np.sum(np.exp(p) * (p - q), axis=1))
    assert record["budget_entries"] == 64 and want > 1e-4
    assert record["kl"] == pytest.approx(want, rel=1e-9)
