"""Where a resume finds the memory-budget decision before anything is sharded: a checkpoint's own entry, read cheaply
from each format autoshard writes, and the fit's ckpt_path read from the call in progress. The whole resume (fsdp2's
distributed checkpoint and DeepSpeed's directory, on 2 gloo ranks) is tests/distributed/test_budget_fit.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from autoshard.checkpoint.formats import BUDGET_KEY, LIGHTNING_META, STATE_KEY
from autoshard.checkpoint.resume import stored_budget_decision
from autoshard.checkpoint.trust import DCP_METADATA, UntrustedPickleError
from autoshard.lightning.budget import resuming_from

DECISION = {"world_size": 2, "budget": 1000, "chosen": {"offload": "optimizer"}, "peak": 900, "backend": "deepspeed_zero3"}


def lightning_dict(**extra: Any) -> dict[str, Any]:
    return {"epoch": 0, "global_step": 4, "state_dict": {"w": torch.zeros(2)}, **extra}


def test_a_full_file_and_a_distributed_checkpoints_meta_hold_the_decision(tmp_path: Path) -> None:
    full = tmp_path / "last.ckpt"
    torch.save(lightning_dict(**{STATE_KEY: {"version": 1, BUDGET_KEY: DECISION}}), full)
    assert stored_budget_decision(full) == DECISION
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / DCP_METADATA).write_bytes(b"")  # only meta.pt is read: the shards are never touched before sharding
    torch.save({"epoch": 0, STATE_KEY: {BUDGET_KEY: DECISION}}, dcp / LIGHTNING_META)
    assert stored_budget_decision(dcp) == DECISION


def test_no_decision_is_none_and_a_path_that_is_no_checkpoint_is_left_to_the_load(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ckpt"
    torch.save(lightning_dict(), plain)  # a run without a budget, or stock Lightning
    assert stored_budget_decision(plain) is None
    assert stored_budget_decision(tmp_path / "missing") is None and stored_budget_decision(tmp_path) is None


def test_the_file_is_read_weights_only_unless_the_fit_trusts_it(tmp_path: Path) -> None:
    path = tmp_path / "pickled.ckpt"
    torch.save(lightning_dict(hyper_parameters={"at": Path("x")}, **{STATE_KEY: {BUDGET_KEY: DECISION}}), path)
    with pytest.raises(UntrustedPickleError):
        stored_budget_decision(path)
    assert stored_budget_decision(path, trust_pickle=True) == DECISION  # fit(..., weights_only=False)


class Seen(pl.Callback):
    """What ``resuming_from`` answers while a fit runs (from a hook: the strategy's setup runs inside the same call)."""

    def __init__(self) -> None:
        self.answer: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.answer = resuming_from(trainer)


def test_the_fits_ckpt_path_is_found_before_lightning_restores_it(tmp_path: Path) -> None:
    from tests.test_activations import Stack

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert resuming_from(trainer) == (None, None)  # outside a fit: trainer.ckpt_path
    seen = Seen()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[seen]
    )
    with pytest.raises(FileNotFoundError):  # Lightning refuses the missing path when it restores, after setup
        trainer.fit(Stack(), [[torch.randn(2, 16, 64)]], ckpt_path=str(tmp_path / "x.ckpt"), weights_only=False)
    assert seen.answer == (str(tmp_path / "x.ckpt"), False)
