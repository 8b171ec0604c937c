"""Random init of meta-device shards on CPU meshes: each shard its own values, replicas of a shard equal."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from autoshard.privates import in_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class _PerShardCPURandom:
    """DTensor's RNG tracker for CPU meshes (see ``per_shard_random_init``); implements what DTensor dispatch calls."""

    distribute_region_enabled = True

    @contextmanager
    def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        seed = int(torch.randint(2**62, (), generator=generator))  # the same draw on ranks that share a seed
        coordinate, shard = spec.mesh.get_coordinate(), 0
        for dim, placement in enumerate(spec.placements):
            if not placement.is_replicate():  # Shard, and FSDP2's _StridedShard over a tensor-parallel split (not is_shard())
                shard = shard * spec.mesh.size(dim) + coordinate[dim]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + shard)
            yield


@contextmanager
def per_shard_random_init(mesh: DeviceMesh) -> Iterator[None]:
    """While meta shards are materialized on CPU, give each shard its own random values, as the whole parameter has.

    torch offsets DTensor's random stream per shard on CUDA-like devices only (CPU's generator has no Philox offset),
    so ranks sharing a seed would get identical shards. Each random op here draws one seed and runs on a generator
    seeded with it plus the shard's index: shards differ, replicas agree, every rank's generator advances alike.
    """
    if mesh.device_type != "cpu" or in_torch.rng_tracker() is not None:
        yield
        return
    in_torch.set_rng_tracker(_PerShardCPURandom())
    try:
        yield
    finally:
        in_torch.set_rng_tracker(None)
