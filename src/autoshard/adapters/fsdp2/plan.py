"""The FSDP2 plan: the units to ``fully_shard`` (deepest first) and why, what stays whole, and how it reads.

Decided by ``planner.plan_fsdp2``; applied by ``FSDP2Plan.apply`` (``apply.apply_plan``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from torch import nn

from autoshard.adapters.checkpointing import CheckpointMode, describe_checkpointing
from autoshard.adapters.fsdp2.apply import apply_plan
from autoshard.adapters.fsdp2.runtime import BUFFER_RULE
from autoshard.intent import ShardingIntent
from autoshard.needs import EMAPair
from autoshard.precision import PrecisionPlan, resolve_precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autoshard.adapters.tp_plan import TPPlan
    from autoshard.mesh import ParallelMesh

ParallelizeFn = Callable[[nn.Module, "DeviceMesh"], None]
PARALLELIZE_FN_HINT = "pass parallelize_fn=(module, device_mesh) -> None to shard them yourself"


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
    NORM = "BatchNorm parameter, kept in float32 (its kernels take no low-precision weight with float32 running statistics)"
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
    sync_batchnorm: bool = False  # Trainer(sync_batchnorm=True), stated in the summary
    precision: PrecisionPlan | None = None  # the run's resolved precision; None: the intent's (see plan_fsdp2)
    hsdp: tuple[int, int] | None = None  # (replicas, shard_size) of the resolved dims, for a plain DeviceMesh given to apply; None: pure FSDP
    tp_plan: TPPlan | None = None  # the model's tensor-parallel layout, applied first when tensor_parallel_size > 1
    compiled: tuple[str, ...] = ()  # modules compiled in place before fully_shard (adapters.compile), units in unit order
    forward_order: str = ""  # where the order choosing what stays gathered after forward came from (adapters.forward_trace)

    @property
    def whole_in_units(self) -> list[str]:
        """Parameters inside a unit that fully_shard leaves whole (its ``ignored_params``): scalars, and BatchNorm's
        under a low-precision gather."""
        return [r.name for r in self.replicated if r.why in (Unsharded.SCALAR, Unsharded.NORM)]

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

    def apply(self, module: nn.Module, mesh: DeviceMesh | ParallelMesh) -> ParallelMesh:
        """Shard ``module`` in place on ``mesh``: the model's tensor-parallel layout first (``tp_plan``), then every
        unit on the data-parallel dims of the same mesh (``apply.apply_plan``); returns the ParallelMesh used."""
        return apply_plan(self, module, mesh)

    def describe(self, mesh_info: dict[str, Any] | None = None) -> str:
        """The rank-0 summary: a header, one line of settings, then every unit and every replicated part."""
        lines = [
            "==== autoshard: FSDP2 plan ====",
            settings_in_words(mesh_info or {}, plan_settings(self.intent, self.precision_plan)),
            f"sharded units ({len(self.units)}, deepest first):",
        ]
        mode, candidate = CheckpointMode.of(self.intent.activation_checkpointing), 0
        for u in self.units:
            extra = " [teacher: reshard after forward]" if u.role is Role.TEACHER else ""
            if u.checkpointed:  # a candidate block: the mode says which of them, by their order (apply_plan does the same)
                extra += " [activation checkpointing]" if mode.applies_to(candidate) else ""
                candidate += 1
            extra += " [compiled]" if u.name in self.compiled else ""
            gathered = "kept" if u.reshard.keeps else "reshard"
            lines.append(f"  {u.name:<40} {u.kind.value:<8} {u.numel:>12,d} params {_mib(u.bytes):>9}  {gathered:<7} {u.why}{extra}")
        lines += _reshard_lines(self.units, self.forward_order)
        units = {u.name for u in self.units}
        if self.compiled:
            inside = [p for p in self.compiled if p not in units]
            lines.append(
                f"torch.compile: {len(self.compiled)} module(s) compiled in place after activation checkpointing, before"
                f" fully_shard" + (f"; whole: {', '.join(inside)}" if inside else "")
            )
        if self.tp_plan is not None:
            rows = self.tp_plan.rows()
            lines.append(
                f"tensor parallel, laid out before fully_shard ({len(rows)} modules; every other parameter of the plan's"
                f" modules is whole on each tensor-parallel rank):"
            )
            lines += [f"  {path:<40} {style}" for path, style in rows]
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
            "compiled": list(self.compiled),
            "forward_order": self.forward_order,
            **({"tensor_parallel": [{"module": m, "style": s} for m, s in self.tp_plan.rows()]} if self.tp_plan is not None else {}),
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


PREFETCH = (
    "FSDP2's implicit prefetch (in backward, the next unit's all-gather is issued before this one's gradients);"
    " no explicit set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: no gain measured on CPU"
    " (docs/benchmarks.md), and torchtitan sets them only for expert parallelism"
)


def _reshard_lines(units: list[ShardUnit], forward_order: str = "") -> list[str]:
    """Each reshard_after_forward choice once, with the units it applies to (a count where there are many), after
    where the forward order came from."""
    by_choice: dict[Reshard, list[str]] = {}
    for u in units:
        by_choice.setdefault(u.reshard, []).append(u.name)
    lines = ["reshard_after_forward" + (f" (forward order: {forward_order})" if forward_order else "") + ":"]
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
        f" {settings['offload']}; activation checkpointing: {describe_checkpointing(settings['activation_checkpointing'])};"
        f" checkpoint: {settings['checkpoint']}"
    )
