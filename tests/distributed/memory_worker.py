"""One rank of the memory-estimator check: estimate on a meta twin, train for real, measure what this rank holds.

Launched by tests/distributed/test_memory.py through the harness (torchrun-style environment).
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers strategy="fsdp2"
from autoshard.demo import Blobs, DinoLike, OnlineProbe, local_state_bytes
from autoshard.intent import ShardingIntent
from autoshard.memory import EstimateOptions, estimate_memory
from autoshard.needs import inspect_needs
from tests.distributed.harness import quiet_trainer, run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def held_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """What this rank really holds: local shards (DTensor.to_local) of params and grads, every optimizer state tensor."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    size = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    params = sum(size(p) for p in module.parameters())
    grads = sum(size(p.grad) for p in module.parameters() if p.grad is not None)
    states = sum(size(v) for o in optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": states, "total": params + grads + states}


class Measure(pl.Callback):
    """At the end of fit: the bytes held, counted two ways (every state tensor, and the demo's local_state_bytes)."""

    def __init__(self, extra: list[Any]) -> None:
        self.extra = extra  # callbacks whose own optimizers count too
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        optimizers += [c.optimizer for c in self.extra if getattr(c, "optimizer", None) is not None]
        self.result = {"held": held_bytes(pl_module, optimizers), "demo": local_state_bytes(pl_module, optimizers)}


def fit(model: pl.LightningModule, data: Any, precision: str, callbacks: list[Any], steps: int = 3) -> pl.Trainer:
    trainer = quiet_trainer(strategy="fsdp2", precision=precision, max_steps=steps, callbacks=callbacks)
    trainer.fit(model, data)
    return trainer


def scenario_dino() -> dict[str, Any]:
    """The demo's EMA method + online probe, with dim 33 so every dim-0 shard is uneven (17 rows vs 16)."""
    with torch.device("meta"):
        twin, twin_probe = DinoLike(dim=33), OnlineProbe(dim=33)
        twin_probe.setup(None, twin, "fit")  # the probe attaches its module and builds its optimizer, as in fit
    intent = ShardingIntent(precision="bf16-mixed")
    needs = inspect_needs(twin, callbacks=[twin_probe])
    estimate = estimate_memory(twin, intent, needs, WORLD, "fsdp2", callbacks=[twin_probe], options=EstimateOptions(rank=RANK))
    pl.seed_everything(0, verbose=False)
    probe = OnlineProbe(dim=33)
    measure = Measure([probe])
    fit(DinoLike(dim=33), DataLoader(Blobs(n=96), batch_size=16), "bf16-mixed", [probe, measure])
    return {"estimate": estimate.to_dict(), **measure.result}


class Uneven(pl.LightningModule):
    """Odd sizes everywhere (13, 7, 3 rows), SGD with momentum, a frozen non-teacher subtree."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 13)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(2))
        self.frozen = nn.Linear(13, 7).requires_grad_(False)
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.frozen(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def scenario_uneven() -> dict[str, Any]:
    """fp32, SGD momentum (one state per parameter), a frozen subtree that stays whole."""
    with torch.device("meta"):
        twin = Uneven()
    intent = ShardingIntent(precision="32-true")
    estimate = estimate_memory(twin, intent, None, WORLD, "fsdp2", options=EstimateOptions(rank=RANK))
    pl.seed_everything(1, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    measure = Measure([])
    fit(Uneven(), DataLoader(data, batch_size=16), "32-true", [measure])
    return {"estimate": estimate.to_dict(), **measure.result}


SCENARIOS = {"dino": scenario_dino, "uneven": scenario_uneven}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
