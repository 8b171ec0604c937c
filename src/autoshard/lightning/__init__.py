"""Lightning integration: strategies registered by name, and the guards, installed once on ``import autoshard``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from autoshard.lightning.compat import check_lightning
from autoshard.lightning.fsdp2 import AutoShardStrategy, FSDP2Strategy
from autoshard.lightning.guards import install_guards

_REGISTERED = False


def _other_registration(registry: Any, name: str, ours: type) -> Any:
    """The class (or factory) another library registered under ``name``, else None; read raw, never instantiated."""
    entry = dict.get(registry, name)
    strategy = entry.get("strategy") if isinstance(entry, dict) else None
    return strategy if callable(strategy) and strategy is not ours else None


def replaced_message(name: str, replaced: Any) -> str:
    """Said once, on rank 0: a silent replacement would leave the user unsure which "fsdp2" trains their model."""
    short = getattr(replaced, "__qualname__", type(replaced).__qualname__)
    theirs = f"{getattr(replaced, '__module__', None) or type(replaced).__module__}.{short}"
    return (
        f"autoshard: Trainer(strategy='{name}') was registered by {theirs}; import autoshard replaced it with"
        f" autoshard.lightning.FSDP2Strategy. To train with the other one, pass it as an object:"
        f" Trainer(strategy={short}(...))"
    )


def register() -> None:
    """Register "fsdp2", "auto-shard" and the DeepSpeed names; idempotent, so re-imports are harmless."""
    global _REGISTERED
    if _REGISTERED:
        return
    check_lightning()  # first: a guard below may need a member this Lightning lacks
    from lightning.pytorch.strategies import StrategyRegistry

    replaced = _other_registration(StrategyRegistry, "fsdp2", FSDP2Strategy)
    StrategyRegistry.register(
        "fsdp2", FSDP2Strategy, description="autoshard: FSDP2 (fully_shard) for any LightningModule", override=True
    )
    if replaced is not None:
        rank_zero_info(replaced_message("fsdp2", replaced))
    StrategyRegistry.register(
        "auto-shard", AutoShardStrategy, description="autoshard: the sharding backend your method can run on", override=True
    )
    from autoshard.lightning.deepspeed import register_deepspeed_strategies  # imports no deepspeed

    register_deepspeed_strategies(StrategyRegistry)
    install_guards()
    _REGISTERED = True


__all__ = ["AutoShardStrategy", "FSDP2Strategy", "register"]
