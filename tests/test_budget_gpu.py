"""What only a CUDA machine can show for the memory budget: the chosen configuration's simulated peak against the
CUDA caching allocator's own count (``torch.cuda.max_memory_allocated``) in a real step. Skipped here, with a reason."""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401
from tests.test_budget_decide import GPT2

pytestmark = pytest.mark.gpu
SEQ, VOCAB = 256, 4096


GPT = functools.partial(GPT2, use_cache=False, width=256, vocab=VOCAB, seq=SEQ)  # block rounding is noise at this size


class Peak(pl.Callback):
    """The allocator's peak during the second step, from the start of its batch to its end, less what was allocated
    before this run's module existed (``baseline``: what earlier tests of the same process still hold, so the figure is
    this run's in any test order)."""

    def __init__(self) -> None:
        import gc

        gc.collect()
        self.baseline = torch.cuda.memory_allocated()
        self.peak = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.baseline


def fit_on_gpu(strategy: Any, ids: torch.Tensor, peak: Peak, module: pl.LightningModule | None = None) -> pl.Trainer:
    """Three steps of GPT on one GPU, bf16-mixed, micro-batches of 16, ``peak`` measuring the second."""
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=3,
        callbacks=[peak],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module or GPT(), DataLoader(TensorDataset(ids), batch_size=16))
    return trainer


def test_the_chosen_configurations_peak_is_within_ten_percent_of_cuda_max_memory_allocated() -> None:
    from autoshard.budget import decide, price
    from autoshard.intent import ShardingIntent
    from autoshard.lightning.fsdp2 import FSDP2Strategy

    ids = torch.randint(0, VOCAB, (16 * 3, SEQ), generator=torch.Generator().manual_seed(0))
    batch = [ids[:16]]
    cheapest = {"reshard_after_forward": False, "activation_checkpointing": False, "offload": "none"}
    saving = {"reshard_after_forward": True, "activation_checkpointing": True, "offload": "none"}
    (high, _), (low, _) = price(GPT, batch, ShardingIntent(), 1, [cheapest, saving])
    # Offload is a candidate too (its simulated step must not pin memory under fake tensors on a CUDA machine);
    # headroom 0: this compares the simulated peak with the allocator's, the headroom is for what neither counts.
    decision = decide(GPT, batch, ShardingIntent(memory_budget=(high + low) // 2, memory_headroom=0), 1)  # before any process group
    assert decision.chosen["activation_checkpointing"] is not False, decision.table()
    peak = Peak()
    fit_on_gpu(FSDP2Strategy(intent=decision.intent(ShardingIntent())), ids, peak)
    print(f"{decision.table()}\nCUDA max_memory_allocated {peak.peak} B, ratio {decision.peak / peak.peak:.3f}")
    assert peak.peak > 0 and decision.peak == pytest.approx(peak.peak, rel=0.10)


@pytest.mark.parametrize("strategy", ["fsdp2", "autoshard-deepspeed"])
def test_memory_budget_is_decided_at_fit_on_cuda_and_the_run_trains_within_it(strategy: str) -> None:
    """The decision at fit runs beside the live nccl group after CUDA started (it used to fork a child, which cannot
    use CUDA: "CUDA error: initialization error"); the chosen configuration trains, and its real peak fits the budget
    once the headroom is kept."""
    from autoshard.budget import price
    from autoshard.intent import ShardingIntent
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy
    from autoshard.lightning.fsdp2 import FSDP2Strategy

    ids = torch.randint(0, VOCAB, (16 * 3, SEQ), generator=torch.Generator().manual_seed(0))
    cheapest = {"activation_checkpointing": False, "offload": "none", **({"reshard_after_forward": False} if strategy == "fsdp2" else {})}
    backend = "fsdp2" if strategy == "fsdp2" else "deepspeed"
    ((high, _),) = price(GPT, [ids[:16]], ShardingIntent(), 1, [cheapest], backend=backend, precision="bf16-mixed")
    headroom = 64 << 20
    budget = high + headroom  # the cheapest fits only without the headroom: the decision must save memory
    make = FSDP2Strategy if strategy == "fsdp2" else AutoShardDeepSpeedStrategy
    peak = Peak()
    trainer = fit_on_gpu(make(memory_budget=budget, memory_headroom=headroom + (8 << 20)), ids, peak)
    decision = trainer.strategy.budget_decision
    print(decision.table(), f"\nCUDA max_memory_allocated {peak.peak} B")
    assert decision is not None and decision.chosen != {k: v for k, v in cheapest.items() if k in decision.chosen}
    assert decision.peak <= decision.headroom.limit(budget) and peak.peak > 0
    # DeepSpeed, measured on an H200 (5M-parameter GPT-2, session 7): 1.27 GB allocated where DeepSpeed's estimator +
    # the simulated activations said 0.53 GB (activation_checkpointing=2 chosen); this was an xfail. The estimate now
    # adds the reduce bucket (763 MiB: 2e8 elements of fp32, bf16-mixed's reduction dtype; session 12, measured on a
    # CPU engine) and the parameters kept gathered from forward into backward (7.5 MiB: all 3.9M partitioned ones,
    # bf16). The budget is DeepSpeed's own cheapest price + the headroom (fsdp2's is below the bucket alone): computed
    # on CPU, 1,574,902,792 B with nothing changed, and the decision chooses activation_checkpointing=2 at
    # 1,341,004,808 B, against the 1.27 GB measured.
    assert peak.peak <= budget, f"{strategy}: CUDA max_memory_allocated {peak.peak} B is over the budget {budget} B\n{decision.table()}"


class FusedGPT(GPT2):
    """GPT-2 with the optimizer GPU users pick: AdamW(fused=True)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


def test_a_fused_adamw_step_is_simulated_as_the_gpu_holds_it() -> None:
    """Parameters outweigh activations here (83M of them, 16 x 64 tokens), so the optimizer step is the peak. On
    torch 2.11 the simulated fused step counted DTensor's sharding propagation: 32 bytes per parameter where CUDA
    holds about 16 (the 0.9B Llama's flat 26.41 GiB). Reproduced and fixed on CPU with torch 2.11; this checks it
    against CUDA's own count."""
    from autoshard.budget import price
    from autoshard.intent import ShardingIntent
    from autoshard.lightning.fsdp2 import FSDP2Strategy

    wide = functools.partial(FusedGPT, use_cache=False, width=1024, vocab=32000, seq=64)
    ids = torch.randint(0, 32000, (16 * 3, 64), generator=torch.Generator().manual_seed(0))
    plain = {"reshard_after_forward": True, "activation_checkpointing": False, "offload": "none"}
    ((simulated, _),) = price(wide, [ids[:16]], ShardingIntent(), 1, [plain], precision="bf16-mixed")
    peak = Peak()
    fit_on_gpu(FSDP2Strategy(intent=ShardingIntent(**plain)), ids, peak, wide())
    print(f"simulated {simulated} B, CUDA max_memory_allocated {peak.peak} B, ratio {simulated / peak.peak:.3f}")
    assert peak.peak > 0 and simulated == pytest.approx(peak.peak, rel=0.10)
