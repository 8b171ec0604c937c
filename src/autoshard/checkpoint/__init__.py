"""Checkpoints on disk, one module per concern, each using only those below it (pyproject.toml's contract; a
paragraph on each in docs/architecture.md): ``saves`` (a training save on every rank) > ``resume`` (the one reader)
> ``readers`` (what a checkpoint holds), ``publish`` (the publish protocol, manifests) > ``formats`` (what a path
holds) > ``trust`` (unpickling without running code) > ``deepspeed_layout`` (DeepSpeed's files). Here: the public API.
"""

from __future__ import annotations

from autoshard.capability import Format
from autoshard.checkpoint.formats import CheckpointInfo, detect_format
from autoshard.checkpoint.resume import check_integrity, locate_checkpoint, open_checkpoint, resolve_for_load
from autoshard.checkpoint.trust import TRUSTED_TYPES, CheckpointFormatError, UntrustedPickleError, load_torch_file, weights_only_loads

__all__ = [
    "TRUSTED_TYPES",
    "CheckpointFormatError",
    "CheckpointInfo",
    "Format",
    "UntrustedPickleError",
    "check_integrity",
    "detect_format",
    "load_torch_file",
    "locate_checkpoint",
    "open_checkpoint",
    "resolve_for_load",
    "weights_only_loads",
]
