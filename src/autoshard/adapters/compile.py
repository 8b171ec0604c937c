"""``torch.compile`` with sharding: each planned block compiled in place, and a model the user compiled unwrapped.

Each block of the fsdp2 plan is compiled in torchtitan's order (checkpointing, compile, ``fully_shard``) and IN PLACE,
``block.compile()``: the module keeps its name and hooks. ``torch.compile(block)`` returns an ``OptimizedModule``
wrapper whose parameters are named ``_orig_mod.`` in every state dict, and whose ``__call__`` bypassed fully_shard's
hooks in the torch release Accelerate's first regional compile ran on (9.8% MFU instead of 23.4%; on torch 2.13 the
hooks fire through it). A model the user compiled is unwrapped at setup (``unwrap_compiled``), so the plan and every
checkpoint see the eager names, and its blocks are compiled in place as for ``compile=True``.

Every hook autoshard adds to a module runs eager (``torch.compiler.disable``), as fully_shard's own do: dynamo traces
each hook of a block compiled in place as a frame of its own, with its own guards, and ``clone_view_outputs`` became a
graph of its own that returns its input: one more compiled call and autograd node per block, per step.

``AUTOSHARD_COMPILE_BACKEND`` names the ``torch.compile`` backend (default inductor); tests use ``aot_eager``.
"""

from __future__ import annotations

import os
from enum import Enum

from torch import nn

from autoshard.errors import IntentError
from autoshard.intent import COMPILE_AUTO
from autoshard.needs import COMPILED_ATTRIBUTE, ORIG_MOD, eager_name
from autoshard.privates import in_torch

BACKEND_ENV = "AUTOSHARD_COMPILE_BACKEND"


class Compile(str, Enum):
    """``ShardingIntent.compile`` as the code branches on it."""

    OFF = "off"  # eager, unless the user compiled part of the model
    BLOCKS = "blocks"  # each planned block compiled in place before fully_shard
    AUTO = "auto"  # memory_budget's to choose; eager until it does

    @classmethod
    def of(cls, value: bool | str) -> Compile:
        return cls.BLOCKS if value is True else cls.AUTO if value == COMPILE_AUTO else cls.OFF


def unwrap_compiled(module: nn.Module) -> list[str]:
    """Replace every ``torch.compile`` wrapper (``OptimizedModule``) inside ``module`` by the module it wraps, marked
    ``COMPILED_ATTRIBUTE``; the eager paths replaced. ``module`` itself is the caller's to unwrap (Lightning and Fabric
    do it for the module they are given)."""
    wrapper_class = in_torch.compile_wrapper()
    if not wrapper_class:  # torch._dynamo never imported: nothing was compiled
        return []
    unwrapped = []
    while True:  # one at a time, outermost first: replacing one renames the wrappers inside it (no more '_orig_mod.')
        found = next(((n, m) for n, m in module.named_modules() if n and isinstance(m, wrapper_class)), None)
        if found is None:
            return unwrapped
        name, wrapper = found
        inner = getattr(wrapper, ORIG_MOD)
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, inner)
        setattr(inner, COMPILED_ATTRIBUTE, True)
        unwrapped.append(eager_name(name))


def compile_in_place(module: nn.Module) -> bool:
    """``module.compile()`` with the backend ``AUTOSHARD_COMPILE_BACKEND`` names (torch's default otherwise); False when
    it is compiled in place already (the user's own ``compile()`` and its options are kept)."""
    if in_torch.compiled_in_place(module):
        return False
    backend = os.environ.get(BACKEND_ENV)
    module.compile(**({"backend": backend} if backend else {}))
    return True


def nothing_to_compile(module: nn.Module, blocks: tuple[str, ...] | None) -> IntentError:
    """compile=True and no block to compile: refused rather than training eager while the user believes it compiled."""
    named = f" among the blocks named ({', '.join(map(repr, blocks))})" if blocks else " (none found by structure)"
    return IntentError(
        f"compile=True compiles the repeated blocks (transformer layers, residual stages) before fully_shard, and"
        f" {type(module).__name__} has none{named}. Fix: name the blocks, ShardingIntent(blocks=['MyBlock']), or drop"
        f" compile and compile a submodule yourself (self.net = torch.compile(net): autoshard compiles it in place)"
    )
