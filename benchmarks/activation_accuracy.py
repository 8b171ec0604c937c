"""Activation-memory estimate vs real 2-rank runs: ``python benchmarks/activation_accuracy.py [--models gpt2,vit,dino]
[--precisions bf16-mixed,32-true] [--json out.json]``.

For each model, batch size, activation checkpointing on/off and precision: ``autoshard.activations.measure_step``
(fake tensors, fake process group) against the live tensor bytes at the peak of step 2 of a real
``Trainer(strategy=AutoShardStrategy(...), accelerator="cpu", devices=2)`` fit on gloo, measured on the real tensors
with the same tracker (``measuring_callback``). Prints rank 0's figures and the worst ratio over both ranks. The
issue's goal: every estimate within 10% of the measured peak. Not a timed test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from autoshard._harness import run_workers  # noqa: E402

WORKER = Path(__file__).resolve().with_name("activation_worker.py")
GOAL = 0.10


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(ranks: list[dict[str, Any]]) -> tuple[str, float]:
    """A markdown table of rank 0's figures, and the worst |estimate / measured - 1| of the peak over all ranks."""
    head = (
        "| model | batch | AC | precision | estimated peak (MiB) | measured peak (MiB) | ratio | estimated activations (MiB)"
        " | measured activations (MiB) | peak at |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    worst = 0.0
    for i, s in enumerate(ranks[0]["scenarios"]):
        for r in ranks:
            other = r["scenarios"][i]
            worst = max(worst, abs(other["estimate"]["peak"] / other["measured"]["peak"] - 1))
        e, m = s["estimate"], s["measured"]
        lines.append(
            f"| {s['model']} | {s['batch']} | {'on' if s['ac'] else 'off'} | {s['precision']} | {mib(e['peak'])} | {mib(m['peak'])}"
            f" | {e['peak'] / m['peak']:.3f} | {mib(e['activations'])} | {mib(m['activations'])} | {e['at']} |"
        )
    return "\n".join(lines), worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", default="gpt2,vit,dino")
    parser.add_argument("--precisions", default="bf16-mixed,32-true")
    parser.add_argument("--json", help="write every rank's estimates and measurements here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        ranks = run_workers(WORKER, ["--models", args.models, "--precisions", args.precisions], Path(out), nprocs=2, timeout=1800)
    text, worst = table(ranks)
    command = "python benchmarks/activation_accuracy.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"$ {command.strip()}\n")
    print(text)
    verdict = "meets" if worst <= GOAL else "MISSES"
    print(f"\nworst peak error over both ranks: {worst:.2%} ({verdict} the {GOAL:.0%} goal); {time.perf_counter() - start:.0f} s")
    notes = {n for r in ranks for s in r["scenarios"] for n in s["estimate"]["notes"]}
    for note in sorted(notes):
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "ranks": ranks, "worst": worst}, indent=1))


if __name__ == "__main__":
    main()
