"""Memory budgets: ``autoshard explain --budget 80GiB`` (does the run fit, and if not, the fewest changes that would),
and ``ShardingIntent(memory_budget=...)`` (``decide``: the cheapest configuration whose simulated peak fits).
One module per concern (docs/architecture.md), in the order of the import-linter contract in pyproject.toml.
"""

from __future__ import annotations

from autoshard.budget.advice import Ask, BudgetReport, Option, check_budget
from autoshard.budget.batch import batch_function, batch_rows, batch_tokens, cut_batch
from autoshard.budget.decide import DecideOptions, auto_entries, decide
from autoshard.budget.decision import (
    CUDA_HEADROOM,
    RATES_ENV,
    RATES_FORMAT,
    BudgetDecision,
    BudgetRefusedError,
    Cost,
    Headroom,
    Rates,
    default_rates,
    describe_config,
    headroom_for,
    is_rates_file,
    read_rates,
)
from autoshard.budget.ranks import whole_nodes
from autoshard.budget.resume import resume_decision, stored_differs
from autoshard.budget.search import price
from autoshard.budget.simulator import ModelStates, Simulator, Subject

__all__ = [
    "CUDA_HEADROOM",
    "RATES_ENV",
    "RATES_FORMAT",
    "is_rates_file",
    "Subject",
    "default_rates",
    "read_rates",
    "Headroom",
    "Ask",
    "BudgetDecision",
    "BudgetReport",
    "ModelStates",
    "Simulator",
    "Option",
    "check_budget",
    "BudgetRefusedError",
    "Cost",
    "DecideOptions",
    "Rates",
    "auto_entries",
    "batch_function",
    "batch_rows",
    "batch_tokens",
    "cut_batch",
    "decide",
    "describe_config",
    "headroom_for",
    "price",
    "resume_decision",
    "stored_differs",
    "whole_nodes",
]
