"""``autoshard consolidate CKPT OUT.pt``: one plain ``{name: tensor}`` file of full weights from any checkpoint.

Apart from ``checkpoint.py`` because it is a command of its own: it reads a whole checkpoint (DeepSpeed's through
its zero_to_fp32) and writes a new file, where ``checkpoint.py`` only tells what a path holds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.capability import Format
from autoshard.checkpoint import (
    CONSOLIDATE,
    LIGHTNING_DEEPSPEED_PREFIX,
    CheckpointFormatError,
    _dcp_keys,
    _describe,
    _pick_one,
    check_integrity,
    detect_format,
    interrupted_save,
    load_dcp_entries,
)
from autoshard.checkpoint_io import fsync_dir, fsync_file, remove, staging_path, unverified_warning

@dataclass(frozen=True)
class Consolidated:
    """What ``consolidate`` wrote: one flat ``{parameter name: tensor}`` file for ``model.load_state_dict``."""

    source: Path
    format: Format
    out_path: Path
    tensors: int
    numel: int
    bytes: int
    seconds: float
    key: str | None  # the entry of the checkpoint the weights came from ("state_dict" for Lightning DCP)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "format": self.format.value,
            "out": str(self.out_path),
            "tensors": self.tensors,
            "numel": self.numel,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "key": self.key,
        }

    def describe(self) -> str:
        return (
            f"consolidated {self.format.value} checkpoint {str(self.source)!r} -> {str(self.out_path)!r}: {self.tensors}"
            f" tensors, {self.numel:,d} elements, {self.bytes / 2**20:.2f} MiB, in {self.seconds:.2f} s."
            f" Load it with model.load_state_dict(torch.load({str(self.out_path)!r}))"
        )


def _load_dcp(path: Path) -> tuple[dict[str, Any], str | None]:
    """The model entry of a DCP checkpoint; optimizer state stays on disk."""
    keys = _dcp_keys(path)
    key = next((k for k in ("state_dict", "model") if k in keys), None)
    sd = load_dcp_entries(path, {key} if key else None)
    return (sd[key] if key else sd), key


def _load_deepspeed(path: Path, tag: str | None) -> dict[str, Any]:
    """DeepSpeed's own ZeRO -> fp32 reconstruction; Lightning's wrapper prefix removed so keys match the module."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise CheckpointFormatError(
            f"{str(path)!r} is a DeepSpeed checkpoint and deepspeed is needed to convert it ({exc}). Fix: pip install"
            f" \"autoshard[deepspeed]\" (no GPU needed), then run `{CONSOLIDATE.format(path=path)}` again"
        ) from None
    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    return {k.removeprefix(LIGHTNING_DEEPSPEED_PREFIX): v for k, v in state.items()}


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if isinstance(value, Mapping):
            raise CheckpointFormatError(f"the model entry holds a nested '{name}': expected a flat {{name: tensor}} state dict")
        if isinstance(value, torch.Tensor):
            out[name] = value.detach().cpu().contiguous()
    return out


def consolidate(
    ckpt: str | os.PathLike[str], out_path: str | os.PathLike[str], *, tag: str | None = None, force: bool = False
) -> Consolidated:
    """Write one plain ``torch.save`` file of full, unsharded weights from a DCP, DeepSpeed or full checkpoint.

    Runs in one CPU process whatever world size wrote the checkpoint; ``model.load_state_dict(torch.load(out))``
    on the unsharded module then passes with ``strict=True``. The checkpoint's files are checked against its manifest
    first. An existing output is never touched without ``force``; with it, the old file is replaced only by the
    complete new one (temporary file in the same directory, fsync, rename).
    """
    start = time.perf_counter()
    out = Path(out_path)
    _check_output(out, force)
    info = detect_format(ckpt)
    source = info.path
    if not info.complete:
        recovered = interrupted_save(source) if info.format is not Format.UNKNOWN else None
        if recovered is None:
            raise CheckpointFormatError(f"cannot consolidate: {_describe(info)}, so it is not a checkpoint. Fix: {_pick_one(source)}")
        warnings.warn(f"{_describe(info)}; consolidating the complete checkpoint an interrupted save left: {str(recovered)!r}", stacklevel=2)
        info = detect_format(recovered)
        source = recovered
    if (out.exists() or out.is_symlink()) and out.resolve() == source.resolve():
        raise CheckpointFormatError(
            f"refusing to write {str(out)!r}: it is the checkpoint being consolidated. Fix: choose another output path"
        )
    if not check_integrity(source):
        warnings.warn(unverified_warning(source), stacklevel=2)
    key: str | None
    if info.format in (Format.DCP, Format.DCP_RAW):
        state, key = _load_dcp(source)
    elif info.format is Format.DEEPSPEED:
        state, key = _load_deepspeed(source, tag or info.tag), None
    else:
        loaded = torch.load(source, mmap=True, map_location="cpu", weights_only=True)
        key = "state_dict" if isinstance(loaded, Mapping) and "state_dict" in loaded else None
        state = loaded[key] if key else loaded
    tensors = _tensors(state)
    if not tensors:
        raise CheckpointFormatError(f"cannot consolidate: {_describe(info)}, but it holds no tensors under {key or 'its top level'!r}")
    _write_new(tensors, out, force)
    return Consolidated(
        source=source,
        format=info.format,
        out_path=out,
        tensors=len(tensors),
        numel=sum(t.numel() for t in tensors.values()),
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        seconds=time.perf_counter() - start,
        key=key,
    )


def _check_output(out: Path, force: bool) -> None:
    """Refuse, before reading the checkpoint, to replace what is at ``out`` unless asked to."""
    if out.is_dir():
        raise CheckpointFormatError(f"cannot write {str(out)!r}: it is a directory. Fix: name a file, e.g. {str(out / 'weights.pt')!r}")
    if (out.exists() or out.is_symlink()) and not force:
        raise CheckpointFormatError(
            f"refusing to overwrite {str(out)!r}: it already exists ({detect_format(out, verify=False).detail}), and"
            f" consolidate would replace it with weights only. Fix: choose another output path, or pass --force"
            f" (force=True) to replace it"
        )


def _write_new(tensors: dict[str, torch.Tensor], out: Path, force: bool) -> None:
    """Staged in the same directory and fsynced, then published in one step: ``os.replace`` with ``force``, else a
    hard link that fails if ``out`` appeared meanwhile. A failure at any point leaves ``out`` as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(out)
    try:
        remove(staged)
        torch.save(tensors, staged)
        fsync_file(staged)
        if force:
            os.replace(staged, out)
        else:
            try:
                os.link(staged, out)
            except FileExistsError:
                _check_output(out, force)  # raises: something appeared at ``out`` while we wrote
                raise
            except OSError:  # a filesystem without hard links: the check just before is the best it allows
                _check_output(out, force)
                os.replace(staged, out)
        fsync_dir(out.parent)
    finally:
        remove(staged)


def cmd_consolidate(args: argparse.Namespace) -> int:
    """``autoshard consolidate CKPT OUT.pt``: print what was written; refusals exit 1 through the CLI's handler
    (which prints them as JSON under --json)."""
    done = consolidate(args.ckpt, args.out, tag=args.tag, force=args.force)
    print(json.dumps(done.to_json(), indent=1) if args.json else done.describe())
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``autoshard consolidate CKPT_DIR OUT.pt`` to the ``autoshard`` command."""
    parser = subparsers.add_parser(
        "consolidate",
        help="turn a sharded (DCP or DeepSpeed) checkpoint into one torch.save file of full weights",
        description=(
            "Read a checkpoint written by strategy='fsdp2'/'auto-shard' (torch.distributed.checkpoint directory),"
            " by DeepSpeed ZeRO (through DeepSpeed's zero_to_fp32), or a full Lightning file, and write one plain"
            " {name: tensor} file: model.load_state_dict(torch.load(OUT)) works on the unsharded model. One CPU"
            " process, any world size at save time, no GPU."
        ),
    )
    parser.add_argument("ckpt", metavar="CKPT_DIR", help="the checkpoint directory (or file), e.g. checkpoints/last.ckpt")
    parser.add_argument("out", metavar="OUT.pt", help="the file to write")
    parser.add_argument("--tag", default=None, help="DeepSpeed only: the tag directory (default: the one in 'latest')")
    parser.add_argument(
        "--force", action="store_true", help="replace OUT.pt if it exists (only once the new file is complete)"
    )
    parser.add_argument("--json", action="store_true", help="print the result (or the refusal) as one JSON object")
    parser.set_defaults(func=cmd_consolidate)


if __name__ == "__main__":  # `python -m autoshard.consolidate consolidate CKPT OUT.pt`: the `autoshard` command
    from autoshard.cli import main

    raise SystemExit(main())


__all__ = ["Consolidated", "consolidate", "register_cli"]
