"""Per-rank memory of a sharded run, before it runs, from shapes alone (a module on meta): FSDP2 figures are exact per
rank (uneven dim-0 shards included); ZeRO-3 figures are DeepSpeed's own estimator formulas, so the two never disagree.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autoshard.adapters.checkpointing import checkpointed_blocks
from autoshard.adapters.fsdp2 import Unsharded
from autoshard.adapters.tp_plan import TPCollective, TPPlan
from autoshard.backends import BACKENDS, get_backend, load, on_backend
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent, as_intent
from autoshard.memory_model import CATEGORIES, LABELS, Layout, MemoryEstimate, Param, RankInputs, Traffic, Unit
from autoshard.mesh import ParallelDims, hybrid_sizes, nodes_for
from autoshard.needs import MethodNeeds, callbacks_of, held_optimizers, inspect_needs, returned_optimizers
from autoshard.precision import Dtype, PrecisionPlan, resolve_precision
from autoshard.select import AUTO, select_backend
from autoshard.units import fmt_bytes

# memory_table's line when no step ran (explain replaces it when --batch was passed but no step ran).
ACTIVATIONS_HINT = "activations are not counted: pass --batch FILE.py:make_batch (or set example_input_array) to simulate a step"


# -- which optimizers (found by autoshard.needs' rules) ---------------------------------------------------------
def sharded_parameter(module: nn.Module) -> str | None:
    """The first parameter already sharded (a DTensor, or DeepSpeed's), None when none is."""
    return next((n for n, p in module.named_parameters() if hasattr(p, "placements") or hasattr(p, "ds_id")), None)


def collect_optimizers(module: nn.Module, callbacks: Sequence[object] | None = None) -> list[tuple[str, torch.optim.Optimizer]]:
    """(source, optimizer) for the module's ``configure_optimizers`` and every callback-owned optimizer, built on the
    unsharded module: optimizers over sharded parameters would count shards twice."""
    sharded = sharded_parameter(module)
    if sharded is not None:
        raise AutoShardError(
            f"estimate_memory reads optimizers of the unsharded module, but {type(module).__name__}.{sharded} is"
            f" already sharded. Fix: estimate before sharding (build the module under `with torch.device('meta'):`),"
            f" or pass optimizers=[...] built on an unsharded copy"
        )
    out: list[tuple[str, torch.optim.Optimizer]] = []
    if callable(getattr(module, "configure_optimizers", None)):
        try:
            configured = module.configure_optimizers()
        except Exception as exc:  # the hook may need a Trainer (schedulers reading estimated_stepping_batches)
            raise AutoShardError(
                f"estimate_memory could not build the optimizers: {type(module).__name__}.configure_optimizers()"
                f" raised {type(exc).__name__}: {exc}. Fix: pass optimizers=[...] to estimate_memory"
            ) from exc
        out += [("configure_optimizers", o) for o in returned_optimizers(configured)]
    for callback in callbacks_of(module, callbacks=callbacks):
        out += [(f"callback {type(callback).__name__}", o) for o in held_optimizers(callback)]
    return out


# -- the layout of one module under a plan --------------------------------------------------------------------------
def _elsize(p: torch.Tensor, precision: PrecisionPlan) -> int:
    """Bytes per element in training: "-true" low precisions convert every floating parameter (Lightning)."""
    if p.is_floating_point() and not precision.autocast and precision.master is not Dtype.FLOAT32:
        return precision.master.bytes
    return p.element_size()


def _gather_elsize(p: torch.Tensor, precision: PrecisionPlan, elsize: int) -> int:
    """Bytes per element all-gathered: the gather dtype, where it differs from the weights' (as ``policies`` casts)."""
    return precision.gather.bytes if p.is_floating_point() and precision.gather is not precision.master else elsize


@dataclass(frozen=True)
class TensorParallelCost:
    """What a model's own tensor-parallel plan changes in the estimate: ``full``, the parameters whole (for the
    unsharded figures), and the plan's per-step collectives."""

    size: int
    full: Layout
    collectives: tuple[TPCollective, ...]
    activation_elsize: int  # bytes per element of the activations the collectives move (the compute dtype)


def _layout(
    module: nn.Module, intent: ShardingIntent, needs: MethodNeeds, backend: str, precision: PrecisionPlan
) -> tuple[Layout, TensorParallelCost | None]:
    """The parameters as the backend's plan places them; under a model's own tensor-parallel plan, as one
    tensor-parallel rank holds them, with the cost of that plan (None without one)."""
    plan_fn = get_backend(backend).plan
    precision = on_backend(precision, backend)
    notes: list[str] = []
    plan = None
    if plan_fn:  # a per-block plan says which unit owns each parameter; without one, every parameter is partitioned
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = load(plan_fn)(module, intent, needs, precision)
        notes += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        notes += plan.notes
    plan_units = plan.units if plan is not None else []
    owner: dict[int, tuple[str, str]] = {}  # param id -> (unit name, role)
    modules = dict(module.named_modules())
    for unit in plan_units:  # deepest first: a unit owns what no deeper unit took
        for p in modules[unit.name].parameters():
            if p.dim() > 0 and id(p) not in owner:
                owner[id(p)] = (unit.name, unit.role)
    whys: dict[str, str] = {r.name: r.why.value for r in plan.replicated} if plan is not None else {}
    replicated = sorted(whys, key=len, reverse=True)
    gathered = {u.name: 0 for u in plan_units}
    reduced = dict(gathered)
    tp_plan: TPPlan | None = getattr(plan, "tp_plan", None)
    tp = intent.tensor_parallel_size if tp_plan is not None else 1
    splits = tp_plan.split_params(module) if tp_plan is not None and tp > 1 else {}
    params: dict[int, Param] = {}
    whole: dict[int, Param] = {}
    for name, p in module.named_parameters():
        elsize = _elsize(p, precision)
        gather = _gather_elsize(p, precision, elsize)
        unit = owner.get(id(p))
        dim = splits.get(name)  # the dimension the tensor-parallel plan splits, None: whole on each tp rank
        shape = tuple(p.shape) if dim is None or dim >= p.dim() else (*p.shape[:dim], p.shape[dim] // tp, *p.shape[dim + 1 :])
        numel = math.prod(shape)
        if unit is not None:
            part, teacher = unit[0], unit[1] == "teacher"
            gathered[part] += numel * gather
            if p.requires_grad and not teacher:
                reduced[part] += numel * (precision.reduce.bytes if p.is_floating_point() else elsize)
        else:
            part = next((r for r in replicated if name == r or name.startswith(r + ".")), name)
            whys.setdefault(part, Unsharded.OUTSIDE.value)
            teacher = False
        params[id(p)] = Param(name, shape, elsize, gather, unit is not None, teacher, p.requires_grad, part)
        whole[id(p)] = replace(params[id(p)], shape=tuple(p.shape))
    units = [Unit(u.name, gathered[u.name], reduced[u.name], u.reshard_after_forward, u.role == "teacher") for u in plan_units]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    recomputed = () if plan is not None else tuple(checkpointed_blocks(module, intent, needs))
    layout = Layout(params, units, whys, notes, largest, precision, recomputed)
    if tp_plan is None or tp == 1:
        return layout, None
    full = Layout(whole, units, whys, notes, largest, precision, recomputed)
    return layout, TensorParallelCost(tp, full, tuple(tp_plan.collectives(module)), precision.compute.bytes)


def _with_tensor_parallel(estimator: Any, layout: Layout, tp: TensorParallelCost, inputs: RankInputs, tokens: int | None) -> MemoryEstimate:
    """The estimate of one rank of a data-parallel x tensor-parallel run, from the backend's own estimator.

    Ranks are numbered tensor parallel innermost (``autoshard.mesh``), so the estimator sees the data-parallel world
    fully_shard shards over and parameters already cut to one tensor-parallel rank's slice. The plan's collectives
    join the traffic rows for ``tokens`` tokens per micro-batch (without them, a note gives bytes per token).
    """
    world_size, num_nodes, dims = inputs.world_size, inputs.num_nodes, inputs.dims
    per_node = world_size // num_nodes
    dp_nodes = num_nodes if dims.dp % num_nodes == 0 and per_node % tp.size == 0 else 1
    inner = inputs.intent.replace(tensor_parallel_size=1, data_parallel_size=None)
    est = estimator(layout, replace(inputs, intent=inner, dims=replace(dims, tp=1), rank=inputs.rank // tp.size, num_nodes=dp_nodes))
    whole = estimator(tp.full, replace(inputs, intent=inner, dims=ParallelDims(), rank=0, num_nodes=1)).full_model_states
    spans_nodes = tp.size > per_node
    traffic: list[Traffic] = []
    per_token: dict[str, int] = {}
    for c in tp.collectives:
        key = f"tensor parallel: {c.collective} of {'parameter gradients' if not c.per_token else 'activations'} ({c.phase})"
        if c.per_token:
            per_token[key] = per_token.get(key, 0) + c.sent(c.features, tp.activation_elsize, tp.size)
        else:
            sent = c.sent(c.features, layout.precision.reduce.bytes, tp.size)
            traffic.append(Traffic(key, tp.size, sent, spans_nodes))
    notes = list(est.notes)
    if per_token and tokens:
        traffic += [Traffic(key, tp.size, sent * tokens, spans_nodes) for key, sent in per_token.items()]
    elif per_token:
        shown = ", ".join(f"{key.removeprefix('tensor parallel: ')} {fmt_bytes(sent)}" for key, sent in per_token.items())
        notes.append(f"tensor-parallel traffic per token of the micro-batch, per rank and step: {shown} (pass --batch to count it)")
    notes.append(
        f"tensor parallel {tp.size}: each rank holds 1/{tp.size} of the rows or columns of every parameter the model's"
        f" plan splits, sharded again over its data-parallel shard group (world size / {tp.size}, or shard_size)"
    )
    return replace(
        est,
        world_size=world_size,
        rank=inputs.rank,
        full_model_states=whole,
        shard_group=est.shard_group * tp.size,
        num_nodes=num_nodes,
        traffic=(*est.traffic, *(t for t in traffic if t.bytes)),
        notes=tuple(dict.fromkeys(notes)),
    )


def with_step(estimate: MemoryEstimate, step: Any, whole_step: bool) -> MemoryEstimate:
    """The estimate with a simulated step's figures (``activations.StepMemory``). ``whole_step``: the step ran this
    backend's own sharding, so its peak is the run's; otherwise (DeepSpeed) only its activations are added."""
    if not whole_step:
        return replace(estimate, activations=step.activations, forward_only=step.forward_only)
    return replace(
        estimate, activations=step.activations, step_peak=step.peak, step_gathered=step.gathered, step_at=step.at, forward_only=step.forward_only
    )


def memory_table(estimates: Sequence[MemoryEstimate]) -> str:
    """Estimates side by side, one column per world size (same module, backend and intent)."""
    if not estimates:
        return ""
    first = estimates[0]
    head = f"per-rank memory, {first.backend}, precision {first.precision}, rank {first.rank} (the largest shard)"
    rows: list[tuple[str, list[str]]] = [("world size", [str(e.world_size) for e in estimates])]
    hybrid = any(e.shard_group and e.shard_group != e.world_size for e in estimates)
    if hybrid or any(e.num_nodes > 1 for e in estimates):
        rows.append(("nodes", [str(e.num_nodes) for e in estimates]))
    if hybrid:
        rows.append(("shard group (shard_size) x replicas", [f"{e.shard_group} x {e.world_size // e.shard_group}" for e in estimates]))
    for c in CATEGORIES:
        rows.append((LABELS[c] + (" [CPU]" if c in first.offloaded else ""), [fmt_bytes(getattr(e, c)) for e in estimates]))
    rows.append(("= model states", [fmt_bytes(e.model_states) for e in estimates]))
    rows.append(
        (f"  vs ideal (unsharded / {'shard group' if hybrid else 'N'})", [f"{e.model_states / e.ideal:.3f}x" if e.ideal else "-" for e in estimates])
    )
    step = "forward" if first.forward_only else "training step"
    if all(e.step_peak for e in estimates):
        rows.append((f"gathered at the {step}'s peak ({first.gather_dtype})", [fmt_bytes(e.step_gathered) for e in estimates]))
        rows.append(("activations + temporaries at the peak", [fmt_bytes(e.activations) for e in estimates]))
        if any(e.other_at_peak for e in estimates):
            signed = [("-" if e.other_at_peak < 0 else "+") + fmt_bytes(abs(e.other_at_peak)) for e in estimates]
            rows.append(("other at the peak (+inputs, buffers; -states not yet made)", signed))
        rows.append((f"= peak per rank (simulated {step})", [fmt_bytes(e.total) for e in estimates]))
    elif all(e.activations for e in estimates):  # the backend's own states and buffers + a simulated step's activations
        rows.append((f"largest gathered block (transient, {first.gather_dtype})", [fmt_bytes(e.gathered_block) for e in estimates]))
        rows.append((f"activations + temporaries (simulated {step})", [fmt_bytes(e.activations) for e in estimates]))
        rows.append(("= peak per rank", [fmt_bytes(e.total) for e in estimates]))
    else:
        rows.append((f"largest gathered block (transient, {first.gather_dtype})", [fmt_bytes(e.gathered_block) for e in estimates]))
        rows.append(("= peak per rank (without activations)", [fmt_bytes(e.total) for e in estimates]))
    rows.append(("  on the accelerator", [fmt_bytes(e.device) for e in estimates]))
    if any(e.host for e in estimates):
        rows.append((get_backend(first.backend).host_memory, [fmt_bytes(e.host) for e in estimates]))
    if any(e.traffic for e in estimates) and any(e.num_nodes > 1 for e in estimates):
        rows.append(("sent per step, within a node", [fmt_bytes(e.intra_node_bytes) for e in estimates]))
        rows.append(("sent per step, across nodes", [fmt_bytes(e.inter_node_bytes) for e in estimates]))
    elif any(e.traffic for e in estimates):
        rows.append(("sent per step (one node)", [fmt_bytes(e.intra_node_bytes) for e in estimates]))
    width = max(len(r[0]) for r in rows)
    cols = [max(len(r[1][i]) for r in rows) for i in range(len(estimates))]
    lines = [head]
    for label, values in rows:
        lines.append("  " + label.ljust(width) + "  " + "  ".join(v.rjust(w) for v, w in zip(values, cols)))
    if first.gathered_unit:
        lines.append(f"  largest unit: '{first.gathered_unit}', all-gathered in {first.gather_dtype}")
    for e in estimates:
        if e.step_at:
            lines.append(f"  world size {e.world_size}: the peak is at {e.step_at}")
    if not any(e.step_peak or e.activations for e in estimates):
        lines.append(f"  {ACTIVATIONS_HINT}")
    lines += [f"  optimizer {o}" for o in first.optimizers]
    if first.unsharded_parts:
        lines.append("  whole on every rank (params + grads + optimizer states):")
        lines += [f"    {p.name:<38} {fmt_bytes(p.bytes):>11}  {p.why}" for p in first.unsharded_parts]
    lines += [f"  note: {n}" for n in dict.fromkeys(n for e in estimates for n in e.notes)]
    return "\n".join(lines)


def _canonical_backend(backend: str, needs: MethodNeeds, intent: ShardingIntent, precision: PrecisionPlan) -> str:
    if isinstance(backend, str) and backend.strip().lower() in AUTO:
        return select_backend(needs, intent, precision=precision).backend
    chosen = get_backend(backend)
    if chosen.memory is None:
        covered = " and ".join(name for name, b in BACKENDS.items() if b.memory is not None)
        raise AutoShardError(f"estimate_memory covers {covered}, not {chosen.name}. Fix: use backend='fsdp2'")
    return chosen.name


@dataclass(frozen=True)
class EstimateOptions:
    """How ``estimate_memory`` counts, beyond the module, the intent, the world size and the optimizers. ``rank`` 0
    holds the largest FSDP2 shard; ``devices_per_node`` derives ``num_nodes`` from each world size; ``sourced``: pairs
    ``collect_optimizers`` made, so that ``configure_optimizers`` runs once (hooks may assert a single call)."""

    rank: int = 0
    num_nodes: int = 1
    devices_per_node: int | None = None
    precision: PrecisionPlan | None = None
    zero_init: bool = True
    state_tensors: Mapping[str, int] | None = None
    sourced: Sequence[tuple[str, torch.optim.Optimizer]] | None = None
    tokens: int | None = None
    zero_overrides: Mapping[str, Any] | None = None  # DeepSpeed: the strategy's zero_overrides (the sizes its estimate reads)


def estimate_memory(
    module: nn.Module,
    intent: ShardingIntent | Mapping[str, Any] | None = None,
    needs: MethodNeeds | None = None,
    world_size: int = 1,
    backend: str = "fsdp2",
    *,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    callbacks: Sequence[object] | None = None,
    options: EstimateOptions | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of ``module`` trained on ``world_size`` ranks; ``optimizers`` default to
    ``configure_optimizers()`` plus the callbacks' own (built here, on the unsharded module)."""
    return estimate_memory_many(module, intent, needs, [world_size], backend, optimizers=optimizers, callbacks=callbacks, options=options)[0]


def estimate_memory_many(
    module: nn.Module,
    intent: ShardingIntent | Mapping[str, Any] | None = None,
    needs: MethodNeeds | None = None,
    world_sizes: Iterable[int] = (1, 2, 8, 64),
    backend: str = "fsdp2",
    *,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    callbacks: Sequence[object] | None = None,
    options: EstimateOptions | None = None,
) -> list[MemoryEstimate]:
    """One estimate per world size; the plan and the optimizers are built once."""
    o = options or EstimateOptions()
    intent = as_intent(intent)
    precision = o.precision or resolve_precision(None, intent)
    if needs is None:
        needs = inspect_needs(module, callbacks=callbacks)
    backend = _canonical_backend(backend, needs, intent, precision)
    if o.sourced is not None:
        sourced = list(o.sourced)
    elif optimizers is None:
        sourced = collect_optimizers(module, callbacks)
    else:
        sourced = [("given", opt) for opt in (returned_optimizers(list(optimizers)) or list(optimizers))]
    layout, tp = _layout(module, intent, needs, backend, precision)
    estimator = get_backend(backend).memory
    out = []
    for world_size in world_sizes:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise AutoShardError(f"world sizes must be positive integers, got {world_size!r}. Fix: e.g. world_sizes=(2, 8)")
        if not 0 <= o.rank < world_size:
            raise AutoShardError(f"rank {o.rank} is not in a world of {world_size} ranks. Fix: rank= 0 to {world_size - 1}")
        nodes = o.num_nodes if o.devices_per_node is None else nodes_for(world_size, o.devices_per_node)
        dims = _dims(intent, world_size, nodes, tp)
        inputs = RankInputs(sourced, intent, dims, o.rank, nodes, dict(o.state_tensors or {}), o.zero_init, dict(o.zero_overrides or {}))
        out.append(estimator(layout, inputs) if tp is None else _with_tensor_parallel(estimator, layout, tp, inputs, o.tokens))
    return out


def _dims(intent: ShardingIntent, world_size: int, num_nodes: int, tp: TensorParallelCost | None) -> ParallelDims:
    """The layout an estimate is for: resolved in full under a model's tensor-parallel plan; otherwise the
    data-parallel split alone over every rank (the table assumes pure data parallel, explain says so)."""
    if tp is not None:
        return ParallelDims.resolve(intent, world_size, num_nodes)
    replicas, shard = hybrid_sizes(intent, world_size, num_nodes) or (1, world_size)
    return ParallelDims(replicas, shard)
