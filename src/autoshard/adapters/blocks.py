"""The repeated blocks of an architecture, the subtrees to shard, and module-path helpers: pure functions of the
module tree, for every backend."""

from __future__ import annotations

from collections import Counter
from collections.abc import Set as AbstractSet

from torch import nn

from autoshard.errors import IntentError

CONTAINERS = (nn.ModuleList, nn.ModuleDict)
STACKS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# A unit costs an all-gather and a reduce-scatter per step whatever its size: repeated modules smaller than this
# share of the model (an expert of a large mixture-of-experts layer, a per-head projection) cost more in collective
# latency than they save in memory, and stay in their parent's unit.
MIN_BLOCK_FRACTION = 2**-12
# A stack whose elements differ and one of which holds more than this share of it is a hierarchy of stages (ConvNeXt,
# Swin, a U-Net level), not a list of layers: the blocks inside each stage are the units.
STAGE_FRACTION = 0.25


def param_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def is_metric(module: nn.Module) -> bool:
    return any(cls.__module__.startswith("torchmetrics") and cls.__name__ == "Metric" for cls in type(module).__mro__)


def outermost(path: str, prefixes: AbstractSet[str]) -> str | None:
    """The shortest of ``prefixes`` that is ``path`` or a dotted ancestor of it; a walk up the path, not a scan."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if candidate in prefixes:
            return candidate
    return None


def within(path: str, prefixes: AbstractSet[str]) -> bool:
    return outermost(path, prefixes) is not None


def subtree_roots(root: nn.Module, shard: tuple[str, ...] | None) -> list[str]:
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
            if isinstance(child, CONTAINERS):
                expand(child, path + ".")
            else:
                out.append(path)

    expand(root, "")
    return out


def param_count(module: nn.Module) -> int:
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
    if not isinstance(module, STACKS):
        return []
    sizes = {name: (child, param_count(child)) for name, child in module.named_children()}
    keys = {name: _repeat_key(child) for name, (child, numel) in sizes.items() if numel}
    counts = Counter(keys.values())
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


def block_units(module: nn.Module, named: tuple[str, ...] | None, modules: dict[str, nn.Module]) -> dict[str, str]:
    """The block units: the modules ``ShardingIntent(blocks=...)`` names (class names or paths), else those found."""
    if named is None:
        return _find_blocks(module, "", param_count(module) * MIN_BLOCK_FRACTION)
    classes = {type(m).__name__ for m in modules.values()}
    unknown = [b for b in named if b not in modules and b not in classes]
    if unknown:
        found = sorted({type(modules[p]).__name__ for p in block_units(module, None, modules)})
        raise IntentError(
            f"blocks names {', '.join(map(repr, unknown))}: neither a module path nor a module class of"
            f" {type(module).__name__} (repeated blocks found: {', '.join(found) or 'none'}). Fix: name block classes"
            f" or module paths as printed by `print(model)`, e.g. blocks=[{(found or ['Block'])[0]!r}]"
        )
    wanted = set(named)
    return {
        name: f"named in ShardingIntent(blocks=...) as {name if name in wanted else type(m).__name__}"
        for name, m in modules.items()
        if name and (name in wanted or type(m).__name__ in wanted) and param_count(m)
    }
