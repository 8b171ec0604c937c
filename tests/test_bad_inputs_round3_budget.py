"""The bad-input catalog, rows 160-166 (docs/bad-inputs.md, "Round three: the memory budget's batch").

The batch a memory budget decides on is read, cut and blamed without harm: a smaller micro-batch cut from a larger one
is simulated exactly like the same micro-batch given directly; the first-batch peek at fit gives training the very
batches, in the same order, as a run without a budget (a one-shot IterableDataset, a DataLoader shuffling with its own
generator); a resume whose micro-batch changed decides again and says why; and a step that fails in the simulation
names its real cause, never an internal name, and blames the batch only when the batch is the problem. The fits here
run in-process on one CPU device, each with and without a budget.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from autoshard.activations import measure_step
from autoshard.budget import BudgetRefusedError, batch_function, cut_batch, decide, resume_decision, stored_differs
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.memory import fmt_bytes
from autoshard.precision import resolve_precision
from tests.test_activations import Stack
from tests.test_bad_inputs_budget import budget_strategy, needs_deepspeed


class Two(Stack):
    """Two residual blocks: a step simulates in a fraction of a second, and its activations grow with the rows."""

    def __init__(self) -> None:
        super().__init__(dim=32, depth=2)


def rows(n: int) -> list[torch.Tensor]:
    return [torch.randn(n, 4, 32)]


def test_160_a_micro_batch_cut_from_a_larger_batch_peaks_like_the_same_micro_batch_given_directly() -> None:
    intent = ShardingIntent()
    precision = resolve_precision(None, intent)
    direct = measure_step(Two, intent, 2, precision, make_batch=batch_function(rows(64)))
    for n in (256, 1024):  # a view of the first 64 rows used to keep all n rows alive in the simulated step
        cut = measure_step(Two, intent, 2, precision, make_batch=cut_batch(batch_function(rows(n)), n // 64))
        assert cut.peak == direct.peak and dict(cut.by_kind) == dict(direct.by_kind), (n, cut.by_kind, direct.by_kind)
    # What the user sees: from 1024 rows no configuration fits 1 MiB, and the micro-batch the refusal proposes, given
    # directly with the configuration it names, peaks at the very bytes the refusal says.
    with pytest.raises(BudgetRefusedError) as info:
        decide(Two, rows(1024), ShardingIntent(memory_budget="1MiB"), 2)
    n = info.value.micro_batch
    message = str(info.value)
    assert n == 128 and "even activation_checkpointing=True, offload='params' peaks at" in message, message
    named = ShardingIntent(memory_budget="1MiB", activation_checkpointing=True, offload="params", pinned=("reshard_after_forward",))
    fits = decide(Two, rows(n), named, 2)
    assert fits.chosen == {} and fits.peak <= 2**20
    assert f"A micro-batch of 128 (was 1024) fits here with activation_checkpointing=True, offload='params' (peak {fmt_bytes(fits.peak)})." in message


def recorder() -> Any:
    """A callback recording the first value of every sample training_step receives, in order (a callback: the simulated
    step runs training_step on fake tensors, which have no values to record)."""
    import lightning.pytorch as pl

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[list[float]] = []

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
            self.seen.append(batch[0][:, 0, 0].tolist())

    return Recorder()


def samples(n: int) -> torch.Tensor:
    """n samples of shape (4, 32), sample i filled with i: what a step saw names its samples."""
    return torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, 4, 32).contiguous()


class OneShot(IterableDataset):
    """An IterableDataset whose __iter__ returns one generator, made once: a second iteration goes on where the first
    stopped (a stream read once)."""

    def __init__(self, n: int) -> None:
        self.stream = ((x,) for x in samples(n))

    def __iter__(self) -> Iterator[tuple[torch.Tensor]]:
        return self.stream


def fit_and_record(loader: DataLoader, name: str = "fsdp2", **fields: Any) -> list[list[float]]:
    """One in-process epoch on this machine's CPU under FSDP2Strategy(**fields) (or AutoShardDeepSpeedStrategy); the
    batches training_step saw."""
    import lightning.pytorch as pl

    environ = dict(os.environ)
    seen = recorder()
    trainer = pl.Trainer(
        strategy=budget_strategy(name, **fields),
        callbacks=[seen],
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        precision="32-true",
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(Two(), loader)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return seen.seen


@pytest.mark.parametrize("name", ["fsdp2", pytest.param("autoshard-deepspeed", marks=needs_deepspeed)])
def test_161_the_budgets_first_batch_peek_loses_no_batch_of_a_one_shot_iterable_dataset(name: str) -> None:
    without = fit_and_record(DataLoader(OneShot(6), batch_size=2), name)
    with_budget = fit_and_record(DataLoader(OneShot(6), batch_size=2), name, memory_budget="1GiB")
    assert without == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert with_budget == without  # the peeked batch is handed back: training used to start at [2.0, 3.0]


def test_162_the_budgets_first_batch_peek_keeps_the_order_of_a_dataloader_shuffling_with_its_own_generator() -> None:
    def loader() -> DataLoader:
        return DataLoader(TensorDataset(samples(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(7))

    without = fit_and_record(loader())
    with_budget = fit_and_record(loader(), memory_budget="1GiB")
    assert sorted(v for batch in without for v in batch) == [float(i) for i in range(8)]
    assert with_budget == without  # the peek used to advance the DataLoader's generator: another permutation


def test_163_a_resume_whose_micro_batch_changed_decides_again_and_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stored = decide(Two, rows(4), ShardingIntent(memory_budget="1GiB"), 2).to_dict()
    kept, said = resume_decision(stored, ShardingIntent(memory_budget="1GiB"), 2, batch="[float32[4, 4, 32]]")
    assert kept is not None and said.startswith("autoshard memory budget: kept the checkpoint's decision")
    again, said = resume_decision(stored, ShardingIntent(memory_budget="1GiB"), 2, batch="[float32[64, 4, 32]]")
    assert again is None
    assert said == (
        "autoshard memory budget: decided again, the checkpoint's decision was for another run"
        " (micro-batch [float32[4, 4, 32]] -> [float32[64, 4, 32]])"
    )
    # The warning "the checkpoint's run trained with ..." is for the same run only: another micro-batch is another run.
    other = decide(Two, rows(64), ShardingIntent(memory_budget="1GiB", activation_checkpointing=True), 2)
    assert other.chosen != stored["chosen"] and stored_differs(stored, other) == ""
    # At fit: trained on 4-row micro-batches, resumed on 64-row ones.
    import lightning.pytorch as pl

    from autoshard.lightning import FSDP2Strategy

    environ = dict(os.environ)

    def fit(batch_size: int, steps: int, ckpt: Path | None) -> pl.Trainer:
        trainer = pl.Trainer(
            strategy=FSDP2Strategy(memory_budget="1GiB", checkpoint="full"),
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            precision="32-true",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Two(), DataLoader(TensorDataset(samples(128)), batch_size=batch_size), ckpt_path=ckpt)
        return trainer

    try:
        first = fit(4, 1, None)
        first.save_checkpoint(tmp_path / "run.ckpt")
        with caplog.at_level(logging.INFO):
            same = fit(4, 2, tmp_path / "run.ckpt")  # the same micro-batch: the decision is kept
        kept_log = caplog.text
        caplog.clear()
        with caplog.at_level(logging.INFO):
            resumed = fit(64, 2, tmp_path / "run.ckpt")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert "autoshard memory budget: kept the checkpoint's decision" in kept_log and "decided again" not in kept_log, kept_log
    assert same.strategy.budget_decision == first.strategy.budget_decision
    assert (
        "autoshard memory budget: decided again, the checkpoint's decision was for another run"
        " (micro-batch [float32[4, 4, 32]] -> [float32[64, 4, 32]])" in caplog.text
    ), caplog.text
    assert "kept the checkpoint's decision" not in caplog.text
    assert resumed.strategy.budget_decision.batch == "[float32[64, 4, 32]]"
    run = resumed.strategy.run  # the request is kept beside the intent the run trains with
    assert run.requested == ShardingIntent(memory_budget="1GiB", checkpoint="full") and resumed.strategy.intent == run.budget.intent(run.requested)


class ReadsTheTrainer(Two):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean() / self.trainer.accumulate_grad_batches


class TakesTheValue(Two):
    """ReadsTheTrainer after the Fix of row 164: the value is an argument of __init__."""

    def __init__(self, accumulate_grad_batches: int = 1) -> None:
        super().__init__()
        self.accumulate_grad_batches = accumulate_grad_batches

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean() / self.accumulate_grad_batches


class ConvertsIds(Two):
    """Two after the Fix of row 165: integer inputs turned into floats in training_step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x.float()).pow(2).mean()


def failure(module: Any, batch: Any) -> str:
    with pytest.raises(AutoShardError) as info:
        decide(module, batch, ShardingIntent(memory_budget="1GiB"), 2)
    message = str(info.value)
    assert "empty_like_batch" not in message and "BatchOfShapes" not in message and "make_batch" not in message, message
    return message


def test_164_a_training_step_that_reads_self_trainer_is_named_as_the_cause_not_the_batch() -> None:
    message = failure(ReadsTheTrainer, rows(8))
    assert message.startswith("training_step could not run on the batch given to decide, [float32[8, 4, 32]]: RuntimeError:"), message
    assert (
        "ReadsTheTrainer is not attached to a `Trainer`" in message
        and "`return self(x).pow(2).mean() / self.trainer.accumulate_grad_batches`" in message
    )
    assert "The batch is not the cause: training_step reads self.trainer there" in message
    assert message.endswith(
        "Fix: give the module what that line reads from the Trainer as an argument of __init__ (e.g."
        " MyModule(accumulate_grad_batches=4)) and read it from self in training_step, or let a few real steps with"
        " autoshard.activations.measuring_callback() measure it instead"
    ), message
    assert "DataLoader" not in message  # the batch is not blamed
    assert decide(TakesTheValue, rows(8), ShardingIntent(memory_budget="1GiB"), 2).peak > 0  # the Fix works


def test_165_an_integer_batch_for_a_float_model_is_named_a_dtype_mismatch() -> None:
    message = failure(Two, [torch.randint(0, 5, (8, 4, 32))])
    assert message.startswith("training_step could not run on the batch given to decide, [int64[8, 4, 32]]:"), message
    assert "A dtype mismatch: the batch holds integer tensors (int64[8, 4, 32]) and that line runs a floating-point op on them" in message
    assert "at test_activations.py:" in message  # the user's line (Stack.forward), not torch's or autoshard's
    assert message.endswith(
        "Fix: turn them into floats in training_step before the first floating-point layer (x.float(), or nn.Embedding for token ids)"
    )
    assert decide(ConvertsIds, [torch.randint(0, 5, (8, 4, 32))], ShardingIntent(memory_budget="1GiB"), 2).peak > 0  # the Fix works


def test_166_a_batch_without_tensors_is_named_as_the_problem() -> None:
    message = failure(Two, ["some", "text"])
    assert message.startswith("training_step could not run on the batch given to decide, [str, str]: ValueError: too many values to unpack"), message
    assert "The batch holds no tensor ([str, str]), and training_step takes it apart as if it did" in message
    assert message.endswith(
        "Fix: make the DataLoader yield what training_step takes (tensors; a collate_fn that tokenizes text), or make"
        " training_step take what the DataLoader yields"
    )
