"""``precision="16-mixed"`` on FSDP2, for both front ends: fp16 autocast (the plan gathers in fp16 and reduces in fp32,
``autoshard.precision``) with dynamic loss scaling whose inf/NaN check every rank shares.

Lightning's ModelParallelStrategy refuses 16-mixed (it has no sharded gradient scaler) and on CPU turns it into
bf16-mixed; ``torch.amp.GradScaler`` fails on a DTensor gradient beside a plain one ("mixed torch.Tensor and
DTensor") and, for a fused optimizer, checks this rank's shard only. Lightning's own ``MixedPrecision`` plugin is kept
(its checkpoint key, its unscale-then-clip order, its skipped steps); only its scaler is ``ShardedLossScaler``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor


class ShardedLossScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` (inf/NaN found on any rank all-reduced over the world: every rank skips the same
    steps and backs its scale off alike) on what each rank holds: a DTensor gradient's local shard. torch's own unscale
    cannot take a DTensor gradient beside a plain one (a parameter autoshard keeps whole), nor DTensors on two meshes."""

    def __init__(self, device: str = "cuda", **settings: Any) -> None:
        super().__init__(device, **settings)
        self.device_type = device

    def _unscale_grads_(  # torch private, overridden: autoshard.privates.in_torch
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        with torch.no_grad():  # to_local() is then the shard itself: unscaled in place
            held = [
                SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            ]
        return super()._unscale_grads_(SimpleNamespace(param_groups=[{"params": held}]), inv_scale, found_inf, allow_fp16)

    def _check_inf_per_device(self, optimizer: Any) -> dict[torch.device, torch.Tensor]:  # torch private, overridden
        """A fused optimizer (``AdamW(fused=True)``) unscales inside its step; torch checks for infs for it here, on
        this rank's shard only (measured: rank 0 stepped while rank 1 skipped). The same check, then each flag
        all-reduced over every rank (through the scaler's device: nccl reduces no CPU tensor)."""
        import torch.distributed as dist

        found = super()._check_inf_per_device(optimizer)
        for flag in found.values():
            shared = flag.to(self.device_type)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX)
            flag.copy_(shared)
        return found


def sharded_scaler(device: str, like: torch.amp.GradScaler | None = None) -> ShardedLossScaler:
    """A ``ShardedLossScaler`` for ``device`` ("cpu", "cuda"), with ``like``'s settings and current scale when given
    (the scaler of a ``MixedPrecision`` plugin the user passed), else torch's defaults."""
    if like is None:
        return ShardedLossScaler(device)
    return ShardedLossScaler(
        device,
        init_scale=like.get_scale() if like.is_enabled() else 2.0**16,
        growth_factor=like.get_growth_factor(),
        backoff_factor=like.get_backoff_factor(),
        growth_interval=like.get_growth_interval(),
        enabled=like.is_enabled(),
    )


def shard_aware(plugin: Any) -> None:
    """Give a 16-mixed ``MixedPrecision`` plugin (passed in ``plugins=``) a ``ShardedLossScaler`` with its scaler's
    settings; any other plugin is left as it is."""
    scaler = getattr(plugin, "scaler", None)
    if getattr(plugin, "precision", None) == "16-mixed" and scaler is not None and not isinstance(scaler, ShardedLossScaler):
        plugin.scaler = sharded_scaler(getattr(plugin, "device", "cuda"), like=scaler)


def accelerator_device(accelerator: Any) -> str:
    """The device type a precision plugin autocasts on, for a Lightning accelerator object (Lightning's own rule:
    cpu and mps by name, every other accelerator cuda)."""
    name = type(accelerator).__name__.removesuffix("Accelerator").lower()
    return name if name in ("cpu", "mps") else "cuda"
