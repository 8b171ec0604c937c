"""Lightning strategies "fsdp2" and "auto-shard": ModelParallelStrategy that shards any LightningModule itself."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from autoshard.adapters.fsdp2 import FSDP2Plan, is_sharded, per_shard_random_init, sync_buffers, to_device_keeping_offloaded
from autoshard.batchnorm import convert_sync_batchnorm
from autoshard.checkpoint.saves import all_gather_object
from autoshard.engine.auto_shard import FSDP2
from autoshard.engine.fsdp2 import FSDP2Checks
from autoshard.engine.guarantees import ExplainMixedDTensor, track_forwards
from autoshard.engine.meta_init import check_meta_init, configure_model_counted_as_overridden
from autoshard.engine.sharding import after_materialize, shard_module, unwrap_user_compile
from autoshard.errors import IntentError
from autoshard.init_from import InitReport
from autoshard.lightning.base import TrainerBackend
from autoshard.lightning.budget import decide_for_fit
from autoshard.lightning.checkpoint import CheckpointMixin
from autoshard.needs import inspect_needs, recount_optimizers
from autoshard.privates import Private, in_lightning, missing

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from autoshard.budget import BudgetDecision


class FSDP2Strategy(TrainerBackend, FSDP2Checks, ExplainMixedDTensor, CheckpointMixin, ModelParallelStrategy):
    """``strategy="fsdp2"``: pure FSDP by default (dp = world size, tp = 1), sharding at setup, no module change.

    ``device_mesh`` is Lightning's ``("data_parallel", "tensor_parallel")`` DeviceMesh, built with the dims resolved
    when the Trainer was built; ``parallel_mesh`` holds the views the plan takes of it. ``parallelize_fn(module,
    device_mesh)`` replaces the generic plan.
    """

    strategy_name = "fsdp2"
    hooked_by = "fsdp2 strategies hook"
    mixed_precision = MixedPrecision
    plan: FSDP2Plan | None = None
    init_report: InitReport | None = None  # what this rank read for ShardingIntent(init_from=...)

    def _lightning_gone(self) -> list[Private]:
        return missing(in_lightning.TRAINER, ModelParallelStrategy)

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        # No user hook is called to inspect the method (stable-pretraining's probes assert configure_optimizers runs
        # once): fsdp2 runs any number of optimizers, so the sharding is decided without counting them, and they
        # are counted from Lightning's own call below, for the printed decision.
        unwrap_user_compile(module)  # before the needs: EMA pairs, the plan and checkpoints see the eager names
        self.needs = inspect_needs(module, trainer, call_hooks=False)
        self.decision = self._decide(self.needs)
        run = self._decide_run(trainer, lambda: self._decide_budget(module, trainer))  # the plan below takes the budget's fields
        init = self._plan_init_from(module, self.needs)  # names missing, unexpected and reshaped weights before anything is sharded
        on_meta = check_meta_init(module, init.covered if init is not None else frozenset())
        already_sharded = is_sharded(module)
        sharded_by = None
        if already_sharded:
            if run.intent.shard_size is not None:
                raise IntentError(
                    f"shard_size={run.intent.shard_size!r} applies to autoshard's own plan, but your configure_model"
                    f" already sharded the modules, so it would be ignored. Fix: drop shard_size and pass"
                    f" mesh=init_device_mesh(device, (replicas, shard_size)) to your fully_shard calls, or let"
                    f" autoshard shard (remove fully_shard from configure_model)"
                )
            sharded_by = "autoshard: modules already sharded (your configure_model); the generic plan is skipped"
        elif self.parallelize_fn is not None:
            self.parallelize_fn(module, self.device_mesh)
            sharded_by = "autoshard: sharded by your parallelize_fn; the generic plan is skipped"
        self.plan = shard_module(
            module,
            self._mesh(),
            run.intent,
            self.needs,
            run.precision,
            sharded_by=sharded_by,
            node_ranks=lambda: all_gather_object(self.node_rank),
            sync_batchnorm=self._layer_sync is not None,
        )
        self._forwarded = track_forwards(module)
        if self._layer_sync is not None:  # Trainer(sync_batchnorm=True); ModelParallelStrategy ignores it
            convert_sync_batchnorm(module, self._mesh().dp.get_group())
        with configure_model_counted_as_overridden(module), per_shard_random_init(self.device_mesh), warnings.catch_warnings():
            if init is not None:  # modules without reset_parameters() passed check_meta_init: init_from fills them
                warnings.filterwarnings("ignore", message="Parameter initialization incomplete")
            super().setup(trainer)  # materializes meta shards locally through reset_parameters()
        if trainer.state.fn == TrainerFn.FITTING:  # Lightning's single configure_optimizers call has run
            self.needs = recount_optimizers(self.needs, module, self.optimizers, trainer)
            self.decision = self._decide(self.needs)
        self.report_decision(self.decision)
        # Lightning's setup replaced parameters (meta materialization) or swapped their contents (Module.to on a
        # DTensor): the gradient hooks follow what the module holds now; then init_from, teachers, broadcasts, lazy init.
        self.init_report = after_materialize(module, self._mesh(), init, on_meta, self.needs.ema_pairs)

    def model_to_device(self) -> None:
        """Lightning moves the whole module to the device after materializing it; with ``offload='params'`` the
        shards stay on the host (FSDP2 refuses them on the device: measured on an H200)."""
        if self.intent.offload == "none" or self.model is None:
            super().model_to_device()
            return
        to_device_keeping_offloaded(self.model, self.root_device)

    def _decide_budget(self, module: torch.nn.Module, trainer: pl.Trainer) -> BudgetDecision:
        """ShardingIntent(memory_budget=...) decided on rank 0 and broadcast (``autoshard.lightning.budget``); the run
        takes the chosen fields. shard_size stays as set: the mesh was built with it, when the Trainer was."""
        other = "your parallelize_fn replaces it" if self.parallelize_fn is not None else ""
        other = other or ("your configure_model already sharded the modules" if is_sharded(module) else "")
        if other:
            raise IntentError(
                f"memory_budget chooses the settings of autoshard's own sharding plan (activation checkpointing,"
                f" resharding, offload), and {other}, so the decision would be ignored; nothing was sharded. Fix: drop"
                f" memory_budget and set what your own sharding needs yourself (autoshard explain --budget shows each"
                f" configuration's peak), or let autoshard shard (no parallelize_fn, no fully_shard in configure_model)"
            )
        asked = self.requested.replace(pinned=tuple(dict.fromkeys((*self.requested.pinned, "shard_size"))))
        return decide_for_fit(self, trainer, asked, FSDP2)

    # -- Buffers: rank 0's copy wins (BUFFER_RULE in autoshard.adapters.fsdp2; DDP's broadcast_buffers=True) --------
    def _sync_buffers(self) -> None:
        assert self.lightning_module is not None
        sync_buffers(self.lightning_module, self._mesh())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._sync_buffers()
        super().on_train_batch_start(batch, batch_idx)

    def on_validation_start(self) -> None:
        self._sync_buffers()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self._sync_buffers()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_buffers()  # the checkpoint holds rank 0's buffers, and so does every rank after it
        return super().lightning_module_state_dict()


class AutoShardStrategy(FSDP2Strategy):
    """``strategy="auto-shard"`` on fsdp2, checked again against the module at setup; built directly, it refuses an
    intent only DeepSpeed runs (the factory ``autoshard.lightning.auto_shard`` builds that one instead). Precision
    takes no part in the choice: the Trainer's is not known at construction."""

    strategy_name = "auto-shard"
    prefer = "auto"
    auto_shard_words = (
        "AutoShardStrategy",
        "autoshard.lightning.auto_shard(...) and the same arguments (what Trainer(strategy='auto-shard') calls),",
        "autoshard's DeepSpeed strategy for this intent; in a LightningCLI config use class_path:"
        " autoshard.lightning.deepspeed.AutoShardDeepSpeedStrategy",
    )
