"""precision="16-mixed" on FSDP2 (issue 39, item 8), in one process: the matrix says yes and auto-shard keeps fsdp2; the
Trainer and Fabric get Lightning's MixedPrecision with autoshard's sharded scaler, on CPU too (Lightning refuses
16-mixed under ModelParallelStrategy and on CPU runs bf16-mixed instead); fp16 all-gathers, fp32 reductions and
weights; a real step with a DTensor gradient beside a plain one. The 2-rank checks (against one process, skipped steps
on both ranks, resume) are tests/distributed/test_fp16.py."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autoshard import Feature, IncompatibleBackendError, MethodNeeds, ShardingIntent, Support, matrix, select_backend
from autoshard.adapters.fsdp2 import policies
from autoshard.backends import Availability
from autoshard.engine.fp16 import ShardedLossScaler
from autoshard.lightning import FSDP2Strategy, auto_shard
from autoshard.precision import resolve_precision

ALL_INSTALLED = {name: Availability(True, "installed (test)") for name in ("fsdp2", "deepspeed_zero3", "fsdp1")}
QUIET: dict[str, Any] = dict(
    accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def test_the_matrix_runs_16_mixed_on_fsdp2_and_auto_keeps_fsdp2() -> None:
    cell = matrix()["fsdp2"][Feature.FP16_MIXED]
    assert cell.support is Support.YES and "sharded grad scaler" in cell.reason and "every rank" in cell.reason
    decision = select_backend(MethodNeeds(), ShardingIntent(precision="16-mixed"), available=ALL_INSTALLED)
    assert decision.backend == "fsdp2" and not decision.caveats
    mp, _ = policies(resolve_precision("16-mixed", ShardingIntent()), ShardingIntent(), "cpu")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.float16, torch.float32)  # as bf16-mixed: low gather, fp32 reduce


@pytest.mark.parametrize("strategy", ["fsdp2", "auto-shard", "instance", "factory with the intent's precision"])
@pytest.mark.parametrize("precision", ["16-mixed", "16"])
def test_196_the_trainer_runs_16_mixed_with_a_sharded_scaler_on_cpu(strategy: str, precision: str) -> None:
    chosen: Any = {
        "instance": lambda: FSDP2Strategy(),
        "factory with the intent's precision": lambda: auto_shard(intent={"precision": "16-mixed"}),
    }.get(strategy, lambda: strategy)()
    built = pl.Trainer(strategy=chosen, precision=precision, **QUIET)
    assert isinstance(built.strategy, FSDP2Strategy)  # auto-shard does not move a 16-mixed run to DeepSpeed
    plugin = built.strategy.precision_plugin
    assert (type(plugin).__name__, plugin.precision, plugin.device) == ("MixedPrecision", "16-mixed", "cpu")  # not bf16-mixed
    assert isinstance(plugin.scaler, ShardedLossScaler)
    plan = built.strategy.precision_plan
    assert (plan.compute, plan.gather, plan.reduce, plan.master, plan.loss_scaling) == ("float16", "float16", "float32", "float32", True)


@pytest.mark.parametrize("strategy", ["fsdp2", "auto-shard"])
def test_fabric_runs_16_mixed_with_a_sharded_scaler(strategy: str) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="16-mixed")
    plugin = fabric.strategy.precision
    assert (plugin.precision, plugin.device, type(plugin.scaler)) == ("16-mixed", "cpu", ShardedLossScaler)


def test_197_a_16_mixed_plugin_passed_in_keeps_its_settings_on_a_sharded_scaler() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    mine = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7, backoff_factor=0.25))
    fabric = Fabric(accelerator="cpu", devices=1, strategy="fsdp2", plugins=[mine])
    scaler = fabric.strategy.precision.scaler
    assert fabric.strategy.precision is mine and isinstance(scaler, ShardedLossScaler)
    assert (scaler.get_scale(), scaler.get_growth_interval(), scaler.get_backoff_factor()) == (1024.0, 7, 0.25)


def test_a_precision_fsdp2_cannot_run_is_still_refused_with_16_mixed_among_the_choices() -> None:
    with pytest.raises(IncompatibleBackendError) as info:
        pl.Trainer(strategy="fsdp2", precision="64-true", **QUIET)
    text = str(info.value)
    assert "Trainer(strategy='fsdp2', precision='64-true') is not supported" in text
    assert "'bf16-mixed', '32-true', 'bf16-true', '16-mixed', '16-true'" in text
    assert text.endswith("Fix: use Trainer(precision='bf16-mixed') (recommended), or precision='16-mixed' on a GPU without bf16 (V100, T4)")


class Net(pl.LightningModule):
    """A sharded body (DTensor gradients) and a parameter on the root (kept whole: a plain gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.seen: set[torch.dtype] = set()
        self.body[0].register_forward_pre_hook(lambda module, args: self.seen.add(module.weight.dtype))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.gain * self.body(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_one_rank_trains_under_16_mixed_with_dtensor_and_plain_gradients() -> None:
    """torch's own GradScaler refuses this step ("mixed torch.Tensor and DTensor"): the scaler unscales each shard."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = pl.Trainer(strategy="fsdp2", precision="16-mixed", max_steps=3, **QUIET)
    trainer.fit(model, DataLoader(TensorDataset(0.1 * torch.randn(12, 4)), batch_size=4))
    weight = model.body[0].weight
    assert isinstance(weight, DTensor) and not isinstance(model.gain, DTensor)
    assert model.seen == {torch.float16}  # the forward sees the fp16 all-gather; the shards stay fp32
    assert weight.dtype == weight.grad.dtype == model.gain.grad.dtype == torch.float32
    scaler = trainer.precision_plugin.scaler
    assert scaler.get_scale() == 2.0**16 and scaler.state_dict()["_growth_tracker"] == 3  # three steps taken, none skipped
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    assert all(not torch.equal(after[n], before[n]) for n in before)


@pytest.mark.gpu
def test_one_gpu_trains_under_16_mixed() -> None:
    """On CUDA (nccl, torch's CUDA scaler kernels): autocast on cuda, three steps taken, every weight moved, finite."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = pl.Trainer(strategy="fsdp2", precision="16-mixed", max_steps=3, **{**QUIET, "accelerator": "gpu"})
    trainer.fit(model, DataLoader(TensorDataset(0.1 * torch.randn(12, 4)), batch_size=4))
    plugin = trainer.precision_plugin
    assert plugin.device == "cuda" and isinstance(plugin.scaler, ShardedLossScaler)
    assert model.seen == {torch.float16} and plugin.scaler.state_dict()["_growth_tracker"] == 3
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in model.named_parameters()}
    assert all(torch.isfinite(after[n]).all() and not torch.equal(after[n], before[n]) for n in before)
