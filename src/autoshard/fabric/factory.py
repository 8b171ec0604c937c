"""``Fabric(strategy="auto-shard")``: a registered factory that builds the Fabric strategy of the backend the intent
needs, as ``autoshard.lightning.auto_shard`` does for the Trainer (the same choice: ``engine.auto_shard.needed_backend``).

Code that wants auto-shard with an intent calls ``auto_shard(...)`` itself, with the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from autoshard.adapters.fsdp2 import ParallelizeFn
from autoshard.engine.auto_shard import needed_backend
from autoshard.fabric.deepspeed import BACKEND as DEEPSPEED
from autoshard.fabric.deepspeed import AutoShardDeepSpeedStrategy
from autoshard.fabric.strategies import AutoShardStrategy
from autoshard.intent import ShardingIntent


def auto_shard(
    intent: ShardingIntent | Mapping[str, Any] | None = None,
    parallelize_fn: ParallelizeFn | None = None,
    process_group_backend: str | None = None,
    timeout: timedelta | None = default_pg_timeout,
    **intent_fields: Any,
) -> AutoShardStrategy | AutoShardDeepSpeedStrategy:
    """The Fabric strategy ``"auto-shard"`` means for this intent; a DeepSpeed one's refusals name auto-shard."""
    wanted, needed = needed_backend(intent, parallelize_fn, **intent_fields)
    if needed != DEEPSPEED:
        return AutoShardStrategy(wanted, parallelize_fn, process_group_backend, timeout)  # refuses any other backend
    chosen = AutoShardDeepSpeedStrategy(wanted, process_group_backend=process_group_backend, timeout=timeout)
    chosen.requested_as = AutoShardStrategy.strategy_name  # its refusals must not propose the auto-shard the user is on
    return chosen
