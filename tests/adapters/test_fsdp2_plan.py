"""plan_fsdp2 in one process: which modules become fully_shard units, in which order, and what stays replicated."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from autoshard import EMAPair, MethodNeeds, ShardingIntent, inspect_needs
from autoshard.adapters.fsdp2 import plan_fsdp2
from autoshard.errors import AutoShardError, IntentError


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()


class Backbone(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.norm = nn.LayerNorm(8)


class Method(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 2), "b": nn.Linear(8, 3)})
        self.frozen = nn.Linear(8, 8).requires_grad_(False)


def names(plan: object) -> list[str]:
    return [u.name for u in plan.units]  # type: ignore[attr-defined]


def test_blocks_first_then_subtrees_never_the_root_nor_containers() -> None:
    plan = plan_fsdp2(Method())
    # deepest first (children before parents, as fully_shard needs); ModuleDict entries are subtrees of their own
    assert names(plan) == ["backbone.blocks.0", "backbone.blocks.1", "backbone.blocks.2", "heads.a", "heads.b", "backbone"]
    assert [u.kind for u in plan.units] == ["block"] * 3 + ["subtree"] * 3
    backbone = next(u for u in plan.units if u.name == "backbone")
    assert backbone.numel == (4 * 8 + 8) + 2 * 8  # embed + norm: what the blocks did not take
    assert [(r.name, r.why, r.trainable) for r in plan.replicated] == [("frozen", "frozen and not an EMA teacher", False)]


def test_every_parameter_is_either_in_one_unit_or_listed_as_replicated() -> None:
    model = Method()
    plan = plan_fsdp2(model)
    total = sum(p.numel() for p in model.parameters())
    assert plan.sharded_numel + sum(r.numel for r in plan.replicated) == total


def test_ema_teacher_is_planned_exactly_like_its_student_and_reshards_after_forward() -> None:
    class EMA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = Backbone()
            self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    model = EMA()
    needs = inspect_needs(model)
    assert needs.ema_pairs == (EMAPair("teacher", "student"),)
    plan = plan_fsdp2(model, ShardingIntent(reshard_after_forward=False), needs)
    student = [(u.name.removeprefix("student"), u.numel) for u in plan.units if u.name.startswith("student")]
    teacher = [(u.name.removeprefix("teacher"), u.numel) for u in plan.units if u.name.startswith("teacher")]
    assert student == teacher
    assert all(u.reshard_after_forward for u in plan.units if u.role == "teacher")
    assert not any(u.reshard_after_forward for u in plan.units if u.role == "trainable")


def test_teacher_inside_a_wrapper_gets_its_own_units() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = Backbone(2)
            self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wrapper = Wrapper()

    plan = plan_fsdp2(Outer(), needs=inspect_needs(Outer()))
    assert {"wrapper.student", "wrapper.teacher"} <= set(names(plan))


def test_tied_weights_stay_in_the_enclosing_unit() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
            self.layers[2].weight = self.layers[0].weight

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = Tied()

    plan = plan_fsdp2(Root())
    assert names(plan) == ["lm.layers.1", "lm"]
    assert any("tied weights" in n for n in plan.notes)


def test_callback_modules_and_exclusions_stay_replicated_with_averaged_gradients() -> None:
    model = Method()
    plan = plan_fsdp2(model, ShardingIntent(exclude=("heads.b",)), MethodNeeds(callback_modules=("heads.a",)))
    assert "heads.a" not in names(plan) and "heads.b" not in names(plan)
    why = {r.name: (r.why, r.trainable) for r in plan.replicated}
    assert why["heads.a"] == ("trained by a callback's optimizer", True)
    assert why["heads.b"] == ("excluded", True)


def test_explicit_shard_paths_and_their_errors() -> None:
    plan = plan_fsdp2(Method(), ShardingIntent(shard=("backbone",)))
    assert names(plan) == ["backbone.blocks.0", "backbone.blocks.1", "backbone.blocks.2", "backbone"]
    with pytest.raises(IntentError, match="shard names 'backbon', not a module of Method: top-level modules are backbone, heads, frozen"):
        plan_fsdp2(Method(), ShardingIntent(shard=("backbon",)))
    with pytest.raises(IntentError, match="exclude names 'nope', not a module of Method"):
        plan_fsdp2(Method(), ShardingIntent(exclude=("nope",)))


def test_scalar_parameters_are_replicated_not_sharded() -> None:
    model = Method()
    model.backbone.scale = nn.Parameter(torch.tensor(1.0))
    plan = plan_fsdp2(model)
    assert ("backbone.scale", "0-dim parameter (fully_shard cannot shard scalars)") in [(r.name, r.why) for r in plan.replicated]


def test_activation_checkpointing_marks_trainable_blocks_only() -> None:
    plan = plan_fsdp2(Method(), ShardingIntent(activation_checkpointing=True))
    assert {u.name for u in plan.units if u.checkpointed} == {"backbone.blocks.0", "backbone.blocks.1", "backbone.blocks.2"}


def test_root_parameters_warn_with_the_fix() -> None:
    model = Method()
    model.bias = nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning, match="parameters live directly on Method: bias.*parallelize_fn"):
        plan = plan_fsdp2(model)
    assert ("bias", "parameter on the LightningModule root", True) in [(r.name, r.why, r.trainable) for r in plan.replicated]


def test_nothing_to_shard_is_a_note_or_under_strict_an_error() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_fsdp2(Flat())
    assert plan.units == [] and "no parameter-owning child modules found to shard in Flat" in plan.notes[0]
    with pytest.raises(AutoShardError, match="no parameter-owning child modules found to shard in Flat"):
        plan_fsdp2(Flat(), ShardingIntent(strict=True))


def test_plan_is_printable_and_works_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = Method()
    plan = plan_fsdp2(model)
    text = plan.describe({"world_size": 8})
    assert text.splitlines()[0] == "==== autoshard: FSDP2 plan ===="
    assert '"world_size": 8' in text and "backbone.blocks.0" in text and "frozen and not an EMA teacher" in text
    assert plan.to_dict()["units"][0]["name"] == "backbone.blocks.0"
