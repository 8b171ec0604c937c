"""The one Lightning range autoshard supports, and the record type of the private Lightning members it touches.

Each front end keeps its own list of those members (``autoshard.lightning.compat``, ``autoshard.fabric.compat``);
both list them as ``Private`` and verify them against ``SUPPORTED_LIGHTNING``. A strategy whose hooked member is gone
refuses to be built (``lightning_lacks``), with the pin.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from autoshard.errors import BackendUnavailableError

SUPPORTED_LIGHTNING = ">=2.6,<2.7"  # the minor release the members are verified on; pyproject.toml says the same
PIN = f'pip install "lightning{SUPPORTED_LIGHTNING}"'


@dataclass(frozen=True)
class Private:
    """``owner`` (a dotted class or module path) has ``name``: a method or class, or, with ``on_instance``, an
    attribute its ``__init__`` sets (only an instance shows it)."""

    owner: str
    name: str
    used_in: str
    why: str
    on_instance: bool = False
    without: str = ""  # what autoshard does when this Lightning lacks it (said by check_lightning)

    def __str__(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.name}"


def lightning_lacks(gone: list[str], hooked_by: str, works: str = "") -> BackendUnavailableError:
    """The refusal of a strategy whose hooked private members (``gone``) this Lightning lacks: Lightning would never
    call autoshard's overrides, so the strategy would run unchecked. ``works``: the backend that works, said."""
    return BackendUnavailableError(
        f"lightning {metadata.version('lightning')} lacks {', '.join(gone)}, which autoshard's {hooked_by}"
        f" (verified on lightning {SUPPORTED_LIGHTNING}).{works} Fix: {PIN}"
    )


__all__ = ["PIN", "SUPPORTED_LIGHTNING", "Private", "lightning_lacks"]
