"""What a backend's memory model reads and returns: the layout of a module under a plan, optimizer state sizes,
and the per-rank estimate (below ``backends/``, whose ``memory`` functions compute from these)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autoshard.precision import PrecisionPlan

if TYPE_CHECKING:
    from autoshard.intent import ShardingIntent
    from autoshard.mesh import ParallelDims

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_states", "ema_teacher", "unsharded")
LABELS = {
    "parameters": "parameters (sharded)",
    "gradients": "gradients (sharded)",
    "optimizer_states": "optimizer states (sharded)",
    "ema_teacher": "EMA teacher (sharded)",
    "unsharded": "unsharded (whole on every rank)",
}


# -- optimizer states ---------------------------------------------------------------------------------------------
StateFn = Callable[[Mapping[str, Any], tuple[int, ...]], tuple[int, int]]
"""(param group, local shape) -> (elements of state in the parameter's dtype, number of float32 scalar tensors)."""


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _per_param(tensors: int, scalars: int = 1) -> StateFn:
    return lambda group, shape: (tensors * numel(shape), scalars)


def _adam(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    return (3 if group.get("amsgrad") else 2) * numel(shape), 1  # exp_avg, exp_avg_sq (+ max_exp_avg_sq), step


def _sgd(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    return (numel(shape) if group.get("momentum", 0) else 0), 0  # momentum_buffer only when momentum != 0


def _rmsprop(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    k = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))  # square_avg (+ momentum_buffer, grad_avg)
    return k * numel(shape), 1


def _adafactor(group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) > 1:  # factored second moment: one row vector and one column vector per matrix
        return numel(shape[:-1]) + numel(shape[:-2]) * shape[-1], 1
    return numel(shape), 1


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


@dataclass(frozen=True)
class Param:
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
class Unit:
    """One sharded unit as memory and traffic see it: bytes all-gathered, gradient bytes reduced."""

    name: str
    gathered: int  # bytes of its parameters in the gather dtype
    reduced: int  # bytes of its trainable parameters' gradients in the reduce dtype
    reshard_after_forward: bool
    teacher: bool  # forwarded without backward: gathered once, nothing reduced


@dataclass
class Layout:
    params: dict[int, Param]
    units: list[Unit]
    whys: dict[str, str]
    notes: list[str]
    largest_layer_params: int  # DeepSpeed's notion: most parameters owned directly by one module
    precision: PrecisionPlan  # as the backend runs it (autoshard.backends.on_backend)
    recomputed: tuple[str, ...] = ()  # without a plan (DeepSpeed): the checkpointed blocks, forwarded again in backward


@dataclass(frozen=True)
class RankInputs:
    """What a backend's estimator (``Backend.memory(layout, inputs)``) reads besides the layout: the optimizers (as
    ``memory.collect_optimizers`` found them), the intent, the resolved layout of the ranks it shards over, which rank,
    the nodes they fill, per-class state counts that override the built-in ones, DeepSpeed's ``zero_init``, and the
    zero_optimization keys the user set (``zero_overrides``: the sizes DeepSpeed's estimate reads from them)."""

    sourced: Sequence[tuple[str, torch.optim.Optimizer]]
    intent: ShardingIntent
    dims: ParallelDims
    rank: int = 0
    num_nodes: int = 1
    overrides: Mapping[str, int] = field(default_factory=dict)
    zero_init: bool = True
    zero_overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.dims.world_size


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` holds under FSDP2's Shard(0): chunks of ceil(rows / N), the tail short or empty."""
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk))


def local_shape(p: Param, world_size: int, rank: int) -> tuple[int, ...]:
    return (shard_rows(p.shape[0], world_size, rank), *p.shape[1:]) if p.sharded and p.shape else p.shape


# -- the estimate ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in one collective kind per training step (ring algorithms: (g - 1) / g of the data);
    ``inter_node``: the group spans nodes, so these bytes cross the slower links."""

    collective: str
    group: int
    bytes: int
    inter_node: bool


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, by category; ``offloaded`` names the categories that live in CPU memory. For ZeRO-3,
    ``device`` and ``host`` are DeepSpeed's own estimator figures."""

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
            model_states=self.model_states,
            total=self.total,
            device=self.device,
            ideal=self.ideal,
            other_at_peak=self.other_at_peak,
            inter_node_bytes=self.inter_node_bytes,
            intra_node_bytes=self.intra_node_bytes,
        )
        return out


def _scalar_bytes() -> int:
    return 8 if torch.get_default_dtype() == torch.float64 else 4  # torch.optim's _get_scalar_dtype


def optimizer_bytes(
    sourced: Sequence[tuple[str, torch.optim.Optimizer]],
    layout: Layout,
    local: Callable[[Param], tuple[int, ...]],
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
                flat = sum(numel(local(i)) for _, i in infos)
                if infos:
                    pid, info = infos[0]
                    per_param[pid] = per_param.get(pid, 0) + (2 + 2 * int(group.get("history_size", 100))) * flat * info.elsize
                continue
            for pid, info in infos:
                elements, scalars = fn(group, local(info))
                per_param[pid] = per_param.get(pid, 0) + elements * info.elsize + scalars * scalar
    return per_param, summaries, notes


def _outside(p: torch.Tensor) -> Param:
    """A parameter an optimizer holds that the module does not own: whole on every rank."""
    return Param("<not in the module>", tuple(p.shape), p.element_size(), p.element_size(), False, False, p.requires_grad, "<not in the module>")


def outside_param(sourced: Sequence[tuple[str, torch.optim.Optimizer]], pid: int) -> Param | None:
    for _, optimizer in sourced:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) == pid:
                    return _outside(p)
    return None
