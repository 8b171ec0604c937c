"""The tests' side of the multi-process harness: the launch helpers live in autoshard._harness (the benchmarks use
them too, without importing the tests) and are re-exported here; ``run_scenarios`` is a test worker's main.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoshard._harness import (  # noqa: F401  (re-exported: the workers and tests import them from here)
    JOB_WORLD_SIZE,
    QUIET,
    count_collectives,
    free_port,
    quiet_trainer,
    run_workers,
    write_result,
)

ROOT = Path(__file__).resolve().parents[2]


def run_scenarios(scenarios: dict[str, Any]) -> None:
    """A worker's main: ``--scenarios a,b --out DIR``; all scenarios run in this one process pair, in order."""
    import argparse
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--scenarios", default=",".join(scenarios))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    write_result(args.out, dist.get_rank(), {name: scenarios[name]() for name in args.scenarios.split(",")})
    # Every rank here, then the group torn down before the interpreter exits: a gloo group left to the exit handlers
    # aborted now and then ("terminate called without an active exception", exit code -6) after a scenario that
    # raised on one rank.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
