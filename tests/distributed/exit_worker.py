"""One rank of 2 for tests/distributed/test_worker_exit.py (gloo, through ``run_scenarios`` like every test worker):
the harness's exit path when a scenario fails on one rank."""

from __future__ import annotations

import os
from typing import Any

RANK = int(os.environ.get("RANK", "0"))


def scenario_raise_on_rank_1() -> dict[str, Any]:
    """Rank 1 fails inside a DTensor program (so DTensor's caches hold the mesh and its groups); rank 0 does not."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    if RANK == 1:
        raise ValueError("planted failure on rank 1")
    return {"full": full.tolist()}


if __name__ == "__main__":
    from tests.distributed.harness import run_scenarios

    run_scenarios({"raise_on_rank_1": scenario_raise_on_rank_1})
