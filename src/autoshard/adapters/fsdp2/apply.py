"""Applying a plan: ``fully_shard`` each unit on the run's mesh (autoshard.mesh), after the model's tensor-parallel
layout when there is one, with the precision and offload policies; then the runtime guarantees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from autoshard.adapters.blocks import outermost
from autoshard.adapters.compile import compile_in_place
from autoshard.adapters.fsdp2.ema import check_ema_alignment
from autoshard.adapters.fsdp2.runtime import average_unsharded_gradients
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelMesh
from autoshard.needs import EMAPair
from autoshard.precision import PrecisionPlan
from autoshard.privates import in_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def policies(precision: PrecisionPlan, intent: ShardingIntent, device_type: str) -> tuple[Any, Any]:
    """FSDP2 MixedPrecisionPolicy for the precision and offload policy for the intent (offload 'optimizer' offloads params too).

    Offloaded shards are pinned only for a CUDA mesh: a simulated step (a CPU mesh under fake tensors) cannot pin. A
    dtype that needs no cast is passed as None, so that FSDP2 does not cast every unit's inputs to the dtype they have.
    """
    _, _, mixed_precision_policy, cpu_offload_policy, offload_policy = in_torch.fsdp2_api()
    gather = None if precision.gather is precision.master else precision.gather
    reduce = None if precision.reduce is (gather or precision.master) else precision.reduce
    mp = mixed_precision_policy(param_dtype=gather and gather.torch, reduce_dtype=reduce and reduce.torch)
    if intent.offload == "none":
        return mp, offload_policy()
    if intent.offload_device != "cpu":
        raise IntentError("fsdp2 can offload to CPU memory only. Fix: use offload_device='cpu', or strategy='autoshard-deepspeed' for NVMe")
    return mp, cpu_offload_policy(pin_memory=device_type == "cuda")


class PlanToApply(Protocol):
    """What ``apply_plan`` reads of an FSDP2Plan (``plan.FSDP2Plan``), which sits above this module."""

    units: list[Any]
    ema_pairs: tuple[EMAPair, ...]
    intent: ShardingIntent
    hsdp: tuple[int, int] | None
    tp_plan: Any
    compiled: tuple[str, ...]

    @property
    def precision_plan(self) -> PrecisionPlan: ...

    @property
    def whole_in_units(self) -> list[str]: ...


def apply_plan(plan: PlanToApply, module: nn.Module, mesh: DeviceMesh | ParallelMesh) -> ParallelMesh:
    """Shard ``module`` in place as ``plan`` says, on ``mesh`` (a DeviceMesh is viewed with the plan's ``hsdp``);
    returns the ParallelMesh used. Tensor parallel first, then each unit ``fully_shard``-ed on the data-parallel dims
    of the same mesh, so FSDP2 composes its placements with the tensor-parallel ones.
    """
    from autoshard.adapters.checkpointing import apply_checkpointing

    fully_shard, _, _, _, _ = in_torch.fsdp2_api()
    parallel = mesh if isinstance(mesh, ParallelMesh) else ParallelMesh.of(mesh, hsdp=plan.hsdp)
    if plan.tp_plan is not None and parallel.dims.tp > 1:
        assert parallel.tp is not None
        plan.tp_plan.apply(module, parallel.tp)
    mp_policy, offload_policy = policies(plan.precision_plan, plan.intent, parallel.shard.device_type)
    whole = {id(module.get_parameter(name)) for name in plan.whole_in_units}
    names = {u.name for u in plan.units}
    for path in plan.compiled:  # a module the user compiled that is no unit: compiled whole (its unit's hooks are outside)
        if path not in names:
            compile_in_place(module.get_submodule(path))
    checkpointed = 0
    for unit in plan.units:
        sub = module.get_submodule(unit.name)
        if outermost(unit.name, names) != unit.name:  # an inner unit: see clone_view_outputs
            # runs before fully_shard's own hook; eager, as fully_shard's own are (adapters.compile)
            sub.register_forward_hook(torch.compiler.disable(clone_view_outputs), prepend=True)
        if unit.checkpointed:  # the intent's mode decides which of the checkpointed blocks, by their order
            apply_checkpointing(sub, plan.intent.activation_checkpointing, checkpointed)
            checkpointed += 1
        if unit.name in plan.compiled:  # torchtitan's order: checkpointing, compile, fully_shard; in place, hooks kept
            compile_in_place(sub)
        ignored = {p for p in sub.parameters() if id(p) in whole}  # inside the unit, left whole by the plan
        fully_shard(
            sub,
            mesh=parallel.shard,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            **({"ignored_params": ignored} if ignored else {}),
        )
    average_unsharded_gradients(module, parallel.dp)
    for pair in plan.ema_pairs:
        check_ema_alignment(module, pair)
    return parallel


def clone_view_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """An inner unit's output that is a view (T5's position bias) would lose fully_shard's pre-backward hook on an
    in-place op downstream: it is copied. Inner units only: theirs are small (T5: heads x tokens x tokens); an
    outermost unit's view (BERT's logits) would cost a full copy at the peak, so FSDP2's warning stands there.
    """
    if not torch.is_grad_enabled():
        return output
    is_view = lambda t: isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None  # noqa: E731
    if not any(is_view(t) for t in in_torch.tree_leaves(output)):
        return output
    return in_torch.tree_map(lambda t: t.clone() if is_view(t) else t, output)
