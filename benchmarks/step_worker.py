"""One rank of the step-time and model-state benchmark: autoshard's strategy="fsdp2" vs a hand-written fully_shard.

Both variants run in the same process pair, alternating, so machine noise hits both alike. Launched by run.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402,F401  registers strategy="fsdp2"
from autoshard._harness import write_result  # noqa: E402
from autoshard.demo import Blobs, DinoLike, OnlineProbe  # noqa: E402
from autoshard.intent import ShardingIntent  # noqa: E402
from autoshard.lightning import FSDP2Strategy  # noqa: E402
from autoshard.memory import EstimateOptions, estimate_memory  # noqa: E402
from autoshard.needs import inspect_needs  # noqa: E402
from benchmarks.models import HandCompiled, HandShardedResharding, HandShardedStepModel, StepModel  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
WARMUP = 3


def held_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Local bytes of params, grads and every optimizer state tensor (DTensor.to_local for shards)."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    size = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    total = sum(size(p) for p in module.parameters()) + sum(size(p.grad) for p in module.parameters() if p.grad is not None)
    return total + sum(size(v) for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v))


class StepTimer(pl.Callback):
    """Wall time of each training batch (forward, backward, optimizer step), after the warm-up steps."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start = self._cpu = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Wall time is what users wait for; CPU time of this process is less disturbed by other jobs on the machine.
        self.times.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._cpu)


class Held(pl.Callback):
    def __init__(self, extra: list[Any] | None = None) -> None:
        self.extra = extra or []
        self.bytes = 0

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        optimizers += [c.optimizer for c in self.extra if getattr(c, "optimizer", None) is not None]
        self.bytes = held_bytes(pl_module, optimizers)


def trainer(strategy: Any, steps: int, callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        precision="32-true",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )


def step_data(steps: int, batch: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = steps * batch * WORLD
    return DataLoader(TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)), batch_size=batch)


def run_variant(name: str, steps: int) -> tuple[list[float], list[float], int]:
    pl.seed_everything(0, verbose=False)
    timer, held = StepTimer(), Held()
    if name.startswith("autoshard"):
        model, strategy = StepModel(), FSDP2Strategy(compile="compile" in name)
    else:
        hand = {"hand_reshard": HandShardedResharding, "hand_default": HandShardedStepModel, "hand_compile": HandCompiled}
        model = hand[name]()
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer(strategy, steps, [timer, held]).fit(model, step_data(steps))
    return timer.times[WARMUP:], timer.cpu[WARMUP:], held.bytes


def model_states_dino() -> dict[str, Any]:
    """The demo's EMA method with its probe: replicated probe and scalars make it a little over total / N."""
    with torch.device("meta"):
        twin, twin_probe = DinoLike(), OnlineProbe()
        twin_probe.setup(None, twin, "fit")
    estimate = estimate_memory(
        twin,
        ShardingIntent(precision="32-true"),
        inspect_needs(twin, callbacks=[twin_probe]),
        WORLD,
        callbacks=[twin_probe],
        options=EstimateOptions(rank=RANK),
    )
    pl.seed_everything(0, verbose=False)
    probe = OnlineProbe()
    held = Held([probe])
    trainer("fsdp2", 3, [probe, held]).fit(DinoLike(), DataLoader(Blobs(n=96), batch_size=16))
    return {"held": held.bytes, "estimate": estimate.model_states, "ideal": estimate.ideal}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compile", action="store_true", help="compile=True against each block compiled by hand")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    # "..._again" is the same as the first: its ratio to it is the noise floor of this machine, this run.
    names = (
        ("autoshard_compile", "hand_compile", "autoshard_compile_again")
        if args.compile
        else ("autoshard", "hand_reshard", "hand_default", "autoshard_again")
    )
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    held: dict[str, int] = {}
    per_round: list[tuple[int, str, float, float]] = []
    for name in names:  # one untimed pass each: the first fits of a process run slow (allocator, caches)
        run_variant(name, WARMUP + 2)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate, so no variant always runs first
            wall, used, held[name] = run_variant(name, args.steps + WARMUP)
            times[name] += wall
            cpu[name] += used
            per_round.append((r, name, statistics.median(wall), statistics.median(used)))
    with torch.device("meta"):
        twin = StepModel()
    estimate = estimate_memory(twin, ShardingIntent(precision="32-true"), None, WORLD, options=EstimateOptions(rank=RANK))
    write_result(
        args.out,
        RANK,
        {
            "median_step_s": {k: statistics.median(v) for k, v in times.items()},
            "median_step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "steps_timed": {k: len(v) for k, v in times.items()},
            "per_round_median_s": per_round,
            "step_model": {
                "held": held,
                "estimate": estimate.model_states,
                "ideal": estimate.ideal,
                "parameters": sum(p.numel() for p in twin.parameters()),
            },
            **({} if args.compile else {"dino": model_states_dino()}),
        },
    )


if __name__ == "__main__":
    main()
