"""FSDP1 (``strategy="fsdp"``): listed so that every request for it gets the same refusal and redirect."""

from __future__ import annotations

from autoshard.backends.base import Availability, Backend
from autoshard.capability import Cell, Feature, Support

REASON = (
    "FSDP1's flat-parameter training state machine breaks methods that run several forwards per step"
    " (DINO, I-JEPA, BYOL multi-crop), and FSDP2 covers everything it does, so autoshard does not drive it"
)
REMEDY = "use strategy='fsdp2' (same memory savings, per-parameter sharding)"
ROW = {feature: Cell(Support.REJECTED, REASON, REMEDY) for feature in Feature}


def check() -> Availability:
    return Availability(False, "FSDP1 is refused by autoshard", REMEDY)


BACKEND = Backend(name="fsdp1", strategy="fsdp", row=ROW, check=check)
