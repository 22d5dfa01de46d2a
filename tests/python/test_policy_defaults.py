"""Budgets that make sense without being given: every evicting policy's default budget (a
quarter of the prompt, at least 256 entries per (layer, KV head)), the floor a share budget
is raised to (64 entries, or the policy's window and one more, whichever is larger) with
one warning, a budget given to `full` refused, and `pykv info --policies` showing it all.

The expected entry counts are the rule written out: default = max(256, ceil(N / 4)); a share
s of N tokens = max(floor, ceil(s N)). A policy keeps exactly its budget in every list when
the prompt is longer (TAKE, SnapKV: the same count per head)."""
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

from pykv import Llama
from pykv.errors import InvalidArgumentError

EVICTING = ["streamingllm", "h2o", "snapkv", "pyramidkv", "adakv", "cake", "lava", "ems", "take",
            "knorm", "keydiff", "random", "tova", "lagkv", "chunkkv", "finch", "expected_attention", "criticalkv",
            "criticaladakv", "kvzip"]
DEFAULT_FRAC, DEFAULT_MIN, FLOOR = 0.25, 256, 64


def prompt(n, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def per_head(llm):
    return sorted({n for layer in llm.kv_stats()["entries_per_head"] for n in layer})


def evaluate(path, tokens, **kwargs):
    """The entries per head after one eval() of tokens, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Llama(str(path), n_ctx=2048, n_batch=512, **kwargs) as llm:
            llm.eval(tokens)
            heads = per_head(llm)
    return heads, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("policy", EVICTING)
def test_an_evicting_policy_without_a_budget_keeps_a_short_prompt_whole(tiny_model, policy):
    heads, said = evaluate(tiny_model(), prompt(200), policy=policy)
    assert heads == [200]   # 200 < 256: nothing evicted
    assert said == []


@pytest.mark.parametrize("policy", ["snapkv", "take", "streamingllm"])
def test_the_default_budget_is_a_quarter_of_a_long_prompt(tiny_model, policy):
    n = 1400
    heads, _ = evaluate(tiny_model(), prompt(n), policy=policy)
    assert heads == [max(DEFAULT_MIN, math.ceil(n * DEFAULT_FRAC))]   # 350


def test_generate_with_take_and_no_budget_runs(tiny_model):
    with Llama(str(tiny_model()), n_ctx=512, policy="take") as llm:
        res = llm.generate(prompt(40), max_tokens=4, temperature=0.0)
    assert len(res.tokens) == 4


@pytest.mark.parametrize("policy", ["take", "h2o", "snapkv", "ems"])
def test_a_share_below_the_floor_is_raised_with_one_warning(tiny_model, policy):
    n = 120   # 10% = 12 entries: TAKE and H2O kept 12, the window policies refused
    heads, said = evaluate(tiny_model(), prompt(n), policy=policy, budget="10%")
    assert heads == [FLOOR]
    assert len(said) == 1 and "raised to 64" in said[0] and policy in said[0]


def test_the_floor_warning_is_given_once_per_context(tiny_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Llama(str(tiny_model()), n_ctx=1024, policy="take", budget="5%") as llm:
            for seed in (1, 2, 3):
                llm.reset()
                llm.eval(prompt(100, seed))
                assert per_head(llm) == [FLOOR]
    assert sum("raised to" in str(w.message) for w in caught) == 1


def test_a_share_below_a_wider_window_is_raised_to_the_window_and_one(tiny_model):
    heads, said = evaluate(tiny_model(), prompt(300), policy="snapkv", budget="10%", window=80)
    assert heads == [81]   # 30 entries < window 80 + 1
    assert len(said) == 1 and "raised to 81" in said[0]


def test_a_share_above_the_floor_is_kept(tiny_model):
    heads, said = evaluate(tiny_model(), prompt(1000), policy="take", budget="10%")
    assert heads == [100] and said == []


def test_streamingllm_window_without_budget_still_sets_the_budget(tiny_model):
    heads, _ = evaluate(tiny_model(), prompt(300), policy="streamingllm", sink=4, window=40)
    assert heads == [44]


@pytest.mark.parametrize("budget", [64, "10%", 0.5])
def test_a_budget_with_full_is_an_error(tiny_model, budget):
    with pytest.raises(InvalidArgumentError, match="keeps every entry"):
        Llama(str(tiny_model()), n_ctx=256, policy="full", budget=budget)


def test_evict_every_chunk_with_full_is_an_error(tiny_model):
    with pytest.raises(InvalidArgumentError, match="evict_every_chunk"):
        Llama(str(tiny_model()), n_ctx=256, policy="full", evict_every_chunk=True)


def test_policy_info_gives_every_policy_its_defaults():
    from pykv.policies import list_policies, policy_info
    infos = {i["name"]: i for i in policy_info()}
    assert list(infos) == list_policies()
    assert not infos["full"]["evicts"]
    for name in EVICTING:
        info = infos[name]
        assert info["evicts"]
        assert (info["default_budget_frac"], info["default_budget_min"], info["budget_floor"]) == (0.25, 256, 64)
        assert info["choose"] and info["options"]
    for name in (n for n in EVICTING if n not in ("take", "finch")):
        assert "evict_every_chunk=0" in infos[name]["options"]
    assert infos["take"]["evicts_while_reading"]
    assert [n for n, i in infos.items() if i["evicts_while_reading"]] == ["take", "finch"]
    assert infos["snapkv"]["options"].startswith("window=32, pool=max, kernel=7, gqa=mean")


def test_info_policies_lists_options_defaults_and_when_to_choose():
    out = subprocess.run([sys.executable, "-m", "pykv", "info", "--policies"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for name in ["full"] + EVICTING:
        assert f"\n  {name} " in text
    assert text.count("budget: default 25% of the prompt, at least 256 entries") == len(EVICTING)
    assert text.count("choose: ") == len(EVICTING) + 1
    assert "options: alpha=0.2, probe_len=32" in text


def test_cli_generate_take_without_budget(tiny_model):
    out = subprocess.run([sys.executable, "-m", "pykv", "generate", str(tiny_model()), "--policy", "take",
                          "-p", "hello there", "-n", "4", "--temp", "0", "-c", "256"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_cli_budget_with_full_is_a_usage_error(tiny_model):
    out = subprocess.run([sys.executable, "-m", "pykv", "generate", str(tiny_model()), "--budget", "64",
                          "-p", "hello", "-n", "2", "-c", "256"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "keeps every entry" in out.stderr
