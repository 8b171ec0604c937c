"""Every refusal ends with a ``Fix:`` the user has not already applied (single process, no launch).

The bad-input catalog (tests/test_bad_inputs.py) checks each message in context; this file sweeps the refusals that
need no Trainer, so a new error without a fix, or a fix that repeats what the user already did, fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

import autoshard  # noqa: F401  registers the strategies
from autoshard import AutoShardError, EMAPair, MethodNeeds, ShardingIntent, select_backend
from autoshard.adapters.deepspeed import deepspeed_config
from autoshard.adapters.fsdp2 import plan_fsdp2
from autoshard.backends import Availability, get_backend
from autoshard.explain import build_intent
from autoshard.intent import as_intent, normalize_precision
from autoshard.lightning import AutoShardStrategy, FSDP2Strategy
from autoshard.memory import estimate_memory
from autoshard.mesh import ParallelDims
from autoshard.target import load_target

EMA = MethodNeeds(ema_pairs=(EMAPair("teacher", "student"),))
TWO_OPTIMIZERS = MethodNeeds(optimizer_sources=(("configure_optimizers", 2),))
MISSING = Availability(False, "deepspeed is not installed", 'pip install "autoshard[deepspeed]"')

REFUSALS: dict[str, Callable[[], Any]] = {
    "unknown precision": lambda: normalize_precision("bf17"),
    "unknown offload": lambda: ShardingIntent(offload="everything"),
    "offload='cpu' mix-up": lambda: ShardingIntent(offload="cpu"),
    "nvme without offload": lambda: ShardingIntent(offload_device="nvme"),
    "nvme without a path": lambda: ShardingIntent(offload="optimizer", offload_device="nvme"),
    "nvme_path ignored": lambda: ShardingIntent(nvme_path="/nvme"),
    "bad bool": lambda: ShardingIntent(strict="yes"),
    "bad size": lambda: ShardingIntent(data_parallel_size=0),
    "empty shard": lambda: ShardingIntent(shard=[]),
    "shard and exclude": lambda: ShardingIntent(shard=["a"], exclude=["a"]),
    "bad path": lambda: ShardingIntent(exclude=[".a"]),
    "not a list": lambda: ShardingIntent(exclude=3),
    "unknown field": lambda: ShardingIntent.from_dict({"reshard_after_forwad": False}),
    "not a mapping": lambda: ShardingIntent.from_dict(["shard"]),  # type: ignore[arg-type]
    "not an intent": lambda: as_intent("fsdp2"),  # type: ignore[arg-type]
    "mesh mismatch": lambda: ParallelDims.resolve(ShardingIntent(data_parallel_size=3), 2),
    "tp does not divide": lambda: ParallelDims.resolve(ShardingIntent(tensor_parallel_size=4), 6),
    "bad world": lambda: ParallelDims.resolve(ShardingIntent(), 0),
    "bad shard_size": lambda: ShardingIntent(shard_size="rack"),
    "shard_size does not divide": lambda: ParallelDims.resolve(ShardingIntent(shard_size=3), 8),
    "shard_size exceeds the world": lambda: ParallelDims.resolve(ShardingIntent(shard_size=16), 8),
    "tensor parallel on a model without a plan": lambda: plan_fsdp2(nn.Sequential(nn.Linear(4, 4)), ShardingIntent(tensor_parallel_size=2)),
    "hsdp on deepspeed": lambda: select_backend(MethodNeeds(), ShardingIntent(shard_size=2), prefer="deepspeed_zero3"),
    "hsdp in the deepspeed config": lambda: deepspeed_config(ShardingIntent(shard_size="node"), world_size=4, micro_batch_size=1),
    "hsdp in the deepspeed memory model": lambda: estimate_memory(nn.Linear(4, 4), ShardingIntent(shard_size=2), MethodNeeds(), 4, "deepspeed_zero3"),
    "MiCS key in zero_overrides": lambda: deepspeed_config(ShardingIntent(), world_size=2, micro_batch_size=1, zero_overrides={"mics_shard_size": 2}),
    "unknown backend": lambda: get_backend("fsdp3"),
    "EMA on deepspeed": lambda: select_backend(EMA, prefer="deepspeed_zero3"),
    "optimizers on deepspeed": lambda: select_backend(TWO_OPTIMIZERS, prefer="deepspeed_zero3"),
    "keyword beside a conflicting intent": lambda: FSDP2Strategy(intent=ShardingIntent(checkpoint="full"), checkpoint="distributed"),
    "nvme on fsdp2": lambda: select_backend(MethodNeeds(), ShardingIntent(offload="params", offload_device="nvme", nvme_path="/n"), prefer="fsdp2"),
    "nothing fits": lambda: select_backend(EMA, ShardingIntent(offload="params", offload_device="nvme", nvme_path="/n")),
    "deepspeed missing": lambda: select_backend(MethodNeeds(), prefer="deepspeed_zero3", available={"deepspeed_zero3": MISSING}),
    "fsdp1": lambda: select_backend(MethodNeeds(), prefer="fsdp"),
    "strategy keyword typo": lambda: FSDP2Strategy(ofload="params"),
    "explain target without colon": lambda: load_target("train.py"),
    "explain target missing file": lambda: load_target("no/such/file.py:build"),
    "explain target not importable": lambda: load_target("no_such_package_xyz:build"),
    "explain target not callable": lambda: load_target("autoshard:__version__"),
    "explain --intent without =": lambda: build_intent(["offload"]),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_every_refusal_ends_with_a_fix(name: str) -> None:
    with pytest.raises(AutoShardError) as info:
        REFUSALS[name]()
    message = str(info.value)
    assert "Fix: " in message, message
    fix = message.rpartition("Fix: ")[2].strip()
    assert len(fix) > 5, message  # a fix says what to do, not just "Fix:"


def test_a_fix_never_proposes_the_strategy_already_in_use() -> None:
    """auto-shard chose DeepSpeed for the intent; the EMA it meets at setup must not be answered with "auto-shard"."""
    intent = ShardingIntent(offload="optimizer")
    with pytest.raises(AutoShardError) as info:
        select_backend(EMA, intent, prefer="deepspeed_zero3")
    assert "Fix: use strategy='fsdp2' (or strategy='auto-shard')" in str(info.value)  # right for everyone else
    with pytest.raises(AutoShardError) as info:
        select_backend(EMA, intent, prefer="deepspeed_zero3", applied="auto-shard")
    fix = str(info.value).rpartition("Fix: ")[2]
    assert fix == "use strategy='fsdp2'", str(info.value)


def test_strategies_take_intent_fields_as_keywords() -> None:
    assert FSDP2Strategy(offload="params").intent.offload == "params"
    assert FSDP2Strategy({"exclude": ["probe"]}, reshard_after_forward=False).intent == ShardingIntent(
        exclude=("probe",), reshard_after_forward=False
    )
    assert AutoShardStrategy(activation_checkpointing=True).intent.activation_checkpointing is True
    with pytest.raises(AutoShardError) as info:
        FSDP2Strategy(ofload="params")
    assert str(info.value).endswith("Fix: rename 'ofload' to 'offload'")


def test_a_zero_micro_batch_is_refused_not_replaced() -> None:
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    with pytest.raises(AutoShardError) as info:
        AutoShardDeepSpeedStrategy(micro_batch_size=0)
    assert str(info.value) == "micro_batch_size must be a positive integer, got 0. Fix: micro_batch_size=1 or more"
    assert AutoShardDeepSpeedStrategy(micro_batch_size=3).config["train_micro_batch_size_per_gpu"] == 3
