"""Memory budgets: ``autoshard explain --budget 80GiB`` (does the run fit, and if not, the fewest changes that would),
and ``ShardingIntent(memory_budget=...)`` (``decide``: the cheapest configuration whose simulated peak fits).

One module per concern, bottom to top (the import-linter contract in pyproject.toml keeps this order):

- ``ranks``: the world sizes a run can have, and the part of an estimate that shrinks with them;
- ``decision``: the values (``BudgetDecision``, ``Tried``, ``Cost``, ``Rates``, ``BudgetRefusedError``) and the fields
  a decision chooses;
- ``batch`` and ``meta``: what a decision is made on (one micro-batch, the module copied to meta);
- ``simulator``: model states and simulated steps for one module and batch, cached;
- ``search``: the price of a configuration and the search for the cheapest that fits (``price``);
- ``advice`` (``check_budget``: ``explain --budget``), ``decide`` (``decide``, ``auto_entries``)
  and ``resume`` (``resume_decision``, ``stored_differs``).
"""

from __future__ import annotations

from autoshard.budget.advice import Ask, BudgetReport, Option, check_budget
from autoshard.budget.batch import batch_function, batch_rows, batch_tokens, cut_batch
from autoshard.budget.decide import DecideOptions, auto_entries, decide
from autoshard.budget.decision import (
    CUDA_HEADROOM,
    RATES_ENV,
    BudgetDecision,
    BudgetRefusedError,
    Cost,
    Headroom,
    Rates,
    default_rates,
    describe_config,
    read_rates,
)
from autoshard.budget.ranks import whole_nodes
from autoshard.budget.resume import resume_decision, stored_differs
from autoshard.budget.search import price
from autoshard.budget.simulator import ModelStates, Subject

__all__ = [
    "CUDA_HEADROOM",
    "RATES_ENV",
    "Subject",
    "default_rates",
    "read_rates",
    "Headroom",
    "Ask",
    "BudgetDecision",
    "BudgetReport",
    "ModelStates",
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
    "price",
    "resume_decision",
    "stored_differs",
    "whole_nodes",
]
