"""Checkpoint behaviour shared by autoshard's Lightning strategies: crash-safe saves, format checks on resume, and the
state Lightning leaves out (callback-owned optimizers, per-rank RNG), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from autoshard import deepspeed_files
from autoshard.budget import BudgetDecision, stored_differs
from autoshard.capability import Format
from autoshard.checkpoint import (
    LIGHTNING_META,
    check_replaceable,
    detect_format,
    load_failure,
    load_torch_file,
    resolve_for_load,
)
from autoshard.checkpoint_io import (
    KIND_SAVE,
    MANIFEST,
    Publisher,
    describe_files,
    fsync_dir,
    fsync_file,
    remove,
    sidecar_path,
    stage_sidecar,
    staging_path,
    unverified_warning,
    write_manifest,
    writer_token,
)
from autoshard.engine.ranks import all_gather_object, begin_save, hash_on_every_rank, on_rank0, verify_on_every_rank
from autoshard.needs import held_optimizers, returned_optimizers

STATE_KEY = "autoshard"  # our entry in Lightning's checkpoint dict (meta.pt for DCP, the file itself for full)
FORMAT_VERSION = 1
BUDGET_KEY = "budget_decision"  # in our entry: ShardingIntent(memory_budget=...)'s decision (BudgetDecision.to_dict())
T = TypeVar("T")


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


def stored_budget_decision(path: Any, trust_pickle: bool = False) -> dict[str, Any] | None:
    """The memory-budget decision a checkpoint holds (``BudgetDecision.to_dict()``), None when it holds none, read
    before anything is sharded and cheaply: a DCP directory's meta.pt (the trainer state, no tensor of the model), a
    full file memory-mapped, a DeepSpeed tag's rank-0 model states (``client_state``, where Lightning's DeepSpeed
    saves put the checkpoint dict). A path that is none of these is left to the load, which refuses it in words.
    ``trust_pickle``: the fit's ``weights_only=False`` (the user trusts the file)."""
    info = detect_format(path, verify=False)
    if info.format is Format.DCP:
        file = info.path / LIGHTNING_META
    elif info.format is Format.FULL:
        file = info.path
    elif info.format is Format.DEEPSPEED and info.tag is not None:
        file = info.path / info.tag / deepspeed_files.model_states_name(0)
        if not file.is_file():
            return None
    else:
        return None
    loaded = load_torch_file(file, action="resume", trust_pickle=trust_pickle)
    extra = loaded.get(STATE_KEY) if isinstance(loaded, Mapping) else None
    stored = extra.get(BUDGET_KEY) if isinstance(extra, Mapping) else None
    return dict(stored) if isinstance(stored, Mapping) else None


def _recording_writer(path: Path) -> Any:
    """DCP's FileSystemWriter that remembers (``.written``) the files this rank wrote, so this rank hashes exactly
    those. Built on first use: importing torch.distributed.checkpoint costs every ``import autoshard`` otherwise."""
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        written: tuple[str, ...] = ()

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            self.written = tuple(sorted({result.storage_data.relative_path for result in future.wait()}))
            return future

    return RecordingWriter(str(path), sync_files=True)


class CheckpointMixin:
    """Mixed in before ModelParallelStrategy in FSDP2Strategy; overrides save_checkpoint / load_checkpoint.

    Save: every rank writes into a hidden staging sibling; rank 0 swaps it in only after all ranks finished, so a
    crash at any instant leaves the previous checkpoint (or the complete new one) and never a partial one under the
    final name. The staging holds a manifest (size + sha256 of every file) before it counts as complete.
    Load: the path is checked before anything is read, with the fix for a wrong format, then every file against the
    manifest.
    """

    # Provided by ModelParallelStrategy; declared for readers and type checkers.
    _save_distributed_checkpoint: bool
    global_rank: int
    world_size: int
    budget_decision: BudgetDecision | None = None  # ShardingIntent(memory_budget=...)'s, made at setup: saved with every checkpoint

    # -- helpers -------------------------------------------------------------------------------------------------
    def _on_rank0(self, fn: Callable[[], T]) -> T | None:
        return on_rank0(fn, self.global_rank, self.world_size, self.broadcast)  # type: ignore[attr-defined]

    def _all_gather(self, obj: Any) -> list[Any]:
        return all_gather_object(obj)

    def _callback_optimizers(self) -> list[tuple[str, int, torch.optim.Optimizer]]:
        """(callback state_key, position, optimizer) for optimizers callbacks own (probes), in callback order.

        Lightning saves only ``trainer.optimizers``; these would restart from scratch on resume.
        """
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
            "rng_states": self._all_gather(rng_state()),
            "callback_optimizers": [{"callback": key, "index": index, "key": f"callback_optimizer_{n}"} for n, (key, index, _) in enumerate(entries)],
        }
        if self.budget_decision is not None:
            extra[BUDGET_KEY] = self.budget_decision.to_dict()
        callback_states = {f"callback_optimizer_{n}": self._optimizer_state(opt, full) for n, (_, _, opt) in enumerate(entries)}
        # The publish protocol (checkpoint_io): rank 0 holds the lock from here to the rename; every rank writes
        # under rank 0's staging name, unique to this save.
        token = self.broadcast(writer_token())  # type: ignore[attr-defined]
        staged = staging_path(path, token)
        held: list[Publisher] = []
        try:
            self._on_rank0(lambda: begin_save(path, token, held))
            if full:
                extra["callback_optimizer_states"] = callback_states
                checkpoint[STATE_KEY] = extra
                self._on_rank0(lambda: self._write_full(checkpoint, staged, path, token))
            else:
                converted = {"state_dict": checkpoint.pop("state_dict")}
                converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
                converted.update(callback_states)
                self._on_rank0(lambda: staged.mkdir(parents=True))
                shards = hash_on_every_rank(staged, self._write_shards(converted, staged), self.global_rank)
                checkpoint[STATE_KEY] = extra
                self._on_rank0(lambda: self._write_meta(checkpoint, staged, shards))
            self._on_rank0(lambda: held[0].publish(check_replaceable))
        finally:
            for publisher in held:  # a failed save's staging stays for the next save to clear (it may be complete)
                publisher.release()

    def _write_shards(self, state: dict[str, Any], staged: Path) -> list[str]:
        """Every rank writes its shards; DCP writes .metadata last, once all ranks' files are synced.

        Returns the files this rank wrote, relative to ``staged``."""
        from torch.distributed.checkpoint import save

        writer = _recording_writer(staged)
        save(state, storage_writer=writer)
        return list(writer.written)

    def _write_meta(self, checkpoint: dict[str, Any], staged: Path, shards: dict[str, Any]) -> None:
        """meta.pt, then the manifest of every file, then meta.pt's rename: its presence marks the staging complete,
        so a complete staging always has its manifest."""
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

    def _write_full(self, checkpoint: dict[str, Any], staged: Path, path: Path, token: str) -> None:
        """The file, then its manifest, both staged; ``commit`` swaps in the file, then the manifest.

        The file must be complete when this returns (it is hashed and renamed next): Lightning's AsyncCheckpointIO
        returns before writing, so the write goes through the CheckpointIO it wraps, in this thread. Its copy of
        every tensor (made so that training can go on while a thread writes) would only double rank 0's memory."""
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
        io.save_checkpoint(checkpoint, staged)
        fsync_file(staged)
        stage_sidecar(path, token, KIND_SAVE)

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k rotation removes a checkpoint; a single file's manifest beside it goes too."""
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self.global_rank == 0:
            remove(sidecar_path(filepath))

    # -- load ----------------------------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        resolved = Path(self._on_rank0(lambda: str(resolve_for_load(path, "fsdp2"))))  # type: ignore[arg-type]
        verified = verify_on_every_rank(resolved, self.global_rank, self.world_size)
        try:
            metadata = super().load_checkpoint(resolved, weights_only=weights_only)  # type: ignore[misc]
        except CheckpointException as exc:  # a BaseException: it would escape every `except Exception`
            wanted = get_model_state_dict(self.model)  # type: ignore[attr-defined]  # the names Lightning asked DCP for
            shapes = {name: tuple(t.shape) for name, t in wanted.items()}
            raise load_failure(resolved, type(self.lightning_module).__name__, shapes, exc.failures) from None  # type: ignore[attr-defined]
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
                options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                state = states[key]
            else:
                from torch.distributed.checkpoint import FileSystemReader, load

                holder = {key: self._optimizer_state(optimizer, full=False)}
                load(holder, storage_reader=FileSystemReader(str(path)))
                options, state = StateDictOptions(cpu_offload=True), holder[key]
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)  # type: ignore[attr-defined]
        said = stored_differs(extra.get(BUDGET_KEY), self.budget_decision)
        if said:
            rank_zero_warn(said)
        rng = extra.get("rng_states") or []
        if extra.get("world_size") == self.world_size and len(rng) == self.world_size:
            set_rng_state(rng[self.global_rank])
        else:
            rank_zero_warn(
                f"autoshard: saved at world size {extra.get('world_size')}, resumed at {self.world_size}: model and optimizer"
                f" states are resharded exactly, but per-rank RNG states cannot be mapped, so random augmentations differ"
                f" from an uninterrupted run"
            )
