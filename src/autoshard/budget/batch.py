"""The one micro-batch a decision is made on: a function returning it (never its values), its rows and tokens, a smaller
micro-batch of it, and the search for the largest smaller one that fits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoshard.errors import IntentError
from autoshard.memory import MemoryEstimate
from autoshard.privates import in_torch


class BatchOfShapes:
    """Empty tensors of a batch's shapes and dtypes on the current device (meta, or fake under the simulated step), in
    the batch's structure. ``origin``: where the batch came from, as messages name it (never this function)."""

    def __init__(self, batch: Any, origin: str) -> None:
        self.batch, self.origin = batch, origin

    def __call__(self) -> Any:
        return in_torch.tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype), self.batch)


def batch_function(batch: Any, origin: str = "the batch given to decide") -> Callable[[], Any]:
    """A function returning one micro-batch of ``batch``'s shapes: ``batch`` itself when it is a function, else a
    ``BatchOfShapes``: the decision never copies or reads the batch's values."""
    if batch is None:
        raise IntentError(
            "memory_budget is decided on one micro-batch, and none was given: autoshard never decides from model states"
            " alone (activations are most of a step's peak). Fix: pass the batch (decide(module, batch, ...), or at fit"
            " a train dataloader), or a function returning one micro-batch as training_step receives it"
        )
    if callable(batch) and not isinstance(batch, (torch.Tensor, nn.Module)):
        return batch
    return BatchOfShapes(batch, origin)


def _tensors(make_batch: Callable[[], Any]) -> list[torch.Tensor]:
    """The tensors of one micro-batch, made on meta (shapes only, no memory)."""
    from autoshard.activations import call_batch

    with torch.device("meta"):
        return [t for t in in_torch.tree_leaves(call_batch(make_batch)) if isinstance(t, torch.Tensor)]


def batch_rows(make_batch: Callable[[], Any]) -> int | None:
    """The micro-batch's rows when every tensor in it shares dim 0 (so it can be cut); else None."""
    rows = {t.shape[0] if t.dim() else None for t in _tensors(make_batch)}
    return rows.pop() if len(rows) == 1 and None not in rows else None


def batch_tokens(make_batch: Callable[[], Any]) -> int | None:
    """Tokens in one micro-batch, for the tensor-parallel activation traffic: the elements of its first integer
    tensor (the token ids of a language model's batch); None when it has none."""
    ids = [t for t in _tensors(make_batch) if not t.is_floating_point() and t.dim() > 0]
    return ids[0].numel() if ids else None


def cut_batch(make_batch: Callable[[], Any], divisor: int) -> Callable[[], Any]:
    """``make_batch`` with every tensor's dim 0 divided by ``divisor``. Each cut tensor is a copy, never a view: a view
    keeps the whole batch's storage alive, and the simulated step would count it in the peak (the copy is fake: free).
    """
    return make_batch if divisor == 1 else CutBatch(make_batch, divisor)


class CutBatch:
    """``make_batch()`` with the first ``rows // divisor`` rows of every tensor, copied."""

    def __init__(self, make_batch: Callable[[], Any], divisor: int) -> None:
        from autoshard.activations.batch import batch_origin

        self.make_batch, self.divisor = make_batch, divisor
        self.origin = f"{batch_origin(make_batch)}, cut to 1/{divisor} of its rows"

    def cut(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.dim():
            return t
        return t[: max(1, t.shape[0] // self.divisor)].clone(memory_format=torch.contiguous_format)

    def __call__(self) -> Any:
        return in_torch.tree_map(self.cut, self.make_batch())


def largest_micro_batch(
    rows: int, budget: int, full: Callable[[int], MemoryEstimate | None], whole: MemoryEstimate | None = None
) -> tuple[int, MemoryEstimate | None]:
    """(the divisor, the estimate) of the largest micro-batch (rows / 2, / 4, ...) that fits, for the advice and the
    decision alike: the first whose estimate ``full(divisor)`` fits or lacks part of the step (None), else the last
    tried (one row). ``whole``: the whole batch's estimate, to skip the divisors its activations (about linear in the
    rows) say cannot fit; no divisor is taken without ``full``'s simulated step."""
    divisor = 2
    while True:
        while whole is not None and rows // divisor > 1 and whole.device - whole.activations * (1 - 1 / divisor) > budget:
            divisor *= 2
        estimate = full(divisor)
        if estimate is None or estimate.device <= budget or rows // divisor <= 1:
            return divisor, estimate
        divisor *= 2
