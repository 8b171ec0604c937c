"""``autoshard consolidate CKPT OUT.pt``: one plain ``{name: tensor}`` file of full weights from any checkpoint.

A command on top of the ``checkpoint`` package: it reads a whole checkpoint (DeepSpeed's through its zero_to_fp32)
with the package's reader and writes a new file through its publish protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from autoshard.capability import Format
from autoshard.checkpoint import deepspeed_layout
from autoshard.checkpoint.formats import describe
from autoshard.checkpoint.publish import Clash, Publisher, output_clash, output_refusal
from autoshard.checkpoint.readers import dcp_keys, flat_tensors, load_dcp_entries, model_entry, torch_weights
from autoshard.checkpoint.resume import CONSOLIDATE, open_checkpoint
from autoshard.checkpoint.trust import CheckpointFormatError, load_torch_file, weights_only_loads

KIND_CONSOLIDATE = "autoshard consolidate"  # the kind in OUT.pt's sidecar manifest: what --force may replace


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

    def to_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "format": self.format.value,
            "out": str(self.out_path),
            "tensors": self.tensors,
            "numel": self.numel,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "key": self.key,
        }

    def describe(self) -> str:
        return (
            f"consolidated {self.format.value} checkpoint {str(self.source)!r} -> {str(self.out_path)!r}: {self.tensors}"
            f" tensors, {self.numel:,d} elements, {self.bytes / 2**20:.2f} MiB, in {self.seconds:.2f} s."
            f" Load it with model.load_state_dict(torch.load({str(self.out_path)!r}))"
        )


def _load_dcp(path: Path, trust_pickle: bool = False) -> tuple[dict[str, Any], str | None]:
    """The model entry of a DCP checkpoint; optimizer state stays on disk."""
    key = model_entry(dcp_keys(path))
    sd = load_dcp_entries(path, {key} if key else None, trust_pickle)
    return (sd[key] if key else sd), key


def _load_deepspeed(path: Path, tag: str, trust_pickle: bool = False) -> dict[str, Any]:
    """DeepSpeed's own ZeRO -> fp32 reconstruction; Lightning's wrapper prefix removed so keys match the module.

    zero_to_fp32 unpickles with weights_only=False: every file of the tag is read by ``load_torch_file`` first (a
    truncated or untrusted one is named), and zero_to_fp32 runs under ``weights_only_loads``."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise CheckpointFormatError(
            f"{str(path)!r} is a DeepSpeed checkpoint and deepspeed is needed to convert it ({exc}). Fix: pip install"
            f' "autoshard[deepspeed]" (no GPU needed), then run `{CONSOLIDATE.format(path=path)}` again'
        ) from None
    deepspeed_layout.check_version()
    for f in sorted((path / tag).glob("*.pt")):
        load_torch_file(f, action="consolidate", trust_pickle=trust_pickle)
    with weights_only_loads(trust_pickle):
        state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    return {k.removeprefix(deepspeed_layout.LIGHTNING_PREFIX): v for k, v in state.items()}


def consolidate(
    ckpt: str | os.PathLike[str], out_path: str | os.PathLike[str], *, tag: str | None = None, force: bool = False, trust_pickle: bool = False
) -> Consolidated:
    """Write one plain ``torch.save`` file of full weights from a DCP, DeepSpeed or full checkpoint, in one CPU process
    whatever world size wrote it. ``force`` replaces only a file consolidate wrote."""
    start = time.perf_counter()
    out = _file_named(out_path, ckpt)
    _check_output(out, force, Path(ckpt))
    info = open_checkpoint(ckpt, "consolidate", tag=tag)  # detect, recover an interrupted save, verify, settle the tag
    source = info.path
    if (out.exists() or out.is_symlink()) and out.resolve() == source.resolve():
        raise CheckpointFormatError(f"refusing to write {str(out)!r}: it is the checkpoint being consolidated. Fix: choose another output path")
    key: str | None
    if info.format in (Format.DCP, Format.DCP_RAW):
        state, key = _load_dcp(source, trust_pickle)
    elif info.format is Format.DEEPSPEED:
        assert info.tag is not None  # open_checkpoint settles it or refuses
        state, key = _load_deepspeed(source, info.tag, trust_pickle), None
    else:
        key, state = torch_weights(load_torch_file(source, action="consolidate", trust_pickle=trust_pickle))
    if not isinstance(state, Mapping):
        raise CheckpointFormatError(
            f"cannot consolidate: {describe(info)}, but it holds a {type(state).__name__}, not a state dict. Fix: pass a checkpoint, or torch.save(model.state_dict(), PATH)"
        )
    tensors = flat_tensors(state)
    if not tensors:
        raise CheckpointFormatError(f"cannot consolidate: {describe(info)}, but it holds no tensors under {key or 'its top level'!r}")
    _write_new(tensors, out, force, source)
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


REFUSALS = {  # of OUT, in consolidate's words (``publish.output_refusal``)
    Clash.SAME: "refusing to write {out!r}: it is the checkpoint being consolidated. Fix: choose another output path",
    Clash.INSIDE: "refusing to write {out!r}: it is inside the checkpoint being consolidated ({source!r}), which would"
    " then hold a file its save did not write (and the next save to it, which replaces it whole, would delete it). Fix:"
    " choose an output path outside it, e.g. {weights!r}",
    Clash.EXISTS: "refusing to overwrite {out!r}: it already exists ({what}), and consolidate would replace it with"
    " weights only. Fix: choose another output path, or pass --force (force=True) to replace it",
    Clash.FOREIGN: "refusing to overwrite {out!r}{even}: it already exists ({what}), and {detail}: --force replaces only"
    " a file consolidate wrote. Fix: choose another output path, or move {out!r} away first",
}
REFUSALS[Clash.HOLDS] = REFUSALS[Clash.INSIDE]  # HOLDS needs a directory at OUT, refused first


def _file_named(out_path: str | os.PathLike[str], ckpt: str | os.PathLike[str]) -> Path:
    """OUT as the one torch.save file consolidate writes, refused before anything is read when its name means something
    else: a trailing separator (a directory: ``Path`` drops it, and a file would take the directory's name) or a
    ``.safetensors`` suffix (a pickle under that name, which safetensors readers refuse)."""
    raw = os.fspath(out_path)
    out = Path(raw)
    if raw.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        raise CheckpointFormatError(
            f"cannot write {raw!r}: a path ending in a separator names a directory, and consolidate writes one file."
            f" Fix: name the file, e.g. {str(out / 'weights.pt')!r}"
        )
    if out.suffix.lower() == ".safetensors":
        raise CheckpointFormatError(
            f"cannot write {raw!r}: consolidate writes one torch.save file (a pickle), not safetensors, and"
            f" safetensors.torch.load_file or from_pretrained would refuse a pickle under that name. Fix: for"
            f" safetensors, `autoshard convert {shlex.quote(os.fspath(ckpt))} {shlex.quote(str(out.with_suffix('')))} --to safetensors` (it writes"
            f" {str(out.with_suffix('') / 'model.safetensors')!r}); for a torch file, name it {str(out.with_suffix('.pt'))!r}"
        )
    return out


def _check_output(out: Path, force: bool, source: Path | None = None) -> None:
    """``publish.output_clash`` (and a directory), in consolidate's words."""
    if out.is_dir():
        raise CheckpointFormatError(f"cannot write {str(out)!r}: it is a directory. Fix: name a file, e.g. {str(out / 'weights.pt')!r}")
    found = output_clash(out, source, KIND_CONSOLIDATE, force=force)
    if found is not None:
        weights = str(source.parent / "weights.pt") if source is not None else ""
        raise CheckpointFormatError(output_refusal(found, out, source, force, REFUSALS, weights=weights))


def _write_new(tensors: dict[str, torch.Tensor], out: Path, force: bool, source: Path) -> None:
    """Through the publish protocol: a failure at any point leaves ``out`` as it was."""
    with Publisher(out) as publisher:
        for stale in publisher.clear_stale():
            warnings.warn(
                f"autoshard: removed {str(stale)!r}, the staging of a consolidate to {str(out)!r} that did not finish (its writer is gone)",
                stacklevel=2,
            )
        torch.save(tensors, publisher.staged)
        publisher.publish_with_manifest(KIND_CONSOLIDATE, lambda path: _check_output(path, force, source))


def cmd_consolidate(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """``autoshard consolidate CKPT OUT.pt``: print what was written (on ``stream``, stdout by default); refusals exit
    1 through the CLI's handler (which prints them as JSON under --json)."""
    done = consolidate(args.ckpt, args.out, tag=args.tag, force=args.force, trust_pickle=args.trust_pickle)
    print(json.dumps(done.to_json(), indent=1) if args.json else done.describe(), file=stream or sys.stdout)
    return 0


def refuse_module_run(command: str, usage: str, argv: Sequence[str]) -> int:
    """``python -m autoshard.<command>`` is no command (it used to exit 0 having done nothing): refused with the
    command line that runs it."""
    words = " ".join(shlex.quote(a) for a in argv) or usage
    message = (
        f"`python -m autoshard.{command}` is not a command: that module holds what `autoshard {command}` runs, so"
        f" nothing was done. Fix: python -m autoshard {command} {words} (or: autoshard {command} {words})"
    )
    if "--json" in argv:
        print(json.dumps({"command": command, "error": {"type": "UsageError", "message": message}}, indent=1))
        return 1
    print(f"autoshard: error: {message}", file=sys.stderr)
    return 2


def command_parser(subparsers: argparse._SubParsersAction, name: str, help: str, description: str | None) -> argparse.ArgumentParser:
    """``autoshard NAME``'s parser (abbreviated options refused, as every autoshard command refuses them)."""
    return subparsers.add_parser(name, allow_abbrev=False, help=help, description=description)


def add_writer_flags(parser: argparse.ArgumentParser, force: str, source: str, trusted: str) -> None:
    """--force (``force``: what it replaces) and --trust-pickle (what it unpickles), for consolidate and convert."""
    parser.add_argument("--force", action="store_true", help=force)
    trust = f"unpickle {source} as torch.load(weights_only=False) does, running any code it holds: only for {trusted} you trust"
    parser.add_argument("--trust-pickle", action="store_true", help=trust)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``autoshard consolidate CKPT_DIR OUT.pt`` to the ``autoshard`` command."""
    description = (
        "Read a checkpoint written by strategy='fsdp2'/'auto-shard' (torch.distributed.checkpoint directory), by DeepSpeed"
        " ZeRO (through DeepSpeed's zero_to_fp32), or a full Lightning file, and write one plain {name: tensor} file:"
        " model.load_state_dict(torch.load(OUT)) works on the unsharded model. One CPU process, any world size at save"
        " time, no GPU."
    )
    parser = command_parser(
        subparsers, "consolidate", "turn a sharded (DCP or DeepSpeed) checkpoint into one torch.save file of full weights", description
    )
    parser.add_argument("ckpt", metavar="CKPT_DIR", help="the checkpoint directory (or file), e.g. checkpoints/last.ckpt")
    parser.add_argument("out", metavar="OUT.pt", help="the file to write")
    parser.add_argument("--tag", default=None, help="DeepSpeed only: the tag directory (default: the one in 'latest')")
    add_writer_flags(parser, "replace OUT.pt if consolidate wrote it (only once the new file is complete)", "the checkpoint", "a file")
    parser.add_argument("--json", action="store_true", help="print the result (or the refusal) as one JSON object")
    parser.set_defaults(func=cmd_consolidate)


if __name__ == "__main__":
    raise SystemExit(refuse_module_run("consolidate", "CKPT_DIR OUT.pt", sys.argv[1:]))
