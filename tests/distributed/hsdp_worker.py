"""One rank of the hybrid-sharding (HSDP) checks: 4 gloo processes, ``FSDP2Strategy(shard_size=2)`` against pure FSDP.

Launched by tests/distributed/test_hsdp.py through the harness; each scenario returns what THIS rank holds, and the
test compares ranks and scenarios. Both scenarios build the same model from the same seed on every rank and read the
same batches, in fp32, so HSDP and FSDP must end on the same weights.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DataLoader, TensorDataset

from autoshard.demo import ema_update
from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import JOB_WORLD_SIZE, quiet_trainer, run_scenarios

STEPS = 8


class Regressor(pl.LightningModule):
    """A student MLP with an EMA teacher, and a root parameter the plan keeps whole (its gradient is averaged)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.student = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            self.teacher(x)  # forwarded, as a method's teacher is; it takes no part in the loss
        loss = F.mse_loss(self.student(x * self.scale), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        ema_update(self.teacher, self.student, 0.9)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 4 * JOB_WORLD_SIZE, 8, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(8, 4, generator=g)))


def fit(**intent: Any) -> dict[str, Any]:
    torch.manual_seed(0)  # the same whole model on every rank: each keeps its own chunk of it
    model = Regressor()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = quiet_trainer(strategy=FSDP2Strategy(**intent), precision="32-true", max_epochs=1)
    trainer.fit(model, DataLoader(data(), batch_size=4, shuffle=False))
    params = dict(model.named_parameters())
    sharded = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    # full_tensor is a collective: every rank gathers every parameter, in the same order
    full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}
    mesh = next(iter(sharded.values())).device_mesh
    return {
        "hsdp": trainer.strategy.hsdp_sizes,
        "mesh_shape": list(mesh.shape),
        "mesh_dims": list(mesh.mesh_dim_names or ()),
        "coordinate": mesh.get_coordinate(),
        "sharded": sorted(sharded),
        "placements": {n: [str(x) for x in p.placements] for n, p in sharded.items()},
        "hsdp_placements": all(p.placements == (Replicate(), Shard(0)) for p in sharded.values()),
        "same_mesh": all(p.device_mesh == mesh for p in sharded.values()),
        "rows": {n: [p.to_local().shape[0], p.shape[0]] for n, p in sharded.items()},
        "local": {n: p.to_local().detach().flatten().tolist() for n, p in sharded.items()},
        "full": {n: t.flatten().tolist() for n, t in full.items()},
        "changed": {n: not torch.equal(full[n], start[n]) for n in full},
        "losses": model.losses,
        "rank": dist.get_rank(),
    }


def scenario_hsdp() -> dict[str, Any]:
    return fit(shard_size=2)


def scenario_fsdp() -> dict[str, Any]:
    return fit()


SCENARIOS = {"hsdp": scenario_hsdp, "fsdp": scenario_fsdp}


if __name__ == "__main__":
    assert JOB_WORLD_SIZE == 4, JOB_WORLD_SIZE
    run_scenarios(SCENARIOS)
