"""Activation checkpointing of one block, in the modes ``ShardingIntent(activation_checkpointing=...)`` names.

``False``, ``True`` (every block), ``k`` (every k-th block) or ``'selective'`` (op-level): steps for a memory budget.
Every k-th block counts from block 0, not from k-1 as torchtitan does: the last block's forward is recomputed right
away, while every other block's activations are still alive, so checkpointing it lowers no peak. Selective is
torchtitan's policy (compute-heavy outputs saved, every second matmul recomputed), with ``addmm``, the CPU attention
kernels and convolutions added. torch's composable ``checkpoint`` leaves module paths and state-dict keys as they are,
unlike ``checkpoint_wrapper``; the RNG state is restored for the recomputation, so training is unchanged, only slower.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from autoshard.adapters.blocks import block_units, is_metric, param_names, subtree_roots, within
from autoshard.errors import IntentError
from autoshard.intent import SELECTIVE, ShardingIntent
from autoshard.needs import MethodNeeds
from autoshard.privates import in_torch


class Checkpointing(Enum):
    """What a block recomputes in backward."""

    NONE = "none"
    FULL = "full"  # the whole forward of the block: only its inputs are saved
    SELECTIVE = "selective"  # op-level: compute-heavy outputs saved, the rest recomputed


@dataclass(frozen=True)
class CheckpointMode:
    """``ShardingIntent.activation_checkpointing`` resolved: the kind, and for FULL the block period ``every``."""

    kind: Checkpointing
    every: int = 1

    @classmethod
    def of(cls, value: bool | int | str | CheckpointMode) -> CheckpointMode:
        """From the intent's value (validated there: ``ShardingIntent`` refuses anything else, with a Fix)."""
        if isinstance(value, CheckpointMode):
            return value
        value = ShardingIntent(activation_checkpointing=value).activation_checkpointing  # one set of refusals
        if value is False:
            return cls(Checkpointing.NONE)
        if value == SELECTIVE:
            return cls(Checkpointing.SELECTIVE)
        return cls(Checkpointing.FULL, 1 if value is True else int(value))

    @property
    def value(self) -> bool | int | str:
        """Back to the intent's spelling: False, True, k or 'selective'."""
        if self.kind is Checkpointing.NONE:
            return False
        if self.kind is Checkpointing.SELECTIVE:
            return SELECTIVE
        return True if self.every == 1 else self.every

    def applies_to(self, index: int) -> bool:
        """Whether the block at ``index`` (0-based, in forward order among the checkpointable blocks) is checkpointed."""
        return self.kind is Checkpointing.SELECTIVE or (self.kind is Checkpointing.FULL and index % self.every == 0)

    def describe(self) -> str:
        """In words, for plan summaries and budget tables: 'no', 'every block', 'every 2nd block', 'selective (op-level)'."""
        if self.kind is Checkpointing.NONE:
            return "no"
        if self.kind is Checkpointing.SELECTIVE:
            return "selective (op-level)"
        return "every block" if self.every == 1 else f"every {_ordinal(self.every)} block"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe_checkpointing(value: bool | int | str) -> str:
    """``activation_checkpointing`` in words (``FSDP2Plan.describe`` shows it; True/False read 'every block'/'no')."""
    return CheckpointMode.of(value).describe()


# -- the selective (op-level) policy ----------------------------------------------------------------------------------
def _op(namespace: str, name: str, overload: str = "default") -> Any:
    """An op overload when this torch has it (attention kernels come and go between releases), else None."""
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None


def _save_list() -> tuple[frozenset[Any], frozenset[Any]]:
    """(ops whose outputs are saved, the matmuls among them: every second one is recomputed)."""
    matmuls = {_op("aten", "mm"), _op("aten", "addmm")}
    saved = {
        *matmuls,
        _op("aten", "_scaled_dot_product_efficient_attention"),
        _op("aten", "_scaled_dot_product_flash_attention"),
        _op("aten", "_scaled_dot_product_cudnn_attention"),
        _op("aten", "_scaled_dot_product_flash_attention_for_cpu"),
        _op("aten", "convolution"),
        _op("_c10d_functional", "reduce_scatter_tensor"),
        _op("aten", "max"),
    }
    return frozenset(saved - {None}), frozenset(matmuls - {None})


def selective_context_fn() -> Any:
    """A ``context_fn`` for ``checkpoint``: torchtitan's op-level policy, with a fresh matmul count per call, kept
    apart for the forward and the recomputation so that both make the same choices."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved, matmuls = _save_list()
    counts: defaultdict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        phase = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            counts[phase] += 1
        keep = func in saved and not (func in matmuls and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# -- applying it --------------------------------------------------------------------------------------------------------
def apply_checkpointing(block: nn.Module, mode: bool | int | str | CheckpointMode, index: int) -> bool:
    """Checkpoint ``block`` (at ``index`` among the checkpointable blocks) as ``mode`` says, before ``fully_shard``;
    True when it did. Twice is refused: torch's composable API would raise an opaque error."""
    mode = CheckpointMode.of(mode)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise IntentError(f"apply_checkpointing: index must be the block's position (0, 1, ...), got {index!r}. Fix: count the blocks from 0")
    if not mode.applies_to(index):
        return False
    if is_checkpointed(block):
        raise IntentError(
            f"{type(block).__name__} is already activation-checkpointed (torch.distributed._composable.checkpoint was"
            f" applied to it before). Fix: checkpoint each block once: leave it to ShardingIntent(activation_checkpointing=...)"
        )
    if mode.kind is Checkpointing.SELECTIVE:
        _checkpoint_forward(block)
    else:
        in_torch.composable_checkpoint(block)
    return True


def checkpointable_blocks(module: nn.Module, intent: ShardingIntent, needs: MethodNeeds | None = None) -> list[str]:
    """The repeated blocks that train and share no parameter outside themselves, inside ``intent.shard``, outside
    ``intent.exclude``, EMA teachers, callback modules and metrics; deepest first. One selection for every engine, so a memory budget
    simulated on fsdp2's plan counts the activations a DeepSpeed run keeps."""
    needs = needs or MethodNeeds()
    modules = dict(module.named_modules())
    names_of = param_names(module)
    skip = set(intent.exclude) | {p.teacher for p in needs.ema_pairs} | set(needs.callback_modules)
    skip |= {n for n, m in modules.items() if n and is_metric(m)}
    roots = set(subtree_roots(module, intent.shard))
    order = {name: i for i, name in enumerate(modules)}
    found = []
    for name in block_units(module, intent.blocks, modules):
        if within(name, skip) or not within(name, roots):
            continue
        params = [p for p in modules[name].parameters() if p.dim() > 0]
        tied = any(not within(n, {name}) for p in modules[name].parameters() for n in names_of[id(p)])
        if any(p.requires_grad for p in params) and not tied:
            found.append(name)
    return sorted(found, key=lambda n: (-n.count("."), order[n]))


def checkpointed_blocks(module: nn.Module, intent: ShardingIntent, needs: MethodNeeds | None = None) -> list[str]:
    """The blocks ``checkpoint_blocks`` checkpoints, left untouched: what the DeepSpeed estimate sees recomputed."""
    mode = CheckpointMode.of(intent.activation_checkpointing)
    if mode.kind is Checkpointing.NONE:
        return []
    return [name for index, name in enumerate(checkpointable_blocks(module, intent, needs)) if mode.applies_to(index)]


def checkpoint_blocks(module: nn.Module, intent: ShardingIntent, needs: MethodNeeds | None = None) -> list[str]:
    """Checkpoint ``module``'s blocks where no ``fully_shard`` plan does it (DeepSpeed, before its engine is built, so
    its hooks gather a block again for the recomputation); the names checkpointed. Refused when no block trains."""
    names = checkpointed_blocks(module, intent, needs)  # the estimate reads the same selection
    if not names and CheckpointMode.of(intent.activation_checkpointing).kind is not Checkpointing.NONE:
        raise nothing_to_checkpoint(module, intent)  # every mode checkpoints the first block: none at all means none trains
    modules = dict(module.named_modules())
    for name in names:
        apply_checkpointing(modules[name], intent.activation_checkpointing, 0)  # selected already: index 0 always applies
    return names


def nothing_to_checkpoint(module: nn.Module, intent: ShardingIntent) -> IntentError:
    """The refusal when ``activation_checkpointing`` is asked for and no block trains (every backend says the same)."""
    named = f" among the blocks named ({', '.join(map(repr, intent.blocks))})" if intent.blocks else " (none found by structure)"
    return IntentError(
        f"activation_checkpointing={intent.activation_checkpointing!r} checkpoints repeated blocks (transformer layers,"
        f" residual stages), and {type(module).__name__} has none that trains{named}, so nothing would be recomputed and"
        f" no memory saved. Fix: name the blocks, ShardingIntent(blocks=['MyBlock']) (class names or module paths as"
        f" print(model) shows them), or drop activation_checkpointing"
    )


def _checkpoint_forward(block: nn.Module) -> None:
    """Selective checkpointing of ``block.forward`` itself, inside its hooks. The composable API re-runs the whole
    call, and the ops of ``fully_shard``'s hooks then miss the selective cache ("encountered during backward but not
    found in storage"); torchtitan's ``checkpoint_wrapper`` would rename the parameters in the state dict."""
    from torch.utils.checkpoint import checkpoint

    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        call = functools.partial(inner, **kwargs) if kwargs else inner
        return checkpoint(call, *args, use_reentrant=False, context_fn=selective_context_fn)

    forward.autoshard_checkpointed = True  # type: ignore[attr-defined]
    block.forward = forward  # type: ignore[method-assign]


def is_checkpointed(block: nn.Module) -> bool:
    """Activation-checkpointed already (the composable API, or this module's selective forward)."""
    if getattr(block.forward, "autoshard_checkpointed", False):
        return True
    try:
        return in_torch.composable_checkpoint.state(block) is not None
    except Exception:  # no state registered: not checkpointed
        return False
