"""``Trainer(strategy="auto-shard")``: a registered factory that builds the strategy of the backend the intent needs.

Lightning's StrategyRegistry stores a callable and calls it with the registered init params when the Trainer is
built, before the LightningModule is known: so the choice here reads the intent alone (NVMe or optimizer-only offload
need DeepSpeed; everything else is fsdp2), and each strategy checks the method again at setup. Code and configs that
want auto-shard with an intent call ``auto_shard(...)`` themselves, with the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from autoshard.adapters.fsdp2 import ParallelizeFn
from autoshard.backends import get_backend
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent, as_intent
from autoshard.lightning.fsdp2 import BACKEND, AutoShardStrategy, backend_for_intent

DEEPSPEED_TAKES_NO_PARALLELIZE_FN = (
    "this intent needs DeepSpeed (only it has what it asks for), and DeepSpeed takes no parallelize_fn."
    " Fix: drop parallelize_fn, or change the intent so that fsdp2 can run it"
)


def needed_backend(
    intent: ShardingIntent | Mapping[str, Any] | None, parallelize_fn: ParallelizeFn | None, **intent_fields: Any
) -> tuple[ShardingIntent, str]:
    """The intent, and the backend it alone needs (``backend_for_intent``): what ``"auto-shard"`` builds, for the
    Trainer (``auto_shard``) and for Fabric (``autoshard.fabric.auto_shard``). A parallelize_fn with an intent only
    DeepSpeed runs is refused: DeepSpeed takes none."""
    wanted = as_intent(intent, **intent_fields)
    needed = backend_for_intent(wanted)
    if needed != BACKEND and parallelize_fn is not None:
        raise IntentError(DEEPSPEED_TAKES_NO_PARALLELIZE_FN)
    return wanted, needed


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
    if needed == BACKEND:
        return AutoShardStrategy(wanted, parallelize_fn, process_group_backend, timeout)
    chosen = get_backend(needed).strategy_class()(wanted, process_group_backend=process_group_backend, timeout=timeout)
    chosen.requested_as = AutoShardStrategy.strategy_name  # its refusals must not propose the auto-shard the user is on
    return chosen


__all__ = ["DEEPSPEED_TAKES_NO_PARALLELIZE_FN", "auto_shard", "needed_backend"]
