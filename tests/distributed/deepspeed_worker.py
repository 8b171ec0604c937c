"""One rank of the DeepSpeed CPU checks; spawned twice by test_deepspeed_engine.py with torchrun-style env vars.

``engine``: a raw ZeRO-3 engine from autoshard's ``deepspeed_config`` trains. ``lightning``: a Trainer with
AutoShardDeepSpeedStrategy trains with automatic, then manual optimization, in the same processes.
Each rank writes ``rank<R>.json`` into the output directory; the test asserts on those numbers.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch
from torch import nn

PG_TIMEOUT = timedelta(seconds=int(os.environ.get("AUTOSHARD_TEST_PG_TIMEOUT", "90")))
IN, HIDDEN = 256, 512  # HIDDEN x IN = 131072 elements: above ZeRO-3's default persistence threshold (1e5)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank, as a real job loading one checkpoint
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_data(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(IN, 1, generator=g) / IN**0.5
    g.manual_seed(100 + rank)  # each rank its own slice of the data, as a DistributedSampler gives
    x = torch.randn(n, IN, generator=g)
    return x, torch.tanh(x @ w)


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gather every ZeRO-3 partition and copy the full tensors (collective: every rank must call it)."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().float().clone() for name, p in params.items()}


def partition_report(module: nn.Module) -> dict[str, dict[str, Any]]:
    return {
        name: {"full": int(p.ds_numel), "local": int(p.ds_tensor.numel()), "placeholder": int(p.numel())}
        for name, p in module.named_parameters()
    }


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float((after[name] - before[name]).abs().max()) for name in before}


MICRO, ACCUMULATE, STEPS = 16, 2, 10


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def sgd(params: Any) -> torch.optim.Optimizer:
    # Linear in the gradient, so a comparison is exact to rounding (Adam amplifies rounding where grads are ~0).
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference_weights(world: int) -> dict[str, torch.Tensor]:
    """Plain single-process fp32 training on the union of every rank's micro-batches: what ZeRO-3 must reproduce."""
    model = make_model()
    optimizer = sgd(model.parameters())
    data = [make_data(r, MICRO * ACCUMULATE * STEPS) for r in range(world)]
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(ACCUMULATE):
            i = (step * ACCUMULATE + micro) * MICRO
            x = torch.cat([d[0][i : i + MICRO] for d in data])
            y = torch.cat([d[1][i : i + MICRO] for d in data])
            (nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_engine(precision: str | None, rank: int, world: int, make_optimizer: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    import deepspeed

    from autoshard.adapters.deepspeed import deepspeed_config
    from autoshard.intent import ShardingIntent

    t0 = time.perf_counter()
    config = deepspeed_config(ShardingIntent(precision=precision), world_size=world, micro_batch_size=MICRO, accumulate_grad_batches=ACCUMULATE)
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    before = full_weights(engine.module)
    x, y = make_data(rank, MICRO * ACCUMULATE * STEPS)
    x_eval, y_eval = make_data(99, 64)  # the same held-out batch on both ranks
    dtype = next(engine.module.parameters()).dtype

    def eval_loss() -> float:
        with torch.no_grad():  # a ZeRO-3 forward gathers partitions: every rank runs it
            return float(nn.functional.mse_loss(engine(x_eval.to(dtype)).float(), y_eval))

    eval_before = eval_loss()
    losses: list[float] = []
    for step in range(STEPS):
        step_losses = []
        for micro in range(ACCUMULATE):
            i = (step * ACCUMULATE + micro) * MICRO
            loss = nn.functional.mse_loss(engine(x[i : i + MICRO].to(dtype)).float(), y[i : i + MICRO])
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
    eval_after = eval_loss()
    after = full_weights(engine.module)
    result = {
        "config": config,
        "param_dtype": str(dtype),
        # gathering really reassembles the partitions: the full weights equal the model's initial ones
        "gathered_equals_initial": all(torch.equal(before[n], initial[n].to(dtype).float()) for n in initial),
        "losses": losses,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "global_steps": int(engine.global_steps),
        "partition": partition_report(engine.module),
        "max_change": changed(before, after),
        "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
        "seconds": time.perf_counter() - t0,
    }
    return result, after


def run_engine(out: Path, rank: int) -> dict[str, Any]:
    import deepspeed

    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo", timeout=PG_TIMEOUT)
    world = torch.distributed.get_world_size()
    results: dict[str, Any] = {"world_size": world, "seconds_init_distributed": time.perf_counter() - t0}
    results["bf16-mixed"], _ = train_engine(None, rank, world, adamw)  # None: the intent's default precision
    results["32-true"], trained = train_engine("32-true", rank, world, sgd)
    reference = reference_weights(world)
    results["32-true"]["max_diff_vs_single_process"] = max(float((trained[n] - reference[n]).abs().max()) for n in reference)
    results["seconds_total"] = time.perf_counter() - t0
    return results


def run_lightning(out: Path, rank: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    class Regressor(pl.LightningModule):
        def __init__(self, manual: bool) -> None:
            super().__init__()
            self.net = make_model()
            self.automatic_optimization = not manual
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses.append(float(loss.detach()))
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    world = int(os.environ["WORLD_SIZE"])  # Lightning's environment teardown deletes WORLD_SIZE after a fit
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for mode in ("automatic", "manual"):
        t = time.perf_counter()
        accumulate = 2 if mode == "automatic" else 1  # DeepSpeed, not Lightning, accumulates: check both agree
        module = Regressor(manual=mode == "manual")
        x, y = make_data(0, 96)  # 6 batches of 8 per rank: 3 steps x 2 accumulated
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        strategy = AutoShardDeepSpeedStrategy({"precision": "32-true"}, timeout=PG_TIMEOUT)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            precision="32-true",
            max_steps=3,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=1.0 if mode == "automatic" else None,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        before = {n: p.detach().clone() for n, p in module.named_parameters()}  # plain tensors before setup
        x_eval, y_eval = make_data(99, 64)
        with torch.no_grad():
            eval_before = float(nn.functional.mse_loss(module.net(x_eval), y_eval))
        trainer.fit(module, loader)
        engine = strategy.deepspeed_engine
        with torch.no_grad():  # a ZeRO-3 forward gathers partitions: every rank runs it
            eval_after = float(nn.functional.mse_loss(engine.module.net(x_eval), y_eval))
        after = full_weights(engine.module)
        results[mode] = {
            "engine": type(engine).__name__,
            "config": strategy.config,
            "stage": strategy.config["zero_optimization"]["stage"],
            "root_device": str(strategy.root_device),
            "process_group_backend": torch.distributed.get_backend(),
            "global_step": trainer.global_step,
            "engine_global_steps": int(engine.global_steps),
            "losses": module.losses,
            "eval_loss_before": eval_before,
            "eval_loss_after": eval_after,
            "partition": partition_report(engine.module),
            "max_change": changed(before, after),
            "finite": all(bool(torch.isfinite(t).all()) for t in after.values()) and all(map(math.isfinite, module.losses)),
            "seconds": time.perf_counter() - t,
        }
    results["seconds_total"] = time.perf_counter() - t0
    return results


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    result = {"engine": run_engine, "lightning": run_lightning}[mode](out, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
