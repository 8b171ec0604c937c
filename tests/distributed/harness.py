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

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from autoshard._harness import (  # noqa: F401  (re-exported: the workers and tests import them from here)
    JOB_WORLD_SIZE,
    QUIET,
    count_collectives,
    free_port,
    fsdp2_collectives,
    quiet_trainer,
    run_workers,
    write_result,
)

ROOT = Path(__file__).resolve().parents[2]
THREAD_JOIN_SECONDS = 10.0  # for the non-daemon threads still running after the worker's main (none is expected)


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


def worker_main(main: Callable[[], object]) -> NoReturn:
    """Run a worker's ``main`` and end the process the one deterministic way (the module docstring says why): exit
    code 0 when ``main`` returned, its own code for ``SystemExit``, 1 with the traceback on stderr for any error."""
    try:
        main()
        code = 0
    except SystemExit as exc:  # argparse's usage errors, a scenario's explicit exit
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  reported here, with its traceback, then a non-zero code
        import traceback

        print(f"worker (rank {os.environ.get('RANK', '?')}) failed:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    leave(code)


def leave(code: int) -> NoReturn:
    """After the worker's results are written and closed: every process group destroyed (after a barrier when the
    worker succeeded, so no rank tears down a group another rank still uses), Python's threads joined and its atexit
    functions run, output flushed, then ``os._exit(code)``."""
    try:
        release_process_groups(barrier=code == 0)
    except BaseException:  # noqa: BLE001  a failed barrier/destroy is the worker's failure, with its traceback
        import traceback

        print(f"worker (rank {os.environ.get('RANK', '?')}) failed while destroying its process groups:", file=sys.stderr)
        traceback.print_exc()
        code = code or 1
    try:
        join_python_threads()
        import atexit

        atexit._run_exitfuncs()  # what a normal exit runs first (logging's flush among them), interpreter still whole
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
                pass
        os._exit(code)


def release_process_groups(barrier: bool) -> None:
    """Destroy every process group: torch's ``destroy_process_group()`` shuts the groups down newest first (DeviceMesh
    and HSDP sub-groups, then the world) and unregisters them all; under DeepSpeed its own ``destroy_process_group``
    does that and also drops the groups DeepSpeed caches (``deepspeed.utils.groups``)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    if deepspeed_comm is not None and deepspeed_comm.cdb is not None:
        deepspeed_comm.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def join_python_threads(timeout: float = THREAD_JOIN_SECONDS) -> None:
    """Join the non-daemon Python threads (a checkpoint writer, say), as a normal exit would; one still running after
    ``timeout`` is named on stderr and abandoned (``os._exit`` ends it with the process)."""
    import threading
    import time

    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            print(f"worker exit: thread {thread.name!r} still running after {timeout:.0f} s; abandoned", file=sys.stderr)
