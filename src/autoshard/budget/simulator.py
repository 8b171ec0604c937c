"""Model states (fast, from shapes) and simulated steps (seconds each) for one module and batch, cached: ``ModelStates``
is the one estimator of model states (explain, the ``--budget`` advice, the decision), ``Simulator`` adds the steps."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.backends import get_backend
from autoshard.budget.batch import cut_batch
from autoshard.budget.decision import describe_config
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.mesh import nodes_for


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


@dataclass(frozen=True)
class Subject:
    """One module built on meta, the callbacks that came with it, the optimizers of its one ``configure_optimizers``
    call (hooks may assert a single call) and the needs read from them: what every estimate of it reads."""

    module: Any
    callbacks: list[Any]
    sourced: list[tuple[str, Any]]
    needs: Any
    notes: list[str]

    @classmethod
    def build(cls, factory: Callable[[], Any]) -> Subject:
        from autoshard.memory import collect_optimizers
        from autoshard.needs import inspect_needs
        from autoshard.target import build_on_meta

        built = build_on_meta(factory)
        sourced = collect_optimizers(built.module, built.callbacks)
        configured = [o for source, o in sourced if source == "configure_optimizers"]
        needs = inspect_needs(built.module, callbacks=built.callbacks, optimizers=configured)
        return cls(built.module, built.callbacks, sourced, needs, built.notes)


class ModelStates:
    """The model states of one ``Subject`` on ``backend``, for any intent at any world size, cached (``memory.estimate_memory_many``)."""

    def __init__(
        self, subject: Subject, backend: str, precision: Any, devices_per_node: int | None, num_nodes: int = 1, tokens: int | None = None
    ) -> None:
        from autoshard.memory import EstimateOptions

        self.subject, self.backend = subject, backend
        self.options = EstimateOptions(
            num_nodes=num_nodes, devices_per_node=devices_per_node, precision=precision, sourced=subject.sourced, tokens=tokens
        )
        self.cache: dict[tuple[str, int], Any] = {}

    def of(self, intent: ShardingIntent, world_sizes: Sequence[int]) -> list[Any]:
        """The estimates of ``intent`` at ``world_sizes``: those not cached made together (one plan for all)."""
        from autoshard.memory import estimate_memory_many

        missing = [n for n in world_sizes if (repr(intent), n) not in self.cache]
        if missing:
            s = self.subject
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the plan's warnings are explain's to report, once
                made = estimate_memory_many(s.module, intent, s.needs, missing, self.backend, callbacks=s.callbacks, options=self.options)
            self.cache.update({(repr(intent), n): e for n, e in zip(missing, made)})
        return [self.cache[(repr(intent), n)] for n in world_sizes]


class Simulator:
    """Model states and simulated steps for one module and batch, cached. Under DeepSpeed a peak is its estimator's
    states plus the activations of an fsdp2 step with the same blocks checkpointed (they do not depend on the offload)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        make_batch: Callable[[], Any],
        base: ShardingIntent,
        precision: Any,
        devices_per_node: int | None,
        num_nodes: int,
        progress: Callable[[str], None] | None,
        backend: str = "fsdp2",
    ) -> None:
        self.factory, self.make_batch, self.base, self.precision = factory, make_batch, base, precision
        self.devices_per_node, self.num_nodes, self.progress = devices_per_node, num_nodes, progress
        self.backend = backend
        subject = Subject.build(factory)
        self.module, self.needs = subject.module, subject.needs
        self.model = ModelStates(subject, backend, precision, devices_per_node, num_nodes)
        self.step_cache: dict[tuple[str, int, int], tuple[Any, int]] = {}
        self.measured: dict[tuple[str, int, int], Any] = {}
        self.sims = 0

    def blocks(self) -> int:
        """Blocks activation checkpointing would wrap (trainable blocks; fsdp2's plan and DeepSpeed wrap the same)."""
        from autoshard.adapters.checkpointing import checkpointable_blocks

        return len(checkpointable_blocks(self.module, self.base, self.needs))

    def states(self, config: dict[str, Any], world_size: int) -> Any:
        return self.model.of(self.base.replace(**config), [world_size])[0]

    def step(self, config: dict[str, Any], world_size: int, divisor: int = 1) -> tuple[Any, int]:
        """(the estimate with the simulated step, the step's FLOPs)."""
        from autoshard.memory import with_step

        key = (config_key(config), world_size, divisor)
        if key not in self.step_cache:
            whole = get_backend(self.backend).simulates_its_step
            step = self._measure(config if whole else {k: v for k, v in config.items() if k == "activation_checkpointing"}, world_size, divisor)
            self.step_cache[key] = (with_step(self.states(config, world_size), step, whole), step.flops)
        return self.step_cache[key]

    def _measure(self, config: dict[str, Any], world_size: int, divisor: int) -> Any:
        from autoshard.activations import measure_step

        key = (config_key(config), world_size, divisor)
        if key not in self.measured:
            if self.progress is not None:
                what = describe_config(config) + ("" if get_backend(self.backend).simulates_its_step else ": activations for DeepSpeed")
                self.progress(f"simulating one step on {world_size} fake ranks ({what}" + (f", micro-batch / {divisor}" if divisor > 1 else "") + ")")
            step = measure_step(
                self.factory,
                self.base.replace(**config),
                world_size,
                self.precision,
                make_batch=cut_batch(self.make_batch, divisor),
                num_nodes=self.num_nodes if self.devices_per_node is None else nodes_for(world_size, self.devices_per_node),
            )
            self.sims += 1
            if step.forward_only:  # the batch did not run: the reason is the user's to fix, never a decision on half a step
                raise IntentError(f"memory_budget cannot be decided: {step.incomplete}")
            self.measured[key] = step
        return self.measured[key]
