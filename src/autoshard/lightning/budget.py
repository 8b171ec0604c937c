"""``ShardingIntent(memory_budget=...)`` at fit, for autoshard's Lightning strategies (fsdp2 and DeepSpeed).

The decision is made once, before anything is sharded: on rank 0, on the first batch of the train DataLoader (the
micro-batch ``training_step`` receives; never ``example_input_array``, whose forward alone is a lower bound of a
step's peak, see ``autoshard.budget``), then broadcast, so every rank trains with the same configuration. Rank 0 logs
the decision table. A checkpoint stores the decision (``lightning.checkpoint``); a resume keeps it unless the budget,
the world or the backend changed, and says which. An impossible budget raises ``BudgetRefusedError`` on every rank,
with the smallest world size that fits.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from autoshard.budget import BudgetDecision, decide_at_fit, resume_decision
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.lightning.checkpoint import on_rank0, rng_state, set_rng_state, stored_budget_decision
from autoshard.needs import held_optimizers

if TYPE_CHECKING:
    import lightning.pytorch as pl

# The private Lightning members used below are listed, with why, in autoshard.lightning.compat.


def _lightning_data_source(trainer: pl.Trainer) -> Any:
    """Where Lightning will take the train DataLoader from (the one passed to fit, or a train_dataloader() hook)."""
    return trainer.fit_loop._data_source


def first_train_batch(trainer: pl.Trainer) -> Any:
    """One micro-batch as ``training_step`` receives it: the first of the train DataLoader(s), combined as Lightning
    combines them, or None when there is none. The RNG states are put back afterwards, so a shuffling sampler or the
    workers' seeds draw the same numbers as in a run without a budget (the same losses as the configuration set by hand).
    """
    from lightning.pytorch.utilities import CombinedLoader

    source = _lightning_data_source(trainer)
    if not source.is_defined():
        return None
    state = rng_state()
    try:
        loaders = source.dataloader()
        if loaders is None:
            return None
        combined = CombinedLoader(loaders, "max_size_cycle")
        iterator = iter(combined)
        try:
            batch, _, _ = next(iterator)
        except StopIteration:
            return None
        finally:
            combined.reset()
        return batch
    finally:
        set_rng_state(state)


def resuming_from(trainer: pl.Trainer) -> tuple[Any, bool | None]:
    """(ckpt_path, weights_only) of the fit in progress, or (trainer.ckpt_path, None) outside one.

    Lightning restores a checkpoint after the strategy's setup, and a stored decision must be read before anything
    is sharded: the arguments of ``Trainer._run`` (the path already resolved from "last", "best" or "hpc"), read from
    that call's frame on this thread's stack.
    """
    import lightning.pytorch as pl

    run = pl.Trainer._run.__code__  # private Lightning method: autoshard.lightning.compat
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is run and frame.f_locals.get("self") is trainer:
                return frame.f_locals.get("ckpt_path"), frame.f_locals.get("weights_only")
            frame = frame.f_back
    finally:
        del frame  # a frame held in a local keeps every frame above it alive
    return trainer.ckpt_path, None


def decide_for_fit(strategy: Any, trainer: pl.Trainer, intent: ShardingIntent, backend: str) -> BudgetDecision:
    """The decision this fit trains with, the same on every rank, made before anything is sharded.

    On rank 0: the checkpoint's decision when the fit resumes with the same budget, world and backend (``said``
    says it was kept, or why it was decided again); else ``decide`` on the module (copied to meta, never changed),
    the first train batch, the strategy's precision and the callbacks that hold optimizers (probes), the simulated
    steps in a forked child beside the live process group. The answer is broadcast; a refusal is raised on every rank
    (``on_rank0``: same type, same text). Rank 0 logs the table: the choice with its peak, then every cheaper
    configuration with its peak and why it does not fit.
    """
    module = strategy.lightning_module
    world = strategy.world_size

    def on_zero() -> dict[str, Any]:
        path, weights_only = resuming_from(trainer)
        stored = stored_budget_decision(path, trust_pickle=weights_only is False) if path else None
        decision, said = resume_decision(stored, intent, world, backend)
        if decision is None:
            batch = first_train_batch(trainer)
            if batch is None:
                raise IntentError(
                    f"memory_budget is decided on the first batch of the train DataLoader (the micro-batch training_step"
                    f" receives), and {type(module).__name__}'s train DataLoader yielded none (an empty dataset, or"
                    f" drop_last=True with fewer samples than batch_size); nothing was sharded. Fix: give Trainer.fit a train"
                    f" DataLoader with at least one batch, or drop memory_budget and set the fields yourself (autoshard"
                    f" explain --budget shows each configuration's peak)"
                )
            decision = decide_at_fit(
                module,
                batch,
                intent,
                world,
                num_nodes=strategy.num_nodes,
                precision=strategy.precision_plan,
                callbacks=[c for c in trainer.callbacks if held_optimizers(c)],
                backend=backend,
            )
        return {"decision": decision.to_dict(), "said": said}

    answer = on_rank0(on_zero, strategy.global_rank, world, strategy.broadcast)
    assert answer is not None
    if answer["said"]:
        rank_zero_info(answer["said"])
    decision = BudgetDecision.from_dict(answer["decision"])
    rank_zero_info(decision.table())
    return decision


__all__ = ["decide_for_fit", "first_train_batch", "resuming_from"]
