"""Checkpoint behaviour shared by autoshard's Lightning strategies: crash-safe saves, format checks on resume, and the
state Lightning leaves out (callback-owned optimizers, per-rank RNG), so a resumed run continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from autoshard.budget import BudgetDecision, stored_differs
from autoshard.checkpoint.formats import BUDGET_KEY, FORMAT_VERSION, LIGHTNING_META, STATE_KEY
from autoshard.checkpoint.publish import remove, sidecar_path, unverified_warning
from autoshard.checkpoint.resume import load_failure, resolve_for_load, weights_only_refusal, weights_refusal
from autoshard.checkpoint.saves import (
    all_gather_object,
    load_full_optimizer_state,
    on_rank0,
    publish_save,
    restore_rng,
    rng_state,
    verify_on_every_rank,
    write_full,
    write_sharded,
)
from autoshard.checkpoint.trust import CheckpointFormatError, UntrustedPickleError, load_torch_file
from autoshard.needs import held_optimizers, returned_optimizers

T = TypeVar("T")


class CheckpointMixin:
    """FSDP2Strategy's save and load on ``checkpoint.saves``: a crash at any instant leaves the previous checkpoint or
    the complete new one, never a partial one; a load checks the path, then every file against the manifest."""

    # Provided by ModelParallelStrategy; declared for readers and type checkers.
    _save_distributed_checkpoint: bool
    global_rank: int
    world_size: int
    budget_decision: BudgetDecision | None  # the run's (engine.base.BackendMixin): saved with every checkpoint

    # -- helpers -------------------------------------------------------------------------------------------------
    def _on_rank0(self, fn: Callable[[], T]) -> T | None:
        return on_rank0(fn, self.global_rank, self.world_size, self.broadcast)  # type: ignore[attr-defined]

    def _callback_optimizers(self) -> list[tuple[str, int, torch.optim.Optimizer]]:
        """(callback state_key, position, optimizer) of the optimizers callbacks own (probes): Lightning saves only
        ``trainer.optimizers``."""
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return []
        trainer_optimizers = {id(o) for o in returned_optimizers(list(trainer.optimizers))}
        owned = {id(p) for p in module.parameters()}
        found = []
        for callback in trainer.callbacks:
            for index, optimizer in enumerate(held_optimizers(callback)):
                if id(optimizer) in trainer_optimizers:
                    continue
                params = [p for group in optimizer.param_groups for p in group["params"]]
                if not all(id(p) in owned for p in params):
                    rank_zero_warn(
                        f"autoshard: {type(callback).__name__}'s optimizer trains parameters outside the LightningModule,"
                        f" so neither they nor its state are checkpointed. Fix: attach the module to the LightningModule"
                        f" (pl_module.probe = ...) or save it in the callback's state_dict()/load_state_dict()"
                    )
                    continue
                found.append((callback.state_key, index, optimizer))
        return found

    def _optimizer_state(self, optimizer: torch.optim.Optimizer, full: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=full, cpu_offload=True)
        return get_optimizer_state_dict(self.model, optimizer, options=options)  # type: ignore[attr-defined]

    # -- save ----------------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: the strategy writes"
                f" the checkpoint itself (crash-safe), not through a CheckpointIO"
            )
        path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
        full = not self._save_distributed_checkpoint
        # save_checkpoint(weights_only=True) leaves optimizers out: callback optimizers too.
        entries = self._callback_optimizers() if "optimizer_states" in checkpoint else []
        extra: dict[str, Any] = {
            "version": FORMAT_VERSION,
            "world_size": self.world_size,
            "rng_states": all_gather_object(rng_state()),
            "callback_optimizers": [{"callback": key, "index": index, "key": f"callback_optimizer_{n}"} for n, (key, index, _) in enumerate(entries)],
        }
        if self.budget_decision is not None:
            extra[BUDGET_KEY] = self.budget_decision.to_dict()
        callback_states = {f"callback_optimizer_{n}": self._optimizer_state(opt, full) for n, (_, _, opt) in enumerate(entries)}
        rank, world = self.global_rank, self.world_size

        def write(staged: Path, token: str) -> None:
            if full:
                extra["callback_optimizer_states"] = callback_states
                checkpoint[STATE_KEY] = extra
                self._on_rank0(lambda: self._write_full(checkpoint, staged, path, token))
            else:
                converted = {"state_dict": checkpoint.pop("state_dict")}
                converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
                converted.update(callback_states)
                checkpoint[STATE_KEY] = extra
                write_sharded(converted, checkpoint, staged, rank, world, self.broadcast)  # type: ignore[attr-defined]

        publish_save(path, write, rank, world, self.broadcast)  # type: ignore[attr-defined]

    def _write_full(self, checkpoint: dict[str, Any], staged: Path, path: Path, token: str) -> None:
        """The file must be complete when this returns (it is hashed next): under AsyncCheckpointIO the write goes
        through the CheckpointIO it wraps (its copy of every tensor would only double rank 0's memory)."""
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        io = self.checkpoint_io  # type: ignore[attr-defined]
        if isinstance(io, AsyncCheckpointIO):
            if not getattr(self, "_autoshard_async_said", False):
                rank_zero_warn(
                    "autoshard: AsyncCheckpointIO: the crash-safe full-file save hashes and renames the file once it is"
                    " complete, so it writes through the wrapped CheckpointIO before returning (synchronously)"
                )
                self._autoshard_async_said = True
            io = io.checkpoint_io
        write_full(lambda f: io.save_checkpoint(checkpoint, f), staged, path, token)

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k rotation removes a checkpoint; a single file's manifest beside it goes too."""
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self.global_rank == 0:
            remove(sidecar_path(filepath))

    # -- load ----------------------------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        resolved = Path(self._on_rank0(lambda: str(resolve_for_load(path, "fsdp2"))))  # type: ignore[arg-type]
        verified = verify_on_every_rank(resolved, self.global_rank, self.world_size)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # type: ignore[attr-defined]
        if resolved.is_file():
            metadata = self._load_full(resolved, weights_only, fitting)
        else:
            if fitting:
                self._on_rank0(lambda: _refuse_weights_only(resolved, _meta_keys(resolved, weights_only)))
            metadata = self._load_sharded(resolved, weights_only)
        extra = metadata.pop(STATE_KEY, None)
        if extra is not None:
            self._restore_extra(extra, resolved)
            if not verified:
                rank_zero_warn(unverified_warning(resolved))
        else:
            unchecked = "; it has no manifest either, so its files are not checked for corruption" if not verified else ""
            rank_zero_warn(
                f"autoshard: {str(resolved)!r} was not written by autoshard: callback optimizers and RNG states are not"
                f" in it, so probes restart their optimizer state and random augmentations differ from an uninterrupted"
                f" run{unchecked}"
            )
        return metadata

    def _load_sharded(self, resolved: Path, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's DCP load, its failure in autoshard's words."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        try:
            return super().load_checkpoint(resolved, weights_only=weights_only)  # type: ignore[misc, no-any-return]
        except CheckpointException as exc:  # a BaseException: it would escape every `except Exception`
            wanted = get_model_state_dict(self.model)  # type: ignore[attr-defined]  # the names Lightning asked DCP for
            shapes = {name: tuple(t.shape) for name, t in wanted.items()}
            raise load_failure(resolved, type(self.lightning_module).__name__, shapes, exc.failures) from None  # type: ignore[attr-defined]

    def _load_full(self, path: Path, weights_only: bool | None, fitting: bool) -> dict[str, Any]:
        """Lightning's full-file load (every rank maps the file; rank 0's values are broadcast), with the checks a DCP
        load has: a weights-only save refused for a fit, the model's names compared before anything is loaded. Its
        optimizer load is autoshard's: Lightning's reads the first entry of each optimizer's state, which a run
        whose optimizer keeps none (plain SGD) lacks (IndexError on resume)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)  # as Lightning loads it
        if fitting:
            _refuse_weights_only(path, checkpoint)
        module = self.lightning_module  # type: ignore[attr-defined]
        strict = module.strict_loading
        model = {name: tuple(t.shape) for name, t in get_model_state_dict(self.model).items()}  # type: ignore[attr-defined]
        weights = checkpoint.pop("state_dict")
        saved = {name: tuple(t.shape) if isinstance(t, torch.Tensor) else None for name, t in weights.items()}
        refusal = weights_refusal(path, type(module).__name__, saved, model, strict)
        if refusal is not None:
            raise refusal
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        set_model_state_dict(self.model, {k: v for k, v in weights.items() if k in model}, options=options)  # type: ignore[attr-defined]
        states = checkpoint.get("optimizer_states", [])
        optimizers = self.optimizers  # type: ignore[attr-defined]
        if len(states) < len(optimizers):
            raise CheckpointFormatError(
                f"cannot resume from {str(path)!r}: it holds the state of {len(states)} optimizer(s), and"
                f" configure_optimizers returned {len(optimizers)}. Fix: resume with the LightningModule and the"
                f" optimizers (configure_optimizers) that wrote this checkpoint"
            )
        for optimizer, state in zip(optimizers, states):
            if any(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):  # saved by position
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, self.model)  # type: ignore[attr-defined]
            load_full_optimizer_state(self.model, optimizer, state, broadcast_from_rank0=True)  # type: ignore[attr-defined]
        return checkpoint  # optimizer_states stays: Lightning checks it is there

    def _restore_extra(self, extra: dict[str, Any], path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        current = {(key, index): opt for key, index, opt in self._callback_optimizers()}
        saved = {(e["callback"], e["index"]): e["key"] for e in extra.get("callback_optimizers", [])}
        for missing in sorted(set(current) - set(saved)):
            rank_zero_warn(f"autoshard: the checkpoint has no state for {missing[0]}'s optimizer #{missing[1]}: it starts fresh")
        states = extra.get("callback_optimizer_states")
        for ident, optimizer in current.items():
            if ident not in saved:
                continue
            key = saved[ident]
            if states is not None:  # full file: the state is in the file every rank loaded; rank 0's copy is used
                load_full_optimizer_state(self.model, optimizer, states[key], broadcast_from_rank0=True)  # type: ignore[attr-defined]
                continue
            from torch.distributed.checkpoint import FileSystemReader, load

            holder = {key: self._optimizer_state(optimizer, full=False)}
            load(holder, storage_reader=FileSystemReader(str(path)))
            options = StateDictOptions(cpu_offload=True)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=holder[key], options=options)  # type: ignore[attr-defined]
        said = stored_differs(extra.get(BUDGET_KEY), self.budget_decision)
        if said:
            rank_zero_warn(said)
        said = restore_rng(extra, self.global_rank, self.world_size, "resumed", "random augmentations")
        if said:
            rank_zero_warn(said)


def _meta_keys(path: Path, weights_only: bool | None) -> list[str]:
    """The top-level keys of a DCP checkpoint's meta.pt (none when only a trusted load could read it: Lightning's own
    load judges that file, as it always did)."""
    try:
        return list(load_torch_file(path / LIGHTNING_META, action="resume", trust_pickle=weights_only is False))
    except UntrustedPickleError:
        return []


def _refuse_weights_only(path: Path, keys: Any) -> None:
    refusal = weights_only_refusal(path, [str(k) for k in keys])
    if refusal is not None:
        raise refusal
