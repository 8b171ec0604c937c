"""``measure_step``: one training step run on fake tensors in Lightning's order (a warm-up step, then the measured one
under the tracker), or ``forward(example_input_array)`` alone when the step cannot run (a lower bound)."""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from autoshard.activations.batch import STEP_INDICES, SkippedStep, describe_batch, step_failure
from autoshard.activations.compiled import block_saving
from autoshard.activations.failures import describe_failure, reads_values
from autoshard.activations.prepare import Run, fake_example, prepare_run
from autoshard.activations.step_memory import StepMemory
from autoshard.activations.tracker import step_tracker, tracker_base
from autoshard.activations.world import fake_world, settle_autograd_engine
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.precision import Dtype, PrecisionPlan
from autoshard.privates import in_torch


def _train_step(run: Run, precision: PrecisionPlan) -> None:
    """One step in Lightning's order (its Closure): training_step, zero_grad (the previous gradients are alive during
    the forward), backward, optimizer step, then the batch-end hooks (callbacks', then the module's). Under manual
    optimization training_step is the whole step."""
    module, batch = run.module, run.batch
    with _autocast(precision):
        out, batch_idx = _training_step(run)
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
    for owner, args in [*((c, (None, module, out, batch, batch_idx)) for c in run.callbacks), (module, (out, batch, batch_idx))]:
        hook = getattr(owner, "on_train_batch_end", None)
        if callable(hook):
            try:
                hook(*args)
            except Exception as exc:  # a probe that logs float(loss): what ran before the failure is measured
                run.notes.append(
                    f"{type(owner).__name__}.on_train_batch_end stopped on fake tensors: {describe_failure(exc)}; what it does after that is not measured"
                )
    del out


def _training_step(run: Run) -> tuple[Any, int]:
    """training_step's output and the batch_idx that gave it: the first of ``STEP_INDICES`` whose step returns
    something (a step returning None trains nothing: Lightning skips its backward and optimizer step). The skipped
    forward runs before the measured one, as in training, and frees what it made when it returns."""
    for batch_idx in STEP_INDICES:
        out = run.module.training_step(run.batch, batch_idx)
        if out is not None or run.manual:
            note = f"training_step returned None for batch_idx 0 (a step Lightning skips): the step measured is batch_idx {batch_idx}'s"
            if batch_idx and note not in run.notes:
                run.notes.append(note)
            return out, batch_idx
    raise SkippedStep(f"training_step returned None for batch_idx {', '.join(map(str, STEP_INDICES))}")


@contextlib.contextmanager
def _block_inputs(run: Run) -> Iterator[dict[int, tuple[Any, Any]]]:
    """The first call's (args, kwargs) of each compiled block class (keyed by its eager copy), captured in the warm-up
    step only: what the measured step holds must not grow by them."""
    inputs: dict[int, tuple[Any, Any]] = {}
    handles = []
    for name, eager in run.compiled.items():

        def capture(_: Any, args: Any, kwargs: Any, key: int = id(eager)) -> None:
            inputs.setdefault(key, (args, kwargs))

        handles.append(run.module.get_submodule(name).register_forward_pre_hook(capture, with_kwargs=True))
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


def _compiled_saving(run: Run, inputs: dict[int, tuple[Any, Any]], precision: PrecisionPlan) -> int:
    """Bytes the compiled blocks keep less than eager over one forward (``activations.compiled``); 0 without any."""
    kinds = {id(block): block for block in run.compiled.values()}  # one eager copy per class of block
    with _autocast(precision):
        saving = {key: block_saving(kinds[key], args, kwargs, precision.gather.torch).saved for key, (args, kwargs) in inputs.items()}
    return sum(saving.get(id(block), 0) for block in run.compiled.values())


def _less_when_compiled(memory: StepMemory, saved: int, blocks: int) -> StepMemory:
    """The eager step's peak less what compiled blocks do not keep, when the peak is in the forward or backward,
    where their activations are alive (the simulated step runs eager)."""
    if not saved or not memory.at.startswith(("forward", "backward")):
        return memory
    note = (
        f"compile: {blocks} block(s) compiled in place; their activations are counted from the compiled graph (inductor's"
        f" min-cut partition), {saved / 2**20:.1f} MiB less than eager"
    )
    return replace(memory, peak=memory.peak - saved, activations=memory.activations - saved, notes=(*memory.notes, note))


def _autocast(precision: PrecisionPlan) -> Any:
    """Lightning's MixedPrecision.forward_context: autocast on the device, without its weight-cast cache."""
    if not precision.autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=precision.compute.torch, cache_enabled=False)


def _forward(run: Run, precision: PrecisionPlan) -> None:
    example = run.batch
    with _autocast(precision):
        if isinstance(example, Mapping):
            run.module(**example)
        elif isinstance(example, tuple):
            run.module(*example)
        else:
            run.module(example)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence Lightning's "self.log without a Trainer" warnings and FakeTensorMode's traceback of every failing op (20
    lines per op; the error reported afterwards says it in one line)."""
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

    ``factory`` (what ``target.build_on_meta`` takes) is called afresh for each attempt: ``fully_shard`` mutates the
    module. ``make_batch()`` returns one micro-batch as ``training_step`` receives it, under FakeTensorMode (any size
    costs no memory). Without it, or when the step cannot run on it, only ``forward(example_input_array)`` runs
    (``forward_only``: a lower bound). ``num_nodes``: the nodes the ranks fill, for ``shard_size='node'``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AutoShardError(f"world size must be a positive integer, got {world_size!r}. Fix: e.g. world_size=8")
    if not 0 <= rank < world_size:
        raise AutoShardError(f"rank {rank} is not in a world of {world_size} ranks. Fix: rank= 0 to {world_size - 1}")
    tracker_base()
    settle_autograd_engine()  # before any fake tensor: later forks of this process can still run a backward
    extra: dict[str, Any] = {"precision": precision.precision.value, "activation_checkpointing": intent.activation_checkpointing}
    step = _Step(factory, intent, world_size, precision, num_nodes, rank)
    failed = ""  # why the training step could not run on make_batch's batch, with its Fix
    with fake_world(world_size, rank), _quiet():
        if make_batch is not None:
            measured, failed = _whole_step(step, make_batch, extra)
            if measured is not None:
                return measured
        return _forward_only(step, make_batch, extra, failed)


@dataclass(frozen=True)
class _Step:
    """What each attempt of ``measure_step`` prepares its run from."""

    factory: Any
    intent: ShardingIntent
    world_size: int
    precision: PrecisionPlan
    num_nodes: int
    rank: int

    def prepare(self, make_batch: Callable[[], Any] | None, mode: Any) -> Run:
        return prepare_run(self.factory, self.intent, self.world_size, self.precision, make_batch, mode, self.num_nodes, self.rank)


def _whole_step(step: _Step, make_batch: Callable[[], Any], extra: dict[str, Any]) -> tuple[StepMemory | None, str]:
    """(the whole training step's memory, "") on ``make_batch``'s batch; (None, why it could not run, with its Fix)."""
    mode = in_torch.FakeTensorMode(allow_non_fake_inputs=True)
    run = step.prepare(make_batch, mode)
    try:
        with mode:
            with _flop_counter() as counter, _block_inputs(run) as inputs:  # the warm-up runs the same ops
                _train_step(run, step.precision)  # warm-up: optimizer states and lazy FSDP state exist after it
            extra["flops"] = int(counter.get_total_flops()) if counter is not None else 0
            saved = _compiled_saving(run, inputs, step.precision)
            del inputs
            gc.collect()
            tracker = step_tracker(run.module, run.optimizers)
            tracker.track_inputs((run.batch,))
            with tracker:
                _train_step(run, step.precision)
        measured = tracker.step_memory(step.world_size, step.rank, False, run.notes, **extra)
        return _less_when_compiled(measured, saved, len(run.compiled)), ""
    except AutoShardError:
        raise
    except Exception as exc:
        failed = step_failure(exc, make_batch, run.batch)  # said once, in ``incomplete`` (or refused below)
    del run
    gc.collect()
    return None, failed


def _forward_only(step: _Step, make_batch: Callable[[], Any] | None, extra: dict[str, Any], failed: str) -> StepMemory:
    """The forward of ``example_input_array`` (a lower bound: no backward, no optimizer step), when there is no batch
    or the step could not run on it (``failed``)."""
    precision = step.precision
    convert = None if precision.autocast or precision.master is Dtype.FLOAT32 else precision.master.torch
    mode = in_torch.FakeTensorMode(allow_non_fake_inputs=True)
    run = step.prepare(None, mode)
    notes = list(run.notes)
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
            run.batch = fake_example(run.module.example_input_array, convert)
            tracker = step_tracker(run.module, run.optimizers)
            tracker.track_inputs((run.batch,))
            with tracker:
                _forward(run, precision)
    except Exception as exc:
        if reads_values(exc):
            fix = "avoid reading tensor values in forward (compute on tensors instead), or estimate on a real device"
        else:
            fix = f"make example_input_array, {describe_batch(run.batch)}, what forward takes, or estimate on a real device"
        raise AutoShardError(
            f"activation memory could not be measured: forward(example_input_array) failed on fake tensors: {describe_failure(exc)}. Fix: {fix}"
        ) from exc
    return tracker.step_memory(step.world_size, step.rank, True, notes, incomplete=incomplete, **extra)


@contextlib.contextmanager
def _flop_counter() -> Iterator[Any]:
    """torch's FlopCounterMode around one step (None where this torch lacks it): activation checkpointing's price."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:
        yield None
        return
    counter = FlopCounterMode(display=False)
    with counter:
        yield counter
