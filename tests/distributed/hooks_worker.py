"""One rank of the "user hooks, called exactly as Lightning calls them" checks under FSDP2 (fsdp2 and auto-shard).

Launched by tests/distributed/test_hooks.py through the harness; every scenario runs in this one process pair and
records its error instead of raising, so that one failure still leaves the others' results.
stable-pretraining's patterns are reproduced without installing it: a probe callback that wraps
``pl_module.configure_optimizers`` in its ``setup`` and asserts the wrapped method runs once, and an EMA teacher
updated by a callback with the positional zip.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers "fsdp2" and "auto-shard"
from autoshard import ShardingIntent
from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import quiet_trainer, run_scenarios

RANK = int(os.environ["RANK"])
IN, DIM, OUT, CLASSES = 8, 16, 8, 3


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def weights(module: nn.Module) -> list[float]:
    """The full parameters, flattened (collective for DTensors: every rank calls it)."""
    return torch.cat([full(p.detach()).float().flatten() for p in module.parameters()]).tolist()


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, IN, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def loader() -> DataLoader:
    return DataLoader(data(), batch_size=8)  # Lightning adds a DistributedSampler: each rank its own samples


class Encoder(nn.Module):
    """Blocks plus layers on the encoder root itself: under fully_shard the root group owns parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.out(x)


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float = 0.5) -> None:
    for t, s in zip(teacher.parameters(), student.parameters()):  # the positional zip every EMA method uses
        t.mul_(momentum).add_(s.detach(), alpha=1 - momentum)


class EMACallback(pl.Callback):
    """The teacher follows the student after every step (stable-pretraining's TeacherStudentCallback does this)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        ema_update(pl_module.teacher, pl_module.student)


class WrappingProbe(pl.Callback):
    """stable-pretraining's OnlineProbe pattern: in setup() it adds a probe to the module and wraps its
    configure_optimizers to append the probe's optimizer; the wrapper asserts (bare) that it runs only once."""

    def __init__(self) -> None:
        self.calls = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if getattr(pl_module, "probe", None) is None:
            pl_module.probe = nn.Linear(OUT, CLASSES)
        original = pl_module.configure_optimizers

        def configure_optimizers() -> list[torch.optim.Optimizer]:
            self.calls += 1
            assert self.calls == 1
            return [*original(), torch.optim.SGD(pl_module.probe.parameters(), lr=0.1)]

        pl_module.configure_optimizers = configure_optimizers


class EMAWithProbe(pl.LightningModule):
    """A BYOL-like method stepping every optimizer by hand, as stable-pretraining's Module does."""

    def __init__(self) -> None:
        super().__init__()
        self.student = Encoder()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = self.student(x)
        with torch.no_grad():
            target = self.teacher(x + 0.1)
        loss = F.mse_loss(z, target) + F.cross_entropy(self.probe(z.detach()), y)
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.student.parameters(), lr=0.1)]


def recorded(fn: Any) -> Any:
    """Run one scenario; an exception becomes {"error": "Type: message"} (both ranks fail alike at setup)."""

    def run() -> dict[str, Any]:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            return {"error": f"{type(exc).__name__}: {exc}"}

    run.__name__ = fn.__name__
    return run


def probe_once(strategy: str) -> dict[str, Any]:
    """Item 1 under FSDP2: the probe's wrapped configure_optimizers runs once, and the method trains."""
    pl.seed_everything(0, verbose=False)
    model, probe = EMAWithProbe(), WrappingProbe()
    teacher_before = weights(model.teacher)
    t = quiet_trainer(strategy=strategy, max_steps=3, callbacks=[probe, EMACallback()])
    t.fit(model, loader())
    return {
        "calls": probe.calls,
        "optimizers": t.strategy.needs.describe_optimizers(),
        "decision": t.strategy.decision.describe(),
        "teacher_changed": weights(model.teacher) != teacher_before,
        "teacher": weights(model.teacher),
        "probe": weights(model.probe),
    }


class ShardsItself(pl.LightningModule):
    """configure_model shards with fully_shard's defaults (as stable-pretraining's Module does under any
    ModelParallelStrategy); the head stays unsharded and trainable; the teacher follows by EMA (callback)."""

    def __init__(self, shard_in_configure_model: bool = True) -> None:
        super().__init__()
        self.student = Encoder()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.head = nn.Linear(OUT, CLASSES)
        self.shard_in_configure_model = shard_in_configure_model

    def configure_model(self) -> None:
        if self.shard_in_configure_model:
            shard_encoders(self, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = self.student(x)
        with torch.no_grad():
            target = self.teacher(x + 0.1)
        return F.mse_loss(z, target) + F.cross_entropy(self.head(z), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.student.parameters(), *self.head.parameters()], lr=0.1)


def shard_encoders(module: nn.Module, device_mesh: Any) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(module.student, FSDPModule):
        return
    mesh = device_mesh["data_parallel"]
    for encoder in (module.student, module.teacher):
        for block in encoder.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(encoder, mesh=mesh)  # default reshard_after_forward: the root stays gathered after forward


def sharded_by_user(strategy: Any, module: ShardsItself) -> dict[str, Any]:
    """Item 2: trains 2 ranks, the teacher changes, ranks agree (the head's gradients are averaged)."""
    teacher_before, head_before = weights(module.teacher), weights(module.head)
    t = quiet_trainer(strategy=strategy, max_steps=3, callbacks=[EMACallback()])
    t.fit(module, loader())
    x = torch.randn(4, IN)
    with torch.no_grad():  # a forward without backward (validation-like): every unit must be sharded again after
        module.student(x)
    return {
        "plan": t.strategy.plan is None,
        "teacher_is_dtensor": all(isinstance(p, DTensor) for p in module.teacher.parameters()),
        "student_sharded_after_no_grad_forward": all(isinstance(p, DTensor) for p in module.student.parameters()),
        "head_is_plain": not isinstance(module.head.weight, DTensor),
        "teacher_changed": weights(module.teacher) != teacher_before,
        "head_changed": weights(module.head) != head_before,
        "teacher": weights(module.teacher),
        "head": weights(module.head),
    }


def scenario_configure_model_shards() -> dict[str, Any]:
    pl.seed_everything(1, verbose=False)
    return sharded_by_user("fsdp2", ShardsItself())


def scenario_parallelize_fn_shards() -> dict[str, Any]:
    pl.seed_everything(2, verbose=False)
    return sharded_by_user(FSDP2Strategy(parallelize_fn=shard_encoders), ShardsItself(shard_in_configure_model=False))


class ReadsAWeight(pl.LightningModule):
    """Item 4: ``self.child.weight`` is used without calling ``self.child``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.child = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.embed(x))
        h = F.linear(h, self.child.weight, self.child.bias)
        return F.cross_entropy(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def scenario_direct_weight_read() -> dict[str, Any]:
    pl.seed_everything(3, verbose=False)
    out: dict[str, Any] = {}
    try:
        quiet_trainer(strategy="fsdp2", max_steps=2).fit(ReadsAWeight(), loader())
        out["error"] = ""
    except Exception as exc:  # noqa: BLE001
        out["error"], out["message"] = type(exc).__name__, str(exc)
        out["cause"] = f"{type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else ""
    model = ReadsAWeight()  # the fix the message gives trains
    fixed = quiet_trainer(strategy=FSDP2Strategy(intent=ShardingIntent(exclude=["child"])), max_steps=2)
    fixed.fit(model, loader())
    out["fixed_trains"] = fixed.global_step == 2 and not isinstance(model.child.weight, DTensor)
    return out


SCENARIOS = {
    "probe_once_fsdp2": recorded(lambda: probe_once("fsdp2")),
    "probe_once_auto_shard": recorded(lambda: probe_once("auto-shard")),
    "configure_model_shards": recorded(scenario_configure_model_shards),
    "parallelize_fn_shards": recorded(scenario_parallelize_fn_shards),
    "direct_weight_read": recorded(scenario_direct_weight_read),
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
