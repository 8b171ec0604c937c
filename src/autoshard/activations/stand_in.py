"""The stand-in Trainer of a manual-optimization step: what ``self.trainer`` and ``self.optimizers()`` reach in fit, without a Trainer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autoshard.privates import in_lightning


class _StandInStrategy:
    """What a manual-optimization step reaches through ``self.trainer.strategy``: ``manual_backward`` and a
    LightningOptimizer's ``step`` do what Lightning's strategy does. No Fabric: ``self.optimizers()`` takes Lightning's
    own Trainer path."""

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.lightning_module = module
        self._lightning_optimizers = [in_lightning.to_lightning_optimizer(o, self) for o in optimizers]

    def backward(self, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.lightning_module.backward(loss, *args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure, **kwargs)


class StandInTrainer:
    """``self.trainer`` of the module copy a manual-optimization step runs on: its optimizers and LR schedulers, step 0
    on the measured rank, ``barebones`` so that ``self.log`` returns at once; anything else says so by name."""

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], world_size: int, rank: int) -> None:
        from lightning.pytorch.plugins.precision import Precision
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        self.strategy = _StandInStrategy(module, optimizers)
        self.optimizers = list(optimizers)
        self.lr_scheduler_configs = [LRSchedulerConfig(s) for s in schedulers]
        self.precision_plugin = Precision()
        self.world_size, self.global_rank, self.local_rank, self.node_rank = world_size, rank, rank, 0
        self.is_global_zero = rank == 0
        self.global_step = self.current_epoch = 0
        self.accumulate_grad_batches = 1
        self.gradient_clip_val = self.gradient_clip_algorithm = None
        self.barebones = True
        self.logger, self.loggers, self.progress_bar_callback = None, [], None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"self.trainer.{name} is not available in autoshard's simulated step (a stand-in Trainer holding the"
            f" optimizers, schedulers, step and rank)"
        )


def returned_schedulers(configured: Any) -> list[Any]:
    """The LR schedulers in ``configure_optimizers``'s return shapes (a dict with "lr_scheduler", or
    ``([optimizers], [schedulers])``), each unwrapped from its ``{"scheduler": ...}`` config."""
    unwrap = lambda s: s.get("scheduler") if isinstance(s, Mapping) else s  # noqa: E731
    if isinstance(configured, Mapping):
        return [unwrap(configured["lr_scheduler"])] if configured.get("lr_scheduler") is not None else []
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and all(isinstance(part, (list, tuple)) for part in configured):
            return [unwrap(s) for s in configured[1]]
        return [s for item in configured if isinstance(item, Mapping) for s in returned_schedulers(item)]
    return []
