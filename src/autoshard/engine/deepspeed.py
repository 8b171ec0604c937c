"""What both front ends' DeepSpeed strategies need of DeepSpeed at run time: that it is there, the process left as
ZeRO-3 found it (``torch.nn.functional.linear``), 0-dim parameters found before the engine is built, and a CPU (gloo)
path (the save's publish is ``checkpoint.saves.publish_deepspeed_save``).

Importing this module does not import deepspeed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from autoshard.adapters.deepspeed import precision_config, provisional_config
from autoshard.backends import deepspeed as deepspeed_backend
from autoshard.capability import Feature
from autoshard.engine.base import BackendMixin
from autoshard.engine.front_end import FrontEnd
from autoshard.errors import BackendUnavailableError, IncompatibleBackendError
from autoshard.intent import ShardingIntent, as_intent
from autoshard.needs import MethodNeeds
from autoshard.precision import PrecisionPlan, resolve_precision
from autoshard.select import Decision


def restore_functional_linear() -> bool:
    """Put back ``torch.nn.functional.linear`` when ZeRO-3 left its own in the process; True when it did.
    ``zero.Init`` replaces it "until manually reset": every model trained afterwards, under any strategy, would run
    DeepSpeed's autograd Function (seen here: losses moved by 3e-4). ``linear_bk`` is torch's, saved by zero.Init."""
    current = torch.nn.functional.linear
    if getattr(current, "__module__", "") != "deepspeed.runtime.zero.linear":
        return False
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is None:
        return False
    torch.nn.functional.linear = original
    return True


def require_deepspeed() -> None:
    """BackendUnavailableError with the install command when deepspeed is missing, importing nothing."""
    if importlib.util.find_spec("deepspeed") is None:
        raise BackendUnavailableError(
            f"deepspeed is not installed: the DeepSpeed ZeRO-3 backend (strategy='autoshard-deepspeed' or"
            f" Lightning's 'deepspeed*' names) needs it. Backend that works without it: fsdp2 (strategy='fsdp2')."
            f" Fix: {deepspeed_backend.INSTALL}"
        )
    available = deepspeed_backend.check()
    if not available.ok:
        raise BackendUnavailableError(
            f"{available.detail}: the DeepSpeed ZeRO-3 backend needs it. Backend that works: fsdp2 (strategy='fsdp2'). Fix: {available.fix}"
        )


def zero_dim_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the 0-dim parameters not yet converted (no ``ds_id``): each one would crash deepspeed.initialize."""
    return [name for name, p in module.named_parameters() if p.dim() == 0 and not hasattr(p, "ds_id")]


class DeepSpeedRuntime(BackendMixin):
    """Strategy mixin for both DeepSpeed strategies: the method refused before the engine exists, torch's linear
    restored at teardown, and a CPU root device (Lightning blocks CPU in two more places, each front end's own)."""

    parallel_devices: list[torch.device] | None

    def _label(self) -> str:
        raise NotImplementedError  # "DeepSpeed ZeRO stage 3 (AutoShardDeepSpeedStrategy)": each strategy says its stage

    def _select_before_engine(self, needs: MethodNeeds, owner: str) -> Decision:
        """``select_backend`` for the method of ``owner`` (a class name); its refusal says that nothing was built yet
        and, under auto-shard, that the intent chose DeepSpeed."""
        try:
            return self._select(needs)
        except IncompatibleBackendError as err:
            why = ""
            if self.requested_as:  # auto-shard picked DeepSpeed from the intent, before the method was known
                why = f" ({self.requested_as} chose DeepSpeed when {self.front.the} was built, for what the intent asks.)"
            raise type(err)(f"{owner} cannot train under {self._label()}; refused before the engine is built.{why}\n{err}") from None

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        restore_functional_linear()

    def _on_cpu(self) -> bool:
        return bool(self.parallel_devices) and self.parallel_devices[0].type == "cpu"

    @property
    def root_device(self) -> torch.device:
        if self._on_cpu():
            return torch.device("cpu", 0)  # DeepSpeed passes root_device.index as device_rank; None breaks it
        return super().root_device  # type: ignore[misc]


class IntentZeRO3(BackendMixin):
    """What both ``autoshard-deepspeed`` strategies hold: the intent (with the fields passed beside it), the ZeRO-3
    config built from it (provisional until the world size is known), and the precision resolved once with it."""

    micro_batch_size: int | None
    zero_overrides: dict[str, Any]

    def _provisional(
        self, intent: ShardingIntent | Mapping[str, Any] | None, fields: Mapping[str, Any], micro_batch_size: int | None, zero_overrides: Any
    ) -> dict[str, Any]:
        """Take the intent and the config's own arguments; the config Lightning's DeepSpeedStrategy is built with.
        Intent-only refusals (tensor parallel) are said here, the precision once the front end's is known, the method
        at setup."""
        self.requested = as_intent(intent, **fields)  # a field given beside a conflicting intent is refused there
        self.micro_batch_size = micro_batch_size
        self.zero_overrides = dict(zero_overrides or {})
        return provisional_config(self.requested, micro_batch_size=micro_batch_size, zero_overrides=self.zero_overrides)

    def _intent_to_check(self) -> ShardingIntent:
        return self.intent

    def _select(self, needs: MethodNeeds, prefer: str | None = None) -> Decision:
        """The decision, its ``KEEP_GATHERED`` caveat with the run's ``stage3_max_reuse_distance`` when
        ``zero_overrides`` sets it: a Fix never asks for what the user already set."""
        decision = super()._select(needs, prefer)  # type: ignore[misc]
        distance = self.zero_overrides.get("stage3_max_reuse_distance")
        if not isinstance(distance, (int, float)) or isinstance(distance, bool):
            return decision
        cell = deepspeed_backend.keep_gathered_cell(distance)
        told = tuple(
            dataclasses.replace(c, reason=cell.reason, remedy=cell.remedy) if c.feature is Feature.KEEP_GATHERED else c for c in decision.caveats
        )
        return dataclasses.replace(decision, caveats=told)

    def _resolve_precision(self) -> PrecisionPlan:
        plan = resolve_precision(self.precision_plugin.precision, self.intent)
        precision_config(plan)  # what ZeRO-3 cannot run (a param_dtype it cannot gather in) is refused now
        return plan


def deepspeed_accelerator() -> str:
    """The accelerator DeepSpeed chose when it was imported (``DS_ACCELERATOR``, else what it detected)."""
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().device_name())


def cpu_accelerator_refusal(accelerator: str, front: FrontEnd) -> IncompatibleBackendError:
    """CPU devices, but DeepSpeed was started with another accelerator: it must be told before Python starts."""
    cell = deepspeed_backend.ROW[Feature.CPU_ACCELERATOR]
    return IncompatibleBackendError(
        f"{front.call(CPU)} with DeepSpeed, but DeepSpeed's accelerator is '{accelerator}': {cell.reason}."
        f" Backend that works on CPU: fsdp2 ({front.strategy('fsdp2')}). Fix: export DS_ACCELERATOR=cpu before"
        f" Python starts, or {cell.remedy}"
    )


CPU = "accelerator='cpu'"
