"""Time per backward of averaging the gradients of many small unsharded parameters over 2 gloo CPU ranks: autoshard's
buckets (``average_unsharded_gradients``) against the per-parameter all_reduce it did before, in the same run.

    python benchmarks/unsharded_grads.py [--shapes 300x256,500x64] [--steps 10] [--rounds 6] [--json out.json]

A model of N parameters of K elements each (``--shapes NxK``, fp32), none sharded, 2 ranks, batch 8 per rank. Variants,
each on its own copy, in rotating order within each round: no averaging (the backward's own cost, the floor), the
per-parameter path (a post-accumulate hook: all_reduce then div_, as autoshard did), autoshard's buckets, the buckets
again (A/A control: the noise of this run), and torch DDP (25 MiB buckets, reduction overlapped with the backward) as a
reference. Ranks meet at a barrier before each timed backward; the time is rank 0's ``loss.backward()``, averaging
included. Ratios are taken within each round, then the median. Nothing asserts: it is a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

VARIANTS = ("none", "per_parameter", "buckets", "buckets_again", "ddp")
LABELS = {
    "none": "no averaging (the backward alone)",
    "per_parameter": "per-parameter all_reduce + div_ (before)",
    "buckets": "autoshard buckets (after)",
    "buckets_again": "autoshard buckets again (A/A control)",
    "ddp": "torch DDP, 25 MiB buckets (reference)",
}


def worker(args: argparse.Namespace) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from autoshard._harness import write_result
    from autoshard.adapters.fsdp2 import average_unsharded_gradients

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))

    class Many(nn.Module):
        def __init__(self, count: int, numel: int) -> None:
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(numel) / numel**0.5) for _ in range(count)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum((x * p).tanh().mean() for p in self.ps)  # type: ignore[return-value]

    def per_parameter(module: nn.Module) -> None:
        group = mesh.get_group()

        def hook(p: torch.Tensor) -> None:  # autoshard's averaging before buckets, as it was
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dist.get_world_size(group))

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(hook)

    results: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        count, numel = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        base = Many(count, numel)
        models: dict[str, nn.Module] = {name: copy.deepcopy(base) for name in VARIANTS}
        per_parameter(models["per_parameter"])
        for name in ("buckets", "buckets_again"):
            average_unsharded_gradients(models[name], mesh)
        models["ddp"] = DistributedDataParallel(models["ddp"])
        x = torch.randn(8, numel, generator=torch.Generator().manual_seed(rank))

        def backward_s(model: nn.Module, x: torch.Tensor = x) -> float:
            model.zero_grad(set_to_none=True)
            loss = model(x)
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            return time.perf_counter() - start

        for model in models.values():  # untimed pass of each: allocations, gloo buffers, DDP's first-iteration setup
            for _ in range(3):
                backward_s(model)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        per_round: list[dict[str, float]] = []
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            medians: dict[str, float] = {}
            for name in order:
                run = [backward_s(models[name]) for _ in range(args.steps)]
                times[name] += run
                medians[name] = statistics.median(run)
            per_round.append(medians)
        grads = {name: torch.cat([p.grad.flatten() for p in m.parameters()]) for name, m in models.items() if name != "none"}
        results[shape] = {
            "parameters": count,
            "numel": numel,
            "median_backward_s": {name: statistics.median(t) for name, t in times.items()},
            "per_round_median_s": per_round,
            "max_diff_vs_per_parameter": {name: float((g - grads["per_parameter"]).abs().max()) for name, g in grads.items()},
        }
    write_result(args.out, rank, results)


def report(result: dict[str, Any], steps: int, rounds: int) -> list[str]:
    lines: list[str] = []
    for r in result.values():
        med = r["median_backward_s"]
        lines.append(
            f"{r['parameters']} unsharded fp32 parameters of {r['numel']} elements ({r['parameters'] * r['numel'] * 4 / 1024:.0f} KiB),"
            f" 2 gloo ranks, batch 8; rank 0, {rounds} rotating rounds x {steps} timed backwards per variant:"
        )
        lines.append(f"  {'':<42} {'ms/backward':>12} {'averaging ms':>13}  max |grad - per-parameter|")
        for name in VARIANTS:
            extra = med[name] - med["none"]
            diff = r["max_diff_vs_per_parameter"].get(name)
            lines.append(f"  {LABELS[name]:<42} {med[name] * 1e3:12.2f} {extra * 1e3:13.2f}  {'' if diff is None else f'{diff:.1e}'}")

        def ratio(a: str, b: str, minus_floor: bool = False, rounds: list[dict[str, float]] = r["per_round_median_s"]) -> str:
            floor = lambda v: v["none"] if minus_floor else 0.0  # noqa: E731
            values = sorted((v[a] - floor(v)) / (v[b] - floor(v)) for v in rounds)
            return f"{statistics.median(values):.3f} (range {values[0]:.3f}..{values[-1]:.3f})"

        lines += [
            "  ratios: median of the same-round ratios (range over rounds)",
            f"  backward, buckets / per-parameter:            {ratio('buckets', 'per_parameter')}",
            f"  averaging alone (minus the floor), same:      {ratio('buckets', 'per_parameter', True)}",
            f"  A/A control, buckets again / buckets:         {ratio('buckets_again', 'buckets')}",
            f"  backward, buckets / DDP:                      {ratio('buckets', 'ddp')}",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None, allow_abbrev=False)
    parser.add_argument("--shapes", default="300x256,500x64", help="comma list of NxK: N parameters of K elements")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from autoshard._harness import run_workers

    command = f"python benchmarks/unsharded_grads.py --shapes {args.shapes} --steps {args.steps} --rounds {args.rounds}"
    print(f"command: {command}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-") as tmp:
        worker_args = ["--worker", "--shapes", args.shapes, "--steps", str(args.steps), "--rounds", str(args.rounds)]
        ranks = run_workers(Path(__file__), worker_args, Path(tmp), nprocs=2, timeout=900)
    print("\n".join(report(ranks[0], args.steps, args.rounds)))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "ranks": ranks}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
