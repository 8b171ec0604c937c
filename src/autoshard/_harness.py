"""Run a script on N local processes the way torchrun does, and collect one JSON result per rank.

Shared by autoshard's tests (tests/distributed) and benchmarks, so that neither imports the other. Workers are
launched externally (RANK/LOCAL_RANK/WORLD_SIZE set), so one process pair can run several Trainers in a row; every
run has a hard timeout because a collective missing on one rank hangs gloo forever, and fails, naming the worker, when
one exits non-zero or its log shows a C++ abort (``terminate called ...``: a CI run once failed so, at a worker's exit).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NoReturn


def _project_root(script: Path) -> Path:
    """The nearest folder above ``script`` holding pyproject.toml: workers import their own package from there
    (``tests.distributed...``, ``benchmarks...``), as the launching process does."""
    for folder in script.resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    return script.resolve().parent


LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher variables an earlier in-process fit left (its MASTER_PORT may
    still be bound: EADDRINUSE in the child)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_workers(script: Path, args: list[str], out_dir: Path, nprocs: int = 2, timeout: float = 240) -> list[dict[str, Any]]:
    """Start ``nprocs`` ranks of ``script``; each writes ``out_dir/rank{R}.json``. A port taken between our pick and
    rank 0's bind is retried once."""
    try:
        return _run_workers(script, args, out_dir, nprocs, timeout)
    except AssertionError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        return _run_workers(script, args, out_dir, nprocs, timeout)


def _run_workers(script: Path, args: list[str], out_dir: Path, nprocs: int, timeout: float) -> list[dict[str, Any]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(_project_root(script)), os.environ.get("PYTHONPATH", "")]),
        }
        log = open(out_dir / f"rank{rank}.log", "w")
        command = [sys.executable, str(script), *args, "--out", str(out_dir)]
        procs.append((f"rank {rank}", subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir), log))
    wait_for(procs, timeout)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


def wait_for(
    procs: Sequence[tuple[str, subprocess.Popen[Any], IO[str]]], timeout: float, stop: Callable[[subprocess.Popen[Any]], None] | None = None
) -> None:
    """Wait for every (label, process, log file) until one deadline; at the first failure stop the rest (``stop``:
    how, default kill) and raise with each log's tail. Log files are closed here."""
    deadline, failed = time.monotonic() + timeout, None
    for label, proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed = f"{label} still running after {timeout:.0f} s (a collective missing on one rank?)"
        if failed is None and proc.returncode != 0:
            failed = f"{label} exited with {_exit_status(proc.returncode)}"
        if failed:
            break
    for _, proc, log in procs:
        if proc.poll() is None:
            (stop or subprocess.Popen.kill)(proc)
            proc.wait()
        log.close()
    if failed is None:  # every exit code 0: still, an abort reported in a log (a launcher's child, say) fails the run
        failed = next((f"{label}'s log reports {line!r}: {ABORT_HINT}" for label, _, log in procs if (line := abort_line(Path(log.name)))), None)
    else:
        aborted = [f"{label}: {line!r}" for label, _, log in procs if (line := abort_line(Path(log.name)))]
        if aborted:
            failed += f"; aborted ({', '.join(aborted)}): {ABORT_HINT}"
    if failed:
        tails = "\n".join(f"--- {label} log tail ---\n" + Path(log.name).read_text()[-4000:] for label, _, log in procs)
        raise AssertionError(f"{failed}\n{tails}")


# What a process that died in C++ prints last: std::terminate (a std::thread destroyed while joinable, typically during
# interpreter shutdown), a C++ exception nobody caught, CPython's own fatal errors.
ABORT_MARKERS = ("terminate called", "Fatal Python error")
ABORT_HINT = (
    "a worker aborted in C++, typically at exit: its process groups' threads (gloo, the TCPStore) torn down during"
    " interpreter shutdown. Test workers end through tests.distributed.harness.worker_main (groups destroyed, then"
    " os._exit); a worker with a main of its own must too"
)


def abort_line(log: Path) -> str | None:
    """The first line of ``log`` that reports a C++ abort or a fatal interpreter error, or None."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    return next((line.strip() for line in text.splitlines() if any(m in line for m in ABORT_MARKERS)), None)


def _exit_status(code: int) -> str:
    """``-6 (SIGABRT)`` for a signal, the code itself otherwise."""
    if code >= 0:
        return str(code)
    import signal

    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


def write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


# Read once at start: Lightning's LightningEnvironment.teardown() deletes WORLD_SIZE when a Trainer finishes,
# so the second Trainer of a process pair would otherwise see a world of 1.
JOB_WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
QUIET = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)


def quiet_trainer(**kwargs: Any) -> Any:
    """A CPU Trainer with devices = this job's world size and no loggers, bars or summaries; kwargs win."""
    import lightning.pytorch as pl

    return pl.Trainer(**{**QUIET, "devices": JOB_WORLD_SIZE, **kwargs})


@contextmanager
def count_collectives() -> Iterator[dict[str, dict[str, int]]]:
    """Bytes FSDP2 moves while inside, per collective and dtype: fully_shard looks its collectives up at each call,
    so wrapping them sees each one's real dtype."""
    import torch.distributed as dist

    counts: dict[str, dict[str, int]] = {"all_gather": {}, "reduce_scatter": {}}
    gather_name, scatter_name = fsdp2_collectives()
    gather, scatter = getattr(dist, gather_name), getattr(dist, scatter_name)

    def add(kind: str, t: Any) -> None:
        key = str(t.dtype).removeprefix("torch.")
        counts[kind][key] = counts[kind].get(key, 0) + t.numel() * t.element_size()

    def all_gather(output_tensor: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> Any:
        add("all_gather", output_tensor)
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        add("reduce_scatter", input)
        return scatter(output, input, *args, **kwargs)

    setattr(dist, gather_name, all_gather)
    setattr(dist, scatter_name, reduce_scatter)
    try:
        yield counts
    finally:
        setattr(dist, gather_name, gather)
        setattr(dist, scatter_name, scatter)


def fsdp2_collectives() -> tuple[str, str]:
    """The names of the all-gather and reduce-scatter FSDP2 calls in torch.distributed: the ``*_single`` pair since
    torch 2.13, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before (torch 2.11, the GPU image's)."""
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        return "all_gather_single", "reduce_scatter_single"
    return "all_gather_into_tensor", "reduce_scatter_tensor"


# How a worker (or the demo, a user's script under Lightning's launcher) ends: tests/distributed/harness.py's
# docstring says why. Groups destroyed while every rank is there, threads joined, atexit run, then os._exit.
THREAD_JOIN_SECONDS = 10.0  # for the non-daemon threads still running after the worker's main (none is expected)


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
