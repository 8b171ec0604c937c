"""One rank of the "several forwards per step under ZeRO-3" measurement; launched by test_deepspeed_multi_forward.py.

A raw DeepSpeed ZeRO-3 engine (DS_ACCELERATOR=cpu, gloo, every parameter partitioned) trains a method whose step
forwards the engine several times before one backward, in three shapes seen in self-supervised methods: two
augmented views with the losses summed (SimCLR, BYOL's online side), multi-crop (two views plus a batch of another
size, DINO / SwAV), and a ``no_grad`` forward followed by a training forward (a target from the same network).
Each is compared with plain torch in one process on the global batch (fp32 SGD, so the comparison is exact to
rounding), and with a one-forward step, for the gathered bytes and trace-cache invalidations per step.
Each rank writes ``rank<R>.json``; the test asserts on those numbers.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch
from torch import nn

from tests.distributed.harness import QUIET, worker_main, write_result

PG_TIMEOUT = timedelta(seconds=int(os.environ.get("AUTOSHARD_TEST_PG_TIMEOUT", "90")))
IN, HIDDEN, MICRO, STEPS = 32, 64, 8, 6


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, noise for view 2, local crops (2 per sample), y) of one rank: its own slice, as a DistributedSampler gives."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(IN, 1, generator=g) / IN**0.5
    g.manual_seed(100 + rank)
    n = MICRO * STEPS
    x = torch.randn(n, IN, generator=g)
    return x, 0.1 * torch.randn(n, IN, generator=g), 0.3 * torch.randn(2 * n, IN, generator=g), torch.tanh(x @ w)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


# Each step: (model, x, noise, crops, y) -> loss, with one backward after; crops hold 2 rows per sample of x.
def one_forward(
    model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, noise: torch.Tensor, crops: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    return mse(model(x), y)


def two_views(
    model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, noise: torch.Tensor, crops: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    return mse(model(x), y) + mse(model(x + noise), y)


def multi_crop(
    model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, noise: torch.Tensor, crops: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    local = model(crops)  # another batch size: 2 local crops per sample
    return mse(model(x), y) + mse(model(x + noise), y) + mse(local, y.repeat(2, 1))


def no_grad_target(
    model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, noise: torch.Tensor, crops: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        target = model(x + noise)
    return mse(model(x), 0.5 * (y + target))


METHODS = {"one_forward": one_forward, "two_views": two_views, "multi_crop": multi_crop, "no_grad_target": no_grad_target}


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # linear in the gradient: exact to rounding


def global_batch(world: int, step: int) -> tuple[torch.Tensor, ...]:
    """Every rank's micro-batch of ``step``, concatenated in rank order (local crops rank by rank too)."""
    parts = [rank_data(r) for r in range(world)]
    s = slice(step * MICRO, (step + 1) * MICRO)
    c = slice(2 * step * MICRO, 2 * (step + 1) * MICRO)
    x, noise, crops, y = (torch.cat([p[i][c if i == 2 else s] for p in parts]) for i in range(4))
    return x, noise, crops, y


def reference(method: str, world: int) -> dict[str, torch.Tensor]:
    """One process on the global batch: each loss term is a mean over equal per-rank sizes, so it is the mean of the
    ranks' terms, and DeepSpeed averages the ranks' gradients."""
    model = make_model()
    optimizer = sgd(model.parameters())
    for step in range(STEPS):
        x, noise, crops, y = global_batch(world, step)
        if method == "multi_crop":  # y.repeat(2, 1) must pair each rank's crops with that rank's targets
            yr = torch.cat([y[r * MICRO : (r + 1) * MICRO].repeat(2, 1) for r in range(world)])
            loss = mse(model(x), y) + mse(model(x + noise), y) + mse(model(crops), yr)
        else:
            loss = METHODS[method](model, x, noise, crops, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().float().clone() for name, p in params.items()}


class Counters:
    """Elements all-gathered (ZeRO-3's parameter fetches) and trace-cache invalidations, while installed."""

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        self.gathered = 0
        self.invalidations = 0
        self._comm, self._coordinator = ds_comm, PartitionedParameterCoordinator
        # ZeRO-3 fetches through the package's names (partition_parameters: ``from deepspeed import comm as dist``);
        # allgather_fn reaches comm.comm's own all_gather_into_tensor, so nothing is counted twice.
        self._saved = (ds_comm.allgather_fn, ds_comm.all_gather_into_tensor, ds_comm.all_gather, PartitionedParameterCoordinator._invalidate_trace)

        allgather_fn, gather_into, gather_list, invalidate = self._saved

        def allgather_fn_counted(output_tensor: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.gathered += output_tensor.numel()
            return allgather_fn(output_tensor, input_tensor, *args, **kwargs)

        def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.gathered += output_tensor.numel()
            return gather_into(output_tensor, input_tensor, *args, **kwargs)

        def all_gather(tensor_list: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.gathered += sum(t.numel() for t in tensor_list)
            return gather_list(tensor_list, tensor, *args, **kwargs)

        def _invalidate_trace(coordinator: Any) -> None:
            self.invalidations += 1
            invalidate(coordinator)

        ds_comm.allgather_fn, ds_comm.all_gather_into_tensor, ds_comm.all_gather = allgather_fn_counted, all_gather_into_tensor, all_gather
        PartitionedParameterCoordinator._invalidate_trace = _invalidate_trace

    def remove(self) -> None:
        comm = self._comm
        comm.allgather_fn, comm.all_gather_into_tensor, comm.all_gather, self._coordinator._invalidate_trace = self._saved


# DeepSpeed's defaults keep a small model's gathered parameters live through the step; "tight" releases each module's
# parameters as soon as it is done and prefetches nothing, so every forward and backward must re-gather them.
TIGHT = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def train(method: str, rank: int, world: int, tight: bool = False) -> dict[str, Any]:
    import deepspeed

    from autoshard.adapters.deepspeed import deepspeed_config
    from autoshard.intent import ShardingIntent

    t0 = time.perf_counter()
    # Every parameter partitioned (the default threshold keeps small ones whole), fp32, no clipping: exact compare.
    config = deepspeed_config(
        ShardingIntent(precision="32-true"),
        world_size=world,
        micro_batch_size=MICRO,
        zero_overrides={"stage3_param_persistence_threshold": 0, **(TIGHT if tight else {})},
    )
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=sgd(model.parameters()), config=config, dist_init_required=False)
    forwards = [0]
    engine.module.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    x, noise, crops, y = rank_data(rank)
    counters = Counters()
    per_step: list[dict[str, int]] = []
    losses: list[float] = []
    try:
        for step in range(STEPS):
            s = slice(step * MICRO, (step + 1) * MICRO)
            c = slice(2 * step * MICRO, 2 * (step + 1) * MICRO)
            before = (counters.gathered, counters.invalidations, forwards[0])
            loss = METHODS[method](engine, x[s], noise[s], crops[c], y[s])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            per_step.append(
                {
                    "gathered": counters.gathered - before[0],
                    "invalidations": counters.invalidations - before[1],
                    "forwards": forwards[0] - before[2],
                }
            )
    finally:
        counters.remove()
    trained = full_weights(engine.module)
    expected = reference(method, world)
    return {
        "max_diff_vs_single_process": max(float((trained[n] - expected[n]).abs().max()) for n in expected),
        "max_change": max(float((expected[n] - p.detach()).abs().max()) for n, p in make_model().named_parameters()),
        "per_step": per_step,
        "losses": losses,
        "global_steps": int(engine.global_steps),
        # every parameter split: ceil(n / world) elements here (a 1-element bias cannot be split further)
        "partitioned": all(int(p.ds_tensor.numel()) == -(-int(p.ds_numel) // world) for p in engine.module.parameters()),
        "total_params": sum(int(p.ds_numel) for p in engine.module.parameters()),
        "seconds": time.perf_counter() - t0,
    }


def run_lightning(rank: int, world: int) -> dict[str, Any]:
    """The same two-view step through Trainer(strategy="autoshard-deepspeed"), the method declaring several forwards:
    it trains (no refusal), equals one process, and the caveat is a warning, on rank 0 only."""
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    class TwoViews(pl.LightningModule):
        autoshard_needs = {"multi_forward": True}

        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, noise, y = batch
            return two_views(self.net, x, noise, x, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

    t0 = time.perf_counter()
    x, noise, _, y = rank_data(rank)
    strategy = AutoShardDeepSpeedStrategy(zero_overrides={"stage3_param_persistence_threshold": 0}, timeout=PG_TIMEOUT)
    trainer = pl.Trainer(devices=world, strategy=strategy, precision="32-true", max_steps=STEPS, use_distributed_sampler=False, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TwoViews(), DataLoader(TensorDataset(x, noise, y), batch_size=MICRO))
    trained = full_weights(strategy.deepspeed_engine.module)
    expected = {f"net.{n}": p for n, p in reference("two_views", world).items()}
    return {
        "engine": type(strategy.deepspeed_engine).__name__,
        "global_step": trainer.global_step,
        "decision": strategy.decision.backend if strategy.decision else None,
        "max_diff_vs_single_process": max(float((trained[n] - expected[n]).abs().max()) for n in expected),
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("autoshard: ")],
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import deepspeed

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    deepspeed.init_distributed(dist_backend="gloo", timeout=PG_TIMEOUT)
    world = torch.distributed.get_world_size()
    result = {method: train(method, rank, world) for method in METHODS}
    result.update({f"{method}_tight": train(method, rank, world, tight=True) for method in ("one_forward", "two_views")})
    result["lightning"] = run_lightning(rank, world)
    write_result(args.out, rank, result)


if __name__ == "__main__":
    worker_main(main)
