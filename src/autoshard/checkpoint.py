"""Checkpoint formats on disk: detect them, resolve a path to a complete checkpoint, swap saves in atomically, consolidate.

Everything here works in one process, without a GPU and without the world size that wrote the checkpoint:
``autoshard consolidate CKPT OUT.pt`` is meant to run on a laptop after the job is gone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from autoshard.errors import AutoShardError

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, atomically, once every rank has written
LIGHTNING_META = "meta.pt"  # Lightning's trainer state (loops, callbacks, schedulers) next to the DCP shards
DEEPSPEED_LATEST = "latest"  # DeepSpeed's pointer to the tag directory
STAGING_SUFFIX = ".autoshard-tmp"  # a save in progress (or interrupted): never under the final name
ASIDE_SUFFIX = ".autoshard-old"  # the previous checkpoint, moved aside for the instant of the swap
LIGHTNING_DEEPSPEED_PREFIX = "_forward_module."  # Lightning's DeepSpeed wrapper around the LightningModule
CONSOLIDATE = "autoshard consolidate {path} weights.pt"


class CheckpointFormatError(AutoShardError, ValueError):
    """A path that cannot be loaded (or overwritten) as asked: what it is, what reads it, and the fix."""


class Format(str, Enum):
    """What a path holds, as far as the files on disk tell."""

    DCP = "distributed"  # Lightning / autoshard DCP directory: .metadata + meta.pt
    DCP_RAW = "dcp-without-trainer-state"  # a torch.distributed.checkpoint directory without Lightning's meta.pt
    FULL = "full"  # one torch.save file
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO directory: latest + <tag>/*model_states.pt
    INCOMPLETE = "incomplete"  # shards (or meta.pt) without DCP's .metadata: a save that did not finish
    MISSING = "missing"
    UNKNOWN = "unknown"


RESUMABLE_BY = {"fsdp2": (Format.DCP, Format.FULL), "deepspeed_zero3": (Format.DEEPSPEED, Format.FULL)}
STRATEGY_FOR = {Format.DCP: "fsdp2", Format.DEEPSPEED: "autoshard-deepspeed"}


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


def staging_path(path: str | os.PathLike[str]) -> Path:
    """Hidden sibling on the same filesystem (so the final rename is atomic); no '.ckpt' suffix, so
    ModelCheckpoint's ``last*.ckpt`` search never picks it up."""
    p = Path(path)
    return p.with_name(f".{p.name}{STAGING_SUFFIX}")


def aside_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.with_name(f".{p.name}{ASIDE_SUFFIX}")


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
    if info.format is Format.DEEPSPEED and backend != "deepspeed_zero3":
        raise CheckpointFormatError(
            f"cannot resume with {backend}: {_describe(info)}. {backend} cannot read DeepSpeed's partitioned files;"
            f" backend that reads it: DeepSpeed (strategy='autoshard-deepspeed', the strategy that wrote it). Fix: resume"
            f" with that strategy, or {_consolidate_fix(p)}"
        )
    if info.format in (Format.DCP, Format.DCP_RAW) and backend == "deepspeed_zero3":
        raise CheckpointFormatError(
            f"cannot resume with DeepSpeed: {_describe(info)}, written by fsdp2 (torch.distributed.checkpoint)."
            f" Backend that reads it: fsdp2 (strategy='fsdp2', at any world size). Fix: resume with strategy='fsdp2',"
            f" or {_consolidate_fix(p)}"
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


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def finish_interrupted_commit(path: str | os.PathLike[str]) -> Path | None:
    """Before a new save: if a crash between the two renames left ``path`` missing, put the newest complete
    sibling back under ``path`` (so the new save's staging can be cleared without losing it). Rank 0 only."""
    p = Path(path)
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
    remove(staged)
    if p.exists() or p.is_symlink():
        remove(aside_path(p))  # ``path`` is complete: whatever stayed aside is older
    return staged


def commit(staged: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Swap a complete ``staged`` checkpoint in under ``path``. Rank 0 only, after every rank finished writing.

    A file over a file is one ``os.replace``. A directory cannot be replaced in one step: the old one is renamed aside,
    the new one renamed in, the old one removed. A crash at any instant leaves ``path``, or a complete sibling that
    ``resolve_for_load`` finds; never a partial directory under ``path``.
    """
    staged, p = Path(staged), Path(path)
    fsync_dir(staged if staged.is_dir() else staged.parent)
    if staged.is_file() and not p.is_dir() or not (p.exists() or p.is_symlink()):
        os.replace(staged, p)
        fsync_dir(p.parent)
        return
    old = aside_path(p)
    remove(old)
    os.rename(p, old)
    os.rename(staged, p)
    fsync_dir(p.parent)
    remove(old)


# -- consolidation ---------------------------------------------------------------------------------------------------
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

    def describe(self) -> str:
        return (
            f"consolidated {self.format.value} checkpoint {str(self.source)!r} -> {str(self.out_path)!r}: {self.tensors}"
            f" tensors, {self.numel:,d} elements, {self.bytes / 2**20:.2f} MiB, in {self.seconds:.2f} s."
            f" Load it with model.load_state_dict(torch.load({str(self.out_path)!r}))"
        )


def _dcp_keys(path: Path) -> set[str]:
    """Top-level keys of a DCP checkpoint, from its .metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    tops = set()
    for fqn in metadata.state_dict_metadata:
        planner = (metadata.planner_data or {}).get(fqn)
        tops.add(str(planner[0]) if planner else fqn.split(".", 1)[0])
    return tops


def _load_dcp(path: Path) -> tuple[dict[str, Any], str | None]:
    """The model entry of a DCP checkpoint, read in this one process (no process group, any saved world size)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    keys = _dcp_keys(path)
    key = next((k for k in ("state_dict", "model") if k in keys), None)
    sd: dict[str, Any] = {}
    # Same reader and planner as torch's dcp_to_torch_save, restricted to the model entry: optimizer state stays on disk.
    _load_state_dict(
        sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(keys={key} if key else None), no_dist=True
    )
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


def consolidate(ckpt: str | os.PathLike[str], out_path: str | os.PathLike[str], *, tag: str | None = None) -> Consolidated:
    """Write one plain ``torch.save`` file of full, unsharded weights from a DCP, DeepSpeed or full checkpoint.

    Runs in one CPU process whatever world size wrote the checkpoint; ``model.load_state_dict(torch.load(out))``
    on the unsharded module then passes with ``strict=True``. The output is written to a temporary file and renamed.
    """
    start = time.perf_counter()
    info = detect_format(ckpt)
    source = info.path
    if not info.complete:
        recovered = interrupted_save(source) if info.format is not Format.UNKNOWN else None
        if recovered is None:
            raise CheckpointFormatError(f"cannot consolidate: {_describe(info)}, so it is not a checkpoint. Fix: {_pick_one(source)}")
        warnings.warn(f"{_describe(info)}; consolidating the complete checkpoint an interrupted save left: {str(recovered)!r}", stacklevel=2)
        info = detect_format(recovered)
        source = recovered
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
    out = Path(out_path)
    if out.is_dir():
        raise CheckpointFormatError(f"cannot write {str(out)!r}: it is a directory. Fix: name a file, e.g. {str(out / 'weights.pt')!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(out)
    torch.save(tensors, staged)
    fsync_file(staged)
    os.replace(staged, out)
    fsync_dir(out.parent)
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


def cmd_consolidate(args: argparse.Namespace) -> int:
    """``autoshard consolidate CKPT OUT.pt``: print what was written; refusals exit 1 through the CLI's handler."""
    print(consolidate(args.ckpt, args.out, tag=args.tag).describe())
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
    parser.set_defaults(func=cmd_consolidate)


def main(argv: list[str] | None = None) -> int:
    """``python -m autoshard.checkpoint consolidate CKPT OUT.pt``, until the ``autoshard`` command wires it in."""
    parser = argparse.ArgumentParser(prog="autoshard")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except AutoShardError as exc:
        print(f"autoshard: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "CheckpointFormatError",
    "CheckpointInfo",
    "Consolidated",
    "Format",
    "commit",
    "consolidate",
    "detect_format",
    "register_cli",
    "resolve_for_load",
]
