"""Model states (fast, from shapes) and simulated steps (seconds each) for one module and batch, cached: what the
decision's search and ``price`` evaluate configurations with."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from autoshard.backends import get_backend
from autoshard.budget.batch import cut_batch
from autoshard.budget.decision import describe_config
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


class Simulator:
    """Model states (fast, from shapes) and simulated steps (seconds each) for one module and batch, cached.

    ``backend``: fsdp2 (the step runs fsdp2's own plan: its peak is the run's), or DeepSpeed ZeRO-3 (its estimator's
    states, plus the activations of one fsdp2 step of the same method, with the same blocks checkpointed, per world
    size and micro-batch: they do not depend on the offload)."""

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
        from autoshard.memory import collect_optimizers
        from autoshard.needs import inspect_needs
        from autoshard.target import build_on_meta

        self.factory, self.make_batch, self.base, self.precision = factory, make_batch, base, precision
        self.devices_per_node, self.num_nodes, self.progress = devices_per_node, num_nodes, progress
        self.backend = backend
        built = build_on_meta(factory)
        self.module, self.callbacks = built.module, built.callbacks
        self.sourced = collect_optimizers(self.module, self.callbacks)
        configured = [o for source, o in self.sourced if source == "configure_optimizers"]
        self.needs = inspect_needs(self.module, callbacks=self.callbacks, optimizers=configured)
        self.states_cache: dict[tuple[str, int], Any] = {}
        self.step_cache: dict[tuple[str, int, int], tuple[Any, int]] = {}
        self.measured: dict[tuple[str, int, int], Any] = {}
        self.sims = 0

    def nodes(self, world_size: int) -> int:
        from autoshard.mesh import nodes_for

        return self.num_nodes if self.devices_per_node is None else nodes_for(world_size, self.devices_per_node)

    def blocks(self) -> int:
        """Blocks activation checkpointing would wrap (trainable blocks; fsdp2's plan and DeepSpeed wrap the same)."""
        from autoshard.adapters.checkpointing import checkpointable_blocks

        return len(checkpointable_blocks(self.module, self.base, self.needs))

    def states(self, config: dict[str, Any], world_size: int) -> Any:
        import warnings

        from autoshard.memory import EstimateOptions, estimate_memory_many

        key = (config_key(config), world_size)
        if key not in self.states_cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                options = EstimateOptions(num_nodes=self.nodes(world_size), precision=self.precision, sourced=self.sourced)
                asked = self.base.replace(**config)
                self.states_cache[key] = estimate_memory_many(
                    self.module, asked, self.needs, [world_size], self.backend, callbacks=self.callbacks, options=options
                )[0]
        return self.states_cache[key]

    def step(self, config: dict[str, Any], world_size: int, divisor: int = 1) -> tuple[Any, int]:
        """(the estimate with the simulated step, the step's FLOPs)."""
        from autoshard.memory import with_step

        key = (config_key(config), world_size, divisor)
        if key not in self.step_cache:
            # DeepSpeed: only the activations of fsdp2's step with the same blocks checkpointed are added to its estimator's
            # states (they do not depend on the offload)
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
                num_nodes=self.nodes(world_size),
            )
            self.sims += 1
            if step.forward_only:  # the batch did not run: the reason is the user's to fix, never a decision on half a step
                raise IntentError(f"memory_budget cannot be decided: {step.incomplete}")
            self.measured[key] = step
        return self.measured[key]
