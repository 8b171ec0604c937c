"""One mesh: the run's parallel dims resolved once (``autoshard.mesh.ParallelDims``), with the intent's refusals, and
what the strategy builds from them when the Trainer is built. The mesh itself, on real processes, is
tests/distributed/test_hsdp_tp.py (HSDP x TP, 2 x 2 x 2 on 8 gloo ranks) and tests/distributed/test_hsdp.py."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch import nn

from autoshard import ShardingIntent
from autoshard.adapters.fsdp2 import plan_fsdp2, settings_in_words
from autoshard.errors import AutoShardError, IntentError
from autoshard.lightning import FSDP2Strategy
from autoshard.mesh import ParallelDims, hybrid_sizes


@pytest.mark.parametrize(
    ("intent", "world", "nodes", "dims"),
    [
        ({}, 8, 1, (1, 8, 1)),  # pure FSDP over every rank
        ({"shard_size": 2}, 8, 1, (4, 2, 1)),
        ({"shard_size": 8}, 8, 1, (1, 8, 1)),  # one replica: pure FSDP
        ({"tensor_parallel_size": 2}, 8, 1, (1, 4, 2)),
        ({"shard_size": 2, "tensor_parallel_size": 2}, 8, 1, (2, 2, 2)),  # HSDP x TP
        ({"shard_size": "node"}, 8, 2, (2, 4, 1)),
        ({"shard_size": "node", "tensor_parallel_size": 2}, 8, 2, (2, 2, 2)),  # a node: 2 shard ranks x 2 tp ranks
        ({"shard_size": "node", "tensor_parallel_size": 4}, 8, 2, (2, 1, 4)),
    ],
)
def test_dims_are_resolved_once_from_the_intent_the_world_and_the_nodes(intent: dict, world: int, nodes: int, dims: tuple) -> None:
    resolved = ParallelDims.resolve(ShardingIntent(**intent), world, nodes)
    assert (resolved.dp_replicate, resolved.dp_shard, resolved.tp) == dims
    assert resolved.world_size == world and resolved.dp * resolved.tp == world
    assert hybrid_sizes(ShardingIntent(**intent), world, nodes) == resolved.hsdp
    assert resolved.node_group == resolved.dp_shard * resolved.tp


@pytest.mark.parametrize(
    ("intent", "world"),
    [
        ({"shard_size": 3}, 8),
        ({"shard_size": 16}, 8),
        ({"data_parallel_size": 3}, 2),
        ({"tensor_parallel_size": 4}, 6),
        ({"shard_size": 4, "tensor_parallel_size": 4}, 8),  # 2 data-parallel ranks cannot hold shard groups of 4
    ],
)
def test_refusals_name_the_intent_field(intent: dict, world: int) -> None:
    with pytest.raises(IntentError) as got:
        ParallelDims.resolve(ShardingIntent(**intent), world)
    assert str(got.value).startswith(next(iter(intent)))


def test_hsdp_with_tensor_parallel_is_an_intent_that_builds() -> None:
    """Refused while HSDP had its own 2-D mesh; one mesh makes it a layout like any other."""
    intent = ShardingIntent(shard_size=2, tensor_parallel_size=2)
    dims = ParallelDims.resolve(intent, 8)
    assert dims.hsdp == (2, 2) and (dims.dp, dims.tp) == (4, 2)


def test_node_shard_groups_with_tensor_parallel_that_does_not_fit_a_node() -> None:
    with pytest.raises(IntentError) as info:
        ParallelDims.resolve(ShardingIntent(shard_size="node", tensor_parallel_size=3), 12, 3)
    text = str(info.value)
    assert text.startswith("shard_size='node' with tensor_parallel_size=3: a node's 4 devices cannot hold whole tensor-parallel")
    assert text.count("Fix: ") == 1 and text.endswith("Fix: tensor_parallel_size= one of 1, 2, 4, or shard_size= a number of data-parallel ranks")


def test_dims_and_sizes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(AutoShardError, match="ParallelDims.tp must be a positive integer, got 0"):
        ParallelDims(1, 2, 0)
    with pytest.raises(AutoShardError, match=r"hybrid sharding 3 x 2 does not cover the 4 data-parallel ranks"):
        ParallelDims.of(4, 1, (3, 2))
    assert ParallelDims.of(4, 2, (2, 2)) == ParallelDims(2, 2, 2)


def test_the_strategy_resolves_the_dims_once_when_the_trainer_is_built() -> None:
    """HSDP x TP on 8 devices: Lightning's mesh sizes come from the dims (dp = replicas x shard ranks), the summary
    says all three; tensor parallel without a parallelize_fn is no longer refused here (the model's plan is read at
    setup)."""
    strategy = FSDP2Strategy(shard_size=2, tensor_parallel_size=2)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=8, logger=False)
    assert strategy.dims == ParallelDims(2, 2, 2) and strategy.hsdp_sizes == (2, 2)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 2)
    described = strategy.describe_mesh()
    assert described == {"data_parallel_size": 4, "tensor_parallel_size": 2, "world_size": 8, "hsdp": (2, 2)}
    words = settings_in_words(described, plan_fsdp2(nn.Sequential(nn.Linear(2, 2))).to_dict()["settings"])
    assert "over 8 ranks (data parallel 4, tensor parallel 2, hybrid sharding: 2 replicas of 2-rank shard groups)" in words
    with pytest.raises(IntentError, match="a parallelize_fn replaces it, so the shard size would be ignored"):
        pl.Trainer(strategy=FSDP2Strategy(shard_size=2, parallelize_fn=lambda m, mesh: None), accelerator="cpu", devices=4, logger=False)


class NoPlan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


class Planned(NoPlan):
    _tp_plan = {"blocks.0": "colwise", "blocks.1": "rowwise"}  # a pair: what one layer splits, the next takes


def test_tensor_parallel_needs_a_layout_the_model_carries() -> None:
    """Refused at setup (every rank alike), when the module is known: a model without a plan would train the same
    batch on every tensor-parallel rank. One with a plan gets it in its FSDP2 plan, applied before fully_shard."""
    with pytest.raises(IntentError) as info:
        plan_fsdp2(NoPlan(), ShardingIntent(tensor_parallel_size=2))
    text = str(info.value)
    assert text.startswith("tensor_parallel_size=2 needs a tensor-parallel layout, and NoPlan carries none autoshard can read")
    assert "they would all train on the same batch" in text
    assert text.endswith(
        "Fix: give the model a _tp_plan (e.g. {'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}), pass"
        " FSDP2Strategy(parallelize_fn=fn), where fn(module, device_mesh) applies a tensor-parallel layout on"
        " device_mesh['tensor_parallel'], or set tensor_parallel_size=1"
    )
    plan = plan_fsdp2(Planned(), ShardingIntent(tensor_parallel_size=2))
    assert plan.tp_plan is not None and plan.tp_plan.rows() == [("blocks.0", "colwise"), ("blocks.1", "rowwise")]
    assert "tensor parallel, laid out before fully_shard (2 modules" in plan.describe()
    assert plan.to_dict()["tensor_parallel"] == [{"module": "blocks.0", "style": "colwise"}, {"module": "blocks.1", "style": "rowwise"}]
    assert plan_fsdp2(NoPlan(), ShardingIntent()).tp_plan is None and "tensor_parallel" not in plan_fsdp2(NoPlan()).to_dict()


def test_a_layout_that_does_not_divide_is_refused_while_planning() -> None:
    with pytest.raises(IntentError, match=r"tensor_parallel_size=3 does not divide 'blocks.0.weight' dimension 0"):
        plan_fsdp2(Planned(), ShardingIntent(tensor_parallel_size=3))
