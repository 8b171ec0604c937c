"""The optimizer built before ``fabric.setup``: moved onto the sharded parameters by name, or refused; never stale.

``fully_shard`` puts new Parameter objects into the module; an optimizer built before still holds the old ones and
would silently step tensors the model no longer uses. Each parameter is replaced in place in its param group (so any
object sharing the group's list, such as LBFGS, sees it), and its state is cut to this rank's shard.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoShardError

BUILD_AFTER = (
    "build the optimizer after `model = fabric.setup_module(model)` from `model.parameters()`, then `optimizer = fabric.setup_optimizers(optimizer)`"
)


@dataclass
class ParameterNames:
    """The parameters a module held when ``fabric.setup`` received it, by id, with their names, weakly held."""

    owner: str  # the module's class name, for messages
    refs: dict[int, tuple[weakref.ref[torch.Tensor], str]]

    @classmethod
    def of(cls, module: nn.Module) -> ParameterNames:
        refs: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            refs.setdefault(id(p), (weakref.ref(p), name))
        return cls(type(module).__name__, refs)

    def name_of(self, p: torch.Tensor) -> str | None:
        """The name ``p`` had in the module before setup, if it is one of those parameters (by identity, not by id)."""
        found = self.refs.get(id(p))
        return found[1] if found is not None and found[0]() is p else None


@dataclass(frozen=True)
class Remapped:
    """What ``remap_optimizer`` moved: parameters, and per-parameter states cut to this rank's shard."""

    parameters: int
    states: int


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def label(optimizer: torch.optim.Optimizer, index: int | None = None) -> str:
    return f"{type(optimizer).__name__}" + (f" #{index}" if index is not None else "")


def stale_refusal(optimizer: str, owner: str, names: list[str], why: str) -> AutoShardError:
    shown = ", ".join(f"'{n}'" for n in names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
    return AutoShardError(
        f"optimizer {optimizer} holds {len(names)} parameter(s) of {owner} from before fabric.setup ({shown}), and"
        f" {why}: it would step tensors the sharded model no longer uses, so training would silently go wrong."
        f" Fix: {BUILD_AFTER}"
    )


def check_trains_module(module: nn.Module, optimizers: list[torch.optim.Optimizer], earlier: Iterable[ParameterNames] = ()) -> None:
    """Refuse an optimizer handed with ``module`` that holds none of its trainable parameters: the model would never
    train. ``earlier``: the parameter names of models set up before, to say whose it holds."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if not trainable:
        return  # a frozen model: no parameter of it could train anyway
    owner = type(module).__name__
    for i, optimizer in enumerate(optimizers):
        held = optimizer_parameters(optimizer)
        if any(id(p) in trainable for p in held):
            continue
        name = label(optimizer, i if len(optimizers) > 1 else None)
        named = [(snapshot.owner, snapshot.name_of(p)) for p in held for snapshot in earlier if snapshot.name_of(p) is not None]
        if named:
            names = ", ".join(f"'{n}'" for _, n in named[:4]) + (f" (+{len(named) - 4} more)" if len(named) > 4 else "")
            whose = f"parameters of {named[0][0]}, set up before ({names})"
        else:
            shapes = ", ".join(str(tuple(p.shape)) for p in held[:4]) + (f" (+{len(held) - 4} more)" if len(held) > 4 else "")
            whose = f"{len(held)} parameter(s) of another module, shaped {shapes}"
        raise AutoShardError(
            f"fabric.setup({owner}, ...) was given optimizer {name}, which holds none of {owner}'s {len(trainable)}"
            f" trainable parameter(s): it holds {whose}. {owner} would compute gradients that nothing applies and never"
            f" train. Fix: build the optimizer from this model's parameters, `optimizer = torch.optim."
            f"{type(optimizer).__name__}(model.parameters(), ...)`, then `model, optimizer = fabric.setup(model, optimizer)`;"
            f" an optimizer of another model goes into that model's own fabric.setup call"
        )


def _cut_state(value: Any, old: torch.Tensor, new: torch.Tensor) -> tuple[Any, bool]:
    """One state entry of ``old`` made to fit ``new``: a tensor shaped like the parameter becomes this rank's shard of
    it (each rank cuts its own copy: no communication), 0-dim tensors and plain values stay; (value, fits)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value, True
    if tuple(value.shape) != tuple(old.shape):
        return value, False
    if isinstance(new, DTensor):
        local = value.detach().to(new.device)
        return distribute_tensor(local, new.device_mesh, new.placements, src_data_rank=None), True
    return value.detach().to(new.device), True


def remap_optimizer(optimizer: torch.optim.Optimizer, before: ParameterNames, module: nn.Module, name: str) -> Remapped:
    """Move every parameter ``optimizer`` holds from ``before`` onto the one the module holds now under the same name,
    with its state; refuses (naming them) those whose name is gone or whose state cannot be cut."""
    now = dict(module.named_parameters(remove_duplicate=False))
    current = {id(p) for p in now.values()}
    moves: list[tuple[list[Any], int, torch.Tensor, torch.Tensor]] = []
    gone: list[str] = []
    uncut: list[str] = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if id(p) in current:
                continue
            old_name = before.name_of(p)
            if old_name is None:
                continue  # another model's parameter (set up apart, or not at all)
            new = now.get(old_name)
            if new is None:
                gone.append(old_name)
                continue
            state = optimizer.state.get(p, {})
            if not all(_cut_state(v, p, new)[1] for v in state.values()):
                uncut.append(old_name)
                continue
            moves.append((params, i, p, new))
    if gone:
        raise stale_refusal(
            name, before.owner, gone, "the module no longer has parameters of those names after setup (its parallelize_fn replaced them)"
        )
    if uncut:
        raise stale_refusal(
            name,
            before.owner,
            uncut,
            "their optimizer state holds tensors shaped neither like the parameter nor 0-dim, which cannot be cut into shards",
        )
    states = 0
    for params, i, old, new in moves:
        params[i] = new
        if old in optimizer.state:
            optimizer.state[new] = {k: _cut_state(v, old, new)[0] for k, v in optimizer.state.pop(old).items()}
            states += 1
    return Remapped(len(moves), states)


def stale_parameters(optimizer: torch.optim.Optimizer, snapshots: Iterable[ParameterNames], live: set[int]) -> list[tuple[str, str]]:
    """(module, parameter name) of every parameter ``optimizer`` holds that a set-up module no longer does."""
    found = []
    snapshots = list(snapshots)
    for p in optimizer_parameters(optimizer):
        if id(p) in live:
            continue
        for snapshot in snapshots:
            old = snapshot.name_of(p)
            if old is not None:
                found.append((snapshot.owner, old))
                break
    return found
