"""One rank of the HSDP x TP checks: 8 gloo processes, ``FSDP2Strategy(shard_size=2, tensor_parallel_size=2)``, i.e.
2 replicas x 2 shard ranks x 2 tensor-parallel ranks on one mesh (``autoshard.mesh``).

Launched by tests/distributed/test_hsdp_tp.py through the harness. The model carries its own tensor-parallel plan
(``_tp_plan``: each block's fc1 colwise, fc2 rowwise); autoshard lays it out on the tensor-parallel ranks, then shards
every unit over the data-parallel dims of the same mesh. It also has a LayerNorm the plan leaves whole, a parameter on
the LightningModule root and an excluded probe (both kept whole, their gradients averaged over the data-parallel
ranks). Lightning's own sampler feeds the batches; each rank records the sample indices it read, and after the fit
every rank trains one process on the same global batches (the 4 data-parallel ranks' batches, in rank order), fp32,
to compare. Each scenario returns what THIS rank holds.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import JOB_WORLD_SIZE, QUIET, run_scenarios

TP, DP = 2, JOB_WORLD_SIZE // 2
BATCH, STEPS, WIDTH = 4, 4, 8
LR = 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TwoBlocks(pl.LightningModule):
    """Two Linear-MLP blocks with the model's own tensor-parallel plan, a norm, a root parameter, a probe."""

    _tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(WIDTH)
        self.probe = nn.Linear(WIDTH, 1)
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x), y) + 0.1 * self.probe(x).pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.seen.append(index.tolist())
        loss = self.loss(x, y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * DP * STEPS, WIDTH, generator=g)
    return TensorDataset(torch.arange(len(x)), x, torch.tanh(x @ torch.randn(WIDTH, WIDTH, generator=g)))


def reference(model: TwoBlocks, steps: list[list[int]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same global batches (each step: every data-parallel rank's samples, in rank order), fp32 SGD."""
    dataset = data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for indices in steps:
        _, x, y = dataset[torch.tensor(indices)]
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def scenario_hsdp_tp() -> dict[str, Any]:
    torch.manual_seed(0)  # the same whole model on every rank (and the reference copy)
    model = TwoBlocks()
    single = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    strategy = FSDP2Strategy(shard_size=2, tensor_parallel_size=TP, exclude=["probe"])
    trainer = pl.Trainer(**QUIET, devices=JOB_WORLD_SIZE, strategy=strategy, precision="32-true", max_epochs=1)
    trainer.fit(model, DataLoader(data(), batch_size=BATCH, shuffle=False))
    rank = dist.get_rank()
    seen: list[list[list[int]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(seen, model.seen)
    # Global batch of each step: the data-parallel ranks' batches (dp rank d = global ranks d*TP .. d*TP+TP-1).
    steps = [sum((seen[d * TP][s] for d in range(DP)), []) for s in range(len(model.seen))]
    ref_losses, ref = reference(single, steps)
    params = dict(model.named_parameters())
    # full_tensor is a collective: every rank gathers every parameter, in the same order
    full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}
    mesh, parallel = strategy.device_mesh, strategy.parallel_mesh
    assert parallel is not None
    return {
        "rank": rank,
        "dims": [strategy.dims.dp_replicate, strategy.dims.dp_shard, strategy.dims.tp],
        "device_mesh": {"dims": list(mesh.mesh_dim_names), "shape": list(mesh.shape)},
        "shard_mesh": {
            "dims": list(parallel.shard.mesh_dim_names),
            "shape": list(parallel.shard.shape),
            "coordinate": parallel.shard.get_coordinate(),
        },
        "tp_group": sorted(dist.get_process_group_ranks(parallel.tp.get_group())),
        "dp_group": sorted(dist.get_process_group_ranks(parallel.dp.get_group())),
        "sampler": strategy.distributed_sampler_kwargs,
        "seen": model.seen,
        "placements": {n: [repr(x) for x in p.placements] for n, p in params.items() if isinstance(p, DTensor)},
        "param_mesh_dims": sorted({tuple(p.device_mesh.mesh_dim_names) for p in params.values() if isinstance(p, DTensor)}),
        "plain": sorted(n for n, p in params.items() if not isinstance(p, DTensor)),
        "local": {n: p.to_local().detach().flatten().tolist() for n, p in params.items() if isinstance(p, DTensor)},
        "local_shapes": {n: list(p.to_local().shape) for n, p in params.items() if isinstance(p, DTensor)},
        "full_shapes": {n: list(p.shape) for n, p in params.items()},
        "max_diff": max((full[n] - ref[n]).abs().max().item() for n in ref),
        "diffs": {n: (full[n] - ref[n]).abs().max().item() for n in ref},
        "changed": {n: not torch.equal(full[n], start[n]) for n in full},
        "losses": model.losses,
        "ref_losses": ref_losses,
        "plan": strategy.plan.describe(strategy.describe_mesh()) if strategy.plan is not None else "",
    }


class NoPlan(TwoBlocks):
    _tp_plan: dict[str, str] = {}


def scenario_no_plan() -> dict[str, Any]:
    """Tensor parallel for a model that carries no layout: refused at setup, on every rank alike, before sharding."""
    trainer = pl.Trainer(**QUIET, devices=JOB_WORLD_SIZE, strategy=FSDP2Strategy(tensor_parallel_size=TP), max_steps=1)
    try:
        trainer.fit(NoPlan(), DataLoader(data(), batch_size=BATCH))
    except Exception as exc:  # noqa: BLE001  (the type and text are the result)
        return {"error": type(exc).__name__, "text": str(exc)}
    return {"error": None, "text": ""}


SCENARIOS = {"hsdp_tp": scenario_hsdp_tp, "no_plan": scenario_no_plan}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
