"""Hugging Face weights: ``model.safetensors``, or shards plus ``model.safetensors.index.json`` (what
``from_pretrained``, ``safetensors.torch.load_file`` and ``ShardingIntent(init_from=...)`` read). Weights only, written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from autoshard.checkpoint.publish import fsync_file, honour_umask
from autoshard.checkpoint.readers import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TIED_METADATA
from autoshard.convert.state import ConvertError, TrainingState, tied_aliases
from autoshard.units import parse_size as memory_size

MAX_SHARD_SIZE = "5GB"  # Hugging Face's save_pretrained default


def parse_size(text: str | int) -> int:
    """``5GB`` (decimal, as Hugging Face reads it), ``500MiB`` (binary), or a number of bytes."""
    return memory_size(text, "--max-shard-size", "5GB", ConvertError)


def write_safetensors(state: TrainingState, staged: Path, max_shard_size: int) -> dict[str, Any]:
    """Hugging Face layout: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` once the weights pass ``max_shard_size`` (greedy, in state-dict order, as
    save_pretrained splits). Tied weights are written once (safetensors refuses shared storage; transformers drops
    the tied name too) and the alias recorded in the file's metadata under ``autoshard_tied``."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConvertError(f'--to safetensors needs the safetensors package ({exc}). Fix: pip install "autoshard[safetensors]"') from None
    aliases = tied_aliases(state)
    tensors = {n: t.detach().contiguous() for n, t in state.tensors.items() if n not in aliases}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}
    if aliases:
        metadata[TIED_METADATA] = json.dumps(aliases, sort_keys=True)
    staged.mkdir(parents=True)
    names = [SAFETENSORS_SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, fname in zip(shards, names):
        save_file(shard, str(staged / fname), metadata=metadata)
        honour_umask(staged / fname)  # save_file creates it 0600; every other output is 0666 less the umask
        fsync_file(staged / fname)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values()), **({TIED_METADATA: aliases} if aliases else {})},
            "weight_map": {n: fname for shard, fname in zip(shards, names) for n in shard},
        }
        (staged / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fsync_file(staged / SAFETENSORS_INDEX)
    notes = (
        [f"tied weights written once: {', '.join(f'{a} -> {n}' for a, n in sorted(aliases.items()))} (recorded in the metadata as {TIED_METADATA})"]
        if aliases
        else []
    )
    return {"notes": notes, "tensors": len(tensors)}
