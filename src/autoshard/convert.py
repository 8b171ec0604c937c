"""``autoshard convert SRC DST --to dcp|deepspeed|safetensors``: move a run between backends, optimizer state included.

A DeepSpeed ZeRO-3 checkpoint keeps each rank's slice of every parameter, fp32 master weight and optimizer moment
in flat per-rank buffers; a DCP checkpoint keeps them per parameter name. Both are read here into one neutral,
in-memory ``TrainingState`` (full tensors by parameter name, optimizer state per parameter, Lightning's trainer
state), and written in the other layout, so ``Trainer.fit(ckpt_path=DST)`` resumes with the other backend, at any
world size. Why not DeepSpeed's ``ds_to_universal``: it writes one file per parameter fragment through a temporary
directory and a process pool, writes ``latest_universal`` into the *parent* of its output, drops each parameter's
``step``, and its output loads only with ``checkpoint.load_universal`` in the resuming config (which skips the
module's buffers). DeepSpeed has no function that returns per-parameter optimizer state in memory, so the flat
buffers are cut here with the layout DeepSpeed records (``param_shapes``: names, shapes and order per sub-group;
each parameter's rank slice is ``ceil(numel / world)`` elements, the last one zero-padded), exactly as its own
``zero_to_fp32`` and ``ds_to_universal`` cut them; the tests check the weights against ``zero_to_fp32`` and the
moments against ``deepspeed.utils.safe_get_full_optimizer_state`` of a live engine.

Everything runs in one CPU process; memory is the full weights plus optimizer state. Outputs are written into a
hidden staging sibling and renamed into place only when complete; an existing DST is never replaced without
``force``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoshard.checkpoint import (
    DEEPSPEED_LATEST,
    LIGHTNING_DEEPSPEED_PREFIX,
    LIGHTNING_META,
    CheckpointFormatError,
    Format,
    dcp_entries,
    deepspeed_tag,
    detect_format,
    flat_tensors,
    load_dcp_entries,
    load_torch_file,
    open_checkpoint,
)
from autoshard.checkpoint_io import (
    MANIFEST,
    Overlap,
    Publisher,
    describe_files,
    foreign_content,
    fsync_dir,
    fsync_file,
    overlap,
    unwritable_refusal,
    write_manifest,
)
from autoshard.errors import closest
from autoshard.init_from import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, TIED_METADATA
from autoshard.units import parse_size as memory_size

TARGETS = ("dcp", "deepspeed", "safetensors")
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's (and autoshard's) default zero_optimization.sub_group_size
MAX_SHARD_SIZE = "5GB"  # Hugging Face's save_pretrained default
RECORD = "autoshard-convert.json"  # inside a converted checkpoint: what it came from
# What DeepSpeed's engine writes into a model_states file besides the client state (Lightning's checkpoint):
# engine._common_checkpoint_state, plus the keys newer releases add around it.
DEEPSPEED_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
        "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
        "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
        "ds_autoep_layers", "autoep_layers",
    }
)  # fmt: skip
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


class ConvertError(CheckpointFormatError):
    """What cannot be converted, named, with the fix."""


# -- the neutral form ----------------------------------------------------------------------------------------------
@dataclass
class OptimizerState:
    """One optimizer by parameter name: each group's hyper-parameters (``params``: names, in the optimizer's order)
    and each parameter's state (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) as full tensors."""

    groups: list[dict[str, Any]]
    state: dict[str, dict[str, Any]]

    def names(self) -> list[str]:
        return [name for group in self.groups for name in group["params"]]


@dataclass
class TrainingState:
    """A checkpoint in memory, backend-neutral: what both layouts can express, and nothing else."""

    tensors: dict[str, torch.Tensor]  # the module's state dict: parameters (fp32 master where kept) and buffers
    optimizers: list[OptimizerState]
    trainer: dict[str, Any]  # Lightning's checkpoint minus weights and optimizers: epoch, global_step, loops, ...
    source: Path
    format: Format
    world_size: int | None  # of the run that wrote it, where recorded
    buffers: set[str] | None = None  # None: not recorded by the source (DCP), inferred where needed
    frozen: set[str] = field(default_factory=set)  # parameters outside every optimizer
    aliases: dict[str, str] = field(default_factory=dict)  # tied weights: alias -> the name that holds it
    callback_optimizers: int = 0  # autoshard DCP: optimizers callbacks own (online probes)
    precision: str | None = None  # DeepSpeed source: the precision its file names and loss scaler are for
    loss_scaler: Any = None  # DeepSpeed source: its loss scaler (a dynamic fp16 scale survives DeepSpeed -> DeepSpeed)
    notes: list[str] = field(default_factory=list)

    @property
    def global_step(self) -> int | None:
        step = self.trainer.get("global_step")
        return int(step) if step is not None else None

    def trained(self) -> list[str]:
        return [name for opt in self.optimizers for name in opt.names()]


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


# -- reading ---------------------------------------------------------------------------------------------------------
def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    progress: Callable[[str], None] | None = None,
    trust_pickle: bool = False,
    weights_only: bool = False,
) -> TrainingState:
    """Any checkpoint autoshard knows, checked against its manifest first, as a TrainingState. Files are unpickled
    without running code unless ``trust_pickle``; ``weights_only`` (--to safetensors) skips optimizer state that
    cannot be named rather than refusing it."""
    say = progress or (lambda _: None)
    info = open_checkpoint(path, "convert", tag=tag, error=ConvertError)  # detect, recover, verify, settle the tag
    source = info.path
    say(f"reading {info.format.value} checkpoint {str(source)!r} ({info.detail})")
    if info.format in (Format.DCP, Format.DCP_RAW):
        return read_dcp(source, trust_pickle)
    if info.format is Format.DEEPSPEED:
        return read_deepspeed(source, info.tag, trust_pickle)
    return read_full(source, trust_pickle, weights_only)


def read_dcp(path: Path, trust_pickle: bool = False) -> TrainingState:
    """An autoshard / Lightning DCP directory: ``state_dict``, ``optimizer_{i}``, ``callback_optimizer_{n}``, meta.pt."""
    entries = dcp_entries(path)
    keys = {where[0] for where, _ in entries}
    key = next((k for k in ("state_dict", "model") if k in keys), None)
    optimizer_keys = sorted((k for k in keys if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1]))
    loaded = load_dcp_entries(path, {key, *optimizer_keys} if key else None, trust_pickle)
    tensors = flat_tensors(loaded[key] if key else loaded)
    optimizers = [_named_optimizer(loaded[k], f"optimizer #{k.split('_')[1]}", path) for k in optimizer_keys]
    trainer: dict[str, Any] = {}
    meta = path / LIGHTNING_META
    if meta.is_file():
        trainer = load_torch_file(meta, action="convert", trust_pickle=trust_pickle)
    extra = trainer.pop("autoshard", None) or {}
    state = TrainingState(
        tensors=tensors,
        optimizers=optimizers,
        trainer=trainer,
        source=path,
        format=Format.DCP if meta.is_file() else Format.DCP_RAW,
        world_size=extra.get("world_size"),
        callback_optimizers=len(extra.get("callback_optimizers", ())),
    )
    # FSDP2 shards parameters only: an entry outside every optimizer that was saved in several chunks is a frozen
    # parameter (an EMA teacher, a frozen backbone), never a buffer.
    trained = set(state.trained())
    for where, item in entries:
        if where[0] == key and len(where) == 2 and where[1] not in trained and len(getattr(item, "chunks", ())) > 1:
            state.frozen.add(where[1])
    if extra.get("rng_states"):
        state.notes.append(
            "per-rank RNG states are not carried (the other backend keeps none): random augmentations differ from an uninterrupted run"
        )
    return state


def read_full(path: Path, trust_pickle: bool = False, weights_only: bool = False) -> TrainingState:
    """One torch.save file: a Lightning checkpoint (``state_dict``, ``optimizer_states``) or bare weights."""
    loaded = load_torch_file(path, action="convert", trust_pickle=trust_pickle)
    if not isinstance(loaded, Mapping):
        raise ConvertError(
            f"cannot convert {str(path)!r}: it holds a {type(loaded).__name__}, not a state dict. Fix: pass a checkpoint file or directory"
        )
    if "state_dict" not in loaded:
        return TrainingState(tensors=flat_tensors(loaded), optimizers=[], trainer={}, source=path, format=Format.FULL, world_size=None)
    trainer = {k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states")}
    extra = trainer.pop("autoshard", None) or {}
    saved = list(loaded.get("optimizer_states") or [])
    notes = []
    if weights_only and any(not isinstance(p, str) for s in saved for g in s.get("param_groups", []) for p in g.get("params", [])):
        # DDP / single-device Lightning keys optimizer state by position: no use to weights, so not a refusal here.
        notes.append(f"{len(saved)} optimizer state(s) keyed by position (a DDP or single-device checkpoint) not read: weights only")
        saved = []
    optimizers = [_named_optimizer(s, f"optimizer #{i}", path) for i, s in enumerate(saved)]
    return TrainingState(
        notes=notes,
        tensors=flat_tensors(loaded["state_dict"]),
        optimizers=optimizers,
        trainer=trainer,
        source=path,
        format=Format.FULL,
        world_size=extra.get("world_size"),
        callback_optimizers=len(extra.get("callback_optimizers", ())),
    )


def _named_optimizer(saved: Mapping[str, Any], label: str, path: Path) -> OptimizerState:
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint's), or a refusal naming why not."""
    groups = [dict(g) for g in saved.get("param_groups", [])]
    params = [p for g in groups for p in g.get("params", [])]
    positional = [p for p in params if not isinstance(p, str)]
    if positional:
        raise ConvertError(
            f"cannot convert {label} of {str(path)!r}: its state is keyed by position ({', '.join(map(str, positional[:4]))}, ...),"
            f" as torch's optimizer.state_dict() writes it, not by parameter name, so it cannot be mapped to parameters"
            f" without the model. Fix: resume it once with strategy='fsdp2' (Trainer.fit(ckpt_path=...)) and convert the"
            f" checkpoint that saves, or convert the weights alone with --to safetensors"
        )
    for g in groups:
        g["params"] = [str(p) for p in g["params"]]
    return OptimizerState(groups=groups, state={str(k): dict(v) for k, v in (saved.get("state") or {}).items()})


def _require_deepspeed(path: Path) -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ConvertError(
            f"{str(path)!r}: DeepSpeed checkpoints hold DeepSpeed objects (the loss scaler), so deepspeed is needed to"
            f' read or write them ({exc}). Fix: pip install "autoshard[deepspeed]" (no GPU needed)'
        ) from None
    return deepspeed


def _deepspeed_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(model_states, optim_states) files of a ZeRO-3 tag directory, in rank order; refuses other layouts by name."""
    model: dict[int, Path] = {}
    optim: dict[int, Path] = {}
    for f in folder.iterdir():
        for pattern, found in ((_MODEL_FILE, model), (_OPTIM_FILE, optim)):
            m = pattern.match(f.name)
            if m:
                if int(m.group(2)) != 0:
                    raise ConvertError(
                        f"cannot convert {str(folder)!r}: {f.name} belongs to model-parallel rank {int(m.group(2))}: tensor or"
                        f" pipeline parallel DeepSpeed checkpoints are not converted (data parallel ZeRO-3 only). Fix: convert"
                        f" the weights with DeepSpeed's ds_to_universal, or train data parallel only"
                    )
                found[int(m.group(1))] = f
    if not model and any(folder.glob("mp_rank_*_model_states.pt")):
        raise ConvertError(
            f"cannot convert {str(folder)!r}: a DeepSpeed ZeRO stage 1/2 checkpoint (mp_rank_*_model_states.pt); only ZeRO-3"
            f" (strategy='autoshard-deepspeed') keeps every parameter partitioned the way this converter reads. Fix: take the"
            f" weights with `autoshard consolidate {folder.parent} weights.pt`"
        )
    ranks = sorted(model)
    if not ranks or ranks != list(range(len(ranks))) or sorted(optim) != ranks:
        raise ConvertError(
            f"cannot convert {str(folder)!r}: expected one model_states and one optim_states file per rank 0..N-1, found"
            f" model_states for ranks {sorted(model)} and optim_states for ranks {sorted(optim)}: the checkpoint is incomplete."
            f" Fix: copy the whole checkpoint directory (every rank's files)"
        )
    return [model[r] for r in ranks], [optim[r] for r in ranks]


def _partition(numel: int, world: int) -> int:
    """Elements of one parameter per rank under ZeRO-3: DeepSpeed pads the last rank's slice."""
    return math.ceil(numel / world)


def read_deepspeed(path: Path, tag: str | None, trust_pickle: bool = False) -> TrainingState:
    """A ZeRO-3 checkpoint (Lightning's DeepSpeedStrategy or autoshard-deepspeed) into full per-parameter tensors."""
    _require_deepspeed(path)  # its files pickle DeepSpeed objects (the loss scaler)
    tag = tag or deepspeed_tag(detect_format(path, verify=False), None, "convert")  # 'latest', never a guess
    folder = path / tag
    if (folder / "offloaded_tensors").exists():
        raise ConvertError(
            f"cannot convert {str(path)!r}: its optimizer state lives in NVMe swap files (offloaded_tensors/), which only the"
            f" engine that wrote them reads. Fix: resume it once without NVMe offload and save, then convert that checkpoint"
        )
    model_files, optim_files = _deepspeed_files(folder)
    world = len(model_files)
    models = [load_torch_file(f, action="convert", trust_pickle=trust_pickle) for f in model_files]
    optims = [load_torch_file(f, action="convert", trust_pickle=trust_pickle)["optimizer_state_dict"] for f in optim_files]
    head = models[0]
    stage = int(optims[0].get("zero_stage", 0))
    if stage != 3:
        raise ConvertError(
            f"cannot convert {str(path)!r}: ZeRO stage {stage}; only stage 3 checkpoints are read. Fix: take the weights with `autoshard consolidate {path} weights.pt`"
        )
    recorded_world = int(head.get("dp_world_size", world))
    if recorded_world != world:
        raise ConvertError(
            f"cannot convert {str(path)!r}: it records dp_world_size={recorded_world} but holds {world} ranks' files. Fix: copy every rank's files"
        )
    prefix = LIGHTNING_DEEPSPEED_PREFIX

    def strip(name: str) -> str:
        return name.removeprefix(prefix)

    sub_groups: list[OrderedDict[str, torch.Size]] = list(head["param_shapes"])
    inner = [o["optimizer_state_dict"] for o in optims]
    tensors: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    keys_seen: set[str] = set()
    for idx, shapes in enumerate(sub_groups):
        flats = {"fp32": [o["fp32_flat_groups"][idx] for o in optims]}
        scalars: dict[str, Any] = {}
        for key, value in inner[0]["state"].get(idx, {}).items():
            values = [s["state"][idx][key] for s in inner]
            size = flats["fp32"][0].numel()
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == size:
                flats[key] = values
            elif not isinstance(value, torch.Tensor) or value.numel() == 1:
                if any(not _same(values[0], v) for v in values[1:]):
                    raise ConvertError(
                        f"cannot convert {str(path)!r}: optimizer state '{key}' of sub-group {idx} differs between ranks ({values[0]!r} vs {values[1]!r}). Fix: resume it once with DeepSpeed and save again"
                    )
                scalars[key] = value
            else:
                raise ConvertError(
                    f"cannot convert {str(path)!r}: optimizer state '{key}' of sub-group {idx} has shape {tuple(value.shape)}, neither"
                    f" one value per element of the flat partition ({size}) nor one scalar, so it has no per-parameter mapping"
                    f" (a factored or matrix-preconditioned optimizer). Fix: convert the weights alone with --to safetensors and"
                    f" start the other backend's optimizer fresh, or train with Adam/AdamW/SGD"
                )
        keys_seen.update(k for k in flats if k != "fp32")
        keys_seen.update(scalars)
        offset = 0
        for name, shape in shapes.items():
            numel = int(math.prod(shape))
            part = _partition(numel, world)
            cut = {key: torch.cat([f[offset : offset + part] for f in parts])[:numel].view(shape).clone() for key, parts in flats.items()}
            offset += part
            tensors[strip(name)] = cut.pop("fp32")
            per_param[strip(name)] = {**cut, **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}}
        if offset != flats["fp32"][0].numel():
            raise ConvertError(
                f"cannot convert {str(path)!r}: sub-group {idx}'s partitions hold {flats['fp32'][0].numel()} elements per rank"
                f" where its recorded parameter shapes need {offset}: the files do not match the layout they record."
                f" Fix: use an unmodified checkpoint written by DeepSpeed ZeRO-3"
            )
    groups = []
    for group in inner[0]["param_groups"]:
        names = [strip(n) for idx in group["params"] for n in sub_groups[idx]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    frozen_shapes = head.get("frozen_param_shapes") or {}
    for name, shape in frozen_shapes.items():
        numel = int(math.prod(shape))
        parts = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        tensors[strip(name)] = torch.cat(parts)[:numel].view(shape).float().clone()
    buffer_names = [strip(b) for b in head.get("buffer_names", [])]
    module = head.get("module") or {}
    for b in head.get("buffer_names", []):  # fp32, as zero_to_fp32 restores them: a bf16 engine saves bf16 buffers
        tensors[strip(b)] = module[b].float() if module[b].is_floating_point() else module[b].clone()
    aliases = {strip(a): strip(n) for a, n in (head.get("shared_params") or {}).items()}
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    trainer = {k: v for k, v in head.items() if k not in DEEPSPEED_KEYS}
    scaler = optims[0].get("loss_scaler")
    fp16 = bool(optims[0].get("dynamic_loss_scale")) or getattr(scaler, "cur_scale", 1.0) != 1.0
    state = TrainingState(
        tensors=tensors,
        optimizers=[OptimizerState(groups=groups, state=per_param)],
        trainer=trainer,
        source=path,
        format=Format.DEEPSPEED,
        world_size=world,
        buffers=set(buffer_names),
        frozen={strip(n) for n in frozen_shapes},
        aliases=aliases,
        precision="bf16-mixed" if optim_files[0].name.startswith("bf16_") else "16-mixed" if fp16 else "32-true",
        loss_scaler=scaler,
    )
    scale = getattr(scaler, "cur_scale", getattr(scaler, "loss_scale", 1.0))
    if optims[0].get("dynamic_loss_scale") and scale != 1.0:
        state.notes.append(f"DeepSpeed's dynamic fp16 loss scale ({scale:g}) is not carried: fsdp2 trains bf16 or fp32, without one")
    return state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


# -- what a layout needs -----------------------------------------------------------------------------------------------
def _require_trainer(state: TrainingState, target: str) -> None:
    if "global_step" not in state.trainer or "loops" not in state.trainer:
        raise ConvertError(
            f"cannot convert {str(state.source)!r} to {target}: it holds no Lightning trainer state (epoch, global_step, loops),"
            f" so Trainer.fit(ckpt_path=...) could not resume from the result ({state.format.value} written without Lightning)."
            f" Fix: convert the weights with --to safetensors and load them before fit (ShardingIntent(init_from=...))"
        )


def tied_aliases(state: TrainingState) -> dict[str, str]:
    """Names whose tensor is another entry's: shared storage, recorded ties (DeepSpeed's shared_params), or a
    parameter outside every optimizer that is bit-identical to a trained one of the same shape (a tied weight that
    DCP saved under both names: two separately trained tensors are never bit-identical)."""
    found = dict(state.aliases)
    trained = set(state.trained())
    by_storage: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, t in state.tensors.items():
        if name in found:
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident in by_storage and t.numel():
            found[name] = by_storage[ident]
        else:
            by_storage.setdefault(ident, name)
    # Frozen parameters are never candidates: an EMA teacher equals its student until its first update.
    candidates = [n for n in state.tensors if n not in trained and n not in found and n not in (state.buffers or ()) and n not in state.frozen]
    for name in candidates:
        t = state.tensors[name]
        for other in trained:
            o = state.tensors.get(other)
            if o is not None and o.shape == t.shape and o.dtype == t.dtype and t.numel() > 1 and torch.equal(o, t):
                found[name] = other
                break
    return found


# -- writing: DCP --------------------------------------------------------------------------------------------------------
def write_dcp(state: TrainingState, staged: Path) -> dict[str, Any]:
    """A directory fsdp2 (``strategy='fsdp2'``/``'auto-shard'``) resumes at any world size: the layout autoshard saves."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    _require_trainer(state, "dcp")
    nested: dict[str, Any] = {"state_dict": {n: t.contiguous() for n, t in state.tensors.items()}}
    for i, opt in enumerate(state.optimizers):
        nested[f"optimizer_{i}"] = {"state": opt.state, "param_groups": [dict(g) for g in opt.groups]}
    staged.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "process group not initialized ... no_dist": intended here
        save(nested, storage_writer=FileSystemWriter(str(staged), sync_files=True), no_dist=True)
    torch.save(state.trainer, staged / LIGHTNING_META)
    fsync_file(staged / LIGHTNING_META)
    return {}


# -- writing: DeepSpeed ---------------------------------------------------------------------------------------------------
def _sub_groups(names: list[str], numels: Mapping[str, int], world: int, sub_group_size: int) -> list[list[str]]:
    """DeepSpeed's ``_create_fp16_sub_groups``: consecutive parameters until their partitions reach sub_group_size."""
    total = sum(_partition(numels[n], world) for n in names)
    if sub_group_size >= total:
        return [names]
    out, current, size = [], [], 0
    for name in names:
        current.append(name)
        size += _partition(numels[name], world)
        if size >= sub_group_size or name == names[-1]:
            out.append(current)
            current, size = [], 0
    return out


def _slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 partition of ``t``, flat, zero-padded at the end."""
    flat = t.reshape(-1)
    part = _partition(flat.numel(), world)
    piece = flat[rank * part : (rank + 1) * part]
    if piece.numel() < part:
        piece = torch.cat([piece, piece.new_zeros(part - piece.numel())])
    return piece


def write_deepspeed(state: TrainingState, staged: Path, world_size: int, precision: str, sub_group_size: int = SUB_GROUP_SIZE) -> dict[str, Any]:
    """Per-rank ZeRO-3 files for ``world_size`` ranks, the layout DeepSpeed's own ``load_checkpoint`` reads (no
    universal-checkpoint config needed): fp32 flat partitions and optimizer state per sub-group, module buffers,
    frozen parameters' partitions, Lightning's trainer state as the client state. ``precision`` is the resuming
    run's: DeepSpeed looks for ``bf16_zero_pp_rank_*`` optimizer files under bf16 and ``zero_pp_rank_*`` otherwise,
    and an fp16 run needs its dynamic loss scale, which only a DeepSpeed fp16 checkpoint has."""
    deepspeed = _require_deepspeed(state.source)
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    _require_trainer(state, "deepspeed")
    if state.callback_optimizers:
        raise ConvertError(
            f"cannot convert {str(state.source)!r} to deepspeed: it holds {state.callback_optimizers} optimizer(s) owned by"
            f" callbacks (online probes), and DeepSpeed trains exactly one optimizer. Fix: resume it with strategy='fsdp2',"
            f" or drop the probe and convert the weights alone with --to safetensors"
        )
    if len(state.optimizers) != 1:
        what = (
            "no optimizer state (saved with weights_only, or before the first step)"
            if not state.optimizers
            else f"{len(state.optimizers)} optimizers"
        )
        raise ConvertError(
            f"cannot convert {str(state.source)!r} to deepspeed: it holds {what}, and a DeepSpeed checkpoint holds exactly one"
            f" optimizer's state. Fix: resume it with strategy='fsdp2', or convert the weights alone with --to safetensors"
            f" and start a new fit"
        )
    bf16 = precision in ("bf16-mixed", "bf16-true")
    scaler = LossScaler(scale=1.0)
    if precision in ("16-mixed", "16-true"):
        if state.precision != "16-mixed" or state.loss_scaler is None:
            raise ConvertError(
                f"cannot convert {str(state.source)!r} for an fp16 DeepSpeed run: fp16 training resumes with its dynamic loss"
                f" scale, which only a DeepSpeed fp16 checkpoint holds (this one is {state.precision or state.format.value})."
                f" Fix: resume with precision='bf16-mixed' (--precision bf16-mixed), or '32-true'"
            )
        scaler = state.loss_scaler
    opt = state.optimizers[0]
    aliases = tied_aliases(state)
    trained = [n for n in opt.names() if state.tensors[n].numel() > 0]
    missing = [n for n in opt.names() if n not in state.tensors]
    if missing:
        raise ConvertError(
            f"cannot convert {str(state.source)!r}: the optimizer trains {', '.join(missing[:4])}, which the weights do not hold. Fix: use a complete checkpoint"
        )
    buffers = (
        set(state.buffers)
        if state.buffers is not None
        else {n for n in state.tensors if n not in trained and n not in aliases and n not in state.frozen}
    )
    frozen = [n for n in state.tensors if n not in trained and n not in buffers and n not in aliases]
    numels = {n: state.tensors[n].numel() for n in trained}
    keys = sorted({k for n in trained for k in opt.state.get(n, {})})
    per_group: list[list[list[str]]] = []
    for group in opt.groups:
        names = [n for n in group["params"] if n in numels]
        per_group.append(_sub_groups(names, numels, world_size, sub_group_size) if names else [])
    flat_groups = [sg for groups in per_group for sg in groups]
    stateless = [n for n in trained if not opt.state.get(n)]
    for n in trained:
        for key, value in opt.state.get(n, {}).items():
            if not _elementwise(value, state.tensors[n]) and isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ConvertError(
                    f"cannot convert {str(state.source)!r} to deepspeed: optimizer state '{key}' of {n} has shape {tuple(value.shape)},"
                    f" not the parameter's {tuple(state.tensors[n].shape)}, so it has no per-element mapping into DeepSpeed's flat"
                    f" partitions (a factored or matrix-preconditioned optimizer). Fix: resume it with strategy='fsdp2', or"
                    f" convert the weights alone with --to safetensors"
                )
    for names in flat_groups:  # DeepSpeed keeps one scalar (step) per flat sub-group: its parameters must agree
        for key in keys:
            holders = [n for n in names if key in opt.state.get(n, {}) and not _elementwise(opt.state[n][key], state.tensors[n])]
            odd = next((n for n in holders[1:] if not _same(opt.state[holders[0]][key], opt.state[n][key])), None)
            if odd is not None:
                first = holders[0]
                raise ConvertError(
                    f"cannot convert {str(state.source)!r} to deepspeed: optimizer state '{key}' differs between parameters"
                    f" ({first}: {_show(opt.state[first][key])}, {odd}: {_show(opt.state[odd][key])}), and DeepSpeed keeps one"
                    f" '{key}' per flat group of parameters. Fix: resume it with strategy='fsdp2', or convert the weights alone"
                    f" with --to safetensors"
                )
    folder = staged / DEEPSPEED_TAG
    folder.mkdir(parents=True)
    version = str(deepspeed.__version__)
    global_step = int(state.global_step or 0)
    param_shapes = [OrderedDict((n, torch.Size(state.tensors[n].shape)) for n in names) for names in flat_groups]
    group_of: list[int] = [g for g, groups in enumerate(per_group) for _ in groups]
    placeholders = {n: torch.empty(0, dtype=state.tensors[n].dtype) for n in state.tensors if n not in buffers}
    for rank in range(world_size):
        fp32 = [torch.cat([_slice(state.tensors[n].float(), rank, world_size) for n in names]) for names in flat_groups]
        inner_state: dict[int, dict[str, Any]] = {}
        for i, names in enumerate(flat_groups):
            entry: dict[str, Any] = {}
            for key in keys:
                holders = [n for n in names if key in opt.state.get(n, {})]
                if not holders:
                    continue
                sample = opt.state[holders[0]][key]
                if _elementwise(sample, state.tensors[holders[0]]):
                    parts = [
                        _slice(opt.state[n][key] if key in opt.state.get(n, {}) else torch.zeros_like(state.tensors[n]), rank, world_size)
                        for n in names
                    ]
                    entry[key] = torch.cat(parts).to(torch.float32 if sample.is_floating_point() else sample.dtype)
                else:
                    entry[key] = sample.clone() if isinstance(sample, torch.Tensor) else sample
            if entry:
                inner_state[i] = entry
        param_groups = []
        for g, group in enumerate(opt.groups):
            ids = [i for i, owner in enumerate(group_of) if owner == g]
            if ids:
                param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        optim = {
            "optimizer_state_dict": {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": scaler,
                "dynamic_loss_scale": bool(getattr(scaler, "dynamic", False)),
                "overflow": False,
                "partition_count": world_size,
                "optimizer_state_dict": {"state": inner_state, "param_groups": param_groups},
                "fp32_flat_groups": fp32,
            },
            "ds_config": {},
            "ds_version": version,
        }
        torch.save(optim, folder / f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        module = {n: (state.tensors[n] if n in buffers else placeholders[n]) for n in state.tensors}
        model = {
            "module": module,
            "buffer_names": [n for n in state.tensors if n in buffers],
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": OrderedDict((n, torch.Size(state.tensors[n].shape)) for n in frozen),
            "shared_params": {a: n for a, n in aliases.items() if n in numels},
            "frozen_param_fragments": OrderedDict((n, _slice(state.tensors[n], rank, world_size).clone()) for n in frozen),
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": 0,
            "global_steps": global_step,
            "dp_world_size": world_size,
            "mp_world_size": 1,
            "ds_config": {},
            "ds_version": version,
            **state.trainer,
        }
        torch.save(model, folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    for f in folder.iterdir():
        fsync_file(f)
    (staged / DEEPSPEED_LATEST).write_text(DEEPSPEED_TAG)
    script = Path(deepspeed.__file__).parent / "utils" / "zero_to_fp32.py"
    if script.is_file():  # DeepSpeed copies its recovery script next to every checkpoint; so does this
        shutil.copyfile(script, staged / "zero_to_fp32.py")
    notes = []
    if buffers and state.buffers is None:
        shown = ", ".join(sorted(buffers)[:4]) + (", ..." if len(buffers) > 4 else "")
        notes.append(
            f"written as module buffers, being outside the optimizer and saved whole: {shown}; if one is a frozen"
            f" parameter, DeepSpeed's load fails with 'size mismatch' for it: convert again with --frozen NAME"
        )
    if frozen:
        notes.append(
            f"{len(frozen)} frozen parameters (outside the optimizer) written as ZeRO-3 fragments: {', '.join(frozen[:4])}{', ...' if len(frozen) > 4 else ''}"
        )
    if stateless:
        notes.append(f"{len(stateless)} parameters had no optimizer state (never stepped): zero moments, the group's step")
    notes.append(f"written for precision {precision!r} (DeepSpeed names its optimizer files after it): resume with that precision")
    return {"world_size": world_size, "notes": notes, "sub_groups": len(flat_groups)}


def _elementwise(value: Any, param: torch.Tensor) -> bool:
    """One value per element of the parameter (exp_avg, exp_avg_sq, momentum_buffer), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _show(value: Any) -> str:
    return f"{value.item():g}" if isinstance(value, torch.Tensor) and value.numel() == 1 else repr(value)


# -- writing: safetensors --------------------------------------------------------------------------------------------------
def parse_size(text: str | int) -> int:
    """``5GB`` (decimal, as Hugging Face reads it), ``500MiB`` (binary), or a number of bytes."""
    return memory_size(text, "--max-shard-size", "5GB", ConvertError)


def write_safetensors(state: TrainingState, staged: Path, max_shard_size: int) -> dict[str, Any]:
    """Hugging Face layout: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` once the weights pass ``max_shard_size`` (greedy, in state-dict order, as
    save_pretrained splits). Tied weights are written once (safetensors refuses shared storage; transformers drops
    the tied name too) and the alias recorded in the file's metadata under ``autoshard_tied``."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConvertError(f'--to safetensors needs the safetensors package ({exc}). Fix: pip install "autoshard[safetensors]"') from None
    aliases = tied_aliases(state)
    tensors = {n: t.detach().contiguous() for n, t in state.tensors.items() if n not in aliases}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    metadata = {"format": "pt"}
    if aliases:
        metadata[TIED_METADATA] = json.dumps(aliases, sort_keys=True)
    staged.mkdir(parents=True)
    names = [SAFETENSORS_SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, fname in zip(shards, names):
        save_file(shard, str(staged / fname), metadata=metadata)
        fsync_file(staged / fname)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values()), **({TIED_METADATA: aliases} if aliases else {})},
            "weight_map": {n: fname for shard, fname in zip(shards, names) for n in shard},
        }
        (staged / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        fsync_file(staged / SAFETENSORS_INDEX)
    notes = (
        [f"tied weights written once: {', '.join(f'{a} -> {n}' for a, n in sorted(aliases.items()))} (recorded in the metadata as {TIED_METADATA})"]
        if aliases
        else []
    )
    return {"notes": notes, "tensors": len(tensors)}


# -- publishing ------------------------------------------------------------------------------------------------------------
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


def check_output(out: Path, source: Path | None, force: bool, *, to: str = "") -> None:
    """Refuse, before reading anything (and again under the lock, before the rename): the source itself, a DST that
    holds it or lies inside it, a place nothing can be written, and an existing DST unless ``force`` and DST is an
    output of ``convert --to {to}`` holding nothing else (its manifest says so). --force never deletes what
    autoshard did not write."""
    suggest = f"{source}-{to or 'converted'}" if source is not None else f"{out}-new"
    shared = overlap(out, source) if source is not None and (Path(source).exists() or Path(source).is_symlink()) else None
    if shared is Overlap.SAME:
        raise ConvertError(f"refusing to write {str(out)!r}: it is the checkpoint being converted. Fix: choose another output path")
    if shared is Overlap.HOLDS:
        raise ConvertError(
            f"refusing to write {str(out)!r}: it holds the checkpoint being converted ({str(source)!r}), and"
            f" publishing DST replaces it whole, so even --force never does. Fix: choose a new output path outside"
            f" it, e.g. {str(beside(Path(out), to or 'converted'))!r}"
        )
    if shared is Overlap.INSIDE:
        raise ConvertError(
            f"refusing to write {str(out)!r}: it is inside the checkpoint being converted ({str(source)!r}), which"
            f" would then hold files its save did not write (and the next save to it, which replaces it whole, would"
            f" delete them). Fix: choose a new output path outside it, e.g. {suggest!r}"
        )
    refusal = unwritable_refusal(out)
    if refusal is not None:
        raise ConvertError(refusal)
    if not (out.exists() or out.is_symlink()):
        return
    what = detect_format(out, verify=False).detail
    foreign = foreign_content(out, output_kind(to), legacy=bool(to) and _recorded_target(out) == to) if to else "its kind is unknown"
    if foreign is None and not force:
        raise ConvertError(
            f"refusing to overwrite {str(out)!r}: it already exists ({what}). Fix: choose a new"
            f" output path, or pass --force (force=True) to replace it once the new one is complete"
        )
    if foreign is not None:
        even = " even with --force" if force else ""
        raise ConvertError(
            f"refusing to overwrite {str(out)!r}{even}: it already exists ({what}), and {foreign}: --force replaces"
            f" only an output of `{output_kind(to)}` holding nothing else. Fix: choose a new output path, e.g."
            f" {suggest!r}, or move {str(out)!r} away first"
        )


def _publish(publisher: Publisher, force: bool, source: Path, to: str) -> None:
    """Manifest of every file, with this output's kind; then, under the lock, DST checked again (another writer may
    have published meanwhile) and the rename (``commit``: aside, in, old removed; never a partial DST)."""
    staged = publisher.staged
    files = [p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()]
    write_manifest(staged / MANIFEST, describe_files(staged, files), output_kind(to))
    fsync_dir(staged)
    publisher.publish(lambda path: check_output(path, source, force, to=to))


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    to: str,
    *,
    world_size: int | None = None,
    tag: str | None = None,
    frozen: Iterable[str] = (),
    max_shard_size: str | int = MAX_SHARD_SIZE,
    module: str | None = None,
    precision: str | None = None,
    sub_group_size: int = SUB_GROUP_SIZE,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    trust_pickle: bool = False,
) -> Converted:
    """Convert checkpoint ``src`` into ``dst`` in the ``to`` layout; see the module docstring. ``trust_pickle``
    unpickles the source as torch.load(weights_only=False) does (its code runs): only for a file the user trusts."""
    start = time.perf_counter()
    say = progress or (lambda _: None)
    if to not in TARGETS:
        raise ConvertError(f"unknown target {to!r}. Fix: --to one of {', '.join(TARGETS)}")
    if precision is not None:
        if to != "deepspeed":
            raise ConvertError(
                f"--precision is for --to deepspeed (DeepSpeed names its files after it); {to} does not depend on it. Fix: drop --precision"
            )
        precision = _precision(precision)
    if module is not None and to != "safetensors":
        raise ConvertError(
            f"--module {module!r} keeps one submodule's weights, which only --to safetensors writes: a checkpoint to resume needs the whole module. Fix: drop --module, or use --to safetensors"
        )
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ConvertError(f"--world-size must be a positive integer, got {world_size!r}. Fix: --world-size N (devices x nodes of the resuming run)")
    out = Path(dst)
    size_limit = parse_size(max_shard_size)
    check_output(out, Path(src) if Path(src).exists() else None, force, to=to)
    if to == "deepspeed" and precision is None and detect_format(src, verify=False).format is not Format.DEEPSPEED:
        _missing_precision(Path(src))  # before reading a checkpoint that may be large
    state = read_checkpoint(src, tag=tag, progress=say, trust_pickle=trust_pickle, weights_only=to == "safetensors")
    _check_target(state, to)
    if module is not None:
        _select_module(state, module)
    for prefix in frozen:
        matched = {n for n in state.tensors if n == prefix or n.startswith(prefix + ".")}
        if not matched:
            raise ConvertError(
                f"--frozen {prefix!r} matches no tensor of {str(state.source)!r}. Fix: pass a name or module path the checkpoint holds, e.g. {next(iter(state.tensors), '')!r}"
            )
        state.frozen |= matched
        if state.buffers is not None:
            state.buffers -= matched
    target_world = (world_size or state.world_size) if to == "deepspeed" else None
    if to == "deepspeed" and target_world is None:
        raise ConvertError(
            f"{str(state.source)!r} does not record the world size it was saved at, and a DeepSpeed checkpoint is written"
            f" for one. Fix: pass --world-size N, the devices x nodes of the run that resumes it"
        )
    if to == "deepspeed" and precision is None:
        if state.precision is None:
            _missing_precision(state.source)
        precision = state.precision
    with Publisher(out) as publisher:  # checkpoint_io's publish protocol: DST's lock, a staging of this writer's own
        staged = publisher.staged
        say(f"writing {to} into {str(staged)!r}")
        if to == "dcp":
            written = write_dcp(state, staged)
        elif to == "deepspeed":
            written = write_deepspeed(state, staged, int(target_world or 1), str(precision), sub_group_size)
        else:
            written = write_safetensors(state, staged, size_limit)
        record = {
            "format": "autoshard-convert",
            "version": 1,
            "source": str(state.source),
            "source_format": state.format.value,
            "source_world_size": state.world_size,
            "target": to,
            "target_world_size": target_world,
            "global_step": state.global_step,
        }
        if to != "safetensors":  # a Hugging Face directory stays exactly what from_pretrained expects
            (staged / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        files = [p for p in staged.rglob("*") if p.is_file()]
        nbytes = sum(p.stat().st_size for p in files)
        say(f"publishing {str(out)!r} ({len(files) + 1} files, {nbytes / 2**20:.2f} MiB)")
        _publish(publisher, force, state.source, to)
    trained = set(state.trained())
    buffers = len(state.buffers) if state.buffers is not None else len([n for n in state.tensors if n not in trained and n not in state.frozen])
    opt_tensors = sum(1 for o in state.optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    epoch = state.trainer.get("epoch")
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
        files=len(files) + 1,
        bytes=nbytes,
        seconds=time.perf_counter() - start,
        notes=tuple([*state.notes, *written.get("notes", [])]),
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


def _precision(value: str) -> str:
    from autoshard.errors import IntentError
    from autoshard.precision import normalize_precision

    try:
        return normalize_precision(value).value
    except IntentError as exc:
        raise ConvertError(f"--precision: {exc}") from None


def _check_target(state: TrainingState, to: str) -> None:
    """Refuse conversions into the layout the source already is: the backend that reads it does so as is."""
    if to == "dcp" and state.format in (Format.DCP, Format.DCP_RAW, Format.FULL):
        raise ConvertError(
            f"{str(state.source)!r} is already {'a DCP checkpoint' if state.format is not Format.FULL else 'a full checkpoint file'},"
            f" which fsdp2 resumes as is at any world size. Fix: pass it as ckpt_path with strategy='fsdp2', or convert to"
            f" deepspeed or safetensors"
        )


# -- command line ------------------------------------------------------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> int:
    """``autoshard convert SRC DST --to ...``: progress on stderr, the summary (or --json) on stdout."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this process only converts: DeepSpeed needs no accelerator here

    def progress(line: str) -> None:
        print(f"autoshard convert: {line}", file=sys.stderr, flush=True)

    result = convert(
        args.src,
        args.dst,
        args.to,
        world_size=args.world_size,
        tag=args.tag,
        frozen=args.frozen or (),
        max_shard_size=args.max_shard_size,
        module=args.module,
        precision=args.precision,
        force=args.force,
        progress=None if args.quiet else progress,
        trust_pickle=args.trust_pickle,
    )
    print(json.dumps(result.to_json(), indent=1) if args.json else result.describe())
    return 0


HELP = "convert a checkpoint between DeepSpeed ZeRO-3 and fsdp2 (DCP), optimizer state included, or to safetensors"


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``autoshard convert SRC DST --to dcp|deepspeed|safetensors`` to the ``autoshard`` command."""
    parser = subparsers.add_parser(
        "convert",
        allow_abbrev=False,
        help=HELP,
        description=(
            "Rewrite a checkpoint for another backend: a DeepSpeed ZeRO-3 checkpoint becomes a DCP directory that"
            " strategy='fsdp2' resumes (Trainer.fit(ckpt_path=DST)) at any world size, and back (--world-size N --precision P);"
            " weights, every parameter's optimizer state, step counts, LR schedulers and Lightning's loop state move"
            " with it. --to safetensors writes Hugging Face weights. One CPU process; DST is written beside itself and"
            " renamed into place when complete."
        ),
    )
    parser.add_argument("src", metavar="SRC", help="the checkpoint: a DeepSpeed or DCP directory, or a full .ckpt file")
    parser.add_argument("dst", metavar="DST", help="the directory to write (must not exist, unless --force)")
    parser.add_argument(
        "--to",
        required=True,
        choices=TARGETS,
        help="dcp: for strategy='fsdp2'; deepspeed: for 'autoshard-deepspeed'; safetensors: Hugging Face weights",
    )
    parser.add_argument("--world-size", type=int, default=None, help="deepspeed only: ranks of the resuming run (default: the source's)")
    parser.add_argument(
        "--precision",
        default=None,
        help="deepspeed only: the resuming Trainer's precision, e.g. bf16-mixed or 32-true (default: the source's, when DeepSpeed)",
    )
    parser.add_argument("--tag", default=None, help="DeepSpeed source only: the tag directory (default: the one in 'latest')")
    parser.add_argument(
        "--frozen",
        action="append",
        metavar="NAME",
        help="deepspeed only: a parameter (or module path) outside the optimizer that is not a buffer; repeatable",
    )
    parser.add_argument(
        "--max-shard-size", default=MAX_SHARD_SIZE, help=f"safetensors only: split above this size (default {MAX_SHARD_SIZE}, like Hugging Face)"
    )
    parser.add_argument(
        "--module", default=None, metavar="PATH", help="safetensors only: the submodule to write, named as it names its weights (e.g. model)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it is an output of convert --to the same target, holding nothing else (only once the new one is complete)",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle SRC as torch.load(weights_only=False) does, running any code it holds: only for a checkpoint you trust",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=cmd_convert)


__all__ = [
    "ConvertError",
    "Converted",
    "OptimizerState",
    "TrainingState",
    "convert",
    "parse_size",
    "read_checkpoint",
    "register_cli",
    "tied_aliases",
    "write_dcp",
    "write_deepspeed",
    "write_safetensors",
]
