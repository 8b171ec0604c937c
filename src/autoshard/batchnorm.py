"""``Trainer(sync_batchnorm=True)`` for every backend: BatchNorm with the statistics of the global batch, on CPU too
(torch's own SyncBatchNorm refuses CPU input, even on one rank)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from autoshard.privates import in_torch


def _differentiable_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce (sum) with autograd. torch.distributed.nn's has it on every torch >= 2.4; 2.13 deprecates it for
    functional collectives, whose autograd is recent, so its FutureWarning is silenced here only."""
    from torch.distributed.nn.functional import all_reduce

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return all_reduce(t, group=group)


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm, plus a CPU path: sums all-reduced through torch.distributed.nn's differentiable
    all_reduce, so gradients flow through the global statistics as in torch's CUDA path."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if input.device.type != "cpu":
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        if not self.training or not dist.is_initialized() or dist.get_world_size(group) == 1:
            # Nothing to synchronize: plain BatchNorm (torch's SyncBatchNorm refuses CPU input even on one rank).
            return in_torch.BatchNorm.forward(self, input)
        self._check_input_dim(input)
        dims, shape = [0, *range(2, input.dim())], [1, -1] + [1] * (input.dim() - 2)
        x = input.float()
        sums = _differentiable_sum(torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.size(1)])]), group)
        count, mean = sums[-1], sums[:-1] / sums[-1]
        centered = x - mean.view(shape)
        var = _differentiable_sum(centered.square().sum(dims), group) / count
        out = centered * (var + self.eps).rsqrt().view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_((var * count / (count - 1)).to(self.running_var.dtype), momentum)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: nn.Module, group: Any) -> int:
    """Every BatchNorm layer normalizes with the statistics of the global batch over ``group`` (None: the world);
    returns how many. Lightning's ModelParallelStrategy and DeepSpeedStrategy never apply the flag. Converted in
    place, by class: torch's convert_sync_batchnorm builds new modules, losing fully_shard's state, hooks and
    optimizer references.
    """
    from torch.distributed.fsdp import FSDPModule as fsdp_module

    count = 0
    for m in module.modules():
        if not isinstance(m, in_torch.BatchNorm):
            continue
        if not isinstance(m, SyncBatchNorm):
            sharded = isinstance(m, fsdp_module)  # keep fully_shard's FSDP<class> on top, as fully_shard builds it
            m.__class__ = type(f"FSDP{SyncBatchNorm.__name__}", (fsdp_module, SyncBatchNorm), {}) if sharded else SyncBatchNorm
        m.process_group = group
        count += 1
    return count
