"""Intent -> a concrete, printable ``fully_shard`` plan, and applying it (per block, teacher like student)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.needs import EMAPair, MethodNeeds

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ParallelizeFn = Callable[[nn.Module, "DeviceMesh"], None]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_BLOCK_PARENTS = (nn.ModuleList, nn.Sequential)
PARALLELIZE_FN_HINT = "pass parallelize_fn=(module, device_mesh) -> None to shard them yourself"


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


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call: the module path and the parameters it owns (not those of deeper units)."""

    name: str
    kind: str  # "block" (element of a ModuleList/Sequential) or "subtree"
    role: str  # "trainable" or "teacher"
    numel: int
    bytes: int
    reshard_after_forward: bool
    checkpointed: bool


@dataclass(frozen=True)
class Replicated:
    """Parameters the plan leaves unsharded, and why; trainable ones get their gradients averaged across ranks."""

    name: str
    numel: int
    bytes: int
    why: str
    trainable: bool


@dataclass
class FSDP2Plan:
    """The ordered (deepest first) list of units to shard, plus what stays replicated."""

    units: list[ShardUnit]
    replicated: list[Replicated]
    ema_pairs: tuple[EMAPair, ...]
    intent: ShardingIntent
    notes: list[str] = field(default_factory=list)

    @property
    def sharded_numel(self) -> int:
        return sum(u.numel for u in self.units)

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Shard ``module`` in place on the data-parallel slice of ``mesh``; replicated grads get averaged."""
        fully_shard, _, _, _, _ = fsdp2_api()
        dp_mesh = data_parallel_mesh(mesh)
        mp_policy, offload_policy = policies(self.intent)
        scalars = {id(p) for p in module.parameters() if p.dim() == 0}
        for unit in self.units:
            sub = module.get_submodule(unit.name)
            if unit.checkpointed:
                from torch.distributed._composable import checkpoint

                checkpoint(sub)
            ignored = {p for p in sub.parameters() if id(p) in scalars}
            fully_shard(
                sub,
                mesh=dp_mesh,
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
        settings = {"backend": "fsdp2", **(mesh_info or {}), **plan_settings(self.intent)}
        lines = ["==== autoshard: FSDP2 plan ====", json.dumps(settings), f"sharded units ({len(self.units)}, deepest first):"]
        for u in self.units:
            extra = " [teacher: reshard after forward]" if u.role == "teacher" else ""
            extra += " [activation checkpointing]" if u.checkpointed else ""
            lines.append(f"  {u.name:<40} {u.kind:<8} {u.numel:>12,d} params {_mib(u.bytes):>9}{extra}")
        if self.replicated:
            lines.append(f"not sharded ({len(self.replicated)}):")
            for r in self.replicated:
                sync = "gradients averaged across ranks" if r.trainable else "frozen"
                lines.append(f"  {r.name:<40} {r.numel:>12,d} params {_mib(r.bytes):>9}  {r.why}; {sync}")
        for pair in self.ema_pairs:
            lines.append(f"EMA pair: teacher '{pair.teacher}' sharded exactly like student '{pair.student}'")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": [vars(u) for u in self.units],
            "replicated": [vars(r) for r in self.replicated],
            "ema_pairs": [vars(p) for p in self.ema_pairs],
            "settings": plan_settings(self.intent),
            "notes": list(self.notes),
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def plan_settings(intent: ShardingIntent) -> dict[str, Any]:
    return {
        "mp_policy": {"param_dtype": intent.param_dtype, "reduce_dtype": intent.reduce_dtype},
        "precision": intent.effective_precision,
        "reshard_after_forward": intent.reshard_after_forward,
        "offload": intent.offload,
        "activation_checkpointing": intent.activation_checkpointing,
        "checkpoint": intent.checkpoint,
    }


def policies(intent: ShardingIntent) -> tuple[Any, Any]:
    """FSDP2 MixedPrecisionPolicy and offload policy for the intent (offload 'optimizer' offloads params too)."""
    _, _, mixed_precision_policy, cpu_offload_policy, offload_policy = fsdp2_api()
    dtype = lambda name: getattr(torch, name) if name else None  # noqa: E731
    mp = mixed_precision_policy(param_dtype=dtype(intent.param_dtype), reduce_dtype=dtype(intent.reduce_dtype))
    if intent.offload == "none":
        return mp, offload_policy()
    if intent.offload_device != "cpu":
        raise IntentError("fsdp2 can offload to CPU only: use offload_device='cpu', or strategy='autoshard-deepspeed' for NVMe")
    return mp, cpu_offload_policy(pin_memory=torch.cuda.is_available())


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["data_parallel"] if "data_parallel" in names and len(names) > 1 else mesh


def average_unsharded_gradients(module: nn.Module, mesh: DeviceMesh) -> int:
    """Keep every trainable parameter left unsharded (probes, root or 0-dim parameters) identical across ranks.

    Each gradient is averaged once accumulated. Hooks, not ``replicate()``: callback optimizers already hold these
    very Parameter objects. Idempotent (a second setup adds no second hook); returns how many got one.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    group = mesh.get_group()
    size = dist.get_world_size(group)
    if size == 1:
        return 0

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)

    count = 0
    for p in module.parameters():
        if p.requires_grad and not isinstance(p, DTensor) and not getattr(p, "_autoshard_grad_hook", False):
            p.register_post_accumulate_grad_hook(hook)
            p._autoshard_grad_hook = True  # type: ignore[attr-defined]
            count += 1
    return count


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
            raise IntentError(f"shard names {', '.join(map(repr, missing))}, not a module of {type(root).__name__}: top-level modules are {top}")
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


def plan_fsdp2(module: nn.Module, intent: ShardingIntent | None = None, needs: MethodNeeds | None = None) -> FSDP2Plan:
    """Decide what to ``fully_shard``: every parameter-owning block, then every trainable subtree; never the root."""
    intent = intent or ShardingIntent()
    needs = needs or MethodNeeds()
    modules = dict(module.named_modules())
    names_of = _param_names(module)
    excluded = set(intent.exclude) | set(needs.callback_modules)
    excluded |= {n for n, m in modules.items() if n and _is_metric(m)}
    unknown = [p for p in intent.exclude if p not in modules]
    if unknown:
        raise IntentError(f"exclude names {', '.join(map(repr, unknown))}, not a module of {type(module).__name__}")
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
    candidates: dict[str, str] = {}
    replicated: list[Replicated] = []
    for root_path in roots:
        sub = modules[root_path]
        if not any(True for _ in sub.parameters()):
            continue
        is_teacher = _within(root_path, teachers)
        if not is_teacher and not any(p.requires_grad for p in sub.parameters()):
            if intent.shard is None:
                replicated.append(_replicated(root_path, sub.parameters(), "frozen and not an EMA teacher"))
                continue
        for name, child in sub.named_modules(prefix=root_path):
            parent = modules.get(name.rpartition(".")[0])
            if isinstance(parent, _BLOCK_PARENTS) and not isinstance(child, _CONTAINERS) and not _within(name, excluded):
                if any(True for _ in child.parameters()):
                    candidates.setdefault(name, "block")
        candidates.setdefault(root_path, "subtree")
    for path in list(candidates):
        if not exclusive(path):
            notes.append(f"'{path}' shares parameters with modules outside it (tied weights): sharded with its parent instead")
            del candidates[path]
    units = _units(modules, candidates, teachers, intent)
    covered = {id(p) for u in units for p in modules[u.name].parameters() if p.dim() > 0}
    unit_names = {u.name for u in units}
    replicated_names = {r.name for r in replicated}
    for name, p in module.named_parameters():
        if id(p) in covered or _within(name, replicated_names):
            continue
        if p.dim() == 0 and _within(name, unit_names):
            replicated.append(_replicated(name, [p], "0-dim parameter (fully_shard cannot shard scalars)"))
            replicated_names.add(name)
            continue
        owner = _outermost(name, excluded)
        if owner is not None:
            if owner not in replicated_names:
                replicated_names.add(owner)
                why = "trained by a callback's optimizer" if owner in needs.callback_modules else "excluded"
                replicated.append(_replicated(owner, modules[owner].parameters(), why))
        else:
            why = "parameter on the LightningModule root" if "." not in name else "not inside any sharded unit"
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
    root_params = [r.name for r in replicated if r.why.startswith("parameter on the")]
    if root_params:
        message = (
            f"parameters live directly on {type(module).__name__}: {', '.join(root_params)}. The generic FSDP2 plan"
            f" cannot shard them (sharding the root breaks training_steps that call children directly); they stay"
            f" replicated with averaged gradients. Fix: move them into a child module, or {PARALLELIZE_FN_HINT}"
        )
        if intent.strict:
            raise AutoShardError(message.replace("they stay replicated with averaged gradients", "strict=True refuses to replicate them"))
        warnings.warn(message, stacklevel=2)
    return FSDP2Plan(units, replicated, tuple(needs.ema_pairs), intent, notes)


def _replicated(name: str, params: Iterable[nn.Parameter], why: str) -> Replicated:
    params = list(params)
    return Replicated(
        name,
        sum(p.numel() for p in params),
        sum(p.numel() * p.element_size() for p in params),
        why,
        any(p.requires_grad for p in params),
    )


def _units(modules: dict[str, nn.Module], candidates: dict[str, str], teachers: set[str], intent: ShardingIntent) -> list[ShardUnit]:
    """Order candidates deepest first and give each the parameters no deeper unit already owns."""
    order = {name: i for i, name in enumerate(modules)}
    ordered = sorted(candidates, key=lambda n: (-n.count("."), order[n]))
    owned: set[int] = set()
    units: list[ShardUnit] = []
    for name in ordered:
        own = [p for p in modules[name].parameters() if id(p) not in owned and p.dim() > 0]
        owned.update(id(p) for p in own)
        if not own:
            continue
        teacher = _within(name, teachers)
        trainable = any(p.requires_grad for p in own)
        units.append(
            ShardUnit(
                name=name,
                kind=candidates[name],
                role="teacher" if teacher else "trainable",
                numel=sum(p.numel() for p in own),
                bytes=sum(p.numel() * p.element_size() for p in own),
                reshard_after_forward=True if teacher or not trainable else intent.reshard_after_forward,
                checkpointed=intent.activation_checkpointing and candidates[name] == "block" and trainable and not teacher,
            )
        )
    return units


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
