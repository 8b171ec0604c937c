"""One rank of the setup-memory benchmark: peak RSS after setup, model built on meta vs built whole on CPU.

ru_maxrss only grows, so each mode needs its own process pair. Launched by run.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402,F401  registers strategy="fsdp2"
from autoshard._harness import write_result  # noqa: E402
from benchmarks.models import BigModel  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def peak_rss_mib() -> float:
    """This process's peak RSS. Linux's VmHWM first: ru_maxrss survives exec, so a worker started by a big parent
    would report the parent's size as its own peak; getrusage where /proc is missing."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class AtTrainStart(pl.Callback):
    """Setup is over here: the module is sharded and materialized, the optimizer built, no step taken."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pl_module.parameters())
        self.seen = {"peak_rss_mib": peak_rss_mib(), "local_param_mib": local / 2**20, "setup_done_s": time.perf_counter()}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--mode", choices=("meta", "naive"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    base = peak_rss_mib()
    start = time.perf_counter()
    at_start = AtTrainStart()
    trainer = pl.Trainer(
        strategy="fsdp2",
        accelerator="cpu",
        devices=WORLD,
        precision="32-true",
        max_steps=1,
        callbacks=[at_start],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    if args.mode == "meta":
        with trainer.init_module(empty_init=True):
            model = BigModel()
    else:
        model = BigModel()
    full = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    after_build = peak_rss_mib()
    g = torch.Generator().manual_seed(0)
    trainer.fit(
        model, DataLoader(TensorDataset(torch.randn(8 * WORLD, 2048, generator=g), torch.randint(0, 2, (8 * WORLD,), generator=g)), batch_size=8)
    )
    seen = at_start.seen
    write_result(
        args.out,
        RANK,
        {
            "mode": args.mode,
            "model_mib": full,
            "base_rss_mib": base,
            "after_build_rss_mib": after_build,
            "setup_peak_rss_mib": seen["peak_rss_mib"],
            "local_param_mib": seen["local_param_mib"],
            "build_and_setup_s": seen["setup_done_s"] - start,
        },
    )


if __name__ == "__main__":
    main()
