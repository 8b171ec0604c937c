"""Checkpoint behaviour shared by autoshard's Lightning strategies (crash-safe saves, format checks on resume)."""

from __future__ import annotations


class CheckpointMixin:
    """Mixed in before ModelParallelStrategy in FSDP2Strategy; overrides save_checkpoint / load_checkpoint."""
