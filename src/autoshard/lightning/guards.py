"""Everything ``import autoshard`` changes in Lightning, recorded as it is done, so that it can be listed and undone.

Two kinds of change, and no other (docs/lightning-changes.md is generated from ``installed()``, and
tests/lightning/test_registration.py checks the page against it and that ``uninstall`` restores Lightning exactly):
- ``StrategyRegistry`` entries: autoshard's own names, and Lightning's "deepspeed*" names pointed at autoshard's
  guarded subclass (``register_strategy``);
- two wrapped methods of Lightning's accelerator connector, where a Trainer's run is configured (``install_guards``):
  FSDP1 is refused there, by name or as an object, and so is a precision fsdp2 cannot run. ``FSDPStrategy`` itself
  is left as Lightning wrote it: other libraries construct it (stable-pretraining's tests do, to test their refusal).

A member this Lightning lacks is left alone, never wrapped: ``autoshard.lightning.compat.check_lightning`` warns once
and names what then stays as Lightning has it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from autoshard.backends import fsdp1
from autoshard.errors import IncompatibleBackendError

FSDP1_REFUSAL = (
    "FSDP1 (strategy='fsdp' / FSDPStrategy) is refused by autoshard: {reason}. Backend that works: fsdp2."
    " Fix: use strategy='fsdp2' (or strategy='auto-shard' to let autoshard choose)"
)
_MARK = "_autoshard_guard"


def fsdp1_refusal() -> str:
    return FSDP1_REFUSAL.format(reason=fsdp1.REASON)


class ChangeKind(str, Enum):
    REGISTRY = "registry entry"
    WRAPPED = "wrapped method"


@dataclass(frozen=True)
class Change:
    """One change to Lightning: what (``target``), to what (``now``), why, and how to put back what was there."""

    kind: ChangeKind
    target: str
    now: str
    why: str
    undo: Callable[[], None] = field(compare=False, repr=False)


_INSTALLED: list[Change] = []


def installed() -> tuple[Change, ...]:
    """The changes in force, in the order they were made."""
    return tuple(_INSTALLED)


def _record(change: Change) -> None:
    """Only the first change of a target is kept: its ``undo`` restores what Lightning had, not autoshard's own."""
    if all(c.target != change.target for c in _INSTALLED):
        _INSTALLED.append(change)


def uninstall() -> list[Change]:
    """Undo every recorded change, newest first; returns them. Registry entries and methods are restored by identity."""
    undone = list(reversed(_INSTALLED))
    for change in undone:
        change.undo()
    _INSTALLED.clear()
    return undone


CHANGES_BEGIN = "<!-- BEGIN GENERATED CHANGES: python -m autoshard.lightning docs/lightning-changes.md -->"
CHANGES_END = "<!-- END GENERATED CHANGES -->"


def changes_markdown() -> str:
    """The table of ``installed()`` that docs/lightning-changes.md embeds between its markers."""
    lines = [CHANGES_BEGIN, "| # | What | Kind | Now | Why |", "|---|---|---|---|---|"]
    for i, c in enumerate(_INSTALLED, 1):
        lines.append(f"| {i} | `{c.target}` | {c.kind.value} | `{c.now}` | {c.why} |")
    return "\n".join([*lines, CHANGES_END])


def registry_target(name: str) -> str:
    return f"StrategyRegistry[{name!r}]"


def register_strategy(registry: Any, name: str, strategy: type, description: str, why: str, **init_params: Any) -> None:
    """``registry.register(name, strategy, ..., override=True)``, recorded with the entry it replaces (or none)."""
    previous = dict.get(registry, name)  # the raw entry: registry.get() would instantiate the strategy
    registry.register(name, strategy, description=description, override=True, **init_params)

    def undo() -> None:
        if previous is None:
            dict.pop(registry, name, None)
        else:
            dict.__setitem__(registry, name, previous)

    _record(Change(ChangeKind.REGISTRY, registry_target(name), f"{strategy.__module__}.{strategy.__qualname__}", why, undo))


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], why: str) -> bool:
    """Replace ``owner.name`` by ``make(original)``, once; False (nothing changed) when this Lightning lacks it."""
    if not hasattr(owner, name):
        return False
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return True
    own, raw = name in vars(owner), vars(owner).get(name)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)

    def undo() -> None:
        if own:
            setattr(owner, name, raw)
        else:
            delattr(owner, name)  # it was inherited: inherit it again

    _record(Change(ChangeKind.WRAPPED, f"{owner.__name__}.{name}", f"{__name__} wrapper", why, undo))
    return True


def install_guards(fsdp2_class: type, refuse_precision: Callable[[object, Any], None]) -> None:
    """Idempotent: where a Trainer is configured, refuse FSDP1 (a name or an object) and a precision fsdp2 cannot run.

    ``fsdp2_class`` / ``refuse_precision``: autoshard's fsdp2 strategy and its precision check, passed in by
    ``autoshard.lightning.register`` (this module sits below the strategies).
    """
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    def check_strategy(original: Callable[..., Any]) -> Callable[..., Any]:
        def check(self: Any) -> None:
            # Before Lightning's own check, which refuses FSDP on CPU with its own text.
            flag = getattr(self, "_strategy_flag", None)
            if isinstance(flag, FSDPStrategy) or (isinstance(flag, str) and flag in FSDPStrategy.get_registered_strategies()):
                raise IncompatibleBackendError(fsdp1_refusal())
            original(self)

        return check

    def validate_precision(original: Callable[..., Any]) -> Callable[..., Any]:
        def validate(self: Any) -> None:
            # Lightning checks only strategy *instances* (not names), says "Fabric(...)", and on CPU silently turns
            # 16-mixed into bf16-mixed later: refuse first, for names and instances alike.
            strategy = getattr(self, "strategy", None)
            if isinstance(strategy, fsdp2_class) and hasattr(self, "_precision_flag"):
                refuse_precision(self._precision_flag, strategy)
            original(self)

        return validate

    _wrap(
        _AcceleratorConnector,
        "_check_strategy_and_fallback",
        check_strategy,
        "Trainer(strategy='fsdp'), 'fsdp_cpu_offload' or an FSDPStrategy object is refused with the redirect to fsdp2,"
        " before Lightning's own CPU check replaces it (FSDPStrategy itself stays constructible)",
    )
    _wrap(
        _AcceleratorConnector,
        "_validate_precision_choice",
        validate_precision,
        "precision='16-mixed' under fsdp2 / auto-shard is refused in Trainer terms, for strategy names too (Lightning"
        " checks instances only, says 'Fabric(...)', and on CPU turns 16-mixed into bf16-mixed right after)",
    )


__all__ = [
    "CHANGES_BEGIN",
    "CHANGES_END",
    "Change",
    "ChangeKind",
    "FSDP1_REFUSAL",
    "changes_markdown",
    "fsdp1_refusal",
    "install_guards",
    "installed",
    "register_strategy",
    "registry_target",
    "uninstall",
]
