"""The tracker: torch's FSDPMemTracker extended to a LightningModule (``step_tracker``), and the Lightning callback
that measures a real run's step with it (``measuring_callback``), so estimate and measurement count the same things."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autoshard.activations.step_memory import ACTIVATIONS, GATHERED, MODEL_STATES, StepMemory
from autoshard.errors import AutoShardError
from autoshard.needs import held_optimizers, returned_optimizers
from autoshard.privates import in_torch

_NOT_A_MODULE = "autoshard: training_step"  # a pseudo-parent while the step runs (see StepTracker)


def tracker_base() -> type:
    try:
        return in_torch.FSDPMemTracker
    except ImportError as exc:  # torch < 2.5
        raise AutoShardError(
            f"measuring activation memory needs torch's FSDPMemTracker (torch.distributed._tools), not importable here"
            f" ({exc}). Fix: upgrade torch (2.6 or newer), or use autoshard explain --no-step (model states only)"
        ) from None


class _StepParts:
    """What ``StepTracker`` adds to torch's tracker that reads none of its private types: a unit called twice at top
    level, Lightning's closure-style ``optimizer.step(closure)``, DTensor's sharding propagation left out, and the peak
    (its place in words, by kind)."""

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

    # DTensor's sharding propagation runs an op once more on fake tensors of its own to learn its output's
    # shapes: no memory of the step, but torch's tracker counted it. torch 2.13 propagates an op at its first sight
    # (the warm-up step, unless the measured step meets a new one); torch 2.11 at every fused or foreach optimizer
    # step (list ops on DTensors): 32 bytes per parameter where the real step holds 16 (the flat 26.41 GiB on a GPU).
    def __enter__(self) -> Any:
        from torch.distributed.tensor import DTensor

        self._dtensor, self._propagating = DTensor, 0
        self._uncounted = _propagation_uncounted(self)
        self._uncounted.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._uncounted.__exit__(None, None, None)
            raise

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            self._uncounted.__exit__(None, None, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._propagating and not any(t is self._dtensor for t in types):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

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
        return f"{'backward' if phase == 'backward' else 'forward'} of training_step's own ops (outside any module: the loss, residual adds)"

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


@functools.cache
def _tracker_class() -> type:
    from torch.distributed.tensor import DTensor
    from torch.utils.weak import WeakIdKeyDictionary

    base = tracker_base()

    class StepTracker(_StepParts, base):  # type: ignore[misc, valid-type]
        """FSDPMemTracker for a LightningModule whose root is not sharded, with any number of optimizers, units called
        twice in one step and parameters left unsharded: torch's bookkeeping limits, not the memory it sees."""

        def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
            in_torch.MemTracker.__init__(self)
            self._root_mod = module
            self._optm = None
            self._optimizers = list(optimizers)
            self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
            self._fsdp_state = in_torch.FSDPState.PRE_FW
            self._ref_class = in_torch.FSDPRefType
            self._plain_handles: list[Any] = []
            self._stepping = False
            self.peak_at = ""
            known, seen = self._mod_tracker._known_modules, self._mod_tracker._seen_modules
            for name, m in module.named_modules():  # module paths as print(model) shows them, not type names
                known[m] = name or type(module).__name__
                seen.add(m)

        # Every optimizer; temporaries of the step stay "Temp"-like activations, only states count as OptState.
        def _instrument_optimizer(self) -> None:
            handles = []
            for optimizer in self._optimizers:
                self._track_optimizer_states(in_torch.FSDPRefType.OPT, optimizer)
                handles.append(optimizer.register_step_pre_hook(self._before_step))
                handles.append(optimizer.register_step_post_hook(self._after_step))
            self._optimizer_hook_handles = tuple(handles) or None

        def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            self._track_optimizer_states(in_torch.FSDPRefType.OPT, optimizer)
            self._stepping = False

        # Parameters no unit owns (0-dim, root, probes): model states too, and so are their gradients.
        def _register_module_and_optimizer_hooks(self) -> None:
            super()._register_module_and_optimizer_hooks()
            for p in self._root_mod.parameters():
                if isinstance(p, DTensor):
                    continue
                self._update_and_maybe_create_winfos(p, in_torch.FSDPRefType.SHARDED_PARAM)
                if p.grad is not None:
                    self._update_and_maybe_create_winfos(p.grad, in_torch.FSDPRefType.SHARDED_GRAD)
                if p.requires_grad:
                    self._plain_handles.append(p.register_post_accumulate_grad_hook(self._plain_grad))

        def _plain_grad(self, p: torch.Tensor) -> None:
            if p.grad is not None:
                self._update_and_maybe_create_winfos(p.grad, in_torch.FSDPRefType.SHARDED_GRAD)

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

    return StepTracker


@contextlib.contextmanager
def _propagation_uncounted(tracker: Any) -> Iterator[None]:
    """While it lasts, ``tracker._propagating`` counts the DTensor sharding propagations running (their ops are
    skipped by ``StepTracker.__torch_dispatch__``)."""
    propagator = in_torch.ShardingPropagator
    original = propagator._propagate_tensor_meta_non_cached

    def flagged(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker._propagating += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker._propagating -= 1

    propagator._propagate_tensor_meta_non_cached = flagged
    try:
        yield
    finally:
        propagator._propagate_tensor_meta_non_cached = original


def step_tracker(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Any:
    """A tracker of every tensor of ``module``'s training step (real or fake tensors): enter it around one step.
    Tensors alive before count only as parameters, gradients, buffers, optimizer states or ``track_inputs``."""
    return _tracker_class()(module, optimizers)


def measuring_callback(batch_index: int = 1) -> Any:
    """A Lightning callback measuring a real run's batch ``batch_index`` (0-based; the default follows the step that
    creates the optimizer states) with ``measure_step``'s tracker; after fit, ``result`` is its StepMemory. Place it
    last among the callbacks, so that earlier callbacks' batch-end work is inside the window.
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

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            """A step that raised leaves no tracker entered: its hooks and dispatch mode are this process's."""
            if self.tracker is not None:
                self.tracker.__exit__(type(exception), exception, exception.__traceback__)
                self.tracker = None

    return MeasuredStep()
