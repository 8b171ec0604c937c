"""Lightning strategies "fsdp2" and "auto-shard": ModelParallelStrategy that shards any LightningModule itself."""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping
from contextlib import contextmanager
from datetime import timedelta
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from autoshard.adapters.fsdp2 import (
    FSDP2Plan,
    ParallelizeFn,
    average_unsharded_gradients,
    broadcast_unsharded,
    check_ema_alignment,
    data_parallel_mesh,
    is_sharded,
    per_shard_random_init,
    plan_fsdp2,
    sync_buffers,
)
from autoshard.backends import fsdp2 as fsdp2_backend
from autoshard.backends import get_backend
from autoshard.backends.matrix import cell
from autoshard.batchnorm import convert_sync_batchnorm
from autoshard.errors import AutoShardError, BackendUnavailableError, IncompatibleBackendError, IntentError
from autoshard.init_from import InitPlan, InitReport, load_init_from, plan_everywhere, sources_of
from autoshard.intent import ShardingIntent, as_intent
from autoshard.lightning.base import BackendMixin
from autoshard.lightning.checkpoint import CheckpointMixin
from autoshard.lightning.compat import PIN, SUPPORTED_LIGHTNING, missing
from autoshard.lightning.guarantees import ExplainMixedDTensor, reshard_after_no_grad_forward, reshard_teachers, track_forwards
from autoshard.needs import EMAPair, MethodNeeds, inspect_needs, recount_optimizers
from autoshard.precision import Precision, PrecisionPlan, normalize_precision
from autoshard.select import Decision, select_backend

if TYPE_CHECKING:
    import lightning.pytorch as pl

BACKEND = fsdp2_backend.BACKEND.name  # "fsdp2": what a decision is compared with, never the literal

FSDP2_PRECISIONS = tuple(p.value for p in Precision if cell("fsdp2", p.feature).support.usable)


def refuse_unsupported_precision(trainer_precision: object, strategy: FSDP2Strategy) -> None:
    """Refuse, in Trainer terms, a precision fsdp2 cannot run (the matrix's FP16_MIXED cell says why).

    Called by the guard on the Trainer's precision flag, before Lightning's own check (which says ``Fabric(...)``,
    skips strategies given by name, and on CPU turns 16-mixed into bf16-mixed right after), and at precision
    resolution, for a precision plugin passed in ``plugins=``. The intent's precision, when stated, is named too.
    """
    try:
        precision: Precision | None = normalize_precision(trainer_precision)
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
        f"Trainer(strategy='{name}', precision='{precision or trainer_precision}') is not supported: {reason}.{also}{why}"
        f" Valid choices with fsdp2: {', '.join(map(repr, FSDP2_PRECISIONS))}."
        f" Fix: use Trainer(precision='bf16-mixed') (recommended), or strategy='autoshard-deepspeed' for a"
        f" single-optimizer method that needs fp16"
    )


def _tasks_per_node(spec: str) -> list[int]:
    """SLURM's task-count lists, one count per node: ``"8"``, ``"2(x3)"`` (3 nodes of 2), ``"4,2"``, ``"2(x2),1"``."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.strip().partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts


def _slurm_first(*names: str) -> tuple[str, str] | None:
    """The first of ``names`` SLURM set, with its value: a step's own variable before the allocation's."""
    return next(((name, os.environ[name]) for name in names if os.environ.get(name)), None)


def check_slurm(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """Under srun the world comes from SLURM, not ``devices=`` / ``num_nodes=``: a mismatch must stop before any
    process waits, and it must stop here, as ModelParallelStrategy starts no launcher under SLURM, so Lightning's own
    ``SLURMEnvironment.validate_settings`` never runs (and it reads ``SLURM_NTASKS_PER_NODE`` as a plain number).

    ``environment``: the cluster environment Lightning chose (None: detected as Lightning does, torchrun first, so
    torchrun started inside an srun allocation is checked by ``check_torchrun``, not here). Tasks per node are read
    from the step (``SLURM_STEP_TASKS_PER_NODE``, what srun started), else ``SLURM_NTASKS_PER_NODE``, else the
    allocation's ``SLURM_TASKS_PER_NODE`` (``"2(x3)"``, ``"4,2"``), else ``SLURM_NTASKS`` / nodes; nodes from the
    step (``SLURM_STEP_NUM_NODES``), else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``. ``shard_size='node'`` resolves
    to ``devices``, so it is the tasks of one node once this check passes.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if environment is not None and not isinstance(environment, SLURMEnvironment):
        return
    if environment is None and (TorchElasticEnvironment.detect() or not SLURMEnvironment.detect()):
        return
    if SLURMEnvironment.job_name() in ("bash", "interactive"):
        return
    found = _slurm_first("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    nodes = int(found[1]) if found else None
    spec = _slurm_first("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if spec is not None:
        counts = _tasks_per_node(spec[1])
        if len(set(counts)) > 1:
            raise IntentError(
                f"SLURM started a different number of tasks on each node ({spec[0]}={spec[1]!r}), but every node must"
                f" run the same number of tasks, one per device: Lightning takes the local ranks and the sharding takes"
                f" its node groups from Trainer(devices=N) on every node. Fix: launch with `srun --nodes={nodes or len(counts)}"
                f" --ntasks-per-node={num_processes} python train.py` and no --ntasks / -n: a total that is not nodes x tasks"
                f" per node leaves a node short"
            )
        tasks = counts[0]
        nodes = nodes or (len(counts) if "(x" in spec[1] or "," in spec[1] else None)
    else:
        total = int(os.environ["SLURM_NTASKS"])
        tasks = total // (nodes or max(num_nodes, 1))
    nodes = nodes if nodes is not None else num_nodes
    if tasks != num_processes:
        both = f", num_nodes={nodes}" if nodes != num_nodes else ""
        srun_nodes = f"--nodes={num_nodes} " if nodes != num_nodes else ""
        raise IntentError(
            f"SLURM started {tasks} task(s) per node but Trainer(devices={num_processes}): under srun Lightning takes"
            f" the world size from SLURM, so the two must be equal (one task per device). Fix: set"
            f" Trainer(devices={tasks}{both}), or launch with `srun {srun_nodes}--ntasks-per-node={num_processes}"
            f" --gres=gpu:{num_processes} python train.py`"
        )
    if nodes != num_nodes:
        raise IntentError(
            f"SLURM allocated {nodes} node(s) but Trainer(num_nodes={num_nodes}): under srun the world is SLURM's"
            f" {nodes} x {tasks} tasks, so the ranks and every node group (shard_size='node') would be wrong. Fix: set"
            f" Trainer(num_nodes={nodes}), or launch with `srun --nodes={num_nodes} --ntasks-per-node={tasks}`"
        )


def check_torchrun(num_processes: int, num_nodes: int, environment: object | None = None) -> None:
    """Under torchrun the world comes from its ``--nnodes`` x ``--nproc-per-node``, not ``devices=`` / ``num_nodes=``.

    Lightning never compares the two for ModelParallelStrategy (no launcher of its own when processes are started
    outside), so a forgotten ``num_nodes=2`` only fails once the process group exists, with Lightning's "sizes ...
    should equal the world size", and ``shard_size='node'`` would have resolved to the whole world (no hybrid
    sharding). ``environment``: the cluster environment Lightning chose (None: detected).
    """
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    if environment is not None and not isinstance(environment, TorchElasticEnvironment):
        return
    if environment is None and not TorchElasticEnvironment.detect():
        return
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    nodes = world // per_node if per_node and world % per_node == 0 else None
    if per_node != num_processes or world != num_processes * num_nodes:
        fix = (
            f"set Trainer(devices={per_node}, num_nodes={nodes}), or launch with `torchrun --nnodes={num_nodes} --nproc-per-node={num_processes} ...`"
            if nodes
            else f"start every node with the same `torchrun --nproc-per-node={num_processes}`"
        )
        raise IntentError(
            f"torchrun started {world} processes, {per_node} on this node (WORLD_SIZE={world}, LOCAL_WORLD_SIZE="
            f"{per_node}), but Trainer(devices={num_processes}, num_nodes={num_nodes}) describes"
            f" {num_processes * num_nodes} ranks, {num_processes} per node: the ranks, the data-parallel mesh and"
            f" every node group (shard_size='node') would be wrong. Fix: {fix}"
        )


def check_node_groups(node_ranks: list[int], shard: int) -> None:
    """``shard_size='node'`` promises one node per shard group, and the groups are consecutive ranks (``hsdp_mesh``).

    torchrun and SLURM's default block distribution number the ranks node by node; ``srun --distribution=cyclic``
    deals them round-robin, and a group would then span nodes: every all-gather and reduce-scatter on the network.
    ``node_ranks``: each global rank's node rank, in rank order (the same list on every rank, so the same error).
    """
    groups = [node_ranks[i : i + shard] for i in range(0, len(node_ranks), shard)]
    spans = [(i, sorted(set(g))) for i, g in enumerate(groups) if len(set(g)) > 1]
    if spans:
        first, nodes = spans[0]
        raise AutoShardError(
            f"shard_size='node' needs each node's {shard} ranks to be consecutive, but ranks"
            f" {first * shard}-{first * shard + shard - 1} (shard group {first}) are on nodes {nodes} (node rank of each"
            f" rank: {node_ranks}): the launcher did not number the ranks node by node (SLURM's"
            f" --distribution=cyclic does that), so each shard group would span nodes. Fix: launch with `srun"
            f" --distribution=block` (SLURM's default) or torchrun, which number the ranks node by node"
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


def check_meta_init(module: torch.nn.Module, covered: Collection[str] = frozenset()) -> bool:
    """True when built on the meta device; refuses modules whose parameters reset_parameters() would not initialize
    and ``init_from`` does not fill (``covered``: the state-dict names it loads).

    Lightning only warns there, and training would start from uninitialized memory.
    """
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return False

    def filled(path: str, m: torch.nn.Module) -> bool:
        own = [n for n, _ in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]
        return bool(covered) and all((f"{path}.{n}" if path else n) in covered for n in own)

    missing = sorted(
        {
            type(m).__name__
            for path, m in module.named_modules()
            if any(True for _ in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
            and not callable(getattr(m, "reset_parameters", None))
            and not filled(path, m)
        }
    )
    if missing:
        raise AutoShardError(
            f"the model was built on the meta device (empty_init=True), but {', '.join(missing)} own parameters or"
            f" buffers and define no reset_parameters(), so they would start from uninitialized memory (no init_from"
            f" file holds them). Fix: define reset_parameters() on them, load them with ShardingIntent(init_from=PATH),"
            f" or build the model without empty_init=True"
        )
    return True


@torch.no_grad()
def copy_students_into_teachers(module: torch.nn.Module, pairs: tuple[EMAPair, ...]) -> None:
    """After meta init each side got its own random init; an EMA teacher must start as a copy of its student."""
    for pair in pairs:
        teacher, student = module.get_submodule(pair.teacher), module.get_submodule(pair.student)
        for t, s in zip((*teacher.parameters(), *teacher.buffers()), (*student.parameters(), *student.buffers())):
            t.copy_(s)


class FSDP2Strategy(BackendMixin, ExplainMixedDTensor, CheckpointMixin, ModelParallelStrategy):
    """``strategy="fsdp2"``: pure FSDP by default (dp = world size, tp = 1), sharding at setup, no module change.

    ``parallelize_fn(module, device_mesh)`` replaces the generic plan; ``device_mesh["data_parallel"]`` is the dp slice.
    ``shard_size=`` (hybrid sharding) gives the plan its own 2-D (replicate, shard) mesh of the dp ranks
    (``adapters.fsdp2.hsdp_mesh``); ``device_mesh`` stays Lightning's, so sampler and replicated state span every dp rank.
    """

    strategy_name = "fsdp2"
    prefer = "fsdp2"

    def __init__(
        self,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **intent_fields: Any,
    ) -> None:
        gone = missing(ModelParallelStrategy)
        if gone:  # Lightning would never call _configure_launcher: "auto" sizes would mean tensor parallel, silently
            raise BackendUnavailableError(
                f"lightning {metadata.version('lightning')} lacks {', '.join(gone)}, which autoshard's fsdp2 strategies"
                f" hook (verified on lightning {SUPPORTED_LIGHTNING}). Fix: {PIN}"
            )
        self.intent = as_intent(intent, **intent_fields)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=self.intent.checkpoint == "distributed",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.parallelize_fn = parallelize_fn
        self.plan: FSDP2Plan | None = None
        self.init_report: InitReport | None = None  # what this rank read for ShardingIntent(init_from=...)

    # -- Trainer construction (BackendMixin._configure_launcher): what can be refused before a process starts ----
    def _check_construction(self) -> None:
        self._select(MethodNeeds(), self._prefer_at_construction())
        check_torchrun(self.num_processes, self.num_nodes, self.cluster_environment)
        check_slurm(self.num_processes, self.num_nodes, self.cluster_environment)
        # Set before Lightning's setup_environment, which keeps sizes that are not "auto".
        self._data_parallel_size, self._tensor_parallel_size = self._mesh_sizes()
        tp = self.intent.tensor_parallel_size
        if self.intent.shard_size is not None and self.parallelize_fn is not None:
            raise IntentError(
                f"shard_size={self.intent.shard_size!r} applies to autoshard's own plan, and a parallelize_fn replaces"
                f" it, so the shard size would be ignored. Fix: drop parallelize_fn, or drop shard_size and pass"
                f" fully_shard(..., mesh=init_device_mesh(device, (replicas, shard_size))) in your parallelize_fn"
            )
        if tp > 1 and self.parallelize_fn is None:
            raise IntentError(
                f"tensor_parallel_size={tp} needs a parallelize_fn: autoshard has no generic tensor-parallel layout, so"
                f" nothing would be split across the {tp} tensor-parallel ranks and they would all train on the same"
                f" batch. Fix: pass FSDP2Strategy(parallelize_fn=fn), where fn(module, device_mesh) applies a"
                f" tensor-parallel layout on device_mesh['tensor_parallel'], or set tensor_parallel_size=1"
            )

    def _prefer_at_construction(self) -> str:
        return self.prefer

    def _resolve_precision(self) -> PrecisionPlan | None:
        refuse_unsupported_precision(self.precision_plugin.precision, self)
        return super()._resolve_precision()

    # -- In each process --------------------------------------------------------------------------------------
    def _decide(self, needs: MethodNeeds) -> Decision:
        decision = self._select(needs)
        if decision.backend != BACKEND:
            raise IncompatibleBackendError(
                f"auto-shard chose {decision.backend} for this method, but the Trainer was built for fsdp2."
                f" Fix: use strategy='{decision.strategy}'\n{decision.describe()}"
            )
        return decision

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        # No user hook is called to inspect the method (stable-pretraining's probes assert configure_optimizers runs
        # once): fsdp2 runs any number of optimizers, so the sharding is decided without counting them, and they
        # are counted from Lightning's own call below, for the printed decision.
        self.needs = inspect_needs(module, trainer, call_hooks=False)
        self.decision = self._decide(self.needs)
        init = self._plan_init_from(module)  # names missing, unexpected and reshaped weights before anything is sharded
        on_meta = check_meta_init(module, init.covered if init is not None else frozenset())
        already_sharded = is_sharded(module)
        if already_sharded or self.parallelize_fn is not None:
            if already_sharded:
                if self.intent.shard_size is not None:
                    raise IntentError(
                        f"shard_size={self.intent.shard_size!r} applies to autoshard's own plan, but your configure_model"
                        f" already sharded the modules, so it would be ignored. Fix: drop shard_size and pass"
                        f" mesh=init_device_mesh(device, (replicas, shard_size)) to your fully_shard calls, or let"
                        f" autoshard shard (remove fully_shard from configure_model)"
                    )
                rank_zero_info("autoshard: modules already sharded (your configure_model); the generic plan is skipped")
            else:
                self.parallelize_fn(module, self.device_mesh)  # type: ignore[misc]
                rank_zero_info("autoshard: sharded by your parallelize_fn; the generic plan is skipped")
            average_unsharded_gradients(module, data_parallel_mesh(self.device_mesh))
            for pair in self.needs.ema_pairs:
                check_ema_alignment(module, pair)
            # The plan's guarantees, whoever sharded: teachers (and units forwarded without grad) reshard after forward.
            teachers = reshard_teachers(module, self.needs.ema_pairs)
            reshard_after_no_grad_forward(module)
            if teachers:
                rank_zero_info(f"autoshard: EMA teacher units reshard after forward: {', '.join(teachers)}")
        else:
            self.plan = plan_fsdp2(module, self.intent, self.needs, self.precision_plan)
            self.plan.sync_batchnorm = self._layer_sync is not None
            self.plan.hsdp = self.hsdp_sizes
            if self.intent.shard_size == "node" and self.hsdp_sizes is not None:
                check_node_groups(self._all_gather(self.node_rank), self.hsdp_sizes[1])
            self.plan.apply(module, self.device_mesh)
            rank_zero_info(self.plan.describe(self.describe_mesh()))
        self._forwarded = track_forwards(module)
        if self._layer_sync is not None:  # Trainer(sync_batchnorm=True); ModelParallelStrategy ignores it
            convert_sync_batchnorm(module, data_parallel_mesh(self.device_mesh).get_group())
        with _configure_model_counted_as_overridden(module), per_shard_random_init(self.device_mesh), warnings.catch_warnings():
            if init is not None:  # modules without reset_parameters() passed check_meta_init: init_from fills them
                warnings.filterwarnings("ignore", message="Parameter initialization incomplete")
            super().setup(trainer)  # materializes meta shards locally through reset_parameters()
        if trainer.state.fn == TrainerFn.FITTING:  # Lightning's single configure_optimizers call has run
            self.needs = recount_optimizers(self.needs, module, self.optimizers, trainer)
            self.decision = self._decide(self.needs)
        self.report_decision(self.decision)
        if init is not None:  # after materialization, before teachers copy students and rank 0's copy is broadcast
            self.init_report = load_init_from(module, init)
            rank_zero_info(self.init_report.describe())
        if on_meta or init is not None:  # teachers the files do not hold start as copies of their (loaded) students
            copy_students_into_teachers(module, init.copy_teachers if init is not None else self.needs.ema_pairs)
        broadcast_unsharded(module, self.device_mesh)

    def _plan_init_from(self, module: torch.nn.Module) -> InitPlan | None:
        """The intent's init_from matched against the module on every rank; the same error everywhere if any fails."""
        if self.intent.init_from is None:
            return None
        assert self.needs is not None
        return plan_everywhere(module, sources_of(self.intent.init_from), self.needs.ema_pairs, self._all_gather)

    # -- Buffers: rank 0's copy wins (BUFFER_RULE in autoshard.adapters.fsdp2; DDP's broadcast_buffers=True) --------
    def _sync_buffers(self) -> None:
        assert self.lightning_module is not None
        sync_buffers(self.lightning_module, self.device_mesh)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._sync_buffers()
        super().on_train_batch_start(batch, batch_idx)

    def on_validation_start(self) -> None:
        self._sync_buffers()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self._sync_buffers()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_buffers()  # the checkpoint holds rank 0's buffers, and so does every rank after it
        return super().lightning_module_state_dict()

    def describe_mesh(self) -> dict[str, Any]:
        return {
            "data_parallel_size": self._data_parallel_size,
            "tensor_parallel_size": self._tensor_parallel_size,
            "world_size": self.world_size,
            **({"hsdp": self.hsdp_sizes} if self.hsdp_sizes else {}),
        }


class AutoShardStrategy(FSDP2Strategy):
    """``strategy="auto-shard"``: the backend the selector picks; checked again against the module at setup.

    The intent alone can require DeepSpeed (NVMe or optimizer-only offload): then construction returns
    autoshard's DeepSpeed strategy instead. The method is only known at setup, where a misfit is refused.
    Precision takes no part in that choice: the Trainer's is not known at construction, so the intent's is ignored
    there too, and a precision only DeepSpeed runs is refused once the Trainer is built, wherever it was stated.
    """

    strategy_name = "auto-shard"
    prefer = "auto"

    def __new__(
        cls,
        intent: ShardingIntent | Mapping[str, Any] | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **intent_fields: Any,
    ) -> Any:
        wanted = as_intent(intent, **intent_fields)
        needed = select_backend(MethodNeeds(), wanted.replace(precision=None)).backend
        if needed != BACKEND:
            if parallelize_fn is not None:
                raise IntentError(
                    "this intent needs DeepSpeed (only it has what it asks for), and DeepSpeed takes no parallelize_fn."
                    " Fix: drop parallelize_fn, or change the intent so that fsdp2 can run it"
                )
            chosen = get_backend(needed).strategy_class()(wanted, process_group_backend=process_group_backend, timeout=timeout)
            chosen.requested_as = cls.strategy_name  # its refusals must not propose the auto-shard the user is on
            return chosen
        return super().__new__(cls)

    def _prefer_at_construction(self) -> str:
        return "fsdp2"
