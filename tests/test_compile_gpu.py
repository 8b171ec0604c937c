"""torch.compile with inductor on one CUDA GPU, bf16-mixed, a small Hugging Face Llama: ``ShardingIntent(compile=True)``
and a user's whole-model ``torch.compile`` under ``strategy="auto-shard"`` train like eager, with the eager checkpoint
keys. Skipped where no CUDA device exists (tests/conftest.py); the 2-rank CPU checks are tests/distributed/test_compile.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  (registers the strategies)

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 1024, 128, 4, 12
# bf16 autocast: inductor fuses and reorders what eager rounds op by op, so the losses (about 7 at the start, ln 1024)
# differ by bf16 rounding; a broken compile (hooks bypassed, stale or unsharded weights) moves them by whole units or NaN.
LOSS_TOLERANCE = 1e-1


def small_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB)
    return LlamaForCausalLM(config)


class CausalLM(pl.LightningModule):
    def __init__(self, user_compile: bool = False) -> None:
        super().__init__()
        model = small_llama()
        self.model = torch.compile(model) if user_compile else model
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


def fit(strategy: Any, module: CausalLM, path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.fsdp import FSDPModule

    pl.seed_everything(0)
    # The same BATCH sequences at every step: memorized within a few steps, so the loss falls well below ln(VOCAB).
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).repeat(STEPS, 1)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=BATCH))
    trainer.save_checkpoint(path)
    # The decoder layers by path (their class name changes once sharded, and with the transformers version: the
    # device's 5.17 matched no "*LlamaDecoderLayer" name)
    layers = {n: m for n, m in module.named_modules() if re.search(r"(^|\.)layers\.\d+$", n)}
    return {
        "losses": module.losses,
        "keys": sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata),
        "units": [n for n, m in layers.items() if isinstance(m, FSDPModule)],
        "compiled": [n for n, m in layers.items() if m._compiled_call_impl is not None],
        "layers": list(layers),
    }


def test_compile_true_and_a_users_torch_compile_train_like_eager_on_cuda(tmp_path: Path) -> None:
    from autoshard.lightning import FSDP2Strategy

    eager = fit("fsdp2", CausalLM(), tmp_path / "eager.ckpt")
    compiled = fit(FSDP2Strategy(compile=True), CausalLM(), tmp_path / "compiled.ckpt")
    user = fit("auto-shard", CausalLM(user_compile=True), tmp_path / "user.ckpt")
    assert len(eager["layers"]) == 4 and eager["units"] == eager["layers"] and eager["compiled"] == []
    assert eager["losses"][-1] < eager["losses"][0] - 0.5  # it trains
    for run in (compiled, user):
        assert run["units"] == run["compiled"] == eager["layers"]  # each decoder layer compiled in place and its own unit
        assert len(run["losses"]) == STEPS and all(abs(a - b) < LOSS_TOLERANCE for a, b in zip(run["losses"], eager["losses"])), (
            run["losses"],
            eager["losses"],
        )
        assert run["keys"] == eager["keys"] and not any("_orig_mod" in k for k in run["keys"])
