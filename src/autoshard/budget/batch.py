"""The one micro-batch a decision is made on: a function returning it (never its values: empty tensors of its
shapes), its rows when it can be cut along dim 0, and a smaller micro-batch of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard.errors import IntentError


def batch_function(batch: Any) -> Callable[[], Any]:
    """A function of no arguments returning one micro-batch of ``batch``'s shapes: ``batch`` itself when it is one
    (a batch function), else a function building empty tensors of the batch's shapes and dtypes on the current
    device (meta, or fake under the simulated step): the decision never copies or reads the batch's values."""
    if batch is None:
        raise IntentError(
            "memory_budget is decided on one micro-batch, and none was given: autoshard never decides from model states"
            " alone (activations are most of a step's peak). Fix: pass the batch (decide(module, batch, ...), or at fit"
            " a train dataloader), or a function returning one micro-batch as training_step receives it"
        )
    if callable(batch) and not isinstance(batch, (torch.Tensor, nn.Module)):
        return batch
    from torch.utils._pytree import tree_map_only

    def empty_like_batch() -> Any:
        return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype), batch)

    return empty_like_batch


def batch_rows(make_batch: Callable[[], Any]) -> int | None:
    """The micro-batch's rows when every tensor in it shares dim 0 (so it can be cut); else None."""
    from torch.utils._pytree import tree_leaves

    from autoshard.activations import call_batch

    with torch.device("meta"):
        rows = {t.shape[0] if t.dim() else None for t in tree_leaves(call_batch(make_batch)) if isinstance(t, torch.Tensor)}
    return rows.pop() if len(rows) == 1 and None not in rows else None


def cut_batch(make_batch: Callable[[], Any], divisor: int) -> Callable[[], Any]:
    """``make_batch`` with every tensor's dim 0 divided by ``divisor`` (a smaller micro-batch of the same samples)."""
    if divisor == 1:
        return make_batch
    from torch.utils._pytree import tree_map

    def smaller() -> Any:
        cut = lambda t: t[: max(1, t.shape[0] // divisor)] if isinstance(t, torch.Tensor) and t.dim() else t  # noqa: E731
        return tree_map(cut, make_batch())

    return smaller
