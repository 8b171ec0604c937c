"""The tests' side of the multi-process harness: the launch helpers live in autoshard._harness (the benchmarks use
them too, without importing the tests) and are re-exported here; ``run_scenarios`` is a test worker's main, and
``worker_main`` is how every worker process ends.

How a worker ends (issue 28, item 7). ``destroy_process_group()`` unregisters and shuts down every group, but on
torch 2.13 it stops no thread: DTensor's caches (its redistribute planners and lru caches in Python, its sharding
cache in C++) keep the DeviceMesh alive, the mesh keeps its ProcessGroups, and with them gloo's worker threads
(``pt_gloo_runloop``), its TCP loops (``gloo_tcp_loop``) and rank 0's TCPStore server (``pt_tcpstore_uv``): all still
running after destroy, gc and atexit in test_hsdp's 2-rank resume (measured). A worker that returned normally carried
them into interpreter finalization and C++ static destruction, to be torn down in an order nobody controls, with the
GIL refused to any thread once finalization starts: now and then ``terminate called without an active exception``,
exit -6, after every result was written (test_hsdp's 2-rank resume in CI, test_47 before). So every worker leaves through
``worker_main``: results written and closed, a barrier, every group destroyed (DeepSpeed's own view of them too),
Python's non-daemon threads joined and its atexit functions run while the interpreter is whole, stdout/stderr
flushed, then ``os._exit``: no finalizer or static destructor runs after that. An error still ends the process with
its traceback on stderr and a non-zero code; the launcher (``autoshard._harness.wait_for``) fails any worker that
exits non-zero or whose log shows an abort, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from autoshard._harness import (  # noqa: F401  (re-exported: the workers and tests import them from here)
    JOB_WORLD_SIZE,
    QUIET,
    count_collectives,
    free_port,
    fsdp2_collectives,
    join_python_threads,
    leave,
    quiet_trainer,
    release_process_groups,
    run_workers,
    worker_main,
    write_result,
)

ROOT = Path(__file__).resolve().parents[2]


def run_scenarios(scenarios: dict[str, Any]) -> NoReturn:
    """A worker's main: ``--scenarios a,b --out DIR``; all scenarios run in this one process pair, in order."""

    def main() -> None:
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

    worker_main(main)
