"""``ShardingIntent(memory_budget=...)``: ``decide``, the cheapest configuration whose simulated peak fits (by the cost
order of ``autoshard.budget.search``), or a refusal naming what would fit; ``auto_entries`` for explain."""

# The decision is made on one micro-batch, as ``training_step`` receives it. Never on ``example_input_array``: a
# forward alone is a lower bound of a step's peak, so a decision on it could choose a configuration that runs out of
# memory. Never on model states alone either: activations are most of a step's peak on the models we know.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.backends import get_backend, load
from autoshard.budget.batch import batch_function, batch_rows, largest_micro_batch
from autoshard.budget.decision import BudgetDecision, BudgetRefusedError, Headroom, Rates, default_rates, describe_config, free_fields, headroom_for
from autoshard.budget.meta import meta_factory
from autoshard.budget.ranks import DEVICES_PER_NODE, MAX_RANKS, smallest_world
from autoshard.budget.search import search_configs
from autoshard.budget.simulator import ModelStates, Simulator, Subject
from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.memory import fmt_bytes
from autoshard.mesh import check_num_nodes, check_world_size, nodes_for


def decide(
    module: Any,
    batch: Any,
    intent: ShardingIntent,
    world_size: int,
    *,
    backend: str = "fsdp2",
    budget: str | int | None = None,
    device_type: str | None = None,
    options: DecideOptions | None = None,
) -> BudgetDecision:
    """The cheapest configuration whose simulated peak per rank fits ``intent.memory_budget`` (or ``budget``) on
    ``world_size`` ranks: a pure function of the module's and the batch's shapes (``batch``: one micro-batch, or a
    function returning one), the intent and the world; fields the user set are kept. On CUDA (``device_type`` None:
    this machine's) the peak leaves ``CUDA_HEADROOM`` free. Refuses (``BudgetRefusedError``) when nothing fits.

    Beside a live process group the simulated steps run in a forked child, or, once CUDA is initialised (a forked
    child cannot use it), in this process with the live registry parked. Never in this process on a CPU run:
    DTensor's caches compare meshes by ranks, dims and device type, so a fake CPU mesh equal to the live one served
    the live run its fake groups (2 gloo ranks: the trained parameters ended on the fake mesh).
    """
    import torch.distributed as dist

    question = Question(module, batch, intent, world_size, backend, budget, device_type, options or DecideOptions())
    if dist.is_available() and dist.is_initialized() and not torch.cuda.is_initialized():
        return _beside_live_group(lambda: _answer(question))
    return _answer(question)


@dataclass(frozen=True)
class DecideOptions:
    """How ``decide`` places and prices the run beyond its world size; larger world sizes come in whole nodes."""

    num_nodes: int = 1
    devices_per_node: int | None = None
    precision: Any = None
    callbacks: Sequence[Any] = ()
    rates: Rates | None = None
    progress: Callable[[str], None] | None = None
    zero_overrides: Mapping[str, Any] | None = None  # DeepSpeed: the strategy's zero_optimization keys (sizes its estimate reads)


@dataclass(frozen=True)
class Question:
    """What ``decide`` was asked (its arguments, as given): answered in this process or in a forked child."""

    module: Any
    batch: Any
    intent: ShardingIntent
    world_size: int
    backend: str
    budget: str | int | None
    device_type: str | None
    options: DecideOptions


@dataclass(frozen=True)
class _Limit:
    """The budget in bytes, the largest peak it admits (``limit``) with the device's headroom, and the backend."""

    budget: int
    limit: int
    headroom: Headroom
    backend: str


def _device_type(given: str | None) -> str:
    """The type of the device the run trains on (this machine's when None): ``'cuda:0'`` and ``torch.device('cuda')``
    are ``'cuda'``, whose headroom the budget keeps; a name torch does not know (``'gpu'``) is refused, not priced as
    a device without headroom."""
    if given is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(given).type
    except (RuntimeError, TypeError, ValueError):
        fix = "'cuda'" if str(given).strip().lower().startswith("gpu") else "'cuda' or 'cpu'"
        raise IntentError(
            f"decide(device_type={given!r}): not a device type torch knows; it says which headroom the budget keeps free"
            f" beside the tensors. Fix: device_type={fix} (or leave it out for this machine's)"
        ) from None


def _limit(q: Question) -> _Limit:
    """The budget checked against the question, or refused in words."""
    from autoshard.units import parse_size

    intent = q.intent
    budget_bytes = parse_size(q.budget, option="memory_budget", example="70GiB", error=IntentError) if q.budget is not None else intent.memory_budget
    if budget_bytes is None:
        raise IntentError("decide needs a memory budget. Fix: ShardingIntent(memory_budget='70GiB'), or decide(..., budget='70GiB')")
    check_world_size(q.world_size)
    if intent.tensor_parallel_size > 1:
        raise IntentError(
            f"memory_budget with tensor_parallel_size={intent.tensor_parallel_size} is not decided yet: the simulated step runs"
            f" data parallel only. Fix: drop memory_budget and set the fields yourself, or set tensor_parallel_size=1"
        )
    backend = _check_budget_backend(intent.replace(memory_budget=budget_bytes, memory_headroom=None), q.backend)
    device_type = _device_type(q.device_type)
    headroom = headroom_for(intent, device_type)
    limit = headroom.limit(budget_bytes)
    if limit < 1:
        raise IntentError(
            f"memory_budget {fmt_bytes(budget_bytes)} per rank is less than the {headroom.words()} a {device_type} run keeps free"
            f" beside its tensors (CUDA context, communication buffers, allocator fragmentation). Fix: memory_budget of the"
            f" whole device, or memory_headroom=0 to let tensors fill the budget"
        )
    return _Limit(budget_bytes, limit, headroom, backend)


def _answer(q: Question) -> BudgetDecision:
    from autoshard.activations import describe_batch
    from autoshard.precision import PrecisionPlan, resolve_precision

    limit, o = _limit(q), q.options
    make_batch = batch_function(q.batch)
    rates = o.rates or default_rates()
    # a resolved plan, or what a Trainer takes (precision="bf16-mixed"), resolved with the intent as a Trainer's is
    precision = o.precision if isinstance(o.precision, PrecisionPlan) else resolve_precision(o.precision, q.intent)
    world_size, num_nodes, devices_per_node = q.world_size, o.num_nodes, o.devices_per_node
    check_num_nodes(world_size, num_nodes)
    if devices_per_node is None:  # larger world sizes come in whole nodes: of these ranks, or of a usual 8-GPU node
        devices_per_node = world_size // num_nodes if num_nodes > 1 else max(world_size, DEVICES_PER_NODE)
    if num_nodes == 1:
        num_nodes = nodes_for(world_size, devices_per_node)
    base = q.intent.replace(memory_budget=None, memory_headroom=None, pinned=())
    subject = Subject.build(meta_factory(q.module, o.callbacks))
    states = ModelStates(subject, limit.backend, precision, devices_per_node, num_nodes, zero_overrides=o.zero_overrides)
    sim = Simulator(states, make_batch, base, o.progress)
    with torch.device("meta"):
        shapes = describe_batch(make_batch())
    free = free_fields(q.intent, num_nodes, limit.backend)
    kept = _kept(q.intent, free, limit.backend)
    blocks = sim.blocks() if "activation_checkpointing" in free else 0
    words = "the budget" if limit.limit == limit.budget else f"the {fmt_bytes(limit.limit)} left after the headroom"
    chosen, cheaper, most = search_configs(sim, world_size, limit.limit, rates, free, blocks, words)
    if chosen is not None:
        return BudgetDecision(
            limit.budget,
            world_size,
            chosen.config,
            chosen.peak,
            chosen.cost,
            cheaper,
            shapes,
            kept,
            rates,
            num_nodes,
            limit.backend,
            limit.headroom,
            chosen.at,
        )
    raise _refusal(sim, most, world_size, limit, shapes)


def _refusal(sim: Simulator, most: dict[str, Any], world_size: int, limit: _Limit, described: str) -> BudgetRefusedError:
    """Nothing fits: the smallest world size at which the most saving configuration does, else the largest
    micro-batch that fits here, else neither, in words."""
    num_nodes, budget_bytes = sim.num_nodes, limit.budget
    estimate = sim.step(most, world_size)[0]
    peak, at = estimate.device, f" (at: {estimate.step_at})" if estimate.step_at else ""
    choices = get_backend(limit.backend).budget
    assert choices is not None  # _check_budget_backend refused a backend without one
    where = f"world size {world_size}" + (f" ({num_nodes} nodes)" if num_nodes > 1 else "")
    head = (
        f"memory_budget {fmt_bytes(budget_bytes)} per rank"
        + (f" (a peak of {fmt_bytes(limit.limit)} with its {limit.headroom.words()})" if limit.limit != budget_bytes else "")
        + f" cannot be met at {where}"
        + (f" under {choices.peaks}" if choices.peaks else "")
        + f": even {describe_config(most)} peaks at {fmt_bytes(peak)} per rank{at} on the micro-batch {described}"
        + (f" ({choices.limits})" if choices.limits else "")
    )
    full, states = (lambda n: sim.step(most, n)[0]), (lambda n: sim.states(most, n))
    smallest = smallest_world(sim.base.replace(**most), world_size, sim.devices_per_node, limit.limit, full, states)
    if smallest is not None:
        return BudgetRefusedError(
            f"{head}. The smallest world size at which a configuration fits is {smallest} (found by search: model states"
            f" shrink with ranks, activations do not). Fix: run on {smallest} ranks (Trainer(devices=..., num_nodes=...)),"
            f" or raise memory_budget to {fmt_bytes(limit.headroom.budget_for(peak))}",
            smallest,
        )
    rows = batch_rows(sim.make_batch)
    smaller = _smaller_batch(sim, most, world_size, limit.limit, rows)
    tail = f"no world size up to {MAX_RANKS} fits: activations and what stays whole do not shrink with ranks"
    if smaller is not None:
        n, fits_at = smaller
        return BudgetRefusedError(
            f"{head}; {tail}. A micro-batch of {n} (was {rows}) fits here with {describe_config(most)} (peak {fmt_bytes(fits_at)})."
            f" Fix: DataLoader(batch_size={n}) with Trainer(accumulate_grad_batches={rows // n}) keeps the global batch",
            None,
            n,
        )
    return BudgetRefusedError(
        f"{head}; {tail}, and no smaller micro-batch fits either"
        + ("" if rows else " (the batch's tensors do not share dim 0, so none was tried)")
        + ". Fix: a smaller model or sequence, or devices with more memory",
        None,
    )


def _smaller_batch(sim: Simulator, config: dict[str, Any], world_size: int, budget: int, rows: int | None) -> tuple[int, int] | None:
    """(rows, peak) of the largest micro-batch that fits with ``config`` (``batch.largest_micro_batch``); None when
    none does, the batch cannot be cut, or a cut batch's step cannot run."""
    if not rows or rows < 2:
        return None
    try:
        divisor, estimate = largest_micro_batch(rows, budget, lambda d: sim.step(config, world_size, d)[0])
    except AutoShardError:
        return None
    return (rows // divisor, estimate.device) if estimate is not None and estimate.device <= budget else None


def _check_budget_backend(intent: ShardingIntent, backend: str) -> str:
    """Refuse a memory budget on a backend it cannot decide for, or an intent that backend cannot run; returns the backend's canonical name."""
    chosen = get_backend(backend)
    if chosen.budget is None:
        raise IntentError(f"memory_budget decides for fsdp2 and DeepSpeed ZeRO-3, not {chosen.name}. Fix: backend='fsdp2'")
    if chosen.budget.check:  # what the backend cannot run (ZeRO-3: tensor parallel, selective checkpointing), in the matrix's words
        load(chosen.budget.check)(intent)
    return chosen.name


def _kept(intent: ShardingIntent, free: list[str], backend: str) -> tuple[str, ...]:
    """The fields the decision leaves as the user set them (those the backend's budget has no say in are not named)."""
    fields = get_backend(backend).budget.fields  # type: ignore[union-attr]
    return tuple(f for f in fields if f not in free and (f != "shard_size" or intent.shard_size is not None))


def _beside_live_group(run: Callable[[], BudgetDecision]) -> BudgetDecision:
    """``run()`` in a forked child (``activations.in_detached_world``); errors come back as the same types."""
    from autoshard.activations import in_detached_world

    answer = in_detached_world(lambda: run().to_dict())
    if "error" in answer:
        error = answer["error"]
        if error["type"] == BudgetRefusedError.__name__:
            raise BudgetRefusedError(error["message"], error.get("min_world_size"), error.get("micro_batch"))
        raise (IntentError if error["type"] == IntentError.__name__ else AutoShardError)(error["message"])
    return BudgetDecision.from_dict(answer["result"])


def auto_entries(
    factory: Any,
    batch: Any,
    intent: ShardingIntent,
    world_sizes: Sequence[int],
    budget: int,
    *,
    backend: str,
    options: DecideOptions,
    device_type: str | None = None,
) -> list[dict[str, Any]]:
    """``explain --budget B --json``'s "auto": per world size, ``BudgetDecision.to_dict()``, or
    ``{"world_size", "budget", "error": {"type", "message", "min_world_size"}}`` when there is no decision.
    ``device_type``: the run's (explain's ``--accelerator``), whose headroom it keeps, not the machine explain runs on."""
    out: list[dict[str, Any]] = []
    for n in world_sizes:
        try:
            out.append(decide(factory, batch, intent, n, backend=backend, budget=budget, device_type=device_type, options=options).to_dict())
        except AutoShardError as exc:
            error = {"type": type(exc).__name__, "message": str(exc), "min_world_size": getattr(exc, "min_world_size", None)}
            out.append({"world_size": n, "budget": budget, "error": error})
    return out
