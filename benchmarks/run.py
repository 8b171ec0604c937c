"""autoshard benchmarks, one command: ``python benchmarks/run.py [--quick] [--only step,compile,deepspeed,comm,plans,plan,rss] [--json out.json]``.

Every ratio is measured in this run (never against a number from elsewhere): step time of strategy="fsdp2" vs a
hand-written fully_shard of the same model, autoshard-deepspeed's step vs a hand-tuned ZeRO-3 config, per-rank model-state bytes vs total / N, bytes all-gathered and
reduced per step under bf16-mixed (bf16 vs fp32 all-gather), plan time on big trees, and setup peak RSS with
meta-device init vs building the model whole. Not timed tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autoshard._harness import run_workers  # noqa: E402

HERE = Path(__file__).resolve().parent
GOALS = {"compile_ratio": 1.02, "deepspeed_ratio": 1.03, "step_ratio": 1.03, "state_ratio": 1.02, "plan_10k_s": 1.0}
BENCHES = ("step", "compile", "deepspeed", "comm", "rss", "plans", "plan")  # rss before plan: the plan trees grow this process


def machine() -> dict[str, Any]:
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "lightning": metadata.version("lightning"),
        "backend": "gloo (CPU)",
        "ranks": 2,
    }


def verdict(value: float, goal: float, lower_is_better: bool = True) -> str:
    return "meets goal" if (value <= goal if lower_is_better else value >= goal) else "MISSES goal"


def _paired(result: dict[str, Any], pairs: tuple[tuple[str, str], ...]) -> dict[str, list[float]]:
    """``"a/b/wall"`` and ``"a/b/cpu"`` for each pair: a / b within each round of a worker's ``per_round_median_s``
    (same minute, same machine load), sorted."""
    rounds: dict[int, dict[str, tuple[float, float]]] = {}
    for r, name, w, c in result["per_round_median_s"]:
        rounds.setdefault(r, {})[name] = (w, c)
    return {
        f"{a}/{b}/{kind}": sorted(v[a][which] / v[b][which] for v in rounds.values()) for a, b in pairs for which, kind in enumerate(("wall", "cpu"))
    }


def bench_step(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    steps, rounds = (8, 4) if quick else (20, 8)
    ranks = run_workers(HERE / "step_worker.py", ["--steps", str(steps), "--rounds", str(rounds)], work / "step", nprocs=2, timeout=1200)
    r0 = ranks[0]
    wall, cpu = r0["median_step_s"], r0["median_step_cpu_s"]
    ratios = _paired(r0, (("autoshard", "hand_reshard"), ("autoshard", "hand_default"), ("autoshard_again", "autoshard")))
    med = {k: statistics.median(v) for k, v in ratios.items()}

    def show(key: str) -> str:
        v = ratios[key]
        return f"{med[key]:.3f} (range {v[0]:.3f}..{v[-1]:.3f})"

    lines = [
        f"step time, {r0['step_model']['parameters']:,d}-parameter MLP stack, batch 64 per rank, fp32, AdamW, rank 0;"
        f" {rounds} rotating rounds x {steps} timed steps per variant (after an untimed pass of each, 3 warm-up steps per fit):",
        "                                                        wall ms/step   CPU ms/step",
    ]
    for name, label in (
        ("autoshard", "autoshard strategy='fsdp2'"),
        ("hand_reshard", "hand-written fully_shard, reshard_after_forward=True"),
        ("hand_default", "hand-written fully_shard, defaults"),
        ("autoshard_again", "autoshard again (A/A control)"),
    ):
        lines.append(f"  {label:<53} {wall[name] * 1e3:9.2f}  {cpu[name] * 1e3:12.2f}   (n={r0['steps_timed'][name]})")
    lines += [
        "  ratios: median of the same-round ratios (range over rounds)",
        f"  autoshard / hand-written, same settings:  wall {show('autoshard/hand_reshard/wall')}  CPU {show('autoshard/hand_reshard/cpu')}"
        f"  (goal <= {GOALS['step_ratio']}: CPU {verdict(med['autoshard/hand_reshard/cpu'], GOALS['step_ratio'])},"
        f" wall {verdict(med['autoshard/hand_reshard/wall'], GOALS['step_ratio'])})",
        f"  A/A control, autoshard again / autoshard: wall {show('autoshard_again/autoshard/wall')}  CPU {show('autoshard_again/autoshard/cpu')}"
        "  (the noise floor of this run)",
        f"  autoshard / hand-written, defaults:       wall {show('autoshard/hand_default/wall')}  CPU {show('autoshard/hand_default/cpu')}"
        "  (fully_shard's default keeps every sibling unit gathered from forward to backward: fewer all-gathers, more memory)",
        "model states per rank (params + grads + optimizer states, DTensor.to_local) vs ideal total / N:",
    ]
    states: dict[str, Any] = {}
    for rank, r in enumerate(ranks):
        for name, key, held in (
            ("MLP stack (autoshard)", "step_model", r["step_model"]["held"]["autoshard"]),
            ("MLP stack (hand-written)", "step_model", r["step_model"]["held"]["hand_reshard"]),
            ("DinoLike + OnlineProbe", "dino", r["dino"]["held"]),
        ):
            ideal, estimate = r[key]["ideal"], r[key]["estimate"]
            states[f"{name} rank {rank}"] = {"held": held, "ideal": ideal, "ratio": held / ideal, "estimate": estimate}
            lines.append(
                f"  rank {rank} {name:<25} held {held:>11,d} B  ideal {ideal:>13,.1f} B  ratio {held / ideal:.4f}"
                f"  ({verdict(held / ideal, GOALS['state_ratio'])});  estimate {estimate:,d} B"
                f" ({100 * abs(estimate - held) / held:.2f}% off)"
            )
    return {"ranks": ranks, "ratios": ratios, "median_ratios": med, "states": states}, lines


def bench_compile(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    """compile=True against the blocks compiled by hand before fully_shard (torchtitan's order), same model, same run."""
    steps, rounds = (8, 2) if quick else (20, 4)
    args = ["--steps", str(steps), "--rounds", str(rounds), "--compile"]
    r0 = run_workers(HERE / "step_worker.py", args, work / "compile", nprocs=2, timeout=1800)[0]
    ratios = _paired(r0, (("autoshard_compile", "hand_compile"), ("autoshard_compile_again", "autoshard_compile")))
    med = {k: statistics.median(v) for k, v in ratios.items()}
    wall, cpu = r0["median_step_s"], r0["median_step_cpu_s"]
    lines = [
        f"compiled step time, the same {r0['step_model']['parameters']:,d}-parameter MLP stack, fp32, rank 0, inductor on CPU;"
        f" {rounds} rotating rounds x {steps} timed steps:",
        f"  compile=True                                   wall {wall['autoshard_compile'] * 1e3:8.2f} ms  CPU {cpu['autoshard_compile'] * 1e3:8.2f} ms",
        f"  each block .compile()d by hand, then fully_shard wall {wall['hand_compile'] * 1e3:8.2f} ms  CPU {cpu['hand_compile'] * 1e3:8.2f} ms",
        f"  compile=True / hand-compiled: wall {med['autoshard_compile/hand_compile/wall']:.3f}  CPU {med['autoshard_compile/hand_compile/cpu']:.3f}"
        f"  (goal <= {GOALS['compile_ratio']}: CPU {verdict(med['autoshard_compile/hand_compile/cpu'], GOALS['compile_ratio'])});"
        f"  A/A control: wall {med['autoshard_compile_again/autoshard_compile/wall']:.3f}  CPU {med['autoshard_compile_again/autoshard_compile/cpu']:.3f}",
    ]
    return {"ratios": ratios, "median_ratios": med, "median_step_s": wall, "median_step_cpu_s": cpu}, lines


def bench_deepspeed(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    """autoshard-deepspeed against the GPU benchmark's hand-tuned ZeRO-3 config on CPU: the same rows, the same run."""
    steps, rounds = (4, 2) if quick else (10, 4)
    r0 = run_workers(HERE / "deepspeed_step_worker.py", ["--steps", str(steps), "--rounds", str(rounds)], work / "deepspeed", nprocs=2, timeout=1800)[
        0
    ]
    pairs = (
        ("deepspeed-matched", "tuned"),
        ("deepspeed", "tuned"),
        ("deepspeed-knobs", "tuned"),
        ("deepspeed_again", "deepspeed"),
        ("fsdp2", "tuned"),
    )
    ratios = _paired(r0, pairs)
    med = {k: statistics.median(v) for k, v in ratios.items()}
    wall, cpu = r0["median_step_s"], r0["median_step_cpu_s"]
    shapes = r0["shapes"]
    lines = [
        f"DeepSpeed ZeRO-3 step time, HF Llama {r0['parameters']:,d} parameters ({shapes['layers']} layers, hidden {shapes['hidden']}),"
        f" bf16-mixed, micro-batch {shapes['micro_batch']} x {shapes['seq']}, 2 ranks, rank 0; {rounds} rotating rounds x {steps} timed steps:",
    ]
    for name, label in (
        ("deepspeed", "autoshard-deepspeed (fp32 gradient reduction)"),
        ("deepspeed-knobs", "  + the tuned bucket, prefetch, persistence sizes"),
        ("deepspeed-matched", "  + every tuned zero key, bf16 reduction (= tuned)"),
        ("tuned", "DeepSpeedStrategy(config=hand-tuned)"),
        ("deepspeed_again", "autoshard-deepspeed again (A/A control)"),
        ("fsdp2", "strategy='auto-shard' (fsdp2), the same module"),
    ):
        lines.append(f"  {label:<52} wall {wall[name] * 1e3:8.2f} ms  CPU {cpu[name] * 1e3:8.2f} ms")
    show = lambda a, b: f"wall {med[f'{a}/{b}/wall']:.3f}  CPU {med[f'{a}/{b}/cpu']:.3f}"  # noqa: E731
    lines += [
        f"  matched / tuned (autoshard's own cost, the same DeepSpeed config): {show('deepspeed-matched', 'tuned')}"
        f"  (goal <= {GOALS['deepspeed_ratio']}: CPU {verdict(med['deepspeed-matched/tuned/cpu'], GOALS['deepspeed_ratio'])})",
        f"  autoshard-deepspeed / tuned: {show('deepspeed', 'tuned')};  with the tuned sizes: {show('deepspeed-knobs', 'tuned')}",
        f"  A/A control: {show('deepspeed_again', 'deepspeed')};  fsdp2 (auto-shard) / tuned: {show('fsdp2', 'tuned')}",
        "what one step dispatches, rank 0 (torch operators but views; collectives and the larger tensor of each; host syncs:"
        " .item() and the like, each a wait for a GPU; dtype casts, bytes read + written):",
    ]
    for name, counts in r0["per_step"].items():
        lines.append(
            f"  {name:<18} {counts.get('operators', 0):5d} operators  {counts.get('collectives', 0):3d} collectives"
            f" ({counts.get('collective_bytes', 0) / 2**20:7.1f} MiB)  {counts.get('host_syncs', 0):2d} host syncs"
            f"  {counts.get('casts', 0):3d} casts ({counts.get('cast_bytes', 0) / 2**20:7.1f} MiB)"
        )
    host, host_cpu, hs = r0["host_step_s"], r0["host_step_cpu_s"], r0["host_shapes"]
    lines.append(
        f"host time per step, {hs['layers']} decoder layers of hidden {hs['hidden']} (kernels negligible; ZeRO-3 partitions every"
        f" weight): fsdp2 wall {host['fsdp2'] * 1e3:.1f} ms CPU {host_cpu['fsdp2'] * 1e3:.1f} ms;"
        f" ZeRO-3 (tuned config) wall {host['deepspeed-matched'] * 1e3:.1f} ms CPU {host_cpu['deepspeed-matched'] * 1e3:.1f} ms"
        f" ({host_cpu['deepspeed-matched'] / host_cpu['fsdp2']:.2f}x the CPU); each decoder layer a ZeRO-3 leaf module"
        f" wall {host['deepspeed-leaf'] * 1e3:.1f} ms CPU {host_cpu['deepspeed-leaf'] * 1e3:.1f} ms"
        f" ({host_cpu['deepspeed-leaf'] / host_cpu['fsdp2']:.2f}x)"
    )
    return {"ratios": ratios, "median_ratios": med, "median_step_s": wall, "median_step_cpu_s": cpu, "per_step": r0["per_step"], "host": host}, lines


def bench_comm(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    ranks = run_workers(HERE / "comm_worker.py", ["--steps", "3"], work / "comm", nprocs=2, timeout=600)
    r0 = ranks[0]
    mib = lambda n: f"{n / 2**20:8.2f} MiB"  # noqa: E731
    lines = [
        f"bytes per training step, {r0['parameters']:,d}-parameter MLP stack, precision='bf16-mixed', 2 ranks, rank 0"
        " (all-gather: gathered output; reduce-scatter: full gradient in; every step after the first the same):",
        f"  {'':<62} {'all-gathered':>22} {'reduce-scattered':>22} {'gathered block (explain)':>26}",
    ]
    totals: dict[str, dict[str, int]] = {}
    for name, run in r0["variants"].items():  # "before", then "after"
        label = run["label"]
        later = run["steps"][1:]
        assert all(s == later[0] for s in later), f"{name}: bytes differ between steps: {later}"
        step = later[0]
        totals[name] = {kind: sum(step[kind].values()) for kind in ("all_gather", "reduce_scatter")}
        totals[name]["gathered_block"] = run["gathered_block"]

        def show(kind: str) -> str:
            return f"{mib(totals[name][kind])} ({'+'.join(step[kind])})"

        lines.append(f"  {label:<62} {show('all_gather'):>22} {show('reduce_scatter'):>22} {mib(run['gathered_block'])} ({run['gather_dtype']})")
    before, after = totals["before"], totals["after"]
    ratio = {k: after[k] / before[k] for k in before}
    ratio["total"] = (after["all_gather"] + after["reduce_scatter"]) / (before["all_gather"] + before["reduce_scatter"])
    lines.append(
        f"  after / before: all-gathered {ratio['all_gather']:.3f}, reduce-scattered {ratio['reduce_scatter']:.3f},"
        f" both {ratio['total']:.3f}; largest gathered block {ratio['gathered_block']:.3f}"
    )
    return {"ranks": ranks, "bytes_per_step": totals, "ratio_after_over_before": ratio}, lines


def bench_plans(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    """Plans on real architectures against a torchtitan-style hand-written plan (benchmarks/plans.py)."""
    from benchmarks.plans import bench_plans as run

    return run(quick, work)


def bench_plan(quick: bool) -> tuple[dict[str, Any], list[str]]:
    from benchmarks import plan_time
    from benchmarks.models import TREE_SHAPES

    shapes = ("vit", "scalars") if quick else TREE_SHAPES
    result = plan_time.run(shapes=shapes, repeats=1 if quick else 3)
    at_10k = [r for r in result["rows"] if r["modules"] >= 10_000 and r["modules"] < 20_000]
    lines = ["plan time (meta-device trees; best of the repeats; setup runs inspect_needs then plan_fsdp2):"]
    lines += ["  " + line for line in plan_time.report(result)]
    for r in at_10k:
        worst = max(r["plan_s"], r["needs_s"])
        lines.append(
            f"  {r['shape']} at {r['modules']:,d} modules: slowest step {worst:.3f} s (goal < {GOALS['plan_10k_s']} s: {verdict(worst, GOALS['plan_10k_s'])})"
        )
    return result, lines


def bench_rss(quick: bool, work: Path) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    for mode in ("naive", "meta"):  # one process pair each: ru_maxrss never goes down
        out[mode] = run_workers(HERE / "rss_worker.py", ["--mode", mode], work / f"rss-{mode}", nprocs=2, timeout=600)
    model = out["naive"][0]["model_mib"]
    lines = [f"setup peak RSS per rank, {model:.0f} MiB fp32 model, 2 ranks (VmHWM at on_train_start; base = after imports):"]
    for mode, label in (("naive", "built whole on CPU  "), ("meta", "trainer.init_module(empty_init=True)")):
        for rank, r in enumerate(out[mode]):
            lines.append(
                f"  {label:<38} rank {rank}: peak {r['setup_peak_rss_mib']:7.1f} MiB  (base {r['base_rss_mib']:6.1f},"
                f" above base {r['setup_peak_rss_mib'] - r['base_rss_mib']:6.1f} MiB; local params {r['local_param_mib']:.1f} MiB;"
                f" build+setup {r['build_and_setup_s']:.1f} s)"
            )
    for rank in range(2):
        naive, meta = out["naive"][rank], out["meta"][rank]
        peak = meta["setup_peak_rss_mib"] / naive["setup_peak_rss_mib"]
        above = (meta["setup_peak_rss_mib"] - meta["base_rss_mib"]) / (naive["setup_peak_rss_mib"] - naive["base_rss_mib"])
        out[f"ratio_rank{rank}"] = {"peak": peak, "above_base": above}
        lines.append(f"  rank {rank}: meta / naive peak RSS {peak:.3f}; above-base growth {above:.3f}")
    return out, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None, allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="fewer steps, repeats and tree shapes (about a minute)")
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma list of {', '.join(BENCHES)}")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every measurement as JSON")
    args = parser.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(BENCHES)}")
    info = machine()
    command = "python benchmarks/run.py" + (
        "" if argv is None and len(sys.argv) == 1 else " " + shlex.join(argv if argv is not None else sys.argv[1:])
    )
    print(f"autoshard benchmarks: {json.dumps(info)}")
    print(f"command: {command}", flush=True)
    results: dict[str, Any] = {"machine": info, "command": command}
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-") as tmp:
        work = Path(tmp)
        for name in chosen:
            start = time.perf_counter()
            if name == "step":
                results[name], lines = bench_step(args.quick, work)
            elif name == "compile":
                results[name], lines = bench_compile(args.quick, work)
            elif name == "deepspeed":
                results[name], lines = bench_deepspeed(args.quick, work)
            elif name == "comm":
                results[name], lines = bench_comm(args.quick, work)
            elif name == "plans":
                results[name], lines = bench_plans(args.quick, work)
            elif name == "plan":
                results[name], lines = bench_plan(args.quick)
            else:
                results[name], lines = bench_rss(args.quick, work)
            print(f"\n[{name}] ({time.perf_counter() - start:.0f} s)")
            print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
