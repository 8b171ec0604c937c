"""What ``import autoshard`` changes in the Trainer's Lightning, done through the one record of changes
(``autoshard.install_record``), so that it can be listed and undone.

Registry entries, wrapped methods of Lightning's connectors (``install_guards``): FSDP1 is refused there, and so
are a precision fsdp2 cannot run and a SLURM number that is not one, and 16-mixed under fsdp2 gets autoshard's plugin
(both connectors, the Trainer's and Fabric's); and ``Trainer._run``, wrapped to record the
checkpoint a run resumes from (``run_arguments``). ``FSDPStrategy`` itself is left as Lightning wrote it: other
libraries construct it (stable-pretraining's tests do, to test their refusal). A member this Lightning lacks is never
wrapped (``check_lightning`` says so).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from autoshard.backends import fsdp1
from autoshard.errors import IncompatibleBackendError
from autoshard.install_record import TRAINER_KINDS, Change, ChangeKind, record
from autoshard.install_record import uninstall as uninstall_changes
from autoshard.privates import in_lightning

FSDP1_REFUSAL = (
    "FSDP1 (strategy='fsdp' / FSDPStrategy) is refused by autoshard: {reason}. Backend that works: fsdp2."
    " Fix: use strategy='fsdp2' (or strategy='auto-shard' to let autoshard choose)"
)
_MARK = "_autoshard_guard"


# Trainer -> (ckpt_path, weights_only) of its Trainer._run call in progress
_RUNS: weakref.WeakKeyDictionary[Any, tuple[Any, bool | None]] = weakref.WeakKeyDictionary()


def run_arguments(trainer: Any) -> tuple[Any, bool | None] | None:
    """(ckpt_path, weights_only) of ``trainer``'s fit, validate, test or predict in progress (the path already resolved
    from "last", "best" or "hpc"); None outside one, or when this Lightning has no ``Trainer._run`` to wrap."""
    return _RUNS.get(trainer)


def fsdp1_refusal() -> str:
    return FSDP1_REFUSAL.format(reason=fsdp1.REASON)


def uninstall() -> list[Change]:
    """Undo the Trainer's changes (registry entries, wrapped methods), newest first; returns them. Fabric's registry
    entries stay (``autoshard.fabric.uninstall()``; ``autoshard.uninstall()`` undoes both)."""
    return uninstall_changes(TRAINER_KINDS)


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], why: str) -> bool:
    """Replace ``owner.name`` by ``make(original)``, once; False (nothing changed) when this Lightning lacks it."""
    if not hasattr(owner, name):
        return False
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return True
    own, raw = name in vars(owner), vars(owner).get(name)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)

    def undo() -> None:
        if own:
            setattr(owner, name, raw)
        else:
            delattr(owner, name)  # it was inherited: inherit it again

    record(Change(ChangeKind.WRAPPED, f"{owner.__name__}.{name}", f"{__name__} wrapper", why, undo))
    return True


def _record_run(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._run`` that keeps its (ckpt_path, weights_only) in ``_RUNS`` while it runs (``run_arguments``)."""
    signature = inspect.signature(original)

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        _RUNS[self] = (arguments.get("ckpt_path"), arguments.get("weights_only"))
        try:
            return original(self, *args, **kwargs)
        finally:
            _RUNS.pop(self, None)

    return run


def install_guards(fsdp2_class: type, refuse_precision: Callable[[object, Any], None]) -> None:
    """Idempotent; ``fsdp2_class`` / ``refuse_precision`` are passed in, as this module sits below the strategies."""
    from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import FSDPStrategy

    from autoshard.engine.fsdp2 import FSDP2Checks
    from autoshard.engine.launch import SLURM_READ_BY_LIGHTNING, check_slurm_numbers

    def check_strategy(original: Callable[..., Any]) -> Callable[..., Any]:
        def check(self: Any) -> None:
            # Before Lightning's own check, which refuses FSDP on CPU with its own text.
            flag = getattr(self, "_strategy_flag", None)
            if isinstance(flag, FSDPStrategy) or (isinstance(flag, str) and flag in FSDPStrategy.get_registered_strategies()):
                raise IncompatibleBackendError(fsdp1_refusal())
            original(self)

        return check

    def validate_precision(original: Callable[..., Any]) -> Callable[..., Any]:
        def validate(self: Any) -> None:
            # Lightning checks only strategy *instances* (not names), says "Fabric(...)", and on CPU silently turns
            # 16-mixed into bf16-mixed later: refuse first, for names and instances alike.
            strategy = getattr(self, "strategy", None)
            if isinstance(strategy, fsdp2_class) and hasattr(self, "_precision_flag"):
                refuse_precision(self._precision_flag, strategy)
            original(self)

        return validate

    _wrap(
        in_lightning.AcceleratorConnector,
        "_check_strategy_and_fallback",
        check_strategy,
        "Trainer(strategy='fsdp'), 'fsdp_cpu_offload' or an FSDPStrategy object is refused with the redirect to fsdp2,"
        " before Lightning's own CPU check replaces it (FSDPStrategy itself stays constructible)",
    )

    def check_cluster_environment(original: Callable[..., Any]) -> Callable[..., Any]:
        def choose(self: Any) -> Any:
            # Lightning reads SLURM's numbers with a bare int() while it picks the cluster environment, before any
            # strategy exists: a value set by hand is named here with the fix (for every strategy, where Lightning
            # would raise anyway; IntentError is a ValueError, as Lightning's was).
            if not isinstance(getattr(self, "_cluster_environment_flag", None), ClusterEnvironment) and SLURMEnvironment.detect():
                check_slurm_numbers(SLURM_READ_BY_LIGHTNING)
            return original(self)

        return choose

    for connector in (in_lightning.AcceleratorConnector, in_lightning.FabricConnector):  # Trainer(...) and Fabric(...) pick it alike
        _wrap(
            connector,
            "_choose_and_init_cluster_environment",
            check_cluster_environment,
            "under SLURM, a task count or rank that is not a number (SLURM_NTASKS=abc, set by hand) is refused by name"
            " with the fix, before Lightning's bare int() error",
        )
    _wrap(
        in_lightning.AcceleratorConnector,
        "_validate_precision_choice",
        validate_precision,
        "a precision fsdp2 cannot run (64-true, ...) is refused in Trainer terms, for strategy names too (Lightning"
        " checks instances only and says 'Fabric(...)')",
    )

    def fp16_under_fsdp2(flag: str, given: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def init(self: Any) -> Any:
                # Lightning refuses 16-mixed under ModelParallelStrategy objects (no sharded grad scaler) and on CPU
                # runs bf16-mixed instead: autoshard's fsdp2 strategies bring the plugin (a plugin the user passed stays).
                strategy = getattr(self, "strategy", None)
                if isinstance(strategy, FSDP2Checks) and getattr(self, flag, None) == "16-mixed" and getattr(self, given, None) is None:
                    return strategy.fp16_plugin(self.accelerator)
                return original(self)

            return init

        return make

    for connector, flag, given in (
        (in_lightning.AcceleratorConnector, "_precision_flag", "_precision_plugin_flag"),
        (in_lightning.FabricConnector, "_precision_input", "_precision_instance"),
    ):
        _wrap(
            connector,
            "_check_and_init_precision",
            fp16_under_fsdp2(flag, given),
            "precision='16-mixed' under fsdp2 / auto-shard runs with Lightning's MixedPrecision and autoshard's sharded"
            " grad scaler (an inf in any rank's shard skips the step on every rank), on CPU too; Lightning refuses"
            " 16-mixed under ModelParallelStrategy and on CPU runs bf16-mixed instead",
        )

    _wrap(
        Trainer,
        "_run",
        _record_run,
        "records the call's ckpt_path and weights_only while it runs: Lightning restores a checkpoint after the"
        " strategy's setup, and a memory budget's stored decision must be read before anything is sharded",
    )
