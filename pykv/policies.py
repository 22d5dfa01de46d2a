"""The KV cache policies as Python sees them: their names and descriptions from the C
registry, and the budget and policy arguments a Llama passes to the C context."""
from __future__ import annotations

from typing import Optional, Tuple

from . import errors
from ._ffi import ffi, lib


def list_policies() -> list:
    """The KV eviction policies, read from the C registry."""
    return [ffi.string(lib.pykv_policy_name(i)).decode() for i in range(lib.pykv_policy_count())]


def describe_policies() -> dict:
    """{name: one-line description} for every policy, in the registry's order."""
    out = {}
    for i in range(lib.pykv_policy_count()):
        desc = lib.pykv_policy_description(i)
        out[ffi.string(lib.pykv_policy_name(i)).decode()] = ffi.string(desc).decode() if desc != ffi.NULL else ""
    return out


def policy_info() -> list:
    """One dict per policy, in the registry's order, from the C registry: name, description,
    options (its policy arguments and their defaults), choose (when to choose it), the
    default budget (default_budget_frac of the prompt, at least default_budget_min entries),
    budget_floor (the least a share budget becomes), evicts, evicts_while_reading (n_ctx then
    bounds the cache, not the prompt), evicts_every_step (decoding keeps the budget) and
    runs_on_gpu (it runs with the layers on a GPU; without, n_gpu_layers leaves them on the CPU)."""
    from ._ffi import check, new_params
    out = []
    for i in range(lib.pykv_policy_count()):
        info = new_params("struct pykv_policy_info")
        check(lib.pykv_policy_get_info(i, info))
        out.append({
            "name": ffi.string(info.name).decode(),
            "description": ffi.string(info.description).decode(),
            "options": ffi.string(info.options).decode(),
            "choose": ffi.string(info.choose).decode(),
            "default_budget_frac": round(float(info.default_budget_frac), 6),
            "default_budget_min": int(info.default_budget_min),
            "budget_floor": int(info.budget_floor),
            "evicts": bool(info.evicts),
            "evicts_while_reading": bool(info.evicts_while_reading),
            "evicts_every_step": bool(info.evicts_every_step),
            "runs_on_gpu": bool(info.runs_on_gpu),
        })
    return out


def default_budget_text(info: dict) -> str:
    """The default budget of a policy's info in words: "25% of the prompt, at least 256 entries"."""
    if not info["evicts"]:
        return "none (keeps everything)"
    return f"{info['default_budget_frac'] * 100:g}% of the prompt, at least {info['default_budget_min']} entries"


def parse_budget(budget):
    """(entries, fraction) for the C params from budget=256 (entries per layer and KV head on
    average) or "3%" / 0.03 (a fraction of the prompt); None: the policy's default."""
    if budget is None:
        return 0, 0.0
    if isinstance(budget, str):
        text = budget.strip()
        try:
            if text.endswith("%"):
                frac = float(text[:-1]) / 100.0
                if not 0.0 < frac <= 1.0:
                    raise ValueError
                return 0, frac
            budget = int(text)
        except ValueError:
            raise errors.InvalidArgumentError(
                f"invalid budget {budget!r}: give a number of entries (256) or a percentage ('3%')") from None
    if isinstance(budget, float) and not budget.is_integer():
        if not 0.0 < budget < 1.0:
            raise errors.InvalidArgumentError(f"invalid budget {budget!r}: a fraction must be in (0, 1)")
        return 0, float(budget)
    if int(budget) <= 0:
        raise errors.InvalidArgumentError(f"invalid budget {budget!r}: it must be positive")
    return int(budget), 0.0


def policy_args(policy_kwargs: Optional[dict]) -> Tuple[str, object]:
    """("k=v,k=v" for the C context, TAKE's probe) from policy_kwargs: the probe is not a C
    argument but a token sequence Llama sets with set_probe. A name or value holding ',' or
    '=' is refused (InvalidArgumentError): the C side would read it as more arguments."""
    kwargs = dict(policy_kwargs or {})
    probe = kwargs.pop("probe", None)
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key:
            raise errors.InvalidArgumentError(f"policy_kwargs names must be non-empty strings, got {key!r}")
        for what, text in (("name", key), ("value", str(value))):
            if "," in text or "=" in text:
                raise errors.InvalidArgumentError(
                    f"policy_kwargs {what} {text!r} (of {key!r}) contains ',' or '=', which separate policy "
                    "arguments: give each argument its own key")
    return ",".join(f"{k}={v}" for k, v in kwargs.items()), probe
