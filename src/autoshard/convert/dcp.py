"""The DCP layout (``strategy='fsdp2'``, at any world size): an autoshard / Lightning directory of
torch.distributed.checkpoint shards (``state_dict``, ``optimizer_{i}``, ``callback_optimizer_{n}``) and ``meta.pt``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from autoshard.capability import Format
from autoshard.checkpoint.formats import LIGHTNING_META
from autoshard.checkpoint.publish import fsync_file
from autoshard.checkpoint.readers import dcp_entries, flat_tensors, load_dcp_entries, model_entry
from autoshard.checkpoint.trust import load_torch_file
from autoshard.convert.state import TrainingState, named_optimizer, require_trainer


def read_dcp(path: Path, trust_pickle: bool = False) -> TrainingState:
    """An autoshard / Lightning DCP directory: ``state_dict``, ``optimizer_{i}``, ``callback_optimizer_{n}``, meta.pt."""
    entries = dcp_entries(path)
    keys = {where[0] for where, _ in entries}
    key = model_entry(keys)
    optimizer_keys = sorted((k for k in keys if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1]))
    loaded = load_dcp_entries(path, {key, *optimizer_keys} if key else None, trust_pickle)
    tensors = flat_tensors(loaded[key] if key else loaded)
    optimizers = [named_optimizer(loaded[k], f"optimizer #{k.split('_')[1]}", path) for k in optimizer_keys]
    trainer: dict[str, Any] = {}
    meta = path / LIGHTNING_META
    if meta.is_file():
        trainer = load_torch_file(meta, action="convert", trust_pickle=trust_pickle)
    extra = trainer.pop("autoshard", None) or {}
    state = TrainingState(
        tensors=tensors,
        optimizers=optimizers,
        trainer=trainer,
        source=path,
        format=Format.DCP if meta.is_file() else Format.DCP_RAW,
        world_size=extra.get("world_size"),
        callback_optimizers=len(extra.get("callback_optimizers", ())),
    )
    # FSDP2 shards parameters only: an entry outside every optimizer that was saved in several chunks is a frozen
    # parameter (an EMA teacher, a frozen backbone), never a buffer.
    trained = set(state.trained())
    for where, item in entries:
        if where[0] == key and len(where) == 2 and where[1] not in trained and len(getattr(item, "chunks", ())) > 1:
            state.frozen.add(where[1])
    if extra.get("rng_states"):
        state.notes.append(
            "per-rank RNG states are not carried (the other backend keeps none): random augmentations differ from an uninterrupted run"
        )
    return state


def write_dcp(state: TrainingState, staged: Path) -> dict[str, Any]:
    """A directory fsdp2 (``strategy='fsdp2'``/``'auto-shard'``) resumes at any world size: the layout autoshard saves."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    require_trainer(state, "dcp")
    nested: dict[str, Any] = {"state_dict": {n: t.contiguous() for n, t in state.tensors.items()}}
    for i, opt in enumerate(state.optimizers):
        nested[f"optimizer_{i}"] = {"state": opt.state, "param_groups": [dict(g) for g in opt.groups]}
    staged.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "process group not initialized ... no_dist": intended here
        save(nested, storage_writer=FileSystemWriter(str(staged), sync_files=True), no_dist=True)
    torch.save(state.trainer, staged / LIGHTNING_META)
    fsync_file(staged / LIGHTNING_META)
    return {}
