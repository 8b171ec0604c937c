"""One simulated step's run, prepared: the module built on meta, its tensors made fake, sharded with autoshard's FSDP2
plan on the fake world, its optimizers and schedulers, and the batch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard.activations.batch import call_batch
from autoshard.activations.failures import describe_failure
from autoshard.activations.stand_in import StandInTrainer, returned_schedulers
from autoshard.activations.world import data_parallel_mesh
from autoshard.adapters.checkpointing import is_checkpointed
from autoshard.adapters.compile import Compile
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelDims
from autoshard.needs import compiled_modules, held_optimizers, inspect_needs, returned_optimizers
from autoshard.precision import Dtype, PrecisionPlan
from autoshard.privates import in_torch


@dataclass
class Run:
    module: nn.Module
    callbacks: list[Any]
    optimizers: list[torch.optim.Optimizer]
    batch: Any
    notes: list[str] = field(default_factory=list)
    manual: bool = False  # automatic_optimization = False: the step is the user's (self.optimizers(), manual_backward)
    compiled: dict[str, nn.Module] = field(default_factory=dict)  # compiled, unchecked blocks -> an eager meta copy of one alike


def _first_of_each_class(module: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    """Each name -> the first of ``names`` whose module has the same class (one count per kind of block)."""
    first: dict[type, nn.Module] = {}
    return {name: first.setdefault(type(module.get_submodule(name)), module.get_submodule(name)) for name in names}


def _fake_parameters(module: nn.Module, callbacks: Sequence[object], dtype: torch.dtype | None) -> None:
    """Replace every parameter and buffer by a fake CPU tensor of its shape (tied weights stay tied); ``dtype``
    converts floating ones as Lightning's "-true" precisions do. Callback optimizers are pointed at the new
    parameters. Must run inside the FakeTensorMode."""
    new: dict[int, torch.Tensor] = {}
    fake = lambda t: torch.empty(t.shape, dtype=_cast(t, dtype), device="cpu")  # noqa: E731
    param = lambda p: nn.Parameter(fake(p), requires_grad=p.requires_grad)  # noqa: E731
    for m in module.modules():
        for tensors, make in ((m._parameters, param), (m._buffers, fake)):
            for name, t in tensors.items():
                if t is not None:
                    if id(t) not in new:
                        new[id(t)] = make(t)
                    tensors[name] = new[id(t)]  # type: ignore[index]
    for callback in callbacks:
        for optimizer in held_optimizers(callback):
            for group in optimizer.param_groups:
                group["params"] = [new.get(id(p), p) for p in group["params"]]


def _convert_input(batch: Any, dtype: torch.dtype | None) -> Any:
    """Lightning's "-true" precisions cast floating inputs to the module's dtype (HalfPrecision.convert_input)."""
    return batch if dtype is None else in_torch.tree_map_only(torch.Tensor, lambda t: t.to(_cast(t, dtype)), batch)


def prepare_run(
    factory: Any,
    intent: ShardingIntent,
    world_size: int,
    precision: PrecisionPlan,
    make_batch: Callable[[], Any] | None,
    mode: Any,
    num_nodes: int = 1,
    rank: int = 0,
) -> Run:
    """Build on meta, make every tensor fake, shard as FSDP2Strategy.setup does with autoshard's plan, build the
    optimizers and the batch. (``engine.guarantees`` apply only to modules the user sharded, refused here.)"""
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
    may_compile = Compile.of(intent.compile) is Compile.BLOCKS or bool(compiled_modules(module))  # the plan's own rule
    unsharded = copy.deepcopy(module) if may_compile else None  # on meta: what compiled blocks are counted on
    with mode:
        _fake_parameters(module, callbacks, convert)
    needs = inspect_needs(module, callbacks=callbacks, call_hooks=False)
    dims = ParallelDims.resolve(intent, world_size, num_nodes)
    mesh = data_parallel_mesh(dims)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_fsdp2(module, intent, needs, precision, dims=dims)
        eager = _first_of_each_class(unsharded, plan.compiled) if unsharded is not None else {}
        plan.apply(module, mesh)  # outside the fake mode: it reads the mesh's real rank tensor
    # a checkpointed block keeps only its input, compiled or not: only the others are counted (activations.compiled)
    compiled = {name: block for name, block in eager.items() if not is_checkpointed(module.get_submodule(name))}
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
                schedulers += returned_schedulers(configured)
            except Exception as exc:
                notes.append(
                    f"configure_optimizers() raised ({describe_failure(exc)}): no optimizer step, so optimizer states and the"
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
        module.trainer = StandInTrainer(module, own, schedulers, world_size, rank)
    return Run(module, callbacks, optimizers, batch, notes, manual, compiled)


def _configure_model(module: nn.Module) -> list[str]:
    """Lightning calls an overridden ``configure_model`` before the strategy shards; so does this, on meta."""
    import lightning.pytorch as pl

    if not isinstance(module, pl.LightningModule) or type(module).configure_model is pl.LightningModule.configure_model:
        return []
    try:
        with torch.device("meta"):
            module.configure_model()
    except Exception as exc:
        return [
            f"{type(module).__name__}.configure_model() could not run without a Trainer ({describe_failure(exc)}): what it builds is not measured"
        ]
    return []


def fake_example(example: Any, dtype: torch.dtype | None) -> Any:
    """``example_input_array`` as fake CPU tensors (built in ``__init__`` under the meta device, it is meta); inside the FakeTensorMode."""
    fake = lambda t: torch.zeros(t.shape, dtype=_cast(t, dtype), device="cpu") if t.is_meta else t.to(_cast(t, dtype))  # noqa: E731
    return in_torch.tree_map_only(torch.Tensor, fake, example)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype "-true" precisions give a tensor: ``dtype`` for floating ones."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype
