"""``Fabric(strategy="autoshard-deepspeed")``: ZeRO-3 from a ShardingIntent, refused before any engine exists for what
DeepSpeed cannot train, and runnable on CPU (gloo), as on the Trainer side.

Fabric shows the method at ``fabric.setup``: the optimizers handed over (several are refused, naming each one and what
it trains), an EMA teacher inside the model (ZeRO-3 would update empty placeholders), 0-dim parameters, and a second
setup call: DeepSpeed builds one engine per call, and Lightning's DeepSpeedStrategy keeps the last one only (Lightning
issue #19773), so a GAN's or a teacher's second ``fabric.setup`` would silently step through the wrong engine.
Importing this module imports deepspeed only when a strategy is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DeepSpeedStrategy
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from torch import nn

from autoshard.adapters.checkpointing import checkpoint_blocks
from autoshard.adapters.deepspeed import deepspeed_config
from autoshard.backends import deepspeed as deepspeed_backend
from autoshard.checkpoint.publish import unverified_warning
from autoshard.checkpoint.resume import resolve_for_load
from autoshard.checkpoint.saves import publish_deepspeed_save, verify_on_every_rank
from autoshard.engine import deepspeed as ds
from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.fabric.base import FabricBackend
from autoshard.fabric.optimizers import ParameterNames, check_trains_module
from autoshard.fabric.setups import Setup, optimizer_label, run_needs, second_setup_refusal
from autoshard.intent import ShardingIntent
from autoshard.privates import in_lightning, missing
from autoshard.privates.in_lightning import lightning_lacks

BACKEND = deepspeed_backend.BACKEND.name  # "deepspeed_zero3"
# Lightning Fabric DeepSpeedStrategy arguments passed through; the ones that shape the config come from the intent.
PASS_THROUGH = frozenset(
    {"accelerator", "parallel_devices", "cluster_environment", "precision", "process_group_backend", "timeout", "logging_level"}
    | {"load_full_weights", "exclude_frozen_parameters", "remote_device"}
)


class AutoShardDeepSpeedStrategy(FabricBackend, ds.IntentZeRO3, ds.DeepSpeedRuntime, DeepSpeedStrategy):
    """``Fabric(strategy="autoshard-deepspeed")``: ZeRO-3, its config generated from the intent once the world size is
    known (``micro_batch_size`` is DeepSpeed's per-rank batch, which Fabric cannot see: 1 unless given)."""

    strategy_name = "autoshard-deepspeed"
    prefer = BACKEND

    def __init__(
        self,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        *,
        micro_batch_size: int | None = None,
        zero_overrides: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        gone = missing(in_lightning.FABRIC, DeepSpeedStrategy)
        if gone:
            raise lightning_lacks(gone, "Fabric DeepSpeed strategy hooks", f" Backend that works: fsdp2 ({self.front.strategy('fsdp2')}).")
        ds.require_deepspeed()
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in ShardingIntent.__dataclass_fields__}
        for key in kwargs:
            if key not in PASS_THROUGH:
                raise IntentError(
                    f"autoshard-deepspeed does not take {key}=: it builds the DeepSpeed config from the intent."
                    f" Fix: set the ShardingIntent field that says it, or pass zero_overrides={{'{key}': ...}} for a"
                    f" zero_optimization key"
                )
        super().__init__(config=self._provisional(intent, fields, micro_batch_size, zero_overrides), **kwargs)
        self.setups: list[Setup] = []

    def _label(self) -> str:
        return f"DeepSpeed ZeRO stage 3 ({type(self).__name__})"

    def _format_config(self) -> None:  # private Lightning hook: autoshard.privates.in_lightning
        """The final config, once the world size is known; Fabric's DeepSpeed needs it before any model exists."""
        self.config = deepspeed_config(
            self.intent,
            None,
            precision=self.precision_plan,
            world_size=self.world_size,
            micro_batch_size=1 if self.micro_batch_size is None else self.micro_batch_size,
            zero_overrides=self.zero_overrides,
        )

    # -- CPU (gloo): the three checks that block Lightning's DeepSpeedStrategy on CPU, as on the Trainer side -----------
    def setup_environment(self) -> None:
        if not self._on_cpu():
            super().setup_environment()  # Lightning's CUDA path, unchanged
            return
        accelerator = ds.deepspeed_accelerator()
        if accelerator != "cpu":
            raise ds.cpu_accelerator_refusal(accelerator, self.front)
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's override only adds the CUDA-only refusal

    def _setup_distributed(self) -> None:  # private Lightning hook: autoshard.privates.in_lightning
        if not self._on_cpu():
            super()._setup_distributed()
            return
        # Lightning checks device indices against local ranks; CPU devices have none, and nothing to select.
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    # -- fabric.setup: the method, checked before any engine exists -------------------------------------------------
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None) -> Any:
        self._check_setup(module, [optimizer_label(module, o) for o in optimizers])
        check_trains_module(module, optimizers)  # after the refusals DeepSpeed's engine has (a second setup call first)
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    def setup_module(self, module: nn.Module) -> Any:
        self._check_setup(module, [])
        return super().setup_module(module)

    def _check_setup(self, module: nn.Module, arriving: list[str]) -> None:
        """What DeepSpeed cannot train, refused with the backend that works and the fix; every rank sees the same
        models, so every rank refuses and none waits in a collective."""
        if self.setups:
            raise second_setup_refusal(self._label(), self.setups, module, arriving)
        needs = run_needs(module, [], arriving, 1)
        decision = self._select_before_engine(needs, type(module).__name__)
        zero_dim = ds.zero_dim_parameters(module)
        if zero_dim:
            names = ", ".join(repr(n) for n in zero_dim)
            raise IncompatibleBackendError(
                f"{type(module).__name__} has 0-dim parameter(s) {names}, so it cannot train under {self._label()}:"
                f" DeepSpeed sends every parameter as bytes (dist.broadcast(p.data.view(torch.uint8))) when it builds the"
                f" engine, and torch cannot view a 0-dim tensor that way; refused before the engine is built. Backend"
                f" that works: fsdp2 (Fabric(strategy='fsdp2')). Fix: use Fabric(strategy='fsdp2'), or give the"
                f" parameter shape (1,): nn.Parameter(torch.ones(1)) instead of nn.Parameter(torch.tensor(1.0))"
            )
        self.needs, self.decision = needs, decision
        self.report_decision(decision)
        checkpoint_blocks(module, self.intent, needs)  # before the engine, whose hooks gather a block again for its recomputation
        self.setups.append(Setup(1, type(module).__name__, _no_ref, ParameterNames(type(module).__name__, {}), arriving))

    # -- fabric.save / fabric.load: the crash-safe writer, the checks before DeepSpeed reads a file -------------------
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any = None) -> None:
        """DeepSpeed's engine writes every rank's files into a staging of this save's own; each rank hashes its own; rank 0
        writes the manifest and renames the staging in, holding the destination's lock (checkpoint.publish's protocol)."""
        if storage_options is not None or filter is not None:
            super().save_checkpoint(path, state, storage_options, filter)  # Lightning's refusals
            return

        def write(staged: Path) -> None:
            super(AutoShardDeepSpeedStrategy, self).save_checkpoint(str(staged), state)
            self.barrier()  # every rank's files are in before any rank hashes

        publish_deepspeed_save(path, write, self.global_rank, self.world_size, self.broadcast)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(state, dict) and state and not (self.load_full_weights and self.zero_stage_3):
            path = resolve_for_load(Path(self.broadcast(path)), BACKEND, world_size=self.world_size)
            if not verify_on_every_rank(Path(path), self.global_rank, self.world_size):
                rank_zero_warn(unverified_warning(path))
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)


def _no_ref() -> None:
    """DeepSpeed's setup record keeps no module: nothing is remapped or re-sharded after its single setup."""
    return None
