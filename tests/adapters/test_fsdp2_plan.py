"""plan_fsdp2 in one process: which modules become fully_shard units, in which order, and what stays replicated."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from autoshard import EMAPair, MethodNeeds, ShardingIntent, inspect_needs
from autoshard.adapters.fsdp2 import Reshard, plan_fsdp2
from autoshard.capability import Feature
from autoshard.errors import AutoShardError, IntentError
from autoshard.select import features_needed


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


def test_tied_weights_are_never_split_across_units() -> None:
    class Shared(nn.Module):  # ALBERT-like: blocks 0 and 2 share a weight, so neither can be a unit of its own
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.blocks[2].fc.weight = self.blocks[0].fc.weight

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = Shared()

    plan = plan_fsdp2(Root())
    assert names(plan) == ["lm.blocks.1", "lm"]
    assert any("'lm.blocks.0' shares parameters with modules outside it (tied weights)" in n for n in plan.notes)
    assert "tied weights grouped in this unit: lm.blocks.0.fc.weight = lm.blocks.2.fc.weight" in plan.units[-1].why


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
    text = plan.describe({"world_size": 8, "data_parallel_size": 8, "tensor_parallel_size": 1})
    assert text.splitlines()[0] == "==== autoshard: FSDP2 plan ===="
    assert text.splitlines()[1].startswith(
        "fsdp2 over 8 ranks (data parallel 8, tensor parallel 1); precision bf16-mixed (all-gather in bfloat16, reduce in float32);"
    )  # the settings in words, not JSON
    assert "backbone.blocks.0" in text and "frozen and not an EMA teacher" in text
    assert plan.to_dict()["units"][0]["name"] == "backbone.blocks.0"


# -- issue 12: units at an architecture's blocks, torchtitan's reshard policy, the reason for each unit -------------
def zoo(arch: str) -> nn.Module:
    from benchmarks.arch_models import ARCHS

    with torch.device("meta"):
        return ARCHS[arch]()


def plan_of(arch: str, intent: ShardingIntent | None = None, needs: MethodNeeds | None = None) -> object:
    model = zoo(arch)
    return plan_fsdp2(model, intent or ShardingIntent(precision="32-true"), needs or inspect_needs(model))


def blocks(path: str, n: int) -> list[tuple[str, bool]]:
    return [(f"{path}.{i}", True) for i in range(n)]


PLANS = {  # (unit, reshard_after_forward), deepest first: blocks reshard, the units that end the forward stay gathered
    "gpt2": [*blocks("model.transformer.h", 4), ("model", False)],
    "llama": [*blocks("model.model.layers", 4), ("model", False)],
    "t5": [*blocks("model.encoder.block", 4), *blocks("model.decoder.block", 4), ("model", False)],
    "bert": [*blocks("model.bert.encoder.layer", 4), ("model", False)],
    "vit": [*blocks("model.layers", 4), ("model", False), ("head", False)],
    "convnext": [*(u for s in range(4) for u in blocks(f"model.stages.{s}.blocks", 2)), ("model", False), ("head", False)],
    "resnet": [*(u for s in range(1, 5) for u in blocks(f"model.layer{s}", 2)), ("model", False), ("head", False)],
}


@pytest.mark.parametrize("arch", list(PLANS))
def test_real_architectures_are_sharded_at_their_blocks(arch: str) -> None:
    """T5Block not its sub-layers, ConvNeXt blocks not the stem or downsample layers, whole ResNet Bottlenecks."""
    plan = plan_of(arch)
    assert [(u.name, u.reshard_after_forward) for u in plan.units] == PLANS[arch]
    block_class = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer", "t5": "T5Block", "bert": "BertLayer", "vit": "ViTLayer"}
    for u in plan.units:
        if u.kind == "block":
            assert u.why.startswith(block_class.get(arch, "ConvNeXtBlock" if arch == "convnext" else "Bottleneck") + " "), u.why
        else:
            assert "holds what no block took" in u.why, u.why
    assert plan.sharded_numel == sum(p.numel() for p in zoo(arch).parameters())


def test_stems_downsamples_and_norms_stay_in_their_parents_unit() -> None:
    plan = plan_of("convnext")
    model = zoo("convnext")
    small = [model.model.stem, model.model.norm, *(s.downsample for s in model.model.stages)]
    assert next(u for u in plan.units if u.name == "model").numel == sum(p.numel() for m in small for p in m.parameters())
    assert "the elements of model.stages are stages" in plan.units[0].why


def test_repeated_modules_below_the_minimum_unit_size_and_experts_inside_layers_are_not_units() -> None:
    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.experts = nn.ModuleList(Expert() for _ in range(4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))  # identical layers: experts run on some ranks only
            self.scales = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(4))  # 1 parameter each

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

    assert names(plan_fsdp2(Root())) == ["net.layers.0", "net.layers.1", "net.layers.2", "net"]


def test_tied_embedding_and_head_are_one_unit_kept_gathered() -> None:
    for arch, tied in (
        ("gpt2", "model.transformer.wte.weight = model.lm_head.weight"),
        ("t5", "model.shared.weight = model.encoder.embed_tokens.weight = model.decoder.embed_tokens.weight = model.lm_head.weight"),
        ("bert", "model.bert.embeddings.word_embeddings.weight = model.cls.predictions.decoder.weight"),
    ):
        unit = plan_of(arch).units[-1]
        assert (unit.name, unit.reshard_after_forward) == ("model", False)
        assert f"tied weights grouped in this unit: {tied}" in unit.why


def test_last_unit_stays_gathered_unless_a_teacher_or_several_forwards_rule_it_out() -> None:
    plan = plan_of("vit")
    reasons = {u.name: u.reshard for u in plan.units}
    assert reasons["head"] is Reshard.KEPT_LAST and reasons["model"] is Reshard.KEPT_BEFORE_LAST
    assert {reasons[f"model.layers.{i}"] for i in range(4)} == {Reshard.AFTER_FORWARD}
    several = plan_of("vit", needs=MethodNeeds(multi_forward=True))
    assert [u.reshard for u in several.units if u.kind == "subtree"] == [Reshard.MULTI_FORWARD] * 2
    assert all(u.reshard_after_forward for u in several.units)

    class EMA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = Backbone()
            self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    ema = plan_fsdp2(EMA(), needs=inspect_needs(EMA()))
    assert all(u.reshard_after_forward for u in ema.units)
    assert {u.name: u.reshard for u in ema.units if u.kind == "subtree"} == {"student": Reshard.EMA_FORWARD, "teacher": Reshard.TEACHER}
    frozen = Method()
    frozen.heads.requires_grad_(False)
    kept = plan_fsdp2(frozen, ShardingIntent(shard=("backbone", "heads")))
    assert {u.name: u.reshard for u in kept.units if u.kind == "subtree"} == {
        "heads": Reshard.FROZEN,  # registered last, but no backward needs a frozen unit: the trainable one is kept
        "backbone": Reshard.KEPT_LAST,
    }


def test_intent_blocks_name_classes_or_paths_and_are_validated() -> None:
    by_class = plan_of("gpt2", ShardingIntent(blocks=["GPT2MLP"]))
    assert names(by_class) == [f"model.transformer.h.{i}.mlp" for i in range(4)] + ["model"]
    assert by_class.units[0].why == "named in ShardingIntent(blocks=...) as GPT2MLP"
    by_path = plan_of("gpt2", ShardingIntent.from_dict({"blocks": "model.transformer.h.3"}))
    assert names(by_path) == ["model.transformer.h.3", "model"]
    assert names(plan_of("t5", ShardingIntent(blocks=[]))) == ["model"]
    with pytest.raises(
        IntentError,
        match=r"blocks names 'GPT2Blok': neither a module path nor a module class of HFCausal \(repeated blocks found: GPT2Block\)\. Fix: .*blocks=\['GPT2Block'\]",
    ):
        plan_of("gpt2", ShardingIntent(blocks=["GPT2Blok"]))
    with pytest.raises(IntentError, match=r"blocks must list module class names or module paths, got \[3\]\. Fix: blocks=\['GPT2Block'\]"):
        ShardingIntent(blocks=[3])
    assert ShardingIntent(blocks=("Block",)).to_dict()["blocks"] == ["Block"]
    # DeepSpeed has no per-block plan to follow: naming blocks is a per-block request, as shard= is
    assert features_needed(MethodNeeds(), ShardingIntent(blocks=["GPT2Block"]))[Feature.PER_BLOCK_SHARDING] == "blocks=GPT2Block"


def test_plan_prints_why_each_unit_is_one_and_each_reshard_choice() -> None:
    plan = plan_of("gpt2")
    text = plan.describe()
    assert "model.transformer.h.0                    block          49,984 params  0.19 MiB  reshard GPT2Block 1 of 4 in model.transformer.h" in text
    assert "  'model': kept gathered after forward: the last unit in forward order, which backward needs first" in text
    assert "  4 units: resharded after forward, gathered again in backward" in text
    assert "prefetch: FSDP2's implicit prefetch" in text
    unit = plan.to_dict()["units"][-1]
    assert (unit["name"], unit["kind"], unit["reshard_after_forward"]) == ("model", "subtree", False)
    assert unit["reshard"] == Reshard.KEPT_LAST.value and unit["why"].startswith("top-level child: holds what no block took")


def test_explain_json_keeps_unit_names_and_adds_why(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from autoshard.explain import main

    assert main(["benchmarks.arch_models:resnet", "--json", "--world-sizes", "2"]) == 0
    units = json.loads(capsys.readouterr().out)["plan"]["units"]
    assert [u["name"] for u in units] == [name for name, _ in PLANS["resnet"]]
    assert units[0]["why"] == "Bottleneck 1 of 2 in model.layer1" and units[-1]["reshard"] == Reshard.KEPT_LAST.value


def test_sync_batchnorm_on_one_cpu_rank_is_plain_batchnorm() -> None:
    """torch's SyncBatchNorm refuses CPU input even when one rank has nothing to synchronize; autoshard's does not."""
    import os

    import torch.distributed as dist

    from autoshard.batchnorm import SyncBatchNorm
    from tests.distributed.harness import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        torch.manual_seed(0)
        synced, plain, x = SyncBatchNorm(4), nn.BatchNorm1d(4), torch.randn(8, 4)
        torch.testing.assert_close(synced(x), plain(x))
        torch.testing.assert_close(synced.running_var, plain.running_var)
        with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
            nn.SyncBatchNorm(4)(x)  # what it replaces
    finally:
        dist.destroy_process_group()
