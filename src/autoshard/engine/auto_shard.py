"""``strategy="auto-shard"``, for the Trainer and for Fabric alike: the backend the intent alone needs.

Both registries call their factory before the model is known, so the choice reads the intent alone (NVMe or
optimizer-only offload need DeepSpeed; everything else is fsdp2), and each strategy checks the method again at setup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoshard.adapters.fsdp2 import ParallelizeFn
from autoshard.backends import fsdp2 as fsdp2_backend
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent, as_intent
from autoshard.needs import MethodNeeds
from autoshard.select import select_backend

FSDP2 = fsdp2_backend.BACKEND.name  # "fsdp2": what a decision is compared with, never the literal

DEEPSPEED_TAKES_NO_PARALLELIZE_FN = (
    "this intent needs DeepSpeed (only it has what it asks for), and DeepSpeed takes no parallelize_fn."
    " Fix: drop parallelize_fn, or change the intent so that fsdp2 can run it"
)


def backend_for_intent(intent: ShardingIntent) -> str:
    """The backend the intent alone needs (no method known yet, precision left to the Trainer): what ``auto-shard``
    builds. Raises the selector's refusal when no backend can run the intent."""
    return select_backend(MethodNeeds(), intent.replace(precision=None)).backend


def needed_backend(
    intent: ShardingIntent | Mapping[str, Any] | None, parallelize_fn: ParallelizeFn | None, **intent_fields: Any
) -> tuple[ShardingIntent, str]:
    """The intent, and the backend it alone needs (``backend_for_intent``): what ``"auto-shard"`` builds, for the
    Trainer and for Fabric. A parallelize_fn with an intent only DeepSpeed runs is refused: DeepSpeed takes none."""
    wanted = as_intent(intent, **intent_fields)
    needed = backend_for_intent(wanted)
    if needed != FSDP2 and parallelize_fn is not None:
        raise IntentError(DEEPSPEED_TAKES_NO_PARALLELIZE_FN)
    return wanted, needed


def fsdp2_auto_intent(wanted: ShardingIntent, label: str, build: str, returns: str) -> ShardingIntent:
    """``wanted``, for an auto-shard strategy object on fsdp2 (the Trainer's and Fabric's): refused when only DeepSpeed
    can run the intent, naming the factory (``build``) that would have returned DeepSpeed's strategy (``returns``)."""
    needed = backend_for_intent(wanted)
    if needed != FSDP2:
        raise IntentError(
            f"{label} is auto-shard's fsdp2 strategy, but this intent needs {needed} (only it has what the intent asks"
            f" for), so an fsdp2 strategy object cannot run it. Fix: build it with {build} which returns {returns}"
        )
    return wanted
