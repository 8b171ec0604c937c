"""Fabric tensor parallel from the model's own plan, on the one mesh: ``Fabric(strategy=FSDP2Strategy(tensor_parallel_size=2))``
on 4 real gloo processes (2 data-parallel x 2 tensor-parallel ranks) lays the model out by its ``_tp_plan``, shards
over the data-parallel ranks of the same mesh, feeds both ranks of a tensor-parallel pair the same batch through
``fabric.setup_dataloaders``, and trains equal to one process on the global batch; a model without a plan is refused.

One 4-process run holds both checks (imports dominate its cost: about 12 s here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("fabric_tp_worker.py")
WORLD, TP = 4, 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, ["--scenarios", "tp,no_plan"], tmp_path_factory.mktemp("fabric_tp"), nprocs=WORLD, timeout=300)


@pytest.mark.timeout(400)
def test_one_mesh_data_parallel_by_tensor_parallel(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        tp = r["tp"]
        assert tp["dims"] == [1, 2, 2]
        assert tp["device_mesh"] == {"dims": ["data_parallel", "tensor_parallel"], "shape": [2, 2]}
        assert tp["tp_group"] == [rank - rank % TP, rank - rank % TP + 1]
        assert tp["dp_group"] == [rank % TP, rank % TP + TP]
        assert tp["param_mesh_dims"] == [["data_parallel", "tensor_parallel"]]  # every DTensor on the one mesh
        assert "tensor parallel, laid out before fully_shard (4 modules" in tp["plan"], tp["plan"]
        assert "fsdp2 over 4 ranks (data parallel 2, tensor parallel 2)" in tp["plan"], tp["plan"]


@pytest.mark.timeout(400)
def test_the_model_plan_lays_out_tensor_parallel_then_fsdp_shards_over_data_parallel(ranks: list[dict[str, Any]]) -> None:
    strided = "_StridedShard(dim=0, sf=2)"  # FSDP2's Shard(0) over rows tensor parallel already split
    for r in ranks:
        p = r["tp"]["placements"]
        for i in (0, 1):
            assert p[f"blocks.{i}.fc1.weight"] == p[f"blocks.{i}.fc1.bias"] == [strided, "Shard(dim=0)"], p  # colwise
            assert p[f"blocks.{i}.fc2.weight"] == ["Shard(dim=0)", "Shard(dim=1)"], p  # rowwise: input columns
            assert p[f"blocks.{i}.fc2.bias"] == ["Shard(dim=0)", "Replicate()"], p  # added once, after the sum
        assert p["norm.weight"] == ["Shard(dim=0)", "Replicate()"]  # whole on each tensor-parallel rank
        for name in ("blocks.0.fc1.weight", "blocks.0.fc2.weight"):  # a quarter each: half by tp, half of that by dp
            rows, cols = r["tp"]["full_shapes"][name]
            local = r["tp"]["local_shapes"][name]
            assert local[0] * local[1] * 4 == rows * cols, (name, local)


@pytest.mark.timeout(400)
def test_a_tensor_parallel_pair_reads_one_batch_through_setup_dataloaders(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        assert r["tp"]["sampler"] == {"num_replicas": 2, "rank": rank // TP}
        assert r["tp"]["seen"] == ranks[rank ^ 1]["tp"]["seen"]  # its tensor-parallel partner
    for step in range(3):  # the data-parallel ranks read disjoint batches covering the global one
        assert len({i for d in range(2) for i in ranks[d * TP]["tp"]["seen"][step]}) == 8


@pytest.mark.timeout(400)
def test_trains_like_one_process_on_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    """The optimizer was built before fabric.setup: moved onto the laid-out shards, it trains every parameter exactly."""
    for r in ranks:
        tp = r["tp"]
        assert max(tp["diffs"].values()) < 1e-5, tp["diffs"]
        assert all(tp["changed"].values()), tp["changed"]
        assert tp["optimizer_holds_model"]


@pytest.mark.timeout(400)
def test_tensor_parallel_without_a_plan_is_refused_at_setup_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["no_plan"]["error"] == "IntentError", r["no_plan"]
        assert r["no_plan"]["text"].startswith("tensor_parallel_size=2 needs a tensor-parallel layout, and NoPlan carries none")
