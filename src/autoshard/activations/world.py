"""The fake world a simulated step runs in: a fake process group in this process (beside a live one too), or in a
forked child, and the data-parallel mesh the plan shards on."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autoshard.errors import AutoShardError
from autoshard.mesh import ParallelDims
from autoshard.privates import in_torch


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process (no communication), gone after, always. Beside a
    live group (a strategy's setup on CUDA, where a forked child cannot use CUDA) the live registry is parked."""
    import torch.distributed as dist

    if not dist.is_available():
        raise AutoShardError(
            "measuring a sharded step needs torch.distributed, which this torch build lacks. Fix: install a torch build with distributed support"
        )
    excepthook = sys.excepthook  # init_process_group wraps it with a "[rank0]:" prefix, once per call
    live = not _DETACHED and dist.is_initialized()
    with in_torch.parked_registry() if live else contextlib.nullcontext():
        dist.init_process_group("fake", store=in_torch.FakeStore(), rank=rank, world_size=world_size)  # registers "fake" first
        try:
            yield
        finally:
            if _DETACHED:  # the child of in_detached_world: its registry is its own, and it never tears down
                in_torch.empty_group_registry()
            elif not live:
                dist.destroy_process_group()
            sys.excepthook = excepthook


@functools.cache
def settle_autograd_engine() -> None:
    """Start autograd's engine (one real backward of a CPU scalar) before this process makes a fake tensor, while the
    engine counts no device but the CPU. Where torch is built with CUDA and no GPU is usable (a CPU run of the usual
    pip wheel), entering a FakeTensorMode gives CUDA a stand-in device guard that counts one device: the engine,
    started by the first backward after it, starts a thread for that device, and every child forked later refuses
    any backward ("Unable to handle autograd's threading in combination with fork-based multiprocessing"), so a
    decision beside a live gloo group failed once the process had simulated a step in it (torch 2.11's CUDA wheel).
    With a GPU the engine counts it whatever happens here: nothing is done."""
    if not torch.cuda.is_available():
        _one_backward()


def _one_backward() -> None:
    """A backward of a CPU scalar: starts autograd's engine, or fails where a forked child cannot run one."""
    leaf = torch.zeros((), requires_grad=True)
    (leaf * 1).backward()


_DETACHED = False  # True in the child process of in_detached_world only
_INHERITED: Any = None  # there: the parent's group registry, kept alive until os._exit (never torn down in the child)


def in_detached_world(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"result": fn()}`` (JSON data), computed in a forked child whose torch.distributed world starts empty, or
    ``{"error": {"type", "message", ...}}``: simulated steps beside a live process group, which the fake one cannot
    coexist with. The child inherits the module and the batch (no pickling) and answers in JSON (nothing unpickled).
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

    global _DETACHED, _INHERITED
    _DETACHED = True
    # Nothing inherited is destroyed here: a destructor of the parent's objects (a gloo group, a store, an engine left
    # to the garbage collector) joins threads fork did not copy, and the child hung in the step's gc.collect() (or
    # died of SIGSEGV). gc.freeze() keeps every inherited object out of the child's collections; the registry
    # replaced below stays referenced.
    gc.freeze()
    try:
        # An empty registry: the inherited live group is not this process's to use.
        _INHERITED = in_torch.empty_group_registry()
        torch.set_num_threads(1)
        _check_autograd_forked()
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


def _check_autograd_forked() -> None:
    """Refuse in words, before the step, where autograd cannot run in this forked child: the parent started autograd's
    engine after something (fully_shard, a fake tensor) gave CUDA a stand-in device on a machine without a GPU,
    before autoshard could start it first (``settle_autograd_engine``). The step's failure blamed the batch."""
    try:
        _one_backward()
    except RuntimeError as exc:
        if "fork" not in str(exc):
            raise
        raise AutoShardError(
            "the simulated step runs in a child forked from this process (beside its live process group), and autograd"
            " cannot run in a forked child here: this process ran a backward after torch gave CUDA a stand-in device (a"
            " fake tensor, or fully_shard, before autoshard started autograd's engine) on a machine with torch's CUDA"
            f" build and no GPU ({exc}). Fix: build the Trainer (or Fabric) with the autoshard strategy before anything"
            " else in the process runs fully_shard or a backward, or run this fit in a fresh process"
        ) from None


def data_parallel_mesh(dims: ParallelDims) -> Any:
    """The 1-D data-parallel mesh the strategy's plan shards on (the plan makes HSDP's 2-D mesh from it)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = dims.dp, dims.tp
    if tp > 1:
        raise AutoShardError(
            f"tensor_parallel_size={tp}: the simulated step shards over data-parallel ranks only and does not lay the"
            f" model out by its tensor-parallel plan, so its peak would not be a tensor-parallel rank's. Fix: measure"
            f" with tensor_parallel_size=1 (the activations of a data-parallel rank), or measure on real devices"
        )
    return init_device_mesh("cpu", (dp,), mesh_dim_names=("data_parallel",))
