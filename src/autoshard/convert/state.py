"""The neutral form of a checkpoint in memory (``TrainingState``), and what every format's reader and writer share.

Each format's reader fills a TrainingState (full tensors by parameter name, optimizer state per parameter,
Lightning's trainer state) and each writer writes one, so a format is one module and converting is read, then write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoshard.capability import Format
from autoshard.checkpoint.trust import CheckpointFormatError


class ConvertError(CheckpointFormatError):
    """What cannot be converted, named, with the fix."""


# -- the neutral form ----------------------------------------------------------------------------------------------
@dataclass
class OptimizerState:
    """One optimizer by parameter name: each group's hyper-parameters (``params``: names, in the optimizer's order)
    and each parameter's state (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) as full tensors."""

    groups: list[dict[str, Any]]
    state: dict[str, dict[str, Any]]

    def names(self) -> list[str]:
        return [name for group in self.groups for name in group["params"]]


@dataclass
class TrainingState:
    """A checkpoint in memory, backend-neutral: what both layouts can express, and nothing else."""

    tensors: dict[str, torch.Tensor]  # the module's state dict: parameters (fp32 master where kept) and buffers
    optimizers: list[OptimizerState]
    trainer: dict[str, Any]  # Lightning's checkpoint minus weights and optimizers: epoch, global_step, loops, ...
    source: Path
    format: Format
    world_size: int | None  # of the run that wrote it, where recorded
    buffers: set[str] | None = None  # None: not recorded by the source (DCP), inferred where needed
    frozen: set[str] = field(default_factory=set)  # parameters outside every optimizer
    aliases: dict[str, str] = field(default_factory=dict)  # tied weights: alias -> the name that holds it
    callback_optimizers: int = 0  # autoshard DCP: optimizers callbacks own (online probes)
    precision: str | None = None  # DeepSpeed source: the precision its file names and loss scaler are for
    loss_scaler: Any = None  # DeepSpeed source: its loss scaler (a dynamic fp16 scale survives DeepSpeed -> DeepSpeed)
    notes: list[str] = field(default_factory=list)

    @property
    def global_step(self) -> int | None:
        step = self.trainer.get("global_step")
        return int(step) if step is not None else None

    def trained(self) -> list[str]:
        return [name for opt in self.optimizers for name in opt.names()]


def named_optimizer(saved: Mapping[str, Any], label: str, path: Path) -> OptimizerState:
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's), or a refusal naming why not."""
    groups = [dict(g) for g in saved.get("param_groups", [])]
    params = [p for g in groups for p in g.get("params", [])]
    positional = [p for p in params if not isinstance(p, str)]
    if positional:
        raise ConvertError(
            f"cannot convert {label} of {str(path)!r}: its state is keyed by position ({', '.join(map(str, positional[:4]))}, ...),"
            f" as torch's optimizer.state_dict() writes it, not by parameter name, so it cannot be mapped to parameters"
            f" without the model. Fix: resume it once with strategy='fsdp2' (Trainer.fit(ckpt_path=...)) and convert the"
            f" checkpoint that saves, or convert the weights alone with --to safetensors"
        )
    for g in groups:
        g["params"] = [str(p) for p in g["params"]]
    return OptimizerState(groups=groups, state={str(k): dict(v) for k, v in (saved.get("state") or {}).items()})


def require_trainer(state: TrainingState, target: str) -> None:
    """A layout Trainer.fit(ckpt_path=...) resumes needs Lightning's trainer state: refused without it."""
    if "global_step" not in state.trainer or "loops" not in state.trainer:
        raise ConvertError(
            f"cannot convert {str(state.source)!r} to {target}: it holds no Lightning trainer state (epoch, global_step, loops),"
            f" so Trainer.fit(ckpt_path=...) could not resume from the result ({state.format.value} written without Lightning)."
            f" Fix: convert the weights with --to safetensors and load them before fit (ShardingIntent(init_from=...))"
        )


def tied_aliases(state: TrainingState) -> dict[str, str]:
    """Names whose tensor is another entry's: shared storage, recorded ties (DeepSpeed's shared_params), or a
    parameter outside every optimizer that is bit-identical to a trained one of the same shape (a tied weight that
    DCP saved under both names: two separately trained tensors are never bit-identical)."""
    found = dict(state.aliases)
    trained = set(state.trained())
    by_storage: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, t in state.tensors.items():
        if name in found:
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident in by_storage and t.numel():
            found[name] = by_storage[ident]
        else:
            by_storage.setdefault(ident, name)
    # Frozen parameters are never candidates: an EMA teacher equals its student until its first update.
    candidates = [n for n in state.tensors if n not in trained and n not in found and n not in (state.buffers or ()) and n not in state.frozen]
    for name in candidates:
        t = state.tensors[name]
        for other in trained:
            o = state.tensors.get(other)
            if o is not None and o.shape == t.shape and o.dtype == t.dtype and t.numel() > 1 and torch.equal(o, t):
                found[name] = other
                break
    return found
