"""Per-rank memory of a sharded run, before it runs: parameters, gradients, optimizer states, teacher, what stays whole.

Works on a module built on the meta device (no memory used): only shapes, dtypes, the FSDP2 plan and the
optimizers' settings are read. FSDP2 figures are exact per rank (uneven dim-0 shards included); ZeRO-3 figures
are DeepSpeed's own estimator formulas, so the two tools never disagree.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autoshard.backends import BACKENDS, get_backend, load
from autoshard.backends.deepspeed import zero3_model_states  # re-exported: public here before it moved
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent, as_intent
from autoshard.needs import MethodNeeds, callbacks_of, held_optimizers, inspect_needs, returned_optimizers
from autoshard.precision import Dtype, PrecisionPlan, on_backend, resolve_precision

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "ema_teacher", "unsharded")
_LABELS = {
    "parameters": "parameters (sharded)",
    "gradients": "gradients (sharded)",
    "optimizer_states": "optimizer states (sharded)",
    "ema_teacher": "EMA teacher (sharded)",
    "unsharded": "unsharded (whole on every rank)",
}


# -- optimizer states ---------------------------------------------------------------------------------------------
StateFn = Callable[[Mapping[str, Any], tuple[int, ...]], tuple[int, int]]
"""(param group, local shape) -> (elements of state in the parameter's dtype, number of float32 scalar tensors)."""


def _n(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _per_param(tensors: int, scalars: int = 1) -> StateFn:
    return lambda group, shape: (tensors * _n(shape), scalars)


def _adam(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    return (3 if group.get("amsgrad") else 2) * _n(shape), 1  # exp_avg, exp_avg_sq (+ max_exp_avg_sq), step


def _sgd(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    return (_n(shape) if group.get("momentum", 0) else 0), 0  # momentum_buffer only when momentum != 0


def _rmsprop(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    k = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))  # square_avg (+ momentum_buffer, grad_avg)
    return k * _n(shape), 1


def _adafactor(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) > 1:  # factored second moment: one row vector and one column vector per matrix
        return _n(shape[:-1]) + _n(shape[:-2]) * shape[-1], 1
    return _n(shape), 1


# torch.optim classes by name, matched along the MRO so subclasses inherit their parent's count.
OPTIMIZER_STATES: dict[str, StateFn] = {
    "Adam": _adam,
    "AdamW": _adam,
    "SparseAdam": _per_param(2),
    "NAdam": _per_param(2, scalars=2),  # + mu_product
    "RAdam": _per_param(2),
    "Adamax": _per_param(2),  # exp_avg, exp_inf
    "Adadelta": _per_param(2),  # square_avg, acc_delta
    "Adagrad": _per_param(1),  # sum
    "ASGD": _per_param(1, scalars=3),  # ax; step, eta, mu
    "Rprop": _per_param(2),  # prev, step_size
    "RMSprop": _rmsprop,
    "SGD": _sgd,
    "Muon": _per_param(1, scalars=0),  # momentum_buffer
    "Adafactor": _adafactor,
}
UNKNOWN_OPTIMIZER_STATES = 2  # like Adam: the common case for optimizers autoshard has no entry for


def _state_fn(optimizer: torch.optim.Optimizer, overrides: Mapping[str, int]) -> tuple[StateFn | None, str | None]:
    """The state model for this optimizer; a note when the count is a guess."""
    for cls in type(optimizer).__mro__:
        if cls.__name__ in overrides:
            return _per_param(int(overrides[cls.__name__]), scalars=0), None
        if cls.__name__ == "LBFGS" and cls.__module__.startswith("torch.optim"):
            return None, None  # group-level flat history, handled apart
        if cls.__name__ in OPTIMIZER_STATES and cls.__module__.startswith("torch.optim"):
            return OPTIMIZER_STATES[cls.__name__], None
    name = type(optimizer).__name__
    note = (
        f"optimizer {name} is not in autoshard's table: assumed {UNKNOWN_OPTIMIZER_STATES} state tensors per"
        f" parameter (like Adam); pass state_tensors={{'{name}': K}} for its real count"
    )
    return _per_param(UNKNOWN_OPTIMIZER_STATES, scalars=0), note


def _describe_states(optimizer: torch.optim.Optimizer, fn: StateFn | None) -> str:
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if fn is None:
        return f"{type(optimizer).__name__}: 2 + 2 x history_size ({group.get('history_size')}) flat copies (upper bound)"
    tensors, scalars = fn(group, (1,))
    scalar = f" + {scalars} scalar{'s' if scalars > 1 else ''}" if scalars else ""
    return f"{type(optimizer).__name__}: {tensors} state tensor{'s' if tensors != 1 else ''} per parameter{scalar}"


# -- which optimizers (found by autoshard.needs' rules) ---------------------------------------------------------
def _sharded_parameter(module: nn.Module) -> str | None:
    return next((n for n, p in module.named_parameters() if hasattr(p, "placements") or hasattr(p, "ds_id")), None)


def collect_optimizers(module: nn.Module, callbacks: Sequence[object] | None = None) -> list[tuple[str, torch.optim.Optimizer]]:
    """(source, optimizer) for the module's ``configure_optimizers`` and every callback-owned optimizer.

    Built on the unsharded (possibly meta) module: optimizers over sharded parameters would count shards twice.
    """
    sharded = _sharded_parameter(module)
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
@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    elsize: int  # bytes per element while training
    gather_elsize: int  # bytes per element of the all-gathered copy (the precision's gather dtype)
    sharded: bool
    teacher: bool
    trainable: bool
    part: str  # the sharded unit, or the plan's "not sharded" entry it belongs to


@dataclass(frozen=True)
class UnshardedPart:
    """One entry of the plan's "not sharded" list, with all its bytes (params + grads + optimizer states)."""

    name: str
    bytes: int
    why: str


@dataclass(frozen=True)
class _Unit:
    """One sharded unit as memory and traffic see it: bytes all-gathered, gradient bytes reduced."""

    name: str
    gathered: int  # bytes of its parameters in the gather dtype
    reduced: int  # bytes of its trainable parameters' gradients in the reduce dtype
    reshard_after_forward: bool
    teacher: bool  # forwarded without backward: gathered once, nothing reduced


@dataclass
class _Layout:
    params: dict[int, _Param]
    units: list[_Unit]
    whys: dict[str, str]
    notes: list[str]
    largest_layer_params: int  # DeepSpeed's notion: most parameters owned directly by one module
    precision: PrecisionPlan  # as the backend runs it (autoshard.precision.on_backend)


def _elsize(p: torch.Tensor, precision: PrecisionPlan) -> int:
    """Bytes per element in training: "-true" low precisions convert every floating parameter (Lightning)."""
    converted = not precision.autocast and precision.master is not Dtype.FLOAT32
    if p.is_floating_point() and converted:
        return precision.master.bytes
    return p.element_size()


def _gather_elsize(p: torch.Tensor, precision: PrecisionPlan, elsize: int) -> int:
    """Bytes per element all-gathered: the gather dtype, where it differs from the weights' (as ``policies`` casts)."""
    if p.is_floating_point() and precision.gather is not precision.master:
        return precision.gather.bytes
    return elsize


def _layout(module: nn.Module, intent: ShardingIntent, needs: MethodNeeds, backend: str, precision: PrecisionPlan) -> _Layout:
    from autoshard.adapters.fsdp2 import Unsharded

    plan_fn = get_backend(backend).plan
    precision = on_backend(precision, backend)
    notes: list[str] = []
    owner: dict[int, tuple[str, str]] = {}  # param id -> (unit name, role)
    units: list[_Unit] = []
    whys: dict[str, str] = {}
    replicated: list[str] = []
    gathered: dict[str, int] = {}
    reduced: dict[str, int] = {}
    if plan_fn:  # a per-block plan says which unit owns each parameter; without one, every parameter is partitioned
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = load(plan_fn)(module, intent, needs, precision)
        notes += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        notes += plan.notes
        modules = dict(module.named_modules())
        for unit in plan.units:  # deepest first: a unit owns what no deeper unit took
            for p in modules[unit.name].parameters():
                if p.dim() > 0 and id(p) not in owner:
                    owner[id(p)] = (unit.name, unit.role)
        whys = {r.name: r.why.value for r in plan.replicated}
        replicated = sorted(whys, key=len, reverse=True)
        gathered = {u.name: 0 for u in plan.units}
        reduced = {u.name: 0 for u in plan.units}
    params: dict[int, _Param] = {}
    for name, p in module.named_parameters():
        elsize = _elsize(p, precision)
        gather = _gather_elsize(p, precision, elsize)
        unit = owner.get(id(p))
        if unit is not None:
            part, teacher = unit[0], unit[1] == "teacher"
            gathered[part] += p.numel() * gather
            if p.requires_grad and not teacher:
                reduced[part] += p.numel() * (precision.reduce.bytes if p.is_floating_point() else elsize)
        else:
            part = next((r for r in replicated if name == r or name.startswith(r + ".")), name)
            whys.setdefault(part, Unsharded.OUTSIDE.value)
            teacher = False
        params[id(p)] = _Param(name, tuple(p.shape), elsize, gather, unit is not None, teacher, p.requires_grad, part)
    if plan_fn:
        units = [_Unit(u.name, gathered[u.name], reduced[u.name], u.reshard_after_forward, u.role == "teacher") for u in plan.units]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    return _Layout(params, units, whys, notes, largest, precision)


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` holds under FSDP2's Shard(0): chunks of ceil(rows / N), the tail short or empty."""
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk))


def _local_shape(p: _Param, world_size: int, rank: int) -> tuple[int, ...]:
    if not p.sharded or not p.shape:
        return p.shape
    return (shard_rows(p.shape[0], world_size, rank), *p.shape[1:])


# -- the estimate ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in one collective kind per training step (ring algorithms: (g - 1) / g of the data).

    ``group``: the ranks taking part; ``inter_node``: the group spans nodes, so these bytes cross the slower
    inter-node links. Hybrid sharding moves the gathers and reduce-scatters inside a node and leaves only the
    all-reduce of each rank's 1/shard_size gradient slice across nodes.
    """

    collective: str
    group: int
    bytes: int
    inter_node: bool


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by category; ``offloaded`` names the categories that live in CPU memory.

    ``total`` is everything at the step's peak (model states + the transient all-gather); ``device`` is the part
    on the accelerator. For ZeRO-3, ``device`` and ``host`` are DeepSpeed's own estimator figures.
    """

    backend: str
    world_size: int
    rank: int
    precision: str
    parameters: int
    gradients: int
    optimizer_states: int
    ema_teacher: int
    unsharded: int
    gathered_block: int
    gathered_unit: str
    full_model_states: int  # the same states with nothing sharded: ideal per rank is this / world_size
    offloaded: tuple[str, ...] = ()
    gather_dtype: str = ""  # the dtype the gathered block is all-gathered in (bfloat16 under bf16-mixed)
    host: int = 0
    unsharded_parts: tuple[UnshardedPart, ...] = ()
    optimizers: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    shard_group: int = 0  # ranks one parameter is sharded over (the world size, or shard_size under HSDP); 0: n/a
    num_nodes: int = 1
    traffic: tuple[Traffic, ...] = ()
    # From one simulated training step (autoshard.activations.measure_step); 0 / "" when none ran.
    activations: int = 0  # activations and temporaries live at the step's peak
    step_peak: int = 0  # every tensor live at the step's peak: the real peak, where the table's total comes from
    step_gathered: int = 0  # all-gathered parameters and collective buffers live at that peak
    step_at: str = ""  # where in the step the peak was
    forward_only: bool = False  # no batch function: forward(example_input_array) only, no backward

    @property
    def inter_node_bytes(self) -> int:
        return sum(t.bytes for t in self.traffic if t.inter_node)

    @property
    def intra_node_bytes(self) -> int:
        return sum(t.bytes for t in self.traffic if not t.inter_node)

    @property
    def model_states(self) -> int:
        """Persistent bytes: what DTensor.to_local() of params, grads and optimizer states adds up to."""
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def total(self) -> int:
        """The peak per rank: the simulated step's when one ran (activations included), else states + gathered."""
        return self.step_peak or self.model_states + self.gathered_block + self.activations

    @property
    def other_at_peak(self) -> int:
        """What the simulated peak holds beyond states + gathered + activations: inputs and buffers (> 0), or
        gradients and optimizer states not yet allocated at that moment (< 0)."""
        return self.step_peak - self.model_states - self.step_gathered - self.activations if self.step_peak else 0

    @property
    def device(self) -> int:
        return self.total - sum(getattr(self, c) for c in self.offloaded)

    @property
    def ideal(self) -> float:
        """Unsharded states / the ranks they are sharded over (shard_size under hybrid sharding)."""
        return self.full_model_states / (self.shard_group or self.world_size)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            model_states=self.model_states, total=self.total, device=self.device, ideal=self.ideal,
            other_at_peak=self.other_at_peak,
            inter_node_bytes=self.inter_node_bytes, intra_node_bytes=self.intra_node_bytes,
        )
        return out

    def table(self) -> str:
        """Plain text for logs: one row per category, then the totals and what stays whole."""
        return memory_table([self])


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int, option: str = "--budget", example: str = "80GiB", error: type[AutoShardError] = AutoShardError) -> int:
    """``80GiB`` (binary), ``5GB`` (decimal, as Hugging Face and disk vendors count), or a number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise error(f"{option} {text!r} is not a size. Fix: write it as {example}, 500MB, 2GiB or a number of bytes")
        number, unit = float(m.group(1)), m.group(2).upper()
        power = "BKMGT".index(unit[0]) if unit and unit[0] in "KMGT" else 0
        size = int(number * (1024 if "I" in unit else 1000) ** power)
    if size < 1:
        raise error(f"{option} {text!r} must be at least one byte. Fix: e.g. {option} {example}")
    return size


def with_step(estimate: MemoryEstimate, step: Any, whole_step: bool) -> MemoryEstimate:
    """The estimate with a simulated step's figures (``autoshard.activations.StepMemory``).

    ``whole_step``: the step ran this backend's own sharding, so its peak is the run's peak; otherwise (DeepSpeed)
    only its activations are added to the backend's own estimate.
    """
    if not whole_step:
        return replace(estimate, activations=step.activations, forward_only=step.forward_only)
    return replace(
        estimate, activations=step.activations, step_peak=step.peak, step_gathered=step.gathered, step_at=step.at,
        forward_only=step.forward_only,
    )


def _signed(n: int) -> str:
    return ("-" if n < 0 else "+") + fmt_bytes(abs(n))


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: the resolution a memory budget needs."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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
        rows.append((_LABELS[c] + (" [CPU]" if c in first.offloaded else ""), [fmt_bytes(getattr(e, c)) for e in estimates]))
    rows.append(("= model states", [fmt_bytes(e.model_states) for e in estimates]))
    rows.append((f"  vs ideal (unsharded / {'shard group' if hybrid else 'N'})", [f"{e.model_states / e.ideal:.3f}x" if e.ideal else "-" for e in estimates]))
    if all(e.step_peak for e in estimates):
        step = "forward" if first.forward_only else "training step"
        rows.append((f"gathered at the {step}'s peak ({first.gather_dtype})", [fmt_bytes(e.step_gathered) for e in estimates]))
        rows.append((f"activations + temporaries at the peak", [fmt_bytes(e.activations) for e in estimates]))
        if any(e.other_at_peak for e in estimates):
            rows.append(("other at the peak (+inputs, buffers; -states not yet made)", [_signed(e.other_at_peak) for e in estimates]))
        rows.append((f"= peak per rank (simulated {step})", [fmt_bytes(e.total) for e in estimates]))
    elif all(e.activations for e in estimates):  # the backend's own states and buffers + a simulated step's activations
        step = "forward" if first.forward_only else "training step"
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
        lines.append("  activations are not counted: pass --batch FILE.py:make_batch (or set example_input_array) to simulate a step")
    lines += [f"  optimizer {o}" for o in first.optimizers]
    if first.unsharded_parts:
        lines.append("  whole on every rank (params + grads + optimizer states):")
        lines += [f"    {p.name:<38} {fmt_bytes(p.bytes):>11}  {p.why}" for p in first.unsharded_parts]
    lines += [f"  note: {n}" for n in dict.fromkeys(n for e in estimates for n in e.notes)]
    return "\n".join(lines)


def _canonical_backend(backend: str, needs: MethodNeeds, intent: ShardingIntent, precision: PrecisionPlan) -> str:
    from autoshard.select import AUTO, select_backend

    if isinstance(backend, str) and backend.strip().lower() in AUTO:
        return select_backend(needs, intent, precision=precision).backend
    chosen = get_backend(backend)
    if chosen.memory is None:
        covered = " and ".join(name for name, b in BACKENDS.items() if b.memory is not None)
        raise AutoShardError(f"estimate_memory covers {covered}, not {chosen.name}. Fix: use backend='fsdp2'")
    return chosen.name


def estimate_memory(
    module: nn.Module,
    intent: ShardingIntent | Mapping[str, Any] | None = None,
    needs: MethodNeeds | None = None,
    world_size: int = 1,
    backend: str = "fsdp2",
    *,
    rank: int = 0,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    callbacks: Sequence[object] | None = None,
    state_tensors: Mapping[str, int] | None = None,
    num_nodes: int = 1,
    zero_init: bool = True,
    precision: PrecisionPlan | None = None,
    devices_per_node: int | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of ``module`` trained on ``world_size`` ranks; rank 0 holds the largest FSDP2 shard.

    ``optimizers`` default to ``configure_optimizers()`` plus the callbacks' own (built here, on the unsharded
    module). ``state_tensors`` overrides the state count per optimizer class name. ``num_nodes`` (or
    ``devices_per_node``, which derives it from the world size) places ranks on nodes: DeepSpeed's estimator,
    ``shard_size='node'`` and the inter-node traffic read it; ``zero_init`` is a DeepSpeed estimator input.
    ``precision``: the run's resolved plan; None plans for the intent's precision.
    """
    return estimate_memory_many(
        module, intent, needs, [world_size], backend, rank=rank, optimizers=optimizers, callbacks=callbacks,
        state_tensors=state_tensors, num_nodes=num_nodes, zero_init=zero_init, precision=precision,
        devices_per_node=devices_per_node,
    )[0]


def estimate_memory_many(
    module: nn.Module,
    intent: ShardingIntent | Mapping[str, Any] | None = None,
    needs: MethodNeeds | None = None,
    world_sizes: Iterable[int] = (1, 2, 8, 64),
    backend: str = "fsdp2",
    *,
    rank: int = 0,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    callbacks: Sequence[object] | None = None,
    state_tensors: Mapping[str, int] | None = None,
    num_nodes: int = 1,
    zero_init: bool = True,
    precision: PrecisionPlan | None = None,
    sourced: Sequence[tuple[str, torch.optim.Optimizer]] | None = None,
    devices_per_node: int | None = None,
) -> list[MemoryEstimate]:
    """One estimate per world size; the plan and the optimizers are built once.

    ``devices_per_node``: each world size runs on world size / devices_per_node nodes (one node when smaller);
    without it, every world size runs on ``num_nodes`` nodes.

    ``sourced``: (source, optimizer) pairs from ``collect_optimizers`` already made by the caller, so that the
    user's ``configure_optimizers`` runs once (hooks may assert a single call).
    """
    intent = as_intent(intent)
    precision = precision or resolve_precision(None, intent)
    if needs is None:
        needs = inspect_needs(module, callbacks=callbacks)
    backend = _canonical_backend(backend, needs, intent, precision)
    if sourced is not None:
        sourced = list(sourced)
    elif optimizers is None:
        sourced = collect_optimizers(module, callbacks)
    else:
        sourced = [("given", o) for o in (returned_optimizers(list(optimizers)) or list(optimizers))]
    layout = _layout(module, intent, needs, backend, precision)
    estimator = get_backend(backend).memory
    out = []
    for world_size in world_sizes:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise AutoShardError(f"world sizes must be positive integers, got {world_size!r}. Fix: e.g. world_sizes=(2, 8)")
        if not 0 <= rank < world_size:
            raise AutoShardError(f"rank {rank} is not in a world of {world_size} ranks. Fix: rank= 0 to {world_size - 1}")
        nodes = num_nodes if devices_per_node is None else nodes_for(world_size, devices_per_node)
        out.append(
            estimator(
                layout, sourced, intent, world_size, rank,
                overrides=dict(state_tensors or {}), num_nodes=nodes, zero_init=zero_init,
            )
        )
    return out


def nodes_for(world_size: int, devices_per_node: int) -> int:
    """Nodes a world of ``world_size`` ranks fills, ``devices_per_node`` ranks each (one node when it is smaller)."""
    if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) or devices_per_node < 1:
        raise AutoShardError(f"devices per node must be a positive integer, got {devices_per_node!r}. Fix: e.g. --devices-per-node 8")
    if world_size <= devices_per_node:
        return 1
    if world_size % devices_per_node:
        raise AutoShardError(
            f"world size {world_size} does not fill whole nodes of {devices_per_node} devices."
            f" Fix: use a multiple of {devices_per_node} (e.g. {world_size - world_size % devices_per_node}),"
            f" or set the devices per node to what your nodes have"
        )
    return world_size // devices_per_node


def _scalar_bytes() -> int:
    return 8 if torch.get_default_dtype() == torch.float64 else 4  # torch.optim's _get_scalar_dtype


def _optimizer_bytes(
    sourced: Sequence[tuple[str, torch.optim.Optimizer]],
    layout: _Layout,
    local: Callable[[_Param], tuple[int, ...]],
    overrides: Mapping[str, int],
) -> tuple[dict[int, int], list[str], list[str]]:
    """State bytes per parameter id on this rank; states exist only for parameters that get a gradient."""
    per_param: dict[int, int] = {}
    summaries, notes = [], []
    scalar = _scalar_bytes()
    for source, optimizer in sourced:
        fn, note = _state_fn(optimizer, overrides)
        summaries.append(f"{_describe_states(optimizer, fn)} ({source})")
        if note:
            notes.append(note)
        for group in optimizer.param_groups:
            infos = [layout.params.get(id(p)) or _outside(p) for p in group["params"]]
            infos = [(id(p), info) for p, info in zip(group["params"], infos) if info.trainable]
            if fn is None:  # LBFGS: flat copies of all of the group's parameters, on the first one
                flat = sum(_n(local(i)) for _, i in infos)
                if infos:
                    pid, info = infos[0]
                    per_param[pid] = per_param.get(pid, 0) + (2 + 2 * int(group.get("history_size", 100))) * flat * info.elsize
                continue
            for pid, info in infos:
                elements, scalars = fn(group, local(info))
                per_param[pid] = per_param.get(pid, 0) + elements * info.elsize + scalars * scalar
    return per_param, summaries, notes


def _outside(p: torch.Tensor) -> _Param:
    """A parameter an optimizer holds that the module does not own: whole on every rank."""
    return _Param("<not in the module>", tuple(p.shape), p.element_size(), p.element_size(), False, False, p.requires_grad, "<not in the module>")


def _outside_param(sourced: Sequence[tuple[str, torch.optim.Optimizer]], pid: int) -> _Param | None:
    for _, optimizer in sourced:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) == pid:
                    return _outside(p)
    return None


__all__ = [
    "MemoryEstimate",
    "OPTIMIZER_STATES",
    "Traffic",
    "UnshardedPart",
    "collect_optimizers",
    "estimate_memory",
    "estimate_memory_many",
    "fmt_bytes",
    "memory_table",
    "nodes_for",
    "parse_size",
    "with_step",
    "shard_rows",
    "zero3_model_states",
]
