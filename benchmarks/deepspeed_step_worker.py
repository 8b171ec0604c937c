"""One rank of the DeepSpeed step benchmark on CPU: autoshard-deepspeed against the GPU benchmark's hand-tuned ZeRO-3
config, the same small Hugging Face Llama, bf16-mixed, 2 gloo ranks (DeepSpeed's CPU accelerator).

The rows are the GPU benchmark's (benchmarks/gpu_worker.py): ``deepspeed`` (autoshard's defaults), ``deepspeed-knobs``
(with the tuned bucket, prefetch and persistence sizes), ``deepspeed-matched`` (every zero key of the tuned config and
its bf16 gradient reduction: DeepSpeed reads the same config), and ``tuned``: the tuned config handed to Lightning's
DeepSpeedStrategy under its own name, ``strategy=DeepSpeedStrategy(config=...)`` (autoshard's subclass registered for
Lightning's names: Lightning's own refuses a CPU). matched / tuned is what autoshard itself costs a DeepSpeed step.
Every variant runs in the same process pair, rotating, so machine noise hits each alike. Launched by run.py.
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

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpu_worker import module_class, strategy_for, tuned_deepspeed_config  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402,F401  registers the strategies
from autoshard._harness import write_result  # noqa: E402
from autoshard.engine.deepspeed import restore_functional_linear  # noqa: E402
from autoshard.lightning.deepspeed import GuardedDeepSpeedStrategy  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
WARMUP = 3
SHAPES = {"layers": 4, "hidden": 256, "ffn": 688, "heads": 4, "kv_heads": 2, "vocab": 2000, "seq": 128, "micro_batch": 4}
NAMES = ("deepspeed", "deepspeed-knobs", "deepspeed-matched", "tuned", "deepspeed_again")


class StepTimer(pl.Callback):
    """Wall and CPU time of each training batch (forward, backward, DeepSpeed's step)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._start = self._cpu = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.wall.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._cpu)


def strategy(name: str, args: argparse.Namespace) -> tuple[Any, type]:
    if name == "tuned":
        return GuardedDeepSpeedStrategy(config=tuned_deepspeed_config(args)), module_class(args)
    return strategy_for(name.removesuffix("_again"), args)


def run_variant(name: str, steps: int, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    pl.seed_everything(0, verbose=False)
    chosen, module_cls = strategy(name, args)
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=chosen,
        accelerator="cpu",
        devices=WORLD,
        precision="bf16-mixed",
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (steps * args.micro_batch * WORLD, args.seq), generator=g)
    module = module_cls()
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=args.micro_batch))
    restore_functional_linear()  # a Trainer of Lightning's own names leaves ZeRO-3's linear in the process
    return timer.wall[WARMUP:], timer.cpu[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ns = argparse.Namespace(**SHAPES, meta=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    wall: dict[str, list[float]] = {n: [] for n in NAMES}
    cpu: dict[str, list[float]] = {n: [] for n in NAMES}
    per_round: list[tuple[int, str, float, float]] = []
    for name in NAMES:  # one untimed pass each: the first fits of a process run slow (allocator, caches)
        run_variant(name, WARMUP + 1, ns)
    for r in range(args.rounds):
        k = r % len(NAMES)
        for name in NAMES[k:] + NAMES[:k]:  # rotate, so no variant always runs first
            w, c = run_variant(name, args.steps + WARMUP, ns)
            wall[name] += w
            cpu[name] += c
            per_round.append((r, name, statistics.median(w), statistics.median(c)))
    write_result(
        args.out,
        RANK,
        {
            "median_step_s": {k: statistics.median(v) for k, v in wall.items()},
            "median_step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "steps_timed": {k: len(v) for k, v in wall.items()},
            "per_round_median_s": per_round,
            "parameters": sum(p.numel() for p in module_class(ns)().parameters()),
            "shapes": SHAPES,
        },
    )


if __name__ == "__main__":
    main()
