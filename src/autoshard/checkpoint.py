"""Checkpoint formats on disk: detect them, read what a DCP checkpoint holds, resolve a path to a complete one.

Everything here works in one process, without a GPU and without the world size that wrote the checkpoint. Two
neighbours do the rest: ``checkpoint_io`` swaps saves in atomically and records / checks their manifests;
``consolidate`` writes one file of full weights (``autoshard consolidate CKPT OUT.pt``, meant to run on a laptop
after the job is gone).

The one reader, in three steps, is where everything that reads a whole checkpoint starts: ``locate_checkpoint``
(detect the format; take the complete checkpoint an interrupted save left in its place, with a warning; else refuse
with the fix, in the words of what was asked), then the manifest check, then the DeepSpeed tag. ``open_checkpoint``
runs the three for convert and consolidate; a resume (``resolve_for_load``, both Lightning strategies) runs the first
on rank 0, then its backend's checks, and every rank checks its share of the manifest
(``lightning.checkpoint.verify_on_every_rank``). ``load_torch_file`` is how each unpickles a file:
``torch.load(weights_only=True)`` with exactly the types in ``TRUSTED_TYPES`` allowed, so a file never runs code.
DeepSpeed's file names and layout live in ``deepspeed_files``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from autoshard import deepspeed_files
from autoshard.backends import get_backend
from autoshard.capability import Format
from autoshard.checkpoint_io import (
    DIGEST,
    KIND_SAVE,
    MANIFEST,
    aside_path,
    foreign_content,
    fsync_dir,
    integrity_problems,
    orphan_sidecar,
    remove,
    sidecar_path,
    staged_siblings,
    staging_path,
    unverified_warning,
    writer_token,
)
from autoshard.errors import AutoShardError

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, atomically, once every rank has written
LIGHTNING_META = "meta.pt"  # Lightning's trainer state (loops, callbacks, schedulers) next to the DCP shards
CONSOLIDATE = "autoshard consolidate {path} weights.pt"
MODEL_ENTRIES = ("state_dict", "model")  # where a DCP checkpoint keeps the module's weights (model_entry)
RESUME = "resume"  # the action of a Lightning resume: its refusals name the backend and say how to resume instead
TRUST_PICKLE = "--trust-pickle (trust_pickle=True)"


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


def is_torch_file(path: Path) -> bool:
    """torch.save writes a zip (PK) since 1.6, a pickle (0x80) before: anything else is not a torch file."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def torn_shard(path: Path) -> str | None:
    """A shard shorter than .metadata says, or missing: what an in-place save (stock Lightning's) leaves when killed.

    Only .metadata is read (offsets and lengths), never the tensors.
    """
    try:
        metadata = read_dcp_metadata(path)
    except UntrustedPickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - a torn .metadata cannot happen with DCP's tmp + rename, but say so if it does
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
        return CheckpointInfo(p, Format.MISSING, "missing: nothing exists at this path")
    if p.is_file():
        if p.stat().st_size == 0:
            return CheckpointInfo(p, Format.UNKNOWN, "an empty file")
        if is_torch_file(p):
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
        return CheckpointInfo(
            p, Format.INCOMPLETE, f"a distributed checkpoint that has {found} but no .metadata: the save did not finish on every rank"
        )
    deepspeed = deepspeed_files.layout(p)
    if deepspeed is not None:
        return CheckpointInfo(p, Format.DEEPSPEED, deepspeed[1], tag=deepspeed[0])
    entries = sorted(x.name for x in p.iterdir())
    listing = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "") if entries else "nothing"
    return CheckpointInfo(p, Format.UNKNOWN, f"a directory holding {listing}: no .metadata (DCP), no meta.pt (Lightning), no latest (DeepSpeed)")


def interrupted_save(path: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint an interrupted save left beside ``path`` (the newer one first), or None.

    A staged directory (any writer's: each stages under its own name) counts only when its last file is in: DCP with
    both .metadata (every rank wrote) and meta.pt (renamed in last), DeepSpeed with its manifest (written after
    ``latest``); a staged file never does (it may be torn). What stands aside was committed before, so it is complete.
    """
    aside = aside_path(path)
    for staged in staged_siblings(path):  # newest first
        if staged.is_dir() and not staged.is_symlink():
            info = detect_format(staged)
            if info.format is Format.DCP or (info.format is Format.DEEPSPEED and (staged / MANIFEST).is_file()):
                return staged
    if (aside.exists() or aside.is_symlink()) and detect_format(aside).complete:
        return aside
    return None


def describe(info: CheckpointInfo) -> str:
    """``'PATH' is DETAIL``: how every refusal names the path it was given."""
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


def pick_one(path: Path) -> str:
    """The fix for a path that is not a checkpoint: the checkpoints inside it, when it is their directory."""
    inside = checkpoints_inside(path)
    if inside:
        shown = ", ".join(inside[:3]) + (", ..." if len(inside) > 3 else "")
        return f"it holds checkpoints ({shown}): pass one of them, e.g. {str(path / inside[-1])!r}"
    return "pass the .ckpt path ModelCheckpoint printed (e.g. checkpoints/last.ckpt)"


def _complete(path: Path) -> bool:
    try:
        return detect_format(path).complete  # .metadata read too: a torn sibling is no fix either
    except CheckpointFormatError:
        return False


def earlier_checkpoint(path: Path, action: str) -> str:
    """The fix for an incomplete checkpoint: a complete one beside it, by name, where there is one (the path the
    user just passed is no fix)."""
    others = [name for name in checkpoints_inside(path.parent) if name != path.name and _complete(path.parent / name)]
    if others:
        return f"{action} an earlier complete checkpoint, e.g. {str(path.parent / others[-1])!r}"
    return f"{action} an earlier complete checkpoint, or restore this one from a backup"


def _consolidate_fix(path: Path) -> str:
    return (
        f"convert the weights with `{CONSOLIDATE.format(path=path)}`, then model.load_state_dict(torch.load('weights.pt'))"
        f" before trainer.fit(model) without ckpt_path (weights carry over; optimizer state and step counters restart)"
    )


def locate_checkpoint(
    path: str | os.PathLike[str],
    action: str,
    *,
    error: type[CheckpointFormatError] = CheckpointFormatError,
    backend: str = "fsdp2",
    stacklevel: int = 2,
) -> CheckpointInfo:
    """The one reader's first step: what ``path`` holds, as a complete checkpoint, or the refusal with the fix.

    A save interrupted between its two renames leaves ``path`` missing and a complete sibling: that one is taken,
    with a warning, so a crash at any instant of a save still reads. ``action`` words the refusal and the warning
    ("convert", "consolidate", or RESUME, for which ``backend`` is the one resuming); ``stacklevel`` is the
    warning's, counted from the caller."""
    info = detect_format(path)
    if info.complete:
        return info
    recovered = interrupted_save(info.path) if info.format is not Format.UNKNOWN else None
    if recovered is None:
        raise _not_readable(info, action, error, backend)
    if action == RESUME:
        said = (
            f"{describe(info)}; a save to it was interrupted and left the complete checkpoint {str(recovered)!r},"
            f" which is loaded instead. The next save to {str(info.path)!r} puts it back in place"
        )
    else:
        said = f"{describe(info)}; {action.removesuffix('e')}ing the complete checkpoint an interrupted save left: {str(recovered)!r}"
    warnings.warn(said, stacklevel=stacklevel + 1)
    return detect_format(recovered)


def _not_readable(info: CheckpointInfo, action: str, error: type[CheckpointFormatError], backend: str) -> CheckpointFormatError:
    """The refusal of a path that holds no complete checkpoint (and no interrupted save left one beside it)."""
    p = info.path
    if action != RESUME:
        if info.format is Format.INCOMPLETE:
            return error(f"cannot {action}: {describe(info)}. Fix: {earlier_checkpoint(p, action)}")
        return error(f"cannot {action}: {describe(info)}, so it is not a checkpoint. Fix: {pick_one(p)}")
    if info.format is Format.MISSING:
        partial = staged_siblings(p)
        why = f" (the first save to it was interrupted: {str(partial[0])!r} is partial)" if partial else ""
        return error(f"cannot resume: {describe(info)}{why}. Fix: pass the path of an existing checkpoint (a .ckpt directory or file)")
    if info.format is Format.INCOMPLETE:
        return error(
            f"cannot resume: {describe(info)}. autoshard never leaves a partial save under the final name, so this one"
            f" was written without autoshard or copied partially. Fix: {earlier_checkpoint(p, 'resume from')}"
        )
    return error(
        f"cannot resume: {describe(info)}, so it is not a checkpoint. {backend} resumes from a directory written by"
        f" torch.distributed.checkpoint with Lightning's meta.pt, or from one torch.save file. Fix: {pick_one(p)}"
    )


def resolve_for_load(path: str | os.PathLike[str], backend: str = "fsdp2", world_size: int | None = None) -> Path:
    """The path to load for ``backend``, or CheckpointFormatError before anything is loaded.

    The one reader's first step (``locate_checkpoint``), then what ``backend`` can resume: the manifest is checked
    next, by every rank (its share), and DeepSpeed settles its tag from ``latest`` itself. ``world_size`` (the
    resuming run's) is checked against a DeepSpeed ZeRO-3 checkpoint's partitions, which DeepSpeed cannot reshard.
    """
    info = locate_checkpoint(path, RESUME, backend=backend)
    p = info.path
    resumes = get_backend(backend).resumes
    if info.format is Format.DEEPSPEED and Format.DEEPSPEED not in resumes:
        raise CheckpointFormatError(
            f"cannot resume with {backend}: {describe(info)}. {backend} cannot read DeepSpeed's partitioned files;"
            f" backend that reads it: DeepSpeed (strategy='autoshard-deepspeed', the strategy that wrote it). Fix: resume"
            f" with that strategy; or convert it, optimizer state, step and schedulers included, with `autoshard convert"
            f" {p} {p}-fsdp2 --to dcp` and resume from {str(p) + '-fsdp2'!r}; or {_consolidate_fix(p)}"
        )
    if info.format in (Format.DCP, Format.DCP_RAW) and Format.DCP not in resumes:
        raise CheckpointFormatError(
            f"cannot resume with DeepSpeed: {describe(info)}, written by fsdp2 (torch.distributed.checkpoint)."
            f" Backend that reads it: fsdp2 (strategy='fsdp2', at any world size). Fix: resume with strategy='fsdp2';"
            f" or convert it, optimizer state, step and schedulers included, with `autoshard convert {p} {p}-deepspeed"
            f" --to deepspeed --world-size N --precision P` (devices x nodes, the Trainer's precision) and resume from"
            f" {str(p) + '-deepspeed'!r}; or {_consolidate_fix(p)}"
        )
    if info.format is Format.DEEPSPEED:
        _check_deepspeed_resume(info, world_size)
    if info.format is Format.DCP_RAW:
        raise CheckpointFormatError(
            f"cannot resume: {describe(info)}: it holds tensors but no Lightning trainer state (loops, callbacks),"
            f" so it was written by torch.distributed.checkpoint directly. Fix: {_consolidate_fix(p)}"
        )
    if info.format is Format.FULL:
        _check_full_file(p)
    return p


def _check_deepspeed_resume(info: CheckpointInfo, world_size: int | None) -> None:
    """DeepSpeed loads the tag ``latest`` names, one ZeRO-3 partition file per rank: say so before it fails."""
    p = info.path
    deepspeed_files.check_version()
    tags = deepspeed_files.tags(p)
    if info.tag is None or deepspeed_files.latest_tag(p) != info.tag:
        tag = info.tag or (tags[-1] if tags else "TAG")
        raise CheckpointFormatError(
            f"cannot resume: {describe(info)}. DeepSpeed resumes the tag its 'latest' file names, and autoshard never"
            f" picks another. Fix: write the tag to resume into it, e.g. `echo {tag} > {str(p / deepspeed_files.LATEST)!r}`"
            f"{' (the newest tag)' if tags and tag == tags[-1] else ''}"
        )
    saved = deepspeed_files.zero3_world_size(p, info.tag)
    if world_size is not None and saved is not None and saved != world_size:
        out = f"{p}-world{world_size}"
        raise CheckpointFormatError(
            f"cannot resume: {describe(info)}, whose ZeRO-3 partitions are for {saved} ranks (zero_pp_rank_0 ..."
            f" zero_pp_rank_{saved - 1}), and this run has {world_size} (devices x nodes). DeepSpeed loads one partition"
            f" file per rank and cannot reshard them. Fix: `autoshard convert {p} {out} --to deepspeed --world-size"
            f" {world_size}` and resume from {out!r} (optimizer state, step and schedulers included); or resume with"
            f" devices x nodes = {saved}"
        )


def _check_full_file(path: Path) -> None:
    """A bare state dict (what consolidate writes) is weights, not a Lightning checkpoint: say how to use it; a
    truncated file is named here rather than in Lightning's traceback."""
    try:
        loaded = load_torch_file(path, action="resume")
    except UntrustedPickleError:  # custom objects inside: Lightning's own loader judges them, as it always did
        return
    if not isinstance(loaded, Mapping):
        return
    keys = set(loaded)
    if "state_dict" not in keys:
        shown = ", ".join(sorted(map(str, keys))[:4])
        raise CheckpointFormatError(
            f"cannot resume: {str(path)!r} is a torch.save file without 'state_dict' (keys: {shown}, ...): weights only,"
            f" such as `autoshard consolidate` writes, not a Lightning checkpoint. Fix: model.load_state_dict(torch.load"
            f"({str(path)!r})) before trainer.fit(model), without ckpt_path"
        )


def check_replaceable(path: str | os.PathLike[str]) -> None:
    """Saving swaps ``path`` out: refuse, before anything is written, unless what is there is autoshard's own earlier
    save (its manifest says so, ``KIND_SAVE``), a training checkpoint Lightning wrote (``_trainer_checkpoint``: what
    ModelCheckpoint replaces by design, e.g. ``last.ckpt`` of an earlier run without autoshard; refusing it would end a
    run at its first save), a symlink (the swap replaces the link, never its target), an empty directory, or the
    remains of an interrupted save. A user's own torch.save file, a text file, a folder of other files, a raw DCP
    directory: each stays as it is."""
    info = detect_format(path, verify=False)
    p = info.path
    if info.format is Format.MISSING or info.format is Format.INCOMPLETE or p.is_symlink():
        return
    if info.format is Format.UNKNOWN and p.is_dir() and not any(p.iterdir()):
        return
    if info.complete:
        foreign = foreign_content(p, KIND_SAVE, legacy=True)
        if foreign is None or _trainer_checkpoint(p, info.format):
            return
        raise CheckpointFormatError(
            f"refusing to save over {str(p)!r}: it is {info.detail}, and {foreign}; a save replaces it whole, and"
            f" autoshard replaces only its own earlier saves. Fix: save to a new path, e.g. {str(_unused_sibling(p))!r},"
            f" or move {str(p)!r} away first"
        )
    new = p / "model.ckpt" if p.is_dir() else _unused_sibling(p)
    raise CheckpointFormatError(
        f"refusing to save over {str(p)!r}: it is {info.detail}, and a save replaces it whole. Fix: save to a new"
        f" path, e.g. {str(new)!r}, or move it away first"
    )


LIGHTNING_VERSION_KEY = b"pytorch-lightning_version"  # in every checkpoint Lightning's Trainer saves


def _trainer_checkpoint(path: Path, fmt: Format) -> bool:
    """Whether ``path`` is a checkpoint a Lightning Trainer saved: a DCP directory with its ``meta.pt``, a DeepSpeed
    checkpoint, or a torch.save file whose pickle holds Lightning's version key (read as bytes: nothing unpickled)."""
    if fmt in (Format.DCP, Format.DEEPSPEED):
        return True
    if fmt is not Format.FULL:
        return False
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                return name is not None and LIGHTNING_VERSION_KEY in archive.read(name)
        with path.open("rb") as f:  # torch's legacy (pre-zip) format: the dict is the first pickle in the file
            return LIGHTNING_VERSION_KEY in f.read(1 << 20)
    except (OSError, zipfile.BadZipFile):
        return False


def _unused_sibling(path: Path) -> Path:
    """``last.ckpt`` -> ``last-1.ckpt`` (the first such name nothing holds): a new path beside one that is taken."""
    stem, suffix = path.stem, path.suffix
    for n in range(1, 1000):
        candidate = path.with_name(f"{stem}-{n}{suffix}")
        if not (candidate.exists() or candidate.is_symlink()):
            return candidate
    return path.with_name(f"{stem}-{writer_token()}{suffix}")


def finish_interrupted_commit(path: str | os.PathLike[str]) -> Path | None:
    """Before a new save: if a crash between the two renames left ``path`` missing, put the newest complete
    sibling back under ``path`` (so the new save's staging can be cleared without losing it). Rank 0 only."""
    p = Path(path)
    staged_sidecar = orphan_sidecar(p) if p.is_file() else None
    if staged_sidecar is not None:
        os.replace(staged_sidecar, sidecar_path(p))  # the file was swapped in, its sidecar not yet
        fsync_dir(p.parent)
    if p.exists() or p.is_symlink():
        return None
    recovered = interrupted_save(p)
    if recovered is not None:
        os.rename(recovered, p)
        fsync_dir(p.parent)
    return recovered


def prepare_staging(path: str | os.PathLike[str], token: str = "") -> Path:
    """Clear what earlier interrupted saves left and return the empty staging path of writer ``token``. Rank 0
    only, holding the destination's lock (``checkpoint_io.Publisher``): every other writer of ``path`` waits for it,
    so each staging found here is a dead writer's."""
    p = Path(path)
    finish_interrupted_commit(p)
    check_replaceable(p)
    for stale in staged_siblings(sidecar_path(p)):  # before the staged files: alone, a staged sidecar means "swap me in"
        remove(stale)
    for stale in staged_siblings(p):
        remove(stale)
    if p.exists() or p.is_symlink():
        remove(aside_path(p))  # ``path`` is complete: whatever stayed aside is older
    return staging_path(p, token)


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


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _reshaped(saved: Mapping[str, tuple[int, ...] | None], model: Mapping[str, tuple[int, ...]]) -> list[str]:
    return sorted(k for k in set(model) & set(saved) if saved[k] is not None and tuple(saved[k] or ()) != tuple(model[k]))


def model_mismatch(saved: Mapping[str, tuple[int, ...] | None], model: Mapping[str, tuple[int, ...]]) -> str | None:
    """How a model's state dict differs from a checkpoint's: missing and unexpected names, other shapes; None if equal."""
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    reshaped = _reshaped(saved, model)
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint: {_names(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} in the checkpoint but not in the model: {_names(unexpected)}")
    if reshaped:
        shown = [f"{k} (checkpoint {tuple(saved[k] or ())}, model {tuple(model[k])})" for k in reshaped]
        parts.append(f"{len(reshaped)} with another shape: {_names(shown, 3)}")
    return "; ".join(parts) or None


def load_failure(path: Path, model_name: str, model: Mapping[str, tuple[int, ...]], failures: Mapping[int, Any]) -> CheckpointFormatError:
    """torch's CheckpointException (a BaseException) as an autoshard error: which keys differ, or what failed where."""
    try:
        saved = saved_shapes(path)
        mismatch = model_mismatch(saved, model)
    except Exception:  # noqa: BLE001 - .metadata unreadable: report torch's failure below
        mismatch = None
    if mismatch:
        reshaped = _reshaped(saved, model)
        # strict=False skips missing and unexpected names only: a tensor of another shape still fails, so it is left out.
        load = (
            "model.load_state_dict(torch.load('weights.pt'), strict=False)"
            if not reshaped
            else "sd = model.state_dict(); model.load_state_dict({k: v for k, v in torch.load('weights.pt').items() if k in sd"
            " and v.shape == sd[k].shape}, strict=False)"
        )
        skipped = (
            f" (strict=False skips missing and unexpected names only; this leaves out the {len(reshaped)} tensor(s) of"
            f" another shape, {_names(reshaped, 3)}, which keep their initial values)"
            if reshaped
            else ""
        )
        return CheckpointFormatError(
            f"cannot resume from {str(path)!r}: its model weights do not match this {model_name}: {mismatch}."
            f" Fix: resume from a checkpoint of this model, or to start from the weights that match, run"
            f" `{CONSOLIDATE.format(path=path)}`, then {load} before trainer.fit(model) without ckpt_path{skipped}"
        )
    ranks = ", ".join(map(str, sorted(failures)))
    first = next(iter(failures.values()), None)
    error = first[0] if isinstance(first, tuple) else first
    what = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}" if error else "no detail"
    return CheckpointFormatError(
        f"cannot resume from {str(path)!r}: torch.distributed.checkpoint failed on rank(s) {ranks}: {what}."
        f" Fix: resume with the LightningModule and the optimizers (configure_optimizers) that wrote this checkpoint"
    )


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


# -- reading files: never code ---------------------------------------------------------------------------------------
# The types autoshard lets torch.load(weights_only=True) build besides tensors and plain values: exactly what the files
# of a DeepSpeed or Lightning checkpoint hold, found by loading real ones (tests/test_bad_inputs_reads.py, one test
# each). Anything else a pickle names is refused (UntrustedPickleError), or loaded under --trust-pickle alone.
DEEPSPEED_TYPES: tuple[str, ...] = deepspeed_files.PICKLED_TYPES  # LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address
# Lightning 2.6's own .ckpt / meta.pt / DeepSpeed client state hold plain values only (loops, callbacks, schedulers,
# precision); a user's hyper-parameters may hold their own types (a Path, a Namespace), which stay refused.
LIGHTNING_TYPES: tuple[str, ...] = ()
TRUSTED_TYPES: tuple[str, ...] = DEEPSPEED_TYPES + LIGHTNING_TYPES
WEIGHTS_ONLY_REFUSAL = "Weights only load failed"  # how torch's restricted unpickler's refusals begin
_FORCE, _NO_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class UntrustedPickleError(CheckpointFormatError):
    """A file whose pickle names a global outside what weights_only and TRUSTED_TYPES allow: loading it runs code."""


def trusted_types(import_missing: bool = False) -> list[Any]:
    """The classes of TRUSTED_TYPES, from modules already imported (deepspeed costs seconds to import; a file that
    needs its types imports it: ``import_missing``); those that cannot be imported (deepspeed absent) are left out."""
    found = []
    for qualname in TRUSTED_TYPES:
        module_name, _, name = qualname.rpartition(".")
        module = sys.modules.get(module_name)
        if module is None and import_missing:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        if module is not None and hasattr(module, name):
            found.append(getattr(module, name))
    return found


@contextmanager
def weights_only_loads(trust_pickle: bool = False) -> Iterator[None]:
    """Every torch.load inside reads weights only, with TRUSTED_TYPES allowed, even one that passes
    weights_only=False (DeepSpeed's zero_to_fp32 and DCP's byte entries do): torch's own TORCH_FORCE_WEIGHTS_ONLY_LOAD
    switch, set for the duration. With ``trust_pickle`` nothing changes."""
    if trust_pickle:
        yield
        return
    saved = {key: os.environ.pop(key, None) for key in (_FORCE, _NO_FORCE)}
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(trusted_types(import_missing=True)):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _refused_globals(path: Path, exc: BaseException) -> list[str]:
    """The globals a refused pickle names (read from its opcodes, never run), less the trusted ones."""
    try:
        found = list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError):  # not a zip file: the refusal's text names one
        found = []
    found = [g for g in found if g not in TRUSTED_TYPES] or re.findall(r"GLOBAL ([\w.]+)", str(exc))
    return list(dict.fromkeys(found))


def untrusted(path: Path, names: list[str], action: str, fix: str | None = None) -> UntrustedPickleError:
    """The refusal of a file whose pickle would build ``names``."""
    shown = ", ".join(f"`{n}`" for n in names[:4]) + (", ..." if len(names) > 4 else "")
    return UntrustedPickleError(
        f"cannot {action}: {str(path)!r} is a pickle that names {shown}: neither a tensor nor a type a Lightning or"
        f" DeepSpeed checkpoint holds (autoshard.checkpoint.TRUSTED_TYPES), and unpickling it would run code chosen by"
        f" whoever wrote the file, so autoshard reads it with torch.load(weights_only=True) and refuses it. Fix: "
        + (
            fix
            or f"if you trust who wrote it (your own run), pass {TRUST_PICKLE}, which unpickles it as"
            f" torch.load(weights_only=False) does; otherwise ask its author for the weights as safetensors"
        )
    )


def unreadable(path: Path, exc: BaseException, action: str) -> CheckpointFormatError:
    """The refusal of a file torch.load cannot parse: cut short, or damaged."""
    size = path.stat().st_size if path.is_file() else 0
    why = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
    return CheckpointFormatError(
        f"cannot {action}: {str(path)!r} ({size:,d} bytes) cannot be read ({type(exc).__name__}: {why}): it is"
        f" truncated or damaged, as a copy, download or save that stopped early leaves it. Fix: copy the checkpoint"
        f" again from where it was written, or use an earlier one"
    )


def load_torch_file(path: str | os.PathLike[str], *, action: str = "read", trust_pickle: bool = False, untrusted_fix: str | None = None) -> Any:
    """``torch.load`` of one file, on the CPU, memory-mapped where torch can: weights_only with TRUSTED_TYPES, so the
    file runs no code (UntrustedPickleError names what it wanted); a truncated or damaged file is a
    CheckpointFormatError naming it, not torch's traceback. ``trust_pickle`` unpickles anything (the user's opt-in)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            mmap = f.read(4) == b"PK\x03\x04"  # torch maps zip files only (torch.save's format since 1.6)
        if trust_pickle:
            return torch.load(p, map_location="cpu", mmap=mmap, weights_only=False)
        try:
            with torch.serialization.safe_globals(trusted_types()):
                return torch.load(p, map_location="cpu", mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as exc:
            wanted = _refused_globals(p, exc) if WEIGHTS_ONLY_REFUSAL in str(exc) else []
            if not wanted or not set(wanted) <= set(TRUSTED_TYPES):
                raise
            with torch.serialization.safe_globals(trusted_types(import_missing=True)):  # a DeepSpeed file: import its types
                return torch.load(p, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        wanted = _refused_globals(p, exc) if WEIGHTS_ONLY_REFUSAL in str(exc) else []
        if wanted and set(wanted) <= set(TRUSTED_TYPES):
            raise CheckpointFormatError(
                f"cannot {action}: {str(p)!r} holds DeepSpeed objects ({', '.join(wanted)}), which need deepspeed to be"
                f' read. Fix: pip install "autoshard[deepspeed]" (no GPU needed)'
            ) from None
        if wanted:
            raise untrusted(p, wanted, action, untrusted_fix) from None
        raise unreadable(p, exc, action) from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError) as exc:
        raise unreadable(p, exc, action) from None


# DCP writes its .metadata with plain pickle and torch reads it so (any global): these are all it holds.
_DCP_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its dataclasses and enums


class _MetadataUnpickler(pickle.Unpickler):
    refused: list[str]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES or module == _DCP_METADATA_MODULE:
            found = super().find_class(module, name)
            if module != _DCP_METADATA_MODULE or (isinstance(found, type) and found.__module__ == module):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"{module}.{name} refused")


def read_dcp_metadata(path: Path, action: str = "read") -> Any:
    """A DCP checkpoint's .metadata, unpickled with only the classes DCP writes into it (torch's own reader would
    build any global a crafted file names): UntrustedPickleError otherwise."""
    f = Path(path) / DCP_METADATA
    with open(f, "rb") as handle:
        unpickler = _MetadataUnpickler(handle)
        unpickler.refused = []
        try:
            return unpickler.load()
        except pickle.UnpicklingError:
            if unpickler.refused:
                raise untrusted(
                    f,
                    unpickler.refused,
                    action,
                    "restore the checkpoint from a backup, or use an earlier one: DCP never writes anything but its own metadata classes there",
                ) from None
            raise


def open_checkpoint(
    path: str | os.PathLike[str], action: str, *, tag: str | None = None, error: type[CheckpointFormatError] = CheckpointFormatError
) -> CheckpointInfo:
    """The one reader, for every command that reads a whole checkpoint in one process (``action``: convert,
    consolidate): ``locate_checkpoint`` (detect the format, take the complete checkpoint an interrupted save left in
    its place, with a warning), then every file checked against the manifest (a warning where there is none), then
    the DeepSpeed tag settled (``tag``, else the one ``latest`` names, never another). ``error`` for what cannot be
    read, with the fix."""
    info = locate_checkpoint(path, action, error=error, stacklevel=3)
    if not check_integrity(info.path):
        warnings.warn(unverified_warning(info.path), stacklevel=3)
    if info.format is Format.DEEPSPEED:
        info = replace(info, tag=deepspeed_tag(info, tag, action))
    elif tag is not None:
        raise error(f"cannot {action} with --tag {tag!r}: {describe(info)}, which has no tags (DeepSpeed checkpoints have). Fix: drop --tag")
    return info


def deepspeed_tag(info: CheckpointInfo, tag: str | None, action: str) -> str:
    """The tag directory to read: ``tag`` if it is one, else the one ``latest`` names; refused otherwise, naming the
    tags there, because reading another tag than the user meant converts other weights without a word."""
    p = info.path
    tags = deepspeed_files.tags(p)
    present = f"its tags: {', '.join(tags)}" if tags else "it holds no tag directory with model states"
    newest = " (the newest)" if len(tags) > 1 else ""
    if tag is not None:
        if tag in tags:
            return tag
        named = deepspeed_files.latest_tag(p)
        latest = f"; 'latest' names {named!r}" if named else ""
        instead = ", or leave --tag out to read the tag 'latest' names" if info.tag is not None else ""
        choose = f"--tag {tags[-1]}{newest}{instead}" if tags else "copy the whole checkpoint directory again"
        raise CheckpointFormatError(f"cannot {action} {str(p)!r} with --tag {tag!r}: no such tag directory ({present}{latest}). Fix: {choose}")
    if info.tag is not None:
        return info.tag
    choose = (
        f"pass --tag with the one you mean, e.g. --tag {tags[-1]}{newest}, or write its name into {str(p / deepspeed_files.LATEST)!r}"
        if tags
        else "copy the whole checkpoint directory again"
    )
    raise CheckpointFormatError(f"cannot {action}: {describe(info)}; autoshard reads the tag 'latest' names and never guesses another. Fix: {choose}")


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


__all__ = [
    "DEEPSPEED_TYPES",
    "LIGHTNING_TYPES",
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
