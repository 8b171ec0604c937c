"""One rank of the memory-budget benchmarks (launched by budget_accuracy.py and budget_cost_order.py).

``--task accuracy``: per model, a budget halfway between the cheapest configuration's peak and the most saving one's;
``autoshard.budget.decide`` chooses (before any process group: its steps run on a fake one), the chosen configuration
is simulated for this rank, then trained for real on the 2 gloo ranks with ``FSDP2Strategy(intent=...)`` and step 2
measured with the same tracker on the real tensors.

``--task order``: per model, each configuration of the grid is trained for real on the 2 gloo ranks and its step
time measured (median of the steps after the first two); its estimated price (``budget.Cost``) is computed from the
simulated step and the traffic model at rates measured on this machine (matmul FLOP/s, gloo all-gather bytes/s,
host copy bytes/s).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
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
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402,F401  registers the strategies
from autoshard._harness import quiet_trainer, write_result  # noqa: E402
from autoshard.activations import measure_step, measuring_callback  # noqa: E402
from autoshard.budget import Rates, decide, describe_config, price  # noqa: E402
from autoshard.intent import ShardingIntent  # noqa: E402
from autoshard.lightning.fsdp2 import FSDP2Strategy  # noqa: E402
from autoshard.memory import EstimateOptions, estimate_memory, with_step  # noqa: E402
from autoshard.precision import resolve_precision  # noqa: E402
from autoshard.target import build_on_meta  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
SEQ, VOCAB, IMAGE, PRECISION = 128, 1024, 32, "bf16-mixed"


class GPT(pl.LightningModule):
    """A tiny Hugging Face GPT-2 decoder (4 layers, width 128), next-token loss; no KV cache in training (HF turns it
    off itself under its own gradient checkpointing: a cache would grow when a block is recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0, use_cache=False)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ViT(pl.LightningModule):
    """A tiny Hugging Face ViTModel (4 layers, width 128, 4x4 patches of 32x32 images) with a linear head on [CLS]."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTModel

        config = ViTConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512, image_size=IMAGE, patch_size=4)
        self.vit = ViTModel(config, add_pooling_layer=False)
        self.head = nn.Linear(128, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        cls = self.vit(pixel_values=x).last_hidden_state[:, 0]
        return nn.functional.cross_entropy(self.head(cls), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ConvBlock(nn.Module):
    """A ResNet basic block (conv-norm-ReLU-conv-norm + identity), GroupNorm: BatchNorm's fp32 running statistics
    meet FSDP2's bf16 gathered weights in CPU batch_norm under bf16-mixed ("expected scalar type BFloat16")."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.GroupNorm(8, channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.GroupNorm(8, channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class ConvNet(pl.LightningModule):
    """A small ResNet: a stem, 4 basic blocks of 64 channels at 32x32, pooling, a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.GroupNorm(8, 64), nn.ReLU())
        self.blocks = nn.Sequential(*(ConvBlock(64) for _ in range(4)))
        self.head = nn.Linear(64, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(features), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(b: int) -> list[torch.Tensor]:
    return [torch.randn(b, 3, IMAGE, IMAGE), torch.randint(0, 10, (b,))]


def _image_data(n: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=_gen(0)), torch.randint(0, 10, (n,), generator=_gen(1)))


# name -> (factory, a fake batch of B as the DataLoader yields it, a dataset of n samples, the micro-batch)
MODELS: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[int], Any], Callable[[int], Any], int]] = {
    "gpt2": (GPT, lambda b: [torch.randint(0, VOCAB, (b, SEQ))], lambda n: TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=_gen(0))), 16),
    "vit": (ViT, _images, _image_data, 64),
    "conv": (ConvNet, _images, _image_data, 32),
}
CHEAPEST = {"reshard_after_forward": False, "activation_checkpointing": False, "offload": "none"}
MOST = {"reshard_after_forward": True, "activation_checkpointing": True, "offload": "params"}


def device_peak(name: str, config: dict[str, Any]) -> int:
    """The device bytes per rank of one configuration, as decide and explain compute them (states + a simulated step)."""
    factory, make_batch, _, batch = MODELS[name]
    intent = ShardingIntent(**config)
    precision = resolve_precision(PRECISION, intent)
    step = measure_step(factory, intent, WORLD, precision, make_batch=lambda: make_batch(batch), rank=RANK)
    module = build_on_meta(factory).module
    return with_step(estimate_memory(module, intent, world_size=WORLD, options=EstimateOptions(precision=precision, rank=RANK)), step, True).device


def fit(name: str, intent: ShardingIntent, steps: int, timed: bool = False) -> tuple[dict[str, Any] | None, list[float]]:
    """A real fit on the gloo ranks: step 2 measured with the tracker, and each step's wall time."""
    factory, _, dataset, batch = MODELS[name]
    pl.seed_everything(0, verbose=False)
    measured = measuring_callback(batch_index=1)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            torch.distributed.barrier()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            torch.distributed.barrier()
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    callbacks: list[pl.Callback] = [clock] if timed else [measured]
    trainer = quiet_trainer(strategy=FSDP2Strategy(intent=intent), precision=PRECISION, max_steps=steps, callbacks=callbacks)
    trainer.fit(factory(), DataLoader(dataset(batch * WORLD * steps), batch_size=batch))
    del trainer
    gc.collect()
    return (measured.result.to_dict() if measured.result else None), clock.times


def accuracy(name: str) -> dict[str, Any]:
    factory, make_batch, _, batch = MODELS[name]
    cheapest, most = device_peak(name, CHEAPEST), device_peak(name, MOST)
    budget = (cheapest + most) // 2
    start = time.perf_counter()
    decision = decide(factory, make_batch(batch), ShardingIntent(memory_budget=budget), WORLD)
    seconds = time.perf_counter() - start
    intent = decision.intent(ShardingIntent())
    estimate = measure_step(factory, intent, WORLD, resolve_precision(PRECISION, intent), make_batch=lambda: make_batch(batch), rank=RANK)
    return {
        "model": name,
        "batch": batch,
        "budget": budget,
        "cheapest": cheapest,
        "most": most,
        "decision": decision.to_dict(),
        "decide_seconds": seconds,
        "chosen": describe_config(decision.chosen),
        "estimate": estimate.to_dict(),
    }


def measured_rates() -> Rates:
    """This machine's rates: a bf16 matmul's FLOP/s on one thread, gloo all-gather bytes/s, host copy bytes/s."""
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    a @ a
    start = time.perf_counter()
    for _ in range(4):
        a @ a
    flops = 4 * 2 * 1024**3 / (time.perf_counter() - start)
    shard = torch.empty(8 * 2**20 // WORLD, dtype=torch.uint8)
    whole = torch.empty(8 * 2**20, dtype=torch.uint8)
    torch.distributed.all_gather_into_tensor(whole, shard)
    start = time.perf_counter()
    for _ in range(4):
        torch.distributed.all_gather_into_tensor(whole, shard)
    gather = 4 * whole.numel() * (WORLD - 1) / WORLD / (time.perf_counter() - start)
    src, dst = torch.empty(64 * 2**20, dtype=torch.uint8), torch.empty(64 * 2**20, dtype=torch.uint8)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    host = 4 * src.numel() / (time.perf_counter() - start)
    return Rates(flops_per_s=flops, intra_node_bytes_per_s=gather, inter_node_bytes_per_s=gather, host_bytes_per_s=host)


ORDER_GRID = [
    CHEAPEST,
    {**CHEAPEST, "reshard_after_forward": True},
    {**CHEAPEST, "activation_checkpointing": 2},
    {**CHEAPEST, "activation_checkpointing": "selective"},
    {**CHEAPEST, "activation_checkpointing": True},
    {**CHEAPEST, "offload": "params"},
    {"reshard_after_forward": True, "activation_checkpointing": True, "offload": "none"},
    MOST,
]


def order(name: str, steps: int) -> dict[str, Any]:
    """Estimated price and measured step time of each configuration of ORDER_GRID (prices use rates measured after
    the process group exists; the simulated steps ran before it, in main)."""
    factory, make_batch, _, batch = MODELS[name]
    rows = []
    for config in ORDER_GRID:
        _, times = fit(name, ShardingIntent(**config), steps, timed=True)
        rows.append({"config": config, "step_seconds": statistics.median(times[2:]), "times": times})
    return {"model": name, "batch": batch, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--task", choices=("accuracy", "order"), required=True)
    parser.add_argument("--models", default="gpt2,vit,conv")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    models = args.models.split(",")
    if args.task == "accuracy":
        planned = [accuracy(m) for m in models]  # before any process group: decide and measure_step make fake ones
        torch.distributed.init_process_group("gloo")
        for p in planned:
            measured, _ = fit(p["model"], ShardingIntent(**p["decision"]["chosen"]), 3)
            p["measured"] = measured
        write_result(args.out, RANK, {"models": planned})
        return
    # order: the prices first (simulated steps, before any process group), then the real runs and this machine's rates
    prices = {}
    for name in models:
        factory, make_batch, _, batch = MODELS[name]
        prices[name] = price(
            factory, make_batch(batch), ShardingIntent(), WORLD, ORDER_GRID, precision=resolve_precision(PRECISION, ShardingIntent())
        )
    torch.distributed.init_process_group("gloo")
    rates = measured_rates()
    out = []
    for name in models:
        result = order(name, args.steps)
        for row, (peak, cost) in zip(result["rows"], prices[name]):
            row["estimate"] = {**cost.to_dict(), "seconds": cost.at(rates), "peak": peak}
        out.append(result)
    write_result(args.out, RANK, {"models": out, "rates": rates.to_dict()})


if __name__ == "__main__":
    main()
