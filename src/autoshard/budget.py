"""``autoshard explain --budget 80GiB``: does the run fit in each rank's device memory, and if not, what would.

Each candidate change is estimated again in full (a simulated step where one can run), never scaled from the
first estimate: activation checkpointing, offload and a smaller micro-batch change activations and states in
ways a ratio would get wrong. Changes are listed cheapest first, by what they cost the run, not by memory saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from autoshard.intent import ShardingIntent
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
    """The verdict for ``world_size`` and, when it does not fit, every single change that does.

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

    # 1. More ranks: the same method and batch, more hardware. States shrink as 1/ranks, activations do not: the
    #    search predicts from the model states alone, then one simulated step confirms. Under hybrid sharding
    #    states divide by the shard group, not the world, so the group grows instead.
    if intent.shard_size is None:
        ranks = _whole_nodes(world_size * 2, devices_per_node)
        while ranks <= MAX_RANKS:
            states = evaluate(Option(intent, ranks, simulate=False))
            if current.device - _states_on_device(current) + _states_on_device(states) <= budget:
                if add(f"{ranks} ranks (Trainer num_nodes x devices)", f"{ranks / world_size:g}x the devices", Option(intent, ranks)).fits:
                    break
                changes.pop()
            ranks = _whole_nodes(ranks * 2, devices_per_node)
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
    # 2. Activation checkpointing: about a third more compute, same results.
    if not intent.activation_checkpointing:
        add(
            "activation_checkpointing=True",
            "~1/3 more compute (forward recomputed in backward)",
            Option(intent.replace(activation_checkpointing=True), world_size),
        )
    # 3. A smaller micro-batch: same global batch with gradient accumulation. Activations shrink about linearly:
    #    the prediction picks the largest micro-batch expected to fit, and one simulated step checks it.
    if batch_rows is not None and batch_rows > 1:
        divisor = 2
        while True:
            while batch_rows // divisor > 1 and current.device - current.activations * (1 - 1 / divisor) > budget:
                divisor *= 2
            made = add(
                f"micro-batch {batch_rows // divisor} (was {batch_rows})",
                f"{divisor}x Trainer(accumulate_grad_batches=...) keeps the global batch; {divisor}x the steps",
                Option(intent, world_size, divisor),
            )
            if made.fits or made.missing or batch_rows // divisor <= 1:  # a step that cannot run: no smaller one either
                break
            changes.pop()
            divisor *= 2
    elif batch_rows is None:
        notes.append("a smaller micro-batch is not estimated: pass --batch with tensors that share dim 0")
    # 4. Offload: states in CPU memory, slowest.
    if intent.offload == "none":
        add(
            "offload='params' (CPU memory)", "host-device copies every step (often 2-5x slower)", Option(intent.replace(offload="params"), world_size)
        )
    if not any(c.fits for c in changes):
        combined = intent.replace(activation_checkpointing=True, offload="params", shard_size=None)
        ranks = min(world_size * 8, MAX_RANKS)
        divisor = batch_rows if batch_rows else 1
        what = f"{ranks} ranks + activation_checkpointing=True + offload='params'" + (", micro-batch 1" if divisor > 1 else "")
        add(what, "all of the costs above", Option(combined, ranks, divisor))
    return BudgetReport(budget, world_size, current.device, False, tuple(changes), tuple(notes))


def _whole_nodes(ranks: int, devices_per_node: int) -> int:
    """``ranks`` rounded up to whole nodes once it exceeds one node (6 x 2 = 12 ranks on 8-device nodes: 16)."""
    return ranks if ranks <= devices_per_node else -(-ranks // devices_per_node) * devices_per_node


def _states_on_device(estimate: MemoryEstimate) -> int:
    return estimate.model_states - sum(getattr(estimate, c) for c in estimate.offloaded)


__all__ = ["BudgetReport", "Change", "Option", "check_budget"]
