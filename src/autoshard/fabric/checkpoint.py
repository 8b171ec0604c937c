"""``fabric.save`` / ``fabric.load`` under autoshard's Fabric fsdp2 strategies: the crash-safe writer of the Trainer
path (``checkpoint.publish.Publisher``: lock, staging of this save's own, manifest of every file, rename), the same layout
(a DCP directory with ``meta.pt``; ``checkpoint='full'``: one torch file with its sidecar manifest), so ``autoshard
consolidate`` / ``convert`` read it, and a load that checks every file first and restores each rank's RNG state.

Fabric's state dict holds whatever the user puts in it: modules and optimizers become their (sharded) state dicts
under their own keys (``{"model": ..., "optimizer": ...}``: consolidate picks the module under ``"model"``), the rest
goes into ``meta.pt``. Unlike Lightning's ModelParallelStrategy, several models may share one checkpoint: each
optimizer is saved with the model whose parameters it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from autoshard.adapters.fsdp2 import sync_buffers
from autoshard.capability import Format
from autoshard.checkpoint import saves
from autoshard.checkpoint.formats import FORMAT_VERSION, LIGHTNING_META, STATE_KEY, detect_format
from autoshard.checkpoint.publish import unverified_warning
from autoshard.checkpoint.readers import dcp_entries, saved_entries, saved_shapes
from autoshard.checkpoint.resume import model_mismatch, reshaped_names, resolve_for_load
from autoshard.checkpoint.trust import CheckpointFormatError, load_torch_file, unreadable_globals

Filter = Mapping[str, Callable[[str, Any], bool]]


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _filtered(key: str, filters: Filter | None, value: Any) -> Any:
    """Fabric's ``save(filter={key: fn(name, value) -> keep})`` on one converted entry."""
    keep = (filters or {}).get(key)
    if keep is None or not isinstance(value, Mapping):
        return value
    return {k: v for k, v in value.items() if keep(k, v)}


def owner_of(optimizer: torch.optim.Optimizer, modules: Mapping[str, nn.Module], key: str) -> nn.Module:
    """The model (among those in the state) whose parameters ``optimizer`` trains: its state is saved by their names."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if any(id(p) in held for p in module.parameters()):
            return module
    raise ValueError(
        f"the optimizer under {key!r} trains no parameter of the model(s) in this state ({', '.join(map(repr, modules)) or 'none'}),"
        f" so its state could not be saved or loaded by parameter name. Fix: put the model it trains in the same"
        f" state, e.g. {{'model': model, {key!r}: optimizer}}"
    )


TRUST_FIX = (  # fabric.load's own argument, where the command line's refusal names --trust-pickle
    "if you trust who wrote it (your own run), load it with fabric.load(path, state, weights_only=False), which"
    " unpickles it as torch.load(weights_only=False) does; otherwise ask its author to save those entries as plain values"
)


def _refuse_unreadable(metadata: Mapping[str, Any]) -> None:
    """fabric.save refuses what its own fabric.load would refuse to read back (a weights-only load), before anything
    is written, naming the entry."""
    for key, value in metadata.items():
        names = unreadable_globals(value)
        if names:
            shown = ", ".join(f"`{n}`" for n in names[:4]) + (", ..." if len(names) > 4 else "")
            raise CheckpointFormatError(
                f"fabric.save cannot save {key!r}: it holds {shown}, which fabric.load would refuse to read back: a"
                f" checkpoint is read with torch.load(weights_only=True), so that loading one runs no code, and that"
                f" builds tensors, plain values (str, int, float, bool, None) and their dicts, lists and tuples only;"
                f" nothing was written. Fix: save {key!r} as plain values (str(path), vars(namespace), float(x),"
                f" x.tolist(), a tensor), or as an object whose state_dict() returns plain values"
            )


def unmatched_keys_refusal(path: Path, missing: list[str]) -> KeyError:
    return KeyError(
        f"the state asks for {', '.join(map(repr, missing))}, which {str(path)!r} does not hold. Fix: load with"
        f" fabric.load(path, state, strict=False) to skip them, or save them in the checkpoint"
    )


class FabricCheckpoint:
    """``save_checkpoint`` / ``load_checkpoint`` with Fabric's signatures, on the writer of ``checkpoint.saves``."""

    intent: Any
    parallel_mesh: Any  # the strategy's one mesh (autoshard.mesh.ParallelMesh), made in setup_environment
    global_rank: int
    world_size: int

    # -- save ----------------------------------------------------------------------------------------------------
    def save_checkpoint(  # type: ignore[override]
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Filter | None = None
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: the strategy writes"
                f" the checkpoint itself (crash-safe), not through a CheckpointIO"
            )
        full = self.intent.checkpoint == "full"
        if filter is not None and not full:
            raise NotImplementedError(
                "fabric.save(..., filter=...) with a distributed checkpoint is not supported: a filtered DCP checkpoint"
                " could not be loaded back (pytorch/pytorch#105379). Fix: drop filter, or use"
                " ShardingIntent(checkpoint='full')"
            )
        path = Path(self.broadcast(path))  # type: ignore[attr-defined]
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        if not modules:
            raise ValueError(
                "fabric.save found no model in the state, and a checkpoint without one cannot be loaded back. Fix: put"
                " the model set up with this Fabric in it: fabric.save(path, {'model': model, 'optimizer': optimizer, 'step': step})"
            )
        for module in modules.values():  # the checkpoint holds rank 0's buffers, and so does every rank after it
            sync_buffers(module, self.parallel_mesh)
        options = StateDictOptions(full_state_dict=full, cpu_offload=True)
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                tensors[key] = _filtered(key, filter, get_model_state_dict(obj, options=options))
            elif isinstance(obj, torch.optim.Optimizer):
                tensors[key] = _filtered(key, filter, get_optimizer_state_dict(owner_of(obj, modules, key), obj, options=options))
            else:
                metadata[key] = _filtered(key, filter, obj.state_dict() if _is_stateful(obj) else obj)
        saves.on_rank0(lambda: _refuse_unreadable(metadata), self.global_rank, self.world_size, self.broadcast)  # type: ignore[attr-defined]  # rank 0's is written
        metadata[STATE_KEY] = {
            "version": FORMAT_VERSION,
            "world_size": self.world_size,
            "rng_states": saves.all_gather_object(saves.rng_state()),
            "fabric": {"modules": list(modules), "optimizers": [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]},
        }
        rank, world, broadcast = self.global_rank, self.world_size, self.broadcast  # type: ignore[attr-defined]

        def write(staged: Path, token: str) -> None:
            if full:
                saves.on_rank0(
                    lambda: saves.write_full(lambda f: torch.save({**tensors, **metadata}, f), staged, path, token), rank, world, broadcast
                )
            else:
                saves.write_sharded(tensors, metadata, staged, rank, world, broadcast)

        saves.publish_save(path, write, rank, world, broadcast)

    # -- load ----------------------------------------------------------------------------------------------------
    def load_checkpoint(  # type: ignore[override]
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:  # load_raw (a module alone), or no state: Lightning's own paths
            return ModelParallelStrategy.load_checkpoint(self, path, state, strict=strict, weights_only=weights_only)  # type: ignore[arg-type]
        path = Path(self.broadcast(path))  # type: ignore[attr-defined]
        resolved = Path(saves.on_rank0(lambda: str(_resolve(path)), self.global_rank, self.world_size, self.broadcast))  # type: ignore[arg-type, attr-defined]
        verified = saves.verify_on_every_rank(resolved, self.global_rank, self.world_size)
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        if not modules:
            raise ValueError("fabric.load found no model in the state. Fix: fabric.load(path, {'model': model, 'optimizer': optimizer})")
        trust = weights_only is False
        if resolved.is_dir():
            self._load_shards(resolved, *_loadable(resolved, saved_entries(dcp_entries(resolved)), modules, optimizers, strict), strict)
            metadata = load_torch_file(resolved / LIGHTNING_META, action="load", trust_pickle=trust, untrusted_fix=TRUST_FIX)
        else:
            metadata = self._load_full(resolved, modules, optimizers, strict, trust)
        extra = metadata.pop(STATE_KEY, None)
        if extra is not None:
            said = saves.restore_rng(extra, self.global_rank, self.world_size, "loaded", "random draws")
            if said:
                rank_zero_warn(said)
            if not verified:
                rank_zero_warn(unverified_warning(resolved))
        requested = [k for k in state if k not in modules and k not in optimizers]
        absent = [k for k in requested if k not in metadata]
        if absent and strict:
            raise unmatched_keys_refusal(resolved, absent)
        for key in requested:
            if key in metadata:
                value = metadata.pop(key)
                if _is_stateful(state[key]):
                    state[key].load_state_dict(value)
                else:
                    state[key] = value
        return metadata

    def _load_shards(self, path: Path, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], strict: bool) -> None:
        from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, load
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        holder: dict[str, Any] = {k: get_model_state_dict(m) for k, m in modules.items()}
        owners = {k: owner_of(o, modules, k) for k, o in optimizers.items()}
        holder.update({k: get_optimizer_state_dict(owners[k], o) for k, o in optimizers.items()})
        try:
            load(holder, storage_reader=FileSystemReader(str(path)), planner=DefaultLoadPlanner(allow_partial_load=not strict))
        except CheckpointException as exc:  # a BaseException: it would escape every `except Exception`
            raise _load_failure(path, modules, exc) from None
        for key, module in modules.items():
            set_model_state_dict(module, holder[key], options=StateDictOptions(strict=strict))
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(owners[key], optimizer, optim_state_dict=holder[key], options=StateDictOptions(cpu_offload=True))

    def _load_full(
        self, path: Path, modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], strict: bool, trust: bool
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        loaded = dict(load_torch_file(path, action="load", trust_pickle=trust, untrusted_fix=TRUST_FIX))
        found = [((str(k), str(n)), v) for k, entry in loaded.items() if isinstance(entry, Mapping) for n, v in entry.items()]
        modules, optimizers = _loadable(path, saved_entries(found), modules, optimizers, strict)
        for key, module in modules.items():  # every model checked before any is loaded, as a DCP load is
            saved = {str(n): tuple(t.shape) if isinstance(t, torch.Tensor) else None for n, t in loaded[key].items()}
            refusal = _mismatch_refusal(path, key, module, saved, strict)
            if refusal is not None:
                raise refusal
        options = StateDictOptions(full_state_dict=True, strict=strict)
        for key, module in modules.items():
            set_model_state_dict(module, loaded.pop(key), options=options)
        for key, optimizer in optimizers.items():
            saves.load_full_optimizer_state(owner_of(optimizer, modules, key), optimizer, loaded.pop(key))
        return loaded


def _resolve(path: Path) -> Path:
    """The checkpoint to read: a full file as it is (Fabric's hold their own keys, not Lightning's ``state_dict``),
    else ``resolve_for_load``: an interrupted save's complete copy, the refusals with their fix."""
    if detect_format(path, verify=False).format is Format.FULL:
        return path
    return resolve_for_load(path, "fsdp2")


def _loadable(
    path: Path,
    saved: Mapping[str, Mapping[str, Any]],
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    strict: bool,
) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    """The models and optimizers of the state to load, checked before anything is read. A model that shares no name
    with what the checkpoint holds under its key would load nothing: refused under ``strict``, and with
    ``strict=False`` too when no model of the state shares one (it used to return as if it had loaded), naming the
    key the weights are under; else skipped, with a warning, as ``strict=False`` skips an absent key. An optimizer
    whose key the checkpoint lacks, or whose model is skipped, is refused under ``strict``, else skipped."""
    refusals: dict[str, tuple[str, CheckpointFormatError]] = {}
    for key, module in modules.items():
        model = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        under = saved.get(key, {})
        if not model or set(model) & set(under):
            continue
        name = type(module).__name__
        best = max((k for k in saved if k != key), key=lambda k: (len(set(saved[k]) & set(model)), k == "state_dict"), default=None)
        shared = len(set(saved[best]) & set(model)) if best is not None else 0
        if key not in saved:
            problem = f"it holds nothing under {key!r}, the key this state gives {name}"
        else:
            problem = (
                f"none of the {len(under)} names it holds under {key!r} is a name of this {name} (checkpoint:"
                f" {', '.join(sorted(under)[:3])}, ...; model: {', '.join(sorted(model)[:3])}, ...)"
            )
        quiet = " (strict=False skips the names the two do not share, and they share none, so it would load nothing)"
        if shared:
            trainer = ", as a Lightning Trainer's checkpoint keeps them" if best == "state_dict" else ""
            message = (
                f"cannot load {str(path)!r} into {name}: {problem}; its weights are under {best!r}{trainer} ({shared} of"
                f" the {len(model)} names of {name}){quiet}. Fix: give the model the key its weights are saved under:"
                f" fabric.load(path, {{{best!r}: model}}), other entries under their own keys"
            )
        else:
            held = ", ".join(repr(k) for k in saved) or "no tensors"
            message = (
                f"cannot load {str(path)!r} into {name}: {problem}, and no key of the checkpoint ({held}) holds a name of"
                f" {name}{quiet}. Fix: load a checkpoint of this model, or load these weights into the model that saved them"
            )
        refusals[key] = (problem, CheckpointFormatError(message))
    if refusals and (strict or len(refusals) == len(modules)):
        raise next(iter(refusals.values()))[1]
    for key, (problem, _) in refusals.items():
        rank_zero_warn(f"autoshard: fabric.load(..., strict=False) left {key!r} as it was: {problem}")
    loading = {k: m for k, m in modules.items() if k not in refusals}
    skipped = {id(p) for k in refusals for p in modules[k].parameters()}
    absent = [k for k, o in optimizers.items() if k not in saved or any(id(p) in skipped for g in o.param_groups for p in g["params"])]
    if absent and strict:
        raise unmatched_keys_refusal(path, absent)
    return loading, {k: o for k, o in optimizers.items() if k not in absent}


def _mismatch_refusal(
    path: Path, key: str, module: nn.Module, saved: Mapping[str, tuple[int, ...] | None], strict: bool = True
) -> CheckpointFormatError | None:
    """The refusal of a saved model entry that differs from the model, in both layouts alike (torch's full-state-dict
    load returns normally with names missing, so the names are compared first): missing and unexpected names under
    ``strict``, another shape always; None when it loads."""
    model = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    reshaped = bool(reshaped_names(saved, model))
    mismatch = model_mismatch(saved, model) if strict or reshaped else None
    if not mismatch:
        return None
    other = (
        "a model whose shapes match (strict=False skips missing and unexpected names, never another shape)"
        if reshaped
        else "fabric.load(path, state, strict=False) to load the names both have"
    )
    return CheckpointFormatError(
        f"cannot load {str(path)!r}: its {key!r} weights do not match this {type(module).__name__}: {mismatch}."
        f" Fix: load a checkpoint of this model, or {other}"
    )


def _load_failure(path: Path, modules: Mapping[str, nn.Module], exc: Any) -> CheckpointFormatError:
    """torch's CheckpointException as the names that differ between a saved model entry and the model."""
    for key, module in modules.items():
        refusal = _mismatch_refusal(path, key, module, saved_shapes(path, key))
        if refusal is not None:
            return refusal
    ranks = ", ".join(map(str, sorted(exc.failures)))
    return CheckpointFormatError(
        f"cannot load {str(path)!r}: torch.distributed.checkpoint failed on rank(s) {ranks}: {exc}. Fix: load it with"
        f" the models and optimizers that wrote it, under the same keys"
    )
