"""``autoshard explain`` for a Fabric loop, which has no LightningModule: a plain ``nn.Module`` factory, an optimizer
factory and a loss, turned into the TARGET explain already takes.

The factory's module gets the two methods explain calls on a LightningModule (``configure_optimizers``: your optimizer
factory; ``training_step``: your loss) on a subclass of its own class made for the occasion, so nothing of yours is
changed, and the simulated step runs YOUR loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoShardError

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[nn.Module], Any]  # one optimizer, or a list / tuple of them
Loss = Callable[[nn.Module, Any], torch.Tensor]


def fabric_target(model: ModelFactory, optimizers: OptimizerFactory | None = None, loss: Loss | None = None) -> Callable[[], nn.Module]:
    """explain's TARGET for a Fabric user: ``model()`` builds the ``nn.Module`` you pass to ``fabric.setup``,
    ``optimizers(model)`` builds its optimizer(s) from ``model.parameters()`` (one, or a list for a GAN), and
    ``loss(model, batch)`` is one step's loss, as your loop computes it from a batch of your DataLoader.

    Without ``loss`` explain can only forward ``example_input_array`` (if the module has one); without ``optimizers``
    no optimizer state is counted.
    """
    if not callable(model):
        raise AutoShardError(
            f"fabric_target(model=...) takes a function that builds the module, got {type(model).__name__}. Fix: pass the"
            f" class or a factory, e.g. fabric_target(MyModel, lambda m: torch.optim.AdamW(m.parameters()), my_loss)"
        )

    def build() -> nn.Module:
        module = model()
        if not isinstance(module, nn.Module):
            raise AutoShardError(
                f"fabric_target's model factory returned {type(module).__name__}, not an nn.Module. Fix: return the module you pass to fabric.setup"
            )
        methods: dict[str, Any] = {"__module__": type(module).__module__, "__doc__": type(module).__doc__}
        if optimizers is not None:
            methods["configure_optimizers"] = lambda self: optimizers(self)
        if loss is not None:
            methods["training_step"] = lambda self, batch, batch_idx=0: loss(self, batch)
        module.__class__ = type(type(module).__name__, (type(module),), methods)
        return module

    build.__name__ = build.__qualname__ = f"fabric_target({getattr(model, '__qualname__', type(model).__name__)})"
    return build
