"""What autoshard keeps true under FSDP2 whoever sharded the model (its plan, your configure_model, a library's
``configure_model``, your parallelize_fn): EMA teachers reshard after forward, and a step that reads a sharded
module's parameters without calling the module is explained by name instead of torch's bare DTensor error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoShardError
from autoshard.needs import EMAPair
from autoshard.privates import in_torch
from autoshard.tracebacks import user_frames

MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"
_FORWARD_LOG = "_autoshard_forward_log"
_RESHARD_HOOK = "_autoshard_reshard_hook"


def fsdp_units(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Every module ``fully_shard`` was applied to, by name, outermost first."""
    fsdp_module = in_torch.fsdp2_api()[1]
    return [(name, m) for name, m in module.named_modules(prefix=prefix) if isinstance(m, fsdp_module)]


def _outermost(units: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Named units not inside another listed one (a sharded LightningModule root, named "", is left out)."""
    out: list[tuple[str, nn.Module]] = []
    for name, unit in units:
        if name and not any(name.startswith(o + ".") for o, _ in out):
            out.append((name, unit))
    return out


def reshard_teachers(module: nn.Module, pairs: Iterable[EMAPair]) -> list[str]:
    """Make every FSDP unit of each EMA teacher reshard after forward; returns their names. ``fully_shard``'s default
    leaves a root gathered for a backward that never comes to a no_grad teacher."""
    names: list[str] = []
    for pair in pairs:
        for name, unit in fsdp_units(module.get_submodule(pair.teacher), prefix=pair.teacher):
            unit.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]
            names.append(name)
    return names


def _reshard_if_no_grad(unit: nn.Module, args: Any, output: Any) -> None:
    if not torch.is_grad_enabled():  # no backward can follow: nothing needs the gathered parameters any more
        unit.reshard()  # type: ignore[operator]


def reshard_after_no_grad_forward(module: nn.Module) -> int:
    """Every FSDP unit reshards after a forward run without grad; returns how many units. A unit first to run forward
    becomes a root and stays gathered for a backward that never comes; which one is known only at run time, so
    every unit gets the hook."""
    units = fsdp_units(module)
    for _, unit in units:
        if not getattr(unit, _RESHARD_HOOK, False):
            unit.register_forward_hook(torch.compiler.disable(_reshard_if_no_grad))  # eager: adapters.compile
            object.__setattr__(unit, _RESHARD_HOOK, True)
    return len(units)


def track_forwards(module: nn.Module) -> set[int]:
    """The ids of the FSDP units called since the set was last cleared (at each step): a unit never called is the one
    a step that mixes Tensor and DTensor read directly."""
    log: set[int] | None = getattr(module, _FORWARD_LOG, None)
    if log is None:
        log = set()
        object.__setattr__(module, _FORWARD_LOG, log)  # not a buffer, not a module: nn.Module.__setattr__ is not needed
    for _, unit in fsdp_units(module):
        if not getattr(unit, _FORWARD_LOG, False):
            unit.register_forward_pre_hook(torch.compiler.disable(lambda m, args, _log=log: _log.add(id(m))))  # eager
            object.__setattr__(unit, _FORWARD_LOG, True)
    return log


def _failing_line(exc: BaseException) -> str:
    """The innermost source line of the user's code in the traceback (not torch's, Lightning's or autoshard's),
    with indexing written as a module path (``self.blocks[0].weight`` -> ``self.blocks.0.weight``)."""
    frames = user_frames(exc)
    return re.sub(r"\[(\d+)\]", r".\1", frames[-1].line or "") if frames else ""


def unsharded_reads(module: nn.Module, called: set[int], exc: BaseException) -> list[str]:
    """Outermost FSDP units not called in this step (their parameters are still DTensors), in module order.

    When the failing line names some of them (``self.child.weight``), only those: later units also wait uncalled.
    """
    from torch.distributed.tensor import DTensor

    waiting = [
        name
        for name, unit in _outermost((n, u) for n, u in fsdp_units(module) if id(u) not in called)
        if name and any(isinstance(p, DTensor) for p in unit.parameters())
    ]
    line = _failing_line(exc)
    named = [n for n in waiting if re.search(rf"(?:^|[^\w.]|self\.){re.escape(n)}\.\w", line)]
    return named or waiting


def mixed_dtensor_error(module: nn.Module, step: str, exc: RuntimeError, called: set[int], fix: Callable[[list[str]], str]) -> AutoShardError | None:
    """torch's "mixed torch.Tensor and DTensor" in a step, as an error naming the ungathered modules and the fix."""
    names = unsharded_reads(module, called, exc)
    if not names:
        return None
    found = re.search(r"\baten\.[\w.]+", str(exc))
    op = found.group(0) if found else "an operator"
    quoted = ", ".join(f"'{n}'" for n in names)
    one = len(names) == 1
    return AutoShardError(
        f"{type(module).__name__}.{step} mixed plain tensors with sharded parameters (torch: {op} {MIXED_DTENSOR})."
        f" The parameters of {quoted} are still sharded (DTensor) at that point: FSDP2 gathers a"
        f" module's parameters only when the module itself is called, and {'it was' if one else 'they were'} not called"
        f" in this step before the parameters were used (read directly, like `{attribute(names[0])}.weight`).\n"
        f"Fix: {fix(names)}"
    )


def attribute(name: str) -> str:
    """A module path as the user wrote it: "blocks.0" -> "self.blocks[0]"."""
    return "self." + re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", name)


def call_instead(names: list[str]) -> str:
    return f"call the module (`{attribute(names[0])}(...)`) instead of reading its parameters"


class ExplainMixedDTensor:
    """Strategy mixin: torch's "mixed torch.Tensor and DTensor" in a step explained by module name."""

    _forwarded: set[int] | None = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._explained("training_step", super().training_step, *args, **kwargs)  # type: ignore[misc]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._explained("validation_step", super().validation_step, *args, **kwargs)  # type: ignore[misc]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._explained("test_step", super().test_step, *args, **kwargs)  # type: ignore[misc]

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._explained("predict_step", super().predict_step, *args, **kwargs)  # type: ignore[misc]

    def _explained(self, step: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        forwarded = self._forwarded
        if forwarded is not None:
            forwarded.clear()
        try:
            return call(*args, **kwargs)
        except RuntimeError as exc:
            module = getattr(self, "lightning_module", None)
            if forwarded is None or module is None or MIXED_DTENSOR not in str(exc):
                raise
            error = mixed_dtensor_error(module, step, exc, forwarded, self._mixed_dtensor_fix)
            if error is None:
                raise
            raise error from exc

    def _mixed_dtensor_fix(self, names: list[str]) -> str:
        quoted = ", ".join(f"'{n}'" for n in names)
        if getattr(self, "plan", None) is None:  # sharded by the user's configure_model or parallelize_fn
            return f"do not fully_shard {quoted} in your configure_model or parallelize_fn, or {call_instead(names)}"
        intent = getattr(self, "intent", None)
        exclude = [*(getattr(intent, "exclude", None) or ()), *names]
        return (
            f"keep {quoted} unsharded with Trainer(strategy={type(self).__name__}(intent=ShardingIntent(exclude={exclude!r}))),"
            f" or {call_instead(names)}"
        )
