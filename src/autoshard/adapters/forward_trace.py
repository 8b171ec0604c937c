"""One forward of a module on the meta device: the order its modules run in, and which modules were running when each
parameter was used. The plan reads both (``fsdp2.planner``): the unit that ends the forward is the one kept gathered
for backward (registration order is not forward order: litgpt's ``GPT`` registers ``lm_head`` before
``transformer``), and a unit whose parameters are used while its own forward never ran (``PeftModel.forward`` calls
``base_model.model``, not ``base_model``) would never be gathered by FSDP2.

The input is the one the module carries for such uses: a LightningModule's ``example_input_array`` (what Lightning's
model summary feeds ``forward``), or a Hugging Face model's ``dummy_inputs`` (also reached through a ``PeftModel``).
The forward runs on meta copies of every parameter, buffer and input (``torch.func.functional_call``): nothing is
computed, the module's tensors are untouched, the attributes, buffers or modules its forward sets are put back and the
random generator state is restored, so every rank traces the same and training starts as without the trace. Without such an input, or
when the forward cannot run on meta (an op that reads values), the plan says it used registration order.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoshard.privates import in_torch

PROBES = ("example_input_array", "dummy_inputs")  # the attributes a module's own example input is read from
REGISTRATION_ORDER = "registration order"  # how an untraced order starts, in words


@dataclass(frozen=True)
class ForwardTrace:
    """What one traced forward showed, or why there is none (``finished`` empty)."""

    how: str  # where the forward order comes from, in words (the plan prints it)
    finished: tuple[str, ...] = ()  # module paths in the order their forward returned ("" is the root)
    # id of each parameter used -> every stack of module paths running when it was used (outermost first)
    uses: dict[int, frozenset[tuple[str, ...]]] = field(default_factory=dict)

    @property
    def traced(self) -> bool:
        return bool(self.finished)

    def position(self, path: str) -> int | None:
        """Where ``path``'s forward returned among all modules' (None: it never ran)."""
        return self.positions.get(path)

    @cached_property
    def positions(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.finished)}


def probe_input(module: nn.Module) -> tuple[str, Any] | None:
    """(attribute, value) of the example input ``module`` carries, or None."""
    for attribute in PROBES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' deprecation notices on attribute lookups through PeftModel
            try:
                value = getattr(module, attribute, None)
            except Exception:  # a property that cannot answer: no example input
                value = None
        if value is not None and not isinstance(value, nn.Module):
            return attribute, value
    return None


def trace_forward(module: nn.Module) -> ForwardTrace:
    """One forward of ``module`` on meta with its own example input (``probe_input``); the reason when none ran."""
    name = type(module).__name__
    probe = probe_input(module)
    if probe is None:
        return ForwardTrace(
            f"{REGISTRATION_ORDER}: {name} carries no example input to trace a forward with at setup (set"
            f" {name}.example_input_array to one forward input to have it traced)"
        )
    attribute, value = probe
    wrapper = in_torch.compile_wrapper()
    if any(isinstance(m, wrapper) or in_torch.compiled_in_place(m) for m in module.modules()):
        return ForwardTrace(f"{REGISTRATION_ORDER}: {name} holds compiled modules, which a forward on meta would compile")
    from torch.distributed.tensor import DTensor

    if any(isinstance(t, DTensor) for t in (*module.parameters(), *module.buffers())):
        return ForwardTrace(f"{REGISTRATION_ORDER}: {name} holds distributed tensors already")
    try:
        finished, uses = _run(module, value)
    except Exception as exc:  # an op that reads values (.item(), nonzero) cannot run on meta
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return ForwardTrace(f"{REGISTRATION_ORDER}: a forward of {name} on its {attribute} failed on the meta device ({type(exc).__name__}: {first})")
    return ForwardTrace(f"traced: one forward of {name} on the meta device with its {attribute}", finished, uses)


class _Uses(TorchFunctionMode):
    """Records, for each parameter an op takes, the modules running at that moment."""

    def __init__(self, params: dict[int, int], stack: list[str]) -> None:
        super().__init__()
        self.params, self.stack = params, stack  # id of a meta copy -> id of the module's parameter
        self.uses: dict[int, set[tuple[str, ...]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in in_torch.tree_leaves((args, kwargs)):
            real = self.params.get(id(t)) if isinstance(t, torch.Tensor) else None
            if real is not None:
                self.uses.setdefault(real, set()).add(tuple(self.stack))
        return func(*args, **kwargs)


def _run(module: nn.Module, value: Any) -> tuple[tuple[str, ...], dict[int, frozenset[tuple[str, ...]]]]:
    """The forward on meta copies, with a hook on every module; the module as it was afterwards."""
    paths: dict[int, str] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), path)
    meta = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    real = {id(meta[n]): id(p) for n, p in module.named_parameters()}
    state = {**meta, **{n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()}}
    inputs = in_torch.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {})
    stack: list[str] = []
    finished: list[str] = []

    def enter(m: nn.Module, _args: Any) -> None:
        stack.append(paths[id(m)])

    def leave(m: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()
        finished.append(paths[id(m)])

    saved = {id(m): (m, dict(m.__dict__), _members(m)) for m in module.modules()}  # what the forward may set (caches)
    handles = [h for m in module.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    mode = _Uses(real, stack)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), mode:
            warnings.simplefilter("ignore")
            torch.func.functional_call(module, state, args, kwargs, strict=False)
    finally:
        for h in handles:
            h.remove()
        for m, attributes, members in saved.values():
            for added in _members(m) - members:  # a buffer, parameter or module registered by the forward: gone again
                delattr(m, added)
            m.__dict__.clear()
            m.__dict__.update(attributes)
    return tuple(finished), {k: frozenset(v) for k, v in mode.uses.items()}


def _members(m: nn.Module) -> set[str]:
    """The names of a module's own parameters, buffers and children."""
    return {n for n, _ in m.named_parameters(recurse=False)} | {n for n, _ in m.named_buffers(recurse=False)} | {n for n, _ in m.named_children()}
