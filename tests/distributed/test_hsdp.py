"""Hybrid sharding (HSDP) on 4 real gloo processes: ``FSDP2Strategy(shard_size=2)`` shards within pairs of ranks,
replicates across the pairs, trains, keeps the replicas identical and matches pure FSDP on the same 4 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("hsdp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 4-process run holds both scenarios (imports dominate the cost)."""
    return run_workers(WORKER, [], tmp_path_factory.mktemp("hsdp"), nprocs=4, timeout=300)


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_parameters_are_replicated_across_pairs_and_sharded_within(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        h = r["hsdp"]
        assert h["hsdp"] == [2, 2] and h["mesh_shape"] == [2, 2] and h["mesh_dims"] == ["dp_replicate", "dp_shard"]
        assert h["coordinate"] == [r["hsdp"]["rank"] // 2, r["hsdp"]["rank"] % 2]  # shard groups: ranks {0,1}, {2,3}
        assert set(h["sharded"]) == {f"{m}.{i}.{k}" for m in ("student", "teacher") for i in (0, 2) for k in ("weight", "bias")}
        assert h["hsdp_placements"] and h["same_mesh"], h["placements"]  # teachers on the students' mesh, alike
        assert all(local * 2 == rows for local, rows in h["rows"].values()), h["rows"]
        assert "scale" not in h["sharded"]


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_it_trains_and_the_replicas_stay_identical(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        h = r["hsdp"]
        assert all(h["changed"][n] for n in h["full"] if not n.startswith("teacher")) and h["changed"]["teacher.0.weight"]
        assert len(h["losses"]) == 8 and h["losses"][-1] < h["losses"][0]
    by_rank = [r["hsdp"] for r in ranks]
    assert by_rank[0]["local"] == by_rank[2]["local"] and by_rank[1]["local"] == by_rank[3]["local"]  # replicas
    assert by_rank[0]["local"] != by_rank[1]["local"]  # the two halves of a shard group differ
    for h in by_rank[1:]:
        assert h["full"] == by_rank[0]["full"]  # includes 'scale': averaged over all 4 ranks, not one shard group


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_hsdp_matches_pure_fsdp_on_the_same_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["fsdp"]["hsdp"] is None and r["fsdp"]["mesh_shape"] == [4]
        assert r["fsdp"]["losses"] == pytest.approx(r["hsdp"]["losses"], abs=1e-5)
        for name, values in r["fsdp"]["full"].items():
            torch.testing.assert_close(torch.tensor(r["hsdp"]["full"][name]), torch.tensor(values), rtol=0, atol=1e-5)
