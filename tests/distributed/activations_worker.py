"""One rank of the activation-estimate check: estimate this rank's step peak with measure_step (on a fake process
group, before the real one exists), then train for real on gloo and measure step 2's peak with the same tracker.

Launched by tests/distributed/test_activations.py through the harness (torchrun-style environment).
"""

from __future__ import annotations

import argparse
import os
import warnings
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers strategy="auto-shard"
from autoshard.activations import measure_step, measuring_callback
from autoshard.demo import DinoLike
from autoshard.intent import ShardingIntent
from autoshard.precision import resolve_precision
from tests.distributed.harness import quiet_trainer, worker_main, write_result

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH, STEPS, PRECISION = 128, 3, "bf16-mixed"


def model() -> DinoLike:
    """The demo's EMA method, wide enough that activations are a large share of the peak."""
    return DinoLike(in_dim=64, dim=128, depth=2)


MODES = (False, 2, "selective")  # activation checkpointing: none, every 2nd block, op-level


class Deeper(pl.LightningModule):
    """Four residual MLP blocks with dropout (recomputation must redraw its masks) and AdamW: checkpointing modes differ."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 64))
            for _ in range(4)
        )
        self.head = torch.nn.Linear(64, 4)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = x + block(x)
        loss = torch.nn.functional.cross_entropy(self.head(x), y)
        self.losses.append(loss.detach())  # read after fit: the simulated step has no values
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(factory: Any, intent: ShardingIntent) -> tuple[pl.LightningModule, Any]:
    """A real fit on gloo with the intent, step 2 measured by the tracker measure_step uses."""
    from autoshard.lightning.fsdp2 import FSDP2Strategy

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * WORLD * STEPS, 64, generator=g), torch.randint(0, 4, (BATCH * WORLD * STEPS,), generator=g))
    pl.seed_everything(0, verbose=False)
    measured = measuring_callback(batch_index=1)
    trainer = quiet_trainer(strategy=FSDP2Strategy(intent=intent), precision=PRECISION, max_steps=STEPS, callbacks=[measured])
    module = factory()
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return module, measured.result


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    intent = ShardingIntent()
    batch = lambda: [torch.randn(BATCH, 64), torch.randint(0, 4, (BATCH,))]  # noqa: E731  as the DataLoader yields it
    estimate = measure_step(model, intent, WORLD, resolve_precision(PRECISION, intent), make_batch=batch, rank=RANK)
    modes = {}
    for ac in MODES:  # estimated before the real group exists (measure_step refuses a live one)
        asked = ShardingIntent(activation_checkpointing=ac)
        modes[repr(ac)] = measure_step(Deeper, asked, WORLD, resolve_precision(PRECISION, asked), make_batch=batch, rank=RANK).to_dict()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # after: measure_step refuses a live group
    _, measured = fit(model, intent)
    result: dict[str, Any] = {"estimate": estimate.to_dict(), "measured": measured and measured.to_dict(), "modes": {}}
    for ac in MODES:
        module, step = fit(Deeper, ShardingIntent(activation_checkpointing=ac))
        weights = [p.full_tensor().float().sum().item() for p in module.parameters()]
        result["modes"][repr(ac)] = {
            "estimate": modes[repr(ac)],
            "measured": step and step.to_dict(),
            "losses": [float(v) for v in module.losses],
            "weights": weights,
        }
    write_result(args.out, RANK, result)


if __name__ == "__main__":
    worker_main(main)
