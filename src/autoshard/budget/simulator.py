"""The one estimator, for one module and batch, cached: ``ModelStates`` (fast, from shapes) and ``Simulator``, which adds
the simulated steps (seconds each); explain's table, the ``--budget`` advice and the decision all read it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.backends import get_backend
from autoshard.budget.batch import cut_batch
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.mesh import nodes_for


@dataclass(frozen=True)
class Subject:
    """One module built on meta, the callbacks that came with it, the optimizers of its one ``configure_optimizers``
    call (hooks may assert a single call) and the needs read from them: what every estimate of it reads."""

    factory: Callable[[], Any]  # called afresh for each simulated step: ``fully_shard`` mutates the module
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
        return cls(factory, built.module, built.callbacks, sourced, needs, built.notes)


class ModelStates:
    """The model states of one ``Subject`` on ``backend``, for any intent at any world size, cached (``memory.estimate_memory_many``)."""

    def __init__(
        self,
        subject: Subject,
        backend: str,
        precision: Any,
        devices_per_node: int | None,
        num_nodes: int = 1,
        tokens: int | None = None,
        zero_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        from autoshard.memory import EstimateOptions

        self.subject, self.backend = subject, backend
        self.options = EstimateOptions(
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            precision=precision,
            sourced=subject.sourced,
            tokens=tokens,
            zero_overrides=zero_overrides,
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
    """The one estimator of a run's peak per rank, for one ``Subject`` and micro-batch: its ``ModelStates`` plus a
    simulated step, each cached; explain's table, its ``--budget`` advice and ``decide`` all read it. A backend that
    does not simulate its own step (DeepSpeed) takes only the activations of fsdp2's step of ``base`` with the same
    blocks checkpointed: nothing else DeepSpeed sets changes them (each offload gave them equal to the byte)."""

    def __init__(
        self, model: ModelStates, make_batch: Callable[[], Any] | None, base: ShardingIntent, progress: Callable[[str], None] | None
    ) -> None:
        self.model, self.make_batch, self.base, self.progress = model, make_batch, base, progress
        self.module, self.needs, self.backend = model.subject.module, model.subject.needs, model.backend
        self.precision, self.num_nodes = model.options.precision, model.options.num_nodes
        self.devices_per_node = model.options.devices_per_node
        self.whole_step = get_backend(model.backend).simulates_its_step  # the step runs this backend's plan: its peak is the run's
        self.measured: dict[tuple[str, int, int], Any] = {}

    def blocks(self) -> int:
        """Blocks activation checkpointing would wrap (trainable blocks; fsdp2's plan and DeepSpeed wrap the same)."""
        from autoshard.adapters.checkpointing import checkpointable_blocks

        return len(checkpointable_blocks(self.module, self.base, self.needs))

    def states(self, config: dict[str, Any], world_size: int) -> Any:
        return self.model.of(self.base.replace(**config), [world_size])[0]

    def step(self, config: dict[str, Any], world_size: int, divisor: int = 1) -> tuple[Any, int]:
        """(the estimate of ``config`` with its simulated step, the step's FLOPs); refused when the step cannot run in
        full: a decision is never made on half a step."""
        from autoshard.memory import with_step

        step = self.measure(self.base.replace(**config), world_size, divisor)
        if step.forward_only:  # the batch did not run: the reason is the user's to fix
            raise IntentError(f"memory_budget cannot be decided: {step.incomplete}")
        return with_step(self.states(config, world_size), step, self.whole_step), step.flops

    def measure(self, intent: ShardingIntent, world_size: int, divisor: int = 1) -> Any:
        """The simulated step of ``intent`` (``activations.measure_step``) on a micro-batch / ``divisor`` (without a
        batch, ``example_input_array``'s forward); what it raises, it raises."""
        from autoshard.activations import measure_step

        if not self.whole_step:  # ZeRO-3 has no reshard_after_forward: its estimate counts what it keeps (kept_gathered)
            intent = self.base.replace(activation_checkpointing=intent.activation_checkpointing, reshard_after_forward=True)
        key = (repr(intent), world_size, divisor)
        if key not in self.measured:
            if self.progress is not None:
                was = self.base.to_dict()
                parts = [f"{k}={v!r}" for k, v in intent.to_dict().items() if v != was[k]] + ([] if self.whole_step else ["activations only"])
                parts += [f"micro-batch / {divisor}"] if divisor > 1 else []
                self.progress(f"simulating one step on {world_size} fake ranks" + (f" ({', '.join(parts)})" if parts else ""))
            self.measured[key] = measure_step(
                self.model.subject.factory,
                intent,
                world_size,
                self.precision,
                make_batch=cut_batch(self.make_batch, divisor) if self.make_batch is not None else None,
                num_nodes=self.num_nodes if self.devices_per_node is None else nodes_for(world_size, self.devices_per_node),
            )
        return self.measured[key]
