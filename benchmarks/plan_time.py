"""Time ``inspect_needs`` and ``plan_fsdp2`` on meta-device trees of 1k to 20k modules; profile whatever misses 1 s."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoshard.adapters.fsdp2 import plan_fsdp2
from autoshard.intent import ShardingIntent
from autoshard.needs import inspect_needs
from benchmarks.models import TREE_SHAPES, tree

GOAL_S = 1.0
GOAL_MODULES = 10_000


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of ``repeats`` runs: the least disturbed by the other jobs on a shared 2-core machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def hot_spots(fn: Callable[[], Any], top: int = 6) -> list[str]:
    """The functions with the most own time, as 'file:line(function) tottime / calls'."""
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    out = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in rows:
        short = path.split("/src/")[-1] if "/src/" in path else path.rsplit("/", 1)[-1]
        out.append(f"{short}:{line}({func}) own {tottime:.3f}s cum {cumtime:.3f}s calls {calls:,d}")
    return out


def run(sizes: Sequence[int] = (1_000, 5_000, 10_000, 20_000), shapes: Sequence[str] = TREE_SHAPES, repeats: int = 3) -> dict[str, Any]:
    """One row per (shape, size): module count, units, seconds for needs and plan; profiles for misses at 10k."""
    rows = []
    profiles: dict[str, dict[str, list[str]]] = {}
    warnings.simplefilter("ignore")  # root-parameter warnings are expected for some trees
    for shape in shapes:
        for size in sizes:
            with torch.device("meta"):
                module = tree(size, shape)
            count = sum(1 for _ in module.modules())
            needs = inspect_needs(module)
            plan = plan_fsdp2(module, ShardingIntent(), needs)
            needs_s = _best_of(lambda: inspect_needs(module), repeats)
            plan_s = _best_of(lambda: plan_fsdp2(module, ShardingIntent(), needs), repeats)
            rows.append(
                {"shape": shape, "modules": count, "units": len(plan.units), "ema_pairs": len(needs.ema_pairs), "needs_s": needs_s, "plan_s": plan_s}
            )
            if size == GOAL_MODULES and (plan_s >= GOAL_S or needs_s >= GOAL_S):
                profiles[shape] = {
                    "plan_fsdp2": hot_spots(lambda: plan_fsdp2(module, ShardingIntent(), needs)),
                    "inspect_needs": hot_spots(lambda: inspect_needs(module)),
                }
    return {"rows": rows, "profiles": profiles, "goal_s": GOAL_S}


def report(result: dict[str, Any]) -> list[str]:
    lines = [f"{'shape':<13} {'modules':>8} {'units':>6} {'EMA pairs':>9} {'inspect_needs':>14} {'plan_fsdp2':>11}"]
    for r in result["rows"]:
        lines.append(f"{r['shape']:<13} {r['modules']:>8,d} {r['units']:>6,d} {r['ema_pairs']:>9,d} {r['needs_s']:>13.3f}s {r['plan_s']:>10.3f}s")
    for shape, spots in result["profiles"].items():
        lines.append(f"profile, {shape} tree at {GOAL_MODULES:,d} modules (misses the {result['goal_s']:.0f} s goal):")
        for fn, rows in spots.items():
            lines.append(f"  {fn}:")
            lines += [f"    {row}" for row in rows]
    return lines
