"""The DeepSpeed ZeRO-3 layout (``strategy='autoshard-deepspeed'``, Lightning's DeepSpeedStrategy): read into a
TrainingState, written for any world size, precision and sub-group size.

DeepSpeed has no function that returns per-parameter optimizer state in memory, so the flat buffers are cut here by
the layout it records (``param_shapes``), as its own ``zero_to_fp32`` cuts them (the tests compare with it and with a
live engine's ``safe_get_full_optimizer_state``). Not ``ds_to_universal``: it writes ``latest_universal`` into the
*parent* of its output, drops each parameter's ``step``, and its output loads only with ``load_universal`` (which
skips the module's buffers).
"""

from __future__ import annotations

import math
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.capability import Format
from autoshard.checkpoint import deepspeed_layout
from autoshard.checkpoint.formats import detect_format
from autoshard.checkpoint.publish import fsync_file
from autoshard.checkpoint.resume import deepspeed_tag
from autoshard.checkpoint.trust import load_torch_file
from autoshard.convert.state import ConvertError, OptimizerState, TrainingState, require_trainer, tied_aliases


def require_deepspeed(path: Path) -> Any:
    """deepspeed, imported, for a checkpoint at ``path`` (its files pickle its loss scaler); the version range checked."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ConvertError(
            f"{str(path)!r}: DeepSpeed checkpoints hold DeepSpeed objects (the loss scaler), so deepspeed is needed to"
            f' read or write them ({exc}). Fix: pip install "autoshard[deepspeed]" (no GPU needed)'
        ) from None
    deepspeed_layout.check_version()
    return deepspeed


def _rank_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(model_states, optim_states) files of a ZeRO-3 tag directory, in rank order; refuses other layouts by name."""
    model: dict[int, Path] = {}
    optim: dict[int, Path] = {}
    for f in folder.iterdir():
        for pattern, found in ((deepspeed_layout.ZERO3_MODEL_FILE, model), (deepspeed_layout.ZERO3_OPTIM_FILE, optim)):
            m = pattern.match(f.name)
            if m:
                if int(m.group(2)) != 0:
                    raise ConvertError(
                        f"cannot convert {str(folder)!r}: {f.name} belongs to model-parallel rank {int(m.group(2))}: tensor or"
                        f" pipeline parallel DeepSpeed checkpoints are not converted (data parallel ZeRO-3 only). Fix: convert"
                        f" the weights with DeepSpeed's ds_to_universal, or train data parallel only"
                    )
                found[int(m.group(1))] = f
    if not model and any(folder.glob(deepspeed_layout.ZERO12_MODEL_FILES)):
        raise ConvertError(
            f"cannot convert {str(folder)!r}: a DeepSpeed ZeRO stage 1/2 checkpoint ({deepspeed_layout.ZERO12_MODEL_FILES}); only ZeRO-3"
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


def read_deepspeed(path: Path, tag: str | None, trust_pickle: bool = False) -> TrainingState:
    """A ZeRO-3 checkpoint into full per-parameter tensors, each sub-group's flat partitions cut by ``param_shapes`` as
    zero_to_fp32's ``_get_fp32_state_dict_from_zero3_checkpoint`` cuts the weights."""
    models, optims, bf16 = _load_rank_files(path, tag, trust_pickle)
    head, world = models[0], len(models)
    sub_groups: list[OrderedDict[str, torch.Size]] = list(head["param_shapes"])
    tensors, per_param = _cut_sub_groups(path, sub_groups, optims)
    groups = []
    for group in optims[0]["optimizer_state_dict"]["param_groups"]:
        names = [_strip(n) for idx in group["params"] for n in sub_groups[idx]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    frozen_shapes = head.get("frozen_param_shapes") or {}
    for name, shape in frozen_shapes.items():
        numel = int(math.prod(shape))
        parts = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        tensors[_strip(name)] = torch.cat(parts)[:numel].view(shape).float().clone()
    module = head.get("module") or {}
    for b in head.get("buffer_names", []):  # fp32, as zero_to_fp32 restores them: a bf16 engine saves bf16 buffers
        tensors[_strip(b)] = module[b].float() if module[b].is_floating_point() else module[b].clone()
    aliases = {_strip(a): _strip(n) for a, n in (head.get("shared_params") or {}).items()}
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    scaler = optims[0].get("loss_scaler")
    fp16 = bool(optims[0].get("dynamic_loss_scale")) or getattr(scaler, "cur_scale", 1.0) != 1.0
    state = TrainingState(
        tensors=tensors,
        optimizers=[OptimizerState(groups=groups, state=per_param)],
        trainer={k: v for k, v in head.items() if k not in deepspeed_layout.ENGINE_KEYS},
        source=path,
        format=Format.DEEPSPEED,
        world_size=world,
        buffers={_strip(b) for b in head.get("buffer_names", [])},
        frozen={_strip(n) for n in frozen_shapes},
        aliases=aliases,
        precision="bf16-mixed" if bf16 else "16-mixed" if fp16 else "32-true",
        loss_scaler=scaler,
    )
    scale = getattr(scaler, "cur_scale", getattr(scaler, "loss_scale", 1.0))
    if optims[0].get("dynamic_loss_scale") and scale != 1.0:
        state.notes.append(f"DeepSpeed's dynamic fp16 loss scale ({scale:g}) is not carried: fsdp2 trains bf16 or fp32, without one")
    return state


def _strip(name: str) -> str:
    """A parameter's name in the LightningModule: Lightning's wrapper prefix removed."""
    return name.removeprefix(deepspeed_layout.LIGHTNING_PREFIX)


def _load_rank_files(path: Path, tag: str | None, trust_pickle: bool) -> tuple[list[Any], list[Any], bool]:
    """Every rank's model states and optimizer state of the tag (``latest``'s, never a guess), checked to be a
    complete ZeRO-3 checkpoint; and whether its optimizer files are bf16's."""
    require_deepspeed(path)  # its files pickle DeepSpeed objects (the loss scaler)
    tag = tag or deepspeed_tag(detect_format(path, verify=False), None, "convert")  # 'latest', never a guess
    folder = path / tag
    if (folder / deepspeed_layout.NVME_SWAP_DIR).exists():
        raise ConvertError(
            f"cannot convert {str(path)!r}: its optimizer state lives in NVMe swap files ({deepspeed_layout.NVME_SWAP_DIR}/), which only the"
            f" engine that wrote them reads. Fix: resume it once without NVMe offload and save, then convert that checkpoint"
        )
    model_files, optim_files = _rank_files(folder)
    world = len(model_files)
    models = [load_torch_file(f, action="convert", trust_pickle=trust_pickle) for f in model_files]
    optims = [load_torch_file(f, action="convert", trust_pickle=trust_pickle)["optimizer_state_dict"] for f in optim_files]
    stage = int(optims[0].get("zero_stage", 0))
    if stage != 3:
        raise ConvertError(
            f"cannot convert {str(path)!r}: ZeRO stage {stage}; only stage 3 checkpoints are read. Fix: take the weights with `autoshard consolidate {path} weights.pt`"
        )
    recorded_world = int(models[0].get("dp_world_size", world))
    if recorded_world != world:
        raise ConvertError(
            f"cannot convert {str(path)!r}: it records dp_world_size={recorded_world} but holds {world} ranks' files. Fix: copy every rank's files"
        )
    return models, optims, optim_files[0].name.startswith(deepspeed_layout.BF16_PREFIX)


def _sub_group_state(path: Path, idx: int, optims: list[Any]) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any]]:
    """Sub-group ``idx``'s flat partitions of every rank (``fp32``, and each per-element optimizer state), and its
    scalar optimizer state (the same on every rank)."""
    inner = [o["optimizer_state_dict"] for o in optims]
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
    return flats, scalars


def _cut_sub_groups(
    path: Path, sub_groups: list[OrderedDict[str, torch.Size]], optims: list[Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Each parameter's full fp32 weight and optimizer state, cut from the flat partitions of every rank by the
    recorded shapes, in order."""
    world = len(optims)
    tensors: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for idx, shapes in enumerate(sub_groups):
        flats, scalars = _sub_group_state(path, idx, optims)
        offset = 0
        for name, shape in shapes.items():
            numel = int(math.prod(shape))
            part = deepspeed_layout.partition_numel(numel, world)
            cut = {key: torch.cat([f[offset : offset + part] for f in parts])[:numel].view(shape).clone() for key, parts in flats.items()}
            offset += part
            tensors[_strip(name)] = cut.pop("fp32")
            per_param[_strip(name)] = {**cut, **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}}
        if offset != flats["fp32"][0].numel():
            raise ConvertError(
                f"cannot convert {str(path)!r}: sub-group {idx}'s partitions hold {flats['fp32'][0].numel()} elements per rank"
                f" where its recorded parameter shapes need {offset}: the files do not match the layout they record."
                f" Fix: use an unmodified checkpoint written by DeepSpeed ZeRO-3"
            )
    return tensors, per_param


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


@dataclass
class _Layout:
    """How a TrainingState's tensors go into ZeRO-3 files: the one optimizer, which tensors are trained, frozen,
    buffers or tied aliases, and the flat sub-groups (names in order) with the parameter group of each."""

    opt: OptimizerState
    trained: list[str]
    buffers: set[str]
    frozen: list[str]
    aliases: dict[str, str]
    keys: list[str]  # optimizer state keys (exp_avg, step, ...)
    flat_groups: list[list[str]]
    group_of: list[int]


def write_deepspeed(
    state: TrainingState, staged: Path, world_size: int, precision: str, sub_group_size: int = deepspeed_layout.SUB_GROUP_SIZE
) -> dict[str, Any]:
    """Per-rank ZeRO-3 files for ``world_size`` ranks, as DeepSpeed's own ``load_checkpoint`` reads them. ``precision``
    is the resuming run's: the optimizer files' names depend on it, and fp16 needs a dynamic loss scale."""
    deepspeed = require_deepspeed(state.source)
    scaler = _loss_scaler(state, precision)
    layout = _layout(state, world_size, sub_group_size)
    folder = staged / deepspeed_layout.LIGHTNING_TAG
    folder.mkdir(parents=True)
    version = str(deepspeed.__version__)
    bf16 = precision in ("bf16-mixed", "bf16-true")
    for rank in range(world_size):
        torch.save(_optim_states(state, layout, rank, world_size, scaler, version), folder / deepspeed_layout.optim_states_name(rank, bf16))
        torch.save(_model_states(state, layout, rank, world_size, version), folder / deepspeed_layout.model_states_name(rank))
    for f in folder.iterdir():
        fsync_file(f)
    (staged / deepspeed_layout.LATEST).write_text(deepspeed_layout.LIGHTNING_TAG)
    script = deepspeed_layout.recovery_script(deepspeed.__file__)
    if script.is_file():  # DeepSpeed copies its recovery script next to every checkpoint (_copy_recovery_script); so does this
        shutil.copyfile(script, staged / deepspeed_layout.RECOVERY_SCRIPT)
    notes = []
    buffers, frozen = layout.buffers, layout.frozen
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
    stateless = [n for n in layout.trained if not layout.opt.state.get(n)]
    if stateless:
        notes.append(f"{len(stateless)} parameters had no optimizer state (never stepped): zero moments, the group's step")
    notes.append(f"written for precision {precision!r} (DeepSpeed names its optimizer files after it): resume with that precision")
    return {"world_size": world_size, "notes": notes, "sub_groups": len(layout.flat_groups)}


def _loss_scaler(state: TrainingState, precision: str) -> Any:
    """The loss scaler the optimizer files hold, once ``state`` is known to fit DeepSpeed (Lightning's trainer state,
    exactly one optimizer): a static scale of 1, or an fp16 source's dynamic one for an fp16 run."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    require_trainer(state, "deepspeed")
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
    if precision not in ("16-mixed", "16-true"):
        return LossScaler(scale=1.0)
    if state.precision != "16-mixed" or state.loss_scaler is None:
        raise ConvertError(
            f"cannot convert {str(state.source)!r} for an fp16 DeepSpeed run: fp16 training resumes with its dynamic loss"
            f" scale, which only a DeepSpeed fp16 checkpoint holds (this one is {state.precision or state.format.value})."
            f" Fix: resume with precision='bf16-mixed' (--precision bf16-mixed), or '32-true'"
        )
    return state.loss_scaler


def _layout(state: TrainingState, world_size: int, sub_group_size: int) -> _Layout:
    """Which tensor goes where, checked: every trained parameter held, every optimizer state per element or one
    scalar per flat sub-group (DeepSpeed keeps one ``step`` per sub-group)."""
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
    per_group: list[list[list[str]]] = []
    for group in opt.groups:
        names = [n for n in group["params"] if n in numels]
        per_group.append(deepspeed_layout.sub_groups(names, numels, world_size, sub_group_size) if names else [])
    keys = sorted({k for n in trained for k in opt.state.get(n, {})})
    layout = _Layout(
        opt, trained, buffers, frozen, {a: n for a, n in aliases.items() if n in numels}, keys,
        [sg for groups in per_group for sg in groups], [g for g, groups in enumerate(per_group) for _ in groups],
    )  # fmt: skip
    _check_optimizer_state(state, layout)
    return layout


def _check_optimizer_state(state: TrainingState, layout: _Layout) -> None:
    """Refuse optimizer state DeepSpeed's flat partitions cannot hold: a tensor of another shape than its parameter,
    or a scalar that differs within one flat sub-group."""
    opt = layout.opt
    for n in layout.trained:
        for key, value in opt.state.get(n, {}).items():
            if not _elementwise(value, state.tensors[n]) and isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ConvertError(
                    f"cannot convert {str(state.source)!r} to deepspeed: optimizer state '{key}' of {n} has shape {tuple(value.shape)},"
                    f" not the parameter's {tuple(state.tensors[n].shape)}, so it has no per-element mapping into DeepSpeed's flat"
                    f" partitions (a factored or matrix-preconditioned optimizer). Fix: resume it with strategy='fsdp2', or"
                    f" convert the weights alone with --to safetensors"
                )
    for names in layout.flat_groups:  # DeepSpeed keeps one scalar (step) per flat sub-group: its parameters must agree
        for key in layout.keys:
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


def _flat_state(state: TrainingState, layout: _Layout, names: list[str], rank: int, world_size: int) -> dict[str, Any]:
    """One flat sub-group's optimizer state on ``rank``: per-element state as its flat partition, scalars as they are."""
    opt, entry = layout.opt, {}
    for key in layout.keys:
        holders = [n for n in names if key in opt.state.get(n, {})]
        if not holders:
            continue
        sample = opt.state[holders[0]][key]
        if _elementwise(sample, state.tensors[holders[0]]):
            parts = [
                deepspeed_layout.rank_slice(
                    opt.state[n][key] if key in opt.state.get(n, {}) else torch.zeros_like(state.tensors[n]), rank, world_size
                )
                for n in names
            ]
            entry[key] = torch.cat(parts).to(torch.float32 if sample.is_floating_point() else sample.dtype)
        else:
            entry[key] = sample.clone() if isinstance(sample, torch.Tensor) else sample
    return entry


def _optim_states(state: TrainingState, layout: _Layout, rank: int, world_size: int, scaler: Any, version: str) -> dict[str, Any]:
    """Rank ``rank``'s optimizer file: its fp32 partition and optimizer state of every flat sub-group."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    fp32 = [torch.cat([deepspeed_layout.rank_slice(state.tensors[n].float(), rank, world_size) for n in names]) for names in layout.flat_groups]
    inner_state = {i: entry for i, names in enumerate(layout.flat_groups) if (entry := _flat_state(state, layout, names, rank, world_size))}
    param_groups = []
    for g, group in enumerate(layout.opt.groups):
        ids = [i for i, owner in enumerate(layout.group_of) if owner == g]
        if ids:
            param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {
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


def _model_states(state: TrainingState, layout: _Layout, rank: int, world_size: int, version: str) -> dict[str, Any]:
    """Rank ``rank``'s model states file: buffers whole, parameters as empty placeholders, shapes, frozen parameters'
    fragments, and Lightning's trainer state as the client state."""
    buffers, frozen = layout.buffers, layout.frozen
    return {
        "module": {n: (t if n in buffers else torch.empty(0, dtype=t.dtype)) for n, t in state.tensors.items()},
        "buffer_names": [n for n in state.tensors if n in buffers],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(state.tensors[n].shape)) for n in names) for names in layout.flat_groups],
        "frozen_param_shapes": OrderedDict((n, torch.Size(state.tensors[n].shape)) for n in frozen),
        "shared_params": layout.aliases,
        "frozen_param_fragments": OrderedDict((n, deepspeed_layout.rank_slice(state.tensors[n], rank, world_size).clone()) for n in frozen),
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": int(state.global_step or 0),
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "ds_config": {},
        "ds_version": version,
        **state.trainer,
    }


def _elementwise(value: Any, param: torch.Tensor) -> bool:
    """One value per element of the parameter (exp_avg, exp_avg_sq, momentum_buffer), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _show(value: Any) -> str:
    return f"{value.item():g}" if isinstance(value, torch.Tensor) and value.numel() == 1 else repr(value)
