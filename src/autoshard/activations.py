"""Activation memory of one training step, measured by running that step on fake tensors (no memory, no GPU).

``memory.py`` counts model states exactly from shapes alone; activations depend on what ``training_step`` does with
a batch, so here the step itself runs: the module is built on meta, sharded with the real FSDP2 plan (activation
checkpointing, ``reshard_after_forward``, MixedPrecisionPolicy, offload policy) on a fake process group of
``world_size`` ranks in this one process, materialized as fake CPU tensors, and one warm-up step then one measured
step run in Lightning's order (``training_step`` under autocast as its precision plugin runs it, zero_grad, backward,
optimizer step, then ``on_train_batch_end`` of the callbacks and the module; under manual optimization
``training_step`` is the step, with ``self.optimizers()`` and ``manual_backward`` served by a stand-in Trainer as in
fit), the measured one under torch's FSDPMemTracker, which sees every tensor storage created and freed. The peak is
the bytes of live tensors at the step's highest point on this rank. ``benchmarks/activation_accuracy.py`` compares
it with real 2-rank runs.

Not modelled: the CUDA caching allocator (block rounding, fragmentation, reserved-but-free memory), CUDA/cuBLAS/NCCL
workspaces and the CUDA context, and tensors created outside torch's dispatcher. The figures are tensor bytes, the
quantity ``torch.cuda.max_memory_allocated`` approaches from below; leave headroom for the rest.

The step's FLOPs (torch's FlopCounterMode, counted in the warm-up step) price activation checkpointing for
``autoshard.budget``: its recomputation is the FLOPs it adds. A process whose process group is already live cannot
host the fake one: ``in_detached_world`` runs the simulation in a forked child instead.

It leans on private torch members (FSDPMemTracker's hooks, the "fake" process group): tests/test_torch_compat.py
lists each, with what it is for, so a torch upgrade that moves one fails there by name.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.needs import held_optimizers, inspect_needs, returned_optimizers
from autoshard.precision import Dtype, PrecisionPlan
from autoshard.tracebacks import user_frames

# FSDPMemTracker's categories (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values), grouped as reported.
MODEL_STATES = ("Sharded Param", "Sharded Grad", "OptState", "Buffer", "Inputs")
GATHERED = ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter")
ACTIVATIONS = ("Activation", "Temp")
_NOT_A_MODULE = "autoshard: training_step"  # a pseudo-parent while the step runs (see StepTracker)


@dataclass(frozen=True)
class StepMemory:
    """Bytes of live tensors on one rank at the peak of one training step, by what they are.

    ``peak = model_states + gathered + activations``: ``model_states`` are sharded parameters, their gradients,
    optimizer states, buffers and the batch; ``gathered`` the all-gathered parameters, all-gather and
    reduce-scatter buffers and gradients not yet reduce-scattered; ``activations`` everything else (saved for
    backward, outputs, gradients of activations, the optimizer step's temporaries). ``by_kind`` keeps
    FSDPMemTracker's own categories at the peak; ``at`` says where the peak happened. ``incomplete`` says why a
    ``forward_only`` peak lacks the backward and the optimizer step, with a Fix, so that no caller presents a lower
    bound as the whole step's peak.
    """

    world_size: int
    rank: int
    peak: int
    activations: int
    gathered: int
    model_states: int
    at: str
    forward_only: bool
    notes: tuple[str, ...] = ()
    by_kind: tuple[tuple[str, int], ...] = ()
    precision: str = ""
    activation_checkpointing: bool | int | str = False  # as ShardingIntent spells it: False, True, k, 'selective'
    incomplete: str = ""  # forward_only: why the whole step did not run, with its Fix ("" when it did)
    flops: int = 0  # floating-point operations of one whole step (forward, recomputation, backward) on this rank

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        out["by_kind"] = dict(self.by_kind)
        return out


# -- the tracker: torch's FSDPMemTracker, for a LightningModule ---------------------------------------------------
def _tracker_base() -> type:
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    except ImportError as exc:  # torch < 2.5
        raise AutoShardError(
            f"measuring activation memory needs torch's FSDPMemTracker (torch.distributed._tools), not importable here"
            f" ({exc}). Fix: upgrade torch (2.6 or newer), or use autoshard explain --no-step (model states only)"
        ) from None
    return FSDPMemTracker


def _make_tracker_class() -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType, _FSDPState
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor
    from torch.utils.weak import WeakIdKeyDictionary

    base = _tracker_base()

    class StepTracker(base):  # type: ignore[misc, valid-type]
        """FSDPMemTracker for a LightningModule whose root is not sharded (autoshard shards its children), with any
        number of optimizers, Lightning's closure-style ``optimizer.step(closure)``, units called twice in one step
        (two views through a student), parameters left unsharded, and the place of the peak in words.

        torch's tracker insists on an FSDP root and one optimizer, and refuses a unit called twice at top level;
        those are its bookkeeping limits, not the memory it sees, which is unchanged here.
        """

        def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
            MemTracker.__init__(self)
            self._root_mod = module
            self._optm = None
            self._optimizers = list(optimizers)
            self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
            self._fsdp_state = _FSDPState.PRE_FW
            self._ref_class = _FSDPRefType
            self._plain_handles: list[Any] = []
            self._stepping = False
            self.peak_at = ""
            known, seen = self._mod_tracker._known_modules, self._mod_tracker._seen_modules
            for name, m in module.named_modules():  # module paths as print(model) shows them, not type names
                known[m] = name or type(module).__name__
                seen.add(m)

        # Units called more than once at top level in one step (torch raises "multiple iterative calls").
        def _fsdp_state_pre_forward(self, fsdp_mod: nn.Module, orig: Callable[..., Any]) -> Callable[..., Any]:
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def pre_forward(*args: Any, **kwargs: Any) -> Any:
                parents = self._mod_tracker.parents
                added = _NOT_A_MODULE not in parents
                parents.add(_NOT_A_MODULE)
                try:
                    return inner(*args, **kwargs)
                finally:
                    if added:
                        self._mod_tracker.parents.discard(_NOT_A_MODULE)

            return pre_forward

        # Every optimizer; temporaries of the step stay "Temp"-like activations, only states count as OptState.
        def _instrument_optimizer(self) -> None:
            handles = []
            for optimizer in self._optimizers:
                self._track_optimizer_states(_FSDPRefType.OPT, optimizer)
                handles.append(optimizer.register_step_pre_hook(self._before_step))
                handles.append(optimizer.register_step_post_hook(self._after_step))
            self._optimizer_hook_handles = tuple(handles) or None

        def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            self._stepping = True
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer itself
            if closure is None:
                return None

            def closure_outside_step() -> Any:  # Lightning runs forward and backward inside optimizer.step
                self._stepping = False
                try:
                    return closure()
                finally:
                    self._stepping = True

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_outside_step}
            return (args[0], closure_outside_step, *args[2:]), kwargs

        def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            self._track_optimizer_states(_FSDPRefType.OPT, optimizer)
            self._stepping = False

        # Parameters no unit owns (0-dim, root, probes): model states too, and so are their gradients.
        def _register_module_and_optimizer_hooks(self) -> None:
            super()._register_module_and_optimizer_hooks()
            for p in self._root_mod.parameters():
                if isinstance(p, DTensor):
                    continue
                self._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)
                if p.grad is not None:
                    self._update_and_maybe_create_winfos(p.grad, _FSDPRefType.SHARDED_GRAD)
                if p.requires_grad:
                    self._plain_handles.append(p.register_post_accumulate_grad_hook(self._plain_grad))

        def _plain_grad(self, p: torch.Tensor) -> None:
            if p.grad is not None:
                self._update_and_maybe_create_winfos(p.grad, _FSDPRefType.SHARDED_GRAD)

        def _deregister_module_and_optimizer_hooks(self) -> None:
            super()._deregister_module_and_optimizer_hooks()
            for handle in self._plain_handles:
                handle.remove()
            self._plain_handles.clear()

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = sum(self._peak_mem.values())
            super()._update_peak_stats(peak_state)
            if sum(self._peak_mem.values()) > before:
                self.peak_at = self._where()

        def _where(self) -> str:
            if self._stepping:
                return "optimizer step"
            names = [n for n in self._mod_tracker.parents if n not in ("Global", _NOT_A_MODULE)]
            root = type(self._root_mod).__name__
            names = [n for n in names if n != root]
            deepest = max(names, key=lambda n: (n.count("."), len(n)), default="")
            phase = "backward" if self._mod_tracker.is_bw else "forward"
            if deepest:
                return f"{phase} of {deepest}"
            return "backward" if phase == "backward" else "training_step, outside any module (loss)"

        def peak_by_kind(self) -> dict[str, int]:
            """The peak snapshot of the device with the highest peak, by category name (and "Total")."""
            snapshot = self.get_tracker_snapshot("peak")
            if not snapshot:
                return {"Total": 0}
            device = max(snapshot, key=lambda d: snapshot[d].get("Total", 0))
            return {getattr(k, "value", str(k)): int(v) for k, v in snapshot[device].items()}

        def step_memory(self, world_size: int, rank: int, forward_only: bool = False, notes: Sequence[str] = (), **extra: Any) -> StepMemory:
            kinds = self.peak_by_kind()
            total = lambda names: sum(kinds.get(n, 0) for n in names)  # noqa: E731
            return StepMemory(
                world_size=world_size,
                rank=rank,
                peak=kinds.get("Total", 0),
                activations=total(ACTIVATIONS),
                gathered=total(GATHERED),
                model_states=total(MODEL_STATES),
                at=self.peak_at or "before the step",
                forward_only=forward_only,
                notes=tuple(dict.fromkeys(notes)),
                by_kind=tuple((k, v) for k, v in kinds.items() if k != "Total" and v),
                **extra,
            )

    return StepTracker


_TRACKER: type | None = None


def step_tracker(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Any:
    """A tracker of every tensor of ``module``'s training step (real or fake tensors): enter it around one step.

    Tensors alive before entering count only if they are the module's parameters, gradients and buffers, the
    optimizers' states, or inputs given to ``track_inputs``. The real-run benchmark uses this very class, so the
    estimate and the measurement count the same things.
    """
    global _TRACKER
    if _TRACKER is None:
        _TRACKER = _make_tracker_class()
    return _TRACKER(module, optimizers)


def measuring_callback(batch_index: int = 1) -> Any:
    """A Lightning callback measuring a real run's training batch ``batch_index`` (0-based; the default, step 2,
    follows the step that creates the optimizer states) with the tracker ``measure_step`` uses: to check an
    estimate against a real run. After fit, its ``result`` is that step's StepMemory on this rank (None before).

    The window opens at ``on_train_batch_start`` and closes at ``on_train_batch_end``: place it last among the
    callbacks, so that earlier callbacks' batch-end work (a probe's step) is inside it.
    """
    import lightning.pytorch as pl

    class MeasuredStep(pl.Callback):
        def __init__(self) -> None:
            self.tracker: Any = None
            self.result: StepMemory | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx != batch_index:
                return
            optimizers = returned_optimizers(list(trainer.optimizers))
            optimizers += [o for c in trainer.callbacks for o in held_optimizers(c) if o not in optimizers]
            gc.collect()
            self.tracker = step_tracker(pl_module, optimizers)
            self.tracker.track_inputs((batch,))
            self.tracker.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.tracker is None:
                return
            self.tracker.__exit__(None, None, None)
            self.result = self.tracker.step_memory(trainer.world_size, trainer.global_rank)
            self.tracker = None

    return MeasuredStep()


# -- the batch ------------------------------------------------------------------------------------------------------
def load_batch(spec: str) -> Callable[..., Any]:
    """``path/to/file.py:make_batch`` or ``package.module:make_batch``: a function returning one micro-batch per rank,
    as the DataLoader yields it (the ``batch`` argument of ``training_step``)."""
    from autoshard.target import load_attribute

    example = "name a function after a colon, e.g. --batch train.py:make_batch (it returns one batch, as your DataLoader yields it)"
    attr = str(spec).rpartition(":")[2]
    obj = load_attribute(spec, "--batch", example, f"give the path of the file that defines {attr}, e.g. train.py:{attr}", "function")
    if not callable(obj):
        raise AutoShardError(f"--batch {spec!r} is a {type(obj).__name__}, not a function. Fix: {example}")
    return obj


def where_defined(fn: Any) -> str:
    """``name (file.py:line)`` of a function (a callable object: its class name), for messages about the user's code."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    name = name.rpartition("<locals>.")[2]  # a function defined inside another: its own name
    code = getattr(getattr(fn, "func", fn), "__code__", None)  # functools.partial: the wrapped function
    if code is None:
        return name
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def call_batch(make_batch: Callable[[], Any]) -> Any:
    """``make_batch()``, refused in words when it raises: the function (file:line), the line that raised, the
    exception and a Fix. Callers choose the device context (explain: meta; the simulated step: FakeTensorMode)."""
    try:
        return make_batch()
    except Exception as exc:
        raise AutoShardError(
            f"the batch function {where_defined(make_batch)} raised {_why(exc)}. explain calls it with no arguments"
            f" under the meta device and FakeTensorMode (tensors without memory or values), so it cannot read data."
            f" Fix: make it build tensors of one micro-batch's shapes, e.g."
            f" `return torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))`"
        ) from exc


def describe_batch(batch: Any, limit: int = 240) -> str:
    """A batch's structure with each tensor's dtype and shape, ``(float32[32, 65], int64[32])``: what a user compares
    with what training_step expects."""

    def one(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).removeprefix('torch.')}[{', '.join(map(str, x.shape))}]"
        if isinstance(x, Mapping):
            return "{" + ", ".join(f"{k!r}: {one(v)}" for k, v in x.items()) + "}"
        if isinstance(x, tuple):
            return "(" + ", ".join(one(v) for v in x) + ("," if len(x) == 1 else "") + ")"
        if isinstance(x, list):
            return "[" + ", ".join(one(v) for v in x) + "]"
        return type(x).__name__

    text = one(batch)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the fake world -------------------------------------------------------------------------------------------------
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


def _mesh(intent: ShardingIntent, world_size: int) -> Any:
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


def _fake_parameters(module: nn.Module, callbacks: Sequence[object], dtype: torch.dtype | None) -> None:
    """Replace every parameter and buffer by a fake CPU tensor of its shape (tied weights stay tied); ``dtype``
    converts floating ones as Lightning's "-true" precisions do. Callback optimizers are pointed at the new
    parameters. Must run inside the FakeTensorMode."""
    new: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=cast, device="cpu")

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
                m._parameters[name] = new[id(p)]  # type: ignore[assignment]
        for name, b in m._buffers.items():
            if b is not None:
                if id(b) not in new:
                    new[id(b)] = fake(b)
                m._buffers[name] = new[id(b)]
    for callback in callbacks:
        for optimizer in held_optimizers(callback):
            for group in optimizer.param_groups:
                group["params"] = [new.get(id(p), p) for p in group["params"]]


def _convert_input(batch: Any, dtype: torch.dtype | None) -> Any:
    """Lightning's "-true" precisions cast floating inputs to the module's dtype (HalfPrecision.convert_input)."""
    if dtype is None:
        return batch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def _user_line(exc: BaseException) -> str:
    """Where the user's code raised: the innermost frame outside torch, Lightning, transformers and autoshard."""
    frames = user_frames(exc, skip_site_packages=True)
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`"


def _why(exc: BaseException) -> str:
    """An exception raised under fake tensors, in words: most are reads of values fake tensors do not have."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException

    where = _user_line(exc)
    if isinstance(exc, DataDependentOutputException):
        return f"it reads a tensor's value{where} (.item(), .tolist(), `if tensor:`), and fake tensors have no values"
    if isinstance(exc, DynamicOutputShapeException):
        return f"an op's output shape depends on tensor values{where} (nonzero, unique, boolean-mask indexing), unknown on fake tensors"
    if isinstance(exc, UnsupportedOperatorException):
        return f"an operator has no fake-tensor implementation{where} ({exc})"
    text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}{where}"


# -- one step -------------------------------------------------------------------------------------------------------
@dataclass
class _Run:
    module: nn.Module
    callbacks: list[Any]
    optimizers: list[torch.optim.Optimizer]
    batch: Any
    notes: list[str] = field(default_factory=list)
    manual: bool = False  # automatic_optimization = False: the step is the user's (self.optimizers(), manual_backward)


class _StandInStrategy:
    """What a manual-optimization step reaches through ``self.trainer.strategy``, doing what Lightning's strategy does
    with its precision plugin: ``manual_backward`` calls the module's ``backward`` hook (``loss.backward()``), and a
    LightningOptimizer's ``step`` runs ``optimizer.step(closure=...)``. No Fabric: the module stays a plain
    LightningModule, so ``self.optimizers()`` takes Lightning's own Trainer path."""

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        self.lightning_module = module
        self._lightning_optimizers = [LightningOptimizer._to_lightning_optimizer(o, self) for o in optimizers]

    def backward(self, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self.lightning_module.backward(loss, *args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure, **kwargs)


class _StandInTrainer:
    """``self.trainer`` of the module copy a manual-optimization step runs on: its optimizers (``self.optimizers()``
    returns them wrapped in LightningOptimizer, as in fit), its LR schedulers, step 0 of epoch 0 on the measured rank, and
    ``barebones`` so that ``self.log`` returns at once. Anything else is not there, and says so by name."""

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], world_size: int, rank: int) -> None:
        from lightning.pytorch.plugins.precision import Precision
        from lightning.pytorch.utilities.types import LRSchedulerConfig

        self.strategy = _StandInStrategy(module, optimizers)
        self.optimizers = list(optimizers)
        self.lr_scheduler_configs = [LRSchedulerConfig(s) for s in schedulers]
        self.precision_plugin = Precision()
        self.world_size, self.global_rank, self.local_rank, self.node_rank = world_size, rank, rank, 0
        self.is_global_zero = rank == 0
        self.global_step = self.current_epoch = 0
        self.accumulate_grad_batches = 1
        self.gradient_clip_val = self.gradient_clip_algorithm = None
        self.barebones = True
        self.logger, self.loggers, self.progress_bar_callback = None, [], None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"self.trainer.{name} is not available in autoshard's simulated step (a stand-in Trainer holding the"
            f" optimizers, schedulers, step and rank)"
        )


def _returned_schedulers(configured: Any) -> list[Any]:
    """The LR schedulers in ``configure_optimizers``'s return shapes (a dict with "lr_scheduler", or
    ``([optimizers], [schedulers])``), each unwrapped from its ``{"scheduler": ...}`` config."""
    unwrap = lambda s: s.get("scheduler") if isinstance(s, Mapping) else s  # noqa: E731
    if isinstance(configured, Mapping):
        return [unwrap(configured["lr_scheduler"])] if configured.get("lr_scheduler") is not None else []
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and all(isinstance(part, (list, tuple)) for part in configured):
            return [unwrap(s) for s in configured[1]]
        return [s for item in configured if isinstance(item, Mapping) for s in _returned_schedulers(item)]
    return []


def _prepare(
    factory: Any,
    intent: ShardingIntent,
    world_size: int,
    precision: PrecisionPlan,
    make_batch: Callable[[], Any] | None,
    mode: Any,
    num_nodes: int = 1,
    rank: int = 0,
) -> _Run:
    """Build on meta, make every tensor fake, shard as FSDP2Strategy.setup does with autoshard's plan, build the
    optimizers and the batch.

    The plan makes EMA teacher units reshard after forward itself; the strategy adds the guarantees of
    ``autoshard.lightning.guarantees`` only to modules the user sharded, which measure_step refuses (below).
    """
    from autoshard.adapters.fsdp2 import is_sharded, plan_fsdp2
    from autoshard.target import build_on_meta

    built = build_on_meta(factory)
    module, callbacks, notes = built.module, list(built.callbacks), list(built.notes)
    notes += _configure_model(module)
    if is_sharded(module):
        raise AutoShardError(
            f"{type(module).__name__} is already sharded when built (fully_shard in the factory or in"
            f" configure_model): measure_step measures autoshard's own plan, applied to the unsharded module."
            f" Fix: return the module unsharded and let strategy='auto-shard' shard it"
        )
    convert = None if precision.autocast or precision.master is Dtype.FLOAT32 else precision.master.torch
    with mode:
        _fake_parameters(module, callbacks, convert)
    needs = inspect_needs(module, callbacks=callbacks, call_hooks=False)
    mesh = _mesh(intent, world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_fsdp2(module, intent, needs, precision)
        plan.hsdp = intent.hsdp_sizes(world_size, num_nodes)
        plan.apply(module, mesh)  # outside the fake mode: it reads the mesh's real rank tensor
    if intent.offload != "none":
        notes.append(
            f"offload={intent.offload!r}: everything here is CPU memory, so the offloaded states are inside this peak;"
            f" on an accelerator they live in host memory (memory.py says which)"
        )
    notes += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    module.train()
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[Any] = []
    with mode:
        configure = getattr(module, "configure_optimizers", None)
        if callable(configure):
            try:
                configured = configure()
                optimizers += returned_optimizers(configured)
                schedulers += _returned_schedulers(configured)
            except Exception as exc:
                notes.append(
                    f"configure_optimizers() raised ({_why(exc)}): no optimizer step, so optimizer states and the"
                    f" step's temporaries are not in the peak (memory.py counts the states)"
                )
        own = list(optimizers)  # the module's own: what self.optimizers() returns in fit
        for callback in callbacks:
            optimizers += [o for o in held_optimizers(callback) if o not in optimizers]
        batch = None
        if make_batch is not None:
            batch = _convert_input(call_batch(make_batch), convert)
    manual = getattr(module, "automatic_optimization", True) is False
    if manual:  # attach the optimizers as Lightning does, on this copy only: the user's step calls them itself
        module.trainer = _StandInTrainer(module, own, schedulers, world_size, rank)
    return _Run(module, callbacks, optimizers, batch, notes, manual)


def _train_step(run: _Run, precision: PrecisionPlan) -> None:
    """One step in the order of Lightning's automatic optimization (its Closure): training_step, then zero_grad
    (so the previous step's gradients are still alive during the forward), backward, optimizer step; then the
    batch-end hooks (callbacks', then the module's: EMA updates, probes). Under manual optimization training_step
    is the whole step (its zero_grad, manual_backward and step), as in Lightning's manual loop."""
    module, batch = run.module, run.batch
    with _autocast(precision):
        out = module.training_step(batch, 0)
    if not run.manual:
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'")
        for optimizer in run.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        for optimizer in run.optimizers:
            optimizer.step()
    for owner, args in [*((c, (None, module, out, batch, 0)) for c in run.callbacks), (module, (out, batch, 0))]:
        hook = getattr(owner, "on_train_batch_end", None)
        if callable(hook):
            try:
                hook(*args)
            except Exception as exc:  # a probe that logs float(loss): what ran before the failure is measured
                run.notes.append(
                    f"{type(owner).__name__}.on_train_batch_end stopped on fake tensors: {_why(exc)}; what it does after that is not measured"
                )
    del out


def _autocast(precision: PrecisionPlan) -> Any:
    """Lightning's MixedPrecision.forward_context: autocast on the device, without its weight-cast cache."""
    if not precision.autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=precision.compute.torch, cache_enabled=False)


def _configure_model(module: nn.Module) -> list[str]:
    """Lightning calls an overridden ``configure_model`` before the strategy shards; so does this, on meta."""
    import lightning.pytorch as pl

    if not isinstance(module, pl.LightningModule) or type(module).configure_model is pl.LightningModule.configure_model:
        return []
    try:
        with torch.device("meta"):
            module.configure_model()
    except Exception as exc:
        return [f"{type(module).__name__}.configure_model() could not run without a Trainer ({_why(exc)}): what it builds is not measured"]
    return []


def _fake_example(example: Any, dtype: torch.dtype | None) -> Any:
    """``example_input_array`` as fake CPU tensors (built in ``__init__`` under the meta device, it is meta);
    inside the FakeTensorMode."""
    from torch.utils._pytree import tree_map_only

    def fake(t: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return torch.zeros(t.shape, dtype=cast, device="cpu") if t.is_meta else t.to(cast)

    return tree_map_only(torch.Tensor, fake, example)


def _forward(run: _Run, precision: PrecisionPlan) -> None:
    example = run.batch
    with _autocast(precision):
        if isinstance(example, Mapping):
            out = run.module(**example)
        elif isinstance(example, tuple):
            out = run.module(*example)
        else:
            out = run.module(example)
    del out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's "self.log without a Trainer" warnings and torch's fake-mode chatter are not the user's: FakeTensorMode
    logs the full traceback of every op that fails (a wrong-shaped batch: 20 lines per op, each prefixed with the
    rank), and the error reported afterwards says it in one line. Only for the simulation: restored after."""
    import logging

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    was = fake_log.disabled
    fake_log.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        fake_log.disabled = was


def measure_step(
    factory: Any,
    intent: ShardingIntent,
    world_size: int,
    precision: PrecisionPlan,
    *,
    make_batch: Callable[[], Any] | None = None,
    rank: int = 0,
    num_nodes: int = 1,
) -> StepMemory:
    """Peak bytes of live tensors on ``rank`` during one training step on ``world_size`` ranks, by kind.

    ``factory`` is what ``autoshard.target.build_on_meta`` takes; it is called afresh (``fully_shard`` mutates the
    module), twice if ``training_step`` cannot run without a Trainer and the step falls back to
    ``forward(example_input_array)``. ``make_batch()`` returns one micro-batch as ``training_step`` receives it; it
    runs under FakeTensorMode, so a batch of any size costs no memory. Without it, only the forward of
    ``example_input_array`` runs (``forward_only``: no backward, no optimizer step, so the peak is a lower bound).

    ``num_nodes``: the nodes the ranks fill, for ``shard_size='node'``.

    CPU tensors only: CUDA allocator rounding and fragmentation, and CUDA/NCCL workspaces, are not modelled.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AutoShardError(f"world size must be a positive integer, got {world_size!r}. Fix: e.g. world_size=8")
    if not 0 <= rank < world_size:
        raise AutoShardError(f"rank {rank} is not in a world of {world_size} ranks. Fix: rank= 0 to {world_size - 1}")
    _tracker_base()
    extra: dict[str, Any] = {"precision": precision.precision.value, "activation_checkpointing": intent.activation_checkpointing}
    convert = None if precision.autocast or precision.master is Dtype.FLOAT32 else precision.master.torch
    notes: list[str] = []
    failed = ""  # why the training step could not run on make_batch's batch, with its Fix
    with fake_world(world_size, rank), _quiet():
        if make_batch is not None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            run = _prepare(factory, intent, world_size, precision, make_batch, mode, num_nodes, rank)
            try:
                with mode:
                    with _flop_counter() as counter:  # the warm-up runs the same ops: counted there, not in the peak's step
                        _train_step(run, precision)  # warm-up: optimizer states and lazy FSDP state exist after it
                    extra["flops"] = int(counter.get_total_flops()) if counter is not None else 0
                    gc.collect()
                    tracker = step_tracker(run.module, run.optimizers)
                    tracker.track_inputs((run.batch,))
                    with tracker:
                        _train_step(run, precision)
                return tracker.step_memory(world_size, rank, False, run.notes, **extra)
            except AutoShardError:
                raise
            except Exception as exc:
                failed = _step_failed(exc, make_batch, run.batch)  # said once, in ``incomplete`` (or refused below)
            del run
            gc.collect()
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        run = _prepare(factory, intent, world_size, precision, None, mode, num_nodes, rank)
        notes = run.notes + notes
        if getattr(run.module, "example_input_array", None) is None:
            if failed:  # the user gave a batch: say why it did not run, never "pass a batch function"
                raise AutoShardError(failed)
            raise AutoShardError(
                f"no batch to measure activations with: {'; '.join(notes) + '; ' if notes else ''}"
                f"{type(run.module).__name__} has no example_input_array. Fix: pass a batch function"
                f" (autoshard explain --batch train.py:make_batch, or measure_step(make_batch=...)), or set"
                f" self.example_input_array in __init__"
            )
        incomplete = failed
        if make_batch is None:
            notes.append("no batch function given: forward(example_input_array) only, no backward or optimizer step (a lower bound)")
            incomplete = (
                "no batch function given, so only forward(example_input_array) ran (no backward, no optimizer step)."
                " Fix: pass a batch function (autoshard explain --batch train.py:make_batch, or measure_step(make_batch=...))"
            )
        try:
            with mode:
                run.batch = _fake_example(run.module.example_input_array, convert)
                tracker = step_tracker(run.module, run.optimizers)
                tracker.track_inputs((run.batch,))
                with tracker:
                    _forward(run, precision)
        except Exception as exc:
            if _reads_values(exc):
                fix = "avoid reading tensor values in forward (compute on tensors instead), or estimate on a real device"
            else:
                fix = f"make example_input_array, {describe_batch(run.batch)}, what forward takes, or estimate on a real device"
            raise AutoShardError(
                f"activation memory could not be measured: forward(example_input_array) failed on fake tensors: {_why(exc)}. Fix: {fix}"
            ) from exc
        return tracker.step_memory(world_size, rank, True, notes, incomplete=incomplete, **extra)


@contextlib.contextmanager
def _flop_counter() -> Iterator[Any]:
    """torch's FlopCounterMode (matmuls, convolutions, attention: the ops that cost time) around one step; None
    where this torch lacks it. Activation checkpointing's price is the FLOPs its recomputation adds to the step."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:
        yield None
        return
    counter = FlopCounterMode(display=False)
    with counter:
        yield counter


def _reads_values(exc: BaseException) -> bool:
    """An op fake tensors cannot run (a value read, a value-dependent shape, no fake kernel), not a wrong input."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException

    return isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException))


def _step_failed(exc: BaseException, make_batch: Callable[[], Any], batch: Any) -> str:
    """Why training_step did not run on the user's batch, in one sentence with the batch's shapes and a Fix that
    is not "pass a batch" (they did)."""
    head = f"training_step could not run on the batch from {where_defined(make_batch)}, {describe_batch(batch)}: {_why(exc)}."
    if _reads_values(exc):
        fix = (
            "keep training_step's values on tensors (no .item(), no `if tensor:`), or measure a real run with"
            " autoshard.activations.measuring_callback()"
        )
    else:
        name = getattr(make_batch, "__name__", "<lambda>").replace("<lambda>", "the batch function")
        fix = (
            f"make {name} return one micro-batch exactly as your DataLoader yields it to training_step (compare the shapes"
            f" above with the line that failed); if it already does, that line fails under the same FSDP2 plan in"
            f" training too, or needs what the simulated step lacks: a few real steps with"
            f" autoshard.activations.measuring_callback() tell which"
        )
    return f"{head} Fix: {fix}"


__all__ = [
    "StepMemory",
    "call_batch",
    "describe_batch",
    "fake_world",
    "in_detached_world",
    "load_batch",
    "measure_step",
    "measuring_callback",
    "step_tracker",
    "where_defined",
]
