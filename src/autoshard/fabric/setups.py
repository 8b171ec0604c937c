"""What a Fabric run needs, found where Fabric shows it: each ``fabric.setup`` / ``setup_module`` call, the optimizers it
hands over (and which modules each trains), EMA teachers set up with or apart from their students.

A Fabric run shows its method piece by piece; the needs so far are the ``MethodNeeds`` the Trainer path gives the
selector, so the same ``select_backend`` decides and refuses, with the same texts.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from autoshard.errors import IncompatibleBackendError
from autoshard.fabric.optimizers import ParameterNames, optimizer_parameters
from autoshard.needs import NEEDS_ATTRIBUTE, MethodNeeds, find_ema_pairs, inspect_needs, modules_trained_by

SETUP_PREFIX = "setup"  # the child names of the container cross-setup EMA pairs are searched in: "setup0", "setup1"
LIGHTNING_19773 = "https://github.com/Lightning-AI/pytorch-lightning/issues/19773"


def trains(module: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """What ``optimizer`` trains of ``module``, in words: "all of Net", "'generator'", or "no parameter of Net"."""
    held = {id(p) for p in optimizer_parameters(optimizer)}
    params = list(module.parameters())
    if params and all(id(p) in held for p in params):
        return f"all of {type(module).__name__}"
    owned = modules_trained_by(module, optimizer)
    if owned:
        return ", ".join(f"'{m}'" for m in owned[:4]) + (f" (+{len(owned) - 4} more)" if len(owned) > 4 else "")
    some = sum(1 for p in params if id(p) in held)
    return f"{some} parameter(s) of {type(module).__name__}" if some else f"no parameter of {type(module).__name__}"


@dataclass
class Setup:
    """One ``fabric.setup`` (or ``setup_module``) call: the module (weakly), its parameters before setup by name, and
    the optimizers that came with it or later through ``setup_optimizers``, each described once."""

    index: int  # 1 for the first setup call
    owner: str  # the module's class name
    module: weakref.ref[nn.Module]
    before: ParameterNames
    optimizers: list[str] = field(default_factory=list)  # "AdamW over 'generator'"
    # Its values are materialized from the meta device, not read from init_from: as an EMA teacher set up before its
    # student, it must start as a copy of the student once that one is set up.
    from_meta: bool = False

    def describe(self) -> str:
        with_optimizers = f" with {', '.join(self.optimizers)}" if self.optimizers else " without an optimizer"
        return f"fabric.setup call {self.index}: {self.owner}{with_optimizers}"


def optimizer_label(module: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__name__} over {trains(module, optimizer)}"


def run_needs(module: nn.Module, earlier: Sequence[Setup], arriving: Sequence[str], call: int) -> MethodNeeds:
    """The needs of the run so far: ``module``'s own and every optimizer Fabric has been handed, by setup call
    (``arriving``: this call's). A declared optimizer count wins, as in the Trainer path."""
    found = inspect_needs(module, callbacks=[], optimizers=[], call_hooks=False)
    declared = [s for s in found.optimizer_sources if s[0] == "declared"]
    if declared or isinstance(getattr(module, NEEDS_ATTRIBUTE, None), MethodNeeds):
        return found  # a MethodNeeds or an optimizer count the module declares: it wins
    sources = [(f"fabric.setup call {s.index}: {o}", 1) for s in earlier for o in s.optimizers]
    sources += [(f"fabric.setup call {call}: {o}", 1) for o in arriving]
    return dataclasses.replace(found, optimizer_sources=tuple(sources) or (("fabric.setup", 0),))


def cross_setup_pairs(modules: Sequence[tuple[int, nn.Module]]) -> list[tuple[int, str, int, str]]:
    """EMA pairs whose teacher and student were set up in different calls: (teacher's call, path inside it, student's
    call, path inside it); "" is the whole module."""
    if len(modules) < 2:
        return []
    container = nn.Module()
    for index, module in modules:
        container.add_module(f"{SETUP_PREFIX}{index}", module)
    out = []
    for pair in find_ema_pairs(container):
        (t_call, t_path), (s_call, s_path) = _split(pair.teacher), _split(pair.student)
        if t_call != s_call:
            out.append((t_call, t_path, s_call, s_path))
    return out


def _split(path: str) -> tuple[int, str]:
    head, _, rest = path.partition(".")
    return int(head.removeprefix(SETUP_PREFIX)), rest


def second_setup_refusal(label: str, earlier: Sequence[Setup], module: nn.Module, arriving: Sequence[str]) -> IncompatibleBackendError:
    """DeepSpeed builds one engine per setup call; a second call replaces the first one's (Lightning issue #19773)."""
    first = "; ".join(s.describe() for s in earlier)
    now = Setup(len(earlier) + 1, type(module).__name__, weakref.ref(module), ParameterNames(type(module).__name__, {}), list(arriving))
    return IncompatibleBackendError(
        f"{label} cannot take a second fabric.setup call: DeepSpeed builds one engine per call and Lightning's"
        f" DeepSpeedStrategy keeps only the last one, so the first model would be saved, clipped and stepped through the"
        f" second one's engine (Lightning issue #19773, {LIGHTNING_19773}). Already set up: {first}. Now: {now.describe()}."
        f" Backend that works: fsdp2 (strategy='fsdp2'), which sets up any number of models and optimizers."
        f" Fix: use Fabric(strategy='fsdp2') (or 'auto-shard'), or put both models in one nn.Module and set it up once"
        f" with a single optimizer over both"
    )
