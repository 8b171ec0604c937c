"""What both fsdp2 strategies, the Trainer's (``lightning.fsdp2``) and Fabric's (``fabric.strategies``), do around
Lightning's ModelParallelStrategy before anything is sharded: the construction checks (precision, the selector, the
dims resolved once and given to Lightning's mesh, a shard size a parallelize_fn would ignore), the one mesh's views,
and the decision at setup. One copy, so the two cannot drift; each front end adds only its own hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.distributed.device_mesh import DeviceMesh  # noqa: F401  ParallelizeFn's "DeviceMesh", for get_type_hints (below)

from autoshard.adapters.fsdp2 import ParallelizeFn
from autoshard.backends.matrix import cell
from autoshard.checkpoint.saves import all_gather_object
from autoshard.engine.auto_shard import FSDP2, fsdp2_auto_intent
from autoshard.engine.base import BackendMixin
from autoshard.engine.fp16 import accelerator_device, shard_aware, sharded_scaler
from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.init_from import InitPlan, plan_everywhere, sources_of
from autoshard.intent import IntentKeywords, ShardingIntent, as_intent
from autoshard.mesh import ParallelMesh
from autoshard.needs import MethodNeeds
from autoshard.precision import Precision, PrecisionPlan, normalize_precision
from autoshard.privates import Private
from autoshard.privates.in_lightning import lightning_lacks
from autoshard.select import Decision

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions: a dependency of torch
    from typing_extensions import Unpack

FSDP2_PRECISIONS = tuple(p.value for p in Precision if cell("fsdp2", p.feature).support.usable)


def refuse_unsupported_precision(precision_flag: object, strategy: FSDP2Checks) -> None:
    """Refuse, in Trainer terms (Fabric restates them: ``FrontEnd.restated``), a precision fsdp2 cannot run (one the
    matrix's fsdp2 row does not list as usable, or one autoshard plans nothing for: 64-true, transformer-engine).

    Called by the guard on the Trainer's precision flag, before Lightning's own check (which says ``Fabric(...)`` and
    skips strategies given by name), and at precision resolution, for a precision plugin passed in ``plugins=``. The
    intent's precision, when stated, is named too. 16-mixed is run, not refused: ``FSDP2Checks.fp16_plugin``.
    """
    try:
        precision: Precision | None = normalize_precision(precision_flag)
    except IntentError:
        precision = None  # 64-true, transformer-engine, ...: nothing autoshard plans for
    if precision is not None and cell("fsdp2", precision.feature).support.usable:
        return
    name = strategy.strategy_name
    reason = cell("fsdp2", precision.feature).reason if precision else "autoshard plans fsdp2 runs only for the precisions below"
    why = ""
    if strategy.prefer == "auto":
        why = f" {name} picks its backend when the strategy is built, before the Trainer's precision is known, and took fsdp2 for this intent."
    stated = strategy.intent.precision
    also = f" ShardingIntent(precision='{stated}') states it too." if stated and stated == precision else ""
    raise IncompatibleBackendError(
        f"Trainer(strategy='{name}', precision='{precision or precision_flag}') is not supported: {reason}.{also}{why}"
        f" Valid choices with fsdp2: {', '.join(map(repr, FSDP2_PRECISIONS))}."
        f" Fix: use Trainer(precision='bf16-mixed') (recommended), or precision='16-mixed' on a GPU without bf16"
        f" (V100, T4)"
    )


def refuse_shard_size_with_parallelize_fn(intent: ShardingIntent, parallelize_fn: ParallelizeFn | None) -> None:
    """A shard size is a setting of autoshard's own plan, which a parallelize_fn replaces: refused rather than ignored
    (both strategies, when the Trainer / Fabric is built)."""
    if intent.shard_size is not None and parallelize_fn is not None:
        raise IntentError(
            f"shard_size={intent.shard_size!r} applies to autoshard's own plan, and a parallelize_fn replaces"
            f" it, so the shard size would be ignored. Fix: drop parallelize_fn, or drop shard_size and pass"
            f" fully_shard(..., mesh=init_device_mesh(device, (replicas, shard_size))) in your parallelize_fn"
        )


class FSDP2Checks(BackendMixin):
    """Mixed in before ModelParallelStrategy by both fsdp2 strategies: what is checked when the Trainer (or Fabric) is
    built, the mesh views made in each process, and the decision for the needs found at setup."""

    strategy_name: str
    prefer = "fsdp2"
    parallelize_fn: ParallelizeFn | None  # the user's, which replaces autoshard's plan
    parallel_mesh: ParallelMesh | None = None  # views of device_mesh, made in setup_environment
    device_mesh: Any  # Lightning's one DeviceMesh, built with the dims set in _check_construction
    _data_parallel_size: Any
    _tensor_parallel_size: Any
    hooked_by: str  # how a refusal names the strategies whose hooked Lightning members are gone
    mixed_precision: type  # the front end's own MixedPrecision plugin class (16-mixed: fp16_plugin)
    auto_shard_words: tuple[str, str, str] | None = None  # auto-shard's: how fsdp2_auto_intent's refusal names it

    def __init__(
        self,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **intent_fields: Unpack[IntentKeywords],  # LightningCLI passes only the fields the config gives: intent.py
    ) -> None:
        gone = self._lightning_gone()
        if gone:  # Lightning would never call _configure_launcher: "auto" sizes would mean tensor parallel, silently
            raise lightning_lacks(gone, self.hooked_by)
        self.requested = self._wanted(as_intent(intent, **intent_fields))
        super().__init__(  # type: ignore[call-arg]
            **self._parent_arguments(),
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=self.intent.checkpoint == "distributed",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.parallelize_fn = parallelize_fn

    def _lightning_gone(self) -> list[Private]:
        """The hooked ModelParallelStrategy members this Lightning lacks (each front end's own list)."""
        raise NotImplementedError

    def _parent_arguments(self) -> dict[str, Any]:
        """What only this front end's ModelParallelStrategy takes."""
        return {}

    def _wanted(self, intent: ShardingIntent) -> ShardingIntent:
        """The intent this strategy runs: auto-shard's refuses one only DeepSpeed can run."""
        return intent if self.auto_shard_words is None else fsdp2_auto_intent(intent, *self.auto_shard_words)

    # -- construction (BackendMixin._configure_launcher): what can be refused before a process starts ------------------
    def _check_construction(self) -> None:
        self._select(MethodNeeds(), FSDP2)  # auto-shard too: it took fsdp2 for this intent (engine.auto_shard)
        dims = self._resolve_dims()  # hybrid sharding's and tensor parallel's too
        # Set before Lightning's setup_environment, which keeps sizes that are not "auto" ("auto" means tensor parallel
        # = processes per node) and builds the one mesh with them.
        self._data_parallel_size, self._tensor_parallel_size = dims.dp, dims.tp
        refuse_shard_size_with_parallelize_fn(self.intent, self.parallelize_fn)

    def _resolve_precision(self) -> PrecisionPlan | None:
        refuse_unsupported_precision(self.precision_plugin.precision, self)
        shard_aware(self.precision_plugin)  # a 16-mixed MixedPrecision passed in plugins=: its scaler made shard-aware
        return super()._resolve_precision()

    def fp16_plugin(self, accelerator: Any) -> Any:
        """The precision plugin that runs precision='16-mixed' on fsdp2, for the accelerator the Trainer (or Fabric)
        chose: the front end's own ``MixedPrecision`` with a ``ShardedLossScaler`` (``autoshard.engine.fp16``). Built by
        the guard in place of Lightning's, which refuses 16-mixed under ModelParallelStrategy and on CPU runs bf16."""
        device = accelerator_device(accelerator)
        return self.mixed_precision("16-mixed", device, scaler=sharded_scaler(device))

    # -- in each process ------------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  # Lightning builds the one DeviceMesh, with the sizes set above
        assert self.dims is not None
        self.parallel_mesh = ParallelMesh.of(self.device_mesh, self.dims)

    def _mesh(self) -> ParallelMesh:
        assert self.parallel_mesh is not None, "the mesh exists once setup_environment has run"
        return self.parallel_mesh

    def describe_mesh(self) -> dict[str, Any]:
        assert self.dims is not None
        return self.dims.describe()

    def _plan_init_from(self, module: nn.Module, needs: MethodNeeds) -> InitPlan | None:
        """The intent's init_from matched against the module on every rank; the same error everywhere if any fails."""
        if self.intent.init_from is None:
            return None
        return plan_everywhere(module, sources_of(self.intent.init_from), needs.ema_pairs, all_gather_object)

    def _decide(self, needs: MethodNeeds) -> Decision:
        decision = self._select(needs)
        if decision.backend != FSDP2:
            raise IncompatibleBackendError(
                f"auto-shard chose {decision.backend} for {self.front.checked}, but {self.front.the} was built for fsdp2."
                f" Fix: use {self.front.strategy(decision.strategy)}\n{decision.describe()}"
            )
        return decision
