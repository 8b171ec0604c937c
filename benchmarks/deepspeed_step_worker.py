"""One rank of the DeepSpeed step benchmark on CPU: autoshard-deepspeed against the GPU benchmark's hand-tuned ZeRO-3
config, the same small Hugging Face Llama, bf16-mixed, 2 gloo ranks (DeepSpeed's CPU accelerator).

The rows are the GPU benchmark's (benchmarks/gpu_worker.py): ``deepspeed`` (autoshard's defaults), ``deepspeed-knobs``
(with the tuned bucket, prefetch and persistence sizes), ``deepspeed-matched`` (every zero key of the tuned config and
its bf16 gradient reduction: DeepSpeed reads the same config), and ``tuned``: the tuned config handed to Lightning's
DeepSpeedStrategy under its own name, ``strategy=DeepSpeedStrategy(config=...)`` (autoshard's subclass registered for
Lightning's names: Lightning's own refuses a CPU). matched / tuned is what autoshard itself costs a DeepSpeed step.
``fsdp2`` (``strategy="auto-shard"``, which picks fsdp2 for this module) is the same model under FSDP2: with the
work each step dispatches (``OpCounter``: operators, collectives, host syncs, casts), what ZeRO-3 costs that FSDP2
does not. Every variant runs in the same process pair, rotating, so machine noise hits each alike. Launched by run.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
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
from gpu_worker import leaf_blocks, matched_deepspeed_arguments, module_class, strategy_for, tuned_deepspeed_config  # noqa: E402
from step_worker import StepTimer  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402,F401  registers the strategies
from autoshard._harness import write_result  # noqa: E402
from autoshard.engine.deepspeed import restore_functional_linear  # noqa: E402
from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy, GuardedDeepSpeedStrategy  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
WARMUP = 3
# Every weight over the tuned config's persistence threshold (1e6 elements), as in the GPU benchmark's model: a
# smaller one would be kept whole by that row and not by the others.
SHAPES = {"layers": 2, "hidden": 1024, "ffn": 2816, "heads": 8, "kv_heads": 8, "vocab": 2000, "seq": 32, "micro_batch": 2}
# Host time: the same rows on 16 decoder layers too small for their kernels to count, so a step's time is what the
# host spends driving it (hooks, fetch and release, launches): where a GPU waits on the host. Every weight partitioned
# (persistence threshold 0), as in the GPU benchmark's model.
HOST_SHAPES = {"layers": 16, "hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 4, "vocab": 256, "seq": 16, "micro_batch": 2}
HOST = ("fsdp2", "deepspeed-matched", "deepspeed-leaf")  # -leaf: each decoder layer a ZeRO-3 leaf module
NAMES = ("deepspeed", "deepspeed-knobs", "deepspeed-matched", "tuned", "deepspeed_again", "fsdp2")
COUNTED = ("fsdp2", "deepspeed-matched", "deepspeed")


class OpCounter(TorchDispatchMode):
    """What one training step dispatches: operators (views aside; each one kernel or more on a GPU), collectives and
    the bytes they carry, host syncs (``.item()``, ``bool(tensor)``: each waits for the GPU) and dtype casts."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.counts["collectives"] += 1
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.counts["collective_bytes"] += max((t.numel() * t.element_size() for t in tensors), default=0)
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.counts["host_syncs"] += 1
        else:
            for source, target in casts(func, args, kwargs or {}, out):
                self.counts["casts"] += 1
                self.counts["cast_bytes"] += source.numel() * (source.element_size() + target.element_size())
        if not func.is_view:
            self.counts["operators"] += 1
        return out


def casts(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, result) of each dtype change an op makes: ``.to(dtype)``, and a copy into a tensor of another dtype
    (FSDP2 casts its shards into the all-gather buffer so)."""
    aten = torch.ops.aten
    if func is aten._to_copy.default and "dtype" in kwargs and kwargs["dtype"] != args[0].dtype:
        return [(args[0], out)]
    if func is aten.copy_.default and args[0].dtype != args[1].dtype:
        return [(args[1], args[0])]
    if func is aten._foreach_copy_.default:
        return [(src, dst) for dst, src in zip(args[0], args[1]) if dst.dtype != src.dtype]
    return []


class CountStep(pl.Callback):
    """``OpCounter`` over training batch ``WARMUP`` (forward, backward, optimizer step), on each rank."""

    def __init__(self) -> None:
        self.mode = OpCounter()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == WARMUP:
            self.mode.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == WARMUP:
            self.mode.__exit__(None, None, None)


def fused(module_cls: type) -> type:
    """The benchmark's module with AdamW(fused=True) on CPU too, as on the GPU: the single-tensor AdamW reads each
    parameter's step count with ``.item()``, a host sync per parameter that the GPU run never makes."""

    class Fused(module_cls):  # type: ignore[valid-type,misc]
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)

    return Fused


def strategy(name: str, args: argparse.Namespace) -> tuple[Any, type]:
    if args.host and name in ("deepspeed-matched", "deepspeed-leaf"):
        arguments = matched_deepspeed_arguments(args)
        overrides = {**arguments["zero_overrides"], "stage3_param_persistence_threshold": 0}
        module_cls = fused(module_class(args))
        chosen = AutoShardDeepSpeedStrategy(reduce_dtype=arguments["reduce_dtype"], zero_overrides=overrides)
        return chosen, leaf_blocks(module_cls) if name == "deepspeed-leaf" else module_cls
    if name == "fsdp2":
        chosen, module_cls = strategy_for("auto-shard", args)
    elif name == "tuned":
        chosen, module_cls = GuardedDeepSpeedStrategy(config=tuned_deepspeed_config(args)), module_class(args)
    else:
        chosen, module_cls = strategy_for(name.removesuffix("_again"), args)
    return chosen, fused(module_cls)


def run_variant(name: str, steps: int, args: argparse.Namespace, extra: list[pl.Callback] | None = None) -> tuple[list[float], list[float]]:
    pl.seed_everything(0, verbose=False)
    chosen, module_cls = strategy(name, args)
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=chosen,
        accelerator="cpu",
        devices=WORLD,
        precision="bf16-mixed",
        max_steps=steps,
        callbacks=[timer, *(extra or [])],
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
    return timer.times[WARMUP:], timer.cpu[WARMUP:]


def rotated(
    names: tuple[str, ...], rounds: int, steps: int, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[tuple[int, str, float, float]]]:
    """Each variant's timed steps (wall, CPU) over ``rounds`` rounds, the order rotated each round so no variant
    always runs first; and each round's medians."""
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    per_round: list[tuple[int, str, float, float]] = []
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            w, c = run_variant(name, steps + WARMUP, args)
            wall[name] += w
            cpu[name] += c
            per_round.append((r, name, statistics.median(w), statistics.median(c)))
    return wall, cpu, per_round


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ns = argparse.Namespace(**SHAPES, meta=False, host=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    for name in NAMES:  # one untimed pass each: the first fits of a process run slow (allocator, caches)
        run_variant(name, WARMUP + 1, ns)
    wall, cpu, per_round = rotated(NAMES, args.rounds, args.steps, ns)
    host_wall, host_cpu, _ = rotated(HOST, args.rounds, 2 * args.steps, argparse.Namespace(**HOST_SHAPES, meta=False, host=True))
    counted = {}
    for name in COUNTED:
        counter = CountStep()
        run_variant(name, WARMUP + 1, ns, [counter])
        counted[name] = dict(counter.mode.counts)
    write_result(
        args.out,
        RANK,
        {
            "median_step_s": {k: statistics.median(v) for k, v in wall.items()},
            "median_step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "steps_timed": {k: len(v) for k, v in wall.items()},
            "per_round_median_s": per_round,
            "per_step": counted,
            "host_step_s": {k: statistics.median(v) for k, v in host_wall.items()},
            "host_step_cpu_s": {k: statistics.median(v) for k, v in host_cpu.items()},
            "host_shapes": HOST_SHAPES,
            "parameters": sum(p.numel() for p in module_class(ns)().parameters()),
            "shapes": SHAPES,
        },
    )


if __name__ == "__main__":
    main()
