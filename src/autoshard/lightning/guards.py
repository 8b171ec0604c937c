"""Fail-fast guards installed on ``import autoshard``: FSDP1 and fp16-under-fsdp2 are refused with a redirect.

They wrap FSDPStrategy.__init__ and two private checks of Lightning's accelerator connector (verified on
lightning 2.4-2.6); every such wrap lives only here.
"""

from __future__ import annotations

import functools
from typing import Any

from autoshard.backends import fsdp1
from autoshard.errors import IncompatibleBackendError

FSDP1_REFUSAL = (
    "FSDP1 (strategy='fsdp' / FSDPStrategy) is refused by autoshard: {reason}. Backend that works: fsdp2."
    " Fix: use strategy='fsdp2' (or strategy='auto-shard' to let autoshard choose)"
)


def fsdp1_refusal() -> str:
    return FSDP1_REFUSAL.format(reason=fsdp1.REASON)


def install_guards() -> None:
    """Idempotent: wrap FSDPStrategy.__init__ and the connector's precision check once."""
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    if not getattr(FSDPStrategy.__init__, "_autoshard_guard", False):

        @functools.wraps(FSDPStrategy.__init__)
        def refuse_fsdp1(self: Any, *args: Any, **kwargs: Any) -> None:
            raise IncompatibleBackendError(fsdp1_refusal())

        refuse_fsdp1._autoshard_guard = True  # type: ignore[attr-defined]
        FSDPStrategy.__init__ = refuse_fsdp1  # type: ignore[method-assign]

    fallback = _AcceleratorConnector._check_strategy_and_fallback
    if not getattr(fallback, "_autoshard_guard", False):

        @functools.wraps(fallback)
        def check_strategy(self: Any) -> None:
            # Lightning rejects "fsdp" on CPU here with its own text, before the class is ever built.
            flag = self._strategy_flag
            if isinstance(flag, str) and flag in FSDPStrategy.get_registered_strategies():
                raise IncompatibleBackendError(fsdp1_refusal())
            fallback(self)

        check_strategy._autoshard_guard = True  # type: ignore[attr-defined]
        _AcceleratorConnector._check_strategy_and_fallback = check_strategy  # type: ignore[method-assign]

    original = _AcceleratorConnector._validate_precision_choice
    if not getattr(original, "_autoshard_guard", False):

        @functools.wraps(original)
        def validate_precision(self: Any) -> None:
            # Lightning checks only strategy *instances* (not names), says "Fabric(...)", and on CPU silently turns
            # 16-mixed into bf16-mixed later: refuse first, for names and instances alike.
            from autoshard.lightning.fsdp2 import FSDP2_PRECISIONS, FSDP2Strategy, precision_refusal

            strategy = self.strategy
            if isinstance(strategy, FSDP2Strategy) and self._precision_flag not in FSDP2_PRECISIONS:
                raise IncompatibleBackendError(precision_refusal(self._precision_flag, strategy.strategy_name))
            original(self)

        validate_precision._autoshard_guard = True  # type: ignore[attr-defined]
        _AcceleratorConnector._validate_precision_choice = validate_precision  # type: ignore[method-assign]
