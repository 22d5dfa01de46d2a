"""What an evaluation runs: the grid's axes and the contexts of its runs.

Budgets are shares of what the policy compresses ("10%": of the needle's context, of the KL
prefix, of the perplexity chunk's first half) or entry counts ("256"); a share becomes entries
per run, rounded, so a cell compares runs of the same compression. Policies are names with
their own arguments after a plus ("cake+pool=max+kernel=5"); "all" is every registered policy.
The full cache runs in every grid as the reference.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .. import errors


@dataclass(frozen=True)
class Budget:
    label: str                       # as given: "10%" or "256"
    share: Optional[float] = None    # 0.10
    entries: Optional[int] = None    # 256

    def of(self, n: int) -> int:
        """Entries per (layer, KV head) for n compressible tokens."""
        if self.entries is not None:
            return self.entries
        return max(1, int(round(self.share * n)))


def parse_budgets(text: str) -> List[Budget]:
    out = []
    for item in _items(text, "--budgets"):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)%", item)
        if m:
            share = float(m.group(1)) / 100
            if not 0 < share <= 1:
                raise errors.InvalidArgumentError(f"--budgets: {item!r} is not a share in (0%, 100%]")
            out.append(Budget(f"{m.group(1)}%", share=share))
        elif re.fullmatch(r"\d+", item) and int(item) > 0:
            out.append(Budget(item, entries=int(item)))
        else:
            raise errors.InvalidArgumentError(f"--budgets: {item!r} is neither a share like 10% nor an entry count")
    return out


def parse_lengths(text: str) -> List[int]:
    """'2k,4k,7168' -> [2048, 4096, 7168]."""
    out = []
    for item in _items(text, "--lengths"):
        m = re.fullmatch(r"(\d+)([kK]?)", item)
        if not m or int(m.group(1)) == 0:
            raise errors.InvalidArgumentError(f"--lengths: {item!r} is not a token count like 2048 or 2k")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out


def parse_depths(text: str) -> List[float]:
    out = []
    for item in _items(text, "--depths"):
        try:
            d = float(item.rstrip("%"))
        except ValueError:
            d = math.nan
        if not 0 <= d <= 100:
            raise errors.InvalidArgumentError(f"--depths: {item!r} is not a percentage between 0 and 100")
        out.append(d / 100)
    return out


def parse_settings(text: str) -> List[str]:
    out = _items(text, "--setting")
    for s in out:
        if s not in ("aware", "agnostic"):
            raise errors.InvalidArgumentError(f"--setting: {s!r} is neither aware nor agnostic")
    return out


def parse_policies(text: str) -> List[str]:
    """Policy specs, the full cache left out (it always runs); 'all' = every registered one."""
    from .. import list_policies
    known = list_policies()
    out: List[str] = []
    for item in _items(text, "--policies"):
        specs = [p for p in known if p != "full"] if item == "all" else [item]
        for spec in specs:
            name = spec.split("+", 1)[0]
            if name not in known:
                raise errors.InvalidArgumentError(f"--policies: unknown policy {name!r} (known: {', '.join(known)})")
            if name != "full" and spec not in out:
                out.append(spec)
    return out


def _items(text: str, flag: str) -> List[str]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise errors.InvalidArgumentError(f"{flag}: empty list")
    return items


def split_spec(spec: str) -> tuple:
    """'cake+pool=max' -> ('cake', {'pool': 'max'})."""
    name, *args = spec.split("+")
    kwargs = {}
    for a in args:
        if "=" not in a:
            raise errors.InvalidArgumentError(f"policy {spec!r}: {a!r} is not KEY=VALUE")
        k, v = a.split("=", 1)
        kwargs[k] = v
    return name, kwargs


@dataclass
class EvalConfig:
    """The grid and how each run's context is made."""
    model: str
    out: Optional[Path]
    lengths: List[int]
    budgets: List[Budget]
    policies: List[str]
    samples: int = 20
    seed: int = 0
    settings: List[str] = field(default_factory=lambda: ["aware", "agnostic"])
    depths: List[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    threads: Optional[int] = None
    n_batch: int = 512
    n_gpu_layers: int = 0
    window: Optional[int] = None
    sink: Optional[int] = None
    policy_kwargs: Dict[str, str] = field(default_factory=dict)   # for every policy (--policy-arg)
    evict_every_chunk: bool = False
    exact_matmul: bool = False
    kv_type: Optional[str] = None
    kv_type_v: Optional[str] = None
    answer_tokens: int = 24

    @property
    def model_name(self) -> str:
        return os.path.basename(self.model)

    def run_args(self, spec: str) -> dict:
        """The policy arguments of a run, as recorded."""
        name, own = split_spec(spec)
        args = dict(self.policy_kwargs)
        args.update(own)
        for key in ("window", "sink"):
            if getattr(self, key) is not None:
                args[key] = getattr(self, key)
        if self.evict_every_chunk and name != "full":
            args["evict_every_chunk"] = True
        return args

    def llama(self, spec: str, budget: Optional[int], n_ctx: int):
        """A context for one run of policy spec at budget entries (None: the full cache)."""
        from .. import Llama
        name, own = split_spec(spec)
        kwargs = dict(self.policy_kwargs)
        kwargs.update(own)
        evicting = name != "full"
        extra = {"n_gpu_layers": self.n_gpu_layers} if self.n_gpu_layers else {}
        return Llama(self.model, n_ctx=n_ctx, n_threads=self.threads, n_batch=self.n_batch, policy=name,
                     budget=budget if evicting else None, policy_kwargs=(kwargs or None) if evicting else None,
                     window=self.window if evicting else None, sink=self.sink if evicting else None,
                     evict_every_chunk=self.evict_every_chunk and evicting, exact_matmul=self.exact_matmul,
                     kv_type=self.kv_type, kv_type_v=self.kv_type_v, **extra)

    def tokenizer(self, n_ctx: int):
        from .. import Llama
        return Llama(self.model, n_ctx=n_ctx, vocab_only=True)


def runs_of(cfg: EvalConfig, settings: Sequence[Optional[str]]):
    """(policy spec, budget or None) of every run of a sample and setting: the full cache first."""
    out = [("full", None)]
    for spec in cfg.policies:
        for b in cfg.budgets:
            out.append((spec, b))
    return [(spec, b, s) for spec, b in out for s in settings]
