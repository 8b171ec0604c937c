"""A training checkpoint's save on every rank, for the Trainer and Fabric strategies alike: what may be replaced
(``check_replaceable``), the first step under the lock (``begin_save``: finish an interrupted commit, clear what dead
writers left), rank 0's steps with their errors raised on every rank (``on_rank0``), each rank hashing the files it
wrote, the DeepSpeed publish, and each rank's RNG state.
"""

from __future__ import annotations

import os
import random
import sys
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from autoshard.capability import Format
from autoshard.checkpoint import deepspeed_layout
from autoshard.checkpoint.formats import LIGHTNING_META, detect_format
from autoshard.checkpoint.publish import (
    KIND_SAVE,
    MANIFEST,
    Publisher,
    aside_path,
    describe_files,
    foreign_content,
    fsync_dir,
    fsync_file,
    integrity_problems,
    remove,
    sidecar_path,
    stage_sidecar,
    staged_siblings,
    staging_path,
    write_manifest,
    writer_token,
)
from autoshard.checkpoint.resume import corrupted, finish_interrupted_commit
from autoshard.checkpoint.trust import CheckpointFormatError


def check_replaceable(path: str | os.PathLike[str]) -> None:
    """Saving swaps ``path`` out: refused before anything is written, unless it is autoshard's own earlier save, a
    checkpoint a Lightning Trainer wrote (ModelCheckpoint replaces those by design: refusing would end a run at its
    first save), a symlink (the link is replaced, never its target), an empty directory or an interrupted save."""
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
            f" autoshard replaces only its own earlier saves. Fix: save to a new path, e.g. {str(unused_sibling(p))!r},"
            f" or move {str(p)!r} away first"
        )
    new = p / "model.ckpt" if p.is_dir() else unused_sibling(p)
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


def unused_sibling(path: Path) -> Path:
    """``last.ckpt`` -> ``last-1.ckpt`` (the first such name nothing holds): a new path beside one that is taken."""
    stem, suffix = path.stem, path.suffix
    for n in range(1, 1000):
        candidate = path.with_name(f"{stem}-{n}{suffix}")
        if not (candidate.exists() or candidate.is_symlink()):
            return candidate
    return path.with_name(f"{stem}-{writer_token()}{suffix}")


def prepare_staging(path: str | os.PathLike[str], token: str = "") -> Path:
    """Clear what interrupted saves left (rank 0, under the lock: each staging found is a dead writer's) and return
    writer ``token``'s staging path."""
    p = Path(path)
    finish_interrupted_commit(p)
    check_replaceable(p)
    for stale in [*staged_siblings(sidecar_path(p)), *staged_siblings(p)]:  # sidecars first: alone, one means "swap me in"
        remove(stale)
    if p.exists() or p.is_symlink():
        remove(aside_path(p))  # ``path`` is complete: whatever stayed aside is older
    return staging_path(p, token)


T = TypeVar("T")
_PLAIN = (str, int, float, bool, type(None))


class RankZeroTraceback(Exception):
    """Rank 0's traceback, as the ``__cause__`` of its error re-raised on another rank."""


def error_payload(exc: BaseException) -> dict[str, Any]:
    """What another rank needs to raise ``exc`` again, as plain data for a broadcast."""
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
    """Rank 0's error on ``rank``: the same class and text when that class is imported here and rebuilds from its
    arguments to the same text (nothing is imported), else a RuntimeError naming it."""
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
    """Run ``fn`` on rank 0 and raise its error on every rank (a rank-0-only failure must not leave the others in a
    barrier until the process-group timeout); returns ``fn()``'s result, broadcast."""
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
    """Every rank hashes the files it wrote while they are in its page cache (rank 0 hashing them all would cost the
    whole checkpoint on one rank); returns every rank's entries. ``sync``: fsync them first."""
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


def rng_state() -> dict[str, Any]:
    """This process's torch / numpy / python (and CUDA) RNG state, in types ``torch.load(weights_only=True)`` reads."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(kind), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_shards(state: dict[str, Any], staged: Path) -> list[str]:
    """Every rank writes its DCP shards; returns the files this rank wrote (the writer class is built here: importing
    torch.distributed.checkpoint would cost every ``import autoshard``)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    class RecordingWriter(FileSystemWriter):
        written: tuple[str, ...] = ()

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            self.written = tuple(sorted({result.storage_data.relative_path for result in future.wait()}))
            return future

    writer = RecordingWriter(str(staged), sync_files=True)
    save(state, storage_writer=writer)
    return list(writer.written)


def write_meta(checkpoint: dict[str, Any], staged: Path, shards: dict[str, Any]) -> None:
    """meta.pt, then the manifest of every file, then meta.pt's rename: its presence marks the staging complete, so
    a complete staging always has its manifest."""
    part = staged / f".{LIGHTNING_META}.part"
    torch.save(checkpoint, part)
    fsync_file(part)
    files = dict(shards)
    files[LIGHTNING_META] = describe_files(staged, [part.name])[part.name]
    others = [p.name for p in staged.iterdir() if p.is_file() and p.name not in files and p != part]
    files.update(describe_files(staged, others))  # .metadata (rank 0's), and anything else DCP wrote
    write_manifest(staged / MANIFEST, files, KIND_SAVE)
    part.rename(staged / LIGHTNING_META)
    fsync_dir(staged)


def write_sharded(state: dict[str, Any], checkpoint: dict[str, Any], staged: Path, rank: int, world: int, broadcast: Callable[[Any], Any]) -> None:
    """A DCP save into ``staged``: every rank's shards (``state``), hashed by the rank that wrote them, then rank 0's
    meta.pt (``checkpoint``, the rest) with the manifest."""
    on_rank0(lambda: staged.mkdir(parents=True), rank, world, broadcast)
    shards = hash_on_every_rank(staged, write_shards(state, staged), rank)
    on_rank0(lambda: write_meta(checkpoint, staged, shards), rank, world, broadcast)


def write_full(save: Callable[[Path], None], staged: Path, path: Path, token: str) -> None:
    """Rank 0's single-file save: ``save(staged)``, then the file and its manifest, both staged; ``commit`` swaps in
    the file, then the manifest."""
    save(staged)
    fsync_file(staged)
    stage_sidecar(path, token, KIND_SAVE)


def publish_save(path: Path, write: Callable[[Path, str], None], rank: int, world: int, broadcast: Callable[[Any], Any]) -> None:
    """A save every rank takes part in: rank 0 holds ``path``'s lock until the rename; every rank writes under one
    staging name. A failed save's staging stays for the next save to clear (it may be complete)."""
    token = broadcast(writer_token())
    held: list[Publisher] = []
    try:
        on_rank0(lambda: begin_save(path, token, held), rank, world, broadcast)
        write(staging_path(path, token), token)
        on_rank0(lambda: held[0].publish(check_replaceable), rank, world, broadcast)
    finally:
        for publisher in held:
            publisher.release()


def publish_deepspeed_save(filepath: Any, write: Callable[[Path], None], rank: int, world: int, broadcast: Callable[[Any], Any]) -> None:
    """A DeepSpeed engine's save (``write(staging)``) through the publish protocol, with the manifest fsdp2 saves
    write: each rank fsyncs and hashes the files it wrote."""
    deepspeed_layout.check_version()  # the shares below follow DeepSpeed's file names

    def write_and_hash(staged: Path, token: str) -> None:
        write(staged)  # returns after DeepSpeed's last barrier: all files are in
        names = [f.relative_to(staged).as_posix() for f in staged.rglob("*") if f.is_file()]
        mine = [name for name in names if deepspeed_layout.writer_rank(name) % world == rank]
        files = hash_on_every_rank(staged, mine, rank, sync=True)  # DeepSpeed does not fsync its files

        def manifest() -> None:
            write_manifest(staged / MANIFEST, files, KIND_SAVE)
            fsync_dir(staged)

        on_rank0(manifest, rank, world, broadcast)

    publish_save(Path(broadcast(filepath)), write_and_hash, rank, world, broadcast)


def load_full_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any], broadcast_from_rank0: bool = False) -> None:
    """A full (unsharded, name-keyed) optimizer state into a sharded model's optimizer, for both front ends. One whose
    state is empty (plain SGD keeps none) is loaded as the local state it equals: torch's full-state-dict load needs
    a tensor in the state to find the device ("Expected device to be set"), and only the param groups are restored."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    full = bool(state.get("state"))
    options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=broadcast_from_rank0 and full)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def restore_rng(extra: dict[str, Any], rank: int, world: int, loaded: str, draws: str) -> str | None:
    """This rank's saved RNG state put back; else (another world size) the warning to give, in the words of the
    front end: ``loaded`` ("resumed"), ``draws`` ("random augmentations")."""
    rng = extra.get("rng_states") or []
    if extra.get("world_size") == world and len(rng) == world:
        set_rng_state(rng[rank])
        return None
    return (
        f"autoshard: saved at world size {extra.get('world_size')}, {loaded} at {world}: model and optimizer"
        f" states are resharded exactly, but per-rank RNG states cannot be mapped, so {draws} differ from an"
        f" uninterrupted run"
    )
