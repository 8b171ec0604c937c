"""``convert(SRC, DST, to)``: any checkpoint autoshard reads, as a ``TrainingState``, written in another layout.

Read by the one checkpoint reader, converted by each format's module, published by ``output``. Checked here: what
the conversion asks (a target the source is not already, a DeepSpeed output's world size and precision, ``--module``,
``--frozen``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.capability import Format
from autoshard.checkpoint import deepspeed_layout
from autoshard.checkpoint.formats import detect_format
from autoshard.checkpoint.publish import Publisher
from autoshard.checkpoint.resume import open_checkpoint
from autoshard.convert.dcp import read_dcp, write_dcp
from autoshard.convert.deepspeed import read_deepspeed, write_deepspeed
from autoshard.convert.output import check_output, publish, write_record
from autoshard.convert.safetensors import MAX_SHARD_SIZE, parse_size, write_safetensors
from autoshard.convert.state import ConvertError, OptimizerState, TrainingState
from autoshard.convert.torch_file import read_full
from autoshard.errors import IntentError, closest
from autoshard.precision import normalize_precision

TARGETS = ("dcp", "deepspeed", "safetensors")


@dataclass(frozen=True)
class Converted:
    """What ``convert`` wrote; ``describe`` is the summary a person reads, ``to_json`` what a script reads."""

    source: Path
    source_format: str
    target: str
    out_path: Path
    tensors: int
    parameters: int
    buffers: int
    optimizer_states: int  # per-parameter state tensors carried (exp_avg, exp_avg_sq, step, momentum_buffer, ...)
    optimizer_keys: tuple[str, ...]
    global_step: int | None
    epoch: int | None
    source_world_size: int | None
    target_world_size: int | None
    files: int
    bytes: int
    seconds: float
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        worlds = ""
        if self.target != "safetensors" and (self.source_world_size or self.target_world_size):
            worlds = f"; world size {self.source_world_size or '?'} -> {self.target_world_size or 'any'}"
        optim = f", {self.optimizer_states} optimizer state tensors ({', '.join(self.optimizer_keys)})" if self.optimizer_states else ""
        where = f"step {self.global_step}, epoch {self.epoch}" if self.global_step is not None else "no trainer state"
        lines = [
            f"converted {self.source_format} checkpoint {str(self.source)!r} -> {self.target} {str(self.out_path)!r}:"
            f" {self.tensors} tensors ({self.parameters} parameters, {self.buffers} buffers){optim}; {where}{worlds};"
            f" {self.files} files, {self.bytes / 2**20:.2f} MiB, in {self.seconds:.2f} s",
            *(f"  note: {note}" for note in self.notes),
            f"  {RESUME_HINT[self.target].format(path=str(self.out_path), world=self.target_world_size)}",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}
        out["optimizer_keys"], out["notes"] = list(self.optimizer_keys), list(self.notes)
        return out


RESUME_HINT = {
    "dcp": "resume: Trainer(strategy='fsdp2', ...).fit(model, ckpt_path={path!r}) at any world size",
    "deepspeed": "resume: Trainer(strategy='autoshard-deepspeed', devices x nodes = {world}, ...).fit(model, ckpt_path={path!r})",
    "safetensors": "load: transformers' from_pretrained({path!r}), safetensors.torch.load_file, or ShardingIntent(init_from={path!r})",
}


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    progress: Callable[[str], None] | None = None,
    trust_pickle: bool = False,
    weights_only: bool = False,
) -> TrainingState:
    """Any checkpoint autoshard knows as a TrainingState; ``weights_only`` (--to safetensors) skips optimizer state
    that cannot be named rather than refusing it."""
    say = progress or (lambda _: None)
    info = open_checkpoint(path, "convert", tag=tag, error=ConvertError)  # detect, recover, verify, settle the tag
    source = info.path
    say(f"reading {info.format.value} checkpoint {str(source)!r} ({info.detail})")
    if info.format in (Format.DCP, Format.DCP_RAW):
        return read_dcp(source, trust_pickle)
    if info.format is Format.DEEPSPEED:
        return read_deepspeed(source, info.tag, trust_pickle)
    return read_full(source, trust_pickle, weights_only)


@dataclass(frozen=True)
class ConvertOptions:
    """What ``convert`` is told besides SRC, DST and the target: ``autoshard convert``'s options."""

    world_size: int | None = None  # deepspeed: ranks of the resuming run (default: the source's)
    precision: str | None = None  # deepspeed: the resuming Trainer's precision (default: the source's, when DeepSpeed)
    tag: str | None = None  # a DeepSpeed source's tag directory (default: the one 'latest' names)
    frozen: Iterable[str] = ()  # deepspeed: parameters (or module paths) outside the optimizer that are not buffers
    max_shard_size: str | int = MAX_SHARD_SIZE  # safetensors: split above this size
    module: str | None = None  # safetensors: the submodule to write, named as it names its weights
    sub_group_size: int = deepspeed_layout.SUB_GROUP_SIZE  # deepspeed: zero_optimization.sub_group_size
    force: bool = False  # replace DST if it is an output of convert --to the same target
    trust_pickle: bool = False  # unpickle the source as torch.load(weights_only=False) does (its code runs)
    progress: Callable[[str], None] | None = None  # called with each progress line


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], to: str, options: ConvertOptions = ConvertOptions()) -> Converted:
    """Convert checkpoint ``src`` into ``dst`` in the ``to`` layout; see the module docstring. ``options.trust_pickle``
    unpickles the source as torch.load(weights_only=False) does (its code runs): only for a file the user trusts."""
    start = time.perf_counter()
    say = options.progress or (lambda _: None)
    precision = _check_options(to, options)
    out = Path(dst)
    size_limit = parse_size(options.max_shard_size)
    check_output(out, Path(src) if Path(src).exists() else None, options.force, to=to)
    if to == "deepspeed" and precision is None and detect_format(src, verify=False).format is not Format.DEEPSPEED:
        _missing_precision(Path(src))  # before reading a checkpoint that may be large
    state = read_checkpoint(src, tag=options.tag, progress=say, trust_pickle=options.trust_pickle, weights_only=to == "safetensors")
    _check_target(state, to)
    if options.module is not None:
        _select_module(state, options.module)
    _mark_frozen(state, options.frozen)
    target_world = (options.world_size or state.world_size) if to == "deepspeed" else None
    if to == "deepspeed":
        precision = _deepspeed_target(state, options.world_size, target_world, precision)
    with Publisher(out) as publisher:  # checkpoint.publish's protocol: DST's lock, a staging of this writer's own
        for stale in publisher.clear_stale():
            say(f"removed {str(stale)!r}, the staging of a convert to {str(out)!r} that did not finish (its writer is gone)")
        staged = publisher.staged
        say(f"writing {to} into {str(staged)!r}")
        if to == "dcp":
            written = write_dcp(state, staged)
        elif to == "deepspeed":
            written = write_deepspeed(state, staged, int(target_world or 1), str(precision), options.sub_group_size)
        else:
            written = write_safetensors(state, staged, size_limit)
        if to != "safetensors":  # a Hugging Face directory stays exactly what from_pretrained expects
            write_record(staged, _record(state, to, target_world))
        files = [p for p in staged.rglob("*") if p.is_file()]
        nbytes = sum(p.stat().st_size for p in files)
        say(f"publishing {str(out)!r} ({len(files) + 1} files, {nbytes / 2**20:.2f} MiB)")
        publish(publisher, options.force, state.source, to)
    return _converted(state, to, out, target_world, (len(files) + 1, nbytes, time.perf_counter() - start), written.get("notes", []))


def _check_options(to: str, options: ConvertOptions) -> str | None:
    """The options refused before anything is read; the precision, normalized."""
    if to not in TARGETS:
        raise ConvertError(f"unknown target {to!r}. Fix: --to one of {', '.join(TARGETS)}")
    precision = options.precision
    if precision is not None:
        if to != "deepspeed":
            raise ConvertError(
                f"--precision is for --to deepspeed (DeepSpeed names its files after it); {to} does not depend on it. Fix: drop --precision"
            )
        try:
            precision = normalize_precision(precision).value
        except IntentError as exc:
            raise ConvertError(f"--precision: {exc}") from None
    if options.module is not None and to != "safetensors":
        raise ConvertError(
            f"--module {options.module!r} keeps one submodule's weights, which only --to safetensors writes: a checkpoint to resume needs the whole module. Fix: drop --module, or use --to safetensors"
        )
    world_size = options.world_size
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ConvertError(f"--world-size must be a positive integer, got {world_size!r}. Fix: --world-size N (devices x nodes of the resuming run)")
    return precision


def _mark_frozen(state: TrainingState, frozen: Iterable[str]) -> None:
    """--frozen: the tensors under each name are parameters outside the optimizer, not buffers."""
    for prefix in frozen:
        matched = {n for n in state.tensors if n == prefix or n.startswith(prefix + ".")}
        if not matched:
            raise ConvertError(
                f"--frozen {prefix!r} matches no tensor of {str(state.source)!r}. Fix: pass a name or module path the checkpoint holds, e.g. {next(iter(state.tensors), '')!r}"
            )
        state.frozen |= matched
        if state.buffers is not None:
            state.buffers -= matched


def _deepspeed_target(state: TrainingState, world_size: int | None, target_world: int | None, precision: str | None) -> str | None:
    """What a DeepSpeed output is written for, checked: the world size (asked, or the source's), the precision (asked,
    or the source's)."""
    if world_size is not None:
        _check_world_size(state, world_size)
    if target_world is None:
        raise ConvertError(
            f"{str(state.source)!r} does not record the world size it was saved at, and a DeepSpeed checkpoint is written"
            f" for one. Fix: pass --world-size N, the devices x nodes of the run that resumes it"
        )
    if precision is None and state.precision is None:
        _missing_precision(state.source)
    return precision or state.precision


def _record(state: TrainingState, to: str, target_world: int | None) -> dict[str, Any]:
    """autoshard-convert.json: what the output was converted from."""
    return {
        "format": "autoshard-convert",
        "version": 1,
        "source": str(state.source),
        "source_format": state.format.value,
        "source_world_size": state.world_size,
        "target": to,
        "target_world_size": target_world,
        "global_step": state.global_step,
    }


def _converted(state: TrainingState, to: str, out: Path, target_world: int | None, written: tuple[int, int, float], notes: list[str]) -> Converted:
    """The summary of a conversion; ``written``: files, bytes and seconds."""
    trained = set(state.trained())
    buffers = len(state.buffers) if state.buffers is not None else len([n for n in state.tensors if n not in trained and n not in state.frozen])
    opt_tensors = sum(1 for o in state.optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    epoch = state.trainer.get("epoch")
    files, nbytes, seconds = written
    return Converted(
        source=state.source,
        source_format=state.format.value,
        target=to,
        out_path=out,
        tensors=len(state.tensors),
        parameters=len(state.tensors) - buffers,
        buffers=buffers,
        optimizer_states=opt_tensors if to != "safetensors" else 0,
        optimizer_keys=tuple(sorted({k for o in state.optimizers for s in o.state.values() for k in s})) if to != "safetensors" else (),
        global_step=state.global_step,
        epoch=int(epoch) if epoch is not None else None,
        source_world_size=state.world_size,
        target_world_size=target_world,
        files=files,
        bytes=nbytes,
        seconds=seconds,
        notes=tuple([*state.notes, *notes]),
    )


def _check_world_size(state: TrainingState, world_size: int) -> None:
    """Past the element count of the largest parameter, extra ZeRO-3 ranks would hold padding only (``--world-size
    1000000`` on a 0.05 MiB model once wrote 190,187 files, 1.5 GB, before it was stopped)."""
    partitioned = set(state.trained()) | state.frozen
    params = [n for n in state.tensors if n in partitioned]
    if not params:
        return
    largest = max(params, key=lambda n: state.tensors[n].numel())
    most = state.tensors[largest].numel()
    if world_size <= most:
        return
    raise ConvertError(
        f"--world-size {world_size:,d} is more ranks than the largest parameter of {str(state.source)!r} has elements"
        f" ({largest!r}: {most:,d}): ZeRO-3 splits each parameter across every rank, so ranks {most:,d} to"
        f" {world_size - 1:,d} would hold padding only, and the checkpoint would be {2 * world_size:,d} files (two per"
        f" rank); nothing was written. Fix: --world-size N, the devices x nodes of the run that resumes it (at most"
        f" {most:,d} for this model)"
    )


def _select_module(state: TrainingState, module: str) -> None:
    """Keep the weights of the submodule at ``module``, named as that submodule names them (``model.transformer.wte
    .weight`` -> ``transformer.wte.weight``): the names Hugging Face's from_pretrained expects of a wrapped model."""
    prefix = module.strip(".") + "."
    kept = {n[len(prefix) :]: t for n, t in state.tensors.items() if n.startswith(prefix)}
    if not kept:
        raise ConvertError(_no_such_module(state, module.strip(".")))
    state.tensors = kept
    state.aliases = {a[len(prefix) :]: n[len(prefix) :] for a, n in state.aliases.items() if a.startswith(prefix) and n.startswith(prefix)}
    state.buffers = {b[len(prefix) :] for b in state.buffers if b.startswith(prefix)} if state.buffers is not None else None
    state.optimizers = [
        OptimizerState([{**g, "params": [p[len(prefix) :] for p in g["params"] if p.startswith(prefix)]} for g in o.groups], {})
        for o in state.optimizers
    ]


def _no_such_module(state: TrainingState, module: str) -> str:
    """Why --module matched nothing, and submodules that hold parameters (a buffer or a lone tensor is no module)."""
    trained = set(state.trained())
    buffers = state.buffers if state.buffers is not None else {n for n in state.tensors if trained and n not in trained and n not in state.frozen}
    params = [n for n in state.tensors if n not in buffers]
    paths = sorted({n.rsplit(".", k)[0] for n in params for k in range(1, n.count(".") + 1)})
    tops = [p for p in paths if "." not in p]
    if module in state.tensors:
        what = f"--module {module!r} names a {'buffer' if module in buffers else 'tensor'} of {str(state.source)!r}, not a submodule"
    else:
        what = f"--module {module!r} holds no tensor of {str(state.source)!r}"
    near = closest(module, paths)
    if near is not None and near not in tops:
        fix = f"--module {near!r}"
    elif tops:
        fix = f"pass one of its submodules: {', '.join(map(repr, tops[:6]))}"
    else:
        fix = "drop --module: the checkpoint's parameters are not inside any submodule"
    return f"{what}. Fix: {fix}"


def _missing_precision(source: Path) -> None:
    raise ConvertError(
        f"--to deepspeed needs the precision of the run that resumes it: DeepSpeed names its optimizer files after it"
        f" (bf16_zero_pp_rank_* under bf16) and looks for that name only, and {str(source)!r} does not record one."
        f" Fix: pass --precision with the Trainer's precision, e.g. --precision bf16-mixed or --precision 32-true"
    )


def _check_target(state: TrainingState, to: str) -> None:
    """Refuse conversions into the layout the source already is: the backend that reads it does so as is."""
    if to == "dcp" and state.format in (Format.DCP, Format.DCP_RAW, Format.FULL):
        raise ConvertError(
            f"{str(state.source)!r} is already {'a DCP checkpoint' if state.format is not Format.FULL else 'a full checkpoint file'},"
            f" which fsdp2 resumes as is at any world size. Fix: pass it as ckpt_path with strategy='fsdp2', or convert to"
            f" deepspeed or safetensors"
        )
