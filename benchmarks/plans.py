"""Sharding plans on seven small real architectures: autoshard's plan vs the plan it made before issue 12 vs a
torchtitan-style hand-written plan, on 2 gloo ranks (``python benchmarks/run.py --only plans``).

Per model and plan, in one process pair: all-gathers and reduce-scatters per training step and their bytes
(counted by wrapping ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``, the two collectives
``fully_shard`` calls), the peak of gathered parameter bytes during a step (measured: every unit's unsharded size
while FSDP2 holds it unsharded), FSDP2's "returned a view tensor" warnings, and the step time (CPU and wall),
with autoshard's plan run twice as an A/A control and once more with explicit forward/backward prefetch.

- ``new``: ``plan_fsdp2(...).apply(module, mesh)``, as the strategy runs it.
- ``old``: the selection before issue 12 (copied below, git-free): every parameter-owning element of every
  ``nn.ModuleList`` / ``nn.Sequential`` is a unit, then each top-level subtree; every unit reshards after forward.
- ``hand``: what torchtitan writes: ``fully_shard(block, reshard_after_forward=True)`` for each block (classes
  named by hand below), then ``fully_shard(child)`` with fully_shard's default for each child of the
  LightningModule (the root cannot be sharded): each is an FSDP root, which FSDP2 keeps gathered after forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HAND_BLOCKS = {  # the block classes a person names when sharding each model by hand
    "gpt2": "GPT2Block",
    "llama": "LlamaDecoderLayer",
    "t5": "T5Block",
    "bert": "BertLayer",
    "vit": "ViTLayer",
    "convnext": "ConvNeXtBlock",
    "resnet": "Bottleneck",
}
PLANS = ("new", "old", "hand", "new_again", "new_prefetch")
BATCH = 4
WARMUP = 2


# -- the three plans: lists of (module path, reshard_after_forward), deepest first -----------------------------------
def old_units(module: Any) -> list[tuple[str, bool | None]]:
    """autoshard's selection before issue 12 (src/autoshard/adapters/fsdp2.py at 752758a), for the zoo's modules
    (no EMA, exclusions, frozen or 0-dim parameters): every unit reshards after forward (the intent's default)."""
    from torch import nn

    modules = dict(module.named_modules())
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    roots: list[str] = []

    def expand(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                expand(child, f"{prefix}{name}.")
            else:
                roots.append(f"{prefix}{name}")

    expand(module, "")
    candidates: list[str] = []
    for root in roots:
        if not any(True for _ in modules[root].parameters()):
            continue
        for name, child in modules[root].named_modules(prefix=root):
            parent = modules.get(name.rpartition(".")[0])
            if isinstance(parent, (nn.ModuleList, nn.Sequential)) and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                if any(True for _ in child.parameters()) and name not in candidates:
                    candidates.append(name)
        if root not in candidates:
            candidates.append(root)

    def exclusive(path: str) -> bool:
        return all(n == path or n.startswith(path + ".") for p in modules[path].parameters() for n in names_of[id(p)])

    order = {name: i for i, name in enumerate(modules)}
    owned: set[int] = set()
    units: list[tuple[str, bool | None]] = []
    for name in sorted((c for c in candidates if exclusive(c)), key=lambda n: (-n.count("."), order[n])):
        own = [p for p in modules[name].parameters() if id(p) not in owned and p.dim() > 0]
        owned.update(id(p) for p in own)
        if own:
            units.append((name, True))
    return units


def hand_units(module: Any, arch: str) -> list[tuple[str, bool | None]]:
    blocks = [(n, True) for n, m in module.named_modules() if type(m).__name__ == HAND_BLOCKS[arch]]
    return blocks + [(n, None) for n, child in module.named_children() if any(True for _ in child.parameters())]


def new_plan(module: Any) -> Any:
    from autoshard import ShardingIntent, inspect_needs
    from autoshard.adapters.fsdp2 import plan_fsdp2

    return plan_fsdp2(module, ShardingIntent(precision="32-true"), inspect_needs(module))


def apply_units(module: Any, units: list[tuple[str, bool | None]], mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for name, reshard in units:
        fully_shard(module.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)


def explicit_prefetch(module: Any, plan: Any) -> None:
    """torchtitan's explicit prefetch (its expert-parallel path): each block prefetches the next one in forward and
    the previous one in backward."""
    blocks = [module.get_submodule(u.name) for u in plan.units if u.kind.value == "block"]
    for current, following in zip(blocks, blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


# -- measuring ------------------------------------------------------------------------------------------------------
class Meter:
    """Counts collectives and bytes, and tracks the gathered bytes FSDP2 holds, while ``on`` is set."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.on = False
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self.bytes = {"all_gather": 0, "reduce_scatter": 0}
        self.gathered: dict[int, int] = {}
        self.peak = 0
        meter = self
        gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

        def all_gather_single(output_tensor: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            meter._count("all_gather", output_tensor)
            return gather(output_tensor, input_tensor, *args, **kwargs)

        def reduce_scatter_single(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            meter._count("reduce_scatter", input)
            return scatter(output, input, *args, **kwargs)

        dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
        unsharded, sharded, post_forward = FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded, FSDPParamGroup._to_sharded_post_forward

        def to_unsharded(group: Any) -> None:
            unsharded(group)
            meter._hold(group, True)

        def to_sharded(group: Any) -> None:
            sharded(group)
            meter._hold(group, False)

        def to_sharded_post_forward(group: Any) -> None:
            post_forward(group)
            meter._hold(group, False)

        FSDPParamGroup._to_unsharded, FSDPParamGroup._to_sharded = to_unsharded, to_sharded
        FSDPParamGroup._to_sharded_post_forward = to_sharded_post_forward

    def _count(self, kind: str, t: Any) -> None:
        if self.on:
            self.counts[kind] += 1
            self.bytes[kind] += t.numel() * t.element_size()

    def _hold(self, group: Any, held: bool) -> None:
        if held:
            self.gathered[id(group)] = sum(p.sharded_param.numel() * p.sharded_param.element_size() for p in group.fsdp_params)
        else:
            self.gathered.pop(id(group), None)
        if self.on:
            self.peak = max(self.peak, sum(self.gathered.values()))

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)
        self.bytes = dict.fromkeys(self.bytes, 0)
        self.peak = sum(self.gathered.values())


def build(arch: str, plan_name: str, mesh: Any) -> dict[str, Any]:
    import torch

    from benchmarks.arch_models import ARCHS

    torch.manual_seed(0)
    module = ARCHS[arch]()
    if plan_name == "old":
        units = old_units(module)
        apply_units(module, units, mesh)
    elif plan_name == "hand":
        units = hand_units(module, arch)
        apply_units(module, units, mesh)
    else:
        plan = new_plan(module)
        plan.apply(module, mesh)
        units = [(u.name, u.reshard_after_forward) for u in plan.units]
        if plan_name == "new_prefetch":
            explicit_prefetch(module, plan)
    rank = int(os.environ["RANK"])
    return {
        "module": module,
        "units": units,
        "optimizer": torch.optim.SGD(module.parameters(), lr=1e-2),
        "batch": module.batch(BATCH, seed=rank),
        "views": set(),
    }


def step(run: dict[str, Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    module, optimizer = run["module"], run["optimizer"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.training_step(run["batch"], 0).backward()
    optimizer.step()
    optimizer.zero_grad()
    run["views"] |= {str(w.message).split("(")[1].split(")")[0] for w in caught if "returned a view tensor" in str(w.message)}
    return time.perf_counter() - wall, time.process_time() - cpu


def worker() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--archs", default="gpt2,llama,t5,bert,vit,convnext,resnet")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard._harness import write_result

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    meter = Meter()
    result: dict[str, Any] = {}
    for arch in args.archs.split(","):
        runs = {name: build(arch, name, mesh) for name in PLANS}
        measured: dict[str, Any] = {}
        for name, run in runs.items():
            for _ in range(WARMUP):  # the first step initializes FSDP2's roots
                step(run)
            meter.reset()
            meter.on = True
            step(run)
            meter.on = False
            measured[name] = {
                "units": run["units"],
                "collectives": dict(meter.counts),
                "bytes": dict(meter.bytes),
                "peak_gathered": meter.peak,
                "views": sorted(run["views"]),
                "wall": [],
                "cpu": [],
            }
        for r in range(args.rounds):  # rotate the order, so that no plan always runs first
            names = PLANS[r % len(PLANS) :] + PLANS[: r % len(PLANS)]
            for name in names:
                times = [step(runs[name]) for _ in range(args.steps)]
                measured[name]["wall"].append(statistics.median(t[0] for t in times))
                measured[name]["cpu"].append(statistics.median(t[1] for t in times))
        result[arch] = measured
    write_result(args.out, dist.get_rank(), result)


# -- the report (run.py) --------------------------------------------------------------------------------------------
def _ratio(rounds_a: list[float], rounds_b: list[float]) -> tuple[float, float, float]:
    """Median of the same-round ratios, and their range."""
    ratios = sorted(a / b for a, b in zip(rounds_a, rounds_b))
    return statistics.median(ratios), ratios[0], ratios[-1]


def bench_plans(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    from autoshard._harness import run_workers

    steps, rounds = (4, 2) if quick else (10, 5)
    ranks = run_workers(Path(__file__), ["--steps", str(steps), "--rounds", str(rounds)], work / "plans", nprocs=2, timeout=1500)
    r0 = ranks[0]
    kib = lambda n: f"{n / 1024:.0f}"  # noqa: E731
    lines = [
        f"sharding plans, 2 gloo ranks, fp32, SGD, batch {BATCH} per rank, rank 0; per step: all-gathers (AG) and reduce-scatters"
        " (RS), KiB all-gathered + reduce-scattered, peak KiB of parameters held gathered (measured); CPU ms/step: median"
        f" over {rounds} rotating rounds x {steps} steps",
        f"  {'model':<9} {'plan':<6} {'units':>5} {'AG':>4} {'RS':>4} {'KiB/step':>9} {'peak KiB':>9} {'CPU ms':>7} {'wall ms':>8}  view warnings",
    ]
    summary: dict[str, Any] = {}
    for arch, measured in r0.items():
        for name in ("new", "old", "hand"):
            m = measured[name]
            c, b = m["collectives"], m["bytes"]
            lines.append(
                f"  {arch:<9} {name:<6} {len(m['units']):>5} {c['all_gather']:>4} {c['reduce_scatter']:>4}"
                f" {kib(b['all_gather'] + b['reduce_scatter']):>9} {kib(m['peak_gathered']):>9}"
                f" {statistics.median(m['cpu']) * 1e3:>7.1f} {statistics.median(m['wall']) * 1e3:>8.1f}  {', '.join(m['views']) or '-'}"
            )
        new, hand = measured["new"], measured["hand"]
        row = {
            "collectives_new": sum(new["collectives"].values()),
            "collectives_hand": sum(hand["collectives"].values()),
            "collectives_old": sum(measured["old"]["collectives"].values()),
            "peak_new_over_hand": new["peak_gathered"] / hand["peak_gathered"],
            "cpu_new_over_hand": _ratio(new["cpu"], hand["cpu"]),
            "cpu_old_over_hand": _ratio(measured["old"]["cpu"], hand["cpu"]),
            "cpu_aa": _ratio(measured["new_again"]["cpu"], new["cpu"]),
            "cpu_prefetch_over_new": _ratio(measured["new_prefetch"]["cpu"], new["cpu"]),
            "wall_new_over_hand": _ratio(new["wall"], hand["wall"]),
            "wall_aa": _ratio(measured["new_again"]["wall"], new["wall"]),
            "wall_prefetch_over_new": _ratio(measured["new_prefetch"]["wall"], new["wall"]),
        }
        summary[arch] = row
    show = lambda r: f"{r[0]:.3f} ({r[1]:.2f}..{r[2]:.2f})"  # noqa: E731
    lines += [
        "  ratios (median of same-round ratios, range): goals: collectives new <= hand + 1, peak new <= hand, step new / hand within A/A",
        f"  {'model':<9} {'coll. new/hand/old':>18} {'peak new/hand':>13} {'CPU new/hand':>19} {'CPU A/A':>19} {'CPU old/hand':>19}"
        f" {'CPU prefetch/new':>19} {'wall new/hand':>19} {'wall A/A':>19}",
    ]
    for arch, s in summary.items():
        coll = f"{s['collectives_new']}/{s['collectives_hand']}/{s['collectives_old']}"
        within = abs(s["cpu_new_over_hand"][0] - 1) <= max(abs(s["cpu_aa"][0] - 1), s["cpu_aa"][2] - s["cpu_aa"][1])
        s["met"] = {
            "collectives": s["collectives_new"] <= s["collectives_hand"] + 1,
            "peak": s["peak_new_over_hand"] <= 1.0,
            "step": s["cpu_new_over_hand"][0] <= 1.0 or within,
        }
        lines.append(
            f"  {arch:<9} {coll:>18} {s['peak_new_over_hand']:>13.3f} {show(s['cpu_new_over_hand']):>19} {show(s['cpu_aa']):>19}"
            f" {show(s['cpu_old_over_hand']):>19} {show(s['cpu_prefetch_over_new']):>19} {show(s['wall_new_over_hand']):>19}"
            f" {show(s['wall_aa']):>19}  goals: {', '.join(k + (' met' if v else ' MISSED') for k, v in s['met'].items())}"
        )
    return {"ranks": ranks, "summary": summary}, lines


if __name__ == "__main__":
    worker()
