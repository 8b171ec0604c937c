"""What a checkpoint holds, read in one process, shared by ``convert``, ``consolidate``, ``init_from`` and the resumes:
a DCP checkpoint's entries from its .metadata alone, or loaded as full tensors (any saved world size, no process
group); the module's weights among them; a flat ``{name: tensor}`` state dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from autoshard.checkpoint.trust import CheckpointFormatError, read_dcp_metadata, weights_only_loads

MODEL_ENTRIES = ("state_dict", "model")  # where a DCP checkpoint keeps the module's weights (model_entry)


def saved_shapes(path: Path, entry: str = "state_dict") -> dict[str, tuple[int, ...] | None]:
    """Names and shapes under ``entry`` of a DCP checkpoint, from .metadata alone (None: not a tensor)."""
    return saved_entries(dcp_entries(path)).get(entry, {})


def saved_entries(entries: Iterable[tuple[tuple[str, ...], Any]]) -> dict[str, dict[str, tuple[int, ...] | None]]:
    """``{top-level key: {name: shape}}`` of a checkpoint's entries, in ``dcp_entries``' form (the path of each entry
    in the saved state dict, and its storage metadata or the tensor itself); None for what is not a tensor."""
    saved: dict[str, dict[str, tuple[int, ...] | None]] = {}
    for where, item in entries:
        if len(where) > 1:
            size = item.shape if isinstance(item, torch.Tensor) else getattr(item, "size", None)
            saved.setdefault(where[0], {})[".".join(where[1:])] = tuple(size) if size is not None else None
    return saved


def dcp_entries(path: Path) -> list[tuple[tuple[str, ...], Any]]:
    """(path in the saved state dict, storage metadata) of every entry of a DCP checkpoint, from .metadata alone.

    The path is what the planner flattened (``("state_dict", "layer.weight")``), else the key split at its first dot.
    """
    metadata = read_dcp_metadata(path)
    planned = metadata.planner_data or {}
    return [(tuple(map(str, planned.get(fqn) or fqn.split(".", 1))), item) for fqn, item in metadata.state_dict_metadata.items()]


def model_entry(keys: Iterable[str]) -> str | None:
    """The top-level key of a DCP checkpoint that holds the module's weights (Lightning's ``state_dict``, else
    ``model``); None when the weights are the top level."""
    return next((k for k in MODEL_ENTRIES if k in keys), None)


def dcp_keys(path: Path) -> set[str]:
    """Top-level keys of a DCP checkpoint, from its .metadata alone."""
    return {where[0] for where, _ in dcp_entries(path)}


def load_dcp_entries(path: Path, keys: Iterable[str] | None = None, trust_pickle: bool = False) -> dict[str, Any]:
    """Top-level entries of a DCP checkpoint (all when ``keys`` is None) as full, nested tensors, read in this one
    process: no process group, any saved world size. Entries not asked for stay on disk. .metadata is checked by
    ``read_dcp_metadata`` first and the non-tensor entries (which DCP unpickles with weights_only=False) are read
    under ``weights_only_loads``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    # Same reader and planner as torch's dcp_to_torch_save.
    wanted = set(keys) if keys is not None else None
    if not trust_pickle:
        read_dcp_metadata(path)
    with weights_only_loads(trust_pickle):
        _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(keys=wanted), no_dist=True)
    return sd


def flat_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a flat ``{name: tensor}`` state dict, detached, contiguous, on the CPU (whatever device they
    were saved from); other values are left out, a nested mapping is refused."""
    out = {}
    for name, value in state.items():
        if isinstance(value, Mapping):
            raise CheckpointFormatError(f"the model entry holds a nested '{name}': expected a flat {{name: tensor}} state dict")
        if isinstance(value, torch.Tensor):
            out[name] = value.detach().cpu().contiguous()
    return out
