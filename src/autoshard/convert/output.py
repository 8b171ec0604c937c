"""Where ``convert`` writes, through ``checkpoint.publish``'s protocol; only the words of the refusals are its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoshard.checkpoint.publish import Clash, Publisher, output_clash, output_refusal
from autoshard.convert.state import ConvertError

RECORD = "autoshard-convert.json"  # inside a converted checkpoint: what it came from


def output_kind(to: str) -> str:
    """The kind a converted output's manifest records: ``--force`` replaces only an output of the same kind."""
    return f"autoshard convert --to {to}"


def _recorded_target(out: Path) -> str | None:
    """The target in an output's autoshard-convert.json (convert wrote it before manifests recorded a kind)."""
    try:
        return str(json.loads((out / RECORD).read_text())["target"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def beside(path: Path, suffix: str) -> Path:
    """A new sibling of ``path`` named after it (``v`` -> ``v-dcp``), as the user wrote it ('.' resolved to a name)."""
    named = path if path.name else path.resolve()
    return named.with_name(f"{named.name}-{suffix}")


REFUSALS = {  # of DST, in convert's words (``publish.output_refusal``)
    Clash.SAME: "refusing to write {out!r}: it is the checkpoint being converted. Fix: choose another output path",
    Clash.HOLDS: "refusing to write {out!r}: it holds the checkpoint being converted ({source!r}), and publishing DST"
    " replaces it whole, so even --force never does. Fix: choose a new output path outside it, e.g. {beside!r}",
    Clash.INSIDE: "refusing to write {out!r}: it is inside the checkpoint being converted ({source!r}), which would then"
    " hold files its save did not write (and the next save to it, which replaces it whole, would delete them). Fix:"
    " choose a new output path outside it, e.g. {suggest!r}",
    Clash.EXISTS: "refusing to overwrite {out!r}: it already exists ({what}). Fix: choose a new output path, or pass"
    " --force (force=True) to replace it once the new one is complete",
    Clash.FOREIGN: "refusing to overwrite {out!r}{even}: it already exists ({what}), and {detail}: --force replaces only"
    " an output of `{kind}` holding nothing else. Fix: choose a new output path, e.g. {suggest!r}, or move {out!r} away"
    " first",
}


def check_output(out: Path, source: Path | None, force: bool, *, to: str = "") -> None:
    """What ``publish.output_clash`` refuses, in convert's words."""
    found = output_clash(out, source, output_kind(to) if to else None, force=force, legacy=bool(to) and _recorded_target(Path(out)) == to)
    if found is None:
        return
    suggest = f"{source}-{to or 'converted'}" if source is not None else f"{out}-new"
    beside_out = str(beside(Path(out), to or "converted"))
    raise ConvertError(output_refusal(found, Path(out), source, force, REFUSALS, suggest=suggest, beside=beside_out, kind=output_kind(to)))


def write_record(staged: Path, record: dict[str, Any]) -> None:
    """autoshard-convert.json, inside the output: what it was converted from (source, formats, world sizes, step)."""
    (staged / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def publish(publisher: Publisher, force: bool, source: Path, to: str) -> None:
    """Manifest of every file, with this output's kind; then, under the lock, DST checked again (another writer may
    have published meanwhile) and the rename (``commit``: aside, in, old removed; never a partial DST)."""
    publisher.publish_with_manifest(output_kind(to), lambda path: check_output(path, source, force, to=to))
