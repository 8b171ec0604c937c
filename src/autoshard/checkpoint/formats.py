"""What a path holds, told by its files only (no tensor is read): ``detect_format`` returns a ``CheckpointInfo``
(the ``Format`` and the evidence, shown verbatim in every refusal). DeepSpeed's layout is ``deepspeed_layout``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from autoshard.capability import Format
from autoshard.checkpoint import deepspeed_layout
from autoshard.checkpoint.trust import DCP_METADATA, UntrustedPickleError, read_dcp_metadata

LIGHTNING_META = "meta.pt"  # Lightning's trainer state (loops, callbacks, schedulers) next to the DCP shards
STATE_KEY = "autoshard"  # our entry in Lightning's checkpoint dict (meta.pt for DCP, the file itself for full)
FORMAT_VERSION = 1
BUDGET_KEY = "budget_decision"  # in our entry: ShardingIntent(memory_budget=...)'s decision (BudgetDecision.to_dict())


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
    """A shard shorter than .metadata says, or missing: what an in-place save (stock Lightning's) leaves when killed."""
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
    """Classify ``path`` by its files only, so it is cheap on any checkpoint size; ``verify`` also reads DCP's
    .metadata to catch torn shards."""
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
    deepspeed = deepspeed_layout.layout(p)
    if deepspeed is not None:
        return CheckpointInfo(p, Format.DEEPSPEED, deepspeed[1], tag=deepspeed[0])
    entries = sorted(x.name for x in p.iterdir())
    listing = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "") if entries else "nothing"
    return CheckpointInfo(p, Format.UNKNOWN, f"a directory holding {listing}: no .metadata (DCP), no meta.pt (Lightning), no latest (DeepSpeed)")


def describe(info: CheckpointInfo) -> str:
    """``'PATH' is DETAIL``: how every refusal names the path it was given."""
    return f"{str(info.path)!r} is {info.detail}"
