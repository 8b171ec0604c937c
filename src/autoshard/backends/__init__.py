"""The backends autoshard knows, each in its own module: its matrix row and how to tell it is installed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from packaging.version import Version

from autoshard.capability import Feature, Row
from autoshard.errors import IntentError


@dataclass(frozen=True)
class Availability:
    """Whether a backend can be used here; ``fix`` is the install command when it cannot."""

    ok: bool
    detail: str
    fix: str = ""


def require(package: str, minimum: str, install: str) -> Availability:
    """Check an installed distribution against a minimum version, without importing it."""
    try:
        found = metadata.version(package)
    except metadata.PackageNotFoundError:
        return Availability(False, f"{package} is not installed", install)
    if Version(found).release < Version(minimum).release:
        return Availability(False, f"{package} {found} is older than the required {minimum}", install)
    return Availability(True, f"{package} {found}")


def require_all(*checks: Availability) -> Availability:
    for check in checks:
        if not check.ok:
            return check
    return Availability(True, ", ".join(c.detail for c in checks))


@dataclass(frozen=True)
class Backend:
    """A sharding engine: its name, the Lightning strategy string users type, and its matrix row."""

    name: str
    strategy: str
    row: Row
    check: Callable[[], Availability]
    summary: str

    def __post_init__(self) -> None:
        missing = [f.value for f in Feature if f not in self.row]
        if missing:
            raise ValueError(f"backend {self.name} has no matrix cell for: {', '.join(missing)}")


def _load() -> dict[str, Backend]:
    from autoshard.backends import deepspeed, fsdp1, fsdp2

    return {b.name: b for b in (fsdp2.BACKEND, deepspeed.BACKEND, fsdp1.BACKEND)}


BACKENDS: dict[str, Backend] = _load()
ALIASES: dict[str, str] = {"deepspeed": "deepspeed_zero3", "zero3": "deepspeed_zero3", "fsdp": "fsdp1"}


def get_backend(name: str) -> Backend:
    key = ALIASES.get(name.lower().replace("-", "_"), name.lower().replace("-", "_"))
    if key not in BACKENDS:
        raise IntentError(f"unknown backend {name!r}: choose one of 'auto', {', '.join(map(repr, BACKENDS))}")
    return BACKENDS[key]
