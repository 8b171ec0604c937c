"""The one publish protocol every autoshard writer follows (training saves, ``consolidate``, ``convert``), for a
destination ``PATH`` named ``NAME`` (docs/checkpoints.md, "One publish protocol"):

1. lock: an exclusive ``flock`` on ``.NAME.autoshard-lock`` beside ``PATH`` (``Publisher``), held from before the
   staging is made until it is renamed in, so writers to one ``PATH`` take turns and none removes another's files;
2. stage: write under ``.NAME.autoshard-tmp.<pid>-<random>``, a name no other writer uses;
3. fsync the files, the staging directory, then the parent after the rename;
4. check, still under the lock, that what is at ``PATH`` may be replaced (never what autoshard did not write);
5. rename (``commit``): a file in one step; a directory aside, in, and the old one removed.

The offline writers (``consolidate``, ``convert``) also check their output path (``output_clash``) and record a
manifest of what they staged (``publish_with_manifest``). The manifest holds every file's size and sha256, so a load
can tell a changed file (``integrity_problems``) and --force replaces only an output of its own kind. Nothing here
reads a checkpoint's content.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import socket
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any

from autoshard.checkpoint.formats import detect_format
from autoshard.errors import AutoShardError

STAGING_SUFFIX = ".autoshard-tmp"  # a save in progress (or interrupted): never under the final name
ASIDE_SUFFIX = ".autoshard-old"  # the previous checkpoint, moved aside for the instant of the swap
LOCK_SUFFIX = ".autoshard-lock"  # beside the destination: held by the one writer publishing to it


def writer_token() -> str:
    """A staging name's tail unique to one writer: its pid (to tell whose it is) and 8 random hex digits (another
    host's process with the same pid, on a shared filesystem)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def staging_path(path: str | os.PathLike[str], token: str = "") -> Path:
    """Hidden sibling on the same filesystem (so the rename is atomic), without '.ckpt' so ModelCheckpoint's
    ``last*.ckpt`` search skips it; without ``token``, the single name older autoshard used, still recognised."""
    p = Path(path)
    return p.with_name(f".{p.name}{STAGING_SUFFIX}" + (f".{token}" if token else ""))


def token_of(staged: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """The writer token in ``staged``, a staging of ``path`` ("" for the tokenless name)."""
    return Path(staged).name.removeprefix(staging_path(path).name).removeprefix(".")


def staged_siblings(path: str | os.PathLike[str]) -> list[Path]:
    """Every writer's staging of ``path`` (the tokenless name too), newest first."""
    p = Path(path)
    base = staging_path(p).name
    try:
        found = [e for e in p.parent.iterdir() if e.name == base or e.name.startswith(base + ".")]
    except OSError:  # no parent directory yet
        return []

    def modified(e: Path) -> float:
        try:
            return e.lstat().st_mtime
        except OSError:
            return 0.0

    return sorted(found, key=lambda e: (-modified(e), e.name))


def lock_path(path: str | os.PathLike[str]) -> Path:
    """The lock file of destination ``path``: hidden, beside it, never matching ``last*.ckpt``."""
    p = Path(path)
    return p.with_name(f".{p.name}{LOCK_SUFFIX}")


def aside_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.with_name(f".{p.name}{ASIDE_SUFFIX}")


def fsync_dir(path: Path) -> None:
    """Make a rename durable (a power loss after it must not bring the old name back)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``), else by setting
    and restoring it at once."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    current = os.umask(0o022)
    os.umask(current)
    return current


def honour_umask(path: Path) -> None:
    """Give a file a library wrote with a private mode (safetensors' ``save_file``: 0600) the mode every other output
    gets, ``0666`` less the umask (0644 under the usual 022). A filesystem that keeps no modes keeps its own."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~umask())


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


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


def listing(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def foreign_content(path: str | os.PathLike[str], kind: str, legacy: bool = False) -> str | None:
    """Why ``path`` is not an output autoshard wrote as ``kind`` holding nothing else (None: ``--force`` may replace
    it). A file's size is checked, not its hash: replacing a corrupted output is what ``--force`` is for.
    ``legacy``: a manifest without a kind (an older autoshard) counts."""
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
            return f"it also holds {listing(extra)}, which its {MANIFEST} does not list (not written by autoshard)"
        return None
    entry = files.get(p.name)
    if set(files) != {p.name} or not isinstance(entry, Mapping) or entry.get("size") != p.stat().st_size:
        return f"it was changed after autoshard wrote it (it no longer matches {where.name})"
    return None


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """A single-file checkpoint's manifest: beside it, visible, so it travels with the file (which cannot hold its own
    hash, and torch.load must keep reading unchanged)."""
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
    """``{relative path: {"size", "sha256"}}``; ``sync``: fsync each file first (DeepSpeed's writer does not)."""
    if sync:
        for name in names:
            fsync_file(root / name)
    return {name: {"size": (root / name).stat().st_size, DIGEST: file_digest(root / name)} for name in sorted(names)}


def write_manifest(target: Path, files: Mapping[str, Mapping[str, Any]], kind: str | None = None) -> None:
    """Written inside a staging only: what makes a staging count comes after, so a torn manifest is never read and
    needs no rename of its own. ``kind`` names the writer."""
    body: dict[str, Any] = {"format": "autoshard-manifest", "version": 1, "algorithm": DIGEST}
    if kind is not None:
        body["kind"] = kind
    body["files"] = dict(sorted(files.items()))
    target.write_text(json.dumps(body, indent=1) + "\n")
    fsync_file(target)


def stage_sidecar(path: str | os.PathLike[str], token: str = "", kind: str | None = None) -> None:
    """The manifest of the file staged for ``path`` by writer ``token``, staged beside it."""
    p, staged = Path(path), staging_path(path, token)
    write_manifest(staging_path(sidecar_path(p), token), {p.name: describe_files(staged.parent, [staged.name])[staged.name]}, kind)


def _manifest_of(path: Path) -> Path | None:
    """The manifest of ``path``, or None. A save interrupted between its two renames (file, then sidecar) leaves the
    new sidecar staged: a staged sidecar without a staged file is the one that describes ``path``."""
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
    """One line per listed file (its ``share``: one rank's part) that is missing or changed; None without a manifest.
    Only files of the recorded size are hashed."""
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


try:
    import fcntl
except ImportError:  # not POSIX: writers still stage and rename, without the lock
    fcntl = None  # type: ignore[assignment]


class CheckpointWriteError(AutoShardError, OSError):
    """A checkpoint or output that cannot be written, refused before anything is: the file named, with the Fix."""


def commit(staged: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Swap a complete ``staged`` checkpoint in under ``path`` (rank 0, after every rank wrote). A directory cannot be
    replaced in one step: the old one goes aside, the new one in. A crash at any instant leaves ``path`` or a complete
    sibling that ``resolve_for_load`` finds, never a partial directory under ``path``."""
    staged, p = Path(staged), Path(path)
    fsync_dir(staged if staged.is_dir() else staged.parent)
    staged_sidecar = staging_path(sidecar_path(p), token_of(staged, p))
    if not staged_sidecar.is_file():
        remove(sidecar_path(p))  # the old file's checksum would call the new one corrupted
    if staged.is_file() and not p.is_dir() or not (p.exists() or p.is_symlink()):
        os.replace(staged, p)
    else:
        old = aside_path(p)
        remove(old)
        os.rename(p, old)
        os.rename(staged, p)
        fsync_dir(p.parent)
        remove(old)
    if staged_sidecar.is_file():
        os.replace(staged_sidecar, sidecar_path(p))
    fsync_dir(p.parent)


_HELD_LOCKS: set[int] = set()  # this process's lock file descriptors


def _forget_locks_in_child() -> None:
    """A forked child (a DataLoader worker, a multiprocessing helper) inherits the descriptors of the locks its parent
    holds, and a flock lasts while any copy is open: the child closes its copies, so the parent's release releases."""
    for fd in list(_HELD_LOCKS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


class Publisher:
    """One writer's turn at ``path``: ``with Publisher(path) as pub:`` write into ``pub.staged``, then
    ``pub.publish(check)``. On an error the staging is removed, unless an interrupted swap left ``path`` missing (the
    staging may then be the newest complete copy, which the next save or load recovers)."""

    def __init__(self, path: str | os.PathLike[str], token: str | None = None) -> None:
        self.path = Path(path)
        self.token = token or writer_token()
        self.lock_file = lock_path(self.path)
        self._fd: int | None = None

    @property
    def staged(self) -> Path:
        return staging_path(self.path, self.token)

    def acquire(self) -> Publisher:
        """Take the destination's lock, waiting with a warning naming the holder. The lock file is removed on release
        while held, so a waiter checks that the name still points at its file: two writers never both hold it."""
        refusal = unwritable_refusal(self.path, before="anything was written")
        if refusal is not None:  # a parent that is a file, a read-only directory: said as such, not as a lock file
            raise CheckpointWriteError(refusal)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            return self
        warned = False
        while True:
            fd = self._open_lock_file()
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if not warned:
                        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                        warnings.warn(
                            f"autoshard: {str(self.path)!r} is being written by {holder} (it holds {str(self.lock_file)!r});"
                            f" waiting for it to finish, then this write goes ahead",
                            stacklevel=2,
                        )
                        warned = True
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    warnings.warn(
                        f"autoshard: cannot lock {str(self.lock_file)!r} ({exc.strerror}: this filesystem has no flock):"
                        f" writing {str(self.path)!r} unlocked, so do not let two processes write it at once",
                        stacklevel=2,
                    )
                    return self
                raise
            try:
                current = os.stat(self.lock_file)
                mine = os.fstat(fd)
                same = (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed this lock file when it finished: lock the current one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        _HELD_LOCKS.add(fd)
        return self

    def _open_lock_file(self) -> int:
        """The lock file's descriptor; one that cannot be opened is refused by name, not as an OSError deep in a save."""
        try:
            return os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, "error")
            try:
                import pwd

                owner = f", owned by {pwd.getpwuid(os.stat(self.lock_file).st_uid).pw_name}"
            except (ImportError, KeyError, OSError):
                owner = ""
            raise CheckpointWriteError(
                f"cannot open {str(self.lock_file)!r}{owner} ({code}: {exc.strerror}), the lock file that keeps two"
                f" writers of {str(self.path)!r} apart, so nothing was written. Fix: if no process is writing"
                f" {str(self.path)!r}, remove the lock file (a crashed writer left it), or write to another path"
            ) from exc

    def clear_stale(self) -> list[Path]:
        """Remove and return the stagings dead writers left: a live writer stages only under this lock, so any found now
        is a dead one's. Without a lock (no flock here) nothing is removed: another writer may be alive."""
        if self._fd is None:
            return []
        found = [p for p in staged_siblings(self.path) if token_of(p, self.path) != self.token]
        for stale in found:  # with the manifest it staged beside it; a staged manifest alone describes ``path``: kept
            remove(staging_path(sidecar_path(self.path), token_of(stale, self.path)))
            remove(stale)
        return found

    def release(self, discard: bool = False) -> None:
        """Give the lock back (and remove its file); ``discard``: remove this writer's staging first."""
        try:
            if discard and (self.path.exists() or self.path.is_symlink() or not aside_path(self.path).exists()):
                remove(staging_path(sidecar_path(self.path), self.token))
                remove(self.staged)
        finally:
            if self._fd is not None and self._fd in _HELD_LOCKS:  # not in a forked child: its copy is closed already
                _HELD_LOCKS.discard(self._fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.lock_file)
                os.close(self._fd)
            self._fd = None

    def publish(self, check: Callable[[Path], None] | None = None) -> None:
        """``check(path)`` under the lock (something may have appeared while this writer wrote), then ``commit``."""
        if check is not None:
            check(self.path)
        commit(self.staged, self.path)

    def publish_with_manifest(self, kind: str, check: Callable[[Path], None] | None = None) -> None:
        """The manifest of what was staged, with its ``kind``, then ``publish(check)``."""
        staged = self.staged
        if staged.is_dir():
            files = [p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()]
            write_manifest(staged / MANIFEST, describe_files(staged, files), kind)
            fsync_dir(staged)
        else:
            fsync_file(staged)
            stage_sidecar(self.path, self.token, kind)
        self.publish(check)

    def __enter__(self) -> Publisher:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release(discard=kind is not None)


def unwritable(path: str | os.PathLike[str]) -> str | None:
    """Why nothing can be written at ``path``, or None: tried with a probe file, since permission bits do not tell
    read-only mounts, ACLs or root apart."""
    parent = Path(path).parent
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    creates = "" if existing == parent else f" (where {str(parent)!r} would be created)"
    if not existing.is_dir():
        if existing == parent:
            return f"{str(parent)!r} is a file, not a directory"
        return f"{str(existing)!r} is a file, not a directory, so {str(parent)!r} cannot be created"
    probe = existing / f".autoshard-probe.{writer_token()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return f"the directory {str(existing)!r}{creates} is not writable ({errno.errorcode.get(exc.errno or 0, 'error')}: {exc.strerror})"
    os.unlink(probe)
    return None


def unwritable_refusal(out: str | os.PathLike[str], before: str = "reading the checkpoint") -> str | None:
    """The refusal (with its Fix) of an output path nothing can be written at, or None."""
    problem = unwritable(out)
    if problem is None:
        return None
    parent = Path(out).parent
    blocker = next((d for d in (parent, *parent.parents) if d.exists() or d.is_symlink()), parent)
    remedy = f"move the file {str(blocker)!r} away" if not blocker.is_dir() else f"make {str(blocker)!r} writable"
    return (
        f"cannot write {str(out)!r}: {problem}; refused before {before}. Fix: choose an output path in a"
        f" directory you can write (e.g. under {str(Path.home())!r}), or {remedy}"
    )


class Clash(Enum):
    """Why an offline writer may not write its output path (``output_clash``); each writer words its refusal."""

    SAME = "same"  # the output is the checkpoint being read (refused even with --force, as the next two)
    HOLDS = "holds"  # the output is a directory holding it: publishing the output deletes the checkpoint
    INSIDE = "inside"  # the output is inside it: the next save to the checkpoint deletes the output
    UNWRITABLE = "unwritable"  # nothing can be written there (``detail``: the refusal, with its Fix)
    EXISTS = "exists"  # something is there, which --force would replace
    FOREIGN = "foreign"  # something is there that even --force may not replace (``detail``: why)


def overlap(out: str | os.PathLike[str], source: str | os.PathLike[str]) -> Clash | None:
    """How output ``out`` and checkpoint ``source`` share a path (symlinks resolved), or None."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src:
        return Clash.SAME
    if dst in src.parents:
        return Clash.HOLDS
    if src in dst.parents:
        return Clash.INSIDE
    return None


@dataclass(frozen=True)
class OutputClash:
    clash: Clash
    detail: str = ""


def output_clash(
    out: str | os.PathLike[str], source: str | os.PathLike[str] | None, kind: str | None, *, force: bool, legacy: bool = False
) -> OutputClash | None:
    """The one check of an offline writer's output path, before ``source`` is read and again before the rename; None
    when ``out`` may be written. --force never replaces ``source`` itself, nor what autoshard did not write."""
    shared = overlap(out, source) if source is not None and (Path(source).exists() or Path(source).is_symlink()) else None
    if shared is not None:
        return OutputClash(shared)
    refusal = unwritable_refusal(out)
    if refusal is not None:
        return OutputClash(Clash.UNWRITABLE, refusal)
    if not (Path(out).exists() or Path(out).is_symlink()):
        return None
    foreign = foreign_content(out, kind, legacy=legacy) if kind else "its kind is unknown"
    if foreign is not None:
        return OutputClash(Clash.FOREIGN, foreign)
    return None if force else OutputClash(Clash.EXISTS)


def output_refusal(found: OutputClash, out: Path, source: Path | None, force: bool, words: Mapping[Clash, str], **fill: str) -> str:
    """An offline writer's refusal of its output path, in its own ``words``: one template per Clash."""
    if found.clash is Clash.UNWRITABLE:
        return found.detail
    what = detect_format(out, verify=False).detail if found.clash in (Clash.EXISTS, Clash.FOREIGN) else ""
    even = " even with --force" if force else ""
    return words[found.clash].format(out=str(out), source=str(source), what=what, detail=found.detail, even=even, **fill)
