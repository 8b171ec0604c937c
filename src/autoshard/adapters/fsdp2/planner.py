"""Intent + method needs -> an FSDP2Plan: every parameter-owning block, then every trainable subtree; never the root.

Which parameters each unit owns, which stay whole and why, and each unit's ``reshard_after_forward`` (torchtitan's
policy). Block discovery is ``blocks``; the plan's types and summary are ``plan``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable

from torch import nn

from autoshard.adapters.blocks import block_units, is_metric, outermost, param_names, subtree_roots, within
from autoshard.adapters.checkpointing import checkpointable_blocks, nothing_to_checkpoint
from autoshard.adapters.compile import Compile, nothing_to_compile
from autoshard.adapters.forward_trace import REGISTRATION_ORDER, ForwardTrace, trace_forward
from autoshard.adapters.fsdp2.ema import check_ema_structure
from autoshard.adapters.fsdp2.plan import PARALLELIZE_FN_HINT, FSDP2Plan, Replicated, Reshard, Role, ShardUnit, UnitKind, Unsharded
from autoshard.adapters.tp_plan import TPPlan, find_tp_plan
from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelDims
from autoshard.needs import MethodNeeds
from autoshard.precision import PrecisionPlan, resolve_precision
from autoshard.privates import in_torch


def plan_fsdp2(
    module: nn.Module,
    intent: ShardingIntent | None = None,
    needs: MethodNeeds | None = None,
    precision: PrecisionPlan | None = None,
    *,
    dims: ParallelDims | None = None,
    sync_batchnorm: bool = False,
) -> FSDP2Plan:
    """Decide what to ``fully_shard``: every parameter-owning block, then every trainable subtree; never the root.
    ``precision=None`` plans for the intent's; ``dims=None`` (no world yet) for the intent's tensor_parallel_size,
    pure FSDP."""
    intent = intent or ShardingIntent()
    needs = needs or MethodNeeds()
    modules = dict(module.named_modules())
    names_of = param_names(module)
    excluded = set(intent.exclude) | set(needs.callback_modules)
    excluded |= {n for n, m in modules.items() if n and is_metric(m)}
    unknown = [p for p in intent.exclude if p not in modules]
    if unknown:
        top = ", ".join(n for n, _ in module.named_children())
        raise IntentError(
            f"exclude names {', '.join(map(repr, unknown))}, not a module of {type(module).__name__}: top-level modules"
            f" are {top}. Fix: name module paths as printed by `print(model)`, or drop them from exclude"
        )
    tp_plan = tensor_parallel_plan(module, dims.tp if dims is not None else intent.tensor_parallel_size)
    teachers = {p.teacher for p in needs.ema_pairs}
    for pair in needs.ema_pairs:
        check_ema_structure(module, pair)
    notes: list[str] = []
    replicated: list[Replicated] = []
    trace = trace_forward(module)
    candidates = _candidates(module, modules, intent, needs, excluded, names_of, replicated, notes)
    candidates = _called_units(module, modules, candidates, trace, notes)
    # The blocks activation checkpointing wraps: one selection for every engine (DeepSpeed checkpoints the same ones)
    checkpointed = set(checkpointable_blocks(module, intent, needs)) if intent.activation_checkpointing else set()
    units, forward_order = _units(modules, candidates, teachers, intent, needs, names_of, checkpointed, trace)
    if intent.activation_checkpointing and not any(u.checkpointed for u in units):
        raise nothing_to_checkpoint(module, intent)
    kept_whole = batchnorm_parameters(module) if low_precision_gather(precision or resolve_precision(None, intent)) else set()
    _left_whole(module, modules, units, excluded, kept_whole, needs, replicated)
    _refuse_or_note(module, intent, units, replicated, notes)
    buffers = {name: b.numel() * b.element_size() for name, b in module.named_buffers()}
    compiled = _compiled(module, units, intent, needs)
    if compiled and needs.compiled:
        user = ", ".join(f"'{p}'" for p in needs.compiled)
        notes.append(f"compiled by the model ({user}): its blocks are compiled in place before fully_shard, names stay eager")
    hsdp = dims.hsdp if dims is not None else None
    return FSDP2Plan(
        units, replicated, tuple(needs.ema_pairs), intent, notes, buffers, sync_batchnorm, precision, hsdp, tp_plan, compiled, forward_order
    )


def _candidates(
    module: nn.Module,
    modules: dict[str, nn.Module],
    intent: ShardingIntent,
    needs: MethodNeeds,
    excluded: set[str],
    names_of: dict[int, list[str]],
    replicated: list[Replicated],
    notes: list[str],
) -> dict[str, tuple[UnitKind, str]]:
    """The modules that may become units (blocks inside the planned subtrees, then the subtrees themselves), minus
    those sharing parameters with modules outside them; frozen subtrees go to ``replicated`` when nothing is named."""
    teachers = {p.teacher for p in needs.ema_pairs}

    def exclusive(path: str) -> bool:
        """A unit may not share a parameter (tied weights) with anything outside it."""
        return all(within(n, {path}) for p in modules[path].parameters() for n in names_of[id(p)])

    roots = [r for r in subtree_roots(module, intent.shard) if not within(r, excluded)]
    roots += [m for p in needs.ema_pairs for m in (p.teacher, p.student) if m not in roots and not within(m, excluded)]
    candidates: dict[str, tuple[UnitKind, str]] = {}
    planned: list[str] = []
    for root_path in roots:
        sub = modules[root_path]
        if not any(True for _ in sub.parameters()):
            continue
        if intent.shard is None and not within(root_path, teachers) and not any(p.requires_grad for p in sub.parameters()):
            replicated.append(_replicated(root_path, sub.parameters(), Unsharded.FROZEN))
            continue
        planned.append(root_path)
    inside = set(planned)
    for name, why in block_units(module, intent.blocks, modules).items():
        if within(name, inside) and not within(name, excluded):
            candidates[name] = (UnitKind.BLOCK, why)
    sides = {p.student: f"EMA student of '{p.teacher}'" for p in needs.ema_pairs} | {
        p.teacher: f"EMA teacher of '{p.student}'" for p in needs.ema_pairs
    }
    for root_path in planned:
        why = "named in ShardingIntent(shard=...)" if intent.shard else sides.get(root_path, "top-level child")
        candidates.setdefault(root_path, (UnitKind.SUBTREE, f"{why}: holds what no block took"))
    for path in list(candidates):
        if not exclusive(path):
            notes.append(f"'{path}' shares parameters with modules outside it (tied weights): sharded with its parent instead")
            del candidates[path]
    return candidates


def _left_whole(
    module: nn.Module,
    modules: dict[str, nn.Module],
    units: list[ShardUnit],
    excluded: set[str],
    kept_whole: set[int],
    needs: MethodNeeds,
    replicated: list[Replicated],
) -> None:
    """Every parameter no unit shards, into ``replicated`` with why: BatchNorm's under a low-precision gather
    (``kept_whole``), 0-dim ones inside units, excluded modules whole, the rest (the root's, outside any unit)."""
    covered = {id(p) for u in units for p in modules[u.name].parameters() if p.dim() > 0}
    unit_names = {u.name for u in units}
    replicated_names = {r.name for r in replicated}

    def add(name: str, params: Iterable[nn.Parameter], why: Unsharded) -> None:
        replicated.append(_replicated(name, params, why))
        replicated_names.add(name)

    for name, p in module.named_parameters():
        if within(name, replicated_names):  # an excluded module, once added, covers all its parameters
            continue
        owner = outermost(name, excluded)
        if id(p) in kept_whole and within(name, unit_names):
            add(name, [p], Unsharded.NORM)
        elif id(p) in covered:
            continue
        elif p.dim() == 0 and within(name, unit_names):
            add(name, [p], Unsharded.SCALAR)
        elif owner is not None:
            add(owner, modules[owner].parameters(), Unsharded.CALLBACK if owner in needs.callback_modules else Unsharded.EXCLUDED)
        else:
            add(name, [p], Unsharded.ROOT if "." not in name else Unsharded.OUTSIDE)


def _refuse_or_note(module: nn.Module, intent: ShardingIntent, units: list[ShardUnit], replicated: list[Replicated], notes: list[str]) -> None:
    """No unit at all, or parameters on the root: refused under ``strict``, else a note or a warning."""
    if not units:
        message = (
            f"no parameter-owning child modules found to shard in {type(module).__name__}: your trainable parameters"
            f" live directly on the module. Fix: put them in child modules, or {PARALLELIZE_FN_HINT}"
        )
        if intent.strict:
            raise AutoShardError(message)
        notes.append(message)
    root_params = [r.name for r in replicated if r.why is Unsharded.ROOT]
    if root_params:
        message = (
            f"parameters live directly on {type(module).__name__}: {', '.join(root_params)}. The generic FSDP2 plan"
            f" cannot shard them (sharding the root breaks training_steps that call children directly); they stay"
            f" replicated with averaged gradients. Fix: move them into a child module, or {PARALLELIZE_FN_HINT}"
        )
        if intent.strict:
            raise AutoShardError(message.replace("they stay replicated with averaged gradients", "strict=True refuses to replicate them"))
        warnings.warn(message, stacklevel=3)


def _compiled(module: nn.Module, units: list[ShardUnit], intent: ShardingIntent, needs: MethodNeeds) -> tuple[str, ...]:
    """The modules ``apply`` compiles in place (``adapters.compile``), in unit order: every block unit (the EMA teacher's
    too) under ``compile=True`` or when the user compiled part of the model; and each module the user compiled that
    holds no block unit and sits inside none, compiled whole. Refused when ``compile=True`` finds nothing to compile."""
    wanted = Compile.of(intent.compile) is Compile.BLOCKS
    if not wanted and not needs.compiled:
        return ()
    blocks = [u.name for u in units if u.kind is UnitKind.BLOCK]
    if wanted and not blocks:
        raise nothing_to_compile(module, intent.blocks)
    whole = [p for p in needs.compiled if p and not any(within(b, {p}) or within(p, {b}) for b in blocks)]
    return tuple([*blocks, *whole])


def low_precision_gather(precision: PrecisionPlan) -> bool:
    """Parameters are gathered in a dtype below the weights' own (bf16-mixed): what BatchNorm cannot take."""
    return precision.gather is not precision.master


def batchnorm_parameters(module: nn.Module) -> set[int]:
    """ids of the parameters of BatchNorm layers. Under a low-precision gather they stay whole in float32 (FSDP1's
    MixedPrecision kept BatchNorm out of its casts by default for the same reason): batch_norm refuses a bf16 weight
    next to float32 running statistics ("expected scalar type BFloat16 but found Float"), and takes a float32 weight
    with a bf16 input. They are a few numbers per channel; autoshard averages their gradients like any whole one."""
    return {id(p) for m in module.modules() if isinstance(m, in_torch.BatchNorm) for p in m.parameters(recurse=False)}


def tensor_parallel_plan(module: nn.Module, tp: int) -> TPPlan | None:
    """The model's own tensor-parallel layout for ``tp`` ranks, checked; None for tp = 1. Refused when the model
    carries none: the ranks would hold whole copies and read the same batch."""
    if tp <= 1:
        return None
    plan = find_tp_plan(module)
    if plan is None:
        raise IntentError(
            f"tensor_parallel_size={tp} needs a tensor-parallel layout, and {type(module).__name__} carries none autoshard"
            f" can read (no _tp_plan on it or its submodules, no transformers config.base_model_tp_plan), so nothing would"
            f" be split across the {tp} tensor-parallel ranks and they would all train on the same batch. Fix: give the"
            f" model a _tp_plan (e.g. {{'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}}), pass"
            f" FSDP2Strategy(parallelize_fn=fn), where fn(module, device_mesh) applies a tensor-parallel layout on"
            f" device_mesh['tensor_parallel'], or set tensor_parallel_size=1"
        )
    plan.check(module, tp)
    return plan


def _replicated(name: str, params: Iterable[nn.Parameter], why: Unsharded) -> Replicated:
    params = list(params)
    return Replicated(
        name,
        sum(p.numel() for p in params),
        sum(p.numel() * p.element_size() for p in params),
        why,
        any(p.requires_grad for p in params),
    )


def _units(
    modules: dict[str, nn.Module],
    candidates: dict[str, tuple[UnitKind, str]],
    teachers: set[str],
    intent: ShardingIntent,
    needs: MethodNeeds,
    names_of: dict[int, list[str]],
    checkpointed: set[str],
    trace: ForwardTrace,
) -> tuple[list[ShardUnit], str]:
    """Order candidates deepest first, give each the parameters no deeper unit already owns, choose its resharding;
    and where the forward order came from."""
    found = _owned(modules, candidates)
    order, how = _forward_order(modules, found, teachers, trace)
    blocks = {name for name, _ in found if candidates[name][0] is UnitKind.BLOCK}
    kept = _ending_forward(_top(found, teachers), blocks, {name for name, _ in found}, order)
    units: list[ShardUnit] = []
    for name, own in found:
        kind, why = candidates[name]
        teacher = within(name, teachers)
        units.append(
            ShardUnit(
                name=name,
                kind=kind,
                role=Role.TEACHER if teacher else Role.TRAINABLE,
                numel=sum(p.numel() for p in own),
                bytes=sum(p.numel() * p.element_size() for p in own),
                reshard=_reshard(kept.get(name), teacher, any(p.requires_grad for p in own), intent, needs),
                checkpointed=name in checkpointed,
                why=why + _tied(own, names_of),
            )
        )
    return units, how


def _owned(modules: dict[str, nn.Module], candidates: dict[str, tuple[UnitKind, str]]) -> list[tuple[str, list[nn.Parameter]]]:
    """Each candidate with the parameters it shards (no deeper candidate's, no 0-dim one), deepest first; those left
    with none are no unit."""
    order = {name: i for i, name in enumerate(modules)}
    owned: set[int] = set()
    found: list[tuple[str, list[nn.Parameter]]] = []
    for name in sorted(candidates, key=lambda n: (-n.count("."), order[n])):
        own = [p for p in modules[name].parameters() if id(p) not in owned and p.dim() > 0]
        owned.update(id(p) for p in own)
        if own:
            found.append((name, own))
    return found


def _called_units(
    module: nn.Module,
    modules: dict[str, nn.Module],
    candidates: dict[str, tuple[UnitKind, str]],
    trace: ForwardTrace,
    notes: list[str],
) -> dict[str, tuple[UnitKind, str]]:
    """FSDP2 gathers a unit's parameters only when the unit itself is called. Where the traced forward used a unit's
    parameters while its own forward was not running, the module inside it that was running becomes a unit (a unit that
    never ran at all is dropped: ``PeftModel.forward`` calls ``base_model.model``, never ``base_model``); a use from
    outside the unit (``self.head.weight`` read by the parent) is refused by name."""
    for _ in range(len(modules)):  # each round adds units strictly inside the bypassed ones: it ends
        owner = {id(p): name for name, own in _owned(modules, candidates) for p in own}
        bypassed: dict[str, set[tuple[str, ...]]] = {}
        for pid, stacks in trace.uses.items():
            unit = owner.get(pid)
            for stack in stacks:
                if unit is not None and unit not in stack:
                    bypassed.setdefault(unit, set()).add(stack)
        if not bypassed:
            return candidates
        for unit, stacks in sorted(bypassed.items()):
            inside = {next((s for s in stack if within(s, {unit})), None) for stack in stacks}
            if None in inside:
                reader = next(stack[-1] for stack in sorted(stacks) if not any(within(s, {unit}) for s in stack))
                raise _used_uncalled(module, unit, reader)
            running = sorted(n for n in inside if n is not None)
            skipped = trace.position(unit) is None
            kind, why = candidates.pop(unit) if skipped else candidates[unit]
            where = f"in place of '{unit}', which the traced forward never calls" if skipped else f"called inside '{unit}' but not by it"
            for path in running:
                candidates.setdefault(path, (kind, f"{where}: {why}"))
            quoted = ", ".join(f"'{p}'" for p in running)
            notes.append(
                f"the traced forward uses parameters of '{unit}' while {'it never calls it' if skipped else 'it is not running'}"
                f" (it calls {quoted} directly): {quoted} {'is a unit' if len(running) == 1 else 'are units'}, so that FSDP2"
                f" gathers them where they run"
            )
    return candidates


def _used_uncalled(module: nn.Module, unit: str, reader: str) -> AutoShardError:
    """A unit's parameters used by a module outside it, while the unit was not called: FSDP2 never gathers them there."""
    by = f"{type(module).__name__}.forward" if not reader else f"'{reader}' ({type(module.get_submodule(reader)).__name__}.forward)"
    return AutoShardError(
        f"{by} uses the parameters of '{unit}' without calling '{unit}' (seen in one forward traced on the meta device):"
        f" FSDP2 gathers a unit's parameters only when the unit itself is called, so that forward would fail with"
        f" torch's 'mixed torch.Tensor and DTensor'. What works: calling the module where its parameters are used, or"
        f" keeping them whole. Fix: keep it whole with ShardingIntent(exclude=[{unit!r}]), or call the module"
        f" (`self.{unit}(...)`) instead of reading its parameters"
    )


def _top(found: list[tuple[str, list[nn.Parameter]]], teachers: set[str]) -> list[str]:
    """The outermost units with trainable parameters, teachers aside: one of them ends the forward."""
    names = {name for name, _ in found}
    return [n for n, own in found if outermost(n, names) == n and not within(n, teachers) and any(p.requires_grad for p in own)]


def _forward_order(
    modules: dict[str, nn.Module], found: list[tuple[str, list[nn.Parameter]]], teachers: set[str], trace: ForwardTrace
) -> tuple[dict[str, int], str]:
    """The position of each unit in forward order, and where it comes from: where the traced forward returned from
    it, when the trace ran every trainable outermost unit; else registration order (which the first training forward
    may correct: ``reshard_in_order``)."""
    missing = [n for n in _top(found, teachers) if trace.position(n) is None]
    if trace.traced and not missing:
        return {n: trace.positions.get(n, -1) for n, _ in found}, trace.how
    how = trace.how
    if trace.traced:
        shown = ", ".join(f"'{n}'" for n in missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        how = f"{REGISTRATION_ORDER}: the traced forward ({trace.how.removeprefix('traced: ')}) never called {shown}"
    return {name: i for i, name in enumerate(modules)}, how


def _ending_forward(top: list[str], blocks: set[str], names: set[str], order: dict[str, int]) -> dict[str, Reshard]:
    """The trainable units that end the forward, which backward needs first: of the outermost ones (``top``), the one
    that runs last (in ``order``: the traced forward's, the first training forward's, else registration order; a
    wrong guess costs the memory of a unit kept gathered, never correctness), and the one before it when it holds
    ``blocks`` (``model`` + ``head``).
    """
    top = sorted(top, key=lambda n: order.get(n, -1))
    if not top:
        return {}
    kept = {top[-1]: Reshard.KEPT_LAST}
    holders = {outermost(n, names) for n in blocks if outermost(n, names) != n}
    if len(top) > 1 and top[-2] in holders:
        kept[top[-2]] = Reshard.KEPT_BEFORE_LAST
    return kept


def follows_forward_order(plan: FSDP2Plan) -> bool:
    """The plan keeps a unit gathered for being last in a forward order it only guessed (registration order): the
    first training forward's order should decide (``reshard_in_order``)."""
    return plan.forward_order.startswith(REGISTRATION_ORDER) and any(u.reshard in (Reshard.KEPT_LAST, Reshard.KEPT_BEFORE_LAST) for u in plan.units)


def reshard_in_order(plan: FSDP2Plan, finished: list[str]) -> list[ShardUnit]:
    """The plan's units with the units that end the forward chosen again by ``finished``, the order a training
    forward returned from its outermost units (every rank runs them in one order: FSDP2's all-gathers follow it)."""
    names = {u.name for u in plan.units}
    order = {n: i for i, n in enumerate(finished)}
    top = [u.name for u in plan.units if u.reshard in _ORDERED and outermost(u.name, names) == u.name]
    if not top or any(n not in order for n in top):  # a unit this forward did not run: the plan's guess stands
        return plan.units
    kept = _ending_forward(top, {u.name for u in plan.units if u.kind is UnitKind.BLOCK}, names, order)
    return [dataclasses.replace(u, reshard=kept.get(u.name, Reshard.AFTER_FORWARD)) if u.reshard in _ORDERED else u for u in plan.units]


_ORDERED = (Reshard.AFTER_FORWARD, Reshard.KEPT_LAST, Reshard.KEPT_BEFORE_LAST)  # the choices forward order makes


def _reshard(kept: Reshard | None, teacher: bool, trainable: bool, intent: ShardingIntent, needs: MethodNeeds) -> Reshard:
    """torchtitan's policy: every unit reshards after forward, except those that end it (final norm, head), which
    backward gathers at once: keeping them saves those all-gathers and raises no peak (backward would bring them
    back before freeing anything). Not when a second forward, or an EMA teacher's, runs before backward."""
    if teacher:
        return Reshard.TEACHER
    if not trainable:
        return Reshard.FROZEN
    if not intent.reshard_after_forward:
        return Reshard.KEPT_BY_INTENT
    if kept is None:
        return Reshard.AFTER_FORWARD
    if needs.multi_forward:
        return Reshard.MULTI_FORWARD
    if needs.ema_pairs:
        return Reshard.EMA_FORWARD
    return kept


def _tied(own: list[nn.Parameter], names_of: dict[int, list[str]]) -> str:
    """Parameters of this unit shared by several modules (tied embedding and head): all in this one unit."""
    ties = [" = ".join(names_of[id(p)]) for p in own if len(names_of[id(p)]) > 1]
    return f"; tied weights grouped in this unit: {'; '.join(ties)}" if ties else ""
