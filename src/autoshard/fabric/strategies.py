"""``Fabric(strategy="fsdp2")`` and ``Fabric(strategy="auto-shard")``: Fabric's ModelParallelStrategy sharding any
``nn.Module`` itself, on the engine the Trainer's ``FSDP2Strategy`` uses, called where Fabric shows the method. What
Fabric adds: optimizers built before setup moved onto the sharded parameters, several setup calls counted as one
method, teachers set up apart from their students.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from autoshard.adapters.fsdp2 import (
    FSDP2Plan,
    Reshard,
    Role,
    check_ema_alignment,
    init_sharded_units,
    is_sharded,
    per_shard_random_init,
    sync_buffers,
)
from autoshard.checkpoint.saves import all_gather_object
from autoshard.engine.fsdp2 import FSDP2Checks
from autoshard.engine.guarantees import reshard_after_no_grad_forward
from autoshard.engine.meta_init import check_meta_init, copy_students_into_teachers
from autoshard.engine.sharding import after_materialize, shard_module, unwrap_user_compile
from autoshard.errors import AutoShardError
from autoshard.fabric.base import FabricBackend
from autoshard.fabric.checkpoint import FabricCheckpoint
from autoshard.fabric.optimizers import ParameterNames, check_trains_module, label, remap_optimizer, stale_parameters, stale_refusal
from autoshard.fabric.setups import Setup, cross_setup_pairs, optimizer_label, run_needs
from autoshard.init_from import InitReport
from autoshard.needs import EMAPair, MethodNeeds
from autoshard.privates import Private, in_lightning, missing

_BUFFER_HOOK = "_autoshard_buffer_sync"
SCALER_KEY = "autoshard_loss_scaler"  # fabric.save's entry for 16-mixed's loss scaler


def teacher_plan(student: FSDP2Plan, path: str) -> FSDP2Plan:
    """The plan that shards a teacher set up apart exactly like its student: the student's units under ``path`` ("":
    the whole set-up module), renamed into the teacher, each resharded after forward (no backward follows)."""
    prefix = f"{path}." if path else ""

    def inside(name: str) -> str | None:
        if not path:
            return name
        return "" if name == path else name[len(prefix) :] if name.startswith(prefix) else None

    units = [
        dataclasses.replace(u, name=n, role=Role.TEACHER, reshard=Reshard.TEACHER, checkpointed=False)
        for u in student.units
        if (n := inside(u.name)) is not None
    ]
    replicated = [dataclasses.replace(r, name=n, trainable=False) for r in student.replicated if (n := inside(r.name)) is not None]
    compiled = tuple(n for p in student.compiled if (n := inside(p)) is not None)  # the teacher's blocks compiled like the student's
    return FSDP2Plan(units, replicated, (), student.intent, precision=student.precision, hsdp=student.hsdp, compiled=compiled)


def _pair(teacher: nn.Module, student: nn.Module) -> tuple[nn.Module, EMAPair]:
    """A throwaway container holding both, so what is written for one module (positional EMA alignment, teachers
    copied from students) applies."""
    both = nn.Module()
    both.add_module("teacher", teacher)
    both.add_module("student", student)
    return both, EMAPair("teacher", "student")


def _sync_buffers_before_forward(module: nn.Module, mesh: Any) -> None:
    """BUFFER_RULE (adapters.fsdp2): rank 0's buffers on every rank before each training forward, as DDP's
    ``broadcast_buffers`` does in its forward (a Fabric loop has no batch hook to do it in). Once per module."""
    from torch.distributed.tensor import DTensor

    if getattr(module, _BUFFER_HOOK, False) or not any(not isinstance(b, DTensor) for b in module.buffers()):
        return

    def sync(m: nn.Module, args: Any) -> None:
        if m.training:
            sync_buffers(m, mesh)

    module.register_forward_pre_hook(torch.compiler.disable(sync))  # eager: adapters.compile
    object.__setattr__(module, _BUFFER_HOOK, True)


class FSDP2Strategy(FabricCheckpoint, FabricBackend, FSDP2Checks, ModelParallelStrategy):
    """``Fabric(strategy="fsdp2")``: pure FSDP by default (dp = world size, tp = 1), sharding at ``fabric.setup``.

    One mesh (``autoshard.mesh``), as on the Trainer side: Fabric's ``("data_parallel", "tensor_parallel")`` DeviceMesh,
    built with the dims resolved when ``Fabric()`` was built (Fabric's own "auto" sizes, tensor parallel = processes per
    node, are replaced by them before Fabric reads them); ``parallel_mesh`` holds the views the plan takes of it.
    ``tensor_parallel_size > 1`` lays each model out by its own plan (``_tp_plan``, transformers' tp plans) before
    ``fully_shard``; the ranks of a tensor-parallel group read one batch (``fabric.setup_dataloaders``).
    ``parallelize_fn(module, device_mesh)`` replaces the generic plan (``device_mesh["data_parallel"]`` is the dp
    slice); the guarantees stay.
    """

    strategy_name = "fsdp2"
    hooked_by = "Fabric strategies hook"
    mixed_precision = MixedPrecision

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``FSDP2Checks``' arguments; ``parallelize_fn`` is the user's (Fabric's own is ``self._shard``)."""
        super().__init__(*args, **kwargs)
        self.setups: list[Setup] = []  # every fabric.setup / setup_module call, in order
        self.plans: dict[int, FSDP2Plan] = {}  # autoshard's plan of each setup call (by its index), when it planned
        self.init_reports: dict[int, InitReport] = {}  # what this rank read for ShardingIntent(init_from=...)
        self._arriving: list[str] = []  # the optimizers handed over with the module being set up, described
        self._pending: tuple[int, MethodNeeds, tuple[int, str] | None] | None = None  # (call, needs, student) in setup

    def _lightning_gone(self) -> list[Private]:
        return missing(in_lightning.FABRIC, ModelParallelStrategy)

    # -- 16-mixed's loss scaler in fabric.save / fabric.load (the Trainer saves it under its plugin's name) ------------
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any = None) -> None:
        """``fabric.save``, with the loss scaler's state (scale, growth tracker) under ``SCALER_KEY`` when 16-mixed
        scales: a loaded run then scales and skips steps as the uninterrupted one would."""
        scaler = self.precision.state_dict()
        if scaler and isinstance(state, dict):
            state = {**state, SCALER_KEY: scaler}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> Any:
        """``fabric.load``; the loss scaler's saved state restored (it is not handed back with the rest)."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        scaler = remainder.pop(SCALER_KEY, None) if isinstance(remainder, dict) else None
        if scaler is not None:
            self.precision.load_state_dict(scaler)
        return remainder

    def _parent_arguments(self) -> dict[str, Any]:
        return {"parallelize_fn": self._shard}

    @property
    def plan(self) -> FSDP2Plan | None:
        """The plan of the last setup call (the Trainer strategy's attribute of the same name)."""
        return self.plans.get(len(self.setups)) if self.setups else None

    # -- fabric.setup(model, *optimizers) / fabric.setup_module(model) -----------------------------------------------
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None) -> Any:
        """The first place Fabric shows a model with its optimizers: they count towards the decision, and each one built
        before setup is moved onto the sharded parameters by name."""
        check_trains_module(module, optimizers, [s.before for s in self.setups])
        self._arriving = [optimizer_label(module, o) for o in optimizers]
        try:
            module = self.setup_module(module)
        finally:
            self._arriving = []
        return module, [self._adopt(o, label(o, i if len(optimizers) > 1 else None)) for i, o in enumerate(optimizers)], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Decide, shard, materialize, load init_from, broadcast what stays whole. Alone (the FSDP2-recommended order),
        the optimizers are checked when they arrive."""
        call = len(self.setups) + 1
        unwrap_user_compile(module)  # before anything reads names: the needs, the plan, optimizers moved by name
        before = ParameterNames.of(module)
        needs = run_needs(module, self.setups, self._arriving, call)
        self.needs, self.decision = needs, self._decide(needs)
        student = self._student_of(module, call)
        init = self._plan_init_from(module, needs)
        on_meta = check_meta_init(module, init.covered if init is not None else frozenset())
        self._pending = (call, needs, student)
        try:
            with per_shard_random_init(self.device_mesh), warnings.catch_warnings():
                if init is not None:  # modules without reset_parameters() passed check_meta_init: init_from fills them
                    warnings.filterwarnings("ignore", message="Parameter initialization incomplete")
                module = super().setup_module(module)  # -> self._shard, then Fabric materializes meta shards
        finally:
            self._pending = None
        # A teacher set up apart, meta-initialized (and not in the init_from files), starts as a copy of its student.
        from_meta = on_meta and (init is None or not init.covered)
        apart = [_pair(module, self._student_module(student))] if student is not None and from_meta else []
        report = after_materialize(module, self._mesh(), init, on_meta, needs.ema_pairs, apart)
        if report is not None:
            self.init_reports[call] = report
        reshard_after_no_grad_forward(module)  # whoever sharded: a unit forwarded without grad gives its memory back
        _sync_buffers_before_forward(module, self._mesh())
        self.setups.append(Setup(call, type(module).__name__, weakref.ref(module), before, list(self._arriving), from_meta))
        self._shard_earlier_teachers(module, call)
        self.report_decision(self.decision)
        return module

    def _shard(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Fabric's parallelize_fn: autoshard's plan, the user's sharding plus the guarantees, or a student's units."""
        assert self._pending is not None, "called by ModelParallelStrategy.setup_module only"
        call, needs, student = self._pending
        if student is not None and student[0] in self.plans:
            plan = teacher_plan(self.plans[student[0]], student[1])
            plan.apply(module, self._mesh())
            self.plans[call] = plan
            check_ema_alignment(*_pair(module, self._student_module(student)))
            rank_zero_info(f"autoshard: EMA teacher {type(module).__name__} (fabric.setup call {call}) sharded exactly like its student")
            return module
        sharded_by = None
        if is_sharded(module):
            sharded_by = "autoshard: modules already sharded (your fully_shard calls); the generic plan is skipped"
        elif self.parallelize_fn is not None:
            returned = self.parallelize_fn(module, mesh)
            module = returned if isinstance(returned, nn.Module) else module
            sharded_by = "autoshard: sharded by your parallelize_fn; the generic plan is skipped"
        plan = shard_module(
            module,
            self._mesh(),
            self.intent,
            needs,
            self.precision_plan,
            sharded_by=sharded_by,
            node_ranks=lambda: all_gather_object(self.node_rank),
        )
        if plan is not None:
            self.plans[call] = plan
        return module

    # -- EMA teachers set up apart from their students ---------------------------------------------------------------
    def _live(self) -> list[tuple[int, nn.Module]]:
        return [(s.index, m) for s in self.setups if (m := s.module()) is not None]

    def _student_of(self, module: nn.Module, call: int) -> tuple[int, str] | None:
        """(setup call, path) of the student ``module`` mirrors as a whole, when it is an EMA teacher of a model set up
        earlier (``teacher = copy.deepcopy(student)``, set up apart); a frozen part of it mirroring one is refused."""
        for t_call, t_path, s_call, s_path in cross_setup_pairs([*self._live(), (call, module)]):
            if t_call != call:
                continue
            if t_path:
                raise AutoShardError(
                    f"'{t_path}' of {type(module).__name__} (fabric.setup call {call}) is a frozen copy of a model set up"
                    f" in call {s_call}, an EMA teacher, but it is set up inside another model: it cannot be sharded like"
                    f" its student, and the positional EMA update would mix whole tensors with shards."
                    f" Fix: set the teacher up on its own (teacher = fabric.setup_module(teacher)), or set teacher and"
                    f" student up in one module"
                )
            return s_call, s_path
        return None

    def _student_module(self, student: tuple[int, str]) -> nn.Module:
        """The student (setup call, path) names, as a module."""
        setup = next(s for s in self.setups if s.index == student[0])
        owner = setup.module()
        assert owner is not None
        return owner.get_submodule(student[1])

    def _shard_earlier_teachers(self, module: nn.Module, call: int) -> None:
        """A teacher set up before its student was left whole (frozen); shard it like the student now that its plan
        exists (its parameters are equal on every rank: each keeps its shard)."""
        for t_call, t_path, s_call, s_path in cross_setup_pairs(self._live()):
            if s_call != call or t_call == call:
                continue
            teacher = next(m for i, m in self._live() if i == t_call)
            from_meta = next(s.from_meta for s in self.setups if s.index == t_call)
            if t_path:
                raise AutoShardError(
                    f"'{t_path}' of {type(teacher).__name__} (fabric.setup call {t_call}) is a frozen copy of"
                    f" {type(module).__name__} (call {call}), an EMA teacher set up inside another model: it cannot be"
                    f" sharded like its student. Fix: set the teacher up on its own, after its student"
                )
            if not is_sharded(teacher) and call in self.plans:
                plan = teacher_plan(self.plans[call], s_path)
                plan.apply(teacher, self._mesh())
                self.plans[t_call] = plan
                if from_meta:  # shard for shard: the two are sharded alike now
                    both, pair = _pair(teacher, module.get_submodule(s_path))
                    with torch.no_grad():
                        copy_students_into_teachers(both, (pair,))
                reshard_after_no_grad_forward(teacher)
                init_sharded_units(teacher)  # as after_materialize does for every setup call: before its first forward
                rank_zero_info(f"autoshard: EMA teacher {type(teacher).__name__} (fabric.setup call {t_call}) sharded exactly like its student")
            check_ema_alignment(*_pair(teacher, module.get_submodule(s_path)))

    # -- optimizers -----------------------------------------------------------------------------------------------------
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``fabric.setup_optimizers`` after ``setup_module``: moved if built before, counted with its model's setup
        call, and the decision made again."""
        optimizer = self._adopt(optimizer, label(optimizer))
        owner = self._owner(optimizer)
        if owner is not None:
            module = owner.module()
            assert module is not None
            owner.optimizers.append(optimizer_label(module, optimizer))
            assert self.needs is not None
            sources = tuple((f"fabric.setup call {s.index}: {o}", 1) for s in self.setups for o in s.optimizers)
            if not any(source == "declared" for source, _ in self.needs.optimizer_sources):
                self.needs = dataclasses.replace(self.needs, optimizer_sources=sources)
            self.decision = self._decide(self.needs)
        return optimizer

    def _owner(self, optimizer: torch.optim.Optimizer) -> Setup | None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for setup in reversed(self.setups):
            module = setup.module()
            if module is not None and any(id(p) in held for p in module.parameters()):
                return setup
        return None

    def _adopt(self, optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
        """Move what ``optimizer`` holds of each set-up model's pre-setup parameters onto the sharded ones, or refuse."""
        moved = states = 0
        for setup in self.setups:
            module = setup.module()
            if module is not None:
                done = remap_optimizer(optimizer, setup.before, module, name)
                moved, states = moved + done.parameters, states + done.states
        live = {id(p) for _, m in self._live() for p in m.parameters()}
        stale = stale_parameters(optimizer, [s.before for s in self.setups], live)
        if stale:
            raise stale_refusal(name, stale[0][0], [n for _, n in stale], "the model that held them is gone")
        if moved:
            kept = f", {states} with their state cut to this rank's shard" if states else ""
            rank_zero_info(f"autoshard: {name} was built before fabric.setup: {moved} parameter(s) moved onto the sharded ones by name{kept}")
        return optimizer


class AutoShardStrategy(FSDP2Strategy):
    """``Fabric(strategy="auto-shard")`` on fsdp2, checked again against each model at setup; built directly, it
    refuses an intent only DeepSpeed runs (the factory ``autoshard.fabric.auto_shard`` builds that one instead)."""

    strategy_name = "auto-shard"
    prefer = "auto"
    auto_shard_words = (
        "autoshard.fabric.AutoShardStrategy",
        "autoshard.fabric.auto_shard(...) and the same arguments (what Fabric(strategy='auto-shard') calls),",
        "autoshard's Fabric DeepSpeed strategy for this intent",
    )
