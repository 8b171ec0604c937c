"""The backends autoshard knows, each in its own module: everything that differs between engines, so code outside
``backends/`` and ``adapters/`` asks the Backend and never compares backend names. Adapters and strategies are dotted
paths, loaded on use, so ``import autoshard.backends`` stays free of torch and Lightning.
"""

from __future__ import annotations

from autoshard.backends.base import Availability, Backend, BudgetChoices, load, require, require_all
from autoshard.errors import IntentError, closest, did_you_mean
from autoshard.precision import PrecisionPlan


def _load() -> dict[str, Backend]:
    from autoshard.backends import deepspeed, fsdp1, fsdp2  # the engines import backends.base, never this registry

    return {b.name: b for b in (fsdp2.BACKEND, deepspeed.BACKEND, fsdp1.BACKEND)}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


BACKENDS: dict[str, Backend] = _load()
# Users type Lightning strategy strings as often as backend names; both lead to the same backend.
ALIASES: dict[str, str] = {
    "deepspeed": "deepspeed_zero3",
    "zero3": "deepspeed_zero3",
    "deepspeed_stage_3": "deepspeed_zero3",
    "fsdp": "fsdp1",
    **{_key(b.strategy): b.name for b in BACKENDS.values()},
}


def get_backend(name: str) -> Backend:
    """The backend for a name, an alias or a strategy string; unknown names list the valid ones."""
    key = _key(name) if isinstance(name, str) else ""
    key = ALIASES.get(key, key)
    if key not in BACKENDS:
        choices = ["auto", *(n for n, b in BACKENDS.items() if not b.rejected)]
        raise IntentError(
            f"unknown backend {name!r}{did_you_mean(name, choices)}: choose one of {', '.join(map(repr, choices))}."
            f" Fix: {closest(name, choices) or 'auto'!r}"
        )
    return BACKENDS[key]


def on_backend(plan: PrecisionPlan, backend: str) -> PrecisionPlan:
    """What ``backend`` actually runs for ``plan``: each Backend's ``precision`` rule (FSDP2 runs it as is; ZeRO-3
    has no autocast and keeps an fp32 master copy: ``backends/deepspeed.precision``)."""
    rules = BACKENDS[backend].precision if backend in BACKENDS else None
    if rules is None:
        raise ValueError(f"no precision rules for backend {backend!r}")
    return rules(plan)


__all__ = ["ALIASES", "BACKENDS", "Availability", "Backend", "BudgetChoices", "get_backend", "load", "on_backend", "require", "require_all"]
