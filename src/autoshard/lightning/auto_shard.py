"""``Trainer(strategy="auto-shard")``: a registered factory that builds the strategy of the backend the intent needs
(``engine.auto_shard.needed_backend``, the choice Fabric's factory makes too).

Code and configs that want auto-shard with an intent call ``auto_shard(...)`` themselves, with the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from autoshard.adapters.fsdp2 import ParallelizeFn
from autoshard.backends import get_backend
from autoshard.engine.auto_shard import FSDP2, needed_backend
from autoshard.intent import ShardingIntent
from autoshard.lightning.fsdp2 import AutoShardStrategy


def auto_shard(
    intent: ShardingIntent | Mapping[str, Any] | None = None,
    parallelize_fn: ParallelizeFn | None = None,
    process_group_backend: str | None = None,
    timeout: timedelta | None = default_pg_timeout,
    **intent_fields: Any,
) -> Any:
    """The strategy ``"auto-shard"`` means for this intent: ``AutoShardStrategy`` (fsdp2), or the Backend's strategy
    (autoshard's DeepSpeed) when only it can run the intent; that one's refusals name auto-shard as what was asked."""
    wanted, needed = needed_backend(intent, parallelize_fn, **intent_fields)
    if needed == FSDP2:
        return AutoShardStrategy(wanted, parallelize_fn, process_group_backend, timeout)
    chosen = get_backend(needed).strategy_class()(wanted, process_group_backend=process_group_backend, timeout=timeout)
    chosen.requested_as = AutoShardStrategy.strategy_name  # its refusals must not propose the auto-shard the user is on
    return chosen
