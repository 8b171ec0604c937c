"""The Trainer's side of ``engine.base.BackendMixin``, mixed in first by every autoshard Trainer strategy: messages in
the Trainer's terms, the run decided at setup, and the train DataLoader handed back what the memory budget's peek read
from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning.pytorch.trainer.states import TrainerFn

from autoshard.engine.base import BackendMixin
from autoshard.engine.front_end import TRAINER
from autoshard.engine.run import Run

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from autoshard.budget import BudgetDecision


class TrainerBackend(BackendMixin):
    """``BackendMixin`` (precision resolved once, the launch and construction checks, the selector) under the Trainer."""

    front = TRAINER

    def _decide_run(self, trainer: pl.Trainer, decide_budget: Callable[[], BudgetDecision]) -> Run:
        """The run, made before anything is planned or sharded and read by every later step. The memory budget is
        decided into it once, at the first fit (``decide_budget``): a validate or test before it trains the request,
        one after it the fit's run."""
        due = self.requested.memory_budget is not None and self.budget_decision is None and trainer.state.fn == TrainerFn.FITTING
        if self.run is None or due:
            self.run = Run.decided(self.requested, self.dims, self.precision_plan, decide_budget() if due else None)
        return self.run

    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's hook for each DataLoader it prepares: the train one gets back the batch the memory budget's
        peek read from it when a fresh iteration would not yield it again (``lightning.budget.hand_back``)."""
        from autoshard.lightning.budget import hand_back

        return hand_back(self, super().process_dataloader(dataloader))  # type: ignore[misc]
