"""More ranks: which world sizes a run can have, and the search for the smallest that fits, shared by the
``--budget`` advice and the decision's search."""

from __future__ import annotations

from collections.abc import Callable

from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.memory import MemoryEstimate
from autoshard.mesh import hybrid_sizes

MAX_RANKS = 4096  # the search for "more ranks" stops here
DEVICES_PER_NODE = 8  # ranks per node when nothing says otherwise (one node of the world size if it is larger)


def whole_nodes(ranks: int, devices_per_node: int) -> int:
    """``ranks`` rounded up to whole nodes once it exceeds one node (6 x 2 = 12 ranks on 8-device nodes: 16)."""
    return ranks if ranks <= devices_per_node else -(-ranks // devices_per_node) * devices_per_node


def states_on_device(estimate: MemoryEstimate) -> int:
    return estimate.model_states - sum(getattr(estimate, c) for c in estimate.offloaded)


def world_sizes_after(world_size: int, devices_per_node: int | None, intent: ShardingIntent) -> list[int]:
    """World sizes above ``world_size`` a run can have: any up to one node, whole nodes beyond, and only those the
    intent's fixed shard_size divides."""
    per_node = devices_per_node or world_size
    sizes = [n for n in range(world_size + 1, per_node + 1)] + list(
        range(max(per_node, world_size) // per_node * per_node + per_node, MAX_RANKS + 1, per_node)
    )
    out = []
    for n in sorted(set(sizes)):
        try:
            hybrid_sizes(intent, n, max(1, n // per_node) if devices_per_node else 1)
        except IntentError:
            continue
        out.append(n)
    return out


def smallest_world(
    intent: ShardingIntent,
    world_size: int,
    devices_per_node: int | None,
    budget: int,
    full: Callable[[int], MemoryEstimate | None],
    states: Callable[[int], MemoryEstimate],
) -> int | None:
    """The smallest world size above ``world_size`` at which ``intent`` fits, for the advice and the decision alike:
    ``full(n)`` is its estimate with a simulated step on ``n`` ranks (None when part of the step is missing: never a
    fit), ``states(n)`` its model states alone (fast). Predicted by bisection as what does not shrink with ranks
    (activations, what stays whole) plus the states (which shrink monotonically), then confirmed with ``full`` on
    that size and the next two."""
    here = full(world_size)
    if here is None:
        return None
    sizes = world_sizes_after(world_size, devices_per_node, intent)
    rest = here.device - states_on_device(here)
    predict = lambda n: rest + states_on_device(states(n))  # noqa: E731
    if not sizes or predict(sizes[-1]) > budget:
        return None
    lo, hi = 0, len(sizes) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if predict(sizes[mid]) <= budget else (mid + 1, hi)
    fits = lambda e: e is not None and e.device <= budget  # noqa: E731
    return next((n for n in sizes[lo : lo + 3] if fits(full(n))), None)
