"""DeepSpeed ZeRO-3 for real on 2 CPU processes (gloo): a raw engine from our config, then Lightning's Trainer.

Two process pairs in all (imports and DeepSpeed's one-time shared-memory op build dominate): one runs the raw
engines, one runs every Lightning scenario; and one process measures what ZeRO-3 keeps gathered into the backward. Each pair has a hard timeout, and every process group a timeout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("deepspeed_worker.py")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install 'autoshard[deepspeed]')"),
]
# The first DeepSpeed CPU run compiles a shared-memory comm op (about 60 s on 2 cores), cached afterwards.
PAIR_TIMEOUT = 240


@pytest.fixture(scope="module")
def engine_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, ["engine"], tmp_path_factory.mktemp("ds_engine"), nprocs=2, timeout=PAIR_TIMEOUT)


@pytest.fixture(scope="module")
def lightning_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, ["lightning"], tmp_path_factory.mktemp("ds_lightning"), nprocs=2, timeout=PAIR_TIMEOUT)


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_raw_engine_partitions_every_parameter_in_half(engine_ranks: list[dict[str, Any]]) -> None:
    for rank in engine_ranks:
        for run in ("bf16-mixed", "32-true"):
            partition = rank[run]["partition"]
            big = partition["0.weight"]  # 131072 elements, above the persistence threshold
            assert big["local"] * 2 == big["full"] == 256 * 512, big
            for name, p in partition.items():  # every tensor: ceil(full / 2) elements per rank, nothing whole
                assert p["local"] == -(-p["full"] // 2), (name, p)
            assert rank[run]["gathered_equals_initial"], run  # gathering the halves gives back the full tensors


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_raw_engine_trains_bf16_adamw(engine_ranks: list[dict[str, Any]]) -> None:
    for rank in engine_ranks:
        run = rank["bf16-mixed"]
        assert run["config"]["bf16"] == {"enabled": True} and run["param_dtype"] == "torch.bfloat16"
        assert run["global_steps"] == 10  # 20 micro-batches, accumulated by 2
        assert run["finite"]
        assert all(change > 0 for change in run["max_change"].values()), run["max_change"]
        assert run["eval_loss_after"] < 0.7 * run["eval_loss_before"], (run["eval_loss_before"], run["eval_loss_after"])


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_raw_engine_fp32_equals_single_process_training(engine_ranks: list[dict[str, Any]]) -> None:
    """The sharper check: 2 ranks x 2 accumulated micro-batches of ZeRO-3 = plain torch on the union of the data."""
    run = engine_ranks[0]["32-true"]
    assert "bf16" not in run["config"] and "fp16" not in run["config"]
    assert run["config"]["gradient_clipping"] == 0.0  # absent, DeepSpeed would clip at 1.0 and this would fail
    assert min(run["max_change"].values()) > 1e-3
    assert run["max_diff_vs_single_process"] < 1e-6, run["max_diff_vs_single_process"]


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_lightning_trainer_trains_with_automatic_and_manual_optimization(lightning_ranks: list[dict[str, Any]]) -> None:
    for rank in lightning_ranks:
        for mode, accumulate in (("automatic", 2), ("manual", 1)):
            run = rank[mode]
            assert run["engine"] == "DeepSpeedEngine" and run["config"]["zero_optimization"]["stage"] == 3
            assert (run["root_device"], run["process_group_backend"]) == ("cpu:0", "gloo")
            assert run["config"]["train_micro_batch_size_per_gpu"] == 8  # Lightning's guess from the DataLoader
            assert run["config"]["gradient_accumulation_steps"] == accumulate
            assert run["config"]["train_batch_size"] == 8 * accumulate * 2
            assert run["global_step"] == run["engine_global_steps"] == 3, mode
            assert run["finite"] and len(run["losses"]) == 3 * accumulate, mode
            assert all(change > 0 for change in run["max_change"].values()), (mode, run["max_change"])
            big = run["partition"]["net.0.weight"]
            assert big["local"] * 2 == big["full"], big
        assert rank["automatic"]["config"]["gradient_clipping"] == 1.0  # Trainer(gradient_clip_val=1.0) reached DeepSpeed
        # manual states no precision: the Trainer's 32-true wins over the intent's bf16-mixed default
        assert "bf16" not in rank["manual"]["config"] and "fp16" not in rank["manual"]["config"]


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_lightning_training_equals_single_process(lightning_ranks: list[dict[str, Any]]) -> None:
    """Not only "the weights moved": the Trainer's steps (accumulation and clipping included) are the right ones."""
    for mode in ("automatic", "manual"):
        assert lightning_ranks[0][mode]["max_diff_vs_single_process"] < 1e-6, mode


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_probe_optimizer_built_in_setup_is_refused_on_both_ranks(lightning_ranks: list[dict[str, Any]]) -> None:
    for rank in lightning_ranks:
        refusal = rank["probe_refused_at_setup"]
        assert refusal["probe_optimizer_built"]  # the probe's own setup() ran: only strategy.setup could see it
        assert refusal["error"] == "IncompatibleBackendError"
        assert refusal["model_type_at_refusal"] != "DeepSpeedEngine"
        text = refusal["message"]
        assert "multiple optimizers" in text and "callback OnlineProbe" in text, text
        assert "Backend that works: fsdp2" in text and "Fix: use strategy='fsdp2'" in text, text


@pytest.fixture(scope="module")
def reuse_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (rank,) = run_workers(WORKER, ["reuse"], tmp_path_factory.mktemp("ds_reuse"), nprocs=1, timeout=PAIR_TIMEOUT)
    return rank


@pytest.fixture(scope="module")
def reuse_runs(reuse_rank: dict[str, Any]) -> list[dict[str, Any]]:
    return reuse_rank["runs"]


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_the_estimate_counts_the_reduce_bucket_in_the_dtype_deepspeed_allocates_it(reuse_rank: dict[str, Any]) -> None:
    """ZeRO-3 allocates its gradient reduce bucket whole, in the reduction's dtype: fp32 under bf16-mixed (each bf16
    gradient cast into it), bf16 with reduce_dtype='bfloat16'. The estimate counted it in the gather dtype, half of
    the real bucket under bf16-mixed (381 MiB short at the default 2e8 elements)."""
    from autoshard.intent import ShardingIntent
    from autoshard.memory import EstimateOptions, estimate_memory
    from tests.distributed.deepspeed_worker import BUCKET, make_blocks

    def gathered(intent: ShardingIntent, **zero: Any) -> int:
        options = EstimateOptions(zero_overrides={"reduce_bucket_size": BUCKET, **zero})
        return estimate_memory(make_blocks(), intent, world_size=1, backend="deepspeed", options=options).gathered_block

    measured = {(b["precision"], b["reduce_dtype"]): b["bytes"] for b in reuse_rank["buckets"]}
    assert measured == {("bf16-mixed", None): 4 * BUCKET, ("bf16-mixed", "bfloat16"): 2 * BUCKET, ("32-true", None): 4 * BUCKET}
    for (precision, reduce_dtype), held in measured.items():
        intent = ShardingIntent(precision=precision, reduce_dtype=reduce_dtype)
        assert gathered(intent) - gathered(intent, contiguous_gradients=False) == held, (precision, reduce_dtype)


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_the_estimate_counts_what_zero3_keeps_gathered_from_forward_into_backward(reuse_runs: list[dict[str, Any]]) -> None:
    """The trailing layers whose next use is within stage3_max_reuse_distance stay gathered when the backward starts
    (measured on a real engine, one process: the rule reads the trace, not the ranks); the estimate's gathered row,
    given the zero_overrides the engine's config was built with, adds exactly their bytes, with and without blocks
    recomputed in the backward."""
    from autoshard.intent import ShardingIntent
    from autoshard.memory import EstimateOptions, estimate_memory
    from tests.distributed.deepspeed_worker import make_blocks

    def gathered_row(reuse: int | None, checkpointing: bool | int) -> int:
        options = EstimateOptions(zero_overrides={} if reuse is None else {"stage3_max_reuse_distance": reuse})
        intent = ShardingIntent(activation_checkpointing=checkpointing)
        return estimate_memory(make_blocks(), intent, world_size=1, backend="deepspeed", options=options).gathered_block

    kept_layers = []
    for run in reuse_runs:
        estimated = gathered_row(run["reuse"], run["checkpointing"]) - gathered_row(0, run["checkpointing"])
        assert run["held"][0] == run["held"][1] == estimated, run
        kept_layers.append(len(run["names"][0]))
    # Without recomputation a layer's next use is 2x the layers after it away: 6 layers keep 4 (the head, block 2, the
    # second layer of block 1). With blocks 0 and 2 recomputed (each forwarded again after its last layer's backward),
    # block 1's second layer is 8 away (3 after it, then the head, block 2's last layer, block 2 again, its first
    # layer): out of reach of 6, within 10.
    assert kept_layers == [0, 4, 3, 5, 7, 7]
