"""Lightning Fabric: ``Fabric(strategy="auto-shard" | "fsdp2" | "autoshard-deepspeed")``, with the Trainer's guarantees.

Fabric keeps its own registry, ``STRATEGY_REGISTRY``; ``import autoshard`` registers there the moment
``lightning.fabric`` is loaded. Each entry is a factory that imports its strategy only when ``Fabric()`` builds it,
so ``from lightning.fabric import Fabric`` stays as fast as without autoshard. Every entry goes into the one record of
changes (``autoshard.install_record``), undone by ``uninstall``.
"""

from __future__ import annotations

import importlib
from typing import Any

from autoshard.install_record import FABRIC_KINDS, Change, ChangeKind, register_strategy
from autoshard.install_record import installed as recorded
from autoshard.install_record import uninstall as uninstall_changes

# name -> (module.attribute of what it builds: a strategy class, or auto-shard's factory; the registry's description;
# why, for the record of changes)
STRATEGIES: dict[str, tuple[str, str, str]] = {
    "fsdp2": (
        "autoshard.fabric.strategies.FSDP2Strategy",
        "autoshard: FSDP2 (fully_shard) for any nn.Module, optimizers remapped",
        "Fabric(strategy='fsdp2'). Another library's 'fsdp2' is replaced (said once, on rank 0) and restored by uninstall",
    ),
    "auto-shard": (
        "autoshard.fabric.factory.auto_shard",
        "autoshard: the sharding backend your models can run on",
        "Fabric(strategy='auto-shard'): a factory building the fsdp2 strategy, or autoshard-deepspeed's when the intent needs DeepSpeed",
    ),
    "autoshard-deepspeed": (
        "autoshard.fabric.deepspeed.AutoShardDeepSpeedStrategy",
        "autoshard: DeepSpeed ZeRO-3 from a ShardingIntent",
        "Fabric(strategy='autoshard-deepspeed'): ZeRO-3 from a ShardingIntent",
    ),
}
_LAZY = {
    "FSDP2Strategy": "autoshard.fabric.strategies",
    "AutoShardStrategy": "autoshard.fabric.strategies",
    "AutoShardDeepSpeedStrategy": "autoshard.fabric.deepspeed",
    "auto_shard": "autoshard.fabric.factory",
    "fabric_target": "autoshard.fabric.explain",
}


def _factory(name: str) -> Any:
    """What the registry calls for ``name``: imports what it builds on first use (a strategy class, or auto-shard's
    factory) and calls it; named after it, so the record of changes names it too."""
    path = STRATEGIES[name][0]

    def build(**kwargs: Any) -> Any:
        module, _, attribute = path.rpartition(".")
        return getattr(importlib.import_module(module), attribute)(**kwargs)

    build.__name__ = build.__qualname__ = path.rpartition(".")[2]
    build.__module__ = path.rpartition(".")[0]
    build.__doc__ = f"Fabric(strategy={name!r}): builds {path}"
    return build


def replaced_message(name: str, replaced: Any) -> str:
    """Said once, on rank 0, when another library had registered ``name`` in Fabric's registry."""
    short = getattr(replaced, "__qualname__", type(replaced).__qualname__)
    theirs = f"{getattr(replaced, '__module__', None) or type(replaced).__module__}.{short}"
    ours = STRATEGIES[name][0]
    return (
        f"autoshard: Fabric(strategy='{name}') was registered by {theirs}; import autoshard replaced it with {ours}."
        f" To use the other one, pass it as an object: Fabric(strategy={short}(...))"
    )


def register() -> None:
    """Register "fsdp2", "auto-shard" and "autoshard-deepspeed" in Fabric's registry; idempotent, and again after
    ``uninstall()``. Must run before ``Fabric()`` is built (``import autoshard`` sees to it)."""
    if installed():  # the record says it is done (autoshard.uninstall() empties it)
        return
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    for name, (_, description, why) in STRATEGIES.items():
        previous = register_strategy(STRATEGY_REGISTRY, name, _factory(name), description, why, ChangeKind.FABRIC_REGISTRY)
        theirs = previous.get("strategy") if isinstance(previous, dict) else None
        if callable(theirs):
            rank_zero_info(replaced_message(name, theirs))


def installed() -> tuple[Change, ...]:
    """The entries of Fabric's registry autoshard set, in the order it set them (the Trainer's changes are in the same
    record: ``autoshard.install_record.installed()``)."""
    return recorded(FABRIC_KINDS)


def uninstall() -> list[Change]:
    """Put back every entry of Fabric's registry as it was before ``register`` (by identity); returns them, newest
    first. The Trainer's changes stay: ``autoshard.uninstall()`` undoes both."""
    return uninstall_changes(FABRIC_KINDS)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoshard.fabric' has no attribute {name!r}")


__all__ = ["STRATEGIES", "installed", "register", "replaced_message", "uninstall", *_LAZY]
