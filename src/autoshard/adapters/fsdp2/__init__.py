"""FSDP2 for any module: intent -> a concrete, printable ``fully_shard`` plan, and applying it on the run's mesh.

One concern per module; the names other layers use are importable from here:

- ``plan``: the plan's types and how it reads (``FSDP2Plan``, ``ShardUnit``, ``describe``);
- ``planner``: intent + needs -> plan (``plan_fsdp2``), and the model's tensor-parallel layout to apply first;
- ``apply``: the plan applied on ``autoshard.mesh`` (tensor parallel, checkpointing, ``fully_shard``) and its policies;
- ``runtime``: what keeps the ranks equal while training (averaged unsharded gradients, broadcasts, buffers), and
  ``is_sharded``;
- ``ema``: EMA teacher and student sharded alike;
- ``rng``: per-shard random init of meta shards on CPU.
"""

from __future__ import annotations

from autoshard.adapters.fsdp2.apply import policies
from autoshard.adapters.fsdp2.ema import check_ema_alignment
from autoshard.adapters.fsdp2.plan import FSDP2Plan, ParallelizeFn, Reshard, Role, Unsharded, settings_in_words
from autoshard.adapters.fsdp2.planner import follows_forward_order, plan_fsdp2, reshard_in_order, tensor_parallel_plan
from autoshard.adapters.fsdp2.rng import per_shard_random_init
from autoshard.adapters.fsdp2.runtime import (
    average_unsharded_gradients,
    broadcast_unsharded,
    grad_buckets,
    init_sharded_units,
    is_sharded,
    sync_buffers,
    to_device_keeping_offloaded,
)

__all__ = [
    "FSDP2Plan",
    "ParallelizeFn",
    "Reshard",
    "Role",
    "Unsharded",
    "average_unsharded_gradients",
    "broadcast_unsharded",
    "check_ema_alignment",
    "follows_forward_order",
    "grad_buckets",
    "init_sharded_units",
    "is_sharded",
    "per_shard_random_init",
    "plan_fsdp2",
    "policies",
    "reshard_in_order",
    "settings_in_words",
    "sync_buffers",
    "tensor_parallel_plan",
    "to_device_keeping_offloaded",
]
