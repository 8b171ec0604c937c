"""Lightning strategies "fsdp2" and "auto-shard": ModelParallelStrategy that shards any LightningModule itself."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from autoshard.adapters.fsdp2 import (
    FSDP2Plan,
    ParallelizeFn,
    average_unsharded_gradients,
    check_ema_alignment,
    data_parallel_mesh,
    is_sharded,
    plan_fsdp2,
)
from autoshard.capability import Feature
from autoshard.backends import get_backend
from autoshard.errors import AutoShardError, IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent, as_intent, normalize_precision, with_trainer_precision
from autoshard.lightning.checkpoint import CheckpointMixin
from autoshard.needs import EMAPair, MethodNeeds, inspect_needs
from autoshard.select import Decision, select_backend

if TYPE_CHECKING:
    import lightning.pytorch as pl

FSDP2_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def precision_refusal(precision: str, strategy: str) -> str:
    """The 16-mixed refusal, in Trainer terms (Lightning's own text speaks of ``Fabric(...)``)."""
    cell = get_backend("fsdp2").row[Feature.FP16_MIXED]
    return (
        f"Trainer(strategy='{strategy}', precision='{precision}') is not supported: {cell.reason}."
        f" Valid choices with fsdp2: {', '.join(map(repr, FSDP2_PRECISIONS))}."
        f" Fix: use Trainer(precision='bf16-mixed') (recommended), or strategy='autoshard-deepspeed' for a"
        f" single-optimizer method that needs fp16"
    )


def check_slurm(num_processes: int, num_nodes: int) -> None:
    """Under srun the world size comes from SLURM, not ``devices=``: a mismatch must stop before any process waits."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect() or SLURMEnvironment.job_name() in ("bash", "interactive"):
        return
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
    tasks = int(per_node.split("(")[0]) if per_node else int(os.environ["SLURM_NTASKS"]) // max(num_nodes, 1)
    if tasks != num_processes:
        raise IntentError(
            f"SLURM started {tasks} task(s) per node but Trainer(devices={num_processes}): under srun Lightning takes"
            f" the world size from SLURM, so the two must be equal (one task per device). Fix: set"
            f" Trainer(devices={tasks}), or launch with `srun --ntasks-per-node={num_processes}"
            f" --gres=gpu:{num_processes} python train.py`"
        )
    nodes = os.environ.get("SLURM_NNODES")
    if nodes is not None and int(nodes) != num_nodes:
        raise IntentError(
            f"SLURM allocated {nodes} node(s) but Trainer(num_nodes={num_nodes}). Fix: set Trainer(num_nodes={nodes})"
        )


@contextmanager
def _configure_model_counted_as_overridden(module: torch.nn.Module) -> Any:
    """ModelParallelStrategy.setup insists on an overridden ``configure_model``; autoshard did the sharding instead.

    A temporary instance attribute satisfies that check without copying Lightning's setup; it is removed after.
    """
    had = "configure_model" in vars(module)
    if not had:

        def configure_model() -> None:
            """Sharded by autoshard at setup."""

        module.__dict__["configure_model"] = configure_model
    try:
        yield
    finally:
        if not had:
            del module.__dict__["configure_model"]


def check_meta_init(module: torch.nn.Module) -> bool:
    """True when built on the meta device; refuses modules whose parameters reset_parameters() would not initialize.

    Lightning only warns there, and training would start from uninitialized memory.
    """
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return False
    missing = sorted(
        {
            type(m).__name__
            for m in module.modules()
            if any(True for _ in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
            and not callable(getattr(m, "reset_parameters", None))
        }
    )
    if missing:
        raise AutoShardError(
            f"the model was built on the meta device (empty_init=True), but {', '.join(missing)} own parameters or"
            f" buffers and define no reset_parameters(), so they would start from uninitialized memory."
            f" Fix: define reset_parameters() on them, or build the model without empty_init=True"
        )
    return True


@torch.no_grad()
def copy_students_into_teachers(module: torch.nn.Module, pairs: tuple[EMAPair, ...]) -> None:
    """After meta init each side got its own random init; an EMA teacher must start as a copy of its student."""
    for pair in pairs:
        teacher, student = module.get_submodule(pair.teacher), module.get_submodule(pair.student)
        for t, s in zip((*teacher.parameters(), *teacher.buffers()), (*student.parameters(), *student.buffers())):
            t.copy_(s)


class FSDP2Strategy(CheckpointMixin, ModelParallelStrategy):
    """``strategy="fsdp2"``: pure FSDP by default (dp = world size, tp = 1), sharding at setup, no module change.

    ``parallelize_fn(module, device_mesh)`` replaces the generic plan; ``device_mesh["data_parallel"]`` is the dp slice.
    """

    strategy_name = "fsdp2"
    prefer = "fsdp2"

    def __init__(
        self,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.intent = as_intent(intent)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=self.intent.checkpoint == "distributed",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.parallelize_fn = parallelize_fn
        self.needs: MethodNeeds | None = None
        self.decision: Decision | None = None
        self.plan: FSDP2Plan | None = None

    # -- Trainer construction: everything that can be refused before a process starts -------------------------
    def _configure_launcher(self) -> None:
        self.intent = self._intent_with_trainer_precision()
        accelerator = self._accelerator_name()
        select_backend(MethodNeeds(), self.intent, prefer=self._prefer_at_construction(), accelerator=accelerator)
        check_slurm(self.num_processes, self.num_nodes)
        self.intent.mesh_sizes(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _prefer_at_construction(self) -> str:
        return self.prefer

    def _intent_with_trainer_precision(self) -> ShardingIntent:
        trainer_precision = normalize_precision(getattr(self.precision_plugin, "precision", "32-true"))
        if trainer_precision not in FSDP2_PRECISIONS:
            raise IncompatibleBackendError(precision_refusal(trainer_precision, self.strategy_name))
        return with_trainer_precision(self.intent, trainer_precision)

    def _accelerator_name(self) -> str | None:
        device = self.parallel_devices[0] if self.parallel_devices else None
        return device.type if device is not None else None

    # -- In each process --------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.intent.mesh_sizes(self.num_nodes * self.num_processes)
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        self.needs = inspect_needs(module, trainer)
        self.decision = select_backend(self.needs, self.intent, prefer=self.prefer, accelerator=self._accelerator_name())
        if self.decision.backend != "fsdp2":
            raise IncompatibleBackendError(
                f"auto-shard chose {self.decision.backend} for this method, but the Trainer was built for fsdp2."
                f" Fix: use strategy='{self.decision.strategy}'\n{self.decision.describe()}"
            )
        rank_zero_info(self.decision.describe())
        on_meta = check_meta_init(module)
        already_sharded = is_sharded(module)
        if already_sharded or self.parallelize_fn is not None:
            if already_sharded:
                rank_zero_info("autoshard: modules already sharded (your configure_model); the generic plan is skipped")
            else:
                self.parallelize_fn(module, self.device_mesh)  # type: ignore[misc]
                rank_zero_info("autoshard: sharded by your parallelize_fn; the generic plan is skipped")
            average_unsharded_gradients(module, data_parallel_mesh(self.device_mesh))
            for pair in self.needs.ema_pairs:
                check_ema_alignment(module, pair)
        else:
            self.plan = plan_fsdp2(module, self.intent, self.needs)
            self.plan.apply(module, self.device_mesh)
            rank_zero_info(self.plan.describe(self.describe_mesh()))
        with _configure_model_counted_as_overridden(module):
            super().setup(trainer)  # materializes meta shards locally through reset_parameters()
        if on_meta:
            copy_students_into_teachers(module, self.needs.ema_pairs)

    def describe_mesh(self) -> dict[str, Any]:
        return {
            "data_parallel_size": self._data_parallel_size,
            "tensor_parallel_size": self._tensor_parallel_size,
            "world_size": self.world_size,
        }


class AutoShardStrategy(FSDP2Strategy):
    """``strategy="auto-shard"``: the backend the selector picks; checked again against the module at setup.

    The intent alone can require DeepSpeed (NVMe or optimizer-only offload): then construction returns
    autoshard's DeepSpeed strategy instead. The method is only known at setup, where a misfit is refused.
    """

    strategy_name = "auto-shard"
    prefer = "auto"

    def __new__(
        cls,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> Any:
        wanted = as_intent(intent)
        if select_backend(MethodNeeds(), wanted).backend == "deepspeed_zero3":
            if parallelize_fn is not None:
                raise IntentError(
                    "this intent needs DeepSpeed (only it has what it asks for), and DeepSpeed takes no parallelize_fn."
                    " Fix: drop parallelize_fn, or change the intent so that fsdp2 can run it"
                )
            from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

            return AutoShardDeepSpeedStrategy(wanted, process_group_backend=process_group_backend, timeout=timeout)
        return super().__new__(cls)

    def _prefer_at_construction(self) -> str:
        return "fsdp2"
