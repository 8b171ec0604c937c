"""Intent -> a concrete, printable ``fully_shard`` plan, and applying it (per block, teacher like student)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.needs import EMAPair, MethodNeeds
from autoshard.precision import PrecisionPlan, resolve_precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ParallelizeFn = Callable[[nn.Module, "DeviceMesh"], None]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_STACKS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# A unit costs an all-gather and a reduce-scatter per step whatever its size: repeated modules smaller than this
# share of the model (an expert of a large mixture-of-experts layer, a per-head projection) cost more in collective
# latency than they save in memory, and stay in their parent's unit.
MIN_BLOCK_FRACTION = 2**-12
# A stack whose elements differ and one of which holds more than this share of it is a hierarchy of stages (ConvNeXt,
# Swin, a U-Net level), not a list of layers: the blocks inside each stage are the units.
STAGE_FRACTION = 0.25
PARALLELIZE_FN_HINT = "pass parallelize_fn=(module, device_mesh) -> None to shard them yourself"
BUFFER_RULE = (
    "rank 0's copy is broadcast to every data-parallel rank at setup, before every training batch, at the start of"
    " validation, before every checkpoint save and at the end of fit (DDP's broadcast_buffers rule)"
)


def fsdp2_api() -> tuple[Any, Any, Any, Any, Any]:
    """fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy (public since torch 2.6)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    return fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy


def is_sharded(module: nn.Module) -> bool:
    """True when someone (the user's configure_model, or a previous setup) already applied fully_shard."""
    fsdp_module = fsdp2_api()[1]
    return any(isinstance(m, fsdp_module) for m in module.modules())


class UnitKind(str, Enum):
    """What a unit is; activation checkpointing wraps blocks only."""

    BLOCK = "block"  # one of the architecture's repeated blocks, or a module named in ShardingIntent(blocks=...)
    SUBTREE = "subtree"  # a top-level child, a ShardingIntent(shard=...) path or an EMA side: what no block took


class Role(str, Enum):
    TRAINABLE = "trainable"
    TEACHER = "teacher"


class Reshard(str, Enum):
    """A unit's ``reshard_after_forward`` and why (torchtitan's policy: reshard, except what backward needs first)."""

    AFTER_FORWARD = "resharded after forward, gathered again in backward"
    KEPT_LAST = "kept gathered after forward: the last unit in forward order, which backward needs first"
    KEPT_BEFORE_LAST = "kept gathered after forward: holds the blocks and ends its forward just before the last unit"
    KEPT_BY_INTENT = "kept gathered after forward: ShardingIntent(reshard_after_forward=False)"
    TEACHER = "resharded after forward: an EMA teacher, no backward follows its forward"
    FROZEN = "resharded after forward: no trainable parameters, no backward needs them"
    MULTI_FORWARD = "resharded after forward although last: kept, it would stay gathered through the step's next forward"
    EMA_FORWARD = "resharded after forward although last: kept, it would stay gathered through the EMA teacher's forward"

    @property
    def keeps(self) -> bool:
        return self in (Reshard.KEPT_LAST, Reshard.KEPT_BEFORE_LAST, Reshard.KEPT_BY_INTENT)


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call: the module path, the parameters it owns (not those of deeper units), and why."""

    name: str
    kind: UnitKind
    role: Role
    numel: int
    bytes: int
    reshard: Reshard
    checkpointed: bool
    why: str  # why this module is a unit

    @property
    def reshard_after_forward(self) -> bool:
        return not self.reshard.keeps

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "role": self.role.value,
            "numel": self.numel,
            "bytes": self.bytes,
            "reshard_after_forward": self.reshard_after_forward,
            "reshard": self.reshard.value,
            "checkpointed": self.checkpointed,
            "why": self.why,
        }


class Unsharded(str, Enum):
    """Why the plan leaves parameters whole on every rank (``Replicated.why``); the plan's checks compare these."""

    FROZEN = "frozen and not an EMA teacher"
    SCALAR = "0-dim parameter (fully_shard cannot shard scalars)"
    CALLBACK = "trained by a callback's optimizer"
    EXCLUDED = "excluded"
    ROOT = "parameter on the LightningModule root"
    OUTSIDE = "not inside any sharded unit"


@dataclass(frozen=True)
class Replicated:
    """Parameters the plan leaves unsharded, and why; trainable ones get their gradients averaged across ranks."""

    name: str
    numel: int
    bytes: int
    why: Unsharded
    trainable: bool


@dataclass
class FSDP2Plan:
    """The ordered (deepest first) list of units to shard, plus what stays replicated."""

    units: list[ShardUnit]
    replicated: list[Replicated]
    ema_pairs: tuple[EMAPair, ...]
    intent: ShardingIntent
    notes: list[str] = field(default_factory=list)
    buffers: dict[str, int] = field(default_factory=dict)  # name -> bytes; never sharded, kept equal by BUFFER_RULE
    sync_batchnorm: bool = False  # set by the strategy for Trainer(sync_batchnorm=True)
    precision: PrecisionPlan | None = None  # the run's resolved precision; None: the intent's (see plan_fsdp2)
    hsdp: tuple[int, int] | None = None  # (replicas, shard_size), set by the strategy (ShardingIntent.hsdp_sizes)

    @property
    def precision_plan(self) -> PrecisionPlan:
        return self.precision or resolve_precision(None, self.intent)

    @property
    def sharded_numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def buffer_rule(self) -> str:
        if not self.sync_batchnorm:
            return BUFFER_RULE
        return BUFFER_RULE + "; BatchNorm layers normalize with the statistics of the global batch (sync_batchnorm=True)"

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Shard ``module`` in place on the data-parallel slice of ``mesh`` (HSDP: that slice as (replicas, shard);
        ``hsdp_mesh``); replicated grads get averaged over every data-parallel rank, not one shard group."""
        fully_shard, _, _, _, _ = fsdp2_api()
        dp_mesh = data_parallel_mesh(mesh)
        shard_mesh = hsdp_mesh(dp_mesh, self.hsdp)
        mp_policy, offload_policy = policies(self.precision_plan, self.intent)
        scalars = {id(p) for p in module.parameters() if p.dim() == 0}
        names = {u.name for u in self.units}
        for unit in self.units:
            sub = module.get_submodule(unit.name)
            if _outermost(unit.name, names) != unit.name:  # an inner unit: see clone_view_outputs
                sub.register_forward_hook(clone_view_outputs, prepend=True)  # runs before fully_shard's own hook
            if unit.checkpointed:
                from torch.distributed._composable import checkpoint

                checkpoint(sub)
            ignored = {p for p in sub.parameters() if id(p) in scalars}
            fully_shard(
                sub,
                mesh=shard_mesh,
                reshard_after_forward=unit.reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload_policy,
                **({"ignored_params": ignored} if ignored else {}),
            )
        average_unsharded_gradients(module, dp_mesh)
        for pair in self.ema_pairs:
            check_ema_alignment(module, pair)

    def describe(self, mesh_info: dict[str, Any] | None = None) -> str:
        """The rank-0 summary: a header, one line of settings, then every unit and every replicated part."""
        lines = [
            "==== autoshard: FSDP2 plan ====",
            settings_in_words(mesh_info or {}, plan_settings(self.intent, self.precision_plan)),
            f"sharded units ({len(self.units)}, deepest first):",
        ]
        for u in self.units:
            extra = " [teacher: reshard after forward]" if u.role is Role.TEACHER else ""
            extra += " [activation checkpointing]" if u.checkpointed else ""
            gathered = "kept" if u.reshard.keeps else "reshard"
            lines.append(f"  {u.name:<40} {u.kind.value:<8} {u.numel:>12,d} params {_mib(u.bytes):>9}  {gathered:<7} {u.why}{extra}")
        lines += _reshard_lines(self.units)
        if self.replicated:
            lines.append(f"not sharded ({len(self.replicated)}):")
            for r in self.replicated:
                sync = "gradients averaged across ranks" if r.trainable else "frozen"
                lines.append(f"  {r.name:<40} {r.numel:>12,d} params {_mib(r.bytes):>9}  {r.why.value}; {sync}")
        if self.buffers:
            names = list(self.buffers)
            shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
            lines.append(f"buffers ({len(names)}, {_mib(sum(self.buffers.values()))}, not sharded): {self.buffer_rule}")
            lines.append(f"  {shown}")
        for pair in self.ema_pairs:
            lines.append(f"EMA pair: teacher '{pair.teacher}' sharded exactly like student '{pair.student}'")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": [u.to_dict() for u in self.units],
            "prefetch": PREFETCH,
            "replicated": [vars(r) for r in self.replicated],
            "ema_pairs": [vars(p) for p in self.ema_pairs],
            "buffers": {
                "names": list(self.buffers),
                "count": len(self.buffers),
                "bytes": sum(self.buffers.values()),
                "rule": self.buffer_rule,
            },
            "settings": plan_settings(self.intent, self.precision_plan),
            "notes": list(self.notes),
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


PREFETCH = (
    "FSDP2's implicit prefetch (in backward, the next unit's all-gather is issued before this one's gradients);"
    " no explicit set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: no gain measured on CPU"
    " (docs/benchmarks.md), and torchtitan sets them only for expert parallelism"
)


def _reshard_lines(units: list[ShardUnit]) -> list[str]:
    """Each reshard_after_forward choice once, with the units it applies to (a count where there are many)."""
    by_choice: dict[Reshard, list[str]] = {}
    for u in units:
        by_choice.setdefault(u.reshard, []).append(u.name)
    lines = ["reshard_after_forward:"]
    for choice, names in by_choice.items():
        shown = ", ".join(f"'{n}'" for n in names) if len(names) <= 3 else f"{len(names)} units"
        lines.append(f"  {shown}: {choice.value}")
    return [*lines, f"prefetch: {PREFETCH}"] if units else []


def plan_settings(intent: ShardingIntent, precision: PrecisionPlan) -> dict[str, Any]:
    """The plan's one-line settings; ``mp_policy`` holds the dtypes parameters are all-gathered and reduced in."""
    return {
        "mp_policy": {"param_dtype": precision.gather.value, "reduce_dtype": precision.reduce.value},
        "precision": precision.precision.value,
        "reshard_after_forward": intent.reshard_after_forward,
        "offload": intent.offload,
        "activation_checkpointing": intent.activation_checkpointing,
        "checkpoint": intent.checkpoint,
    }


def settings_in_words(mesh: dict[str, Any], settings: dict[str, Any]) -> str:
    """The plan's settings as one sentence a person reads at a glance (``to_dict()["settings"]`` keeps the fields)."""
    where = f" over {mesh['world_size']} ranks" if "world_size" in mesh else ""
    sizes = [f"{kind} parallel {mesh[f'{kind}_parallel_size']}" for kind in ("data", "tensor") if f"{kind}_parallel_size" in mesh]
    if mesh.get("hsdp"):
        replicas, shard = mesh["hsdp"]
        sizes.append(f"hybrid sharding: {replicas} replicas of {shard}-rank shard groups")
    where += f" ({', '.join(sizes)})" if sizes else ""
    mp = settings["mp_policy"]
    yes_no = {True: "yes", False: "no"}
    return (
        f"fsdp2{where}; precision {settings['precision']} (all-gather in {mp['param_dtype']}, reduce in"
        f" {mp['reduce_dtype']}); reshard after forward: {yes_no[settings['reshard_after_forward']]}; offload:"
        f" {settings['offload']}; activation checkpointing: {yes_no[settings['activation_checkpointing']]};"
        f" checkpoint: {settings['checkpoint']}"
    )


def policies(precision: PrecisionPlan, intent: ShardingIntent) -> tuple[Any, Any]:
    """FSDP2 MixedPrecisionPolicy for the precision and offload policy for the intent (offload 'optimizer' offloads params too).

    fully_shard keeps the weights in ``precision.master`` (Lightning converts the module for "-true"); a dtype
    that needs no cast is passed as None, so that FSDP2 does not cast every unit's inputs to the dtype they have.
    """
    _, _, mixed_precision_policy, cpu_offload_policy, offload_policy = fsdp2_api()
    gather = None if precision.gather is precision.master else precision.gather
    reduce = None if precision.reduce is (gather or precision.master) else precision.reduce
    mp = mixed_precision_policy(param_dtype=gather and gather.torch, reduce_dtype=reduce and reduce.torch)
    if intent.offload == "none":
        return mp, offload_policy()
    if intent.offload_device != "cpu":
        raise IntentError("fsdp2 can offload to CPU memory only. Fix: use offload_device='cpu', or strategy='autoshard-deepspeed' for NVMe")
    return mp, cpu_offload_policy(pin_memory=torch.cuda.is_available())


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["data_parallel"] if "data_parallel" in names and len(names) > 1 else mesh


HSDP_DIMS = ("dp_replicate", "dp_shard")


def hsdp_mesh(dp_mesh: DeviceMesh, sizes: tuple[int, int] | None) -> DeviceMesh:
    """The mesh ``fully_shard`` shards on: ``dp_mesh`` itself (FSDP), or for HSDP its ranks as a 2-D
    ``(replicas, shard_size)`` mesh, on which fully_shard places parameters ``(Replicate(), Shard(0))``.

    Built with ``init_device_mesh`` over the data-parallel ranks: shard groups are consecutive ranks (one node's
    under torchrun, so all-gathers and reduce-scatters stay inside it), replicas are every shard_size-th rank.
    A separate mesh, so Lightning's (data_parallel, tensor_parallel) mesh stays as it is for everything else
    (sampler, buffers, unsharded gradients, sync_batchnorm: all over every data-parallel rank). HSDP with tensor
    parallel is refused by the intent, so the data-parallel ranks are the whole world here.
    """
    if sizes is None:
        return dp_mesh
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shard = sizes
    if replicas * shard != dp_mesh.size() or dp_mesh.size() != dist.get_world_size():
        raise AutoShardError(
            f"hybrid sharding {replicas} x {shard} needs the {dp_mesh.size()} data-parallel ranks to be the whole world"
            f" ({dist.get_world_size()}) and {replicas} x {shard} of them. Fix: set tensor_parallel_size=1 and a shard_size"
            f" that divides the data-parallel size"
        )
    return init_device_mesh(dp_mesh.device_type, (replicas, shard), mesh_dim_names=HSDP_DIMS)


def clone_view_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """Inner units hand their outputs to the next unit: one that is a view (T5's position bias) would lose
    fully_shard's pre-backward hook on an in-place op downstream, so FSDP2 warns; a copy has no such hazard.

    Only inner units: their view outputs seen so far are small (T5: heads x tokens x tokens, independent of the
    batch). An outermost unit's view output (BERT's logits) would cost a full copy at the peak, so FSDP2's warning
    stands there: do not modify those outputs in place.
    """
    if not torch.is_grad_enabled():
        return output
    import torch.utils._pytree as pytree

    is_view = lambda t: isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None  # noqa: E731
    if not any(is_view(t) for t in pytree.tree_leaves(output)):
        return output
    return pytree.tree_map(lambda t: t.clone() if is_view(t) else t, output)


GRAD_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default
_UNSHARDED_GRADS = "_autoshard_unsharded_grads"
_ARMS = "_autoshard_arms_grad_average"  # on an FSDP unit: its forward hook queues the reduction (UnshardedGradients.arm)


def average_unsharded_gradients(module: nn.Module, mesh: DeviceMesh, bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """Keep every trainable parameter left unsharded (probes, root or 0-dim parameters) identical across ranks.

    Their gradients are averaged over ``mesh``: every data-parallel rank (1-D; under HSDP Lightning's data-parallel
    slice, never one shard group, or the replicas would drift apart), once per backward, coalesced into buckets of
    ``bucket_bytes`` as DDP does (see UnshardedGradients). Hooks, not ``replicate()``: callback optimizers already hold
    these very Parameter objects. Idempotent (a second setup adds no second hook, and the hooks reduce over the newest
    mesh); returns how many parameters got a hook.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    group = mesh.get_group()
    if dist.get_world_size(group) == 1:
        return 0
    state: UnshardedGradients | None = getattr(module, _UNSHARDED_GRADS, None)
    if state is None:
        state = UnshardedGradients(group, bucket_bytes)
        object.__setattr__(module, _UNSHARDED_GRADS, state)  # not a submodule, not a buffer
    state.group, state.bucket_bytes, state.buckets = group, bucket_bytes, None
    # nn.Embedding(sparse=True): a sparse gradient cannot join a flat bucket; it keeps its own all_reduce.
    sparse = {id(p) for m in module.modules() if getattr(m, "sparse", False) is True for p in m.parameters(recurse=False)}
    count = 0
    for name, p in module.named_parameters():
        if p.requires_grad and not isinstance(p, DTensor) and not getattr(p, "_autoshard_grad_hook", False):
            if id(p) in sparse:
                p.register_post_accumulate_grad_hook(state.reduce_alone)
                p._autoshard_grad_hook = True  # type: ignore[attr-defined]
            else:
                owner, _, attr = name.rpartition(".")
                state.params.append(p)
                state.homes.append((module.get_submodule(owner), attr))
                state.hook(p)
            count += 1
    fsdp_module = fsdp2_api()[1]
    for unit in module.modules():
        if state.params and isinstance(unit, fsdp_module) and not getattr(unit, _ARMS, False):
            unit.register_forward_hook(state.arm)
            object.__setattr__(unit, _ARMS, True)
    return count


@dataclass(eq=False)
class UnshardedGradients:
    """One module's unsharded trainable parameters, whose gradients are averaged at the end of each backward.

    The backward's first gradient of one of them, or of an FSDP unit's output, queues one reduction at its end (the
    autograd engine's final callback, where DDP and FSDP2 finish too): it sees every gradient of that backward, once.
    Every registered parameter goes into the same buckets in the same order on every rank, whether this rank's
    backward reached it or not (zeros then), with one flag per parameter riding in the bucket: every rank issues the
    same all_reduces (one per bucket), so a parameter only some ranks used (a data-dependent branch) neither hangs the
    others nor gets paired with the wrong tensor, and gets the average of what the ranks computed (DDP's
    find_unused_parameters); one no rank reached keeps its gradient as it was (None stays None: optimizers still skip
    it). The unit outputs make a rank whose backward reached none of these parameters reduce too, whenever it reached
    the sharded model (as FSDP2 itself needs every rank to); a backward that reaches neither on any rank issues nothing.

    Each backward of an accumulated step is reduced (Lightning's per-micro-batch rule for the sharded units too): the
    sum of averaged micro-batches is the average of the sums, and the gradients agree across ranks at every point.
    """

    group: Any
    bucket_bytes: int
    params: list[nn.Parameter] = field(default_factory=list)
    homes: list[tuple[nn.Module, str]] = field(default_factory=list)  # (owning module, attribute) of each, see refresh
    buckets: list[list[nn.Parameter]] | None = None  # grad_buckets(params), kept until a parameter is replaced
    _touched: set[int] = field(default_factory=set)  # ids of the parameters whose gradient grew since the last reduction
    _queued: set[int] = field(default_factory=set)  # graph tasks (backwards) whose end will reduce

    def hook(self, param: nn.Parameter) -> None:
        param.register_post_accumulate_grad_hook(self.touched)
        param._autoshard_grad_hook = True  # type: ignore[attr-defined]

    def touched(self, param: torch.Tensor) -> None:
        self._touched.add(id(param))
        self.queue()

    def arm(self, unit: nn.Module, args: Any, output: Any) -> None:
        """An FSDP unit's forward hook: the gradient of any of its outputs queues the reduction of that backward."""
        if torch.is_grad_enabled():
            import torch.utils._pytree as pytree

            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad: self.queue())

    def queue(self) -> None:
        task = torch._C._current_graph_task_id()
        if task not in self._queued:  # by task, not a flag: a backward that raised never ran its callback
            self._queued.add(task)
            engine = torch.autograd.Variable._execution_engine
            # Queued again from the engine's callback, so it runs behind every callback queued during the backward:
            # FSDP2's final one reduce-scatters units whose inputs needed no grad, and which hook came first differs
            # by rank when their backwards differ; collectives must not.
            engine.queue_callback(lambda: engine.queue_callback(lambda: self.reduce(task)))

    def reduce(self, task: int) -> None:
        adopted = self.refresh()
        touched = self._touched | {id(p) for p in self.params if id(p) in adopted and p.grad is not None}
        self._touched = set()
        self._queued.discard(task)
        if adopted or self.buckets is None:
            self.buckets = grad_buckets(self.params, self.bucket_bytes)
        average_gradients(self.buckets, touched, self.group)

    def refresh(self) -> set[int]:
        """The parameters the module holds now; returns the ids of those it did not hold at registration.

        Materializing meta parameters (``to_empty``, in Lightning's setup after sharding) or ``load_state_dict(assign=
        True)`` puts new Parameter objects in the module, without the hooks: each gets one here, at its home, so the
        order stays the same on every rank. Its gradient so far was never averaged: it counts as reached. A home
        that now holds a sharded parameter leaves the buckets, on every rank alike.
        """
        from torch.distributed.tensor import DTensor

        adopted: set[int] = set()
        for i, (owner, attr) in enumerate(self.homes):
            p = owner._parameters.get(attr)  # getattr would go through Module.__getattr__: 10x slower, per parameter
            if isinstance(p, nn.Parameter) and p is not self.params[i]:
                self.params[i] = p
                adopted.add(id(p))
                if not isinstance(p, DTensor) and not getattr(p, "_autoshard_grad_hook", False):
                    self.hook(p)
        if adopted:
            kept = [i for i, p in enumerate(self.params) if not isinstance(p, DTensor)]
            self.params, self.homes = [self.params[i] for i in kept], [self.homes[i] for i in kept]
        return adopted

    def reduce_alone(self, param: torch.Tensor) -> None:
        import torch.distributed as dist

        if param.grad is not None:
            dist.all_reduce(param.grad, group=self.group)
            param.grad.div_(dist.get_world_size(self.group))


def grad_buckets(params: Iterable[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` in order, by dtype and device, cut into buckets of at most ``bucket_bytes`` (a larger parameter gets
    one of its own): a layout that depends on the parameters only, so every rank builds the same one."""
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}
    for p in params:
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        own = buckets.setdefault(key, [[]])
        if own[-1] and filled[key] + nbytes > bucket_bytes:
            own.append([])
            filled[key] = 0
        own[-1].append(p)
        filled[key] = filled.get(key, 0) + nbytes
    return [bucket for own in buckets.values() for bucket in own]


def average_gradients(buckets: list[list[nn.Parameter]], touched: AbstractSet[int], group: Any) -> int:
    """Average the gradients of the parameters in ``buckets`` (grad_buckets) over ``group`` (``touched``: ids of those
    this rank's backward reached), one all_reduce per bucket; returns how many. Two buckets in flight at most: bucket
    k+1 is flattened while k is reduced.

    Each rank contributes its gradient, or zeros where it has none, so the result is the average whatever each rank
    accumulated before (the earlier micro-batches are already equal on every rank), plus a 1.0 flag where its backward
    reached the parameter: a flag sum above 0 means some rank did, and only those gradients are written back.
    Flattening, unflattening and the copies back are one call each (torch's own, as DDP's coalesced helpers use): with
    hundreds of small parameters a Python loop of tensor ops costs more than the all_reduce saved.
    """
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors

    size = dist.get_world_size(group)
    # A fake process group (activations.py's simulated step) has no other ranks and its fake tensors no values to read:
    # every rank is this one there.
    fake = dist.get_backend(group) == "fake"
    pending: tuple[list[nn.Parameter], list[torch.Tensor], torch.Tensor, Any] | None = None
    for bucket in buckets:
        flags = torch.tensor([1.0 if id(p) in touched else 0.0 for p in bucket], dtype=bucket[0].dtype, device=bucket[0].device)
        parts = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = _flatten_dense_tensors([*parts, flags])
        work = dist.all_reduce(flat, group=group, async_op=True)
        if pending is not None:
            _write_back(*pending, size, fake, touched)
        pending = (bucket, [*parts, flags], flat, work)
    if pending is not None:
        _write_back(*pending, size, fake, touched)
    return len(buckets)


def _write_back(
    bucket: list[nn.Parameter], parts: list[torch.Tensor], flat: torch.Tensor, work: Any, size: int, fake: bool, touched: AbstractSet[int]
) -> None:
    """Wait for one bucket's all_reduce and write the averages of the parameters some rank reached into their grads."""
    from torch._utils import _unflatten_dense_tensors

    work.wait()
    flat.div_(size)
    *averages, flags = _unflatten_dense_tensors(flat, parts)
    reached = [id(p) in touched for p in bucket] if fake else (flags > 0).tolist()
    into, values = [], []
    for p, used, average in zip(bucket, reached, averages):
        if not used:
            continue
        if p.grad is None:  # this rank's backward did not reach it, another's did
            p.grad = torch.empty_like(p).copy_(average)
        else:
            into.append(p.grad)
            values.append(average)
    if into:
        torch._foreach_copy_(into, values)


_BUCKET_BYTES = 250 * 2**20  # DDP's bucket size for module states


def _broadcast_from_first(tensors: list[torch.Tensor], group: Any) -> None:
    """Overwrite ``tensors`` in place with the group's first rank's copy, coalesced in buckets (what DDP uses)."""
    import torch.distributed as dist

    if tensors and dist.get_world_size(group) > 1:
        dist._broadcast_coalesced(group, tensors, _BUCKET_BYTES, 0)


def broadcast_unsharded(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every rank starts from rank 0's copy of whatever is not sharded, as DDP does at construction.

    Without a common seed each rank initialized its own random values, and nothing reconciles them later: what the
    plan keeps whole (root, tied, excluded, 0-dim parameters) only gets averaged gradients, buffers get nothing.
    Plain tensors go from the data-parallel group's first rank; a DTensor along each mesh dimension it is replicated
    on (HSDP or tensor-parallel replicas). Shard placements need nothing: fully_shard keeps chunk r of rank r's own
    init, so without a seed the whole parameter is rank 0's rows, then rank 1's, ...: independent draws from the
    same distribution, hence still a valid init of the whole parameter (and an EMA teacher's chunk r is cut from
    the same rank's copy of its student, so the pair still agrees).
    """
    from torch.distributed.tensor import DTensor

    dp_group = data_parallel_mesh(mesh).get_group()
    by_group: dict[Any, list[torch.Tensor]] = {dp_group: []}
    for t in (*module.parameters(), *module.buffers()):
        if not isinstance(t, DTensor):
            by_group[dp_group].append(t.detach())
            continue
        for dim, placement in enumerate(t.placements):
            if placement.is_replicate():
                by_group.setdefault(t.device_mesh.get_group(dim), []).append(t.to_local().detach())
    for group, tensors in by_group.items():
        _broadcast_from_first(tensors, group)


def sync_buffers(module: nn.Module, mesh: DeviceMesh) -> None:
    """Rank 0's buffers on every data-parallel rank: BUFFER_RULE, DDP's ``broadcast_buffers=True``.

    Buffers updated in forward (BatchNorm running statistics, a centering buffer) drift apart per rank, and a
    checkpoint would keep whichever rank's copy it happened to write. One coalesced broadcast: buffers are small.
    """
    from torch.distributed.tensor import DTensor

    plain = [b.detach() for b in module.buffers() if not isinstance(b, DTensor)]
    _broadcast_from_first(plain, data_parallel_mesh(mesh).get_group())


class _PerShardCPURandom:
    """DTensor's RNG tracker for CPU meshes (see ``per_shard_random_init``); implements what DTensor dispatch calls."""

    distribute_region_enabled = True

    @contextmanager
    def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        seed = int(torch.randint(2**62, (), generator=generator))  # the same draw on ranks that share a seed
        coordinate, shard = spec.mesh.get_coordinate(), 0
        for dim, placement in enumerate(spec.placements):
            if placement.is_shard():
                shard = shard * spec.mesh.size(dim) + coordinate[dim]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + shard)
            yield


@contextmanager
def per_shard_random_init(mesh: DeviceMesh) -> Iterator[None]:
    """While meta shards are materialized on CPU, give each shard its own random values, as the whole parameter has.

    DTensor offsets its random stream per shard only on CUDA-like devices: torch's OffsetBasedRNGTracker refuses
    CPU, whose Mersenne-Twister generator has no Philox offset to advance. So on CPU ``reset_parameters()`` runs on
    each local shard with the rank's own generator, and ranks that share a seed (seed_everything) get identical
    shards: rows 0-15 of a weight equal rows 16-31. Here each DTensor random op draws one seed from the generator
    and runs on a generator seeded with it plus the shard's index: distinct shards differ, replicas of one shard
    agree, and every rank's generator advances alike. The values are not a single-process init's, but each shard
    is an independent draw from the same distribution. Installed only for CPU meshes and removed after; CUDA keeps
    torch's own tracker.
    """
    from torch.distributed.tensor import _random

    if mesh.device_type != "cpu" or _random._rng_tracker is not None:
        yield
        return
    _random._rng_tracker = _PerShardCPURandom()  # type: ignore[assignment]
    try:
        yield
    finally:
        _random._rng_tracker = None


def _param_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _is_metric(module: nn.Module) -> bool:
    return any(cls.__module__.startswith("torchmetrics") and cls.__name__ == "Metric" for cls in type(module).__mro__)


def _outermost(path: str, prefixes: AbstractSet[str]) -> str | None:
    """The shortest of ``prefixes`` that is ``path`` or a dotted ancestor of it; a walk up the path, not a scan."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if candidate in prefixes:
            return candidate
    return None


def _within(path: str, prefixes: AbstractSet[str]) -> bool:
    return _outermost(path, prefixes) is not None


def _subtree_roots(root: nn.Module, shard: tuple[str, ...] | None) -> list[str]:
    """Top-level children (ModuleList/ModuleDict containers expanded), or the user's explicit paths."""
    if shard is not None:
        modules = dict(root.named_modules())
        missing = [p for p in shard if p not in modules]
        if missing:
            top = ", ".join(n for n, _ in root.named_children())
            raise IntentError(
                f"shard names {', '.join(map(repr, missing))}, not a module of {type(root).__name__}: top-level modules"
                f" are {top}. Fix: name module paths as printed by `print(model)`, e.g. shard=['{next(iter(top.split(', ')), 'backbone')}']"
            )
        return list(shard)
    out: list[str] = []

    def expand(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS):
                expand(child, path + ".")
            else:
                out.append(path)

    expand(root, "")
    return out


def plan_fsdp2(
    module: nn.Module, intent: ShardingIntent | None = None, needs: MethodNeeds | None = None, precision: PrecisionPlan | None = None
) -> FSDP2Plan:
    """Decide what to ``fully_shard``: every parameter-owning block, then every trainable subtree; never the root.

    ``precision``: the run's resolved plan (the strategy's, from the Trainer); None plans for the intent's.
    """
    intent = intent or ShardingIntent()
    needs = needs or MethodNeeds()
    modules = dict(module.named_modules())
    names_of = _param_names(module)
    excluded = set(intent.exclude) | set(needs.callback_modules)
    excluded |= {n for n, m in modules.items() if n and _is_metric(m)}
    unknown = [p for p in intent.exclude if p not in modules]
    if unknown:
        top = ", ".join(n for n, _ in module.named_children())
        raise IntentError(
            f"exclude names {', '.join(map(repr, unknown))}, not a module of {type(module).__name__}: top-level modules"
            f" are {top}. Fix: name module paths as printed by `print(model)`, or drop them from exclude"
        )
    teachers = {p.teacher for p in needs.ema_pairs}
    for pair in needs.ema_pairs:
        check_ema_structure(module, pair)

    def exclusive(path: str) -> bool:
        """A unit may not share a parameter (tied weights) with anything outside it."""
        inside = {path}
        return all(_within(n, inside) for p in modules[path].parameters() for n in names_of[id(p)])

    roots = [r for r in _subtree_roots(module, intent.shard) if not _within(r, excluded)]
    roots += [m for p in needs.ema_pairs for m in (p.teacher, p.student) if m not in roots and not _within(m, excluded)]
    notes: list[str] = []
    candidates: dict[str, tuple[UnitKind, str]] = {}
    replicated: list[Replicated] = []
    planned: list[str] = []
    for root_path in roots:
        sub = modules[root_path]
        if not any(True for _ in sub.parameters()):
            continue
        is_teacher = _within(root_path, teachers)
        if not is_teacher and not any(p.requires_grad for p in sub.parameters()):
            if intent.shard is None:
                replicated.append(_replicated(root_path, sub.parameters(), Unsharded.FROZEN))
                continue
        planned.append(root_path)
    inside = set(planned)
    for name, why in _blocks(module, intent.blocks, modules).items():
        if _within(name, inside) and not _within(name, excluded):
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
    units = _units(modules, candidates, teachers, intent, needs, names_of)
    covered = {id(p) for u in units for p in modules[u.name].parameters() if p.dim() > 0}
    unit_names = {u.name for u in units}
    replicated_names = {r.name for r in replicated}
    for name, p in module.named_parameters():
        if id(p) in covered or _within(name, replicated_names):
            continue
        if p.dim() == 0 and _within(name, unit_names):
            replicated.append(_replicated(name, [p], Unsharded.SCALAR))
            replicated_names.add(name)
            continue
        owner = _outermost(name, excluded)
        if owner is not None:
            if owner not in replicated_names:
                replicated_names.add(owner)
                why = Unsharded.CALLBACK if owner in needs.callback_modules else Unsharded.EXCLUDED
                replicated.append(_replicated(owner, modules[owner].parameters(), why))
        else:
            why = Unsharded.ROOT if "." not in name else Unsharded.OUTSIDE
            replicated.append(_replicated(name, [p], why))
            replicated_names.add(name)
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
        warnings.warn(message, stacklevel=2)
    buffers = {name: b.numel() * b.element_size() for name, b in module.named_buffers()}
    return FSDP2Plan(units, replicated, tuple(needs.ema_pairs), intent, notes, buffers, precision=precision)


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
) -> list[ShardUnit]:
    """Order candidates deepest first, give each the parameters no deeper unit already owns, choose its resharding."""
    order = {name: i for i, name in enumerate(modules)}
    owned: set[int] = set()
    found: list[tuple[str, list[nn.Parameter]]] = []
    for name in sorted(candidates, key=lambda n: (-n.count("."), order[n])):
        own = [p for p in modules[name].parameters() if id(p) not in owned and p.dim() > 0]
        owned.update(id(p) for p in own)
        if own:
            found.append((name, own))
    kept = _ending_forward(found, candidates, teachers, order)
    units: list[ShardUnit] = []
    for name, own in found:
        kind, why = candidates[name]
        teacher = _within(name, teachers)
        trainable = any(p.requires_grad for p in own)
        units.append(
            ShardUnit(
                name=name,
                kind=kind,
                role=Role.TEACHER if teacher else Role.TRAINABLE,
                numel=sum(p.numel() for p in own),
                bytes=sum(p.numel() * p.element_size() for p in own),
                reshard=_reshard(kept.get(name), teacher, trainable, intent, needs),
                checkpointed=intent.activation_checkpointing and kind is UnitKind.BLOCK and trainable and not teacher,
                why=why + _tied(own, names_of),
            )
        )
    return units


def _ending_forward(
    found: list[tuple[str, list[nn.Parameter]]], candidates: dict[str, tuple[UnitKind, str]], teachers: set[str], order: dict[str, int]
) -> dict[str, Reshard]:
    """The trainable units that end the forward, which backward needs first: the outermost unit registered last, and
    the one before it when it holds blocks (a ``model`` + ``head`` split: the final norm runs just before the head).

    Units nested in another end their forward before it; among the outermost ones, registration order is the
    forward order of every model we know (HF, timm, torchvision, Lightning examples). A wrong guess costs the
    memory of a unit kept gathered, never correctness.
    """
    names = {name for name, _ in found}
    outermost = sorted(
        (name for name, own in found if _outermost(name, names) == name and not _within(name, teachers) and any(p.requires_grad for p in own)),
        key=order.__getitem__,
    )
    if not outermost:
        return {}
    kept = {outermost[-1]: Reshard.KEPT_LAST}
    holders = {_outermost(n, names) for n in names if candidates[n][0] is UnitKind.BLOCK and _outermost(n, names) != n}
    if len(outermost) > 1 and outermost[-2] in holders:
        kept[outermost[-2]] = Reshard.KEPT_BEFORE_LAST
    return kept


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


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _repeat_key(module: nn.Module) -> object:
    """Siblings with equal keys repeat: modules with children by class (ResNet's first Bottleneck, with its
    downsample, is still a Bottleneck), leaves by class and parameter shapes (an MLP's two Linears differ)."""
    if next(module.children(), None) is not None:
        return type(module)
    return type(module), tuple(tuple(p.shape) for p in module.parameters())


def _structure(module: nn.Module) -> tuple[object, ...]:
    return type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def _repeated(module: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """The parameter-owning elements of a ModuleList / Sequential / ModuleDict that repeat a sibling, in order, with
    their parameter counts."""
    if not isinstance(module, _STACKS):
        return []
    sizes = {name: (child, _numel(child)) for name, child in module.named_children()}
    keys = {name: _repeat_key(child) for name, (child, numel) in sizes.items() if numel}
    counts: dict[object, int] = {}
    for key in keys.values():
        counts[key] = counts.get(key, 0) + 1
    return [(name, *sizes[name]) for name, key in keys.items() if counts[key] > 1]


def _find_blocks(module: nn.Module, path: str, min_numel: float) -> dict[str, str]:
    """Block paths under ``module`` (at ``path``) and why each is one: the elements of the outermost stacks of
    repeated modules, without looking inside them (T5's sub-layers, an MLP's Linears stay in their block)."""
    elements = _repeated(module)
    found = _stack_blocks(path, elements, min_numel) if elements else {}
    taken = {name for name, _, _ in elements}
    for name, child in module.named_children():
        if name not in taken:
            found.update(_find_blocks(child, f"{path}.{name}" if path else name, min_numel))
    return found


def _stack_blocks(path: str, elements: list[tuple[str, nn.Module, int]], min_numel: float) -> dict[str, str]:
    """The blocks of one stack: its elements, or, for a hierarchy of stages, the blocks inside each stage."""
    sizes = [numel for _, _, numel in elements]
    if min(sizes) < min_numel:
        return {}
    paths = [f"{path}.{name}" if path else name for name, _, _ in elements]
    found = {p: f"{type(m).__name__} {i} of {len(elements)} in {path}" for i, (p, (_, m, _)) in enumerate(zip(paths, elements), 1)}
    if max(sizes) > STAGE_FRACTION * sum(sizes) and len({_structure(m) for _, m, _ in elements}) > 1:
        stages = f"; the elements of {path} are stages (the largest holds {max(sizes) / sum(sizes):.0%} of it)"
        for p, (_, m, _) in zip(paths, elements):
            inner = _find_blocks(m, p, min_numel)
            if inner:
                del found[p]
                found.update({name: why + stages for name, why in inner.items()})
    return found


def _blocks(module: nn.Module, named: tuple[str, ...] | None, modules: dict[str, nn.Module]) -> dict[str, str]:
    """The block units: the modules ``ShardingIntent(blocks=...)`` names (class names or paths), else those found."""
    if named is None:
        return _find_blocks(module, "", _numel(module) * MIN_BLOCK_FRACTION)
    classes = {type(m).__name__ for m in modules.values()}
    unknown = [b for b in named if b not in modules and b not in classes]
    if unknown:
        found = sorted({type(modules[p]).__name__ for p in _blocks(module, None, modules)})
        raise IntentError(
            f"blocks names {', '.join(map(repr, unknown))}: neither a module path nor a module class of"
            f" {type(module).__name__} (repeated blocks found: {', '.join(found) or 'none'}). Fix: name block classes"
            f" or module paths as printed by `print(model)`, e.g. blocks=[{(found or ['Block'])[0]!r}]"
        )
    wanted = set(named)
    return {
        name: f"named in ShardingIntent(blocks=...) as {name if name in wanted else type(m).__name__}"
        for name, m in modules.items()
        if name and (name in wanted or type(m).__name__ in wanted) and _numel(m)
    }


def _describe_param(p: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    info: dict[str, Any] = {"shape": tuple(p.shape), "dtype": p.dtype, "dtensor": isinstance(p, DTensor)}
    if isinstance(p, DTensor):
        info["placements"] = tuple(p.placements)
        info["mesh"] = (p.device_mesh.device_type, tuple(p.device_mesh.mesh.flatten().tolist()))
    return info


def check_ema_structure(module: nn.Module, pair: EMAPair) -> None:
    """Before sharding: the positional EMA zip needs the same parameter count, shapes and dtypes, in order."""
    _compare(module, pair, keys=("shape", "dtype"), when="structure")


def check_ema_alignment(module: nn.Module, pair: EMAPair) -> None:
    """After sharding: count, shape, dtype, DTensor-ness, placements and mesh must all match, position by position."""
    _compare(module, pair, keys=("shape", "dtype", "dtensor", "placements", "mesh"), when="sharding")


def _compare(module: nn.Module, pair: EMAPair, keys: tuple[str, ...], when: str) -> None:
    teacher = list(module.get_submodule(pair.teacher).named_parameters())
    student = list(module.get_submodule(pair.student).named_parameters())
    fix = (
        "Fix: build the teacher as copy.deepcopy(student) and let autoshard shard both, or apply identical"
        " fully_shard calls to both in your parallelize_fn"
    )
    head = f"EMA teacher '{pair.teacher}' and student '{pair.student}' differ in {when}"
    if len(teacher) != len(student):
        raise AutoShardError(f"{head}: {len(teacher)} vs {len(student)} parameters, so the positional EMA update would pair the wrong tensors. {fix}")
    for i, ((tn, tp), (sn, sp)) in enumerate(zip(teacher, student)):
        t, s = _describe_param(tp), _describe_param(sp)
        for key in keys:
            if t.get(key) != s.get(key):
                raise AutoShardError(f"{head}: parameter #{i} ('{tn}' vs '{sn}') has {key} {t.get(key)} vs {s.get(key)}. {fix}")
