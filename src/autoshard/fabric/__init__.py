"""Lightning Fabric: ``Fabric(strategy="auto-shard" | "fsdp2" | "autoshard-deepspeed")``, with the Trainer's guarantees.

Fabric keeps its own registry, ``lightning.fabric.strategies.STRATEGY_REGISTRY``, apart from the Trainer's, and each
``Fabric()`` copies its names once when it is built: ``import autoshard`` registers here (``register``), at once when
``lightning.fabric`` is loaded, else the moment it is. Registering imports nothing but that registry: each entry is a
factory that imports its strategy (and ``autoshard.lightning``, whose guarantees it shares) when ``Fabric()`` builds
it, so ``from lightning.fabric import Fabric`` stays as fast as without autoshard.

Every registry entry this changes is recorded (``installed``) and put back by ``uninstall``, as for the Trainer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# name -> (module.attribute of the strategy class it builds, the registry's description)
STRATEGIES: dict[str, tuple[str, str]] = {
    "fsdp2": ("autoshard.fabric.strategies.FSDP2Strategy", "autoshard: FSDP2 (fully_shard) for any nn.Module, optimizers remapped"),
    "auto-shard": ("autoshard.fabric.strategies.AutoShardStrategy", "autoshard: the sharding backend your models can run on"),
    "autoshard-deepspeed": ("autoshard.fabric.deepspeed.AutoShardDeepSpeedStrategy", "autoshard: DeepSpeed ZeRO-3 from a ShardingIntent"),
}
_LAZY = {
    "FSDP2Strategy": "autoshard.fabric.strategies",
    "AutoShardStrategy": "autoshard.fabric.strategies",
    "AutoShardDeepSpeedStrategy": "autoshard.fabric.deepspeed",
    "fabric_target": "autoshard.fabric.explain",
}


@dataclass(frozen=True)
class FabricChange:
    """One entry of Fabric's registry set by ``register``, with the entry it replaced (None: the name was free)."""

    name: str
    now: str
    previous: dict[str, Any] | None

    @property
    def target(self) -> str:
        return f"lightning.fabric STRATEGY_REGISTRY[{self.name!r}]"


_INSTALLED: list[FabricChange] = []


def _factory(name: str) -> Any:
    """What the registry calls for ``name``: imports the strategy class on first use and builds it."""
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
    if _INSTALLED:
        return
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    for name, (path, description) in STRATEGIES.items():
        previous = dict.get(STRATEGY_REGISTRY, name)  # the raw entry: STRATEGY_REGISTRY.get() would build it
        STRATEGY_REGISTRY.register(name, _factory(name), description=description, override=True)
        _INSTALLED.append(FabricChange(name, path, previous))
        theirs = previous.get("strategy") if isinstance(previous, dict) else None
        if callable(theirs):
            rank_zero_info(replaced_message(name, theirs))


def installed() -> tuple[FabricChange, ...]:
    """The entries of Fabric's registry autoshard set, in the order it set them."""
    return tuple(_INSTALLED)


def uninstall() -> list[FabricChange]:
    """Put back every entry of Fabric's registry as it was before ``register`` (by identity); returns them."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    undone = list(reversed(_INSTALLED))
    for change in undone:
        if change.previous is None:
            dict.pop(STRATEGY_REGISTRY, change.name, None)
        else:
            dict.__setitem__(STRATEGY_REGISTRY, change.name, change.previous)
    _INSTALLED.clear()
    return undone


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoshard.fabric' has no attribute {name!r}")


__all__ = ["STRATEGIES", "FabricChange", "installed", "register", "replaced_message", "uninstall", *_LAZY]
