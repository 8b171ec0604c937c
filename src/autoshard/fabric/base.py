"""Fabric's side of ``engine.base.BackendMixin``, mixed in first by every autoshard Fabric strategy: messages in
Fabric's terms, Fabric's precision plugin, and a memory budget refused (Fabric's step is the user's own loop)."""

from __future__ import annotations

from typing import Any

from autoshard.engine.base import BackendMixin
from autoshard.engine.front_end import FABRIC
from autoshard.errors import IntentError
from autoshard.units import fmt_bytes


class FabricBackend(BackendMixin):
    """``BackendMixin`` (precision resolved once, the launch and construction checks, the selector) for Fabric's
    strategies: Fabric calls the same ``_configure_launcher`` last when ``Fabric()`` is built, and holds the precision
    plugin as ``precision``."""

    front = FABRIC

    @property
    def precision_plugin(self) -> Any:
        return self.precision  # type: ignore[attr-defined]

    def _check_construction(self) -> None:
        budget = self._intent_to_check().memory_budget
        if budget is not None:  # never ignored in silence: the Trainer's strategies decide it at fit, these do not yet
            raise IntentError(
                f"memory_budget={fmt_bytes(budget)} is decided at fit only under a Lightning Trainer (autoshard.lightning.budget,"
                f" which simulates the LightningModule's training_step on the first training batch); under Fabric the step"
                f" is your own loop, which autoshard cannot simulate, so Fabric's strategies do not decide it, and it would be"
                f" ignored. Fix: decide it once with autoshard.budget.decide(module, batch, intent, world_size) on a"
                f" LightningModule whose training_step runs your step, and pass its .chosen fields to the intent instead of"
                f" memory_budget"
            )
        super()._check_construction()
