"""FSDP2 for any module: intent -> a concrete, printable ``fully_shard`` plan, and applying it on the run's mesh.

One concern per module, every public name importable from here:

- ``plan``: the plan's types and how it reads (``FSDP2Plan``, ``ShardUnit``, ``describe``);
- ``planner``: intent + needs -> plan (``plan_fsdp2``), and the model's tensor-parallel layout to apply first;
- ``apply``: the plan applied on ``autoshard.mesh`` (tensor parallel, checkpointing, ``fully_shard``) and its policies;
- ``runtime``: what keeps the ranks equal while training (averaged unsharded gradients, broadcasts, buffers);
- ``ema``: EMA teacher and student sharded alike;
- ``rng``: per-shard random init of meta shards on CPU;
- ``api``: FSDP2's entry points in the installed torch.
"""

from __future__ import annotations

from autoshard.adapters.blocks import MIN_BLOCK_FRACTION, STAGE_FRACTION
from autoshard.adapters.fsdp2.api import fsdp2_api, is_sharded
from autoshard.adapters.fsdp2.apply import HSDP_DIMS, apply_plan, clone_view_outputs, hsdp_mesh, policies
from autoshard.adapters.fsdp2.ema import check_ema_alignment, check_ema_structure
from autoshard.adapters.fsdp2.plan import (
    PARALLELIZE_FN_HINT,
    PREFETCH,
    FSDP2Plan,
    ParallelizeFn,
    Replicated,
    Reshard,
    Role,
    ShardUnit,
    UnitKind,
    Unsharded,
    plan_settings,
    settings_in_words,
)
from autoshard.adapters.fsdp2.planner import plan_fsdp2, tensor_parallel_plan
from autoshard.adapters.fsdp2.rng import per_shard_random_init
from autoshard.adapters.fsdp2.runtime import (
    BUFFER_RULE,
    GRAD_BUCKET_BYTES,
    UnshardedGradients,
    average_gradients,
    average_unsharded_gradients,
    broadcast_unsharded,
    grad_buckets,
    init_sharded_units,
    spans_data_parallel,
    sync_buffers,
    to_device_keeping_offloaded,
)

__all__ = [
    "BUFFER_RULE",
    "GRAD_BUCKET_BYTES",
    "HSDP_DIMS",
    "MIN_BLOCK_FRACTION",
    "PARALLELIZE_FN_HINT",
    "PREFETCH",
    "STAGE_FRACTION",
    "FSDP2Plan",
    "ParallelizeFn",
    "Replicated",
    "Reshard",
    "Role",
    "ShardUnit",
    "UnitKind",
    "UnshardedGradients",
    "Unsharded",
    "apply_plan",
    "average_gradients",
    "average_unsharded_gradients",
    "broadcast_unsharded",
    "check_ema_alignment",
    "check_ema_structure",
    "clone_view_outputs",
    "fsdp2_api",
    "grad_buckets",
    "init_sharded_units",
    "hsdp_mesh",
    "is_sharded",
    "per_shard_random_init",
    "plan_fsdp2",
    "plan_settings",
    "policies",
    "settings_in_words",
    "spans_data_parallel",
    "sync_buffers",
    "to_device_keeping_offloaded",
    "tensor_parallel_plan",
]
