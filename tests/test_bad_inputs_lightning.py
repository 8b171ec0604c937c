"""The bad-input catalog, rows 85-99 (docs/bad-inputs.md): what ``import autoshard`` changes, and what the selector
promises.

FSDP1 is refused where a run is configured, never where a class is built; every change to Lightning can be undone;
a Lightning that lacks a hooked member keeps its own strategies; a refusal is never swallowed; and what a backend
does only partly is a warning, not an info line. One process, ``devices=1``; each test restores what it changes.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers the strategies and guards
import autoshard.lightning as al
from autoshard.errors import BackendUnavailableError, IntentError
from autoshard.lightning import FSDP2Strategy
from autoshard.privates.in_lightning import PIN, check_lightning

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.fixture(autouse=True)
def isolated_environment() -> Iterator[None]:
    """In-process fits set MASTER_PORT & co.: undo them after each test. The 1-rank process group stays for the
    module (tests/conftest.py drops it, through DeepSpeed's own destroy once DeepSpeed has used it): a second engine
    in this process needs the world group DeepSpeed cached."""
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)


def trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **kwargs})


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Validated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).pow(2).mean()


class TwoViews(Net):
    """Two augmented views through the same network, losses summed (SimCLR / BYOL's online side)."""

    autoshard_needs = {"multi_forward": True}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        return self.body(x).pow(2).mean() + self.body(x + 0.1).pow(2).mean()


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


def autoshard_warnings(run: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if str(w.message).startswith("autoshard")]


@contextmanager
def reinstalled() -> Iterator[None]:
    """autoshard uninstalled for the block; afterwards (whatever happened) Lightning and autoshard as before."""
    al.uninstall()
    check_lightning.cache_clear()
    try:
        yield
    finally:
        al.uninstall()
        check_lightning.cache_clear()
        al.register()


# -- 85-87: what `import autoshard` changes -----------------------------------------------------------------------------
def test_85_fsdp_strategy_built_outside_a_trainer() -> None:
    """stable-pretraining's own tests build FSDPStrategy() to test their refusal: with autoshard imported it builds."""
    from lightning.pytorch.strategies import FSDPStrategy

    assert type(FSDPStrategy()) is FSDPStrategy
    assert type(FSDPStrategy(cpu_offload=True)) is FSDPStrategy


def test_86_autoshard_names_after_uninstall() -> None:
    with reinstalled():
        with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='fsdp2'`"):
            trainer(strategy="fsdp2")  # Lightning's own text: the name is gone
        with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
            trainer(strategy="fsdp")  # Lightning's own CPU refusal, no redirect
        al.register()  # the fix
        assert isinstance(trainer(strategy="fsdp2").strategy, FSDP2Strategy)


@needs_deepspeed
def test_87_deepspeed_on_a_lightning_without_a_hooked_member(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    with reinstalled():
        monkeypatch.delattr(DeepSpeedStrategy, "_init_optimizers")
        said = autoshard_warnings(al.register)
        assert len(said) == 1 and "it lacks DeepSpeedStrategy._init_optimizers" in said[0], said
        assert type(trainer(strategy="deepspeed").strategy) is DeepSpeedStrategy  # the user's choice, untouched
        with pytest.raises(BackendUnavailableError) as info:
            trainer(strategy="autoshard-deepspeed")
        text = str(info.value)
        assert "lacks DeepSpeedStrategy._init_optimizers, which autoshard's DeepSpeed strategies hook" in text
        assert text.endswith(f"Fix: {PIN}")
        monkeypatch.undo()  # the member is back before autoshard installs again


# -- 88: a refusal is not swallowed ---------------------------------------------------------------------------------------
@needs_deepspeed
def test_88_a_precision_plugin_autoshard_cannot_plan_under_lightnings_deepspeed_name() -> None:
    """It was swallowed: the method was then checked against the default bf16-mixed, a precision the run does not use."""
    from lightning.pytorch.plugins import DoublePrecision

    with pytest.raises(IntentError) as info:
        trainer(strategy="deepspeed_stage_3", plugins=[DoublePrecision()])
    text = str(info.value)
    assert text.startswith("DeepSpeed ZeRO stage 3 (GuardedDeepSpeedStrategy) cannot run precision '64-true' (from the Trainer's DoublePrecision)")
    assert "knows only bf16-mixed, 32-true, bf16-true, 16-mixed, 16-true" in text
    assert text.endswith("Fix: drop the DoublePrecision plugin and set Trainer(precision='bf16-mixed') (or another listed precision)")


# -- 89-92: partial support is a warning ------------------------------------------------------------------------------------
def test_89_offload_optimizer_under_fsdp2_offloads_the_parameters_too() -> None:
    model = Validated()
    run = trainer(strategy=FSDP2Strategy(offload="optimizer"), precision="32-true", max_steps=2, limit_val_batches=1)
    said = autoshard_warnings(lambda: (run.fit(model, data()), run.validate(model, data(), verbose=False)))
    assert run.global_step == 2  # it runs: a caveat, not a refusal
    assert said == [
        (
            "autoshard: partial support on fsdp2 for CPU offload of optimizer state only [offload='optimizer']: FSDP2 has"
            " no optimizer-only offload; CPUOffloadPolicy offloads parameters, gradients and optimizer state together and"
            " runs the optimizer step on CPU. Fix: use offload='params' to accept that, or strategy='autoshard-deepspeed'"
            " if the method has one optimizer and no EMA teacher"
        )
    ]  # once: validate after fit says nothing again


def test_90_bf16_true_under_fsdp2_has_no_fp32_master_copy() -> None:
    run = trainer(strategy="fsdp2", precision="bf16-true")
    said = autoshard_warnings(lambda: run.fit(Net(), data()))
    assert len(said) == 1, said
    assert said[0].startswith(
        "autoshard: partial support on fsdp2 for bf16 weights (bf16-true) [precision='bf16-true']: the"
        " module is converted to bf16 (Lightning's meaning of bf16-true): no fp32 master copy"
    )
    assert said[0].endswith(
        "Fix: use precision='bf16-mixed' (fp32 weights, bf16 compute and all-gather), or"
        " strategy='autoshard-deepspeed' if the method has one optimizer and no EMA teacher"
    )
    # Rank 0 only: on 2 gloo ranks, tests/distributed/test_deepspeed_multi_forward.py (rank 1 says nothing).


@needs_deepspeed
@pytest.mark.parametrize("strategy", ["deepspeed_stage_3", "autoshard-deepspeed"])
def test_91_several_forwards_per_step_under_zero3(strategy: str) -> None:
    """The matrix said "no" and nothing refused it. Measured (tests/distributed/test_deepspeed_multi_forward.py): it
    trains like one process; the prefetch trace is lost every step. So it runs, with that caveat as a warning."""
    run = trainer(strategy=strategy, precision="32-true")
    model = TwoViews()
    said = autoshard_warnings(lambda: run.fit(model, data()))
    assert run.global_step == 1 and type(run.strategy.model).__name__ == "DeepSpeedEngine"
    (caveat,) = [w for w in said if "several forwards per step" in w]
    assert caveat.startswith(
        "autoshard: partial support on deepspeed_zero3 for several forwards per step [declared"
        " multi_forward=True]: trains correctly: measured on 2 ranks"
    )
    assert "invalidates its parameter prefetch trace at every such step" in caveat
    assert "Fix: use strategy='fsdp2' (or strategy='auto-shard')" in caveat


@needs_deepspeed
def test_92_reshard_after_forward_false_under_zero3_is_warned() -> None:
    """ZeRO-3 has no reshard_after_forward and autoshard sets nothing for it: the field was accepted without a word.
    Now the matrix's caveat is a warning, with its Fix; fsdp2, which honours the field, says nothing."""
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    run = trainer(strategy=AutoShardDeepSpeedStrategy(reshard_after_forward=False), precision="32-true")
    said = autoshard_warnings(lambda: run.fit(Net(), data()))
    assert run.global_step == 1 and type(run.strategy.model).__name__ == "DeepSpeedEngine"  # it runs: a caveat
    (caveat,) = [w for w in said if "reshard_after_forward" in w]
    assert caveat.startswith(
        "autoshard: partial support on deepspeed_zero3 for parameters kept gathered until backward"
        " (reshard_after_forward=False) [reshard_after_forward=False]: ZeRO-3 has no such switch, and autoshard sets"
        " nothing for the field"
    )
    assert "within stage3_max_reuse_distance elements of the trace (1,000,000,000, DeepSpeed's default)" in caveat
    assert caveat.endswith(
        "Fix: set zero_overrides={'stage3_max_reuse_distance': N} on the strategy to choose how many elements ahead"
        " ZeRO-3 keeps parameters for (0 releases each module's after its forward), or use strategy='fsdp2' (or"
        " strategy='auto-shard') for reshard_after_forward=False"
    )
    kept = trainer(strategy=FSDP2Strategy(reshard_after_forward=False), precision="32-true")
    assert autoshard_warnings(lambda: kept.fit(Net(), data())) == []


@needs_deepspeed
def test_178_keep_gathered_fix_is_not_what_the_user_already_set() -> None:
    """With zero_overrides={'stage3_max_reuse_distance': N} already set, the caveat's Fix still said to set it. Now it
    names the user's distance and only the Fix left: fsdp2."""
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    strategy = AutoShardDeepSpeedStrategy(reshard_after_forward=False, zero_overrides={"stage3_max_reuse_distance": 0})
    run = trainer(strategy=strategy, precision="32-true")
    said = autoshard_warnings(lambda: run.fit(Net(), data()))
    (caveat,) = [w for w in said if "reshard_after_forward" in w]
    assert "within stage3_max_reuse_distance elements of the trace (0, set by zero_overrides)" in caveat
    assert "zero_overrides={" not in caveat and "DeepSpeed's default" not in caveat
    assert caveat.endswith("Fix: use strategy='fsdp2' (or strategy='auto-shard') for reshard_after_forward=False")
    from autoshard.backends.deepspeed import keep_gathered_cell

    assert "trace (1,000,000,000, set by zero_overrides)" in keep_gathered_cell(1e9).reason  # YAML's float, as a count
