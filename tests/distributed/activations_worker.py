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
from tests.distributed.harness import quiet_trainer, write_result

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
BATCH, STEPS, PRECISION = 128, 3, "bf16-mixed"


def model() -> DinoLike:
    """The demo's EMA method, wide enough that activations are a large share of the peak."""
    return DinoLike(in_dim=64, dim=128, depth=2)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    intent = ShardingIntent()
    batch = lambda: [torch.randn(BATCH, 64), torch.randint(0, 4, (BATCH,))]  # noqa: E731  as the DataLoader yields it
    estimate = measure_step(model, intent, WORLD, resolve_precision(PRECISION, intent), make_batch=batch, rank=RANK)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # after: measure_step refuses a live group
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * WORLD * STEPS, 64, generator=g), torch.randint(0, 4, (BATCH * WORLD * STEPS,), generator=g))
    pl.seed_everything(0, verbose=False)
    measured = measuring_callback(batch_index=1)
    trainer = quiet_trainer(strategy="auto-shard", precision=PRECISION, max_steps=STEPS, callbacks=[measured])
    trainer.fit(model(), DataLoader(data, batch_size=BATCH))
    result: dict[str, Any] = {"estimate": estimate.to_dict(), "measured": measured.result and measured.result.to_dict()}
    write_result(args.out, RANK, result)


if __name__ == "__main__":
    main()
