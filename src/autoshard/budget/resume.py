"""A decision stored in a checkpoint: kept at resume when the run is the same, and the warning when it differs."""

from __future__ import annotations

from typing import Any

from autoshard.backends import get_backend
from autoshard.budget.decision import BudgetDecision, describe_config, free_fields
from autoshard.intent import ShardingIntent
from autoshard.memory import fmt_bytes


def resume_decision(
    stored: dict[str, Any] | None, intent: ShardingIntent, world_size: int, backend: str = "fsdp2", *, batch: str | None = None
) -> tuple[BudgetDecision | None, str]:
    """At resume: the stored decision when the run is the same (budget, world, backend, free fields and micro-batch
    ``batch``, as ``describe_batch`` says it), so it trains as before; else None and the sentence to log saying why
    it is decided again ("" when nothing was stored)."""
    if not stored:
        return None, ""
    decision = BudgetDecision.from_dict(stored)
    backend = get_backend(backend).name
    changed = []
    if decision.budget != intent.memory_budget:
        changed.append(f"memory_budget {fmt_bytes(decision.budget)} -> {fmt_bytes(intent.memory_budget) if intent.memory_budget else 'none'}")
    if decision.world_size != world_size:
        changed.append(f"world size {decision.world_size} -> {world_size}")
    if batch is not None and decision.batch and decision.batch != batch:
        changed.append(f"micro-batch {decision.batch} -> {batch}")
    if decision.backend != backend:
        changed.append(f"backend {decision.backend} -> {backend}")
    else:  # the decision chose exactly the fields left free then: the same ones must be free now
        free = set(free_fields(intent, decision.num_nodes, backend))
        if set(decision.chosen) - free:
            changed.append(f"you now set {', '.join(sorted(set(decision.chosen) - free))}")
        if free - set(decision.chosen):
            changed.append(f"you no longer set {', '.join(sorted(free - set(decision.chosen)))}")
    if changed:
        return None, f"autoshard memory budget: decided again, the checkpoint's decision was for another run ({'; '.join(changed)})"
    return decision, f"autoshard memory budget: kept the checkpoint's decision ({describe_config(decision.chosen)})"


def stored_differs(stored: dict[str, Any] | None, current: BudgetDecision | None) -> str:
    """When a checkpoint loads: the warning when it holds a decision for this same run that differs from the one this
    run trains with ("" otherwise): it could not be read before sharding, and the fresh one came out otherwise."""
    if not stored or current is None:
        return ""
    before = BudgetDecision.from_dict(stored)
    same_run = (before.budget, before.world_size, before.backend) == (current.budget, current.world_size, current.backend)
    same_run = same_run and (not before.batch or not current.batch or before.batch == current.batch)  # another micro-batch: another run
    if not same_run or before.chosen == current.chosen:
        return ""
    return (
        f"autoshard memory budget: the checkpoint's run trained with {describe_config(before.chosen)} (peak {fmt_bytes(before.peak)})"
        f" for this budget and world, and this run was decided again before the checkpoint could be read: it trains with"
        f" {describe_config(current.chosen)} (peak {fmt_bytes(current.peak)}); the values are the same, memory and speed differ."
        f" Fix: to train as before, drop memory_budget and set ShardingIntent({', '.join(f'{k}={v!r}' for k, v in before.chosen.items())})"
    )
