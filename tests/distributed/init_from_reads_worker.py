"""One rank of the init_from read checks; launched by tests/distributed/test_init_from_reads.py through the harness.

A safetensors file cut short: every rank must name the cause (it used to fail on the rank reading past the end only,
at load, while rank 0 printed "loaded" and then died in the next collective with gloo's "Connection closed").
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers strategy="fsdp2"
from tests.distributed.harness import quiet_trainer, run_scenarios

RANK = int(os.environ["RANK"])


class Wide(pl.LightningModule):
    """Rows enough for each rank's shard to lie in another half of the file."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 256)
        self.head = nn.Linear(256, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(torch.tanh(self.body(batch[0]))).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def scenario_truncated_safetensors() -> dict[str, Any]:
    from safetensors.torch import save_file

    from autoshard.lightning import FSDP2Strategy

    path = Path(os.getcwd()).parent / "truncated.safetensors"
    if RANK == 0:
        torch.manual_seed(0)
        save_file({k: v.contiguous() for k, v in Wide().state_dict().items()}, str(path))
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 3 // 4])  # the body's last rows, and the head, are gone
    dist.barrier()
    strategy = FSDP2Strategy(init_from=str(path))
    trainer = quiet_trainer(strategy=strategy, max_steps=1, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"error": None, "message": None}
    try:
        trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        out.update(error=type(exc).__name__, message=str(exc))
    out.update(loaded=strategy.init_report is not None, seconds=time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    run_scenarios({"truncated_safetensors": scenario_truncated_safetensors})
