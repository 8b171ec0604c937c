"""Lightning integration: strategies registered by name, and the guards, installed once on ``import autoshard``."""

from __future__ import annotations

from autoshard.lightning.fsdp2 import AutoShardStrategy, FSDP2Strategy
from autoshard.lightning.guards import install_guards

_REGISTERED = False


def register() -> None:
    """Register "fsdp2", "auto-shard" and the DeepSpeed names; idempotent, so re-imports are harmless."""
    global _REGISTERED
    if _REGISTERED:
        return
    from lightning.pytorch.strategies import StrategyRegistry

    StrategyRegistry.register(
        "fsdp2", FSDP2Strategy, description="autoshard: FSDP2 (fully_shard) for any LightningModule", override=True
    )
    StrategyRegistry.register(
        "auto-shard", AutoShardStrategy, description="autoshard: the sharding backend your method can run on", override=True
    )
    from autoshard.lightning.deepspeed import register_deepspeed_strategies  # imports no deepspeed

    register_deepspeed_strategies(StrategyRegistry)
    install_guards()
    _REGISTERED = True


__all__ = ["AutoShardStrategy", "FSDP2Strategy", "register"]
