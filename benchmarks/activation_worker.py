"""One rank of the activation-memory accuracy benchmark (launched by activation_accuracy.py).

First every scenario is estimated with ``autoshard.activations.measure_step`` for this rank (on a fake process group,
before any real one exists), then each is trained for real on the 2 gloo ranks with ``strategy=AutoShardStrategy``
and the live tensor bytes of step 2 are measured with the same tracker, on the real tensors.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402,F401  registers the strategies
from autoshard._harness import quiet_trainer, write_result  # noqa: E402
from autoshard.activations import measure_step, measuring_callback  # noqa: E402
from autoshard.demo import DinoLike  # noqa: E402
from autoshard.intent import ShardingIntent  # noqa: E402
from autoshard.lightning.fsdp2 import AutoShardStrategy  # noqa: E402
from autoshard.precision import resolve_precision  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STEPS = 3  # step 2 (batch_idx 1) is measured: step 1 creates the optimizer states, as the estimate's warm-up does
SEQ, VOCAB, IMAGE = 128, 1024, 32


class GPT(pl.LightningModule):
    """A small Hugging Face GPT-2 (2 layers, width 128) trained on next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ViT(pl.LightningModule):
    """A small Hugging Face ViT (2 layers, width 128, 8x8 patches of 32x32 images) for classification."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, image_size=IMAGE, patch_size=4, num_labels=10
        )
        self.model = ViTForImageClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(pixel_values=x, labels=y).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def dino() -> DinoLike:
    return DinoLike(in_dim=64, dim=256, depth=4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# name -> (factory, fake batch of B, dataset of n samples); a fake batch is what the DataLoader yields (a list).
MODELS: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[int], Any], Callable[[int], Any]]] = {
    "gpt2": (
        GPT,
        lambda b: [torch.randint(0, VOCAB, (b, SEQ))],
        lambda n: TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=_gen(0))),
    ),
    "vit": (
        ViT,
        lambda b: [torch.randn(b, 3, IMAGE, IMAGE), torch.randint(0, 10, (b,))],
        lambda n: TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=_gen(0)), torch.randint(0, 10, (n,), generator=_gen(1))),
    ),
    "dino": (
        dino,
        lambda b: [torch.randn(b, 64), torch.randint(0, 4, (b,))],
        lambda n: TensorDataset(torch.randn(n, 64, generator=_gen(0)), torch.randint(0, 4, (n,), generator=_gen(1))),
    ),
}
BATCHES = {"gpt2": (4, 16), "vit": (16, 64), "dino": (64, 256)}


def scenarios(models: list[str], precisions: list[str]) -> list[dict[str, Any]]:
    return [{"model": m, "batch": b, "ac": ac, "precision": p} for m in models for p in precisions for b in BATCHES[m] for ac in (False, True)]


def estimate(s: dict[str, Any]) -> dict[str, Any]:
    factory, make_batch, _ = MODELS[s["model"]]
    intent = ShardingIntent(activation_checkpointing=s["ac"])
    start = time.perf_counter()
    result = measure_step(factory, intent, WORLD, resolve_precision(s["precision"], intent), make_batch=lambda: make_batch(s["batch"]), rank=RANK)
    return {**result.to_dict(), "seconds": time.perf_counter() - start}


def measure(s: dict[str, Any]) -> dict[str, Any]:
    factory, _, dataset = MODELS[s["model"]]
    pl.seed_everything(0, verbose=False)
    measure_cb = measuring_callback(batch_index=1)
    trainer = quiet_trainer(
        strategy=AutoShardStrategy(ShardingIntent(activation_checkpointing=s["ac"])),
        precision=s["precision"],
        max_steps=STEPS,
        callbacks=[measure_cb],
    )
    data = DataLoader(dataset(s["batch"] * WORLD * STEPS), batch_size=s["batch"])
    trainer.fit(factory(), data)
    del trainer
    gc.collect()
    assert measure_cb.result is not None, "the measured step never ran"
    return measure_cb.result.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--models", default="gpt2,vit,dino")
    parser.add_argument("--precisions", default="bf16-mixed,32-true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    todo = scenarios(args.models.split(","), args.precisions.split(","))
    estimates = [estimate(s) for s in todo]  # before any process group: measure_step makes its own fake one
    results = [{**s, "estimate": e, "measured": measure(s)} for s, e in zip(todo, estimates)]
    write_result(args.out, RANK, {"scenarios": results})


if __name__ == "__main__":
    main()
