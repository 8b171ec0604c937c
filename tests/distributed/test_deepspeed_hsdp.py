"""Hybrid sharding and BatchNorm under DeepSpeed, for real on 4 CPU processes (gloo); one process set runs all of it.

Hybrid sharding (``shard_size``) is refused on DeepSpeed (matrix cell "no"): MiCS, the DeepSpeed feature that shards
within groups and replicates across them, was removed in DeepSpeed 0.19.7, and ZeRO++ hpZ, what remains, is a
different layout. ``test_hpz_...`` measures that difference, so the cell's reason is checked, not only written.
``Trainer(sync_batchnorm=True)``, which Lightning's DeepSpeedStrategy ignores, is applied by autoshard and checked
against one process on the global batch. The refusal itself needs no process: tests/adapters/test_deepspeed_config.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("deepspeed_hsdp_worker.py")
WORLD = 4
BIG = 256 * 512  # the first Linear's weight in deepspeed_worker.make_model
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install 'autoshard[deepspeed]')"),
]
# 4 processes on 2 cores: imports, two Lightning fits and four raw engines (plus the one-time op build) take minutes.
TIMEOUT = 420


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, [], tmp_path_factory.mktemp("ds_hsdp"), nprocs=WORLD, timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 30)
def test_sync_batchnorm_matches_one_process_on_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    """4 ranks x 8 samples under ZeRO-3 (BatchNorm weight partitioned too) = 1 process x the 32 samples."""
    for rank in ranks:
        run = rank["sync_batchnorm"]
        assert run["engine"] == "DeepSpeedEngine" and run["global_step"] == 3
        assert run["bn_class_in_training"] == ["SyncBatchNorm"] and run["bn_weight_partitioned"]
        assert run["bn_class_after_fit"] == "_BatchNormXd"  # Lightning's revert after fit, as under DDP
        assert run["num_batches_tracked"] == [3, 3]
        assert run["running_max_diff"] < 1e-5, run["running_max_diff"]
        assert run["weights_max_diff"] < 1e-5, run["weights_max_diff"]
    assert all(r["sync_batchnorm"]["running"] == ranks[0]["sync_batchnorm"]["running"] for r in ranks)


@pytest.mark.timeout(TIMEOUT + 30)
def test_without_sync_batchnorm_each_rank_keeps_its_own_statistics(ranks: list[dict[str, Any]]) -> None:
    """The same fit without the flag: what the check above would see if the flag were ignored (as Lightning does)."""
    for rank in ranks:
        run = rank["plain_batchnorm"]
        assert run["bn_class_in_training"] == ["BatchNorm1d"]
        assert run["running_max_diff"] > 1e-2, run["running_max_diff"]
    assert ranks[0]["plain_batchnorm"]["running"] != ranks[1]["plain_batchnorm"]["running"]


@pytest.mark.timeout(TIMEOUT + 30)
def test_hpz_partitions_a_second_parameter_copy_only_not_the_optimizer_state(ranks: list[dict[str, Any]]) -> None:
    """zero_hpz_partition_size=2 on 4 ranks: the parameters' own partition and the optimizer state stay 1/4 (every
    rank); only the copy gathered in backward is 1/2 (the group). Hybrid sharding would hold all of them at 1/2."""
    for rank in ranks:
        plain, hpz = rank["hpz"]["plain"], rank["hpz"]["hpz"]
        assert hpz["config_zero"]["zero_hpz_partition_size"] == 2 and "zero_hpz_partition_size" not in plain["config_zero"]
        assert hpz["full"]["0.weight"] == BIG
        for run in (plain, hpz):
            assert run["primary"] == {n: -(-full // WORLD) for n, full in run["full"].items()}, run["primary"]
            assert run["optimizer_partition"] == sum(run["primary"].values())
            assert run["optimizer_group_size"] == WORLD
            assert run["global_steps"] == 10
        assert all(size is None for size in plain["secondary_after_forward"].values())
        # The copy is 1/2 of the tensor padded to a multiple of the world size, as the primary partition is padded.
        assert hpz["secondary_after_forward"] == {n: -(-full // WORLD) * WORLD // 2 for n, full in hpz["full"].items()}
        assert hpz["secondary_after_forward"]["0.weight"] == BIG // 2
        assert rank["hpz"]["min_change_from_initial"] > 1e-3  # both trained
        assert rank["hpz"]["max_diff_hpz_vs_plain"] < 1e-6, rank["hpz"]["max_diff_hpz_vs_plain"]  # same numbers


@pytest.mark.timeout(TIMEOUT + 30)
def test_mics_is_gone_from_the_installed_deepspeed() -> None:
    """The cell says DeepSpeed removed MiCS; if an installed DeepSpeed accepts mics_shard_size again, revisit it."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    with pytest.raises(DeepSpeedConfigError, match="MiCS ZeRO-3 sharding has been removed"):
        DeepSpeedConfig(config)
    assert importlib.util.find_spec("deepspeed.runtime.zero.mics") is None
