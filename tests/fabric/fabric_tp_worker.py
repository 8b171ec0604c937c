"""One rank of the Fabric tensor-parallel check (tests/fabric/test_fabric_tp.py): 4 gloo processes,
``Fabric(strategy=FSDP2Strategy(tensor_parallel_size=2))``, i.e. 2 data-parallel x 2 tensor-parallel ranks on one mesh.

The model carries its own tensor-parallel plan (``_tp_plan``: each block's fc1 colwise, fc2 rowwise) and a LayerNorm
the plan leaves whole; autoshard lays it out on the tensor-parallel ranks, then shards every unit over the data-parallel
ranks of the same mesh. The optimizer is built before ``fabric.setup`` (moved onto the laid-out shards). Fabric's own
sampler (``fabric.setup_dataloaders``) feeds the batches; each rank records the sample indices it read, and every rank
then trains one process on the same global batches (the data-parallel ranks' batches, in rank order), fp32, to compare.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers Fabric's strategy names
from tests.distributed.harness import JOB_WORLD_SIZE, run_scenarios

TP, DP = 2, JOB_WORLD_SIZE // 2
BATCH, STEPS, WIDTH = 4, 3, 8
LR = 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TwoBlocks(nn.Module):
    """Two Linear-MLP blocks with the model's own tensor-parallel plan, and a norm the plan leaves whole."""

    _tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class NoPlan(TwoBlocks):
    _tp_plan: dict[str, str] = {}


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * DP * STEPS, WIDTH, generator=g)
    return TensorDataset(torch.arange(len(x)), x, torch.tanh(x @ torch.randn(WIDTH, WIDTH, generator=g)))


def fabric(**intent: Any) -> Any:
    from lightning.fabric import Fabric

    from autoshard.fabric import FSDP2Strategy

    f = Fabric(accelerator="cpu", devices=JOB_WORLD_SIZE, strategy=FSDP2Strategy(**intent), precision="32-true")
    f.launch()
    return f


def reference(model: nn.Module, steps: list[list[int]]) -> dict[str, torch.Tensor]:
    """One process, the same global batches (each step: every data-parallel rank's samples, in rank order), fp32 SGD."""
    dataset = data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for indices in steps:
        _, x, y = dataset[torch.tensor(indices)]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def scenario_tp() -> dict[str, Any]:
    f = fabric(tensor_parallel_size=TP)
    torch.manual_seed(0)  # the same whole model on every rank (and the reference copy)
    model = TwoBlocks()
    single = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # built before setup: moved onto the laid-out shards
    model, opt = f.setup(model, opt)
    loader = f.setup_dataloaders(DataLoader(data(), batch_size=BATCH, shuffle=False))
    seen: list[list[int]] = []
    for index, x, y in loader:
        seen.append(index.tolist())
        f.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    everyone: list[list[list[int]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, seen)
    # Global batch of each step: the data-parallel ranks' batches (dp rank d = global ranks d*TP .. d*TP+TP-1).
    steps = [sum((everyone[d * TP][s] for d in range(DP)), []) for s in range(len(seen))]
    ref = reference(single, steps)
    inner = model.module
    params = dict(inner.named_parameters())
    full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}  # collectives
    strategy = f.strategy
    parallel = strategy.parallel_mesh
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    return {
        "dims": [strategy.dims.dp_replicate, strategy.dims.dp_shard, strategy.dims.tp],
        "device_mesh": {"dims": list(strategy.device_mesh.mesh_dim_names), "shape": list(strategy.device_mesh.shape)},
        "tp_group": sorted(dist.get_process_group_ranks(parallel.tp.get_group())),
        "dp_group": sorted(dist.get_process_group_ranks(parallel.dp.get_group())),
        "sampler": strategy.distributed_sampler_kwargs,
        "seen": seen,
        "placements": {n: [repr(x) for x in p.placements] for n, p in params.items() if isinstance(p, DTensor)},
        "param_mesh_dims": sorted({tuple(p.device_mesh.mesh_dim_names) for p in params.values() if isinstance(p, DTensor)}),
        "local_shapes": {n: list(p.to_local().shape) for n, p in params.items() if isinstance(p, DTensor)},
        "full_shapes": {n: list(p.shape) for n, p in params.items()},
        "diffs": {n: (full[n] - ref[n]).abs().max().item() for n in ref},
        "changed": {n: not torch.equal(full[n], start[n]) for n in full},
        "optimizer_holds_model": held == {id(p) for p in inner.parameters()},
        "plan": strategy.plan.describe(strategy.describe_mesh()) if strategy.plan is not None else "",
    }


def scenario_no_plan() -> dict[str, Any]:
    """Tensor parallel for a model that carries no layout: the plan refuses it at fabric.setup, on every rank alike."""
    f = fabric(tensor_parallel_size=TP)
    try:
        f.setup_module(NoPlan())
    except Exception as exc:  # noqa: BLE001  (the type and text are the result)
        return {"error": type(exc).__name__, "text": str(exc)}
    return {"error": None, "text": ""}


SCENARIOS = {"tp": scenario_tp, "no_plan": scenario_no_plan}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
