"""What every autoshard strategy does around its Lightning parent, whichever backend it drives and whichever front
end (the Trainer or Fabric, ``front``) built it.

Mixed in first, so its ``_configure_launcher`` runs before Lightning's: one order for every backend when the Trainer
(or Fabric) is built (precision resolved once, the launch checked, the parallel dims resolved once), and at setup the
same ``select_backend`` for the method's needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from autoshard.activations import settle_autograd_engine
from autoshard.engine.front_end import FrontEnd
from autoshard.engine.launch import check_launch
from autoshard.engine.run import Run
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelDims
from autoshard.needs import MethodNeeds
from autoshard.precision import PrecisionPlan, resolve_precision
from autoshard.select import Decision, select_backend

if TYPE_CHECKING:
    import torch

    from autoshard.budget import BudgetDecision


class BackendMixin:
    """Precision, launch and construction-time checks, backend selection and parallel dims, for FSDP2 and DeepSpeed alike."""

    front: FrontEnd  # the Trainer or Fabric: what messages call the thing the user built
    prefer: str  # what select_backend is asked for: the backend's name, or "auto"
    requested: ShardingIntent  # the intent as the user built the strategy: never replaced
    run: Run | None = None  # decided at setup, before anything is planned or sharded
    requested_as: str | None = None  # the strategy string the user typed, when it is not this class's own name
    precision_plan: PrecisionPlan | None = None  # resolved once the Trainer's precision is known
    needs: MethodNeeds | None = None  # what the method needs, once inspected at setup
    dims: ParallelDims | None = None  # resolved once when the Trainer is built (_resolve_dims)
    decision: Decision | None = None  # the backend decision for those needs
    # Provided by the Lightning strategy this is mixed into.
    num_nodes: int
    num_processes: int
    parallel_devices: list[torch.device] | None
    precision_plugin: Any
    cluster_environment: Any

    def _configure_launcher(self) -> None:  # private Lightning hook: autoshard.privates.in_lightning
        # Before fully_shard (torch's own FakeTensorMode) or a simulated step: a budget's forked decision can still train
        settle_autograd_engine()
        try:
            self.precision_plan = self._resolve_precision()
            # Under srun or torchrun Lightning starts no launcher, so its own validate_settings never runs: the world
            # they started is compared with devices x num_nodes here, before any process waits, whatever the backend.
            check_launch(self.num_processes, self.num_nodes, self.cluster_environment)
            self._check_construction()
        except AutoShardError as exc:
            restated = self.front.restated(exc)  # what is refused here is said in the Trainer's terms
            if restated is None:
                raise
            raise restated from None
        super()._configure_launcher()  # type: ignore[misc]

    @property
    def intent(self) -> ShardingIntent:
        """What the run trains with once it is decided at setup (the memory budget's fields taken); the request before."""
        return self.run.intent if self.run is not None else self.requested

    @property
    def budget_decision(self) -> BudgetDecision | None:
        """ShardingIntent(memory_budget=...)'s decision, made at fit: saved with every checkpoint."""
        return self.run.budget if self.run is not None else None

    @property
    def hsdp_sizes(self) -> tuple[int, int] | None:
        """(replicas, shard_size) for ShardingIntent(shard_size=...); None: pure FSDP (or not resolved yet)."""
        return self.dims.hsdp if self.dims is not None else None

    def _resolve_precision(self) -> PrecisionPlan | None:
        """The run's precision, once: the Trainer's precision plugin (the source of truth) with the intent."""
        return resolve_precision(self.precision_plugin.precision, self._intent_to_check())

    def _check_construction(self) -> None:
        """What can be refused once the Trainer is built and before any process starts; more per strategy."""
        self._resolve_dims()

    def _intent_to_check(self) -> ShardingIntent:
        """The intent the matrix judges (Lightning's own DeepSpeed names have none: the default)."""
        return self.intent

    def _resolve_dims(self) -> ParallelDims:
        """The run's parallel dims (replicas x shard ranks x tensor parallel), resolved once for this world, where
        num_nodes is known (``shard_size='node'``); refuses sizes that do not fit it."""
        self.dims = ParallelDims.resolve(self._intent_to_check(), self.num_nodes * self.num_processes, self.num_nodes)
        return self.dims

    def _accelerator_name(self) -> str | None:
        return self.parallel_devices[0].type if self.parallel_devices else None

    def report_decision(self, decision: Decision) -> None:
        """The decision at info level, and each caveat as a warning: on rank 0, once per run (this strategy's setup
        runs again for validate or test after fit: the same caveat is not said twice)."""
        rank_zero_info(decision.describe(caveats=False))
        warned: set[str] = vars(self).setdefault("warned_caveats", set())
        for text in decision.warnings():
            if text not in warned:
                warned.add(text)
                rank_zero_warn(text)

    def _select(self, needs: MethodNeeds, prefer: str | None = None) -> Decision:
        """``select_backend`` for this run: its accelerator, its resolved precision, the strategy string in use."""
        return select_backend(
            needs,
            self._intent_to_check(),
            prefer=prefer or self.prefer,
            accelerator=self._accelerator_name(),
            applied=self.requested_as,
            precision=self.precision_plan,
        )
