"""autoshard: ask for sharded training once; get FSDP2 or DeepSpeed ZeRO-3, whichever can run your method.

``import autoshard`` registers the Lightning strategies ``"auto-shard"``, ``"fsdp2"`` and ``"autoshard-deepspeed"``
and installs the FSDP1 / DeepSpeed guards: at once when Lightning is already imported, else the moment
``lightning.pytorch`` is. The same three names go into Lightning Fabric's own registry (``autoshard.fabric``) the
moment ``lightning.fabric`` is loaded. Every change is in one record, listed in docs/lightning-changes.md;
``autoshard.uninstall()`` undoes all of it and ``autoshard.register()`` installs it again. ``import autoshard``
itself, ``autoshard --version`` and ``autoshard matrix`` import neither torch nor Lightning (seconds each); the names
below that need torch load on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from autoshard.capability import Cell, Feature, Support
from autoshard.errors import AutoShardError, BackendUnavailableError, IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent

__version__ = "0.1.0"

# Public names imported on first access (PEP 562): their modules import torch, or (the matrix) every backend, which
# `import autoshard.capability` must not.
_LAZY = {
    "Decision": "autoshard.select",
    "EMAPair": "autoshard.needs",
    "MethodNeeds": "autoshard.needs",
    "features_needed": "autoshard.select",
    "inspect_needs": "autoshard.needs",
    "matrix": "autoshard.backends.matrix",
    "render_matrix": "autoshard.backends.matrix",
    "select_backend": "autoshard.select",
    "ThroughputMonitor": "autoshard.lightning.throughput",
}

__all__ = [
    "AutoShardError",
    "BackendUnavailableError",
    "Cell",
    "Feature",
    "IncompatibleBackendError",
    "IntentError",
    "ShardingIntent",
    "Support",
    "register",
    "uninstall",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"autoshard.{name}") is not None:
        return importlib.import_module(f"autoshard.{name}")  # autoshard.lightning.X after `import autoshard`, as before
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# -- registration with Lightning --------------------------------------------------------------------------------------
_LIGHTNING = "lightning.pytorch"
_OURS = "autoshard.lightning"
_FABRIC = "lightning.fabric"  # Fabric's registry is its own; lightning.pytorch imports it first, so it is always first


def _loaded(name: str) -> bool:
    """In sys.modules and done executing (``__spec__._initializing`` is how importlib marks a module mid-import)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the strategies right after ``lightning.pytorch`` has executed (or, when ``autoshard.lightning`` is
    what imports it, once that has), then takes itself off sys.meta_path."""

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name not in (_LIGHTNING, _OURS, _FABRIC) or self not in sys.meta_path:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :]:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    """The real loader, then registration; the module keeps the real loader afterwards."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ... while the module executes
        return getattr(self.loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        if module.__name__ == _FABRIC:
            _register_fabric()
        elif module.__name__ == _OURS:
            _register(module)
        elif _OURS not in sys.modules or _loaded(_OURS):  # else autoshard.lightning is mid-import: it registers when done
            _register(None)


def _register(ours: ModuleType | None) -> None:
    """``autoshard.lightning.register()`` (idempotent), once; no more watching imports after it."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]
    (ours or importlib.import_module(_OURS)).register()


def _register_fabric() -> None:
    """``autoshard.fabric.register()`` (idempotent): imports Fabric's registry only, no strategy, no lightning.pytorch."""
    importlib.import_module("autoshard.fabric").register()


def register() -> None:
    """Install again what ``uninstall()`` undid (idempotent): the Trainer's names and guards, Fabric's names. Imports
    Lightning, so call it where Lightning is in use."""
    _register_fabric()
    _register(None)


def uninstall() -> list[Any]:
    """Undo everything ``import autoshard`` changed in Lightning, the Trainer's and Fabric's alike: every change in the
    one record (``autoshard.install_record``, listed in docs/lightning-changes.md), newest first, each registry entry
    and method put back by identity; returns the changes undone. An import hook still waiting for Lightning is removed
    too, so nothing is registered later. ``register()`` installs everything again."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]
    return importlib.import_module("autoshard.install_record").uninstall()


if _loaded(_FABRIC):
    _register_fabric()
if _loaded(_LIGHTNING):
    _register(None)
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
