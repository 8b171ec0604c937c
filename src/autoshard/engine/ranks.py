"""Collectives every front end's checkpoint and setup code runs on all ranks alike: one rank's failure raised on
every rank (``on_rank0``), objects gathered in rank order, files hashed and verified in shares, a save begun.

Each is called by every rank: a rank that raised alone would leave the others waiting in the collective until the
process-group timeout.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from autoshard.checkpoint import corrupted, prepare_staging
from autoshard.checkpoint_io import Publisher, describe_files, integrity_problems

T = TypeVar("T")
_PLAIN = (str, int, float, bool, type(None))


class RankZeroTraceback(Exception):
    """Rank 0's traceback, as text: the ``__cause__`` of its error re-raised on another rank, so the log of every
    rank shows where rank 0 failed."""


def error_payload(exc: BaseException) -> dict[str, Any]:
    """What another rank needs to raise ``exc`` again: its class (module and name), its arguments where they are
    plain values, its text and its traceback. Plain data: it travels through a broadcast."""
    args: tuple[Any, ...] = tuple(exc.args)
    if isinstance(exc, OSError) and exc.errno is not None:  # the filename is not in args; str() shows it
        args = (exc.errno, exc.strerror, exc.filename) + ((None, exc.filename2) if exc.filename2 is not None else ())
    if not all(isinstance(a, _PLAIN) for a in args):
        args = (str(exc),)
    return {
        "module": type(exc).__module__,
        "qualname": type(exc).__qualname__,
        "args": args,
        "text": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def rebuild_error(payload: dict[str, Any], rank: int) -> Exception:
    """Rank 0's error as raised on ``rank``: the same class with the same text when that class is already imported
    here and rebuilds from its arguments to the same text; else a RuntimeError naming it. Rank 0's traceback is its
    ``__cause__``. Nothing is imported: a class this process never loaded falls back to RuntimeError."""
    kind = payload["qualname"]
    found: Any = sys.modules.get(payload["module"])
    for part in kind.split("."):
        found = getattr(found, part, None)
    exc: Exception | None = None
    if isinstance(found, type) and issubclass(found, Exception):
        try:
            exc = found(*payload["args"])
        except Exception:  # a constructor that wants other arguments
            exc = None
        if exc is not None and (type(exc) is not found or str(exc) != payload["text"]):
            exc = None
    if exc is None:
        exc = RuntimeError(f"rank 0 failed while checkpointing: {kind}: {payload['text']}")
    exc.__cause__ = RankZeroTraceback(f"rank 0's traceback (re-raised on rank {rank}):\n{payload['traceback'].rstrip()}")
    return exc


def on_rank0(fn: Callable[[], T], rank: int, world_size: int, broadcast: Callable[[Any], Any]) -> T | None:
    """Run ``fn`` on rank 0 and raise its error on every rank: a rank-0-only failure must not leave the others
    waiting in a barrier until the process-group timeout. Rank 0 raises its own exception; the others raise the same
    type with the same text (``rebuild_error``) and rank 0's traceback as the cause. Returns ``fn()``'s result,
    broadcast."""
    result: Any = None
    error: dict[str, Any] | None = None
    original: Exception | None = None
    if rank == 0:
        try:
            result = fn()
        except Exception as exc:  # re-raised below, on every rank
            if world_size == 1:
                raise
            original, error = exc, error_payload(exc)
    error = broadcast(error)
    if error is not None:
        if original is not None:
            raise original
        raise rebuild_error(error, rank)
    return broadcast(result)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def verify_on_every_rank(path: Path, rank: int, world_size: int) -> bool:
    """Every file of ``path`` against its manifest, each rank a share of them (largest first, dealt round-robin), so
    the check costs about one rank's part; the same error on every rank. False when there is no manifest."""
    shares = all_gather_object(integrity_problems(path, slice(rank, None, world_size)))
    if all(share is None for share in shares):
        return False
    problems = [problem for share in shares for problem in share or []]
    if problems:
        raise corrupted(path, problems)
    return True


def hash_on_every_rank(staged: Path, names: list[str], rank: int, sync: bool = False) -> dict[str, Any]:
    """Every rank hashes the files it wrote (``names``), in parallel, while they are in its page cache: rank 0 hashing
    them all after the barrier would cost the whole checkpoint on one rank (docs/checkpoints.md). Returns every rank's
    entries; an error is raised on every rank. ``sync``: fsync them first (files their writer did not sync)."""
    try:
        mine: dict[str, Any] | str = describe_files(staged, names, sync=sync)
    except OSError as exc:  # gathered first: a rank raising alone would leave the others in the collective
        mine = f"rank {rank} could not hash its files: {exc}"
    shares = all_gather_object(mine)
    errors = [share for share in shares if isinstance(share, str)]
    if errors:
        raise RuntimeError("; ".join(errors))
    return {name: entry for share in shares for name, entry in share.items()}


def begin_save(path: Path, token: str, held: list[Publisher]) -> None:
    """Rank 0, first step of a save: take ``path``'s lock (``held`` keeps it until the caller releases it), finish
    an interrupted commit, refuse a path that is not a checkpoint, clear what dead writers left."""
    held.append(Publisher(path, token).acquire())
    prepare_staging(path, token)


__all__ = [
    "RankZeroTraceback",
    "all_gather_object",
    "begin_save",
    "error_payload",
    "hash_on_every_rank",
    "on_rank0",
    "rebuild_error",
    "verify_on_every_rank",
]
