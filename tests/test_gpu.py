"""What only a CUDA machine can show: nccl FSDP2 and the stock CUDA DeepSpeed path. Skipped here, with a reason."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import autoshard  # noqa: F401
from autoshard.demo import Blobs, DinoLike, OnlineProbe

pytestmark = pytest.mark.gpu


def fit(strategy: Any, model: pl.LightningModule, callbacks: list | None = None) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, callbacks=callbacks or [],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(Blobs(n=64), batch_size=16))
    return trainer


def test_auto_shard_trains_the_ema_probe_method_on_cuda() -> None:
    model = DinoLike()
    before = [p.detach().clone() for p in model.student.parameters()]
    trainer = fit("auto-shard", model, [OnlineProbe()])
    assert trainer.strategy.decision.backend == "fsdp2"
    assert torch.distributed.get_backend() == "nccl"
    after = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.student.parameters()]
    assert all(a.device.type == "cuda" and torch.isfinite(a).all() for a in after)
    assert sum(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(after, before)) == len(before)


def test_deepspeed_trains_a_single_optimizer_method_on_cuda() -> None:
    pytest.importorskip("deepspeed")

    class Single(DinoLike):
        def __init__(self) -> None:
            super().__init__()
            del self.teacher  # ZeRO-3 refuses EMA; one model, one optimizer

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            _, logits = self.student(batch[0])
            return torch.nn.functional.cross_entropy(logits[:, :4].float(), batch[1])

        def on_train_batch_end(self, *args: Any) -> None:
            pass

    model = Single()
    trainer = fit("autoshard-deepspeed", model)
    assert trainer.strategy.decision.backend == "deepspeed_zero3"
    assert torch.isfinite(torch.tensor(float(trainer.callback_metrics.get("loss", 0.0))))
