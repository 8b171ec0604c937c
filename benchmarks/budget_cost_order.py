"""The memory budget's cost order, estimated vs measured: ``python benchmarks/budget_cost_order.py [--models gpt2,conv]
[--steps 8] [--json out.json]``.

For each model and each configuration of a grid (resharding, activation checkpointing every 2nd block / selective /
every block, offload, and combinations): the price ``autoshard.budget`` estimates (recomputed FLOPs from the
simulated step, all-gather bytes from the traffic model, host-device bytes), at rates measured on this machine (a
bf16 matmul's FLOP/s, gloo all-gather bytes/s, host copy bytes/s), against the median step time of a real 2-rank
gloo run. Reported: both orders, and the share of pairs of configurations that the estimate orders as measured
(pairs whose measured times differ by less than 3% count as ties, agreeing either way). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autoshard._harness import run_workers  # noqa: E402
from autoshard.budget import describe_config  # noqa: E402

WORKER = Path(__file__).resolve().with_name("budget_worker.py")
TIE = 0.03


def agreement(rows: list[dict]) -> float:
    """The share of pairs ordered alike by the estimate and the measurement (a measured tie agrees either way)."""
    pairs = list(itertools.combinations(rows, 2))
    same = 0
    for a, b in pairs:
        ma, mb = a["step_seconds"], b["step_seconds"]
        if abs(ma - mb) <= TIE * max(ma, mb) or (a["estimate"]["seconds"] - b["estimate"]["seconds"]) * (ma - mb) > 0:
            same += 1
    return same / len(pairs) if pairs else 1.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", default="gpt2,conv")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write every rank's figures here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        ranks = run_workers(WORKER, ["--task", "order", "--models", args.models, "--steps", str(args.steps)], Path(out), nprocs=2, timeout=3600)
    command = "python benchmarks/budget_cost_order.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"$ {command.strip()}\n")
    rates = ranks[0]["rates"]
    print(
        f"rates measured here: {rates['flops_per_s'] / 1e9:.1f} GFLOP/s (bf16 matmul, 1 thread), all-gather"
        f" {rates['intra_node_bytes_per_s'] / 1e9:.2f} GB/s (gloo), host copy {rates['host_bytes_per_s'] / 1e9:.2f} GB/s\n"
    )
    for result in ranks[0]["models"]:
        rows = result["rows"]
        print(f"{result['model']} (micro-batch {result['batch']}):\n")
        print("| configuration | estimated extra (ms/step) | recomputed GFLOP | all-gathered MiB | host MiB | measured step (ms) |")
        print("|---|---|---|---|---|---|")
        for row in sorted(rows, key=lambda r: r["estimate"]["seconds"]):
            e = row["estimate"]
            gathered = (e["gather_bytes_intra"] + e["gather_bytes_inter"]) / 2**20
            print(
                f"| {describe_config(row['config'])} | {e['seconds'] * 1e3:.2f} | {e['recompute_flops'] / 1e9:.3f} | {gathered:.2f}"
                f" | {e['host_bytes'] / 2**20:.2f} | {row['step_seconds'] * 1e3:.1f} |"
            )
        print(f"\npairs ordered as measured: {agreement(rows):.0%}\n")
    print(f"{time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
