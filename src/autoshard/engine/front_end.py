"""Which front end the user built, as a value (``TRAINER`` or ``FABRIC``), so one message text serves both."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import AutoShardError


@dataclass(frozen=True)
class FrontEnd:
    """How messages name the front end: ``name`` is what the user builds, ``the`` how a sentence refers to it."""

    name: str  # "Trainer" / "Fabric"
    the: str  # "the Trainer" / "Fabric"
    strategy_form: str  # how a fix names a strategy: "strategy='{}'" / "Fabric(strategy='{}')"
    checked: str  # what is checked at setup: "this method" / "these models"

    def call(self, arguments: str) -> str:
        """``Trainer(devices=2)`` / ``Fabric(devices=2)``."""
        return f"{self.name}({arguments})"

    def strategy(self, name: str) -> str:
        """A strategy as a fix names it: ``strategy='fsdp2'`` / ``Fabric(strategy='fsdp2')``."""
        return self.strategy_form.format(name)

    @property
    def possessive(self) -> str:
        return f"{self.the}'s"

    def restated(self, exc: AutoShardError) -> AutoShardError | None:
        """``exc``, raised where the Trainer or Fabric is built, in this front end's terms; None for the Trainer itself.
        Those texts (precision, the intent's sizes, the selector, the launch checks) are written in the Trainer's, and
        docs/guide.md quotes them so."""
        if self is TRAINER:
            return None
        text = str(exc).replace("Trainer(", f"{self.name}(").replace("the Trainer's", self.possessive)
        return type(exc)(text.replace("the Trainer", self.the))


TRAINER = FrontEnd("Trainer", "the Trainer", "strategy='{}'", "this method")
FABRIC = FrontEnd("Fabric", "Fabric", "Fabric(strategy='{}')", "these models")
