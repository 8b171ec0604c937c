"""Fail-fast guards installed on ``import autoshard``: FSDP1 and fp16-under-fsdp2 are refused with a redirect.

They wrap FSDPStrategy.__init__ and two private checks of Lightning's accelerator connector (listed in
autoshard.lightning.compat); every such wrap lives only here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from autoshard.backends import fsdp1
from autoshard.errors import IncompatibleBackendError

FSDP1_REFUSAL = (
    "FSDP1 (strategy='fsdp' / FSDPStrategy) is refused by autoshard: {reason}. Backend that works: fsdp2."
    " Fix: use strategy='fsdp2' (or strategy='auto-shard' to let autoshard choose)"
)


def fsdp1_refusal() -> str:
    return FSDP1_REFUSAL.format(reason=fsdp1.REASON)


def _wrap_once(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make(original)`` unless autoshard already did: re-imports stay harmless."""
    original = getattr(owner, name)
    if getattr(original, "_autoshard_guard", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper._autoshard_guard = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def install_guards() -> None:
    """Idempotent: refuse FSDP1 at construction and by name, and fp16 under fsdp2 before Lightning's own check."""
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    def refuse_fsdp1(original: Callable[..., Any]) -> Callable[..., Any]:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            raise IncompatibleBackendError(fsdp1_refusal())

        return init

    def check_strategy(original: Callable[..., Any]) -> Callable[..., Any]:
        def check(self: Any) -> None:
            # Lightning refuses "fsdp" on CPU here with its own text, before the class is ever built.
            flag = self._strategy_flag
            if isinstance(flag, str) and flag in FSDPStrategy.get_registered_strategies():
                raise IncompatibleBackendError(fsdp1_refusal())
            original(self)

        return check

    def validate_precision(original: Callable[..., Any]) -> Callable[..., Any]:
        def validate(self: Any) -> None:
            # Lightning checks only strategy *instances* (not names), says "Fabric(...)", and on CPU silently turns
            # 16-mixed into bf16-mixed later: refuse first, for names and instances alike.
            from autoshard.lightning.fsdp2 import FSDP2Strategy, refuse_unsupported_precision

            if isinstance(self.strategy, FSDP2Strategy):
                refuse_unsupported_precision(self._precision_flag, self.strategy)
            original(self)

        return validate

    _wrap_once(FSDPStrategy, "__init__", refuse_fsdp1)
    _wrap_once(_AcceleratorConnector, "_check_strategy_and_fallback", check_strategy)
    _wrap_once(_AcceleratorConnector, "_validate_precision_choice", validate_precision)
