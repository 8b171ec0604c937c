"""Lightning integration: strategies registered by name, and the guards, installed once on ``import autoshard``.

Every change this makes to Lightning is recorded in the one record of changes (``autoshard.install_record``) and
undone by ``uninstall()`` (the Trainer's part) or ``autoshard.uninstall()`` (everything).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from autoshard.engine.fsdp2 import refuse_unsupported_precision
from autoshard.install_record import CHANGES_BEGIN, CHANGES_END, TRAINER_KINDS, Change, changes_markdown, installed, register_strategy
from autoshard.lightning import guards
from autoshard.lightning.auto_shard import auto_shard
from autoshard.lightning.fsdp2 import AutoShardStrategy, FSDP2Strategy
from autoshard.privates.in_lightning import check_lightning


def _other_registration(registry: Any, name: str, ours: type) -> Any:
    """The class (or factory) another library registered under ``name``, else None; read raw, never instantiated."""
    entry = dict.get(registry, name)
    strategy = entry.get("strategy") if isinstance(entry, dict) else None
    return strategy if callable(strategy) and strategy is not ours else None


def replaced_message(name: str, replaced: Any) -> str:
    """Said once, on rank 0: a silent replacement would leave the user unsure which "fsdp2" trains their model."""
    short = getattr(replaced, "__qualname__", type(replaced).__qualname__)
    theirs = f"{getattr(replaced, '__module__', None) or type(replaced).__module__}.{short}"
    return (
        f"autoshard: Trainer(strategy='{name}') was registered by {theirs}; import autoshard replaced it with"
        f" autoshard.lightning.FSDP2Strategy. To train with the other one, pass it as an object:"
        f" Trainer(strategy={short}(...))"
    )


def register() -> None:
    """Register "fsdp2", "auto-shard" and the DeepSpeed names, and install the guards; idempotent, so re-imports are
    harmless, and again after ``uninstall()``."""
    if installed(TRAINER_KINDS):  # the record says it is done (autoshard.uninstall() empties it)
        return
    check_lightning()  # first: it warns when a member a guard below needs is gone (that guard is then skipped)
    from lightning.pytorch.strategies import StrategyRegistry

    replaced = _other_registration(StrategyRegistry, "fsdp2", FSDP2Strategy)
    register_strategy(
        StrategyRegistry,
        "fsdp2",
        FSDP2Strategy,
        "autoshard: FSDP2 (fully_shard) for any LightningModule",
        "Trainer(strategy='fsdp2'). Another library's 'fsdp2' is replaced (said once, on rank 0) and restored by uninstall",
    )
    if replaced is not None:
        rank_zero_info(replaced_message("fsdp2", replaced))
    register_strategy(
        StrategyRegistry,
        "auto-shard",
        auto_shard,  # a factory: AutoShardStrategy, or autoshard's DeepSpeed strategy when the intent needs it
        "autoshard: the sharding backend your method can run on",
        "Trainer(strategy='auto-shard'): the backend the selector picks",
    )
    from autoshard.lightning.deepspeed import register_deepspeed_strategies  # imports no deepspeed

    register_deepspeed_strategies(StrategyRegistry)
    guards.install_guards(FSDP2Strategy, refuse_unsupported_precision)


def uninstall() -> list[Change]:
    """Undo what ``import autoshard`` changed in the Trainer's Lightning, by identity; returns the changes undone.
    Fabric's registry entries stay: ``autoshard.uninstall()`` undoes both."""
    return guards.uninstall()


def write_changes(path: str | Path) -> None:
    """Regenerate the list of changes in ``path`` (docs/lightning-changes.md), between its markers."""
    register()
    path = Path(path)
    text = path.read_text()
    if CHANGES_BEGIN not in text or CHANGES_END not in text:
        raise ValueError(f"{path} has no {CHANGES_BEGIN} ... {CHANGES_END} block to replace")
    before, rest = text.split(CHANGES_BEGIN, 1)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(before + changes_markdown() + rest.split(CHANGES_END, 1)[1])
    os.replace(staged, path)  # atomic: a failed write leaves the page as it was


__all__ = ["AutoShardStrategy", "Change", "FSDP2Strategy", "auto_shard", "installed", "register", "uninstall", "write_changes"]
