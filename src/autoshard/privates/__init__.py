"""Every private member of torch, Lightning and DeepSpeed that autoshard touches, in one place that records and
provides each: a release may move any of them, and an upgrade is checked and fixed here.

``in_torch``, ``in_lightning`` and ``in_deepspeed`` each hold a dependency's ledger (``Private`` records: where, and
why) and its providers: code elsewhere takes a private member from them (``in_torch.tree_map``), never by importing
it, so tests/test_privates.py reads src/ and fails on a private reached anywhere else. A member autoshard overrides
in a subclass, or reads on an object it holds, stays where it is used and is recorded here. Importing this package
imports no dependency: a provider imports its member on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Private:
    """``owner`` (a dotted module or class path) has ``name``: a function, class or method, or, with
    ``on_instance``, an attribute its ``__init__`` sets (only an instance shows it)."""

    owner: str
    name: str
    used_in: str  # the autoshard module(s) using it
    why: str
    on_instance: bool = False
    without: str = ""  # what autoshard does when the installed release lacks it (said by check_lightning)

    def __str__(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.name}"

    @property
    def dotted(self) -> str:
        return f"{self.owner}.{self.name}"


def resolve(path: str) -> Any | None:
    """A module, class or attribute from its dotted path (the longest importable prefix, then attributes); None when
    absent. A module wins over a same-named attribute of its package (``deepspeed.utils.tensor_fragment``)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(found, part):
                return None
            found = getattr(found, part)
        return found
    return None


def missing(members: Iterable[Private], owner: type | None = None) -> list[Private]:
    """The listed members (those of ``owner`` only, if given) that the installed release lacks. Instance attributes
    need an instance: the tests build one per owner."""
    gone = []
    for member in members:
        where = None if member.on_instance else resolve(member.owner)
        if member.on_instance or (owner is not None and where is not owner):
            continue
        if not hasattr(where, member.name):
            gone.append(member)
    return gone


def provide(namespace: dict[str, Any], provided: Mapping[str, str], name: str) -> Any:
    """A module's lazy attribute ``name``: the member ``provided[name]`` (``"module:attribute"``), imported on first
    use and kept in ``namespace`` (so a hot path pays the import once). ImportError when the release lacks it."""
    if name not in provided:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    module, _, attribute = provided[name].partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ImportError(f"cannot import name {attribute!r} from {module!r}")
        found = getattr(found, part)
    namespace[name] = found
    return found
