"""Checkpoint formats on disk: detect them, read what a DCP checkpoint holds, resolve a path to a complete one.

Everything here works in one process, without a GPU and without the world size that wrote the checkpoint. Two
neighbours do the rest: ``checkpoint_io`` swaps saves in atomically and records / checks their manifests;
``consolidate`` writes one file of full weights (``autoshard consolidate CKPT OUT.pt``, meant to run on a laptop
after the job is gone).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.backends import get_backend
from autoshard.capability import Format
from autoshard.checkpoint_io import (
    DIGEST,
    aside_path,
    fsync_dir,
    integrity_problems,
    remove,
    sidecar_path,
    staging_path,
)
from autoshard.errors import AutoShardError

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, atomically, once every rank has written
LIGHTNING_META = "meta.pt"  # Lightning's trainer state (loops, callbacks, schedulers) next to the DCP shards
DEEPSPEED_LATEST = "latest"  # DeepSpeed's pointer to the tag directory
LIGHTNING_DEEPSPEED_PREFIX = "_forward_module."  # Lightning's DeepSpeed wrapper around the LightningModule
CONSOLIDATE = "autoshard consolidate {path} weights.pt"


class CheckpointFormatError(AutoShardError, ValueError):
    """A path that cannot be loaded (or overwritten) as asked: what it is, what reads it, and the fix."""


@dataclass(frozen=True)
class CheckpointInfo:
    """The verdict on one path; ``detail`` is the evidence, shown verbatim in errors."""

    path: Path
    format: Format
    detail: str
    tag: str | None = None  # DeepSpeed tag directory

    @property
    def complete(self) -> bool:
        return self.format in (Format.DCP, Format.DCP_RAW, Format.FULL, Format.DEEPSPEED)


def _is_torch_file(path: Path) -> bool:
    """torch.save writes a zip (PK) since 1.6, a pickle (0x80) before: anything else is not a torch file."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def _deepspeed_tag(path: Path) -> str | None:
    """The tag of a DeepSpeed ZeRO checkpoint directory, or None when ``path`` is not one."""
    latest = path / DEEPSPEED_LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag and (path / tag).is_dir():
            return tag
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        if any(sub.glob("*mp_rank_*_model_states.pt")):
            return sub.name
    return None


def torn_shard(path: Path) -> str | None:
    """A shard shorter than .metadata says, or missing: what an in-place save (stock Lightning's) leaves when killed.

    Only .metadata is read (offsets and lengths), never the tensors.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a torn .metadata cannot happen with DCP's tmp + rename, but say so if it does
        return f".metadata cannot be read ({type(exc).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {name} is missing"
        size = shard.stat().st_size
        if size < end:
            return f"shard {name} holds {size:,d} bytes where .metadata expects {end:,d}"
    return None


def detect_format(path: str | os.PathLike[str], verify: bool = True) -> CheckpointInfo:
    """Classify ``path`` by its files only (no tensor is read), so it is cheap on any checkpoint size.

    ``verify`` also reads DCP's .metadata to catch torn shards; deciding whether a path may be replaced skips it.
    """
    p = Path(path)
    if not p.exists():
        if p.is_symlink():
            return CheckpointInfo(p, Format.MISSING, f"a symlink to {os.readlink(p)!r}, which does not exist")
        return CheckpointInfo(p, Format.MISSING, "nothing exists at this path")
    if p.is_file():
        if p.stat().st_size == 0:
            return CheckpointInfo(p, Format.UNKNOWN, "an empty file")
        if _is_torch_file(p):
            return CheckpointInfo(p, Format.FULL, "a single torch.save file")
        return CheckpointInfo(p, Format.UNKNOWN, "a file that torch.save did not write (neither zip nor pickle)")
    if not p.is_dir():
        return CheckpointInfo(p, Format.UNKNOWN, "neither a file nor a directory")
    has_metadata = (p / DCP_METADATA).is_file()
    has_meta = (p / LIGHTNING_META).is_file()
    shards = sorted(x.name for x in p.glob("*.distcp"))
    if has_metadata and verify:
        torn = torn_shard(p)
        if torn is not None:
            return CheckpointInfo(p, Format.INCOMPLETE, f"a distributed checkpoint whose {torn}: a save overwrote it in place and was interrupted")
    if has_metadata and has_meta:
        return CheckpointInfo(p, Format.DCP, f"a distributed checkpoint: {len(shards)} shard file(s), .metadata, meta.pt")
    if has_metadata:
        return CheckpointInfo(p, Format.DCP_RAW, f"DCP shards ({len(shards)} file(s)) and .metadata, but no meta.pt (no trainer state)")
    if shards or has_meta:
        found = ", ".join(shards[:4] + (["meta.pt"] if has_meta else []))
        return CheckpointInfo(p, Format.INCOMPLETE, f"has {found} but no .metadata: the save did not finish on every rank")
    tag = _deepspeed_tag(p)
    if tag is not None:
        return CheckpointInfo(p, Format.DEEPSPEED, f"a DeepSpeed ZeRO checkpoint (tag '{tag}')", tag=tag)
    entries = sorted(x.name for x in p.iterdir())
    listing = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "") if entries else "nothing"
    return CheckpointInfo(
        p, Format.UNKNOWN, f"a directory holding {listing}: no .metadata (DCP), no meta.pt (Lightning), no latest (DeepSpeed)"
    )


def interrupted_save(path: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint an interrupted save left beside ``path`` (the newer one first), or None.

    A staged directory counts only with both .metadata (every rank wrote) and meta.pt (renamed in last); a staged
    file never does (it may be torn). What stands aside was committed before, so it is complete.
    """
    staged, aside = staging_path(path), aside_path(path)
    if staged.is_dir() and detect_format(staged).format is Format.DCP:
        return staged
    if (aside.exists() or aside.is_symlink()) and detect_format(aside).complete:
        return aside
    return None


def _describe(info: CheckpointInfo) -> str:
    return f"{str(info.path)!r} is {info.detail}"


def checkpoints_inside(path: Path) -> list[str]:
    """Complete checkpoints directly inside a directory: the usual mistake is passing ModelCheckpoint's dirpath."""
    if not path.is_dir():
        return []
    return sorted(
        c.name
        for c in path.iterdir()
        if not c.name.startswith(".") and (c.is_dir() or c.suffix == ".ckpt") and detect_format(c, verify=False).complete
    )


def _pick_one(path: Path) -> str:
    inside = checkpoints_inside(path)
    if inside:
        shown = ", ".join(inside[:3]) + (", ..." if len(inside) > 3 else "")
        return f"it holds checkpoints ({shown}): pass one of them, e.g. {str(path / inside[-1])!r}"
    return "pass the .ckpt path ModelCheckpoint printed (e.g. checkpoints/last.ckpt)"


def _consolidate_fix(path: Path) -> str:
    return (
        f"convert the weights with `{CONSOLIDATE.format(path=path)}`, then model.load_state_dict(torch.load('weights.pt'))"
        f" before trainer.fit(model) without ckpt_path (weights carry over; optimizer state and step counters restart)"
    )


def resolve_for_load(path: str | os.PathLike[str], backend: str = "fsdp2") -> Path:
    """The path to load for ``backend``, or CheckpointFormatError before anything is loaded.

    A swap interrupted between its two renames leaves ``path`` missing and a complete sibling: that one is used,
    with a warning, so a crash at any instant of a save still resumes.
    """
    info = detect_format(path)
    p = info.path
    if info.format in (Format.MISSING, Format.INCOMPLETE, Format.UNKNOWN):
        recovered = interrupted_save(p) if info.format is not Format.UNKNOWN else None
        if recovered is not None:
            warnings.warn(
                f"{_describe(info)}; a save to it was interrupted and left the complete checkpoint {str(recovered)!r},"
                f" which is loaded instead. The next save to {str(p)!r} puts it back in place",
                stacklevel=2,
            )
            return resolve_for_load(recovered, backend)
        if info.format is Format.MISSING:
            partial = staging_path(p)
            why = f" (the first save to it was interrupted: {str(partial)!r} is partial)" if partial.exists() else ""
            raise CheckpointFormatError(
                f"cannot resume: {_describe(info)}{why}. Fix: pass the path of an existing checkpoint (a .ckpt directory or file)"
            )
        if info.format is Format.INCOMPLETE:
            raise CheckpointFormatError(
                f"cannot resume: {_describe(info)}. autoshard never leaves a partial save under the final name, so this one"
                f" was written without autoshard or copied partially. Fix: resume from an earlier complete checkpoint"
            )
        raise CheckpointFormatError(
            f"cannot resume: {_describe(info)}, so it is not a checkpoint. {backend} resumes from a directory written by"
            f" torch.distributed.checkpoint with Lightning's meta.pt, or from one torch.save file. Fix: {_pick_one(p)}"
        )
    resumes = get_backend(backend).resumes
    if info.format is Format.DEEPSPEED and Format.DEEPSPEED not in resumes:
        raise CheckpointFormatError(
            f"cannot resume with {backend}: {_describe(info)}. {backend} cannot read DeepSpeed's partitioned files;"
            f" backend that reads it: DeepSpeed (strategy='autoshard-deepspeed', the strategy that wrote it). Fix: resume"
            f" with that strategy; or convert it, optimizer state, step and schedulers included, with `autoshard convert"
            f" {p} {p}-fsdp2 --to dcp` and resume from {str(p) + '-fsdp2'!r}; or {_consolidate_fix(p)}"
        )
    if info.format in (Format.DCP, Format.DCP_RAW) and Format.DCP not in resumes:
        raise CheckpointFormatError(
            f"cannot resume with DeepSpeed: {_describe(info)}, written by fsdp2 (torch.distributed.checkpoint)."
            f" Backend that reads it: fsdp2 (strategy='fsdp2', at any world size). Fix: resume with strategy='fsdp2';"
            f" or convert it, optimizer state, step and schedulers included, with `autoshard convert {p} {p}-deepspeed"
            f" --to deepspeed --world-size N --precision P` (devices x nodes, the Trainer's precision) and resume from"
            f" {str(p) + '-deepspeed'!r}; or {_consolidate_fix(p)}"
        )
    if info.format is Format.DCP_RAW:
        raise CheckpointFormatError(
            f"cannot resume: {_describe(info)}: it holds tensors but no Lightning trainer state (loops, callbacks),"
            f" so it was written by torch.distributed.checkpoint directly. Fix: {_consolidate_fix(p)}"
        )
    if info.format is Format.FULL:
        _check_full_file(p)
    return p


def _check_full_file(path: Path) -> None:
    """A bare state dict (what consolidate writes) is weights, not a Lightning checkpoint: say how to use it."""
    try:
        keys = set(torch.load(path, mmap=True, map_location="cpu", weights_only=True))
    except Exception:  # custom objects inside: let Lightning's own loader judge it
        return
    if "state_dict" not in keys:
        shown = ", ".join(sorted(map(str, keys))[:4])
        raise CheckpointFormatError(
            f"cannot resume: {str(path)!r} is a torch.save file without 'state_dict' (keys: {shown}, ...): weights only,"
            f" such as `autoshard consolidate` writes, not a Lightning checkpoint. Fix: model.load_state_dict(torch.load"
            f"({str(path)!r})) before trainer.fit(model), without ckpt_path"
        )


def check_replaceable(path: str | os.PathLike[str]) -> None:
    """Saving swaps ``path`` out: refuse when it holds something that is not a checkpoint (a user directory)."""
    info = detect_format(path, verify=False)
    if info.format is Format.MISSING or info.format in (Format.DCP, Format.DCP_RAW, Format.FULL, Format.INCOMPLETE):
        return
    p = info.path
    if info.format is Format.UNKNOWN and p.is_dir() and not any(p.iterdir()):
        return
    raise CheckpointFormatError(
        f"refusing to save over {str(p)!r}: it is {info.detail}, and a save replaces it whole. Fix: save to a new"
        f" path, e.g. {str(p / 'model.ckpt')!r}, or move it away first"
    )


def finish_interrupted_commit(path: str | os.PathLike[str]) -> Path | None:
    """Before a new save: if a crash between the two renames left ``path`` missing, put the newest complete
    sibling back under ``path`` (so the new save's staging can be cleared without losing it). Rank 0 only."""
    p = Path(path)
    staged_sidecar = staging_path(sidecar_path(p))
    if p.is_file() and staged_sidecar.is_file() and not staging_path(p).exists():
        os.replace(staged_sidecar, sidecar_path(p))  # the file was swapped in, its sidecar not yet
        fsync_dir(p.parent)
    if p.exists() or p.is_symlink():
        return None
    recovered = interrupted_save(p)
    if recovered is not None:
        os.rename(recovered, p)
        fsync_dir(p.parent)
    return recovered


def prepare_staging(path: str | os.PathLike[str]) -> Path:
    """Clear what earlier interrupted saves left and return the empty staging path. Rank 0 only."""
    p = Path(path)
    finish_interrupted_commit(p)
    check_replaceable(p)
    staged = staging_path(p)
    remove(staging_path(sidecar_path(p)))  # before the staged file: alone, a staged sidecar means "swap me in"
    remove(staged)
    if p.exists() or p.is_symlink():
        remove(aside_path(p))  # ``path`` is complete: whatever stayed aside is older
    return staged


def corrupted(path: str | os.PathLike[str], problems: list[str]) -> CheckpointFormatError:
    """The refusal for a checkpoint whose files differ from what the save recorded."""
    return CheckpointFormatError(
        f"{str(path)!r} is corrupted: {'; '.join(problems)}. autoshard recorded every file's {DIGEST} when it saved"
        f" this checkpoint, so loading it would bring back different weights or state without an error."
        f" Fix: restore the checkpoint from a backup, or use the previous checkpoint"
    )


def check_integrity(path: str | os.PathLike[str]) -> bool:
    """Every file of ``path`` against its manifest, in this process: CheckpointFormatError naming the bad file.

    False (nothing checked) when there is no manifest; the caller warns once.
    """
    problems = integrity_problems(path)
    if problems:
        raise corrupted(path, problems)
    return problems is not None


def saved_shapes(path: Path, entry: str = "state_dict") -> dict[str, tuple[int, ...] | None]:
    """Names and shapes under ``entry`` of a DCP checkpoint, from .metadata alone (None: not a tensor)."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    for where, item in _dcp_entries(path):
        if where[0] == entry and len(where) > 1:
            size = getattr(item, "size", None)
            shapes[".".join(where[1:])] = tuple(size) if size is not None else None
    return shapes


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def model_mismatch(saved: Mapping[str, tuple[int, ...] | None], model: Mapping[str, tuple[int, ...]]) -> str | None:
    """How a model's state dict differs from a checkpoint's: missing and unexpected names, other shapes; None if equal."""
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    reshaped = sorted(k for k in set(model) & set(saved) if saved[k] is not None and tuple(saved[k] or ()) != tuple(model[k]))
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint: {_names(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} in the checkpoint but not in the model: {_names(unexpected)}")
    if reshaped:
        shown = [f"{k} (checkpoint {tuple(saved[k] or ())}, model {tuple(model[k])})" for k in reshaped]
        parts.append(f"{len(reshaped)} with another shape: {_names(shown, 3)}")
    return "; ".join(parts) or None


def load_failure(
    path: Path, model_name: str, model: Mapping[str, tuple[int, ...]], failures: Mapping[int, Any]
) -> CheckpointFormatError:
    """torch's CheckpointException (a BaseException) as an autoshard error: which keys differ, or what failed where."""
    try:
        mismatch = model_mismatch(saved_shapes(path), model)
    except Exception:  # .metadata unreadable: report torch's failure below
        mismatch = None
    if mismatch:
        return CheckpointFormatError(
            f"cannot resume from {str(path)!r}: its model weights do not match this {model_name}: {mismatch}."
            f" Fix: resume from a checkpoint of this model, or to start from the weights that match, run"
            f" `{CONSOLIDATE.format(path=path)}`, then model.load_state_dict(torch.load('weights.pt'), strict=False)"
            f" before trainer.fit(model) without ckpt_path"
        )
    ranks = ", ".join(map(str, sorted(failures)))
    first = next(iter(failures.values()), None)
    error = first[0] if isinstance(first, tuple) else first
    what = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}" if error else "no detail"
    return CheckpointFormatError(
        f"cannot resume from {str(path)!r}: torch.distributed.checkpoint failed on rank(s) {ranks}: {what}."
        f" Fix: resume with the LightningModule and the optimizers (configure_optimizers) that wrote this checkpoint"
    )


def _dcp_entries(path: Path) -> list[tuple[tuple[str, ...], Any]]:
    """(path in the saved state dict, storage metadata) of every entry of a DCP checkpoint, from .metadata alone.

    The path is what the planner flattened (``("state_dict", "layer.weight")``), else the key split at its first dot.
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    planned = metadata.planner_data or {}
    return [(tuple(map(str, planned.get(fqn) or fqn.split(".", 1))), item) for fqn, item in metadata.state_dict_metadata.items()]


def _dcp_keys(path: Path) -> set[str]:
    """Top-level keys of a DCP checkpoint, from its .metadata alone."""
    return {where[0] for where, _ in _dcp_entries(path)}


def load_dcp_entries(path: Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Top-level entries of a DCP checkpoint (all when ``keys`` is None) as full, nested tensors, read in this one
    process: no process group, any saved world size. Entries not asked for stay on disk."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    # Same reader and planner as torch's dcp_to_torch_save.
    wanted = set(keys) if keys is not None else None
    _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(keys=wanted), no_dist=True)
    return sd


if __name__ == "__main__":  # `python -m autoshard.checkpoint consolidate CKPT OUT.pt`: the `autoshard` command
    from autoshard.cli import main

    raise SystemExit(main())


__all__ = [
    "CheckpointFormatError",
    "CheckpointInfo",
    "Format",
    "check_integrity",
    "detect_format",
    "resolve_for_load",
]
