"""The one record of what ``import autoshard`` changes in Lightning: the Trainer's strategy registry, its accelerator
connector, and Fabric's own strategy registry, each change kept as it is made, so it can be listed and undone.

It imports nothing (not even Lightning), so the Trainer side and the Fabric side (registered without
``lightning.pytorch``) both write here. docs/lightning-changes.md is generated from it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ChangeKind(str, Enum):
    """What was changed; the order here is the order of the generated table."""

    REGISTRY = "registry entry"  # lightning.pytorch.strategies.StrategyRegistry
    WRAPPED = "wrapped method"  # a method of Lightning's accelerator connector, or Trainer._run
    FABRIC_REGISTRY = "Fabric registry entry"  # lightning.fabric.strategies.STRATEGY_REGISTRY


TRAINER_KINDS = frozenset({ChangeKind.REGISTRY, ChangeKind.WRAPPED})
FABRIC_KINDS = frozenset({ChangeKind.FABRIC_REGISTRY})


@dataclass(frozen=True)
class Change:
    """One change to Lightning: what (``target``), to what (``now``), why, and how to put back what was there."""

    kind: ChangeKind
    target: str
    now: str
    why: str
    undo: Callable[[], None] = field(compare=False, repr=False)


_INSTALLED: list[Change] = []


def installed(kinds: Collection[ChangeKind] | None = None) -> tuple[Change, ...]:
    """The changes in force (of ``kinds`` only, if given), in the order they were made."""
    return tuple(c for c in _INSTALLED if kinds is None or c.kind in kinds)


def record(change: Change) -> None:
    """Only the first change of a target is kept: its ``undo`` restores what Lightning had, not autoshard's own."""
    if all(c.target != change.target for c in _INSTALLED):
        _INSTALLED.append(change)


def uninstall(kinds: Collection[ChangeKind] | None = None) -> list[Change]:
    """Undo every recorded change (of ``kinds`` only, if given), newest first; returns them. Registry entries and
    methods are restored by identity."""
    undone = [c for c in reversed(_INSTALLED) if kinds is None or c.kind in kinds]
    for change in undone:
        change.undo()
        _INSTALLED.remove(change)
    return undone


CHANGES_BEGIN = "<!-- BEGIN GENERATED CHANGES: python -m autoshard.lightning docs/lightning-changes.md -->"
CHANGES_END = "<!-- END GENERATED CHANGES -->"


def changes_markdown() -> str:
    """The table docs/lightning-changes.md embeds, grouped by kind, so it does not depend on import order."""
    order = list(ChangeKind)
    lines = [CHANGES_BEGIN, "| # | What | Kind | Now | Why |", "|---|---|---|---|---|"]
    for i, c in enumerate(sorted(_INSTALLED, key=lambda c: order.index(c.kind)), 1):
        lines.append(f"| {i} | `{c.target}` | {c.kind.value} | `{c.now}` | {c.why} |")
    return "\n".join([*lines, CHANGES_END])


def registry_target(name: str) -> str:
    """The Trainer registry's entry ``name``, as the record and the page name it."""
    return f"StrategyRegistry[{name!r}]"


def fabric_registry_target(name: str) -> str:
    """Fabric's registry entry ``name``, as the record and the page name it."""
    return f"lightning.fabric STRATEGY_REGISTRY[{name!r}]"


def register_strategy(
    registry: Any,
    name: str,
    strategy: Callable[..., Any],
    description: str,
    why: str,
    kind: ChangeKind = ChangeKind.REGISTRY,
    **init_params: Any,
) -> Any:
    """``registry.register(name, strategy, ..., override=True)``, recorded with the entry it replaces (returned; None:
    the name was free). ``strategy``: a class, or a factory that returns one."""
    previous = dict.get(registry, name)  # the raw entry: registry.get() would instantiate the strategy
    registry.register(name, strategy, description=description, override=True, **init_params)

    def undo() -> None:
        if previous is None:
            dict.pop(registry, name, None)
        else:
            dict.__setitem__(registry, name, previous)

    target = fabric_registry_target(name) if kind is ChangeKind.FABRIC_REGISTRY else registry_target(name)
    record(Change(kind, target, f"{strategy.__module__}.{strategy.__qualname__}", why, undo))
    return previous
