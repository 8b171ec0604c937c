"""Checkpoints on disk: one package, one module per concern, each using only those listed after it.

- ``saves``: a training save on every rank (Trainer and Fabric, fsdp2 and DeepSpeed): what may be replaced, rank 0's
  steps with their errors raised everywhere, the files each rank hashes, the DeepSpeed publish, RNG states;
- ``resume``: the one reader, from a path to a complete checkpoint (an interrupted save recovered, the manifest
  checked), and every refusal of a resume, convert or consolidate, with its fix;
- ``readers``: what a checkpoint holds, read in one process (DCP entries, the module's weights, safetensors headers),
  shared by ``convert``, ``consolidate`` and ``init_from``; ``formats``: what a path holds, by its files alone;
- ``publish``: the protocol every writer follows (lock, staging of its own, fsync, check, rename), manifests and
  hashes, and the check of an offline writer's output path;
- ``trust``: unpickling without running code (``TRUSTED_TYPES``);
- ``deepspeed_layout``: DeepSpeed's file names, partitions and private members, pinned to the releases checked.

Only ``saves`` runs on every rank of a run; the rest runs in one process without a GPU. The commands on top
(``autoshard consolidate``, ``autoshard convert``) and ``ShardingIntent(init_from=...)`` are modules of their own.
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
