"""HSDP x TP on one mesh, 8 real gloo processes: ``FSDP2Strategy(shard_size=2, tensor_parallel_size=2)`` lays the
model out by its own ``_tp_plan`` on the tensor-parallel ranks, then shards over the replicate x shard dims of the same
mesh (2 x 2 x 2). It trains equal to one process on the same global batches, keeps the replicas identical, feeds both
ranks of a tensor-parallel pair the same batch, and refuses tensor parallel for a model without a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("hsdp_tp_worker.py")
WORLD, TP = 8, 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 8-process run holds every check (imports dominate the cost; this machine may have 2 cores)."""
    return run_workers(WORKER, ["--scenarios", "hsdp_tp,no_plan"], tmp_path_factory.mktemp("hsdp_tp"), nprocs=WORLD, timeout=400)


def coordinate(rank: int) -> tuple[int, int, int]:
    """(replica, shard, tensor parallel) of a global rank: tensor parallel innermost, then shard, then replica."""
    return rank // 4, rank // 2 % 2, rank % 2


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_one_mesh_with_three_dims(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        h = r["hsdp_tp"]
        replica, shard, tp = coordinate(rank)
        assert h["dims"] == [2, 2, 2]
        # Lightning's mesh, as a user's parallelize_fn / configure_model sees it, is the root: dp = replicas x shards.
        assert h["device_mesh"] == {"dims": ["data_parallel", "tensor_parallel"], "shape": [4, 2]}
        assert h["shard_mesh"] == {"dims": ["dp_replicate", "dp_shard"], "shape": [2, 2], "coordinate": [replica, shard]}
        assert h["tp_group"] == [rank - tp, rank - tp + 1]
        assert h["dp_group"] == [tp + 2 * d for d in range(4)]
        # Every DTensor lives on the one mesh: sharded ones on all three dims, the excluded probe on tensor parallel.
        assert h["param_mesh_dims"] == [["dp_replicate", "dp_shard", "tensor_parallel"], ["tensor_parallel"]]
        assert "tensor parallel, laid out before fully_shard (4 modules" in h["plan"], h["plan"]


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_placements_are_hsdp_on_the_data_parallel_dims_and_the_plan_on_tensor_parallel(ranks: list[dict[str, Any]]) -> None:
    strided = "_StridedShard(dim=0, sf=2)"  # FSDP2's Shard(0) over rows tensor parallel already split: rows 0..n/2 first
    for r in ranks:
        h = r["hsdp_tp"]
        p = h["placements"]
        for i in (0, 1):
            assert p[f"blocks.{i}.fc1.weight"] == ["Replicate()", strided, "Shard(dim=0)"], p  # colwise: output rows
            assert p[f"blocks.{i}.fc1.bias"] == ["Replicate()", strided, "Shard(dim=0)"], p
            assert p[f"blocks.{i}.fc2.weight"] == ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"], p  # rowwise: input columns
            assert p[f"blocks.{i}.fc2.bias"] == ["Replicate()", "Shard(dim=0)", "Replicate()"], p  # added once, after the sum
        assert p["norm.weight"] == ["Replicate()", "Shard(dim=0)", "Replicate()"]  # whole on each tensor-parallel rank
        assert h["plain"] == ["scale"]  # the root parameter: kept whole, averaged over the data-parallel ranks
        assert p["probe.weight"] == p["probe.bias"] == ["Replicate()"]  # excluded: whole, on the tensor-parallel ranks
        # Each rank holds 1/8 of an fc weight: half of it by tensor parallel, half of that by the shard group.
        for name in ("blocks.0.fc1.weight", "blocks.0.fc2.weight"):
            rows, cols = h["full_shapes"][name]
            assert h["local_shapes"][name][0] * h["local_shapes"][name][1] * 4 == rows * cols, (name, h["local_shapes"][name])


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_a_tensor_parallel_pair_reads_one_batch_and_the_sampler_counts_data_parallel_ranks_only(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        h = r["hsdp_tp"]
        assert h["sampler"] == {"num_replicas": 4, "rank": rank // TP}
        assert len(h["seen"]) == 4 and all(len(batch) == 4 for batch in h["seen"])
        assert h["seen"] == ranks[rank ^ 1]["hsdp_tp"]["seen"]  # its tensor-parallel partner
    for step in range(4):  # the data-parallel ranks read disjoint batches that cover the global one
        global_batch = [i for d in range(4) for i in ranks[d * TP]["hsdp_tp"]["seen"][step]]
        assert len(set(global_batch)) == 16


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_training_equals_one_process_on_the_global_batch_and_replicas_stay_identical(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        h = r["hsdp_tp"]
        assert h["max_diff"] < 1e-5, h["diffs"]
        assert all(h["changed"].values()), h["changed"]  # every parameter trained: root scale and probe included
        # The global batch's loss is the mean of the data-parallel ranks' losses (equal batch sizes).
        means = [sum(ranks[d * TP]["hsdp_tp"]["losses"][s] for d in range(4)) / 4 for s in range(4)]
        assert means == pytest.approx(h["ref_losses"], abs=1e-5) and h["ref_losses"][-1] < h["ref_losses"][0]
    for rank in range(4):  # replica 0 and replica 1 of the same (shard, tensor-parallel) coordinate hold equal shards
        assert ranks[rank]["hsdp_tp"]["local"] == ranks[rank + 4]["hsdp_tp"]["local"]
    assert ranks[0]["hsdp_tp"]["local"] != ranks[1]["hsdp_tp"]["local"]  # tensor-parallel halves differ
    assert ranks[0]["hsdp_tp"]["local"] != ranks[2]["hsdp_tp"]["local"]  # shard halves differ


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_tensor_parallel_without_a_layout_is_refused_at_setup_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["no_plan"]["error"] == "IntentError", r["no_plan"]
        assert r["no_plan"]["text"].startswith("tensor_parallel_size=2 needs a tensor-parallel layout, and NoPlan carries none")
