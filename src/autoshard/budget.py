"""Memory budgets: ``autoshard explain --budget 80GiB`` (does the run fit, and if not, the fewest changes that would),
and ``ShardingIntent(memory_budget=...)`` (``decide``: the cheapest configuration whose simulated peak fits).

Each candidate is estimated again in full (a simulated step where one can run), never scaled from the first
estimate: activation checkpointing, offload and a smaller micro-batch change activations and states in ways a ratio
would get wrong. Changes are listed cheapest first, by what they cost the run, not by memory saved. The decision's
cost order is documented above ``decide``'s section below and in docs/guide.md ("Memory budget").
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard.backends import get_backend
from autoshard.backends.deepspeed import BACKEND_NAME as DEEPSPEED
from autoshard.backends.fsdp2 import BACKEND_NAME as FSDP2
from autoshard.errors import AutoShardError, IntentError
from autoshard.intent import BUDGET_FIELDS, SELECTIVE, ShardingIntent
from autoshard.memory import MemoryEstimate, fmt_bytes

MAX_RANKS = 4096  # the search for "more ranks" stops here


@dataclass(frozen=True)
class Option:
    """One way to run: the intent, the world size and the micro-batch (a fraction of the given one).

    ``simulate=False`` asks for the model states only (no simulated step): fast, used to search before one
    simulation confirms.
    """

    intent: ShardingIntent
    world_size: int
    batch_divisor: int = 1
    simulate: bool = True


Evaluate = Callable[[Option], MemoryEstimate]
"""Estimate one option (explain builds it: the memory table's maths plus a simulated step)."""


@dataclass(frozen=True)
class Change:
    """A change to the run that was estimated: what to set, what it costs, the new device peak per rank."""

    change: str  # what to set, as the user writes it
    cost: str  # what the run pays for it
    peak: int  # device bytes per rank with the change
    fits: bool  # never True when ``missing``: a lower bound under the budget proves nothing
    missing: str = ""  # the part of the step its estimate lacks (its simulated step could not run), "" when whole


@dataclass(frozen=True)
class BudgetReport:
    """The verdict. ``missing`` names the part of the step the peak lacks ("" when the whole step was simulated):
    then the peak is a lower bound, so ``fits`` is None ("cannot tell") unless even that bound is over the budget,
    and no change is estimated (each would lack the same part)."""

    budget: int
    world_size: int
    peak: int
    fits: bool | None
    changes: tuple[Change, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    missing: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        if self.missing:
            verdict = "cannot tell whether it fits" if self.fits is None else "does NOT fit, even without them"
            head = (
                f"budget {fmt_bytes(self.budget)} per rank, world size {self.world_size}: peak at least {fmt_bytes(self.peak)}"
                f" ({self.peak / self.budget:.0%} of the budget) with {self.missing} not counted: {verdict}"
            )
        else:
            head = (
                f"budget {fmt_bytes(self.budget)} per rank, world size {self.world_size}: peak {fmt_bytes(self.peak)}"
                f" ({self.peak / self.budget:.0%} of the budget): {'fits' if self.fits else 'does NOT fit'}"
            )
        lines = [head]
        if self.fits is False and not self.missing:
            fitting = [c for c in self.changes if c.fits]
            short = [c for c in self.changes if not c.fits and not c.missing]
            unknown = [c for c in self.changes if c.missing]
            if fitting:
                lines.append("changes that fit, cheapest first:")
                lines += [f"  {c.change:<52} peak {fmt_bytes(c.peak):>11}; costs {c.cost}" for c in fitting]
            else:
                lines.append("nothing autoshard tried fits: a smaller model, or devices with more memory")
            if short:
                lines.append("estimated, not enough on its own:")
                lines += [f"  {c.change:<52} peak {fmt_bytes(c.peak):>11}" for c in short]
            if unknown:
                lines.append("not estimated in full (its simulated step could not run), so no verdict:")
                lines += [f"  {c.change:<52} peak at least {fmt_bytes(c.peak)}, {c.missing} not counted" for c in unknown]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def check_budget(
    evaluate: Evaluate,
    intent: ShardingIntent,
    world_size: int,
    budget: int,
    *,
    devices_per_node: int,
    batch_rows: int | None,
    lacks: Callable[[MemoryEstimate], str] = lambda estimate: "",
) -> BudgetReport:
    """The verdict for ``world_size`` and, when it does not fit, the fewest changes that do.

    Never more ranks or more changes than needed: each single change first (the smallest world size that fits,
    found by search over world sizes from model states, then confirmed by a simulated step; activation
    checkpointing; the largest micro-batch that fits; offload); only when none fits alone, pairs of them on these
    ranks, then all three; only when nothing fits on these ranks, the smallest world size for each combination,
    fewest changes first. Every combination tried is listed, the ones that fit and the smaller ones that did not.

    ``batch_rows``: the micro-batch's size when it can be cut along dim 0 (None: it cannot, or no batch given).
    ``lacks``: the part of the step an estimate's simulated step could not cover ("activations"; "" when whole).
    A partial estimate is never "fits": for the run itself the verdict is then "cannot tell" (unless the lower
    bound is already over the budget) and no change is tried; a change estimated in part is listed as such.
    """
    current = evaluate(Option(intent, world_size))
    missing = lacks(current)
    if missing:
        fits = None if current.device <= budget else False
        why = f"no change is estimated: each estimate would lack {missing} too"
        return BudgetReport(budget, world_size, current.device, fits, (), (why,), missing)
    if current.device <= budget:
        return BudgetReport(budget, world_size, current.device, True)
    changes: list[Change] = []
    notes: list[str] = []

    def add(change: str, cost: str, option: Option) -> Change:
        estimate = evaluate(option)
        peak, gap = estimate.device, lacks(estimate)
        made = Change(change, cost, peak, peak <= budget and not gap, gap)
        changes.append(made)
        return made

    def smallest_world(asked: ShardingIntent, divisor: int = 1) -> int | None:
        """The smallest world size above this one at which ``asked`` fits: predicted from model states by bisection
        (states shrink with ranks, the rest does not), then confirmed by a simulated step, or the next sizes."""
        here = evaluate(Option(asked, world_size, divisor))
        if lacks(here):
            return None
        rest = here.device - _states_on_device(here)
        sizes = _world_sizes_after(world_size, devices_per_node, asked)
        predict = lambda n: rest + _states_on_device(evaluate(Option(asked, n, divisor, simulate=False)))  # noqa: E731
        if not sizes or predict(sizes[-1]) > budget:
            return None
        lo, hi = 0, len(sizes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if predict(sizes[mid]) <= budget else (mid + 1, hi)
        for n in sizes[lo : lo + 3]:
            estimate = evaluate(Option(asked, n, divisor))
            if estimate.device <= budget and not lacks(estimate):
                return n
        return None

    def micro_batch(asked: ShardingIntent, ranks: int) -> int:
        """The divisor of the largest micro-batch (rows / 2, / 4, ...) that fits with ``asked``: predicted from the
        activations (about linear in the rows), confirmed by a simulated step. When none fits, where the search
        stopped: one row, or the first micro-batch whose step could not be simulated (listed as such)."""
        base = evaluate(Option(asked, ranks))
        divisor = 2
        while True:
            while batch_rows // divisor > 1 and base.device - base.activations * (1 - 1 / divisor) > budget:
                divisor *= 2
            estimate = evaluate(Option(asked, ranks, divisor))
            if lacks(estimate) or estimate.device <= budget or batch_rows // divisor <= 1:
                return divisor
            divisor *= 2

    # 1. More ranks: the same method and batch, more hardware. Under hybrid sharding states divide by the shard
    #    group, not the world, so the group grows instead.
    if intent.shard_size is None:
        ranks = smallest_world(intent)
        if ranks is not None:
            add(f"{ranks} ranks (Trainer num_nodes x devices)", f"{ranks / world_size:g}x the devices", Option(intent, ranks))
        else:
            notes.append(f"no world size up to {MAX_RANKS} fits: activations and what stays whole do not shrink with ranks")
    else:  # a bigger shard group, up to every rank: states shrink, and more of the gathers cross nodes
        group = devices_per_node if intent.shard_size == "node" else int(intent.shard_size)
        size = group * 2
        while size < world_size:
            if world_size % size == 0:
                made = add(
                    f"shard_size={size} (was {intent.shard_size!r})",
                    f"gathers span {size} ranks",
                    Option(intent.replace(shard_size=size), world_size),
                )
                if made.fits:
                    break
                changes.pop()
            size *= 2
        else:
            if group < world_size:  # a group of every rank is already pure FSDP
                add(
                    "shard_size=None (shard over every rank)",
                    "gathers and reduce-scatters cross nodes",
                    Option(intent.replace(shard_size=None), world_size),
                )
    # 2.-4. The changes on these ranks, each alone, cheapest first: activation checkpointing (about a third more
    #    compute, same results), a smaller micro-batch (gradient accumulation keeps the global batch), offload.
    singles: dict[str, tuple[dict[str, Any], str]] = {}
    if not intent.activation_checkpointing:
        singles["ac"] = ({"activation_checkpointing": True}, "~1/3 more compute (forward recomputed in backward)")
    if intent.offload == "none":
        singles["offload"] = ({"offload": "params"}, "host-device copies every step (often 2-5x slower)")
    words = {"ac": "activation_checkpointing=True", "offload": "offload='params' (CPU memory)"}

    def try_combo(keys: tuple[str, ...], ranks: int, ranks_cost: str = "") -> Change | None:
        fields: dict[str, Any] = {k: v for key in keys if key != "mb" for k, v in singles[key][0].items()}
        asked = intent.replace(**fields)
        parts = [words[key] for key in keys if key != "mb"]
        costs = [singles[key][1] for key in keys if key != "mb"]
        divisor = 1
        if "mb" in keys:
            divisor = micro_batch(asked, ranks)
            parts.append(f"micro-batch {batch_rows // divisor} (was {batch_rows})")
            costs.append(f"{divisor}x Trainer(accumulate_grad_batches=...) keeps the global batch; {divisor}x the steps")
        if ranks != world_size:
            parts.insert(0, f"{ranks} ranks")
            costs.insert(0, ranks_cost)
        if len(parts) == 1 and ranks == world_size and "mb" not in keys:
            return add(parts[0], costs[0], Option(asked, ranks, divisor))
        return add(" + ".join(parts), "; ".join(costs), Option(asked, ranks, divisor))

    if "ac" in singles:
        try_combo(("ac",), world_size)
    if batch_rows is not None and batch_rows > 1:
        try_combo(("mb",), world_size)
    elif batch_rows is None:
        notes.append("a smaller micro-batch is not estimated: pass --batch with tensors that share dim 0")
    if "offload" in singles:
        try_combo(("offload",), world_size)
    if any(c.fits or c.missing for c in changes):
        return BudgetReport(budget, world_size, current.device, False, tuple(changes), tuple(notes))
    # 5. Nothing fits alone: the fewest changes together, first on these ranks, then with the fewest ranks.
    available = [k for k in ("ac", "mb", "offload") if k in singles or (k == "mb" and batch_rows and batch_rows > 1)]
    for size in range(2, len(available) + 1):
        found = [try_combo(keys, world_size) for keys in itertools.combinations(available, size)]
        if any(c is not None and c.fits for c in found):
            return BudgetReport(budget, world_size, current.device, False, tuple(changes), tuple(notes))
    if intent.shard_size is None:
        for size in range(1, len(available) + 1):
            fitted = False
            for keys in itertools.combinations(available, size):
                fields = {k: v for key in keys if key != "mb" for k, v in singles[key][0].items()}
                asked = intent.replace(**fields)
                divisor = micro_batch(asked, world_size) if "mb" in keys else 1
                ranks = smallest_world(asked, divisor)
                if ranks is not None:
                    made = try_combo(keys, ranks, f"{ranks / world_size:g}x the devices")
                    fitted = fitted or bool(made and made.fits)
            if fitted:
                break
    return BudgetReport(budget, world_size, current.device, False, tuple(changes), tuple(notes))


def _whole_nodes(ranks: int, devices_per_node: int) -> int:
    """``ranks`` rounded up to whole nodes once it exceeds one node (6 x 2 = 12 ranks on 8-device nodes: 16)."""
    return ranks if ranks <= devices_per_node else -(-ranks // devices_per_node) * devices_per_node


def _states_on_device(estimate: MemoryEstimate) -> int:
    return estimate.model_states - sum(getattr(estimate, c) for c in estimate.offloaded)


# =====================================================================================================================
# ShardingIntent(memory_budget=...): the cheapest configuration whose simulated peak fits
# =====================================================================================================================
#
# The decision is made on one micro-batch, as ``training_step`` receives it: a function returning it, or the batch
# itself (at fit: the first batch of the train dataloader). Never on ``example_input_array``: it is forward's input,
# and a forward alone is a lower bound of a step's peak (no backward, no optimizer step), so a decision on it could
# choose a configuration that runs out of memory. Never on model states alone either: activations are most of a
# step's peak on the models we know.
#
# The cost order. Every free field's option has a price, in estimated seconds per step on nominal hardware (Rates):
#   - activation checkpointing: the FLOPs its recomputation adds to the simulated step (forward, backward and
#     recomputation counted by torch's FlopCounterMode), at Rates.flops_per_s;
#   - reshard_after_forward=True: the all-gather bytes of the traffic model (memory.py: a unit is gathered again in
#     backward), at the link's rate (inter-node bytes at Rates.inter_node_bytes_per_s, the rest intra-node);
#   - offload='params': host-device bytes per step (each rank's shard of the parameters copied in for every
#     all-gather, its gradient shard copied out), at Rates.host_bytes_per_s;
#   - a smaller shard group (shard_size='node'): more memory (states divide by fewer ranks), less cross-node traffic:
#     its price is the traffic model's bytes at each link's rate, like resharding.
# A configuration's price is the sum. The cheapest configuration whose simulated peak fits the budget is chosen;
# ties go to fewer changes. Every cheaper configuration is listed with its peak and why it does not fit.
#
# Under DeepSpeed ZeRO-3 (backend='deepspeed') the one knob chosen is offload: 'none', then 'optimizer'
# (offload_optimizer: each step the gradient partition goes to the host, the updated parameter partition comes back),
# then 'params' (offload_param too: the parameter partition comes in for the forward's and the backward's gathers,
# gradients go out, the step runs on the host). Each saves more device memory than the one before and copies more.
# A peak there is DeepSpeed's own estimator (estimate_zero3_model_states_mem_needs: 4 x the largest layer + 18, 2 or
# 0 bytes per parameter / ranks) plus the activations of a simulated step of the same method (explain does the same).
# Activation checkpointing is not chosen there: autoshard does not checkpoint blocks under DeepSpeed (the model's own
# deepspeed.checkpointing calls do), so a step cannot be simulated for it, and memory_budget refuses it (row 131).


FREE_FIELDS = BUDGET_FIELDS
DEFAULTS: dict[str, Any] = {"reshard_after_forward": True, "activation_checkpointing": False, "offload": "none", "shard_size": None}
MAX_DECISION_RANKS = MAX_RANKS
DEVICES_PER_NODE = 8  # ranks per node when nothing says otherwise (one node of the world size if it is larger)
OFFLOAD_SAVING = {"none": 0, "optimizer": 1, "params": 2}  # what each offload leaves off the device, least first


class BudgetRefusedError(IntentError):
    """No configuration fits ``memory_budget`` at this world size; ``min_world_size`` is the smallest world size at
    which one does (None: none up to MAX_RANKS, activations do not shrink with ranks), ``micro_batch`` the largest
    micro-batch that fits here with every saving on (None: unknown, or the batch cannot be cut along dim 0)."""

    def __init__(self, message: str, min_world_size: int | None = None, micro_batch: int | None = None) -> None:
        # Every value in args: a strategy's other ranks rebuild rank 0's refusal from them (lightning.checkpoint).
        super().__init__(message, min_world_size, micro_batch)
        self.min_world_size = min_world_size
        self.micro_batch = micro_batch

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Rates:
    """What one step's extra work costs, per second, on the hardware the run is for: turns FLOPs and bytes into
    seconds so that recomputation, collectives and host copies are compared in one unit. The defaults are a nominal
    H100-class node (dense bf16 at a realistic 40% of peak, NVLink, 200 Gb/s InfiniBand per GPU, PCIe 5 x16);
    benchmarks/budget_cost_order.py measures them on the machine at hand."""

    flops_per_s: float = 400e12
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 25e9
    host_bytes_per_s: float = 25e9

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Cost:
    """The estimated price of one configuration, per step: seconds by cause, and the quantities behind them."""

    recompute_flops: int = 0
    gather_bytes_intra: int = 0
    gather_bytes_inter: int = 0
    host_bytes: int = 0
    seconds: float = 0.0

    def at(self, rates: Rates) -> float:
        """The same quantities priced at other rates (the cost-order benchmark measures this machine's)."""
        return (
            self.recompute_flops / rates.flops_per_s
            + self.gather_bytes_intra / rates.intra_node_bytes_per_s
            + self.gather_bytes_inter / rates.inter_node_bytes_per_s
            + self.host_bytes / rates.host_bytes_per_s
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tried:
    """One configuration the decision looked at: its free fields, its peak per rank, its price, and why it does not
    fit (``why`` is "" for the chosen one). ``simulated=False``: its peak is a lower bound, inferred from a
    configuration that saves at least as much in every field and already does not fit (no step simulated)."""

    config: dict[str, Any]
    peak: int
    cost: Cost
    fits: bool
    why: str = ""
    simulated: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dict(self.config),
            "peak": self.peak,
            "fits": self.fits,
            "why": self.why,
            "simulated": self.simulated,
            "cost": self.cost.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tried:
        return cls(
            dict(data["config"]),
            int(data["peak"]),
            Cost(**data.get("cost", {})),
            bool(data["fits"]),
            data.get("why", ""),
            bool(data.get("simulated", True)),
        )


@dataclass(frozen=True)
class BudgetDecision:
    """What ``memory_budget`` chose at one world size: ``chosen`` holds ShardingIntent field names and values (paste
    them: ``ShardingIntent(**chosen)``), ``peak`` its simulated device bytes per rank, ``cheaper`` every cheaper
    configuration with its peak and why it does not fit, cheapest first. ``kept`` names the fields the user set,
    which the decision did not touch."""

    budget: int
    world_size: int
    chosen: dict[str, Any]
    peak: int
    cost: Cost
    cheaper: list[Tried]
    batch: str = ""
    kept: tuple[str, ...] = ()
    rates: Rates = field(default_factory=Rates)
    num_nodes: int = 1
    backend: str = FSDP2  # the backend the peaks are for: fsdp2's simulated step, or DeepSpeed's estimator + activations

    def intent(self, base: ShardingIntent) -> ShardingIntent:
        """``base`` with the chosen fields: what the run trains with."""
        return base.replace(**self.chosen)

    def table(self) -> str:
        """The decision table a strategy logs on rank 0 at fit: the choice with its peak, then every cheaper
        configuration with its peak and why it does not fit."""
        head = (
            f"autoshard memory budget: {fmt_bytes(self.budget)} per rank, world size {self.world_size}"
            + (f" on {self.num_nodes} nodes" if self.num_nodes > 1 else "")
            + (", DeepSpeed ZeRO-3 (its estimator + the simulated activations)" if self.backend == DEEPSPEED else "")
            + (f", micro-batch {self.batch}" if self.batch else "")
        )
        lines = [head, f"  chosen: {describe_config(self.chosen)}", f"    peak {fmt_bytes(self.peak)} per rank; costs {_cost_words(self.cost)}"]
        if self.cheaper:
            lines.append("  cheaper, and why each does not fit (cheapest first):")
            for t in self.cheaper:
                lines.append(f"    {describe_config(t.config):<72} peak {'>= ' if not t.simulated else ''}{fmt_bytes(t.peak):>11}  {t.why}")
        else:
            lines.append("  nothing cheaper: this is the cheapest configuration")
        if self.kept:
            lines.append(f"  kept as you set them: {', '.join(self.kept)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: stored in the checkpoint, printed by ``autoshard explain --budget --json``."""
        return {
            "world_size": self.world_size,
            "budget": self.budget,
            "chosen": dict(self.chosen),
            "peak": self.peak,
            "cost": self.cost.to_dict(),
            "cheaper": [t.to_dict() for t in self.cheaper],
            "batch": self.batch,
            "kept": list(self.kept),
            "rates": self.rates.to_dict(),
            "num_nodes": self.num_nodes,
            "backend": self.backend,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BudgetDecision:
        return cls(
            budget=int(data["budget"]),
            world_size=int(data["world_size"]),
            chosen=dict(data["chosen"]),
            peak=int(data["peak"]),
            cost=Cost(**data.get("cost", {})),
            cheaper=[Tried.from_dict(t) for t in data.get("cheaper", [])],
            batch=data.get("batch", ""),
            kept=tuple(data.get("kept", ())),
            rates=Rates(**data.get("rates", {})),
            num_nodes=int(data.get("num_nodes", 1)),
            backend=str(data.get("backend", FSDP2)),
        )


def describe_config(config: dict[str, Any]) -> str:
    """``activation_checkpointing=2, offload='params'``: the fields that differ from ShardingIntent's defaults, as
    a user writes them ("defaults" when none does)."""
    changed = [f"{k}={v!r}" for k, v in config.items() if DEFAULTS.get(k, object()) != v or type(DEFAULTS.get(k)) is not type(v)]
    return ", ".join(changed) or "defaults (nothing changed)"


def _cost_words(cost: Cost) -> str:
    parts = []
    if cost.recompute_flops:
        parts.append(f"{cost.recompute_flops / 1e9:.3g} GFLOP recomputed")
    if cost.gather_bytes_intra or cost.gather_bytes_inter:
        parts.append(f"{fmt_bytes(cost.gather_bytes_intra + cost.gather_bytes_inter)} all-gathered/reduced")
    if cost.host_bytes:
        parts.append(f"{fmt_bytes(cost.host_bytes)} host<->device")
    return f"~{cost.seconds * 1e3:.3g} ms/step estimated ({'; '.join(parts) or 'nothing extra'})"


# -- the batch ----------------------------------------------------------------------------------------------------------
def batch_function(batch: Any) -> Callable[[], Any]:
    """A function of no arguments returning one micro-batch of ``batch``'s shapes: ``batch`` itself when it is one
    (a batch function), else a function building empty tensors of the batch's shapes and dtypes on the current
    device (meta, or fake under the simulated step): the decision never copies or reads the batch's values."""
    if batch is None:
        raise IntentError(
            "memory_budget is decided on one micro-batch, and none was given: autoshard never decides from model states"
            " alone (activations are most of a step's peak). Fix: pass the batch (decide(module, batch, ...), or at fit"
            " a train dataloader), or a function returning one micro-batch as training_step receives it"
        )
    if callable(batch) and not isinstance(batch, (torch.Tensor, nn.Module)):
        return batch
    from torch.utils._pytree import tree_map_only

    def empty_like_batch() -> Any:
        return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype), batch)

    return empty_like_batch


def batch_rows(make_batch: Callable[[], Any]) -> int | None:
    """The micro-batch's rows when every tensor in it shares dim 0 (so it can be cut); else None."""
    from torch.utils._pytree import tree_leaves

    from autoshard.activations import call_batch

    with torch.device("meta"):
        rows = {t.shape[0] if t.dim() else None for t in tree_leaves(call_batch(make_batch)) if isinstance(t, torch.Tensor)}
    return rows.pop() if len(rows) == 1 and None not in rows else None


def cut_batch(make_batch: Callable[[], Any], divisor: int) -> Callable[[], Any]:
    """``make_batch`` with every tensor's dim 0 divided by ``divisor`` (a smaller micro-batch of the same samples)."""
    if divisor == 1:
        return make_batch
    from torch.utils._pytree import tree_map

    def smaller() -> Any:
        cut = lambda t: t[: max(1, t.shape[0] // divisor)] if isinstance(t, torch.Tensor) and t.dim() else t  # noqa: E731
        return tree_map(cut, make_batch())

    return smaller


# -- the module, copied to meta for each simulated step ------------------------------------------------------------------
def meta_factory(module: Any, callbacks: Sequence[Any] = ()) -> Callable[[], Any]:
    """A factory for the simulated steps: a class or function is called afresh each time; a module instance (real or
    meta) is copied to the meta device each time (``fully_shard`` mutates what it shards), weights never copied,
    the Trainer it may be attached to left out."""
    if callable(module) and not isinstance(module, nn.Module):
        return module
    if not isinstance(module, nn.Module):
        raise IntentError(
            f"memory_budget decides for a LightningModule, got {type(module).__name__}. Fix: pass the module, or a function building it"
        )
    sharded = next((n for n, p in module.named_parameters() if hasattr(p, "placements") or hasattr(p, "ds_id")), None)
    if sharded is not None:
        raise IntentError(
            f"memory_budget is decided before sharding, but {type(module).__name__}.{sharded} is already sharded."
            f" Fix: decide on the unsharded module (the strategy does, at setup, before fully_shard)"
        )

    def copy_on_meta() -> Any:
        memo: dict[int, Any] = {}
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for b in m._buffers.values():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device="meta")
            for name in ("_trainer", "_fabric", "_device_mesh"):  # a Lightning module at fit: never copy the Trainer
                held = m.__dict__.get(name)
                if held is not None:
                    memo[id(held)] = None
        try:
            return copy.deepcopy((module, list(callbacks)) if callbacks else module, memo)
        except Exception as exc:
            raise IntentError(
                f"memory_budget could not copy {type(module).__name__} to the meta device to simulate its step"
                f" ({type(exc).__name__}: {exc}). Fix: pass a function building the module (decide(MyModule, batch, ...))"
            ) from exc

    return copy_on_meta


# -- the search ------------------------------------------------------------------------------------------------------------
def _ac_options(blocks: int) -> list[bool | int | str]:
    """False, every k-th block (k = 2, and 4 from 8 blocks), selective, every block: steps between nothing and all."""
    if blocks == 0:
        return [False]
    every = [k for k in (2, 4) if k < blocks and (k == 2 or blocks >= 8)]
    return [False, *every, SELECTIVE, True]


def _saves_at_least(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether configuration ``a`` saves at least as much memory as ``b`` in every field (so peak(a) <= peak(b))."""
    for key, va in a.items():
        vb = b[key]
        if va == vb and type(va) is type(vb):
            continue
        if key == "reshard_after_forward" and not (va is True and vb is False):
            return False
        if key == "offload" and OFFLOAD_SAVING[va] < OFFLOAD_SAVING[vb]:
            return False
        if key == "shard_size" and not (va is None and vb == "node"):
            return False
        if key == "activation_checkpointing" and not _ac_saves_at_least(va, vb):
            return False
    return True


def _ac_saves_at_least(a: bool | int | str, b: bool | int | str) -> bool:
    if b is False or a is True:
        return True
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and not isinstance(b, bool):
        return a <= b  # every 2nd block saves more than every 4th
    return False


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


class _Simulator:
    """Model states (fast, from shapes) and simulated steps (seconds each) for one module and batch, cached.

    ``backend``: fsdp2 (the step runs fsdp2's own plan: its peak is the run's), or DeepSpeed ZeRO-3 (its estimator's
    states, plus the activations of one fsdp2 step of the same method per world size and micro-batch: they do not
    depend on the offload)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        make_batch: Callable[[], Any],
        base: ShardingIntent,
        precision: Any,
        devices_per_node: int | None,
        num_nodes: int,
        progress: Callable[[str], None] | None,
        backend: str = FSDP2,
    ) -> None:
        from autoshard.memory import collect_optimizers
        from autoshard.needs import inspect_needs
        from autoshard.target import build_on_meta

        self.factory, self.make_batch, self.base, self.precision = factory, make_batch, base, precision
        self.devices_per_node, self.num_nodes, self.progress = devices_per_node, num_nodes, progress
        self.backend = backend
        built = build_on_meta(factory)
        self.module, self.callbacks = built.module, built.callbacks
        self.sourced = collect_optimizers(self.module, self.callbacks)
        configured = [o for source, o in self.sourced if source == "configure_optimizers"]
        self.needs = inspect_needs(self.module, callbacks=self.callbacks, optimizers=configured)
        self.states_cache: dict[tuple[str, int], Any] = {}
        self.step_cache: dict[tuple[str, int, int], tuple[Any, int]] = {}
        self.measured: dict[tuple[str, int, int], Any] = {}
        self.sims = 0

    def nodes(self, world_size: int) -> int:
        from autoshard.memory import nodes_for

        return self.num_nodes if self.devices_per_node is None else nodes_for(world_size, self.devices_per_node)

    def blocks(self) -> int:
        """Blocks activation checkpointing would wrap under the plan (trainable block units)."""
        import warnings

        from autoshard.adapters.fsdp2 import plan_fsdp2

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_fsdp2(self.module, self.base.replace(activation_checkpointing=True), self.needs, self.precision)
        return sum(1 for u in plan.units if u.checkpointed)

    def states(self, config: dict[str, Any], world_size: int) -> Any:
        import warnings

        from autoshard.memory import estimate_memory_many

        key = (_key(config), world_size)
        if key not in self.states_cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.states_cache[key] = estimate_memory_many(
                    self.module,
                    self.base.replace(**config),
                    self.needs,
                    [world_size],
                    self.backend,
                    callbacks=self.callbacks,
                    sourced=self.sourced,
                    num_nodes=self.nodes(world_size),
                    precision=self.precision,
                )[0]
        return self.states_cache[key]

    def step(self, config: dict[str, Any], world_size: int, divisor: int = 1) -> tuple[Any, int]:
        """(the estimate with the simulated step, the step's FLOPs)."""
        from autoshard.memory import with_step

        key = (_key(config), world_size, divisor)
        if key not in self.step_cache:
            whole = self.backend == FSDP2  # DeepSpeed: only the step's activations are added to its estimator's states
            step = self._measure(config if whole else {}, world_size, divisor)
            self.step_cache[key] = (with_step(self.states(config, world_size), step, whole), step.flops)
        return self.step_cache[key]

    def _measure(self, config: dict[str, Any], world_size: int, divisor: int) -> Any:
        from autoshard.activations import measure_step

        key = (_key(config), world_size, divisor)
        if key not in self.measured:
            if self.progress is not None:
                what = describe_config(config) if self.backend == FSDP2 else "activations for DeepSpeed"
                self.progress(f"simulating one step on {world_size} fake ranks ({what}" + (f", micro-batch / {divisor}" if divisor > 1 else "") + ")")
            step = measure_step(
                self.factory,
                self.base.replace(**config),
                world_size,
                self.precision,
                make_batch=cut_batch(self.make_batch, divisor),
                num_nodes=self.nodes(world_size),
            )
            self.sims += 1
            if step.forward_only:  # the batch did not run: the reason is the user's to fix, never a decision on half a step
                raise IntentError(f"memory_budget cannot be decided: {step.incomplete}")
            self.measured[key] = step
        return self.measured[key]


def _cost(sim: _Simulator, config: dict[str, Any], world_size: int, flops: dict[Any, int], rates: Rates) -> Cost:
    states = sim.states(config, world_size)
    ac = config.get("activation_checkpointing", sim.base.activation_checkpointing)
    base_ac = False if "activation_checkpointing" in config else sim.base.activation_checkpointing
    recompute = max(0, flops.get(ac, 0) - flops.get(base_ac, 0)) if ac in flops and base_ac in flops else 0
    gathered_intra = states.intra_node_bytes
    gathered_inter = states.inter_node_bytes
    host = 0
    offload = config.get("offload", sim.base.offload)
    if sim.backend == DEEPSPEED:  # see the cost order above: gradients out, parameters in once (optimizer) or per gather
        host = {"none": 0, "optimizer": states.parameters + states.gradients, "params": 2 * states.parameters + states.gradients}[offload]
    elif offload != "none":
        reshard = config.get("reshard_after_forward", sim.base.reshard_after_forward)
        host = (states.parameters + states.ema_teacher) * (2 if reshard else 1) + states.gradients
    cost = Cost(recompute, gathered_intra, gathered_inter, host)
    return Cost(recompute, gathered_intra, gathered_inter, host, cost.at(rates))


def price(
    module: Any,
    batch: Any,
    intent: ShardingIntent,
    world_size: int,
    configs: Sequence[dict[str, Any]],
    *,
    rates: Rates | None = None,
    precision: Any = None,
    num_nodes: int = 1,
    backend: str = FSDP2,
) -> list[tuple[int, Cost]]:
    """(device peak per rank, price) of each configuration (ShardingIntent fields over ``intent``), as ``decide``
    computes them on ``backend``: one simulated step each, plus one without activation checkpointing for the
    recomputed FLOPs."""
    from autoshard.precision import resolve_precision

    rates = rates or Rates()
    base = intent.replace(memory_budget=None, pinned=())
    sim = _Simulator(
        meta_factory(module),
        batch_function(batch),
        base,
        precision or resolve_precision(None, intent),
        world_size // num_nodes,
        num_nodes,
        None,
        get_backend(backend).name,
    )
    flops: dict[Any, int] = {}
    out = []
    for config in [{**c, "activation_checkpointing": False} for c in configs] + list(configs):
        estimate, step_flops = sim.step(dict(config), world_size)
        flops.setdefault(config.get("activation_checkpointing", base.activation_checkpointing), step_flops)
    for config in configs:
        estimate, _ = sim.step(dict(config), world_size)
        out.append((estimate.device, _cost(sim, dict(config), world_size, flops, rates)))
    return out


def _free_fields(intent: ShardingIntent, num_nodes: int, backend: str = FSDP2) -> list[str]:
    """The fields the user left at their defaults (shard_size only when there are several nodes to group by; under
    DeepSpeed offload only, its one knob autoshard sets)."""
    free = [f for f in FREE_FIELDS if getattr(intent, f) == DEFAULTS[f] and type(getattr(intent, f)) is type(DEFAULTS[f]) and f not in intent.pinned]
    if backend == DEEPSPEED:
        return [f for f in free if f == "offload"]
    return [f for f in free if f != "shard_size" or num_nodes > 1]


def _options(field_name: str, blocks: int, backend: str = FSDP2) -> list[Any]:
    """Each free field's options, cheapest (least saving) first."""
    return {
        "reshard_after_forward": [False, True],
        "activation_checkpointing": _ac_options(blocks),
        "offload": ["none", "optimizer", "params"] if backend == DEEPSPEED else ["none", "params"],
        "shard_size": ["node", None],
    }[field_name]


def _search(
    sim: _Simulator, world_size: int, budget: int, rates: Rates, free: list[str], blocks: int
) -> tuple[Tried | None, list[Tried], dict[str, Any]]:
    """(the cheapest configuration that fits or None, every cheaper one tried, the most saving configuration).

    Order of work, to simulate few steps: the cheapest configuration first (it fits: done); then the most saving
    one (it does not: nothing fits at this world size); then one step per activation-checkpointing option (its
    recomputed FLOPs are its price); then the rest in price order, skipping (as lower bounds) those that save no
    more than one already over the budget.
    """
    grid = [dict(zip(free, values)) for values in itertools.product(*(_options(f, blocks, sim.backend) for f in free))]
    most = grid[-1]
    flops: dict[Any, int] = {}
    peaks: dict[str, int] = {}
    changes = lambda c: sum(c[f] != getattr(sim.base, f) for f in free)  # noqa: E731  ties: fewer changes
    # The cheapest: nothing recomputed, nothing offloaded, the cheapest resharding and shard group by the traffic
    # model (no step needed to price those; at one rank resharding is free, so the default stays).
    plain = [c for c in grid if not c.get("activation_checkpointing") and c.get("offload", "none") == "none"]
    cheapest = min(plain, key=lambda c: (_cost(sim, c, world_size, flops, rates).seconds, changes(c)))

    def simulate(config: dict[str, Any]) -> int:
        estimate, step_flops = sim.step(config, world_size)
        flops.setdefault(config.get("activation_checkpointing", sim.base.activation_checkpointing), step_flops)
        peaks[_key(config)] = estimate.device
        return estimate.device

    if simulate(cheapest) <= budget:
        return Tried(cheapest, peaks[_key(cheapest)], _cost(sim, cheapest, world_size, flops, rates), True), [], most
    if simulate(most) > budget:
        return None, [], most
    if "activation_checkpointing" in free:
        for option in _ac_options(blocks):
            simulate({**cheapest, "activation_checkpointing": option})
    priced = sorted(grid, key=lambda c: (_cost(sim, c, world_size, flops, rates).seconds, changes(c)))
    tried: list[Tried] = []
    over: list[dict[str, Any]] = []
    for config in priced:
        cost = _cost(sim, config, world_size, flops, rates)
        dominant = next((o for o in over if _saves_at_least(o, config)), None)
        if _key(config) not in peaks and dominant is not None:
            bound = peaks[_key(dominant)]
            why = f"saves no more than {describe_config(dominant)}, which peaks at {fmt_bytes(bound)} (over the budget): not simulated"
            tried.append(Tried(config, bound, cost, False, why, simulated=False))
            continue
        peak = peaks[_key(config)] if _key(config) in peaks else simulate(config)
        if peak <= budget:
            return Tried(config, peak, cost, True), tried, most
        over.append(config)
        tried.append(Tried(config, peak, cost, False, f"{fmt_bytes(peak - budget)} over the budget"))
    return None, tried, most  # unreachable: the most saving configuration fits


def _world_sizes_after(world_size: int, devices_per_node: int | None, intent: ShardingIntent) -> list[int]:
    """World sizes above ``world_size`` a run can have: any up to one node, whole nodes beyond, and only those the
    intent's fixed shard_size divides."""
    per_node = devices_per_node or world_size
    sizes = [n for n in range(world_size + 1, per_node + 1)] + list(
        range(max(per_node, world_size) // per_node * per_node + per_node, MAX_DECISION_RANKS + 1, per_node)
    )
    out = []
    for n in sorted(set(sizes)):
        try:
            intent.hsdp_sizes(n, max(1, n // per_node) if devices_per_node else 1)
        except IntentError:
            continue
        out.append(n)
    return out


def _smallest_world(sim: _Simulator, config: dict[str, Any], world_size: int, budget: int) -> int | None:
    """The smallest world size above ``world_size`` at which ``config`` fits: predicted from model states (they shrink
    with ranks, activations do not) by bisection, then confirmed by a simulated step (the next sizes when not)."""
    here, _ = sim.step(config, world_size)
    rest = here.device - _states_on_device(sim.states(config, world_size))
    sizes = _world_sizes_after(world_size, sim.devices_per_node, sim.base.replace(**config))
    predict = lambda n: rest + _states_on_device(sim.states(config, n))  # noqa: E731
    if not sizes or predict(sizes[-1]) > budget:
        return None
    lo, hi = 0, len(sizes) - 1
    while lo < hi:  # the first size predicted to fit (states shrink monotonically with ranks)
        mid = (lo + hi) // 2
        if predict(sizes[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    for n in sizes[lo : lo + 3]:
        if sim.step(config, n)[0].device <= budget:
            return n
    return None


def _largest_micro_batch(sim: _Simulator, config: dict[str, Any], world_size: int, budget: int, rows: int | None) -> tuple[int, int] | None:
    """(rows, peak) of the largest micro-batch (rows / 2, / 4, ...) that fits with ``config``; None when none does or
    the batch cannot be cut."""
    if not rows or rows < 2:
        return None
    divisor = 2
    while rows // divisor >= 1:
        try:
            estimate, _ = sim.step(config, world_size, divisor)
        except AutoShardError:
            return None
        if estimate.device <= budget:
            return rows // divisor, estimate.device
        if rows // divisor == 1:
            return None
        divisor *= 2
    return None


def decide(
    module: Any,
    batch: Any,
    intent: ShardingIntent,
    world_size: int,
    *,
    num_nodes: int = 1,
    devices_per_node: int | None = None,
    budget: str | int | None = None,
    precision: Any = None,
    callbacks: Sequence[Any] = (),
    rates: Rates | None = None,
    progress: Callable[[str], None] | None = None,
    backend: str = FSDP2,
) -> BudgetDecision:
    """The cheapest configuration whose simulated peak per rank fits ``intent.memory_budget`` (or ``budget``) on
    ``world_size`` ranks: a pure function of the module's shapes, the batch's shapes, the intent and the world.

    ``backend``: fsdp2, or DeepSpeed ZeRO-3 ('deepspeed'), where offload is the one field chosen and each peak is
    DeepSpeed's estimator plus the simulated activations (the cost order above says why).

    ``module``: a LightningModule (real or on meta; copied to meta for each simulated step, never changed) or a
    function building one. ``batch``: one micro-batch as ``training_step`` receives it (tensors are read for shapes
    only), or a function returning one. Fields the user set (not at their defaults) are kept; the free ones among
    reshard_after_forward, activation_checkpointing, offload and (with several nodes) shard_size are chosen, in the
    cost order of this module's header. ``devices_per_node`` places larger world sizes on whole nodes.

    Refuses (``BudgetRefusedError``, before anything is sharded) when nothing fits, naming the smallest world size at
    which something does (a search: states shrink with ranks, activations do not), or, when none does, the largest
    micro-batch that fits here.

    In a process whose process group is already live, the simulated steps run in a forked child (their fake group
    cannot coexist with a live one); the answer is the same.
    """
    import torch.distributed as dist

    from autoshard.activations import describe_batch
    from autoshard.precision import resolve_precision
    from autoshard.units import parse_size

    if dist.is_available() and dist.is_initialized():
        args = dict(
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            budget=budget,
            precision=precision,
            callbacks=callbacks,
            rates=rates,
            progress=progress,
            backend=backend,
        )
        return _beside_live_group(lambda: decide(module, batch, intent, world_size, **args))

    budget_bytes = parse_size(budget, option="memory_budget", example="70GiB", error=IntentError) if budget is not None else intent.memory_budget
    if budget_bytes is None:
        raise IntentError("decide needs a memory budget. Fix: ShardingIntent(memory_budget='70GiB'), or decide(..., budget='70GiB')")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise IntentError(f"world size must be a positive integer, got {world_size!r}. Fix: Trainer(devices=N, num_nodes=M) with N, M >= 1")
    if intent.tensor_parallel_size > 1:
        raise IntentError(
            f"memory_budget with tensor_parallel_size={intent.tensor_parallel_size} is not decided yet: the simulated step runs"
            f" data parallel only. Fix: drop memory_budget and set the fields yourself, or set tensor_parallel_size=1"
        )
    backend = check_budget_intent(intent.replace(memory_budget=budget_bytes), backend)
    make_batch = batch_function(batch)
    rates = rates or Rates()
    precision = precision or resolve_precision(None, intent)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise IntentError(f"num_nodes={num_nodes!r} does not divide the world size {world_size}. Fix: Trainer(devices=N, num_nodes=M) with N, M >= 1")
    if devices_per_node is None:  # larger world sizes come in whole nodes: of these ranks, or of a usual 8-GPU node
        devices_per_node = world_size // num_nodes if num_nodes > 1 else max(world_size, DEVICES_PER_NODE)
    if num_nodes == 1:
        from autoshard.memory import nodes_for

        num_nodes = nodes_for(world_size, devices_per_node)
    sim = _Simulator(
        meta_factory(module, callbacks),
        make_batch,
        intent.replace(memory_budget=None, pinned=()),
        precision,
        devices_per_node,
        num_nodes,
        progress,
        backend,
    )
    with torch.device("meta"):
        described = describe_batch(make_batch())
    free = _free_fields(intent, num_nodes, backend)
    kept = _kept(intent, free, backend)
    blocks = sim.blocks() if "activation_checkpointing" in free else 0
    chosen, cheaper, most = _search(sim, world_size, budget_bytes, rates, free, blocks)
    if chosen is not None:
        return BudgetDecision(budget_bytes, world_size, chosen.config, chosen.peak, chosen.cost, cheaper, described, kept, rates, num_nodes, backend)
    peak = sim.step(most, world_size)[0].device
    where = f"world size {world_size}" + (f" ({num_nodes} nodes)" if num_nodes > 1 else "")
    head = (
        f"memory_budget {fmt_bytes(budget_bytes)} per rank cannot be met at {where}"
        + (" under DeepSpeed ZeRO-3 (its estimator + the simulated activations)" if backend == DEEPSPEED else "")
        + f": even {describe_config(most)} peaks at {fmt_bytes(peak)} per rank on the micro-batch {described}"
        + (
            f" (under DeepSpeed autoshard sets the offload only{'' if 'offload' in free else ', and you set it'}; strategy='fsdp2'"
            f" can also checkpoint activations)"
            if backend == DEEPSPEED
            else ""
        )
    )
    smallest = _smallest_world(sim, most, world_size, budget_bytes)
    if smallest is not None:
        raise BudgetRefusedError(
            f"{head}. The smallest world size at which a configuration fits is {smallest} (found by search: model states"
            f" shrink with ranks, activations do not). Fix: run on {smallest} ranks (Trainer(devices=..., num_nodes=...)),"
            f" or raise memory_budget to {fmt_bytes(peak)}",
            smallest,
        )
    rows = batch_rows(make_batch)
    smaller = _largest_micro_batch(sim, most, world_size, budget_bytes, rows)
    tail = f"no world size up to {MAX_DECISION_RANKS} fits: activations and what stays whole do not shrink with ranks"
    if smaller is not None:
        n, fits_at = smaller
        raise BudgetRefusedError(
            f"{head}; {tail}. A micro-batch of {n} (was {rows}) fits here with {describe_config(most)} (peak {fmt_bytes(fits_at)})."
            f" Fix: DataLoader(batch_size={n}) with Trainer(accumulate_grad_batches={rows // n}) keeps the global batch",
            None,
            n,
        )
    raise BudgetRefusedError(
        f"{head}; {tail}, and no smaller micro-batch fits either"
        + ("" if rows else " (the batch's tensors do not share dim 0, so none was tried)")
        + ". Fix: a smaller model or sequence, or devices with more memory",
        None,
    )


def check_budget_intent(intent: ShardingIntent, backend: str) -> str:
    """Refuse a memory budget ``backend`` cannot decide for this intent (at a strategy's construction, and in
    ``decide``); returns the backend's canonical name."""
    name = get_backend(backend).name
    if name not in (FSDP2, DEEPSPEED):
        raise IntentError(f"memory_budget decides for fsdp2 and DeepSpeed ZeRO-3, not {name}. Fix: backend='fsdp2'")
    if name == DEEPSPEED and intent.memory_budget is not None and intent.activation_checkpointing is not False:
        raise IntentError(
            f"memory_budget under DeepSpeed cannot count activation_checkpointing={intent.activation_checkpointing!r}: autoshard"
            f" does not checkpoint blocks under DeepSpeed (your blocks' own deepspeed.checkpointing.checkpoint calls do), so"
            f" the simulated step cannot know which activations they recompute, and a decision could choose an offload"
            f" your run does not need, or one that does not fit. What works: strategy='fsdp2', where memory_budget checkpoints"
            f" blocks itself and chooses how many. Fix: drop memory_budget and set offload yourself (autoshard explain"
            f" --backend deepspeed --batch FILE.py:make_batch shows each peak), or use strategy='fsdp2'"
        )
    return name


def _kept(intent: ShardingIntent, free: list[str], backend: str) -> tuple[str, ...]:
    """The fields the decision leaves as the user set them (under DeepSpeed, those it has no say in are not named)."""
    fields = ("offload",) if backend == DEEPSPEED else FREE_FIELDS
    return tuple(f for f in fields if f not in free and (f != "shard_size" or intent.shard_size is not None))


def decide_at_fit(module: Any, batch: Any, intent: ShardingIntent, world_size: int, *, num_nodes: int = 1, **kwargs: Any) -> BudgetDecision:
    """``decide`` as a strategy calls it at setup, on rank 0, before anything is sharded (then it broadcasts
    ``to_dict()`` to the other ranks). The same function: named for the call site."""
    return decide(module, batch, intent, world_size, num_nodes=num_nodes, **kwargs)


def _beside_live_group(run: Callable[[], BudgetDecision]) -> BudgetDecision:
    """``run()`` in a forked child (``activations.in_detached_world``): a live process group (a strategy's setup, a
    Trainer that ran before) and the simulated steps' fake one cannot coexist in one process. Errors come back as
    the same types."""
    from autoshard.activations import in_detached_world

    answer = in_detached_world(lambda: run().to_dict())
    if "error" in answer:
        error = answer["error"]
        if error["type"] == BudgetRefusedError.__name__:
            raise BudgetRefusedError(error["message"], error.get("min_world_size"), error.get("micro_batch"))
        raise (IntentError if error["type"] == IntentError.__name__ else AutoShardError)(error["message"])
    return BudgetDecision.from_dict(answer["result"])


def resume_decision(
    stored: dict[str, Any] | None, intent: ShardingIntent, world_size: int, backend: str = FSDP2
) -> tuple[BudgetDecision | None, str]:
    """At resume: the stored decision when the budget and the world are the same (so the run trains as before), else
    None and the sentence to log saying why it is decided again ("" when nothing was stored). A decision for another
    backend, or whose chosen fields you have set by hand since, is decided again too (it would override them)."""
    if not stored:
        return None, ""
    decision = BudgetDecision.from_dict(stored)
    backend = get_backend(backend).name
    changed = []
    if decision.budget != intent.memory_budget:
        changed.append(f"memory_budget {fmt_bytes(decision.budget)} -> {fmt_bytes(intent.memory_budget) if intent.memory_budget else 'none'}")
    if decision.world_size != world_size:
        changed.append(f"world size {decision.world_size} -> {world_size}")
    if decision.backend != backend:
        changed.append(f"backend {decision.backend} -> {backend}")
    else:  # the decision chose exactly the fields left free then: the same ones must be free now
        free = set(_free_fields(intent, decision.num_nodes, backend))
        if set(decision.chosen) - free:
            changed.append(f"you now set {', '.join(sorted(set(decision.chosen) - free))}")
        if free - set(decision.chosen):
            changed.append(f"you no longer set {', '.join(sorted(free - set(decision.chosen)))}")
    if changed:
        return None, f"autoshard memory budget: decided again, the checkpoint's decision was for another run ({'; '.join(changed)})"
    return decision, f"autoshard memory budget: kept the checkpoint's decision ({describe_config(decision.chosen)})"


def stored_differs(stored: dict[str, Any] | None, current: BudgetDecision | None) -> str:
    """When a checkpoint loads: the warning to give when it holds a decision for this same budget, world and backend
    that differs from the one this run trains with ("" otherwise). It happens only when the stored decision could not
    be read before sharding (``resume_decision``) and the fresh one came out otherwise (another batch shape, another
    autoshard): the values train the same (these fields change memory and speed, not the maths), the peak does not."""
    if not stored or current is None:
        return ""
    before = BudgetDecision.from_dict(stored)
    same_run = (before.budget, before.world_size, before.backend) == (current.budget, current.world_size, current.backend)
    if not same_run or before.chosen == current.chosen:
        return ""
    return (
        f"autoshard memory budget: the checkpoint's run trained with {describe_config(before.chosen)} (peak {fmt_bytes(before.peak)})"
        f" for this budget and world, and this run was decided again before the checkpoint could be read: it trains with"
        f" {describe_config(current.chosen)} (peak {fmt_bytes(current.peak)}); the values are the same, memory and speed differ."
        f" Fix: to train as before, drop memory_budget and set ShardingIntent({', '.join(f'{k}={v!r}' for k, v in before.chosen.items())})"
    )


def auto_entries(factory: Any, batch: Any, intent: ShardingIntent, world_sizes: Sequence[int], budget: int, **kwargs: Any) -> list[dict[str, Any]]:
    """``explain --budget B --json``'s "auto": per world size, ``BudgetDecision.to_dict()`` (``chosen``, ``peak``,
    ``cheaper``: each with its ``config`` and ``peak``), or ``{"world_size", "budget", "error": {"type", "message",
    "min_world_size"}}`` when there is no decision (``min_world_size``: None when no world size fits)."""
    out: list[dict[str, Any]] = []
    for n in world_sizes:
        try:
            out.append(decide(factory, batch, intent, n, budget=budget, **kwargs).to_dict())
        except AutoShardError as exc:
            error = {"type": type(exc).__name__, "message": str(exc), "min_world_size": getattr(exc, "min_world_size", None)}
            out.append({"world_size": n, "budget": budget, "error": error})
    return out


__all__ = [
    "BudgetDecision",
    "BudgetReport",
    "Change",
    "Option",
    "check_budget",
    "check_budget_intent",
    "BudgetRefusedError",
    "Cost",
    "Rates",
    "Tried",
    "auto_entries",
    "batch_function",
    "batch_rows",
    "cut_batch",
    "decide",
    "decide_at_fit",
    "describe_config",
    "meta_factory",
    "price",
    "resume_decision",
    "stored_differs",
]
