"""What a checkpoint holds, read in one process (no process group, any saved world size), shared by ``convert``,
``consolidate``, ``init_from`` and the resumes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.checkpoint.trust import CheckpointFormatError, read_dcp_metadata, weights_only_loads
from autoshard.privates import in_torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_SINGLE = "pytorch_model.bin"
TIED_METADATA = "autoshard_tied"  # written by `autoshard convert --to safetensors`: {alias: the name kept}
# safetensors' dtype names.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
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
    """(path in the saved state dict, storage metadata) of every entry of a DCP checkpoint, from .metadata alone."""
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
    """Top-level entries of a DCP checkpoint (all when ``keys`` is None) as full tensors; the non-tensor entries, which
    DCP unpickles with weights_only=False, are read under ``weights_only_loads``."""
    from torch.distributed.checkpoint import FileSystemReader

    sd: dict[str, Any] = {}
    # Same reader and planner as torch's dcp_to_torch_save.
    wanted = set(keys) if keys is not None else None
    if not trust_pickle:
        read_dcp_metadata(path)
    with weights_only_loads(trust_pickle):
        in_torch.load_state_dict(
            sd, storage_reader=FileSystemReader(str(path)), planner=in_torch.EmptyStateDictLoadPlanner(keys=wanted), no_dist=True
        )
    return sd


def torch_weights(loaded: Any) -> tuple[str | None, Any]:
    """(the key, the weights) of what ``torch.load`` returned: a Lightning checkpoint keeps them under a
    ``state_dict`` mapping; anything else is taken as the weights themselves (key None: its top level)."""
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        return "state_dict", loaded["state_dict"]
    return None, loaded


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


def dtype_name(dtype: torch.dtype | str) -> str:
    """A dtype as torch names it without its module ("float16"), the way the readers record each tensor's."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes sit in a safetensors file: read with plain file reads, never mapped."""

    file: Path
    offset: int  # of its first byte, from the start of the file
    dtype: torch.dtype | None  # None: a dtype without a torch equivalent here (read through safe_open)
    shape: tuple[int, ...]


def safetensors_header(files: Iterable[Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, Stored], dict[str, str], dict[str, str]]:
    """The JSON header of each file; one shorter than its header says is refused here, at planning, on every rank (a
    rank failing alone at load time would leave the others in the next collective)."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Stored] = {}
    tied: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointFormatError(
                f"init_from: {str(f)!r}, which the index names, does not exist. Fix: download or copy every shard the index lists"
            )
        with open(f, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            try:
                header = json.loads(handle.read(length))
            except ValueError:
                raise CheckpointFormatError(
                    f"init_from: {str(f)!r} has no readable safetensors header. Fix: pass a file written by safetensors (save_pretrained, save_file)"
                ) from None
        meta = header.pop("__metadata__", None) or {}
        if TIED_METADATA in meta:
            tied.update(json.loads(meta[TIED_METADATA]))
        end = max((int(info["data_offsets"][1]) for info in header.values()), default=0)
        size = f.stat().st_size
        if size < 8 + length + end:
            raise CheckpointFormatError(
                f"init_from: {str(f)!r} is truncated: it holds {size:,d} bytes where its safetensors header says"
                f" {8 + length + end:,d}. Nothing was loaded or sharded yet. Fix: download or copy the file again"
            )
        for key, info in header.items():
            shapes[key] = tuple(info["shape"])
            stored = SAFETENSORS_DTYPES.get(info["dtype"])
            dtypes[key] = dtype_name(stored) if stored is not None else str(info["dtype"])
            where[key] = Stored(f, 8 + length + int(info["data_offsets"][0]), stored, tuple(info["shape"]))
    return shapes, where, tied, dtypes
