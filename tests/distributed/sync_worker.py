"""One rank of the "ranks never silently hold different models" checks; every scenario runs in this process pair.

Launched by tests/distributed/test_sync.py through the harness (torchrun-style environment), or with ``--cuda`` by
Lightning's own launcher on a machine with 2 GPUs. Each scenario returns what THIS rank holds; the test compares ranks.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from autoshard.demo import ema_update
from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import JOB_WORLD_SIZE, QUIET, quiet_trainer, run_scenarios, worker_main, write_result


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def plain_state(module: nn.Module) -> dict[str, list[float]]:
    """Every tensor this rank holds whole (non-DTensor parameters and buffers), as it holds it."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.detach().float().flatten().tolist() for n, t in tensors if not isinstance(t, DTensor)}


def pair_equal(teacher: nn.Module, student: nn.Module) -> bool:
    pairs = zip((*teacher.parameters(), *teacher.buffers()), (*student.parameters(), *student.buffers()))
    return all(torch.equal(full(t.detach()), full(s.detach())) for t, s in pairs)  # collective: every rank runs it


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.gain = nn.Parameter(torch.randn(()))  # 0-dim: fully_shard cannot shard it, it stays whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)) * self.gain


class Mixed(pl.LightningModule):
    """Everything a plan keeps whole: a root parameter, a tied embedding, 0-dim parameters, an excluded probe, a
    random buffer; plus an EMA teacher/student pair with BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.embed = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight
        self.student = Tower()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.probe = nn.Linear(8, 3)
        self.register_buffer("noise", torch.randn(8))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        h = self.embed(ids) * self.scale + self.noise
        s = self.student(h)
        with torch.no_grad():
            t = self.teacher(h)
        return F.cross_entropy(self.out(s), ids) + F.mse_loss(s, t) + self.probe(s.detach()).square().mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        ema_update(self.teacher, self.student, 0.9)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def shard_towers(module: nn.Module, dp_mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for tower in (module.student, module.teacher):
        fully_shard(tower.fc, mesh=dp_mesh, reshard_after_forward=True)  # a root unit: reshard explicitly (EMA zip)


class MixedShardedInConfigureModel(Mixed):
    def configure_model(self) -> None:
        shard_towers(self, self.device_mesh["data_parallel"])


def _setup_broadcast(model: Mixed, strategy: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class AtStart(pl.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            seen["at_setup"] = plain_state(pl_module)
            seen["teacher_equals_student"] = pair_equal(pl_module.teacher, pl_module.student)

    t = quiet_trainer(strategy=strategy, max_steps=2, callbacks=[AtStart()])
    t.fit(model, DataLoader(TensorDataset(torch.arange(64) % 16), batch_size=8))
    seen["after_fit"] = plain_state(model)
    seen["sharded"] = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    return seen


# Ranks whose random state differs (no common seed): every scenario below seeds rank by rank on purpose.
def scenario_broadcast_plan() -> dict[str, Any]:
    torch.manual_seed(100 + dist.get_rank())
    return _setup_broadcast(Mixed(), FSDP2Strategy(intent={"exclude": ["probe"]}))


def scenario_broadcast_parallelize_fn() -> dict[str, Any]:
    torch.manual_seed(200 + dist.get_rank())
    return _setup_broadcast(Mixed(), FSDP2Strategy(parallelize_fn=lambda m, mesh: shard_towers(m, mesh["data_parallel"])))


def scenario_broadcast_configure_model() -> dict[str, Any]:
    torch.manual_seed(300 + dist.get_rank())
    return _setup_broadcast(MixedShardedInConfigureModel(), "fsdp2")


class BNNet(pl.LightningModule):
    """``bn_first``: BatchNorm on the raw input, so its running statistics depend on the data alone."""

    def __init__(self, bn_first: bool) -> None:
        super().__init__()
        layers = [nn.BatchNorm1d(8), nn.Linear(8, 16)] if bn_first else [nn.Linear(8, 16), nn.BatchNorm1d(16)]
        self.net = nn.Sequential(*layers, nn.ReLU(), nn.Linear(16, 2))
        self.seen: dict[str, list[list[float]]] = {"train_step_start": [], "validation": []}

    def bn(self) -> nn.Module:
        return self.net[0] if isinstance(self.net[0], nn.BatchNorm1d) else self.net[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train_step_start"].append(self.bn().running_mean.tolist())
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["validation"].append(self.bn().running_mean.tolist())
        self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def bn_data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = 2 * torch.randn(n, 8, generator=g) + torch.arange(8)  # per-feature means, so per-rank statistics differ
    return TensorDataset(x, (x[:, 0] > x[:, 1]).long())


def ordered_loader(data: TensorDataset, batch_size: int) -> DataLoader:
    """Rank r gets samples r, r + W, ...: step k's global batch is samples [2 * bs * k, 2 * bs * (k + 1))."""
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


def scenario_buffers() -> dict[str, Any]:
    """BatchNorm buffers under different per-rank batches: at each step, in validation, in a checkpoint, after fit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = Path.cwd()
    seen: dict[str, Any] = {}

    class SaveMidway(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:  # after a forward: every rank's BatchNorm just updated its own statistics
                trainer.save_checkpoint(out / "mid.ckpt")
                seen["after_save"] = pl_module.bn().running_mean.tolist()

    pl.seed_everything(7, verbose=False)
    model = BNNet(bn_first=True)
    t = quiet_trainer(strategy="fsdp2", max_steps=4, val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0, callbacks=[SaveMidway()])
    data = bn_data()
    t.fit(model, ordered_loader(data, 8), ordered_loader(data, 8))
    seen.update(model.seen, final=model.bn().running_mean.tolist(), final_var=model.bn().running_var.tolist())
    seen["plan_buffers"] = t.strategy.plan.to_dict().get("buffers")  # .get: the same worker runs on older code
    if dist.get_rank() == 0:
        dcp_to_torch_save(out / "mid.ckpt", out / "mid.pt")
        seen["in_checkpoint"] = torch.load(out / "mid.pt", weights_only=False)["state_dict"]["net.0.running_mean"].tolist()
        # DDP's rule, "rank 0's buffers": BatchNorm over rank 0's batches only (indices 0, 2, 4, ...), alone.
        reference = nn.BatchNorm1d(8)
        for k in range(4):
            reference(data.tensors[0][16 * k : 16 * (k + 1) : 2])
        seen["rank0_reference"] = [reference.running_mean.tolist(), reference.running_var.tolist()]
    return seen


def scenario_sync_batchnorm() -> dict[str, Any]:
    """Trainer(sync_batchnorm=True): 2 ranks x 8 samples must match 1 process x the 16 samples (statistics, weights)."""
    pl.seed_everything(9, verbose=False)
    model = BNNet(bn_first=False)
    reference = copy.deepcopy(model)
    steps = 4
    t = quiet_trainer(strategy="fsdp2", sync_batchnorm=True, max_steps=steps)
    data = bn_data()
    t.fit(model, ordered_loader(data, 8))
    opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    for k in range(steps):
        x, y = data[16 * k : 16 * (k + 1)]
        opt.zero_grad()
        F.cross_entropy(reference.net(x), y).backward()
        opt.step()
    bn, ref_bn = model.bn(), reference.bn()
    got = {n: full(p.detach()) for n, p in model.named_parameters()}
    return {
        "bn_class": type(bn).__name__,
        "running": [bn.running_mean.tolist(), bn.running_var.tolist(), int(bn.num_batches_tracked)],
        "running_max_diff": max(float((bn.running_mean - ref_bn.running_mean).abs().max()), float((bn.running_var - ref_bn.running_var).abs().max())),
        "num_batches_tracked": [int(bn.num_batches_tracked), int(ref_bn.num_batches_tracked)],
        "weights_max_diff": max(float((got[n] - p.detach()).abs().max()) for n, p in reference.named_parameters()),
        "plan_buffers": t.strategy.plan.to_dict().get("buffers"),
        "plan_text": t.strategy.plan.describe(),
    }


class MetaNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.body(batch[0])).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def meta_result(model: MetaNet, seen: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import _random

    weight, bias = seen["weight"], seen["bias"]
    half = weight.shape[0] // 2
    return {
        "weight_halves_equal": torch.equal(weight[:half], weight[half:]),
        "bias_halves_equal": torch.equal(bias[:half], bias[half:]),
        "weight_std": [float(weight[:half].std()), float(weight[half:].std())],
        "weight_max_abs": float(weight.abs().max()),
        "bound": 64**-0.5,  # nn.Linear(64, ...): kaiming_uniform(a=sqrt(5)) draws from U(-1/sqrt(64), 1/sqrt(64))
        "local_rows": list(model.body.weight.to_local().shape),
        "tracker_left": type(_random._rng_tracker).__name__ if _random._rng_tracker is not None else None,
        "rng_after_setup": seen["rng"],
    }


class MetaSnapshot(pl.Callback):
    """At fit start (after setup): the whole of ``body``'s weight and bias, and two draws from the generator."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen["weight"], self.seen["bias"] = (full(p.detach()).cpu() for p in (pl_module.body.weight, pl_module.body.bias))
        self.seen["rng"] = torch.rand(2).tolist()  # every rank's generator must have advanced alike


def meta_fit(**trainer_kwargs: Any) -> dict[str, Any]:
    """Same seed on every rank, built on meta, sharded and materialized by the strategy."""
    pl.seed_everything(8, verbose=False)
    snapshot = MetaSnapshot()
    trainer = pl.Trainer(**{**QUIET, "devices": JOB_WORLD_SIZE, "strategy": "fsdp2", "max_steps": 1, **trainer_kwargs}, callbacks=[snapshot])
    with trainer.init_module(empty_init=True):
        model = MetaNet()
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(64, 64, generator=torch.Generator().manual_seed(0))), batch_size=8))
    return meta_result(model, snapshot.seen)


def scenario_meta_init() -> dict[str, Any]:
    return meta_fit()


def cuda_main(out: str) -> None:
    """``--cuda``: the meta-init check on 2 GPUs (nccl), launched by Lightning itself; each rank writes its JSON."""
    result = meta_fit(accelerator="gpu", devices=2)
    write_result(out, dist.get_rank(), result)


SCENARIOS = {
    "broadcast_plan": scenario_broadcast_plan,
    "broadcast_parallelize_fn": scenario_broadcast_parallelize_fn,
    "broadcast_configure_model": scenario_broadcast_configure_model,
    "buffers": scenario_buffers,
    "sync_batchnorm": scenario_sync_batchnorm,
    "meta_init": scenario_meta_init,
}


if __name__ == "__main__":
    if "--cuda" in sys.argv:
        worker_main(lambda: cuda_main(sys.argv[sys.argv.index("--out") + 1]))
    else:
        assert JOB_WORLD_SIZE == 2, JOB_WORLD_SIZE
        run_scenarios(SCENARIOS)
