"""What every autoshard strategy does around its Lightning parent, whichever backend it drives.

Mixed in first (``class FSDP2Strategy(BackendMixin, ..., ModelParallelStrategy)``), so its ``_configure_launcher``
runs before Lightning's. One order for every backend: when the Trainer is built, the Trainer's precision is resolved
once (with the intent) and what needs no module is checked (mesh sizes, and per strategy more); at setup, the
method's needs go through the same ``select_backend`` with the same accelerator, precision and strategy string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from autoshard.intent import ShardingIntent
from autoshard.needs import MethodNeeds
from autoshard.precision import PrecisionPlan, resolve_precision
from autoshard.select import Decision, select_backend

if TYPE_CHECKING:
    import torch


class BackendMixin:
    """Precision, construction-time checks, backend selection and mesh sizes, for FSDP2 and DeepSpeed alike."""

    prefer: str  # what select_backend is asked for: the backend's name, or "auto"
    intent: ShardingIntent
    requested_as: str | None = None  # the strategy string the user typed, when it is not this class's own name
    precision_plan: PrecisionPlan | None = None  # resolved once the Trainer's precision is known
    needs: MethodNeeds | None = None  # what the method needs, once inspected at setup
    hsdp_sizes: tuple[int, int] | None = None  # (replicas, shard_size) for ShardingIntent(shard_size=...); None: pure FSDP
    decision: Decision | None = None  # the backend decision for those needs
    # Provided by the Lightning strategy this is mixed into.
    num_nodes: int
    num_processes: int
    parallel_devices: list[torch.device] | None
    precision_plugin: Any

    def _configure_launcher(self) -> None:  # private Lightning hook: autoshard.lightning.compat
        self.precision_plan = self._resolve_precision()
        self._check_construction()
        super()._configure_launcher()  # type: ignore[misc]

    def _resolve_precision(self) -> PrecisionPlan | None:
        """The run's precision, once: the Trainer's precision plugin (the source of truth) with the intent."""
        return resolve_precision(self.precision_plugin.precision, self._intent_to_check())

    def _check_construction(self) -> None:
        """What can be refused once the Trainer is built and before any process starts; more per strategy."""
        self._mesh_sizes()

    def _intent_to_check(self) -> ShardingIntent:
        """The intent the matrix judges (Lightning's own DeepSpeed names have none: the default)."""
        return self.intent

    def _mesh_sizes(self) -> tuple[int, int]:
        """(data parallel, tensor parallel) for this world; refuses sizes whose product is not the world size.

        The hybrid-sharding split (``hsdp_sizes``) is resolved here too, once, where num_nodes is known ("node").
        """
        intent, world = self._intent_to_check(), self.num_nodes * self.num_processes
        sizes = intent.mesh_sizes(world, self.num_nodes)
        self.hsdp_sizes = intent.hsdp_sizes(world, self.num_nodes)
        return sizes

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


__all__ = ["BackendMixin"]
