"""Hybrid sharding in the estimate: states divide by the shard group, not the world; the traffic that crosses
nodes shrinks to the all-reduce of each rank's gradient slice."""

from __future__ import annotations

import pytest

from autoshard.demo import DinoLike
from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.memory import EstimateOptions, estimate_memory, estimate_memory_many, memory_table
from autoshard.mesh import nodes_for
from autoshard.target import build_on_meta


@pytest.fixture(scope="module")
def dino() -> object:
    return build_on_meta(DinoLike).module


STATES = ("parameters", "gradients", "optimizer_states", "ema_teacher", "unsharded")


def test_states_divide_by_the_shard_group_not_the_world(dino: object) -> None:
    hybrid = estimate_memory(dino, ShardingIntent(shard_size=2), world_size=8)
    pure_on_two = estimate_memory(dino, ShardingIntent(), world_size=2)
    pure_on_eight = estimate_memory(dino, ShardingIntent(), world_size=8)
    assert [getattr(hybrid, c) for c in STATES] == [getattr(pure_on_two, c) for c in STATES]  # exact, byte for byte
    assert hybrid.parameters > 3 * pure_on_eight.parameters
    assert hybrid.shard_group == 2 and pure_on_eight.shard_group == 8
    assert hybrid.model_states / hybrid.ideal == pytest.approx(pure_on_two.model_states / pure_on_two.ideal)


def test_rank_in_the_second_group_holds_the_same_shard_as_its_replica(dino: object) -> None:
    first = estimate_memory(dino, ShardingIntent(shard_size=4), world_size=8, options=EstimateOptions(rank=1))
    replica = estimate_memory(dino, ShardingIntent(shard_size=4), world_size=8, options=EstimateOptions(rank=5))
    assert first.parameters == replica.parameters and first.optimizer_states == replica.optimizer_states


def test_node_means_the_devices_of_one_node(dino: object) -> None:
    by_node = estimate_memory_many(dino, ShardingIntent(shard_size="node"), world_sizes=(16, 64), options=EstimateOptions(devices_per_node=8))
    assert [(e.num_nodes, e.shard_group) for e in by_node] == [(2, 8), (8, 8)]
    assert by_node[0].parameters == by_node[1].parameters  # more nodes add replicas, not shards


def test_hybrid_sharding_keeps_gathers_inside_the_node(dino: object) -> None:
    pure, hybrid = (
        estimate_memory(dino, ShardingIntent(shard_size=size), world_size=16, options=EstimateOptions(devices_per_node=8)) for size in (None, "node")
    )
    assert pure.intra_node_bytes == 0 and pure.inter_node_bytes > 0  # every gather spans both nodes
    gathers = {t.collective: t for t in hybrid.traffic}
    assert not gathers["all-gather of parameters (forward, backward)"].inter_node
    assert not gathers["reduce-scatter of gradients"].inter_node
    assert gathers["all-reduce of gradient slices across replicas"].inter_node
    assert gathers["all-reduce of gradient slices across replicas"].group == 2
    assert hybrid.inter_node_bytes < pure.inter_node_bytes / 8  # only a 1/8 slice of the gradients crosses nodes
    table = memory_table([pure])
    assert "sent per step, across nodes" in table and "nodes  " in table


def test_one_node_sends_nothing_across_nodes(dino: object) -> None:
    est = estimate_memory(dino, ShardingIntent(), world_size=8, options=EstimateOptions(devices_per_node=8))
    assert est.inter_node_bytes == 0 and est.intra_node_bytes > 0


def test_gather_traffic_follows_the_ring_cost(dino: object) -> None:
    two, eight = (estimate_memory(dino, ShardingIntent(), world_size=n) for n in (2, 8))
    gather = lambda e: next(t.bytes for t in e.traffic if t.collective.startswith("all-gather"))  # noqa: E731
    assert gather(eight) / gather(two) == pytest.approx((7 / 8) / (1 / 2), rel=1e-3)


def test_a_shard_size_that_does_not_fit_is_refused(dino: object) -> None:
    with pytest.raises(IntentError, match="Fix:"):
        estimate_memory(dino, ShardingIntent(shard_size=3), world_size=8)


def test_world_sizes_must_fill_whole_nodes() -> None:
    assert nodes_for(4, 8) == 1 and nodes_for(64, 8) == 8
    with pytest.raises(AutoShardError, match=r"does not fill whole nodes of 8 devices\. Fix: use a multiple of 8 \(e\.g\. 8\)"):
        nodes_for(12, 8)
