"""The one publish protocol every autoshard writer follows (training saves, ``consolidate``, ``convert``), for a
destination ``PATH`` named ``NAME`` (docs/checkpoints.md, "One publish protocol"):

1. lock: an exclusive ``flock`` on ``.NAME.autoshard-lock`` beside ``PATH`` (``Publisher``), held from before the
   staging is made until it is renamed in, so writers to one ``PATH`` take turns and none removes another's files;
2. stage: write under ``.NAME.autoshard-tmp.<pid>-<random>``, a name no other writer uses;
3. fsync the files, the staging directory, then the parent after the rename;
4. check, still under the lock, that what is at ``PATH`` now may be replaced (the caller's rule: never what
   autoshard did not write);
5. rename (``commit``): a file in one step; a directory aside, in, and the old one removed.

The offline writers (``consolidate``, ``convert``) add two steps around it, both here: ``output_clash``, the one check
of their output path (before the checkpoint is read, and again under the lock), and ``Publisher.publish_with_manifest``,
which records what they staged, with their kind, before the rename. A training save on every rank is ``saves``'.
"""

from __future__ import annotations

import errno
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import TracebackType

from autoshard.checkpoint.manifest import MANIFEST, describe_files, foreign_content, sidecar_path, stage_sidecar, write_manifest
from autoshard.checkpoint.staging import aside_path, fsync_dir, fsync_file, lock_path, remove, staged_siblings, staging_path, token_of, writer_token
from autoshard.errors import AutoShardError

try:
    import fcntl
except ImportError:  # not POSIX: writers still stage and rename, without the lock
    fcntl = None  # type: ignore[assignment]


class CheckpointWriteError(AutoShardError, OSError):
    """A checkpoint or output that cannot be written, refused before anything is: the file named, with the Fix."""


def commit(staged: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Swap a complete ``staged`` checkpoint in under ``path``. Rank 0 only, after every rank finished writing.

    A file over a file is one ``os.replace``, then its staged sidecar manifest (if any) is swapped in the same way
    (``_manifest_of`` reads a crash between the two). A directory cannot be replaced in one step: the old one is
    renamed aside, the new one renamed in, the old one removed. A crash at any instant leaves ``path``, or a complete
    sibling that ``resolve_for_load`` finds; never a partial directory under ``path``.
    """
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
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)


class Publisher:
    """One writer's turn at ``path``: the lock, a staging name of its own, and the publish step (the protocol in
    the module docstring). Every autoshard writer goes through it.

    ``with Publisher(path) as pub:`` write into ``pub.staged``, then ``pub.publish(check)``. Leaving the block
    releases the lock; on an error it also removes this writer's staging, unless an interrupted swap left ``path``
    missing (then the staging may be the newest complete copy, which the next save or load recovers). A writer whose
    steps run apart (a Lightning save, across collectives) calls ``acquire`` and ``release`` itself.
    """

    def __init__(self, path: str | os.PathLike[str], token: str | None = None) -> None:
        self.path = Path(path)
        self.token = token or writer_token()
        self.lock_file = lock_path(self.path)
        self._fd: int | None = None

    @property
    def staged(self) -> Path:
        return staging_path(self.path, self.token)

    def acquire(self) -> Publisher:
        """Take the destination's lock (waiting, with a warning naming the holder, while another writer has it).

        The lock file is removed on release while still held, so a writer that waited on the removed file sees the
        name now points elsewhere (or nowhere) and locks afresh: two writers never both hold "the" lock.
        """
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
        """The lock file's descriptor; a lock file that cannot be opened (another user's, left by a crash; a directory
        in its place) is refused naming it, instead of an OSError from deep inside a save."""
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
        """An offline writer's first step under the lock: remove the stagings of ``path`` that writers which died
        left (killed mid-write: a staging can be as large as the output), and return them, for the writer to say so.
        Every live writer of ``path`` stages only while it holds this lock, so whatever staging is found now is a dead
        one's. Without a lock (no flock on this filesystem) nothing is removed: another writer may be alive."""
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
                try:
                    os.unlink(self.lock_file)
                except FileNotFoundError:
                    pass
                os.close(self._fd)
            self._fd = None

    def publish(self, check: Callable[[Path], None] | None = None) -> None:
        """Under the lock: ``check(path)`` raises when what is at ``path`` now may not be replaced (something may
        have appeared while this writer wrote); then ``commit``, which fsyncs the staging and the parent."""
        if check is not None:
            check(self.path)
        commit(self.staged, self.path)

    def publish_with_manifest(self, kind: str, check: Callable[[Path], None] | None = None) -> None:
        """An offline writer's last step: the manifest of what it staged, with its ``kind`` (``--force`` replaces only
        an output of the same kind), fsynced: inside a staged directory, beside a staged file (a sidecar); then
        ``publish(check)``."""
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
    """Why nothing can be written at ``path``, or None. Asked before a large checkpoint is read.

    Tried for real, by creating and removing a probe file in the nearest existing directory (what would hold
    ``path`` or its missing parents): permission bits do not tell read-only mounts, ACLs or root apart."""
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
    """The refusal (with its Fix) of an output path nothing can be written at, or None: consolidate and convert
    ask before they read a checkpoint that may be large, every save (``Publisher.acquire``) before it writes."""
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


class Overlap(Enum):
    """Where an output path lies relative to the checkpoint being read: each is refused, even with --force."""

    SAME = "same"  # the output is the checkpoint
    HOLDS = "holds"  # the output is a directory holding it: replacing it deletes the checkpoint
    INSIDE = "inside"  # the output is inside the checkpoint directory: the next save to it deletes the output


def overlap(out: str | os.PathLike[str], source: str | os.PathLike[str]) -> Overlap | None:
    """How output ``out`` and checkpoint ``source`` share a path (symlinks resolved), or None."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src:
        return Overlap.SAME
    if dst in src.parents:
        return Overlap.HOLDS
    if src in dst.parents:
        return Overlap.INSIDE
    return None


class Clash(Enum):
    """Why an offline writer may not write its output path (``output_clash``); each writer words its refusal."""

    SAME = Overlap.SAME.value  # the output is the checkpoint being read
    HOLDS = Overlap.HOLDS.value  # the output is a directory holding it: publishing the output deletes the checkpoint
    INSIDE = Overlap.INSIDE.value  # the output is inside it: the next save to the checkpoint deletes the output
    UNWRITABLE = "unwritable"  # nothing can be written there (``detail``: the refusal, with its Fix)
    EXISTS = "exists"  # something is there, which --force would replace
    FOREIGN = "foreign"  # something is there that even --force may not replace (``detail``: why)


@dataclass(frozen=True)
class OutputClash:
    clash: Clash
    detail: str = ""


def output_clash(
    out: str | os.PathLike[str], source: str | os.PathLike[str] | None, kind: str | None, *, force: bool, legacy: bool = False
) -> OutputClash | None:
    """The one check of an offline writer's output path, asked before the checkpoint ``source`` is read and again
    under the lock, before the rename; None when ``out`` may be written. Refused: ``out`` is, holds or lies inside
    ``source`` (even with ``force``); nothing can be written there; something is there, unless ``force`` and it is
    an output of ``kind`` holding nothing else (``foreign_content``, ``legacy`` passed on; ``kind`` None: unknown,
    so nothing is replaced). --force never deletes what autoshard did not write."""
    shared = overlap(out, source) if source is not None and (Path(source).exists() or Path(source).is_symlink()) else None
    if shared is not None:
        return OutputClash(Clash(shared.value))
    refusal = unwritable_refusal(out)
    if refusal is not None:
        return OutputClash(Clash.UNWRITABLE, refusal)
    if not (Path(out).exists() or Path(out).is_symlink()):
        return None
    foreign = foreign_content(out, kind, legacy=legacy) if kind else "its kind is unknown"
    if foreign is not None:
        return OutputClash(Clash.FOREIGN, foreign)
    return None if force else OutputClash(Clash.EXISTS)
