"""One torch.save file: a Lightning checkpoint (``state_dict``, ``optimizer_states``) or bare weights. Read only:
a conversion never writes one (fsdp2 resumes the DCP layout, ``consolidate`` writes weights)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from autoshard.capability import Format
from autoshard.checkpoint.readers import flat_tensors, torch_weights
from autoshard.checkpoint.trust import load_torch_file
from autoshard.convert.state import ConvertError, TrainingState, named_optimizer


def read_full(path: Path, trust_pickle: bool = False, weights_only: bool = False) -> TrainingState:
    """One torch.save file: a Lightning checkpoint (``state_dict``, ``optimizer_states``) or bare weights."""
    loaded = load_torch_file(path, action="convert", trust_pickle=trust_pickle)
    if not isinstance(loaded, Mapping):
        raise ConvertError(
            f"cannot convert {str(path)!r}: it holds a {type(loaded).__name__}, not a state dict. Fix: pass a checkpoint file or directory"
        )
    entry, weights = torch_weights(loaded)
    if entry is None:
        return TrainingState(tensors=flat_tensors(weights), optimizers=[], trainer={}, source=path, format=Format.FULL, world_size=None)
    trainer = {k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states")}
    extra = trainer.pop("autoshard", None) or {}
    saved = list(loaded.get("optimizer_states") or [])
    notes = []
    if weights_only and any(not isinstance(p, str) for s in saved for g in s.get("param_groups", []) for p in g.get("params", [])):
        # DDP / single-device Lightning keys optimizer state by position: no use to weights, so not a refusal here.
        notes.append(f"{len(saved)} optimizer state(s) keyed by position (a DDP or single-device checkpoint) not read: weights only")
        saved = []
    optimizers = [named_optimizer(s, f"optimizer #{i}", path) for i, s in enumerate(saved)]
    return TrainingState(
        notes=notes,
        tensors=flat_tensors(weights),
        optimizers=optimizers,
        trainer=trainer,
        source=path,
        format=Format.FULL,
        world_size=extra.get("world_size"),
        callback_optimizers=len(extra.get("callback_optimizers", ())),
    )
