"""The Trainer's side of ``engine.base.BackendMixin``, mixed in first by every autoshard Trainer strategy: messages in
the Trainer's terms, and the train DataLoader handed back what the memory budget's peek read from it."""

from __future__ import annotations

from autoshard.engine.base import BackendMixin
from autoshard.engine.front_end import TRAINER


class TrainerBackend(BackendMixin):
    """``BackendMixin`` (precision resolved once, the launch and construction checks, the selector) under the Trainer."""

    front = TRAINER

    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's hook for each DataLoader it prepares: the train one gets back the batch the memory budget's
        peek read from it when a fresh iteration would not yield it again (``lightning.budget.hand_back``)."""
        from autoshard.lightning.budget import hand_back

        return hand_back(self, super().process_dataloader(dataloader))  # type: ignore[misc]
