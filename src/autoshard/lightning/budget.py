"""``ShardingIntent(memory_budget=...)`` at fit, for autoshard's Lightning strategies (fsdp2 and DeepSpeed).

Decided once, before anything is sharded, on rank 0, on the first batch of the train DataLoader (never
``example_input_array``, whose forward alone is a lower bound of a step's peak), then broadcast. Reading that batch
changes nothing training sees: the generators it drew from are put back, and an iterable that does not restart gets
the batch back (``hand_back``).
"""

from __future__ import annotations

import itertools
import random
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from autoshard.activations import describe_batch
from autoshard.budget import BudgetDecision, DecideOptions, batch_function, decide, resume_decision
from autoshard.checkpoint.resume import stored_budget_decision
from autoshard.checkpoint.saves import on_rank0, rng_state, set_rng_state
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.lightning.guards import run_arguments
from autoshard.needs import held_optimizers

if TYPE_CHECKING:
    import lightning.pytorch as pl

# The private Lightning members used below are listed, with why, in autoshard.privates.in_lightning.


def _lightning_data_source(trainer: pl.Trainer) -> Any:
    """Where Lightning will take the train DataLoader from (the one passed to fit, or a train_dataloader() hook)."""
    return trainer.fit_loop._data_source


class HandedBack:
    """A loader a second ``iter()`` does not restart, whose first iteration starts with the batch the budget's peek
    read from it, so training sees every batch it would have seen without a budget."""

    def __init__(self, loader: Any, first: Any, rest: Iterator[Any]) -> None:
        self.loader = loader
        self.pending: tuple[Any, Iterator[Any]] | None = (first, rest)

    def __iter__(self) -> Iterator[Any]:
        if self.pending is None:
            return iter(self.loader)
        first, rest = self.pending
        self.pending = None
        return itertools.chain([first], rest)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper lacks: the loader's sampler, dataset, ...
        if name == "loader":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.loader, name)


# strategy -> {id(what holds the iteration's state): (that object, the HandedBack to give training)}; rank 0 only
_HANDED_BACK: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, HandedBack]]] = weakref.WeakKeyDictionary()


def _state_holder(loader: Any) -> Any:
    """What a fresh iteration of ``loader`` starts from: its dataset for a DataLoader, else the iterable itself."""
    from torch.utils.data import DataLoader

    return loader.dataset if isinstance(loader, DataLoader) else loader


def _continues(loader: Any) -> bool:
    """Whether a second ``iter()`` of ``loader`` goes on where the first stopped (one generator held by an
    IterableDataset, a generator passed as the loader)."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
        return False
    holder = _state_holder(loader)
    try:
        return iter(holder) is iter(holder)
    except TypeError:
        return False


def _random_states(loaders: list[Any]) -> list[tuple[Any, Any]]:
    """(generator, its state) of every generator a DataLoader, its samplers and its dataset hold besides the global
    ones."""
    import numbers

    from torch.utils.data import DataLoader, Dataset, Sampler

    found: dict[int, tuple[Any, Any]] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        state = _get_random_state(obj)
        if state is not None:
            found[id(obj)] = (obj, state)
            return
        if isinstance(obj, (DataLoader, Sampler, Dataset)) or depth == 0:
            for value in getattr(obj, "__dict__", {}).values():
                if not isinstance(value, (str, bytes, numbers.Number, torch.Tensor)):
                    visit(value, depth + 1)

    for loader in loaders:
        visit(loader, 0)
    return list(found.values())


def _get_random_state(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return obj.bit_generator.state
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return obj.get_state()
    return None


def _set_random_state(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, random.Random):
        obj.setstate(state)
    elif hasattr(obj, "bit_generator"):
        obj.bit_generator.state = state
    else:
        obj.set_state(state)


def first_train_batch(trainer: pl.Trainer, strategy: Any = None) -> Any:
    """One micro-batch as ``training_step`` receives it, or None. Every generator the peek drew from is put back, so
    a shuffling sampler and the workers' seeds draw the same numbers, and a one-shot iterable gets the batch back."""
    from lightning.pytorch.utilities import CombinedLoader

    source = _lightning_data_source(trainer)
    if not source.is_defined():
        return None
    state = rng_state()
    own: list[tuple[Any, Any]] = []
    try:
        loaders = source.dataloader()
        if loaders is None:
            return None
        combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
        own = _random_states(combined.flattened)
        firsts, handed = [], {}
        for loader in combined.flattened:
            continues = _continues(loader)
            iterator = iter(loader)
            try:
                first = next(iterator)
            except StopIteration:
                return None
            firsts.append(first)
            if continues:
                holder = _state_holder(loader)
                handed[id(holder)] = (holder, HandedBack(loader, first, iterator))
            else:  # training starts its own iteration: no worker started here stays (persistent ones would keep their seeds)
                del iterator
                CombinedLoader(loader).reset()
        if strategy is not None and handed:
            _HANDED_BACK[strategy] = handed
        shape = CombinedLoader(combined.iterables, "max_size_cycle")  # the first batches, combined as Lightning combines them
        shape.flattened = [[first] for first in firsts]
        batch, _, _ = next(iter(shape))
        return batch
    finally:
        for generator, saved in own:
            _set_random_state(generator, saved)
        set_rng_state(state)


def _training(strategy: Any) -> bool:
    """Whether the strategy's Trainer is preparing the train DataLoader (not the validation of the sanity check)."""
    try:
        return bool(strategy.lightning_module.trainer.training)
    except (AttributeError, RuntimeError):  # no module, or a module not attached to a Trainer
        return False


def hand_back(strategy: Any, dataloader: Any) -> Any:
    """``Strategy.process_dataloader`` for the train DataLoader of a fit: the one the budget's peek read from, with the
    peeked batch in front, when a fresh iteration would not give it again (``first_train_batch``); else unchanged."""
    handed = _HANDED_BACK.get(strategy)
    if not handed or not _training(strategy):
        return dataloader
    entry = handed.pop(id(_state_holder(dataloader)), None)
    if entry is None or entry[0] is not _state_holder(dataloader):
        return dataloader
    back = entry[1]
    back.loader = dataloader
    return back


def resuming_from(trainer: pl.Trainer) -> tuple[Any, bool | None]:
    """(ckpt_path, weights_only) of the fit in progress, or (trainer.ckpt_path, None) outside one.

    Lightning restores a checkpoint after the strategy's setup, and a stored decision must be read before anything
    is sharded: the arguments of ``Trainer._run``, recorded by its guard while it runs (``guards.run_arguments``).
    """
    return run_arguments(trainer) or (trainer.ckpt_path, None)


def decide_for_fit(
    strategy: Any, trainer: pl.Trainer, intent: ShardingIntent, backend: str, zero_overrides: Mapping[str, Any] | None = None
) -> BudgetDecision:
    """The decision this fit trains with, the same on every rank: on rank 0 the checkpoint's when the fit resumes with
    the same budget, world, backend and micro-batch, else ``decide`` on a meta copy of the module and the first batch
    (the live process group's registry parked meanwhile; DeepSpeed's peaks with the strategy's ``zero_overrides``);
    broadcast, and a refusal raised on every rank."""
    module = strategy.lightning_module
    world = strategy.world_size

    def on_zero() -> dict[str, Any]:
        path, weights_only = resuming_from(trainer)
        stored = stored_budget_decision(path, trust_pickle=weights_only is False) if path else None
        # Read even when a decision is stored: it is kept only for the same micro-batch (shapes and dtypes)
        batch = first_train_batch(trainer, strategy)
        decision, said = resume_decision(stored, intent, world, backend, batch=None if batch is None else describe_batch(batch))
        if decision is None:
            if batch is None:
                raise IntentError(
                    f"memory_budget is decided on the first batch of the train DataLoader (the micro-batch training_step"
                    f" receives), and {type(module).__name__}'s train DataLoader yielded none (an empty dataset, or"
                    f" drop_last=True with fewer samples than batch_size); nothing was sharded. Fix: give Trainer.fit a train"
                    f" DataLoader with at least one batch, or drop memory_budget and set the fields yourself (autoshard"
                    f" explain --budget shows each configuration's peak)"
                )
            decision = decide(
                module,
                batch_function(batch, origin="the first batch of the train DataLoader"),
                intent,
                world,
                backend=backend,
                device_type=strategy.root_device.type,
                options=DecideOptions(
                    num_nodes=strategy.num_nodes,
                    precision=strategy.precision_plan,
                    callbacks=[c for c in trainer.callbacks if held_optimizers(c)],
                    zero_overrides=zero_overrides,
                ),
            )
        return {"decision": decision.to_dict(), "said": said}

    answer = on_rank0(on_zero, strategy.global_rank, world, strategy.broadcast)
    assert answer is not None
    if answer["said"]:
        rank_zero_info(answer["said"])
    decision = BudgetDecision.from_dict(answer["decision"])
    rank_zero_info(decision.table())
    return decision
