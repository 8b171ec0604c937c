"""Ranks must never silently hold different models: what every rank holds after setup, during and after training,
in checkpoints, under sync_batchnorm and after meta-device init, compared rank by rank on 2 real gloo processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import ROOT, free_port, run_workers

WORKER = Path(__file__).with_name("sync_worker.py")
BROADCAST = ("broadcast_plan", "broadcast_parallelize_fn", "broadcast_configure_model")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One process pair runs every scenario (imports dominate the cost of a 2-process run)."""
    return run_workers(WORKER, [], tmp_path_factory.mktemp("sync"), nprocs=2, timeout=300)


def differing(a: dict[str, list[float]], b: dict[str, list[float]]) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if a[n] != b[n]]


@pytest.mark.distributed
@pytest.mark.timeout(330)
@pytest.mark.parametrize("scenario", BROADCAST)
def test_every_rank_starts_from_rank_0s_unsharded_tensors(ranks: list[dict[str, Any]], scenario: str) -> None:
    """Ranks seeded differently: root, tied, 0-dim and excluded parameters and every buffer must still agree, on the
    generic plan, a parallelize_fn and a configure_model that sharded; an EMA teacher still equals its student."""
    r0, r1 = ranks[0][scenario], ranks[1][scenario]
    assert r0["sharded"] and r0["sharded"] == r1["sharded"]
    names = set(r0["at_setup"])
    assert {"scale", "embed.weight", "student.gain", "teacher.gain", "probe.weight", "noise", "student.bn.running_mean"} <= names
    assert differing(r0["at_setup"], r1["at_setup"]) == []
    assert differing(r0["after_fit"], r1["after_fit"]) == []
    assert r0["teacher_equals_student"] and r1["teacher_equals_student"]


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_buffers_are_rank_0s_at_every_step_in_validation_checkpoints_and_after_fit(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0]["buffers"], ranks[1]["buffers"]
    assert len(r0["train_step_start"]) == 4 and r0["validation"]
    for key in ("train_step_start", "validation", "after_save", "final", "final_var"):
        assert r0[key] == r1[key], key
    assert r0["in_checkpoint"] == r0["after_save"]  # a distributed checkpoint keeps one copy: it must be rank 0's
    mean, var = r0["rank0_reference"]  # DDP's rule: the statistics of rank 0's batches alone
    assert torch.allclose(torch.tensor(r0["final"]), torch.tensor(mean), atol=1e-6)
    assert torch.allclose(torch.tensor(r0["final_var"]), torch.tensor(var), atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_plan_lists_buffers_and_their_rule(ranks: list[dict[str, Any]]) -> None:
    plain = ranks[0]["buffers"]["plan_buffers"]
    assert plain["names"] == ["net.0.running_mean", "net.0.running_var", "net.0.num_batches_tracked"]
    assert plain["count"] == 3 and plain["bytes"] == 8 * 4 * 2 + 8
    assert plain["rule"].startswith("rank 0's copy is broadcast") and "sync_batchnorm" not in plain["rule"]
    synced = ranks[0]["sync_batchnorm"]
    assert "global batch (sync_batchnorm=True)" in synced["plan_buffers"]["rule"]
    assert "buffers (3, 0.00 MiB, not sharded): rank 0's copy" in synced["plan_text"]


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_sync_batchnorm_matches_one_process_on_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    """Each rank sees 8 different samples; statistics and weights must be those of BatchNorm over all 16."""
    for rank in ranks:
        result = rank["sync_batchnorm"]
        assert result["bn_class"].endswith("SyncBatchNorm")
        assert result["num_batches_tracked"] == [4, 4]
        assert result["running_max_diff"] < 1e-5, result["running_max_diff"]
        assert result["weights_max_diff"] < 1e-5, result["weights_max_diff"]
    assert ranks[0]["sync_batchnorm"]["running"] == ranks[1]["sync_batchnorm"]["running"]


def check_meta_init(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["local_rows"] == [16, 64]
        assert not rank["weight_halves_equal"] and not rank["bias_halves_equal"]  # each shard got its own values
        expected_std = rank["bound"] / 3**0.5  # U(-b, b); 1024 draws per half: within 10%
        assert all(abs(s - expected_std) < 0.1 * expected_std for s in rank["weight_std"]), rank["weight_std"]
        assert rank["weight_max_abs"] <= rank["bound"]
    assert ranks[0]["rng_after_setup"] == ranks[1]["rng_after_setup"]


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_meta_init_gives_each_shard_its_own_values_on_cpu(ranks: list[dict[str, Any]]) -> None:
    check_meta_init([r["meta_init"] for r in ranks])
    assert all(r["meta_init"]["tracker_left"] is None for r in ranks)  # the CPU tracker is gone after setup


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_meta_init_gives_each_shard_its_own_values_on_cuda(tmp_path: Path) -> None:
    """torch's own CUDA tracker must keep doing this (autoshard's CPU one stays out): not run here, needs 2 GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (one nccl rank each)")
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(WORKER), "--cuda", "--out", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    import json

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    check_meta_init(ranks)
    assert all(r["tracker_left"] == "OffsetBasedRNGTracker" for r in ranks)


def test_tensor_parallel_builds_a_trainer_with_or_without_a_parallelize_fn() -> None:
    """The layout comes from the model's own plan (found at setup) or a parallelize_fn: neither is needed to build."""
    import lightning.pytorch as pl

    from autoshard.lightning import FSDP2Strategy

    def layout(module: object, mesh: object) -> None:
        return None

    for fn in (None, layout):
        trainer = pl.Trainer(
            strategy=FSDP2Strategy(intent={"tensor_parallel_size": 2}, parallelize_fn=fn), accelerator="cpu", devices=2, logger=False
        )
        strategy = trainer.strategy
        assert isinstance(strategy, FSDP2Strategy) and strategy.parallelize_fn is fn
        mesh = strategy.describe_mesh()
        assert (mesh["data_parallel_size"], mesh["tensor_parallel_size"], mesh["world_size"]) == (1, 2, 2)  # all of it tensor parallel
