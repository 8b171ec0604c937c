"""The batch a simulated step runs on: loaded, called and described, its failures said in words, and a step that
failed on it said with its real cause (``step_failure``)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoshard.activations.failures import describe_failure, reads_values
from autoshard.errors import AutoShardError

# The batch_idx values a simulated step offers training_step, in order: a method that skips its first batch (a warm-up
# that returns None; Lightning then runs no backward and no optimizer step) is measured on the next.
STEP_INDICES = (0, 1)


class SkippedStep(ValueError):
    """training_step returned None for every batch_idx of ``STEP_INDICES``: there is no training step to measure."""


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
    return name if code is None else f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def call_batch(make_batch: Callable[[], Any]) -> Any:
    """``make_batch()``, refused in words when it raises: the function (file:line), the line that raised, the
    exception and a Fix. Callers choose the device context (explain: meta; the simulated step: FakeTensorMode)."""
    try:
        return make_batch()
    except Exception as exc:
        what = batch_origin(make_batch) if hasattr(make_batch, "origin") else f"the batch function {where_defined(make_batch)}"
        raise AutoShardError(
            f"{what} raised {describe_failure(exc)}. explain calls it with no arguments"
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


def batch_origin(make_batch: Callable[..., Any]) -> str:
    """Where a batch came from, as a message names it: the ``origin`` of a batch given as data or cut from another,
    else "the batch from" the user's function with its file and line."""
    origin = getattr(make_batch, "origin", None)
    return origin if isinstance(origin, str) else f"the batch from {where_defined(make_batch)}"


def _root_function(make_batch: Callable[..., Any]) -> Callable[..., Any]:
    """The function a batch was first made by, under any cut of it (``budget.cut_batch`` keeps it as ``make_batch``)."""
    while callable(getattr(make_batch, "make_batch", None)):
        make_batch = make_batch.make_batch  # type: ignore[attr-defined]
    return make_batch


def _tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch, in the containers ``describe_batch`` reads (mappings, tuples, lists)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _dtype_mismatch(exc: BaseException, batch: Any) -> list[torch.Tensor]:
    """The batch's integer tensors when the failure is a floating-point op meeting one of them; else []."""
    ints = [t for t in _tensors(batch) if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    text = str(exc)
    if ints and (re.search(r"\bLong\b|\bInt\b", text) or any(word in text.lower() for word in ("dtype", "scalar type", "int64", "integral"))):
        return ints
    return []


def step_failure(exc: BaseException, make_batch: Callable[..., Any], batch: Any) -> str:
    """Why training_step did not run on a batch, in one sentence with the batch's shapes, the real cause and a Fix that
    is not "pass a batch" (one was given). The batch is blamed only when it is the problem: not when the step reads
    ``self.trainer``, reads a tensor's values or fails on a batch exactly as the DataLoader yields it."""
    root = _root_function(make_batch)
    given = isinstance(getattr(root, "origin", None), str)  # data (the DataLoader's batch), not a function of the user's
    head = f"training_step could not run on {batch_origin(make_batch)}, {describe_batch(batch)}: {describe_failure(exc)}."
    name = getattr(root, "__name__", "<lambda>").replace("<lambda>", "the batch function")
    measured = "a few real steps with autoshard.activations.measuring_callback() measure it instead"
    if isinstance(exc, SkippedStep):
        tried = " and ".join(map(str, STEP_INDICES))
        return (
            f"training_step returned None on {batch_origin(make_batch)}, {describe_batch(batch)}, for batch_idx {tried}:"
            f" Lightning runs no backward and no optimizer step for such a step, so there is no training step to measure"
            f" (the batch's shapes are not the cause). Fix: make training_step return the loss (or a dict with 'loss')"
            f" for batch_idx {STEP_INDICES[-1]}, so that a skipped warm-up batch is measured on the next; a step that skips"
            f" on something the simulated step lacks (self.global_step is 0 there, no Trainer) cannot be measured: set the"
            f" fields yourself instead of memory_budget, or let {measured}"
        )
    if reads_values(exc):
        return (
            f"{head} Fix: keep training_step's values on tensors (no .item(), no `if tensor:`), or measure a real run with"
            f" autoshard.activations.measuring_callback()"
        )
    # the step read self.trainer (the copy has none) or something the manual step's stand-in Trainer lacks
    if "is not attached to a `Trainer`" in str(exc) or "is not available in autoshard's simulated step" in str(exc):
        return (
            f"{head} The batch is not the cause: training_step reads self.trainer there, and the simulated step runs on a copy"
            f" of the module without a Trainer (a manual-optimization step gets a stand-in holding only its optimizers,"
            f" schedulers, step and rank). Fix: give the module what that line reads from the Trainer as an argument of"
            f" __init__ (e.g. MyModule(accumulate_grad_batches=4)) and read it from self in training_step, or let {measured}"
        )
    ints = _dtype_mismatch(exc, batch)
    if ints:
        cause = (
            f" A dtype mismatch: the batch holds integer tensors ({', '.join(describe_batch(t) for t in ints)}) and that line"
            f" runs a floating-point op on them."
        )
        if given:
            return (
                f"{head}{cause} Training on such a batch fails the same way. Fix: turn them into floats in training_step before the"
                f" first floating-point layer (x.float(), or nn.Embedding for token ids)"
            )
        return (
            f"{head}{cause} Fix: make {name} return the dtypes your DataLoader yields (torch.randn for float inputs,"
            f" torch.randint for ids); if your DataLoader yields integers there too, turn them into floats in"
            f" training_step (x.float(), or nn.Embedding for token ids)"
        )
    if not _tensors(batch):
        cause = f" The batch holds no tensor ({describe_batch(batch)}), and training_step takes it apart as if it did."
        if given:
            return (
                f"{head}{cause} Training on such a batch fails the same way. Fix: make the DataLoader yield what training_step takes"
                f" (tensors; a collate_fn that tokenizes text), or make training_step take what the DataLoader yields"
            )
        return f"{head}{cause} Fix: make {name} return one micro-batch of tensors exactly as your DataLoader yields it to training_step"
    if given:
        return (
            f"{head} Fix: compare the shapes above with the line that failed: if this is the micro-batch training_step"
            f" receives, that line fails on it under the same FSDP2 plan in training too; if it runs in training, it needs"
            f" what the simulated step lacks, and {measured}"
        )
    return (
        f"{head} Fix: make {name} return one micro-batch exactly as your DataLoader yields it to training_step (compare the"
        f" shapes above with the line that failed); if it already does, that line fails under the same FSDP2 plan in"
        f" training too, or needs what the simulated step lacks: a few real steps with"
        f" autoshard.activations.measuring_callback() tell which"
    )
