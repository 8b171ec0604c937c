"""Where a writer stages its files and how they are made durable: the hidden names beside a destination (a staging of
each writer's own, the old copy set aside, the lock file), fsyncs, and removal. Names and file operations only: the
publish protocol that uses them is ``publish``.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

STAGING_SUFFIX = ".autoshard-tmp"  # a save in progress (or interrupted): never under the final name
ASIDE_SUFFIX = ".autoshard-old"  # the previous checkpoint, moved aside for the instant of the swap
LOCK_SUFFIX = ".autoshard-lock"  # beside the destination: held by the one writer publishing to it


def writer_token() -> str:
    """A staging name's tail unique to one writer: its pid (to tell whose it is) and 8 random hex digits (another
    host's process with the same pid, on a shared filesystem)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def staging_path(path: str | os.PathLike[str], token: str = "") -> Path:
    """Hidden sibling on the same filesystem (so the final rename is atomic); no '.ckpt' suffix, so
    ModelCheckpoint's ``last*.ckpt`` search never picks it up. ``token`` (``writer_token()``) makes it one writer's;
    without it, the single name autoshard used before, still recognised."""
    p = Path(path)
    return p.with_name(f".{p.name}{STAGING_SUFFIX}" + (f".{token}" if token else ""))


def token_of(staged: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """The writer token in ``staged``, a staging of ``path`` ("" for the tokenless name)."""
    return Path(staged).name.removeprefix(staging_path(path).name).removeprefix(".")


def staged_siblings(path: str | os.PathLike[str]) -> list[Path]:
    """Every writer's staging of ``path`` (the tokenless name too), newest first: found by name, since each writer
    picks its own."""
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
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``), else by setting
    and restoring it at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def honour_umask(path: Path) -> None:
    """Give a file a library wrote with a private mode (safetensors' ``save_file``: 0600) the mode every other output
    gets, ``0666`` less the umask (0644 under the usual 022). A filesystem that keeps no modes keeps its own."""
    try:
        os.chmod(path, 0o666 & ~umask())
    except OSError:
        pass


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
