"""What a backend is (its ``Backend`` record) and how one checks it is installed: below every engine module, so
``backends/<b>.py`` imports this and the registry (``backends/__init__``) imports the engines, never the reverse."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version

from autoshard.capability import Feature, Format, Row, Support

if TYPE_CHECKING:
    from autoshard.memory_model import Layout, MemoryEstimate, RankInputs
    from autoshard.precision import PrecisionPlan


@dataclass(frozen=True)
class Availability:
    """Whether a backend can be used here; ``fix`` is the install command when it cannot."""

    ok: bool
    detail: str
    fix: str = ""


def require(package: str, minimum: str, install: str) -> Availability:
    """Check an installed distribution against a minimum version, without importing it (importing deepspeed is slow).

    Release numbers are compared, so nightly and local builds such as ``2.6.0a0+git1234`` count as 2.6.0.
    """
    try:
        found = metadata.version(package)
    except metadata.PackageNotFoundError:
        return Availability(False, f"{package} is not installed", install)
    try:
        too_old = Version(found).release < Version(minimum).release
    except InvalidVersion:  # an odd local build: it is installed, and refusing it would block a working setup
        return Availability(True, f"{package} {found} (version not checked)")
    if too_old:
        return Availability(False, f"{package} {found} is older than the required {minimum}", f'pip install -U "{package}>={minimum}"')
    return Availability(True, f"{package} {found}")


def require_all(*checks: Availability) -> Availability:
    """The first failed check, or one that lists every version found."""
    failed = next((c for c in checks if not c.ok), None)
    return failed or Availability(True, ", ".join(c.detail for c in checks))


@dataclass(frozen=True)
class BudgetChoices:
    """What ``memory_budget`` may choose on a backend and how it prices it (``autoshard.budget.search``'s cost order).

    ``offload``: least saving first; ``compile``: whether ``compile='auto'`` lets it compile the blocks; ``host_bytes``:
    host-device bytes per step of an offload; ``peaks``: what its peaks are, in the decision's words ("" the simulated
    step's own); ``limits``: what a decision there cannot change; ``check``: "module:function" refusing an intent the
    backend cannot run ("" none).
    """

    fields: tuple[str, ...]
    offload: tuple[str, ...]
    selective: bool
    host_bytes: Callable[[MemoryEstimate, str, bool], int]
    peaks: str = ""
    limits: str = ""
    check: str = ""
    compile: bool = False


@dataclass(frozen=True)
class Backend:
    """A sharding engine: its name, the Lightning strategy string users type, and its matrix row."""

    name: str
    strategy: str
    row: Row
    check: Callable[[], Availability]
    # "module:function" (module, intent, needs, precision) -> a plan with describe() and to_dict(): the per-block
    # units that explain prints and memory counts. Empty: the engine has no plan to inspect.
    plan: str = ""
    # "module:function" (intent, needs, *, world_size, micro_batch_size) -> the engine's config, which explain prints.
    config: str = ""
    # "module:Class", the Lightning strategy that drives it.
    lightning: str = ""
    # How it runs a resolved PrecisionPlan (autoshard.precision.on_backend); None: no precision rules.
    precision: Callable[[PrecisionPlan], PrecisionPlan] | None = None
    # Per-rank bytes (layout, memory_model.RankInputs) -> MemoryEstimate, on memory.py's shared layout; None:
    # estimate_memory does not cover it.
    memory: Callable[[Layout, RankInputs], MemoryEstimate] | None = None
    host_memory: str = "CPU memory (offloaded)"  # memory_table's label for the bytes it keeps in CPU memory
    budget: BudgetChoices | None = None  # what memory_budget chooses here; None: it does not decide for this backend
    writes: Format | None = None  # the checkpoint format it saves
    resumes: tuple[Format, ...] = ()  # the formats checkpoint.resolve_for_load lets it resume from

    def __post_init__(self) -> None:
        missing = [f.value for f in Feature if f not in self.row]
        if missing:
            raise ValueError(f"backend {self.name} has no matrix cell for: {', '.join(missing)}")
        if self.writes is not None and self.writes not in self.resumes:
            raise ValueError(f"backend {self.name} writes {self.writes.value} checkpoints but cannot resume them")

    def strategy_class(self) -> type:
        """The Lightning strategy class; importing it imports Lightning, hence only on use."""
        return load(self.lightning)

    @property
    def simulates_its_step(self) -> bool:
        """The simulated step runs this backend's own plan (its peak is the run's); otherwise only the step's
        activations are added to the backend's own estimator's states."""
        return bool(self.plan)

    @property
    def rejected(self) -> bool:
        """Every cell is Support.REJECTED: autoshard lists the backend only to refuse requests for it (FSDP1)."""
        return all(c.support is Support.REJECTED for c in self.row.values())


def load(path: str) -> Any:
    """The object at ``"module:attr"``, imported now: how a Backend points at code that needs torch or Lightning."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
