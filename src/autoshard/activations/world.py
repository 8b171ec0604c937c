"""The fake world a simulated step runs in: a fake process group of ``world_size`` ranks in this process
(``fake_world``), a forked child when a live group is already there (``in_detached_world``), and the data-parallel
mesh the plan shards on."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process (no communication), destroyed after, always."""
    import torch.distributed as dist

    if not dist.is_available():
        raise AutoShardError(
            "measuring a sharded step needs torch.distributed, which this torch build lacks. Fix: install a torch build with distributed support"
        )
    if dist.is_initialized():
        raise AutoShardError(
            "measure_step runs the step on a fake process group of its own, but a process group is already initialized"
            " in this process (a Trainer or init_process_group ran before). Fix: call it before any distributed setup,"
            " or in a separate process (autoshard explain --batch runs in its own)"
        )
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    excepthook = sys.excepthook  # init_process_group wraps it with a "[rank0]:" prefix, once per call
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if _DETACHED:  # a forked child (in_detached_world): tearing down would reach the inherited live group
            import torch.distributed.distributed_c10d as c10d

            c10d._world = c10d._World()  # forget the fake group instead (the child exits with os._exit)
        else:
            dist.destroy_process_group()
        sys.excepthook = excepthook


_DETACHED = False  # True in the child process of in_detached_world only


def in_detached_world(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"result": fn()}`` (JSON data), computed in a forked child whose torch.distributed world starts empty, or
    ``{"error": {"type", "message", ...}}`` with the attributes of the AutoShardError it raised.

    For simulated steps in a process whose process group is already live (a strategy's setup): the fake group of
    ``fake_world`` cannot coexist with it. The child inherits the module and the batch (no pickling, no imports:
    about as fast as in-process), replaces torch's group registry by an empty one (``distributed_c10d._world``,
    private), never tears anything down, and exits with ``os._exit``; the parent's group is untouched. Its answer
    comes back as JSON text: nothing is unpickled.
    """
    import json
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        raise AutoShardError(
            "a simulated step beside a live process group runs in a forked child process, and this platform cannot fork."
            " Fix: decide before the process group starts (autoshard.budget.decide before Trainer.fit), or in another process"
        )
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_detached_child, args=(fn, send), daemon=True)
    child.start()
    send.close()
    try:
        text = receive.recv_bytes()
    except EOFError:
        child.join()
        raise AutoShardError(
            f"the child process simulating the step died (exit code {child.exitcode}) before answering: out of host"
            f" memory, or a crash in torch. Fix: run autoshard explain --budget on the same module and batch to see it"
        ) from None
    finally:
        receive.close()
    child.join()
    return json.loads(text)


def _detached_child(fn: Callable[[], Any], send: Any) -> None:
    import json

    import torch.distributed.distributed_c10d as c10d

    global _DETACHED
    _DETACHED = True
    try:
        c10d._world = c10d._World()  # an empty registry: the inherited live group is not this process's to use
        torch.set_num_threads(1)
        payload: dict[str, Any] = {"result": fn()}
    except AutoShardError as exc:
        extra = {k: v for k, v in vars(exc).items() if isinstance(v, (int, str, type(None)))}
        payload = {"error": {"type": type(exc).__name__, "message": str(exc), **extra}}
    except BaseException as exc:  # noqa: BLE001  everything reaches the parent, in words
        payload = {"error": {"type": type(exc).__name__, "message": f"{type(exc).__name__}: {exc}"}}
    try:
        send.send_bytes(json.dumps(payload, default=str).encode())
        send.close()
    finally:
        os._exit(0)


def data_parallel_mesh(intent: ShardingIntent, world_size: int) -> Any:
    """The 1-D data-parallel mesh the strategy's plan shards on (the plan makes HSDP's 2-D mesh from it)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = intent.mesh_sizes(world_size)
    if tp > 1:
        raise AutoShardError(
            f"tensor_parallel_size={tp}: the simulated step shards over data-parallel ranks only and does not lay the"
            f" model out by its tensor-parallel plan, so its peak would not be a tensor-parallel rank's. Fix: measure"
            f" with tensor_parallel_size=1 (the activations of a data-parallel rank), or measure on real devices"
        )
    return init_device_mesh("cpu", (dp,), mesh_dim_names=("data_parallel",))
