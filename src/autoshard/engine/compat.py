"""The one Lightning range autoshard supports, and the record type of the private Lightning members it touches.

Each front end keeps its own list of those members (``autoshard.lightning.compat``, ``autoshard.fabric.compat``);
both list them as ``Private`` and verify them against ``SUPPORTED_LIGHTNING``. A strategy whose hooked member is gone
refuses to be built (``lightning_lacks``), with the pin.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
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


def engine_members(strategies: str, left: str, left_deepspeed: str) -> tuple[Private, ...]:
    """The members ``engine/`` hooks in a front end's strategies (``strategies``: ``lightning.pytorch.strategies`` or
    ``lightning.fabric.strategies``); ``left`` / ``left_deepspeed``: what is refused when one is gone."""
    model_parallel, deepspeed = f"{strategies}.ModelParallelStrategy", f"{strategies}.DeepSpeedStrategy"
    return (
        Private(
            model_parallel, "_configure_launcher", "engine/base.py", "overridden: construction's last step, once the precision is known", without=left
        ),
        Private(
            model_parallel,
            "_data_parallel_size",
            "engine/fsdp2.py",
            "set from the intent before 'auto' (tensor parallel within a node)",
            on_instance=True,
        ),
        Private(model_parallel, "_tensor_parallel_size", "engine/fsdp2.py", "set with _data_parallel_size", on_instance=True),
        Private(deepspeed, "_configure_launcher", "engine/base.py", "overridden, as for ModelParallelStrategy", without=left_deepspeed),
    )


def resolve(path: str) -> object | None:
    """A class or module from its dotted path; None when the installed Lightning has none there."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None


def absent(members: Iterable[Private], owner: type | None = None) -> list[Private]:
    """The listed methods and classes (of ``owner`` only, if given) that the installed Lightning lacks. Instance
    attributes need an instance: tests/lightning/test_compat.py builds one per owner."""
    gone = []
    for member in members:
        where = None if member.on_instance else resolve(member.owner)
        if member.on_instance or (owner is not None and where is not owner):
            continue
        if not hasattr(where, member.name):
            gone.append(member)
    return gone


def lightning_lacks(gone: list[str], hooked_by: str, works: str = "") -> BackendUnavailableError:
    """The refusal of a strategy whose hooked private members (``gone``) this Lightning lacks: Lightning would never
    call autoshard's overrides, so the strategy would run unchecked. ``works``: the backend that works, said."""
    return BackendUnavailableError(
        f"lightning {metadata.version('lightning')} lacks {', '.join(gone)}, which autoshard's {hooked_by}"
        f" (verified on lightning {SUPPORTED_LIGHTNING}).{works} Fix: {PIN}"
    )
