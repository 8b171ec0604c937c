"""``autoshard explain TARGET``'s TARGET: a factory named by ``file.py:name`` or ``package.module:name``, built on meta.

Apart from the report (``explain.py``) because loading user code and building it on the meta device is its own
concern, with its own refusals.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard.adapters.compile import unwrap_compiled
from autoshard.errors import AutoShardError


def load_target(target: str) -> Callable[[], Any]:
    """``path/to/file.py:factory`` or ``package.module:factory`` (a dotted attribute path after the colon)."""
    obj = load_attribute(
        target,
        "TARGET",
        "name the factory after a colon, e.g. autoshard explain autoshard.demo:DinoLike",
        "give the path of your training script, e.g. train.py:build_model",
    )
    if not callable(obj) and not isinstance(obj, nn.Module):
        raise AutoShardError(
            f"TARGET {target!r} is a {type(obj).__name__}, not a class or a function returning a LightningModule."
            f" Fix: point it at the LightningModule class or at a factory function"
        )
    return obj


def load_attribute(spec: str, label: str, no_colon_fix: str, missing_file_fix: str, noun: str = "factory") -> Any:
    """What ``path/to/file.py:name`` or ``package.module:name`` names (a dotted path after the colon), imported as
    ``python -m`` would; ``label`` names the option in errors (TARGET, --batch), ``noun`` what it names."""
    where, sep, attr = str(spec).rpartition(":")
    if not sep or not where or not attr:
        raise AutoShardError(f"{label} {spec!r} is not path/to/file.py:{noun} or package.module:{noun}. Fix: {no_colon_fix}")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            path = Path(where).resolve()
            if not path.is_file():
                raise AutoShardError(f"{label} file {where!r} does not exist. Fix: {missing_file_fix}")
            name = f"_autoshard_{label.strip('-').lower()}_{abs(hash(str(path)))}"
            found = importlib.util.spec_from_file_location(name, path)
            assert found is not None and found.loader is not None
            module = importlib.util.module_from_spec(found)
            sys.modules[name] = module
            sys.path.insert(0, str(path.parent))  # so the file can import its siblings
            try:
                found.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.parent))
        else:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: the console script's sys.path lacks the project
            try:
                module = importlib.import_module(where)
            finally:
                sys.path.remove(os.getcwd())
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AutoShardError:
        raise
    except Exception as exc:
        raise AutoShardError(
            f"could not load {label} {spec!r}: {type(exc).__name__}: {exc}."
            f' Fix: check that `python -c "import {where.removesuffix(".py")}"` works and that {attr!r} is defined there'
        ) from exc
    return obj


@dataclass
class Built:
    """The module built on meta, the callbacks that came with it, and what explain had to note while building."""

    module: nn.Module
    callbacks: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def build_on_meta(factory: Callable[[], Any] | nn.Module) -> Built:
    """Call the factory under ``torch.device("meta")``; it may return a module or ``(module, [callbacks])``. Callbacks
    get ``setup(None, module, "fit")`` so that probes attach their modules and build their optimizers."""
    notes: list[str] = []
    with torch.device("meta"):
        try:
            made = factory if isinstance(factory, nn.Module) else factory()
        except Exception as exc:
            raise AutoShardError(
                f"the factory raised {type(exc).__name__}: {exc}. It runs under `with torch.device('meta'):`;"
                f" a factory that loads weights or calls .to(device) cannot: build the architecture only"
            ) from exc
        if isinstance(made, Mapping):
            module, callbacks = made.get("model"), list(made.get("callbacks") or [])
        elif isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], nn.Module):
            module, callbacks = made[0], list(made[1] or [])
        else:
            module, callbacks = made, []
        if not isinstance(module, nn.Module):
            raise AutoShardError(
                f"the factory returned {type(module).__name__}, not a LightningModule. Fix: return the module, or (module, [callbacks])"
            )
        # As the strategies do at setup: torch.compile wrappers inside are replaced by the modules they wrap, so the
        # plan, the estimates and the simulated step read the eager names (and the plan compiles those blocks in place).
        unwrapped = unwrap_compiled(module)
        if unwrapped:
            notes.append(f"torch.compile wrapper(s) on {', '.join(map(repr, unwrapped))} replaced by the modules they wrap, as at setup")
        for callback in callbacks:
            setup = getattr(callback, "setup", None)
            if callable(setup):
                try:
                    setup(None, module, "fit")
                except Exception as exc:  # a callback that needs a real Trainer: say what is not counted
                    notes.append(
                        f"{type(callback).__name__}.setup needs a Trainer ({type(exc).__name__}: {exc}): its"
                        f" optimizers are not counted; set `autoshard_optimizers = N` on it to declare them"
                    )
    real = [n for n, p in module.named_parameters() if not p.is_meta]
    if real:
        notes.append(f"{len(real)} parameter(s) are not on the meta device (the factory moved or loaded them), e.g. {real[0]}")
    import lightning.pytorch as pl

    if not isinstance(module, pl.LightningModule):
        notes.append(f"{type(module).__name__} is a plain nn.Module, not a LightningModule: the Trainer needs one")
    return Built(module, callbacks, notes)
