"""One rank of tests/distributed/test_deepspeed_hsdp.py: 4 gloo processes on CPU, every scenario in them, in order.

``sync_batchnorm`` / ``plain_batchnorm``: Lightning fits under autoshard-deepspeed (ZeRO-3) with and without
``Trainer(sync_batchnorm=True)``. ``hpz``: what ZeRO++ hpZ (``zero_hpz_partition_size=2``) really partitions, against
plain ZeRO-3 on the same data: the evidence behind the matrix's "hpZ is not hybrid sharding". hpZ runs last: DeepSpeed
keeps its parameter group in a process-wide global that a later engine would pick up.
Each rank writes ``rank<R>.json``; the test asserts on those numbers.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed.deepspeed_worker import ACCUMULATE, MICRO, PG_TIMEOUT, STEPS, full_weights, make_data, make_model, sgd
from tests.distributed.harness import JOB_WORLD_SIZE, QUIET, worker_main, write_result

BN_BATCH, BN_STEPS = 8, 3


class BNNet:
    """Built lazily (lightning imported inside the scenario): BatchNorm after a Linear, so gradients flow through it."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class Net(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
                self.bn_classes: set[str] = set()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                self.bn_classes.add(type(self.net[1]).__name__)
                x, y = batch
                return F.cross_entropy(self.net(x), y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

        return Net()


def bn_data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = 2 * torch.randn(BN_BATCH * world * BN_STEPS, 8, generator=g) + torch.arange(8)  # ranks' statistics differ
    return x, (x[:, 0] > x[:, 1]).long()


def batchnorm_fit(sync: bool) -> dict[str, Any]:
    """Rank r reads samples r, r + W, ... in order: step k's global batch is rows [k * W * 8, (k + 1) * W * 8)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    t0 = time.perf_counter()
    world, rank = JOB_WORLD_SIZE, dist.get_rank()
    pl.seed_everything(9, verbose=False)
    module = BNNet.make()
    reference = copy.deepcopy(module.net)  # plain BatchNorm in one process, on each whole global batch
    x, y = bn_data(world)
    loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=BN_BATCH)
    # Threshold 0: the BatchNorm weight and bias are partitioned too, gathered by ZeRO-3 around each forward.
    strategy = AutoShardDeepSpeedStrategy(zero_overrides={"stage3_param_persistence_threshold": 0}, timeout=PG_TIMEOUT)
    trainer = pl.Trainer(
        **QUIET,
        devices=world,
        strategy=strategy,
        precision="32-true",
        sync_batchnorm=sync,
        max_steps=BN_STEPS,
        use_distributed_sampler=False,
    )
    trainer.fit(module, loader)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    chunk = BN_BATCH * world
    for k in range(BN_STEPS):
        optimizer.zero_grad()
        F.cross_entropy(reference(x[k * chunk : (k + 1) * chunk]), y[k * chunk : (k + 1) * chunk]).backward()
        optimizer.step()
    bn, ref_bn = module.net[1], reference[1]
    got = full_weights(strategy.deepspeed_engine.module)
    return {
        "bn_class_in_training": sorted(module.bn_classes),
        "bn_class_after_fit": type(bn).__name__,  # DDPStrategy.teardown, which DeepSpeedStrategy inherits, reverts it
        "engine": type(strategy.deepspeed_engine).__name__,
        "bn_weight_partitioned": int(bn.weight.ds_tensor.numel()) < int(bn.weight.ds_numel),
        "global_step": trainer.global_step,
        "running": [bn.running_mean.tolist(), bn.running_var.tolist()],
        "num_batches_tracked": [int(bn.num_batches_tracked), int(ref_bn.num_batches_tracked)],
        "running_max_diff": max(float((bn.running_mean - ref_bn.running_mean).abs().max()), float((bn.running_var - ref_bn.running_var).abs().max())),
        "weights_max_diff": max(float((got[f"net.{n}"] - p.detach()).abs().max()) for n, p in reference.named_parameters()),
        "seconds": time.perf_counter() - t0,
    }


def train(config_overrides: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """A raw ZeRO-3 engine from autoshard's config (fp32 SGD, 2 accumulated micro-batches, 10 steps)."""
    import deepspeed

    from autoshard.adapters.deepspeed import deepspeed_config
    from autoshard.intent import ShardingIntent

    t0 = time.perf_counter()
    overrides = {"stage3_param_persistence_threshold": 0, **config_overrides}  # every tensor partitioned
    config = deepspeed_config(
        ShardingIntent(precision="32-true"),
        world_size=world,
        micro_batch_size=MICRO,
        accumulate_grad_batches=ACCUMULATE,
        zero_overrides=overrides,
    )
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=sgd(model.parameters()), config=config, dist_init_required=False)
    params = dict(engine.module.named_parameters())
    x, y = make_data(rank, MICRO * ACCUMULATE * STEPS)
    secondary: dict[str, int | None] = {}
    for i in range(ACCUMULATE * STEPS):
        loss = F.mse_loss(engine(x[i * MICRO : (i + 1) * MICRO]), y[i * MICRO : (i + 1) * MICRO])
        if i == 0:  # after the first forward released the parameters: hpZ's second copy exists now
            secondary = {n: (None if p.ds_secondary_tensor is None else int(p.ds_secondary_tensor.numel())) for n, p in params.items()}
        engine.backward(loss)
        engine.step()
    optimizer = engine.optimizer
    return {
        "config_zero": config["zero_optimization"],
        "full": {n: int(p.ds_numel) for n, p in params.items()},
        "primary": {n: int(p.ds_tensor.numel()) for n, p in params.items()},
        "secondary_after_forward": secondary,
        # The optimizer's own partition: fp32 master weights (and, for Adam, its moments) live there.
        "optimizer_partition": sum(int(t.numel()) for t in optimizer.fp32_partitioned_groups_flat),
        "optimizer_group_size": dist.get_world_size(group=optimizer.dp_process_group),
        "weights": {n: t.flatten().tolist() for n, t in full_weights(engine.module).items()},
        "global_steps": int(engine.global_steps),
        "seconds": time.perf_counter() - t0,
    }


def scenario_hpz(rank: int, world: int) -> dict[str, Any]:
    plain = train({}, rank, world)
    hpz = train({"zero_hpz_partition_size": 2}, rank, world)
    diff = max(max(abs(a - b) for a, b in zip(plain["weights"][n], hpz["weights"][n])) for n in plain["weights"])
    moved = min(max(abs(a - b) for a, b in zip(plain["weights"][n], w)) for n, w in initial_weights().items())
    for run in (plain, hpz):
        del run["weights"]
    return {"plain": plain, "hpz": hpz, "max_diff_hpz_vs_plain": diff, "min_change_from_initial": moved}


def initial_weights() -> dict[str, list[float]]:
    return {n: p.detach().flatten().tolist() for n, p in make_model().named_parameters()}


def main() -> None:
    import argparse

    import deepspeed

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo", timeout=PG_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"world_size": world}
    result["sync_batchnorm"] = batchnorm_fit(sync=True)
    result["plain_batchnorm"] = batchnorm_fit(sync=False)
    result["hpz"] = scenario_hpz(rank, world)
    result["seconds_total"] = time.perf_counter() - t0
    write_result(args.out, rank, result)


if __name__ == "__main__":
    worker_main(main)
