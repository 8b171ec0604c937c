"""A training checkpoint's save on every rank, for the Trainer and Fabric strategies alike: what may be replaced
(``check_replaceable``), the first step under the lock (``begin_save``: finish an interrupted commit, clear what dead
writers left), rank 0's steps with their errors raised on every rank (``on_rank0``), each rank hashing the files it
wrote, the DeepSpeed publish, and each rank's RNG state.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from autoshard.capability import Format
from autoshard.checkpoint.formats import detect_format
from autoshard.checkpoint.manifest import KIND_SAVE, foreign_content, sidecar_path
from autoshard.checkpoint.resume import finish_interrupted_commit
from autoshard.checkpoint.staging import aside_path, remove, staged_siblings, staging_path, writer_token
from autoshard.checkpoint.trust import CheckpointFormatError


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


def prepare_staging(path: str | os.PathLike[str], token: str = "") -> Path:
    """Clear what earlier interrupted saves left and return the empty staging path of writer ``token``. Rank 0
    only, holding the destination's lock (``checkpoint.publish.Publisher``): every other writer of ``path`` waits for it,
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
