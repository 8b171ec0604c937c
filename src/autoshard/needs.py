"""What a LightningModule (plus its callbacks) needs from a sharding backend, found by looking, never by changing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoShardError, did_you_mean
from autoshard.privates import in_torch

NEEDS_ATTRIBUTE = "autoshard_needs"
CALLBACK_OPTIMIZERS_ATTRIBUTE = "autoshard_optimizers"
CONFIGURE_OPTIMIZERS = "configure_optimizers"


@dataclass(frozen=True)
class EMAPair:
    """A teacher updated from a student by a positional zip over their parameters (DINO, BYOL, MoCo...)."""

    teacher: str
    student: str


@dataclass(frozen=True)
class MethodNeeds:
    """The method's requirements; a module may declare them (``autoshard_needs = {...}``) and that wins.
    ``callback_modules``: trained by callback-owned optimizers, kept unsharded; ``compiled``: the eager paths of
    modules the user compiled."""

    optimizer_sources: tuple[tuple[str, int], ...] = (("configure_optimizers", 1),)
    ema_pairs: tuple[EMAPair, ...] = ()
    manual_optimization: bool = False
    multi_forward: bool = False
    root_parameters: tuple[str, ...] = ()
    callback_modules: tuple[str, ...] = ()
    compiled: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Users declare needs by hand with lists and plain tuples; store tuples so the value stays hashable.
        set_ = object.__setattr__
        sources = tuple((str(where), _count(f"the optimizer count of {where!r}", n)) for where, n in self.optimizer_sources)
        set_(self, "optimizer_sources", sources)
        set_(self, "ema_pairs", tuple(_ema_pair(p) for p in self.ema_pairs))
        for name in ("root_parameters", "callback_modules", "compiled"):
            value = getattr(self, name)
            set_(self, name, (value,) if isinstance(value, str) else tuple(value))

    @property
    def num_optimizers(self) -> int:
        return sum(count for _, count in self.optimizer_sources)

    def describe_optimizers(self) -> str:
        """Where the optimizers come from, e.g. "1 from configure_optimizers, 1 from callback OnlineProbe"."""
        return ", ".join(f"{count} from {where}" for where, count in self.optimizer_sources if count) or "none"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["num_optimizers"] = self.num_optimizers
        return out


def _count(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AutoShardError(f"{what} must be a whole number (0 or more), got {value!r}")
    return value


def _ema_pair(value: object) -> EMAPair:
    if isinstance(value, EMAPair):
        return value
    if isinstance(value, Mapping) and set(value) == {"teacher", "student"}:
        return EMAPair(str(value["teacher"]), str(value["student"]))
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return EMAPair(*value)
    raise AutoShardError(f"an EMA pair is ('teacher.path', 'student.path') or {{'teacher': ..., 'student': ...}}, got {value!r}")


# The one place that knows where optimizers hide: needs, memory estimates and checkpoints all find them here.
def returned_optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers in any shape ``configure_optimizers`` returns or ``trainer.optimizers`` holds, in order
    (Lightning's ``_MockOptimizer`` stand-in for ``None`` is no optimizer)."""
    configured = getattr(configured, "_optimizer", configured)  # LightningOptimizer
    if configured is None or type(configured).__name__ == "_MockOptimizer":
        return []
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return returned_optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and all(isinstance(part, (list, tuple)) for part in configured):
            return returned_optimizers(configured[0])  # ([optimizers], [schedulers])
        return [o for item in configured for o in returned_optimizers(item)]
    return []


def held_optimizers(obj: object) -> list[torch.optim.Optimizer]:
    """The optimizers an object (a callback) holds as attributes, directly or one level down in a list, tuple or
    dict, each once: an online probe's ``self.optimizer``, or ``self.optimizers = [...]``."""
    found: dict[int, torch.optim.Optimizer] = {}
    for value in getattr(obj, "__dict__", {}).values():
        values = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else (value,)
        found.update((id(o), o) for v in values for o in returned_optimizers(v))
    return list(found.values())


def _modules_owning(root: nn.Module, param_ids: set[int]) -> list[str]:
    """Outermost submodules of ``root`` whose parameters all belong to ``param_ids``."""
    owned: list[str] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in owned):
            continue
        params = list(module.parameters())
        if params and all(id(p) in param_ids for p in params):
            owned.append(name)
    return owned


def modules_trained_by(root: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The outermost submodules of ``root`` all of whose parameters ``optimizer`` trains: what it owns, by module path
    (the rule that finds the modules callback optimizers train; Fabric names each optimizer's modules with it)."""
    return _modules_owning(root, {id(p) for group in optimizer.param_groups for p in group["params"]})


def _callback_needs(root: nn.Module, callbacks: Iterable[object]) -> tuple[list[tuple[str, int]], list[str], set[int]]:
    """Optimizers each callback owns (found, or declared as ``autoshard_optimizers = N``), the modules they train,
    and the ids of the optimizers callbacks hold (one that Lightning also returns is counted once, as the callback's)."""
    sources: list[tuple[str, int]] = []
    param_ids: set[int] = set()
    held: set[int] = set()
    module_ids = {id(m): n for n, m in root.named_modules() if n}
    attached: list[str] = []
    for callback in callbacks:
        optimizers = held_optimizers(callback)
        held.update(id(o) for o in optimizers)
        declared = getattr(callback, CALLBACK_OPTIMIZERS_ATTRIBUTE, None)
        name = type(callback).__name__
        count = len(optimizers) if declared is None else _count(f"{name}.{CALLBACK_OPTIMIZERS_ATTRIBUTE}", declared)
        if count:
            sources.append((f"callback {name}", count))
        for optimizer in optimizers:
            param_ids.update(id(p) for group in optimizer.param_groups for p in group["params"])
        if count:
            attached.extend(module_ids[id(v)] for v in getattr(callback, "__dict__", {}).values() if id(v) in module_ids)
    modules = _modules_owning(root, param_ids) if param_ids else []
    modules += [m for m in attached if m not in modules and not any(m.startswith(o + ".") for o in modules)]
    return sources, modules, held


@dataclass
class _Tally:
    count: int = 0
    numel: int = 0
    frozen: bool = True


def _tally(root: nn.Module) -> dict[str, _Tally]:
    """Parameter count, size and frozenness of every subtree, in one post-order pass."""
    out: dict[str, _Tally] = {}

    def visit(module: nn.Module, name: str) -> _Tally:
        tally = _Tally()
        for p in module._parameters.values():
            if p is not None:
                tally.count += 1
                tally.numel += _numel(p)
                tally.frozen &= not p.requires_grad
        for child_name, child in module._modules.items():
            if child is None:
                continue
            sub = visit(child, f"{name}.{child_name}" if name else child_name)
            tally.count += sub.count
            tally.numel += sub.numel
            tally.frozen &= sub.frozen
        out[name] = tally
        return tally

    visit(root, "")
    return out


# ZeRO-3 leaves an empty placeholder in each partitioned parameter and keeps the real size in ds_shape / ds_numel
# (configure_model runs under zero.Init); a DTensor from fully_shard already reports its global shape.
def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _signature(module: nn.Module) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((_shape(p), p.dtype) for p in module.parameters())


def find_ema_pairs(root: nn.Module) -> list[EMAPair]:
    """Teacher/student pairs: siblings named teacher/student, or a frozen subtree mirroring a trainable one."""
    modules = dict(root.named_modules())
    pairs: list[EMAPair] = []
    for name, module in modules.items():
        children = dict(module.named_children())
        if "teacher" in children and "student" in children:
            prefix = f"{name}." if name else ""
            pairs.append(EMAPair(f"{prefix}teacher", f"{prefix}student"))
    tallies = _tally(root)
    taken = {p.teacher for p in pairs} | {p.student for p in pairs}

    def inside_taken(path: str) -> bool:
        return any(path == t or path.startswith(t + ".") for t in taken)

    def pairable(path: str) -> bool:
        """A whole model, not a layer: leaves and stack elements (a frozen norm, frozen early blocks) never pair."""
        parent = modules[path.rpartition(".")[0]]
        return bool(modules[path]._modules) and not isinstance(parent, (nn.ModuleList, nn.Sequential))

    trainable_by_size: dict[tuple[int, int], list[str]] = {}
    for other, t in tallies.items():
        if other and not t.frozen:
            trainable_by_size.setdefault((t.count, t.numel), []).append(other)
    for name, tally in tallies.items():
        if not name or not tally.count or not tally.frozen or inside_taken(name):
            continue
        parent = name.rpartition(".")[0]
        if tallies[parent].frozen or not pairable(name):
            continue  # only the outermost frozen subtree, and only whole models
        signature = None
        candidates = sorted(
            trainable_by_size.get((tally.count, tally.numel), ()),
            key=lambda other: (other.rpartition(".")[0] != parent, other.count("."), other),
        )
        for other in candidates:
            if inside_taken(other) or other.startswith(name + ".") or name.startswith(other + ".") or not pairable(other):
                continue
            signature = signature or _signature(modules[name])
            if _signature(modules[other]) == signature:
                pairs.append(EMAPair(name, other))
                taken.update((name, other))
                break
    return pairs


_DECLARABLE = ("optimizers", "ema_pairs", "manual_optimization", "multi_forward", "callback_modules")


def _declared(module: nn.Module) -> MethodNeeds | Mapping[str, Any] | None:
    """The module's own statement of its needs, checked key by key so that a typo is not silently ignored."""
    declared = getattr(module, NEEDS_ATTRIBUTE, None)
    if declared is None or isinstance(declared, MethodNeeds):
        return declared
    if not isinstance(declared, Mapping):
        raise AutoShardError(
            f"{type(module).__name__}.{NEEDS_ATTRIBUTE} must be a MethodNeeds or a dict such as"
            f" {{'optimizers': 2, 'multi_forward': True}}, got {type(declared).__name__}"
        )
    unknown = sorted(set(declared) - set(_DECLARABLE), key=str)
    if unknown:
        hints = "".join(f" {key!r}{did_you_mean(key, _DECLARABLE)}" for key in unknown)
        raise AutoShardError(f"unknown key(s) in {type(module).__name__}.{NEEDS_ATTRIBUTE}:{hints}. Valid keys are {', '.join(_DECLARABLE)}")
    if "optimizers" in declared:
        _count(f"{NEEDS_ATTRIBUTE}['optimizers']", declared["optimizers"])
    for key in ("manual_optimization", "multi_forward"):
        if key in declared and not isinstance(declared[key], bool):
            raise AutoShardError(f"{NEEDS_ATTRIBUTE}[{key!r}] must be True or False, got {declared[key]!r}")
    return declared


def _apply_declared(detected: MethodNeeds, declared: Mapping[str, Any]) -> MethodNeeds:
    """Detected needs with the declared keys put over them; callback optimizers still count."""
    changes: dict[str, Any] = {}
    if "optimizers" in declared:
        others = tuple(src for src in detected.optimizer_sources if not src[0].startswith(CONFIGURE_OPTIMIZERS))
        changes["optimizer_sources"] = (("declared", declared["optimizers"]), *others)
    for key in ("ema_pairs", "manual_optimization", "multi_forward", "callback_modules"):
        if key in declared:
            changes[key] = declared[key]
    return dataclasses.replace(detected, **changes)


def _configured_optimizers(module: nn.Module) -> int:
    """Call the user's configure_optimizers once, only to count what it returns. Offline only: during fit no user
    hook is called to inspect it, because hooks may count their calls (stable-pretraining's probes assert one)."""
    try:
        return len(returned_optimizers(module.configure_optimizers()))
    except Exception as exc:  # the user's hook may need state we do not have; say how to skip it
        raise AutoShardError(
            f"autoshard could not count optimizers: {type(module).__name__}.configure_optimizers() raised"
            f" {type(exc).__name__}: {str(exc).rstrip('.')}. Declare them instead: set `{NEEDS_ATTRIBUTE} = {{'optimizers': N}}`"
            f" on the module"
        ) from exc


def _configure_optimizers_source(module: nn.Module) -> str:
    """ "configure_optimizers", saying so when it was replaced on the instance: probe callbacks append theirs there."""
    if CONFIGURE_OPTIMIZERS in vars(module):
        return f"{CONFIGURE_OPTIMIZERS} (wrapped on the instance, as probe callbacks do)"
    return CONFIGURE_OPTIMIZERS


def callbacks_of(module: nn.Module, trainer: Any = None, callbacks: Sequence[object] | None = None) -> list[object]:
    """``callbacks`` if given, else the Trainer's (``trainer``, else the one ``module`` is attached to), else none."""
    if callbacks is not None:
        return list(callbacks)
    trainer = trainer if trainer is not None else getattr(module, "_trainer", None)
    return list(getattr(trainer, "callbacks", None) or [])


def _optimizer_sources(
    module: nn.Module,
    declared: Mapping[str, Any] | None,
    callback_sources: list[tuple[str, int]],
    held: set[int],
    optimizers: Sequence[Any] | None,
    call_hooks: bool,
) -> list[tuple[str, int]]:
    if declared and "optimizers" in declared:
        return list(callback_sources)  # _apply_declared puts the declared count first
    if optimizers is not None:
        mine = [o for o in returned_optimizers(list(optimizers)) if id(o) not in held]
        return [(_configure_optimizers_source(module), len(mine)), *callback_sources]
    if call_hooks and callable(getattr(module, CONFIGURE_OPTIMIZERS, None)):
        return [(_configure_optimizers_source(module), _configured_optimizers(module)), *callback_sources]
    return list(callback_sources)


COMPILED_ATTRIBUTE = "autoshard_compiled"  # set by autoshard.adapters.compile on a module it unwrapped from torch.compile
ORIG_MOD = "_orig_mod"  # the attribute of torch.compile's OptimizedModule holding the module: a path segment to drop


def eager_name(name: str) -> str:
    """A parameter or module path without torch.compile's ``_orig_mod`` segments: the name in an eager model."""
    return ".".join(p for p in name.split(".") if p != ORIG_MOD)


def compiled_modules(module: nn.Module) -> tuple[str, ...]:
    """The eager paths of the modules the user compiled (wrapped, in place, or unwrapped by autoshard), outermost
    first; a module inside a compiled one is not listed again."""
    wrapper = in_torch.compile_wrapper()
    found: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, wrapper) or in_torch.compiled_in_place(sub) or getattr(sub, COMPILED_ATTRIBUTE, None) is not None:
            path = eager_name(name)
            if not any(path == f or path.startswith(f + ".") or not f for f in found):
                found.append(path)
    return tuple(found)


def inspect_needs(
    module: nn.Module,
    trainer: Any = None,
    callbacks: Sequence[object] | None = None,
    *,
    optimizers: Sequence[Any] | None = None,
    call_hooks: bool = True,
) -> MethodNeeds:
    """Find what ``module`` needs; the callbacks (``callbacks``, else ``trainer``'s, else the attached Trainer's) add theirs.

    A declared ``autoshard_needs`` wins (a dict overrides only the keys it names). ``configure_optimizers`` is called
    once to count unless ``optimizers`` (Lightning's own call's result) is given or ``call_hooks=False`` (during fit).
    """
    declared = _declared(module)
    if isinstance(declared, MethodNeeds):
        return declared
    callback_sources, callback_modules, held = _callback_needs(module, callbacks_of(module, trainer, callbacks))
    detected = MethodNeeds(
        optimizer_sources=tuple(_optimizer_sources(module, declared, callback_sources, held, optimizers, call_hooks)),
        ema_pairs=tuple(find_ema_pairs(module)),
        manual_optimization=getattr(module, "automatic_optimization", True) is False,
        root_parameters=tuple(n for n, _ in module.named_parameters(recurse=False)),
        callback_modules=tuple(callback_modules),
        compiled=compiled_modules(module),
    )
    return _apply_declared(detected, declared) if declared else detected


def recount_optimizers(
    needs: MethodNeeds, module: nn.Module, optimizers: Sequence[Any], trainer: Any = None, callbacks: Sequence[object] | None = None
) -> MethodNeeds:
    """``needs`` with its optimizers counted from what Lightning's own configure_optimizers call returned; only the
    count changes."""
    declared = _declared(module)
    if isinstance(declared, MethodNeeds):
        return needs
    callback_sources, _, held = _callback_needs(module, callbacks_of(module, trainer, callbacks))
    sources = _optimizer_sources(module, declared, callback_sources, held, optimizers, call_hooks=False)
    if declared and "optimizers" in declared:
        sources.insert(0, ("declared", declared["optimizers"]))
    return dataclasses.replace(needs, optimizer_sources=tuple(sources))
