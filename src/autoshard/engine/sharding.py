"""The FSDP2 setup sequence both fsdp2 strategies run: one copy, so a guarantee added to one is had by both.
``shard_module`` runs before the parameters are materialized, ``after_materialize`` once they hold values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from autoshard.adapters.blocks import outermost
from autoshard.adapters.compile import Compile, unwrap_compiled
from autoshard.adapters.fsdp2 import (
    FSDP2Plan,
    average_unsharded_gradients,
    broadcast_unsharded,
    check_ema_alignment,
    follows_forward_order,
    init_sharded_units,
    plan_fsdp2,
    reshard_in_order,
)
from autoshard.engine.guarantees import reshard_after_no_grad_forward, reshard_teachers
from autoshard.engine.launch import check_node_groups
from autoshard.engine.meta_init import copy_students_into_teachers
from autoshard.errors import IntentError
from autoshard.init_from import InitPlan, InitReport, load_init_from
from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelMesh
from autoshard.needs import EMAPair, MethodNeeds
from autoshard.precision import PrecisionPlan


def unwrap_user_compile(module: nn.Module) -> list[str]:
    """Every ``torch.compile`` wrapper inside ``module`` replaced by the module it wraps, before the needs are
    inspected, so that EMA pairs, the plan and every checkpoint see the eager names."""
    unwrapped = unwrap_compiled(module)
    if unwrapped:
        rank_zero_info(
            f"autoshard: torch.compile wrapper(s) on {', '.join(map(repr, unwrapped))} replaced by the modules they wrap"
            f" (parameter names without '_orig_mod.'); their blocks are compiled in place before fully_shard"
        )
    return unwrapped


def shard_module(
    module: nn.Module,
    mesh: ParallelMesh,
    intent: ShardingIntent,
    needs: MethodNeeds,
    precision: PrecisionPlan | None,
    *,
    sharded_by: str | None,
    node_ranks: Callable[[], list[int]],
    sync_batchnorm: bool = False,
) -> FSDP2Plan | None:
    """Shard ``module`` by autoshard's plan and return it, or, when ``sharded_by`` says who already did, keep the
    plan's guarantees around their layout and return None. ``node_ranks`` (a collective) is called only for
    ``shard_size='node'`` under hybrid sharding."""
    if sharded_by is not None:
        # Refused rather than training eager while the user believes it compiled; a module whose blocks are compiled
        # already (by the user, or by autoshard's plan in an earlier setup of the same module: validate after fit) passes.
        if Compile.of(intent.compile) is Compile.BLOCKS and not needs.compiled:
            raise IntentError(
                f"compile=True compiles the blocks of autoshard's own plan, and the modules were sharded otherwise"
                f" ({sharded_by.removeprefix('autoshard: ')}), so nothing would be compiled. Fix: compile each block in"
                f" place where you shard it (block.compile() before fully_shard(block)), or drop compile=True, or let"
                f" autoshard shard"
            )
        rank_zero_info(sharded_by)
        average_unsharded_gradients(module, mesh)
        for pair in needs.ema_pairs:
            check_ema_alignment(module, pair)
        # The plan's guarantees, whoever sharded: teachers (and units forwarded without grad) reshard after forward.
        teachers = reshard_teachers(module, needs.ema_pairs)
        reshard_after_no_grad_forward(module)
        if teachers:
            rank_zero_info(f"autoshard: EMA teacher units reshard after forward: {', '.join(teachers)}")
        return None
    plan = plan_fsdp2(module, intent, needs, precision, dims=mesh.dims, sync_batchnorm=sync_batchnorm)
    if intent.shard_size == "node" and mesh.dims.hybrid:
        check_node_groups(node_ranks(), mesh.dims.node_group)
    plan.apply(module, mesh)
    if follows_forward_order(plan):
        follow_first_forward(module, plan)
        plan.forward_order += "; the first training forward's order decides from the next forward on"
    rank_zero_info(plan.describe(mesh.dims.describe()))
    return plan


def follow_first_forward(module: nn.Module, plan: FSDP2Plan) -> None:
    """Log the order the first training forward returns from the plan's outermost units in; when the next forward
    starts, choose again which units stay gathered after forward (``reshard_in_order``), then remove the hooks. Every
    rank logs the same order (FSDP2's all-gathers follow it), so every rank makes the same choice."""
    names = {u.name for u in plan.units}
    outer = [u.name for u in plan.units if outermost(u.name, names) == u.name]
    finished: list[str] = []
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def started(name: str) -> None:
        if not torch.is_grad_enabled() or name not in finished:  # a no-grad forward (validation) shows nothing
            return
        for handle in handles:
            handle.remove()
        units = reshard_in_order(plan, finished)
        changed = [(old, new) for old, new in zip(plan.units, units) if old.reshard is not new.reshard]
        for _, new in changed:
            module.get_submodule(new.name).set_reshard_after_forward(new.reshard_after_forward, recurse=False)  # type: ignore[operator]
        plan.units[:] = units
        if changed:
            kept = ", ".join(f"'{new.name}'" for _, new in changed if new.reshard.keeps)
            rank_zero_info(
                f"autoshard: the first training forward ran its units in another order than they are registered in:"
                f" {kept or 'none'} kept gathered after forward from now on (" + "; ".join(f"'{n.name}': {n.reshard.value}" for _, n in changed) + ")"
            )

    def returned(name: str) -> None:
        if torch.is_grad_enabled():
            finished.append(name)

    for name in outer:
        sub = module.get_submodule(name)
        handles.append(sub.register_forward_pre_hook(torch.compiler.disable(lambda m, args, _n=name: started(_n))))  # eager: adapters.compile
        handles.append(sub.register_forward_hook(torch.compiler.disable(lambda m, args, out, _n=name: returned(_n))))


def after_materialize(
    module: nn.Module,
    mesh: ParallelMesh,
    init: InitPlan | None,
    on_meta: bool,
    ema_pairs: tuple[EMAPair, ...],
    apart: Iterable[tuple[nn.Module, EMAPair]] = (),
) -> InitReport | None:
    """What follows materialization, before the first forward; returns what this rank read for ``init_from``.
    Gradient hooks go on again (materialization replaced parameters); FSDP2's lazy init counts every parameter
    trainable, so what is frozen at the first forward (a GAN's discriminator) does not decide a reduce dtype."""
    average_unsharded_gradients(module, mesh)
    report = None
    if init is not None:  # after materialization, before teachers copy students and rank 0's copy is broadcast
        report = load_init_from(module, init)
        rank_zero_info(report.describe())
    if on_meta or init is not None:  # teachers the files do not hold start as copies of their (loaded) students
        with torch.no_grad():
            copy_students_into_teachers(module, init.copy_teachers if init is not None else ema_pairs)
            for both, pair in apart:
                copy_students_into_teachers(both, (pair,))
    broadcast_unsharded(module, mesh)
    init_sharded_units(module)  # before the first forward: what is frozen then (toggle_optimizer) does not count
    return report
