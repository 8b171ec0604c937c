"""Hybrid sharding (HSDP) on 4 real gloo processes: ``FSDP2Strategy(shard_size=2)`` shards within pairs of ranks,
replicates across the pairs, trains, keeps the replicas identical and matches pure FSDP on the same 4 ranks. Its DCP
checkpoints resume under another shard size (HSDP -> FSDP -> HSDP on 4 ranks) and another world size (HSDP on 4 ->
FSDP on 2) with weights and AdamW state exactly as saved, and training goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("hsdp_worker.py")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hsdp")


@pytest.fixture(scope="module")
def ranks(work: Path) -> list[dict[str, Any]]:
    """One 4-process run holds every 4-rank scenario (imports dominate the cost)."""
    return run_workers(WORKER, ["--scenarios", "hsdp,fsdp,resume_across_shard_sizes"], work, nprocs=4, timeout=300)


@pytest.fixture(scope="module")
def two_ranks(work: Path, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """2 processes, in a directory inside the 4-rank run's: they resume its HSDP checkpoint."""
    return run_workers(WORKER, ["--scenarios", "resume_on_2_ranks"], work / "two_ranks", nprocs=2, timeout=200)


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


def assert_resumed_exactly(report: dict[str, Any], hsdp: list[int] | None) -> None:
    loaded = report["loaded_equals_saved"]
    assert loaded["equal"], loaded  # every weight (student, EMA teacher, root scale), AdamW state, step counter
    assert report["optimizer_entries"] == 2 * 5  # exp_avg, exp_avg_sq of the 5 trainable parameters
    assert loaded["compared"] > 25, loaded
    assert report["hsdp"] == hsdp
    assert report["steps"][1] > report["steps"][0]  # it trained on
    assert {"param/scale", "param/student.0.weight", "param/teacher.0.weight"} <= set(report["trained"])
    assert report["losses"] and all(loss == loss and loss < 10 for loss in report["losses"])


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_hsdp_checkpoint_resumes_under_pure_fsdp_and_back(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        resume = r["resume_across_shard_sizes"]
        assert resume["saved_hsdp"] == [2, 2]
        assert_resumed_exactly(resume["hsdp_to_fsdp"], None)
        assert_resumed_exactly(resume["fsdp_to_hsdp"], [2, 2])
        assert resume["hsdp_to_fsdp"]["warnings"] == [] and resume["fsdp_to_hsdp"]["warnings"] == []
        assert resume["hsdp_to_fsdp"]["steps"] == [4, 8] and resume["fsdp_to_hsdp"]["steps"] == [8, 12]
    # autoshard's DCP directory, as for pure FSDP: one file per rank, DCP's metadata, Lightning's meta.pt, the manifest.
    layout = [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "autoshard-manifest.json", "meta.pt"]
    assert ranks[0]["resume_across_shard_sizes"]["layout"] == layout


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_hsdp_checkpoint_on_4_ranks_resumes_under_fsdp_on_2(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        assert_resumed_exactly(r["resume_on_2_ranks"], None)
        assert r["resume_on_2_ranks"]["steps"] == [4, 7]
    warnings = two_ranks[0]["resume_on_2_ranks"]["warnings"]  # rank 0 warns
    assert any("saved at world size 4, resumed at 2" in w and "per-rank RNG states cannot be mapped" in w for w in warnings), warnings
