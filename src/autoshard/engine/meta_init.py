"""Models built on the meta device (``Trainer.init_module(empty_init=True)``) under autoshard's fsdp2 strategies: what
must hold before Lightning materializes the shards, and what must follow.

Lightning materializes meta shards through each module's ``reset_parameters()`` and only warns when a module has
none: training would then start from uninitialized memory.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch

from autoshard.errors import AutoShardError
from autoshard.needs import EMAPair


@contextmanager
def configure_model_counted_as_overridden(module: torch.nn.Module) -> Iterator[None]:
    """ModelParallelStrategy.setup insists on an overridden ``configure_model``; autoshard did the sharding instead, so
    a temporary instance attribute satisfies that check."""
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
    and ``init_from`` does not fill (``covered``: the state-dict names it loads)."""
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
