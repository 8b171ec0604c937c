"""One rank of the multi-node checks: started by ``torchrun --nnodes=2 --nproc-per-node=2 --node-rank=N``, twice on
this machine (tests/distributed/test_multinode.py), so Lightning sees what a real 2-node torchrun job gives it.

Scenarios, in one process group: ``hsdp`` trains ``FSDP2Strategy(shard_size="node")`` with
``Trainer(num_nodes=2, devices=2)``; ``auto`` the same intent through ``strategy="auto-shard"``; ``fsdp`` pure FSDP on
the same 4 ranks. Each returns what THIS rank holds and what Lightning saw of the launch; the test compares ranks,
nodes and scenarios. Same model, seed and batches in fp32: HSDP and FSDP must end on the same weights.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DataLoader

from autoshard.lightning import AutoShardStrategy, FSDP2Strategy
from tests.distributed.harness import QUIET, run_scenarios
from tests.distributed.hsdp_worker import Regressor, data

NODES, PER_NODE = 2, 2
# Read at start: Lightning's teardown deletes WORLD_SIZE when a Trainer finishes (see harness.JOB_WORLD_SIZE).
LAUNCH = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}


def group_ranks(mesh: Any, dim: str) -> list[int]:
    return sorted(dist.get_process_group_ranks(mesh.get_group(dim)))


def fit(strategy: Any) -> dict[str, Any]:
    torch.manual_seed(0)  # the same whole model on every rank: each keeps its own chunk of it
    model = Regressor()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = pl.Trainer(**QUIET, strategy=strategy, devices=PER_NODE, num_nodes=NODES, precision="32-true", max_epochs=1)
    seen = {
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "num_nodes": trainer.num_nodes,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "global_rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
    }
    trainer.fit(model, DataLoader(data(), batch_size=4, shuffle=False))
    params = dict(model.named_parameters())
    sharded = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    # full_tensor is a collective: every rank gathers every parameter, in the same order
    full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}
    mesh = next(iter(sharded.values())).device_mesh
    hsdp = mesh.ndim == 2
    return {
        "seen": seen,
        "hsdp": trainer.strategy.hsdp_sizes,
        "mesh_shape": list(mesh.shape),
        "mesh_dims": list(mesh.mesh_dim_names or ()),
        "coordinate": mesh.get_coordinate(),
        "shard_group": group_ranks(mesh, "dp_shard") if hsdp else sorted(mesh.mesh.flatten().tolist()),
        "replica_group": group_ranks(mesh, "dp_replicate") if hsdp else [dist.get_rank()],
        "placements": {n: [str(x) for x in p.placements] for n, p in sharded.items()},
        "hsdp_placements": all(p.placements == (Replicate(), Shard(0)) for p in sharded.values()),
        "rows": {n: [p.to_local().shape[0], p.shape[0]] for n, p in sharded.items()},
        "local": {n: p.to_local().detach().flatten().tolist() for n, p in sharded.items()},
        "full": {n: t.flatten().tolist() for n, t in full.items()},
        "changed": {n: not torch.equal(full[n], start[n]) for n in full},
        "losses": model.losses,
    }


def scenario_hsdp() -> dict[str, Any]:
    return fit(FSDP2Strategy(shard_size="node"))


def scenario_auto() -> dict[str, Any]:
    return fit(AutoShardStrategy(shard_size="node"))


def scenario_fsdp() -> dict[str, Any]:
    return fit(FSDP2Strategy())


def scenario_launch() -> dict[str, Any]:
    """What torchrun set for this process (the test checks the node layout against it)."""
    return dict(LAUNCH)


SCENARIOS = {"launch": scenario_launch, "hsdp": scenario_hsdp, "auto": scenario_auto, "fsdp": scenario_fsdp}


if __name__ == "__main__":
    assert LAUNCH["WORLD_SIZE"] == str(NODES * PER_NODE) and LAUNCH["LOCAL_WORLD_SIZE"] == str(PER_NODE), LAUNCH
    run_scenarios(SCENARIOS)
