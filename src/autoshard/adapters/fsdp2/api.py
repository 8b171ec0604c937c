"""FSDP2's entry points in the installed torch (public since torch 2.6, under ``_composable`` before)."""

from __future__ import annotations

from typing import Any

from torch import nn


def fsdp2_api() -> tuple[Any, Any, Any, Any, Any]:
    """fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy (public since torch 2.6)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    return fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy


def is_sharded(module: nn.Module) -> bool:
    """True when someone (the user's configure_model, or a previous setup) already applied fully_shard."""
    fsdp_module = fsdp2_api()[1]
    return any(isinstance(m, fsdp_module) for m in module.modules())
