"""autoshard: ask for sharded training once; get FSDP2 or DeepSpeed ZeRO-3, whichever can run your method.

``import autoshard`` registers the Lightning strategies ``"auto-shard"``, ``"fsdp2"`` and ``"autoshard-deepspeed"``
and installs the FSDP1 / DeepSpeed guards.
"""

from __future__ import annotations

from autoshard.capability import Cell, Feature, Support, matrix, render_matrix
from autoshard.errors import AutoShardError, BackendUnavailableError, IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.needs import EMAPair, MethodNeeds, inspect_needs
from autoshard.select import Decision, features_needed, select_backend

__version__ = "0.1.0"

__all__ = [
    "AutoShardError",
    "BackendUnavailableError",
    "Cell",
    "Decision",
    "EMAPair",
    "Feature",
    "IncompatibleBackendError",
    "IntentError",
    "MethodNeeds",
    "ShardingIntent",
    "Support",
    "features_needed",
    "inspect_needs",
    "matrix",
    "render_matrix",
    "select_backend",
]

from autoshard import lightning as _lightning  # noqa: E402  (registers the strategies and guards)

_lightning.register()
