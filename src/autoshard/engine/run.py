"""The run a strategy trains, decided at setup before anything is planned or sharded, then only read: the intent as
the user built the strategy (kept), the one the run trains with (ShardingIntent(memory_budget=...)'s chosen fields
taken), the budget's decision, and what was resolved when the Trainer or Fabric was built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelDims
from autoshard.precision import PrecisionPlan

if TYPE_CHECKING:
    from autoshard.budget import BudgetDecision


@dataclass(frozen=True)
class Run:
    """One run's decided inputs: a strategy's ``intent`` and ``budget_decision`` read them once it is made."""

    requested: ShardingIntent  # as the user built the strategy: never replaced
    intent: ShardingIntent  # what the run trains with: the requested intent with the budget's chosen fields
    dims: ParallelDims | None  # resolved when the Trainer (or Fabric) was built
    precision: PrecisionPlan | None  # likewise
    budget: BudgetDecision | None = None  # saved with every checkpoint, so a resume keeps it

    @classmethod
    def decided(cls, requested: ShardingIntent, dims: ParallelDims | None, precision: PrecisionPlan | None, budget: BudgetDecision | None) -> Run:
        return cls(requested, requested if budget is None else budget.intent(requested), dims, precision, budget)
