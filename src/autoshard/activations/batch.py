"""The batch a simulated step runs on: ``--batch file.py:make_batch`` loaded (``load_batch``), called with its failure
in words (``call_batch``), and described by its dtypes and shapes (``describe_batch``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoshard.activations.failures import describe_failure
from autoshard.errors import AutoShardError


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
            f"the batch function {where_defined(make_batch)} raised {describe_failure(exc)}. explain calls it with no arguments"
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
