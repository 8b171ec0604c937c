"""ShardingIntent -> DeepSpeed ZeRO-3 config: what a user asks for is what DeepSpeed gets, and contradictions stop early."""

from __future__ import annotations

import importlib.util

import pytest

from autoshard.adapters.deepspeed import deepspeed_config, validate_deepspeed_config
from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.needs import EMAPair, MethodNeeds
from autoshard.precision import resolve_precision

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def make(intent: ShardingIntent | None = None, **kwargs: object) -> dict:
    kwargs.setdefault("world_size", 2)
    kwargs.setdefault("micro_batch_size", 4)
    return deepspeed_config(intent or ShardingIntent(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "bf16", "fp16", "reduce"),
    [
        ("bf16-mixed", True, False, "fp32"),
        ("bf16-true", True, False, "bf16"),
        ("16-mixed", False, True, "fp32"),
        ("16-true", False, True, "fp16"),
        ("32-true", False, False, "fp32"),
    ],
)
def test_precision_block_follows_the_intent(precision: str, bf16: bool, fp16: bool, reduce: str) -> None:
    config = make(ShardingIntent(precision=precision))
    assert config.get("bf16", {}).get("enabled", False) is bf16
    assert config.get("fp16", {}).get("enabled", False) is fp16
    if fp16:
        assert config["fp16"]["loss_scale"] == 0  # 0 = dynamic loss scaling: fp16 without it underflows
    # "-mixed" reduces in fp32 on every backend (DeepSpeed's own default would be the low dtype)
    assert config["communication_data_type"] == reduce
    assert config["zero_optimization"]["stage"] == 3


def test_the_runs_precision_plan_wins_over_the_intents_default() -> None:
    """A strategy passes the plan resolved with the Trainer's precision: the config follows it, not bf16-mixed."""
    intent = ShardingIntent(param_dtype="float32")
    config = make(intent, precision=resolve_precision("32-true", intent))
    assert "bf16" not in config and config["communication_data_type"] == "fp32"
    with pytest.raises(IntentError, match=r"param_dtype='float32' contradicts precision='bf16-mixed'.*Fix:"):
        make(intent)  # no Trainer: the intent's precision, bf16-mixed


def test_unstated_precision_plans_for_bf16_mixed() -> None:
    assert make()["bf16"] == {"enabled": True}


@pytest.mark.parametrize(("world", "micro", "accumulate"), [(1, 1, 1), (2, 4, 1), (8, 3, 5)])
def test_batch_keys_are_consistent(world: int, micro: int, accumulate: int) -> None:
    config = make(world_size=world, micro_batch_size=micro, accumulate_grad_batches=accumulate)
    assert config["train_micro_batch_size_per_gpu"] == micro
    assert config["gradient_accumulation_steps"] == accumulate
    assert config["train_batch_size"] == micro * accumulate * world


def test_gradient_clipping_is_always_written() -> None:
    # DeepSpeed clips at norm 1.0 when the key is absent; a Trainer without gradient_clip_val must not be clipped.
    assert make()["gradient_clipping"] == 0.0
    assert make(gradient_clip_val=0.5)["gradient_clipping"] == 0.5


def test_offload_none_optimizer_params() -> None:
    none = make()["zero_optimization"]
    assert "offload_optimizer" not in none and "offload_param" not in none
    optimizer = make(ShardingIntent(offload="optimizer"))
    assert optimizer["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in optimizer["zero_optimization"]
    assert optimizer["zero_force_ds_cpu_optimizer"] is False  # a torch optimizer still works with offload
    params = make(ShardingIntent(offload="params"))["zero_optimization"]
    assert params["offload_param"]["device"] == "cpu" and params["offload_optimizer"]["device"] == "cpu"


def test_nvme_offload_carries_the_path_and_aio() -> None:
    config = make(ShardingIntent(offload="params", offload_device="nvme", nvme_path="/local_nvme/run1"))
    zero = config["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == "/local_nvme/run1"
    assert "aio" in config


def test_checkpoint_activation_checkpointing_reduce_dtype() -> None:
    default = make()
    assert default["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert "activation_checkpointing" not in default and default["communication_data_type"] == "fp32"
    config = make(ShardingIntent(checkpoint="full", activation_checkpointing=True, reduce_dtype="bfloat16"))
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    # autoshard checkpoints the blocks itself (adapters.checkpointing), not through deepspeed.checkpointing's block
    assert "activation_checkpointing" not in config
    assert config["communication_data_type"] == "bf16"


def test_zero_overrides_replace_single_keys_and_are_validated() -> None:
    zero = make(zero_overrides={"stage3_param_persistence_threshold": 0})["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 0 and zero["reduce_bucket_size"] == 200_000_000
    with pytest.raises(IntentError, match=r"zero_optimization.reduce_bucket_size.*Fix:"):
        make(zero_overrides={"reduce_bucket_size": -1})


def test_tensor_parallel_is_refused_with_the_backend_that_works() -> None:
    with pytest.raises(IncompatibleBackendError) as err:
        make(ShardingIntent(tensor_parallel_size=2))
    text = str(err.value)
    assert "tensor parallel" in text and "tensor_parallel_size=2" in text
    assert "Backend that works: fsdp2" in text and "Fix: use strategy='fsdp2'" in text


def test_method_needs_are_refused_from_the_matrix() -> None:
    needs = MethodNeeds(ema_pairs=(EMAPair("teacher", "student"),))
    with pytest.raises(IncompatibleBackendError, match=r"(?s)EMA teacher/student.*teacher 'teacher' follows student 'student'.*fsdp2"):
        make(needs=needs)


def test_data_parallel_size_must_be_the_world_size() -> None:
    with pytest.raises(IntentError, match="data_parallel_size"):
        make(ShardingIntent(data_parallel_size=4), world_size=2)


def test_param_dtype_contradicting_precision_is_refused() -> None:
    assert make(ShardingIntent(precision="bf16-mixed", param_dtype="bfloat16"))["bf16"]["enabled"]
    with pytest.raises(IntentError, match=r"param_dtype='float16' contradicts precision='bf16-mixed'.*Fix:"):
        make(ShardingIntent(precision="bf16-mixed", param_dtype="float16"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(fp16={"enabled": True}), r"'bf16.enabled / fp16.enabled': both are true.*Fix: keep one"),
        (lambda c: c.update(train_batch_size=9), r"'train_batch_size': is 9 .*4 \* 1 \* 2 = 8.*Fix:"),
        (lambda c: c["zero_optimization"].update(stage=2), r"'zero_optimization.stage': is 2.*Fix: set zero_optimization.stage=3"),
        (
            lambda c: c["zero_optimization"].update(offload_param={"device": "nvme"}),
            r"'zero_optimization.offload_param.nvme_path': missing.*Fix: set ShardingIntent\(nvme_path=",
        ),
        (lambda c: c.update(gradient_clipping=-1), r"'gradient_clipping'.*Fix:"),
    ],
)
def test_validator_names_the_key_and_the_fix(change: object, message: str) -> None:
    config = make()
    change(config)  # type: ignore[operator]
    with pytest.raises(IntentError, match=message):
        validate_deepspeed_config(config, world_size=2)


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install 'autoshard[deepspeed]')")
@pytest.mark.parametrize(
    "intent",
    [
        ShardingIntent(),
        ShardingIntent(precision="16-mixed", activation_checkpointing=True, checkpoint="full", reduce_dtype="float32"),
        ShardingIntent(precision="32-true", offload="params"),
        ShardingIntent(offload="optimizer", offload_device="nvme", nvme_path="/local_nvme"),
    ],
    ids=["default", "fp16-ckpt", "fp32-offload", "nvme"],
)
def test_deepspeed_itself_accepts_every_generated_config(intent: ShardingIntent) -> None:
    """DeepSpeed's own parser forbids unknown keys and checks the batch arithmetic; world size 1 without a group."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(make(intent, world_size=1, micro_batch_size=4, accumulate_grad_batches=2, gradient_clip_val=1.0))
    assert parsed.zero_optimization_stage == 3
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps, parsed.gradient_clipping) == (8, 2, 1.0)
    precision = resolve_precision(None, intent).precision
    assert parsed.bfloat16_config.enabled is precision.startswith("bf16")
    assert parsed.float16_config.enabled is precision.startswith("16")
    if intent.offload != "none":
        assert parsed.zero_config.offload_optimizer.device == intent.offload_device
    assert parsed.zero_config.gather_16bit_weights_on_model_save is (intent.checkpoint == "full")


@pytest.mark.parametrize("shard_size", [2, "node"])
def test_shard_size_is_refused_with_what_deepspeed_has_instead(shard_size: object) -> None:
    """No DeepSpeed config is hybrid sharding: MiCS is gone (0.19.7), hpZ shards a parameter copy only. The numbers
    behind the reason: tests/distributed/test_deepspeed_hsdp.py."""
    with pytest.raises(IncompatibleBackendError) as err:
        make(ShardingIntent(shard_size=shard_size), world_size=4)  # type: ignore[arg-type]
    text = str(err.value)
    assert f"hybrid sharding (HSDP) [shard_size={shard_size!r}]" in text, text
    assert "MiCS (mics_shard_size" in text and "DeepSpeed 0.19.7 removed" in text, text
    assert "ZeRO++ hpZ (zero_hpz_partition_size), is not hybrid sharding" in text, text
    assert "the gradients and the optimizer states stay sharded over every rank" in text, text
    assert "Backend that works: fsdp2 (strategy='fsdp2')" in text, text
    assert text.endswith("or drop shard_size to shard over every rank under ZeRO-3"), text


@pytest.mark.parametrize("key", ["mics_shard_size", "mics_hierarchical_params_gather"])
def test_mics_keys_in_zero_overrides_are_refused_before_any_process(key: str) -> None:
    with pytest.raises(IntentError) as err:
        make(zero_overrides={key: 2})
    text = str(err.value)
    assert text.startswith(f"DeepSpeed config key 'zero_optimization.{key}': is MiCS, which DeepSpeed removed in 0.19.7"), text
    assert text.endswith("Fix: remove it; for hybrid sharding use ShardingIntent(shard_size=N) with strategy='fsdp2'"), text


def test_hpz_through_zero_overrides_is_passed_as_asked() -> None:
    """hpZ is DeepSpeed's own knob, not hybrid sharding: written as given (trained for real on 4 ranks in
    tests/distributed/test_deepspeed_hsdp.py); autoshard's memory estimate does not count its parameter copy."""
    assert make(zero_overrides={"zero_hpz_partition_size": 2}, world_size=4)["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_the_memory_model_refuses_shard_size_as_the_matrix_does() -> None:
    torch = pytest.importorskip("torch")
    from autoshard.memory import estimate_memory
    from autoshard.needs import MethodNeeds

    model = torch.nn.Linear(64, 64)
    needs, optimizers = MethodNeeds(), [torch.optim.AdamW(model.parameters())]
    with pytest.raises(IncompatibleBackendError) as err:
        estimate_memory(model, ShardingIntent(shard_size=2), needs, 4, "deepspeed_zero3", optimizers=optimizers)
    text = str(err.value)
    assert text.startswith("no deepspeed_zero3 memory estimate for shard_size=2 on 4 ranks: shard_size means"), text
    assert "Fix: use strategy='fsdp2'" in text, text
    # shard_size = the whole world is one replica, pure ZeRO-3: estimated as such
    whole = estimate_memory(model, ShardingIntent(shard_size=4), needs, 4, "deepspeed_zero3", optimizers=optimizers)
    assert whole.device == estimate_memory(model, None, needs, 4, "deepspeed_zero3", optimizers=optimizers).device


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install 'autoshard[deepspeed]')")
def test_a_hand_tuned_zero3_config_is_reachable_from_the_intent() -> None:
    """The GPU benchmark's hand-tuned ZeRO-3 config (benchmarks/gpu_worker.py), written through autoshard as its
    ``deepspeed-matched`` row writes it: DeepSpeed's own parser reads the same ZeRO config and the same gradient
    reduction dtype from both, so what separates those two rows' step times is autoshard's, not the config's."""
    import argparse
    import sys
    from pathlib import Path

    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from gpu_worker import matched_deepspeed_arguments, tuned_deepspeed_config
    finally:
        sys.path.pop(0)
    tuned = tuned_deepspeed_config(argparse.Namespace())
    arguments = matched_deepspeed_arguments(argparse.Namespace())
    ours = make(ShardingIntent(reduce_dtype=arguments["reduce_dtype"]), world_size=1, zero_overrides=arguments["zero_overrides"])
    ours["gradient_clipping"] = 0.0
    theirs = DeepSpeedConfig({**tuned, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1})
    parsed = DeepSpeedConfig(ours)
    assert parsed.zero_config == theirs.zero_config
    assert parsed.bfloat16_config.enabled and theirs.bfloat16_config.enabled
    # DeepSpeed reduces in the model's dtype when the key is absent (engine.communication_data_type): bf16 here
    assert theirs.communication_data_type is None and parsed.communication_data_type == torch.bfloat16
    # ... and autoshard's default bf16-mixed reduces in fp32 (as under FSDP2): the row without reduce_dtype differs there
    assert DeepSpeedConfig(make(world_size=1)).communication_data_type == torch.float32


def test_the_config_printed_in_docs_is_the_one_generated() -> None:
    """docs/deepspeed.md, "The generated config": the JSON it prints "as is" is what deepspeed_config writes for the
    case it names, key for key."""
    import json
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed.md").read_text()
    printed = json.loads(re.search(r"## The generated config.*?```json\n(.*?)```", page, flags=re.S).group(1))
    intent = ShardingIntent(offload="optimizer", checkpoint="full")
    generated = make(intent, precision=resolve_precision("bf16-mixed", intent), world_size=8, accumulate_grad_batches=2, gradient_clip_val=1.0)
    assert printed == generated
