"""One rank of the collective-bytes benchmark: what FSDP2 all-gathers and reduce-scatters per step under bf16-mixed.

Two variants in one process pair: autoshard's bf16-mixed (bf16 all-gather, fp32 reduce), and the fp32 all-gather
autoshard did before: ``ShardingIntent(param_dtype="float32")`` builds exactly the old
``MixedPrecisionPolicy(None, None)``. The harness's ``count_collectives`` wraps the two collectives fully_shard
calls and counts bytes: the gathered output and the reduce-scatter input (the full unit, per rank).
Launched by run.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autoshard  # noqa: E402,F401  registers strategy="fsdp2"
from autoshard._harness import count_collectives, quiet_trainer, write_result  # noqa: E402
from autoshard.intent import ShardingIntent  # noqa: E402
from autoshard.lightning import FSDP2Strategy  # noqa: E402
from autoshard.memory import EstimateOptions, estimate_memory  # noqa: E402
from benchmarks.models import StepModel  # noqa: E402
from benchmarks.step_worker import step_data  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
VARIANTS = {
    "before": ("fp32 all-gather (what autoshard did: param_dtype='float32')", {"param_dtype": "float32"}),
    "after": ("autoshard bf16-mixed (bf16 all-gather, fp32 reduce)", {}),
}


class PerStep(pl.Callback):
    """The bytes of each training step (forward, backward, optimizer step), counted between batch start and end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, dict[str, int]]] = []
        self._ctx: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._ctx = count_collectives()
        self.steps.append(self._ctx.__enter__())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._ctx.__exit__(None, None, None)


def run_variant(label: str, fields: dict[str, Any], steps: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    per_step = PerStep()
    strategy = FSDP2Strategy(**fields)
    quiet_trainer(strategy=strategy, precision="bf16-mixed", max_steps=steps, callbacks=[per_step]).fit(StepModel(), step_data(steps))
    with torch.device("meta"):
        twin = StepModel()
    estimate = estimate_memory(twin, ShardingIntent(**fields), None, WORLD, options=EstimateOptions(rank=RANK, precision=strategy.precision_plan))
    return {
        "label": label,
        "steps": per_step.steps,
        "mp_policy": strategy.plan.to_dict()["settings"]["mp_policy"] if strategy.plan else None,
        "gathered_block": estimate.gathered_block,
        "gather_dtype": estimate.gather_dtype,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in StepModel().parameters())
    results = {name: run_variant(label, fields, args.steps) for name, (label, fields) in VARIANTS.items()}
    write_result(args.out, RANK, {"parameters": parameters, "variants": results})


if __name__ == "__main__":
    main()
