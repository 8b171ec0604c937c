"""The manifest of a checkpoint: every file's size and sha256, recorded by its writer (``write_manifest``, inside a
directory; ``stage_sidecar``, beside a single file) and checked before a load reads a file (``integrity_problems``,
``check_integrity``); ``foreign_content`` tells whether an output is autoshard's own, of one kind, so --force may
replace it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from autoshard.checkpoint.staging import fsync_file, staged_siblings, staging_path, token_of
from autoshard.checkpoint.trust import CheckpointFormatError

MANIFEST = "autoshard-manifest.json"  # inside a DCP checkpoint directory: every file's size and sha256
MANIFEST_SUFFIX = ".autoshard-manifest.json"  # beside a single-file checkpoint: a file cannot hold its own hash
KIND_SAVE = "autoshard save"  # the manifest's kind of a training checkpoint (fsdp2 DCP or full, autoshard-deepspeed, Fabric)
DIGEST = "sha256"  # ~1.5 GB/s here with SHA-NI (blake2b: 0.76 GB/s), and `sha256sum FILE` checks it by hand


def orphan_sidecar(path: str | os.PathLike[str]) -> Path | None:
    """A staged sidecar manifest whose staged file is gone: a save renamed its file in and was interrupted before its
    manifest followed, so this one describes the file now at ``path`` (the newest, if several)."""
    p = Path(path)
    for staged in staged_siblings(sidecar_path(p)):
        token = token_of(staged, sidecar_path(p))
        if staged.is_file() and not (staging_path(p, token).exists() or staging_path(p, token).is_symlink()):
            return staged
    return None


def _listing(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def foreign_content(path: str | os.PathLike[str], kind: str, legacy: bool = False) -> str | None:
    """Why ``path`` is not an output autoshard wrote as ``kind`` and holding nothing else; None when it is one, so
    ``--force`` may replace it. A directory: its manifest says ``kind`` and lists every file in it. A file: its
    sidecar manifest says ``kind`` and lists it alone, at its size (not hashed: replacing a corrupted output is
    what ``--force`` is for). ``legacy``: a manifest without a kind (an older autoshard) counts, where the caller
    has other evidence of the kind."""
    p = Path(path)
    if p.is_symlink():
        return f"it is a symlink to {os.readlink(p)!r}, and autoshard never writes one"
    where = p / MANIFEST if p.is_dir() else sidecar_path(p)
    if not where.is_file():
        return f"autoshard did not write it (no {where.name} {'in' if p.is_dir() else 'beside'} it)"
    try:
        body = json.loads(where.read_text())
        files: dict[str, Any] = dict(body["files"])
        found = body.get("kind")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its manifest {str(where)!r} cannot be read ({type(exc).__name__})"
    if found != kind and not (legacy and found is None):
        writer = f"{found!r}" if found else "an autoshard that did not record which command"
        return f"it was written by {writer}, not by {kind!r} (its {where.name} says so)"
    if p.is_dir():
        on_disk = {q.relative_to(p).as_posix() for q in p.rglob("*") if q.is_file() or q.is_symlink()} - {MANIFEST}
        extra = sorted(on_disk - set(files))
        if extra:
            return f"it also holds {_listing(extra)}, which its {MANIFEST} does not list (not written by autoshard)"
        return None
    entry = files.get(p.name)
    if set(files) != {p.name} or not isinstance(entry, Mapping) or entry.get("size") != p.stat().st_size:
        return f"it was changed after autoshard wrote it (it no longer matches {where.name})"
    return None


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where a single-file checkpoint's manifest lives: next to it, visible, so it travels with the file.

    A file cannot record its own hash, and torch.load / Lightning must keep reading the file unchanged.
    """
    p = Path(path)
    return p.with_name(p.name + MANIFEST_SUFFIX)


def file_digest(path: Path) -> str:
    """sha256 of a file in 1 MiB reads (hashlib.file_digest needs Python 3.11)."""
    digest = hashlib.new(DIGEST)
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def describe_files(root: Path, names: Iterable[str], sync: bool = False) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` for files under ``root``: what a manifest records and a check recomputes.

    ``sync``: fsync each file first, for files their writer did not sync (DeepSpeed's)."""
    if sync:
        for name in names:
            fsync_file(root / name)
    return {name: {"size": (root / name).stat().st_size, DIGEST: file_digest(root / name)} for name in sorted(names)}


def write_manifest(target: Path, files: Mapping[str, Mapping[str, Any]], kind: str | None = None) -> None:
    """Written and fsynced inside a staging only: what makes a staging count (meta.pt's rename, the staged file's
    rename) comes after, so a torn manifest is never read and needs no tmp + rename of its own.

    ``kind`` names the writer (``KIND_*`` of each writer): ``--force`` replaces only an output of its own kind."""
    body: dict[str, Any] = {"format": "autoshard-manifest", "version": 1, "algorithm": DIGEST}
    if kind is not None:
        body["kind"] = kind
    body["files"] = dict(sorted(files.items()))
    target.write_text(json.dumps(body, indent=1) + "\n")
    fsync_file(target)


def stage_sidecar(path: str | os.PathLike[str], token: str = "", kind: str | None = None) -> None:
    """The manifest of the file staged for ``path`` by writer ``token``, staged beside it; ``commit`` swaps in the
    file, then it."""
    p, staged = Path(path), staging_path(path, token)
    write_manifest(staging_path(sidecar_path(p), token), {p.name: describe_files(staged.parent, [staged.name])[staged.name]}, kind)


def _manifest_of(path: Path) -> Path | None:
    """The manifest describing checkpoint ``path``, or None (Lightning's own saves, autoshard before manifests).

    For a file, a save interrupted between its two renames (the file, then its sidecar) leaves the new file with
    the old sidecar and the new sidecar still staged; a staged sidecar without a staged file is that new one.
    """
    if path.is_dir():
        found = path / MANIFEST
        return found if found.is_file() else None
    target = path.resolve()  # save_last="link": the manifest sits beside the file the link points to
    staged = orphan_sidecar(target)
    if staged is not None:
        return staged
    found = sidecar_path(target)
    return found if found.is_file() else None


def integrity_problems(path: str | os.PathLike[str], share: slice = slice(None)) -> list[str] | None:
    """One line per file the manifest lists (its ``share`` of them: one rank's part) that is missing or changed.

    None when ``path`` has no manifest. Sizes are compared first (no read); only equal sizes are hashed.
    """
    p = Path(path)
    where = _manifest_of(p)
    if where is None:
        return None
    try:
        manifest = json.loads(where.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        algorithm = manifest.get("algorithm", DIGEST)
        order = sorted(files, key=lambda n: (-int(files[n]["size"]), n))  # largest first: the shares even out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"its manifest {str(where)!r} cannot be read ({type(exc).__name__}: {exc})"]
    if algorithm != DIGEST:
        return [f"its manifest {str(where)!r} records {algorithm!r} checksums; this autoshard checks {DIGEST!r}"]
    root = p if p.is_dir() else p.resolve()
    problems = []
    for name in order[share]:
        expected = files[name]
        f = root / name if p.is_dir() else root  # a sidecar lists one file: this one, whatever it is called now
        try:
            size = f.stat().st_size
            if size != expected["size"]:
                problems.append(f"{str(f)!r} holds {size:,d} bytes where {where.name} records {expected['size']:,d}")
                continue
            found = file_digest(f)
        except FileNotFoundError:
            problems.append(f"{str(f)!r} is missing ({where.name} lists it)")
            continue
        except OSError as exc:
            problems.append(f"{str(f)!r} cannot be read ({exc})")
            continue
        if found != expected[DIGEST]:
            problems.append(
                f"{str(f)!r} has {DIGEST} {found} where {where.name} records {expected[DIGEST]}"
                f" (same size, {size:,d} bytes: its content changed after the save)"
            )
    return problems


def unverified_warning(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    expected = p / MANIFEST if p.is_dir() else sidecar_path(p)
    return (
        f"autoshard: {str(p)!r} has no manifest {expected.name!r} (written by Lightning itself or an older autoshard):"
        f" its files cannot be checked against the checksums of the save, so a corrupted file would go unnoticed"
    )


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
