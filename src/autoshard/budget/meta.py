"""The module a decision simulates: copied to the meta device for each simulated step (``fully_shard`` mutates what
it shards), weights never copied, the Trainer it may be attached to left out."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoshard.errors import IntentError
from autoshard.memory import sharded_parameter


def meta_factory(module: Any, callbacks: Sequence[Any] = ()) -> Callable[[], Any]:
    """A factory for the simulated steps: a class or function is called afresh each time, a module instance copied."""
    if callable(module) and not isinstance(module, nn.Module):
        return module
    if not isinstance(module, nn.Module):
        raise IntentError(
            f"memory_budget decides for a LightningModule, got {type(module).__name__}. Fix: pass the module, or a function building it"
        )
    sharded = sharded_parameter(module)
    if sharded is not None:
        raise IntentError(
            f"memory_budget is decided before sharding, but {type(module).__name__}.{sharded} is already sharded."
            f" Fix: decide on the unsharded module (the strategy does, at setup, before fully_shard)"
        )

    def copy_on_meta() -> Any:
        memo: dict[int, Any] = {}
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for b in m._buffers.values():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device="meta")
            for name in ("_trainer", "_fabric", "_device_mesh"):  # a Lightning module at fit: never copy the Trainer
                held = m.__dict__.get(name)
                if held is not None:
                    memo[id(held)] = None
        try:
            return copy.deepcopy((module, list(callbacks)) if callbacks else module, memo)
        except Exception as exc:
            raise IntentError(
                f"memory_budget could not copy {type(module).__name__} to the meta device to simulate its step"
                f" ({type(exc).__name__}: {exc}). Fix: pass a function building the module (decide(MyModule, batch, ...))"
            ) from exc

    return copy_on_meta
