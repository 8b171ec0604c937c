"""``autoshard explain --budget 80GiB``: does the run fit, and if not, the fewest changes that would.

Each candidate is estimated again in full (a simulated step where one can run), never scaled from the first
estimate: activation checkpointing, offload and a smaller micro-batch change activations and states in ways a ratio
would get wrong. Changes are listed cheapest first, by what they cost the run, not by memory saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from autoshard.budget.batch import largest_micro_batch
from autoshard.budget.decision import Headroom
from autoshard.budget.ranks import MAX_RANKS, smallest_world
from autoshard.intent import ShardingIntent
from autoshard.memory import MemoryEstimate, fmt_bytes


@dataclass(frozen=True)
class Option:
    """One way to run: the intent, the world size and the micro-batch (a fraction of the given one).
    ``simulate=False``: model states only, fast, to search before one simulation confirms."""

    intent: ShardingIntent
    world_size: int
    batch_divisor: int = 1
    simulate: bool = True


Evaluate = Callable[[Option], MemoryEstimate]  # explain's: the memory table's maths plus a simulated step


@dataclass(frozen=True)
class Change:
    change: str  # what to set, as the user writes it
    cost: str  # what the run pays for it
    peak: int  # device bytes per rank with the change
    fits: bool  # never True when ``missing``: a lower bound under the budget proves nothing
    missing: str = ""  # the part of the step its estimate lacks (its simulated step could not run), "" when whole


@dataclass(frozen=True)
class BudgetReport:
    """The verdict. ``missing`` names the part of the step the peak lacks: then the peak is a lower bound, so ``fits``
    is None ("cannot tell") unless even that bound is over the budget."""

    budget: int
    world_size: int
    peak: int
    fits: bool | None
    changes: tuple[Change, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    missing: str = ""
    headroom: Headroom = field(default_factory=Headroom)  # kept free beside the peak, as decide keeps it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        head = f"budget {fmt_bytes(self.budget)} per rank, world size {self.world_size}: peak"
        share = f" ({self.peak / self.budget:.0%} of the budget)"
        if self.headroom != Headroom():
            limit = self.headroom.limit(self.budget)
            if limit < 1:  # check_budget's note says why, with the Fix
                return "\n".join(
                    [f"budget {fmt_bytes(self.budget)} per rank: less than its {self.headroom.words()}: does NOT fit"]
                    + [f"  note: {n}" for n in self.notes]
                )
            head = f"budget {fmt_bytes(self.budget)} per rank, less its {self.headroom.words()} (the peak may reach {fmt_bytes(limit)}), world size {self.world_size}: peak"
            share = f" ({self.peak / limit:.0%} of what it may reach)"
        if self.missing:
            verdict = "cannot tell whether it fits" if self.fits is None else "does NOT fit, even without them"
            head += f" at least {fmt_bytes(self.peak)}{share} with {self.missing} not counted: {verdict}"
        else:
            head += f" {fmt_bytes(self.peak)}{share}: {'fits' if self.fits else 'does NOT fit'}"
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
    evaluate: Evaluate, intent: ShardingIntent, world_size: int, budget: int, *, ask: Ask, headroom: Headroom | None = None
) -> BudgetReport:
    """The verdict for ``world_size`` and, when it does not fit, the fewest changes that do (``_Advisor.advise``).
    A partial estimate (``ask.lacks``) is never "fits": a lower bound under the budget proves nothing. A peak fits
    when it leaves ``headroom`` free, as ``decide`` judges it, so that the advice and the decision agree."""
    headroom = headroom or Headroom()
    limit = headroom.limit(budget)
    current = evaluate(Option(intent, world_size))
    if limit < 1:  # as decide refuses it: no configuration leaves the headroom free
        why = (
            f"the budget is less than the {headroom.words()} a CUDA run keeps free beside its tensors (CUDA context,"
            f" communication buffers, allocator fragmentation), so no configuration fits. Fix: --budget of the whole device,"
            f" or --intent memory_budget={budget} --intent memory_headroom=0 to let tensors fill it, or --accelerator cpu for a CPU run"
        )
        return BudgetReport(budget, world_size, current.device, False, (), (why,), headroom=headroom)
    missing = ask.lacks(current)
    if missing:
        why = f"no change is estimated: each estimate would lack {missing} too"
        return BudgetReport(budget, world_size, current.device, None if current.device <= limit else False, (), (why,), missing, headroom)
    if current.device <= limit:
        return BudgetReport(budget, world_size, current.device, True, headroom=headroom)
    advisor = _Advisor(evaluate, intent, world_size, limit, ask)
    advisor.advise()
    return BudgetReport(budget, world_size, current.device, False, tuple(advisor.changes), tuple(advisor.notes), headroom=headroom)


@dataclass(frozen=True)
class Ask:
    """What ``check_budget`` may propose: ``batch_rows`` None when the batch cannot be cut along dim 0,
    ``checkpointable`` False when no block can be checkpointed; ``lacks``: the part of the step an estimate lacks."""

    devices_per_node: int
    batch_rows: int | None
    checkpointable: bool = True
    lacks: Callable[[MemoryEstimate], str] = lambda estimate: ""


_WORDS = {"ac": "activation_checkpointing=True", "offload": "offload='params' (CPU memory)"}


class _Advisor:
    """One ``check_budget`` search: the changes estimated so far (``changes``) and why some were not (``notes``)."""

    def __init__(self, evaluate: Evaluate, intent: ShardingIntent, world_size: int, budget: int, ask: Ask) -> None:
        self.evaluate, self.intent, self.world_size, self.budget, self.ask = evaluate, intent, world_size, budget, ask
        self.rows = ask.batch_rows
        self.changes: list[Change] = []
        self.notes: list[str] = []
        # The changes on these ranks, cheapest first: activation checkpointing (about a third more compute, same
        # results), a smaller micro-batch (gradient accumulation keeps the global batch), offload.
        self.singles: dict[str, tuple[dict[str, Any], str]] = {}
        if not intent.activation_checkpointing and ask.checkpointable:
            self.singles["ac"] = ({"activation_checkpointing": True}, "~1/3 more compute (forward recomputed in backward)")
        if intent.offload == "none":
            self.singles["offload"] = ({"offload": "params"}, "host-device copies every step (often 2-5x slower)")

    def add(self, change: str, cost: str, option: Option) -> Change:
        estimate = self.evaluate(option)
        peak, gap = estimate.device, self.ask.lacks(estimate)
        made = Change(change, cost, peak, peak <= self.budget and not gap, gap)
        self.changes.append(made)
        return made

    def full(self, asked: ShardingIntent, ranks: int, divisor: int = 1) -> MemoryEstimate | None:
        """``asked``'s estimate on ``ranks`` with the micro-batch / ``divisor``; None when it lacks part of the step."""
        estimate = self.evaluate(Option(asked, ranks, divisor))
        return None if self.ask.lacks(estimate) else estimate

    def smallest_world(self, asked: ShardingIntent, divisor: int = 1) -> int | None:
        """The smallest world size above this one at which ``asked`` fits (``ranks.smallest_world``)."""
        states = lambda n: self.evaluate(Option(asked, n, divisor, simulate=False))  # noqa: E731
        return smallest_world(asked, self.world_size, self.ask.devices_per_node, self.budget, lambda n: self.full(asked, n, divisor), states)

    def micro_batch(self, asked: ShardingIntent, ranks: int) -> int:
        """The divisor of the largest micro-batch that fits with ``asked`` (``batch.largest_micro_batch``, predicted
        from the whole batch's activations), else where the search stopped."""
        whole = self.evaluate(Option(asked, ranks))
        return largest_micro_batch(self.rows or 0, self.budget, lambda d: self.full(asked, ranks, d), whole)[0]

    def more_ranks(self) -> None:
        """1. More ranks: the same method and batch, more hardware. Under hybrid sharding states divide by the shard
        group, not the world, so the group grows instead."""
        intent, world_size = self.intent, self.world_size
        if intent.shard_size is None:
            ranks = self.smallest_world(intent)
            if ranks is not None:
                self.add(f"{ranks} ranks (Trainer num_nodes x devices)", f"{ranks / world_size:g}x the devices", Option(intent, ranks))
            else:
                self.notes.append(f"no world size up to {MAX_RANKS} fits: activations and what stays whole do not shrink with ranks")
            return
        # a bigger shard group, up to every rank: states shrink, and more of the gathers cross nodes
        group = self.ask.devices_per_node if intent.shard_size == "node" else int(intent.shard_size)
        size = group * 2
        while size < world_size:
            if world_size % size == 0:
                change = f"shard_size={size} (was {intent.shard_size!r})"
                if self.add(change, f"gathers span {size} ranks", Option(intent.replace(shard_size=size), world_size)).fits:
                    return
                self.changes.pop()
            size *= 2
        if group < world_size:  # a group of every rank is already pure FSDP
            change = "shard_size=None (shard over every rank)"
            self.add(change, "gathers and reduce-scatters cross nodes", Option(intent.replace(shard_size=None), world_size))

    def asked(self, keys: tuple[str, ...]) -> ShardingIntent:
        """The intent with the changes ``keys`` name ("mb", a smaller micro-batch, changes no field)."""
        return self.intent.replace(**{k: v for key in keys if key != "mb" for k, v in self.singles[key][0].items()})

    def try_combo(self, keys: tuple[str, ...], ranks: int, ranks_cost: str = "") -> Change:
        asked = self.asked(keys)
        parts = [_WORDS[key] for key in keys if key != "mb"]
        costs = [self.singles[key][1] for key in keys if key != "mb"]
        divisor = 1
        if "mb" in keys:
            divisor = self.micro_batch(asked, ranks)
            parts.append(f"micro-batch {(self.rows or 0) // divisor} (was {self.rows})")
            costs.append(f"{divisor}x Trainer(accumulate_grad_batches=...) keeps the global batch; {divisor}x the steps")
        if ranks != self.world_size:
            parts.insert(0, f"{ranks} ranks")
            costs.insert(0, ranks_cost)
        return self.add(" + ".join(parts), "; ".join(costs), Option(asked, ranks, divisor))

    def advise(self) -> None:
        """Each change alone, cheapest first; then the fewest changes together, first on these ranks, then with the
        fewest ranks. Every combination tried is listed, the ones that fit and those that did not."""
        self.more_ranks()
        if "ac" in self.singles:
            self.try_combo(("ac",), self.world_size)
        if self.rows is not None and self.rows > 1:
            self.try_combo(("mb",), self.world_size)
        elif self.rows is None:
            self.notes.append("a smaller micro-batch is not estimated: pass --batch with tensors that share dim 0")
        if "offload" in self.singles:
            self.try_combo(("offload",), self.world_size)
        if any(c.fits or c.missing for c in self.changes):
            return
        available = [k for k in ("ac", "mb", "offload") if k in self.singles or (k == "mb" and self.rows and self.rows > 1)]
        for size in range(2, len(available) + 1):
            found = [self.try_combo(keys, self.world_size) for keys in itertools.combinations(available, size)]
            if any(c.fits for c in found):
                return
        if self.intent.shard_size is None:
            self.with_fewest_ranks(available)

    def with_fewest_ranks(self, available: list[str]) -> None:
        """Nothing fits on these ranks: the smallest world size for each combination, fewest changes first."""
        for size in range(1, len(available) + 1):
            fitted = False
            for keys in itertools.combinations(available, size):
                asked = self.asked(keys)
                divisor = self.micro_batch(asked, self.world_size) if "mb" in keys else 1
                ranks = self.smallest_world(asked, divisor)
                if ranks is not None:
                    fitted = self.try_combo(keys, ranks, f"{ranks / self.world_size:g}x the devices").fits or fitted
            if fitted:
                return
