"""DeepSpeed under Lightning: "autoshard-deepspeed" (ZeRO-3 from a ShardingIntent) and guarded Lightning names.

Both refuse what DeepSpeed cannot train (several optimizers, an EMA teacher under ZeRO-3) before the engine
exists, with the backend that works, instead of Lightning's opaque error or a silent mis-training. Importing this
module does not import deepspeed; constructing a strategy does.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from autoshard.adapters.checkpointing import checkpoint_blocks, describe_checkpointing
from autoshard.adapters.deepspeed import deepspeed_config
from autoshard.backends import deepspeed as deepspeed_backend
from autoshard.budget import stored_differs
from autoshard.checkpoint.formats import BUDGET_KEY, STATE_KEY
from autoshard.checkpoint.publish import unverified_warning
from autoshard.checkpoint.resume import resolve_for_load
from autoshard.checkpoint.saves import publish_deepspeed_save, verify_on_every_rank
from autoshard.checkpoint.trust import WEIGHTS_ONLY_REFUSAL, untrusted, weights_only_loads
from autoshard.engine.deepspeed import (
    DeepSpeedRuntime,
    IntentZeRO3,
    cpu_accelerator_refusal,
    deepspeed_accelerator,
    require_deepspeed,
    zero_dim_parameters,
)
from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.install_record import register_strategy
from autoshard.intent import ShardingIntent
from autoshard.lightning.base import TrainerBackend
from autoshard.lightning.budget import decide_for_fit
from autoshard.needs import inspect_needs, returned_optimizers
from autoshard.precision import PRECISIONS, PrecisionPlan
from autoshard.privates import in_lightning, missing
from autoshard.privates.in_lightning import lightning_lacks
from autoshard.select import Decision

if TYPE_CHECKING:
    import lightning.pytorch as pl

BACKEND = deepspeed_backend.BACKEND.name  # "deepspeed_zero3"

# Lightning's own DeepSpeed names, re-registered to GuardedDeepSpeedStrategy with the init params Lightning gave them.
LIGHTNING_DEEPSPEED_NAMES: tuple[str, ...] = (
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
    "deepspeed_stage_3_offload_nvme",
)


def _lightning_batch_size(strategy: DeepSpeedStrategy) -> int:
    """The train DataLoader's batch_sampler.batch_size, else 1 (Lightning's rule, so both strategies agree)."""
    return int(strategy._auto_select_batch_size())


def _lightning_init_distributed(strategy: DeepSpeedStrategy) -> None:
    strategy._init_deepspeed_distributed()


def _lightning_layer_sync(strategy: DeepSpeedStrategy) -> Any:
    """What Trainer(sync_batchnorm=True) set (Lightning's connector); DeepSpeedStrategy itself never applies it."""
    return strategy._layer_sync


# DeepSpeed sends every parameter as bytes, ``dist.broadcast(p.data.view(torch.uint8), ...)``: in the engine
# (``DeepSpeedEngine._broadcast_model``, every stage) and in zero.Init (``Init._zero_init_param``). torch cannot view
# a 0-dim tensor with another element size, so a 0-dim parameter fails with this text (deepspeed 0.19.8).
_ZERO_DIM_ERROR = "cannot be 0 to view"
_ZERO_DIM_FIX = (
    "use strategy='fsdp2' (it keeps 0-dim parameters whole on every rank), or give the parameter shape (1,):"
    " nn.Parameter(torch.ones(1)) instead of nn.Parameter(torch.tensor(1.0))"
)


def _zero_dim_refusal(where: str, label: str) -> IncompatibleBackendError:
    return IncompatibleBackendError(
        f"{where} cannot train under {label}: DeepSpeed sends every parameter as bytes"
        f" (dist.broadcast(p.data.view(torch.uint8))) when it builds the engine or partitions under zero.Init, and"
        f" torch cannot view a 0-dim tensor that way ('self.dim() cannot be 0 to view Float as Byte'); refused"
        f" before the engine is built. Backend that works: fsdp2 (strategy='fsdp2'). Fix: {_ZERO_DIM_FIX}"
    )


def sync_batchnorm(module: torch.nn.Module) -> int:
    """``Trainer(sync_batchnorm=True)`` under DeepSpeed: ZeRO is data parallel over the whole world, so every BatchNorm
    syncs over the default group; converted in place before the engine is built. Returns how many."""
    from autoshard.batchnorm import convert_sync_batchnorm

    return convert_sync_batchnorm(module, None)


class _LightningConfigHook(DeepSpeedStrategy):
    """Holds the private overrides, so subclasses never name a private Lightning member themselves."""

    def _format_config(self) -> None:  # private Lightning hook: autoshard.privates.in_lightning
        if not self._autoshard_format_config():
            super()._format_config()

    def _autoshard_format_config(self) -> bool:
        """Return True when the config was produced here; False leaves Lightning's own formatting in place."""
        return False

    def _init_optimizers(self) -> Any:  # private Lightning hook: autoshard.privates.in_lightning
        module = self.lightning_module
        assert module is not None
        error: Exception | None = None
        with _returned_by(module, "configure_optimizers") as returned:
            try:
                chosen = super()._init_optimizers()
            except Exception as exc:  # e.g. Lightning's "single optimizer": autoshard's refusal, if any, says more
                error = exc
        if returned:
            self._autoshard_optimizers_returned(returned[0])
        if error is not None:
            raise error
        return chosen

    def _autoshard_optimizers_returned(self, configured: Any) -> None:
        """Called with what Lightning's single configure_optimizers call returned, before deepspeed.initialize."""


@contextmanager
def _returned_by(module: torch.nn.Module, hook: str) -> Iterator[list[Any]]:
    """Record what Lightning's own call of ``module.<hook>()`` returns (a temporary instance attribute wraps it), so
    the hook still runs once, called by Lightning."""
    had = hook in vars(module)
    current = getattr(module, hook)
    returned: list[Any] = []

    def observed(*args: Any, **kwargs: Any) -> Any:
        result = current(*args, **kwargs)
        returned.append(result)
        return result

    module.__dict__[hook] = observed
    try:
        yield returned
    finally:
        if vars(module).get(hook) is observed:
            if had:
                module.__dict__[hook] = current
            else:
                del module.__dict__[hook]


def _attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # "... is not attached to a `Trainer`"
        return None


class GuardedDeepSpeedStrategy(TrainerBackend, DeepSpeedRuntime, _LightningConfigHook):
    """Lightning's DeepSpeedStrategy, registered under Lightning's own names, plus autoshard's refusal at setup and a
    CPU (gloo) path. Stages 1-2 do not partition parameters: there only several optimizers are refused."""

    prefer = BACKEND

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        gone = missing(in_lightning.TRAINER, DeepSpeedStrategy)
        if gone:  # Lightning would never call autoshard's overrides: the provisional config and no refusal
            raise lightning_lacks(gone, "DeepSpeed strategies hook", f" Backend that works: fsdp2 ({self.front.strategy('fsdp2')}).")
        require_deepspeed()
        super().__init__(*args, **kwargs)

    writes_manifest = False  # Lightning's own DeepSpeed saves (these names) record none: no warning when it is missing

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Refuse another backend's checkpoint, a stale 'latest', partitions of another world size and files that
        differ from the manifest, before DeepSpeed reads anything."""
        if not (self.load_full_weights and self.zero_stage_3):
            checkpoint_path = resolve_for_load(checkpoint_path, BACKEND, world_size=self.world_size)
            verified = verify_on_every_rank(Path(checkpoint_path), self.global_rank, self.world_size)
            if not verified and self.writes_manifest:
                rank_zero_warn(unverified_warning(checkpoint_path))
        # DeepSpeed reads every file with torch.load(weights_only=False): weights-only here, so a crafted file runs no
        # code, unless fit(weights_only=False) says the user trusts it.
        try:
            with weights_only_loads(trust_pickle=weights_only is False):
                return super().load_checkpoint(checkpoint_path, weights_only)
        except pickle.UnpicklingError as exc:
            if WEIGHTS_ONLY_REFUSAL not in str(exc):
                raise
            wanted = re.findall(r"GLOBAL ([\w.]+)", str(exc)) or ["a type outside autoshard.checkpoint.TRUSTED_TYPES"]
            raise untrusted(
                Path(checkpoint_path),
                wanted,
                "resume",
                fix=f"if you trust who wrote it (your own run), resume with trainer.fit(model, ckpt_path={str(checkpoint_path)!r},"
                f" weights_only=False), which unpickles it as DeepSpeed does",
            ) from None

    # -- what to check --------------------------------------------------------------------------------------------
    @property
    def zero_stage(self) -> int:
        zero = (self.config or {}).get("zero_optimization") or {}
        return int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0

    def _label(self) -> str:
        return f"DeepSpeed ZeRO stage {self.zero_stage} ({type(self).__name__})"

    def _resolve_precision(self) -> PrecisionPlan | None:
        """A Trainer precision autoshard cannot plan for is refused, never replaced by the default (the method would be
        checked against a precision the run does not use)."""
        try:
            return super()._resolve_precision()
        except IntentError as err:
            plugin = type(self.precision_plugin).__name__
            raise IntentError(
                f"{self._label()} cannot run precision {self.precision_plugin.precision!r} (from the Trainer's {plugin}):"
                f" autoshard checks every DeepSpeed run against the capability matrix for its precision, and knows only"
                f" {', '.join(PRECISIONS)}. Fix: drop the {plugin} plugin and set Trainer(precision='bf16-mixed') (or"
                f" another listed precision)"
            ) from err

    def _intent_to_check(self) -> ShardingIntent:
        return ShardingIntent()

    def check_method(self, trainer: pl.Trainer, optimizers: Sequence[Any] | None = None) -> Decision:
        """The method's needs against the matrix, then its 0-dim parameters, before any engine exists; ``optimizers``:
        what Lightning's own configure_optimizers call returned."""
        module = self.lightning_module
        assert module is not None, "check_method needs the LightningModule connected (Trainer.fit does that)"
        needs = inspect_needs(module, trainer, optimizers=optimizers, call_hooks=False)
        if self.zero_stage != 3:
            # Stages 1-2 keep whole parameters on every rank: EMA is safe there, and several forwards lose no prefetch.
            needs = dataclasses.replace(needs, ema_pairs=(), multi_forward=False)
        decision = self._select_before_engine(needs, type(module).__name__)
        self.needs, self.decision = needs, decision
        # After the matrix's refusals: an EMA teacher says more, and its fix (fsdp2) solves this too.
        zero_dim = zero_dim_parameters(module)
        if zero_dim:  # every rank sees the same module: every rank refuses, none waits in a collective
            names = ", ".join(repr(n) for n in zero_dim)
            raise _zero_dim_refusal(f"{type(module).__name__} has 0-dim parameter(s) {names}, so it", self._label())
        return decision

    # -- Lightning hooks --------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        accelerator = deepspeed_accelerator()
        if not self._on_cpu():
            if accelerator == "cpu":  # its engine would keep the model on the CPU and broadcast it on the nccl group
                raise IncompatibleBackendError(
                    f"Trainer(accelerator='{self.parallel_devices[0].type if self.parallel_devices else 'gpu'}') with DeepSpeed, but"
                    f" DeepSpeed's accelerator is 'cpu' (DS_ACCELERATOR=cpu in this process's environment): its engine"
                    f" would place the model on the CPU and fail in its first broadcast on the GPU process group."
                    f" Fix: unset DS_ACCELERATOR before Python starts (DeepSpeed then picks CUDA), or Trainer(accelerator='cpu')"
                )
            super().setup_environment()  # Lightning's CUDA path, unchanged
            return
        if accelerator != "cpu":
            raise cpu_accelerator_refusal(accelerator, self.front)
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's override only adds the CUDA-only refusal

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            super().setup_distributed()
            return
        # Lightning checks device indices against local ranks; CPU devices have none, and nothing to select.
        reset_seed()
        self.set_world_ranks()
        _lightning_init_distributed(self)

    def setup(self, trainer: pl.Trainer) -> None:
        if _lightning_layer_sync(self) is not None and trainer.training and self.world_size > 1:
            # Lightning's DeepSpeedStrategy ignores Trainer(sync_batchnorm=True); its teardown reverts it, as under DDP.
            assert self.lightning_module is not None
            count = sync_batchnorm(self.lightning_module)
            rank_zero_info(f"autoshard: sync_batchnorm=True: {count} BatchNorm layer(s) normalize with the global batch")
        # Checked once all of it is known: when fitting, after Lightning's configure_optimizers call (in
        # _init_optimizers), so that probe optimizers appended there count; otherwise here.
        if not self._lightning_calls_configure_optimizers(trainer):
            self.report_decision(self.check_method(trainer))
        self._before_config(trainer)
        super().setup(trainer)

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """Lightning's zero.Init context for configure_model, with DeepSpeed's 0-dim failure said in full."""
        self._before_config(_attached_trainer(self.lightning_module))
        try:
            with super().model_sharded_context():
                yield
        except RuntimeError as exc:
            if _ZERO_DIM_ERROR not in str(exc):
                raise
            where = "A 0-dim parameter built in configure_model under ZeRO-3's zero.Init (its name is not known yet)"
            raise _zero_dim_refusal(where, self._label()) from exc

    def _before_config(self, trainer: pl.Trainer | None) -> None:
        """Called before each of the two hooks in which Lightning formats the config (once, in whichever runs first)."""

    def _lightning_calls_configure_optimizers(self, trainer: pl.Trainer) -> bool:
        """Lightning calls it right before the engine when training, unless the DeepSpeed config names an optimizer."""
        return bool(trainer.training) and "optimizer" not in (self.config or {})

    def _autoshard_optimizers_returned(self, configured: Any) -> None:
        module = self.lightning_module
        assert module is not None
        self.report_decision(self.check_method(module.trainer, returned_optimizers(configured)))


# Lightning DeepSpeedStrategy arguments that shape the config: autoshard builds the config from the intent instead.
_CONFIG_ARGUMENTS: dict[str, str] = {
    "config": "pass a ShardingIntent; for a hand-written config use lightning's DeepSpeedStrategy(config=...)",
    "zero_optimization": "autoshard-deepspeed always uses ZeRO-3",
    "stage": "autoshard-deepspeed always uses ZeRO-3; for stage 1 or 2 use strategy='deepspeed_stage_2'",
    "offload_optimizer": "set ShardingIntent(offload='optimizer')",
    "offload_parameters": "set ShardingIntent(offload='params')",
    "offload_params_device": "set ShardingIntent(offload_device='nvme', nvme_path=...)",
    "offload_optimizer_device": "set ShardingIntent(offload_device='nvme', nvme_path=...)",
    "nvme_path": "set ShardingIntent(nvme_path=...)",
    "partition_activations": "set ShardingIntent(activation_checkpointing=True)",
    "cpu_checkpointing": "set ShardingIntent(activation_checkpointing=True)",
    "contiguous_memory_optimization": "set ShardingIntent(activation_checkpointing=True)",
    "synchronize_checkpoint_boundary": "set ShardingIntent(activation_checkpointing=True)",
    "logging_batch_size_per_gpu": "pass micro_batch_size=N",
}
_PASS_THROUGH = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "logging_level",
    "load_full_weights",
    "exclude_frozen_parameters",
    "remote_device",
}


def _split_arguments(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(intent fields, Lightning arguments); config-shaping Lightning arguments are refused with their intent field."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in ShardingIntent.__dataclass_fields__}
    for key in [k for k in kwargs if k not in _PASS_THROUGH]:
        fix = _CONFIG_ARGUMENTS.get(key, f"pass zero_overrides={{'{key}': ...}} to set a zero_optimization key")
        raise IntentError(f"AutoShardDeepSpeedStrategy does not take {key}=: it builds the DeepSpeed config from the intent. Fix: {fix}")
    return fields, kwargs


class AutoShardDeepSpeedStrategy(IntentZeRO3, GuardedDeepSpeedStrategy):
    """``strategy="autoshard-deepspeed"``: ZeRO-3 whose config is generated from a ShardingIntent when Lightning first
    needs it, once the world size, batch size, ``accumulate_grad_batches`` and ``gradient_clip_val`` are known."""

    strategy_name = "autoshard-deepspeed"
    writes_manifest = True
    config_final = False  # whether Lightning formatted the config (once): the run it was formatted from stays

    def __init__(
        self,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        *,
        micro_batch_size: int | None = None,
        zero_overrides: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        fields, lightning_kwargs = _split_arguments(dict(kwargs))
        self.checkpointed: dict[int, list[str]] = {}  # id(module) -> the blocks init_deepspeed checkpointed
        provisional = self._provisional(intent, fields, micro_batch_size, zero_overrides)
        super().__init__(config=provisional, **lightning_kwargs)  # checks lightning and the deepspeed import

    def init_deepspeed(self) -> None:
        """Activation checkpointing right before ``deepspeed.initialize`` (the config is final here), so DeepSpeed's
        hooks gather a block's parameters again for its recomputation. Once per module."""
        module = self.lightning_module
        if module is not None and id(module) not in self.checkpointed:
            blocks = checkpoint_blocks(module, self.intent, self.needs)
            self.checkpointed[id(module)] = blocks
            if blocks:
                rank_zero_info(
                    f"autoshard: activation checkpointing ({describe_checkpointing(self.intent.activation_checkpointing)}) under"
                    f" DeepSpeed ZeRO-3: {len(blocks)} block(s): {', '.join(blocks)}"
                )
        super().init_deepspeed()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save through the publish protocol (``publish_deepspeed_save``): a crash leaves the previous
        checkpoint whole, and a resume checks every file before DeepSpeed reads one."""
        if self.budget_decision is not None:  # in DeepSpeed's client state: a resume reads it before the config exists
            checkpoint[STATE_KEY] = {BUDGET_KEY: self.budget_decision.to_dict()}
        if storage_options is not None or self.deepspeed_engine.use_node_local_storage():
            super().save_checkpoint(checkpoint, filepath, storage_options)  # Lightning's refusal; per-node directories
            return
        publish_deepspeed_save(
            filepath,
            lambda staged: super(AutoShardDeepSpeedStrategy, self).save_checkpoint(checkpoint, str(staged)),
            self.global_rank,
            self.world_size,
            self.broadcast,
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        extra = checkpoint.pop(STATE_KEY, None)
        said = stored_differs(extra.get(BUDGET_KEY) if isinstance(extra, Mapping) else None, self.budget_decision)
        if said:
            rank_zero_warn(said)
        return checkpoint

    def _before_config(self, trainer: pl.Trainer | None) -> None:
        """The run, decided before the config is formatted from it, before anything is partitioned."""
        if trainer is not None and not self.config_final:
            self._decide_run(trainer, lambda: decide_for_fit(self, trainer, self.requested, BACKEND, self.zero_overrides))

    def _autoshard_format_config(self) -> bool:
        self.config_final = True
        trainer = _attached_trainer(self.lightning_module)
        if trainer is None:
            return True  # no Trainer yet: keep the provisional config (Lightning leaves its own unformatted too)
        self.config = deepspeed_config(
            self.intent,
            self.needs,
            precision=self.precision_plan,
            world_size=self.world_size,
            micro_batch_size=_lightning_batch_size(self) if self.micro_batch_size is None else self.micro_batch_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            zero_overrides=self.zero_overrides,
        )
        return True


def register_deepspeed_strategies(registry: Any) -> None:
    """Register "autoshard-deepspeed" and point Lightning's DeepSpeed names at the guarded class; idempotent. When
    a hooked member is gone, Lightning's names stay its own: strategy="deepspeed" is never refused for autoshard's sake."""
    register_strategy(
        registry,
        "autoshard-deepspeed",
        AutoShardDeepSpeedStrategy,
        "autoshard: DeepSpeed ZeRO-3 from a ShardingIntent, refused with guidance when the method cannot run",
        "Trainer(strategy='autoshard-deepspeed'): ZeRO-3 from a ShardingIntent",
    )
    if missing(in_lightning.TRAINER, DeepSpeedStrategy):
        return
    for name in LIGHTNING_DEEPSPEED_NAMES:
        entry = dict.get(registry, name)  # the raw entry: registry.get() would instantiate the strategy
        if entry is None or entry["strategy"] not in (DeepSpeedStrategy, GuardedDeepSpeedStrategy):
            continue  # absent, or someone else's subclass: leave it alone
        register_strategy(
            registry,
            name,
            GuardedDeepSpeedStrategy,
            entry["description"],
            "Lightning's name, same description and init params; refuses at setup what ZeRO cannot train (several"
            " optimizers; at stage 3 an EMA teacher), and runs on CPU (gloo)",
            **entry["init_params"],
        )
