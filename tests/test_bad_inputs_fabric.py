"""The bad-input catalog, rows 110-119 (docs/bad-inputs.md): Lightning Fabric.

What DeepSpeed cannot train is refused at ``fabric.setup``, before any engine (several optimizers and a second setup
call, each named; an EMA teacher); an optimizer that cannot be moved onto the sharded parameters is refused rather
than left stepping the old ones; Fabric-only misfits of precision, checkpoints and EMA teachers set up apart. One
process (``devices=1``, a 1-rank gloo group kept for the module: DeepSpeed caches it); 2-rank runs of the same paths:
tests/fabric/test_fabric.py.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoshard  # noqa: F401  registers Fabric's strategy names
from autoshard.checkpoint.trust import CheckpointFormatError
from autoshard.errors import AutoShardError, IncompatibleBackendError, IntentError
from autoshard.fabric import FSDP2Strategy, auto_shard
from tests.test_bad_inputs import refused

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.fixture(autouse=True)
def isolated_environment() -> Iterator[None]:
    """Fabric's launch sets MASTER_PORT & co.: undo them after each test. The 1-rank process group stays for the
    module (tests/conftest.py drops it, through DeepSpeed's own destroy once DeepSpeed has used it)."""
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.Tanh())
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = Net()
        self.disc = Net()


class WithTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = Net()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)


class Holder(nn.Module):
    """A trainable head beside a frozen copy of a model set up in an earlier call."""

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = teacher
        self.head = nn.Linear(2, 2)


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def fabric(strategy: Any = "fsdp2", **kwargs: Any) -> Any:
    from lightning.fabric import Fabric

    f = Fabric(accelerator="cpu", devices=1, strategy=strategy, **kwargs)
    f.launch()
    return f


# -- 110-112: DeepSpeed, refused at fabric.setup before any engine ------------------------------------------------------
@needs_deepspeed
def test_110_deepspeed_two_optimizers_named() -> None:
    f = fabric("autoshard-deepspeed")
    model = Pair()
    opts = torch.optim.AdamW(model.gen.parameters()), torch.optim.SGD(model.disc.parameters(), lr=0.1)
    refused(
        IncompatibleBackendError,
        lambda: f.setup(model, *opts),
        "Pair cannot train under DeepSpeed ZeRO stage 3 (AutoShardDeepSpeedStrategy); refused before the engine is built.",
        "[2 optimizers: 1 from fabric.setup call 1: AdamW over 'gen', 1 from fabric.setup call 1: SGD over 'disc']",
        "Backend that works: fsdp2",
        "Fix: use strategy='fsdp2'",
    )
    assert f.strategy.model is None  # no engine was built


@needs_deepspeed
def test_111_deepspeed_second_setup_call_named() -> None:
    """Lightning issue #19773: a second setup call replaces the first one's engine; refused, both calls named."""
    f = fabric("autoshard-deepspeed")
    gen = Net()
    f.setup(gen, torch.optim.AdamW(gen.parameters()))
    disc = Net(width=6)
    refused(
        IncompatibleBackendError,
        lambda: f.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1)),
        "cannot take a second fabric.setup call",
        "Lightning issue #19773",
        "Already set up: fabric.setup call 1: Net with AdamW over all of Net. Now: fabric.setup call 2: Net with SGD over all of Net.",
        "Fix: use Fabric(strategy='fsdp2') (or 'auto-shard'), or put both models in one nn.Module",
    )
    # The first call built an engine (zero.Init replaced torch.nn.functional.linear for the process): the strategy's
    # teardown puts torch's own back. Fabric never calls it by itself: the guide says to, once DeepSpeed is done
    f.strategy.teardown()
    assert getattr(torch.nn.functional.linear, "__module__", "") != "deepspeed.runtime.zero.linear"


@needs_deepspeed
def test_112_deepspeed_ema_teacher() -> None:
    f = fabric("autoshard-deepspeed")
    model = WithTeacher()
    refused(
        IncompatibleBackendError,
        lambda: f.setup(model, torch.optim.AdamW(model.student.parameters())),
        "WithTeacher cannot train under DeepSpeed ZeRO stage 3",
        "teacher 'teacher' follows student 'student'",
        "empty partitioned placeholder",
        "Fix: use strategy='fsdp2'",
    )


# -- 113-114: an optimizer built before setup that cannot be moved --------------------------------------------------------
def test_113_optimizer_whose_parameters_were_renamed() -> None:
    """A parallelize_fn that shards and returns another module: the old names are gone, so the optimizer built before
    setup cannot be moved; refused rather than left stepping the old tensors."""
    from torch.distributed.fsdp import fully_shard

    from autoshard.fabric import FSDP2Strategy

    def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
        for child in module.children():
            fully_shard(child, mesh=mesh["data_parallel"])
        return Wrapper(module)

    f = fabric(FSDP2Strategy(parallelize_fn=parallelize))
    model = Net()
    refused(
        AutoShardError,
        lambda: f.setup(model, torch.optim.AdamW(model.parameters())),
        "optimizer AdamW holds 4 parameter(s) of Net from before fabric.setup ('body.0.weight', 'body.0.bias', 'head.weight', 'head.bias')",
        "the module no longer has parameters of those names after setup",
        "would step tensors the sharded model no longer uses",
        "Fix: build the optimizer after `model = fabric.setup_module(model)`",
    )


def test_114_optimizer_state_that_cannot_be_cut() -> None:
    """Adafactor keeps factored moments (a row and a column vector per matrix): they cannot be cut like the parameter."""
    f = fabric()
    model = Net()
    opt = torch.optim.Adafactor(model.parameters())
    model(torch.randn(2, 4)).pow(2).mean().backward()
    opt.step()
    refused(
        AutoShardError,
        lambda: f.setup(model, opt),
        "optimizer Adafactor holds 2 parameter(s) of Net from before fabric.setup ('body.0.weight', 'head.weight')",
        "their optimizer state holds tensors shaped neither like the parameter nor 0-dim",
        "Fix: build the optimizer after",
    )


# -- 115: precision ---------------------------------------------------------------------------------------------------------
def test_115_a_precision_plugin_fsdp2_cannot_run_in_fabric_terms() -> None:
    """A plugin autoshard plans nothing for (64-true) reaches autoshard's check, said in Fabric's terms; the string is
    Lightning's own check (it names Fabric). 16-mixed, as a string or a plugin, runs now (tests/test_fp16_fsdp2.py)."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import DoublePrecision

    text = refused(
        IncompatibleBackendError,
        lambda: Fabric(accelerator="cpu", devices=1, strategy="fsdp2", plugins=[DoublePrecision()]),
        "Fabric(strategy='fsdp2', precision='64-true') is not supported",
        "autoshard plans fsdp2 runs only for the precisions below",
        "Fix: use Fabric(precision='bf16-mixed') (recommended)",
    )
    assert "Trainer" not in text
    refused(ValueError, lambda: Fabric(accelerator="cpu", devices=1, strategy="fsdp2", precision="64-true"), "Fabric(..., precision='64-true')")


# -- 116, 118, 119: fabric.save / fabric.load -------------------------------------------------------------------------------
def test_116_save_an_optimizer_without_its_model(tmp_path: Path) -> None:
    f = fabric()
    gen = Net()
    gen, opt_g = f.setup(gen, torch.optim.AdamW(gen.parameters()))
    disc = f.setup_module(Net(width=6))
    refused(
        ValueError,
        lambda: f.save(tmp_path / "ckpt", {"model": disc, "optimizer": opt_g}),
        "the optimizer under 'optimizer' trains no parameter of the model(s) in this state ('model')",
        "Fix: put the model it trains in the same state",
    )
    assert not (tmp_path / "ckpt").exists()


def test_117_ema_teacher_set_up_inside_another_model() -> None:
    """A frozen copy of a model set up earlier, set up inside another model: it cannot be sharded like its student."""
    f = fabric()
    student = Net()
    teacher = copy.deepcopy(student).requires_grad_(False)
    f.setup(student, torch.optim.AdamW(student.parameters()))
    refused(
        AutoShardError,
        lambda: f.setup_module(Holder(teacher)),
        "'teacher' of Holder (fabric.setup call 2) is a frozen copy of a model set up in call 1, an EMA teacher",
        "the positional EMA update would mix whole tensors with shards",
        "Fix: set the teacher up on its own (teacher = fabric.setup_module(teacher))",
    )


def test_118_save_with_filter_into_a_distributed_checkpoint(tmp_path: Path) -> None:
    f = fabric()
    model = f.setup_module(Net())
    refused(
        NotImplementedError,
        lambda: f.save(tmp_path / "ckpt", {"model": model}, filter={"model": lambda name, value: "head" in name}),
        "a filtered DCP checkpoint could not be loaded back",
        "Fix: drop filter, or use ShardingIntent(checkpoint='full')",
    )


def test_119_load_the_checkpoint_of_another_model(tmp_path: Path) -> None:
    f = fabric()
    model = f.setup_module(Net())
    f.save(tmp_path / "ckpt", {"model": model, "step": 1})
    other = f.setup_module(Net(width=6))
    refused(
        CheckpointFormatError,
        lambda: f.load(tmp_path / "ckpt", {"model": other}),
        f"cannot load {str(tmp_path / 'ckpt')!r}: its 'model' weights do not match this Net: 3 with another shape:",
        "body.0.weight (checkpoint (8, 4), model (6, 4))",
        "Fix: load a checkpoint of this model, or a model whose shapes match (strict=False skips missing and unexpected names",
    )


def test_137_memory_budget_under_fabric_is_refused_not_ignored() -> None:
    """The Trainer's strategies decide a memory budget at fit, by simulating training_step; under Fabric the step is the
    user's own loop, so Fabric's strategies refuse the budget when Fabric is built, and say how to decide it by hand."""
    for strategy in ("fsdp2", "auto-shard"):
        refused(
            IntentError,
            lambda: fabric(auto_shard(memory_budget="1GiB") if strategy == "auto-shard" else FSDP2Strategy(memory_budget="1GiB")),
            "memory_budget=1.00 GiB is decided at fit only under a Lightning Trainer",
            "under Fabric the step is your own loop, which autoshard cannot simulate, so Fabric's strategies do not decide it,"
            " and it would be ignored",
            "Fix: decide it once with autoshard.budget.decide(module, batch, intent, world_size) on a LightningModule whose"
            " training_step runs your step",
        )
