"""One rank of the memory-budget fit checks (tests/distributed/test_budget_fit.py), for fsdp2 ("fs_*") and
autoshard-deepspeed ("ds_*") in one process pair.

Per backend, in this order: a run given only a memory budget (it decides, logs the table on rank 0, trains, saves a
checkpoint holding the decision); the same configuration set by hand (it must train the same: losses and weights);
a resume with the same budget (keeps the checkpoint's decision); a resume with another budget (decides again and says
so); an impossible budget (refused on both ranks before anything is sharded, with the smallest world size that fits).
The budgets come from the test (``BUDGET_FIT`` JSON), computed there with ``autoshard.budget.price`` on the same module
and batch shapes. Each run: 32-true, a shuffling DataLoader (Lightning's DistributedSampler) and dropout, so a decision
that moved the global RNG (its first-batch read) would change the losses.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers the strategies
from autoshard.intent import BUDGET_FIELDS

DIM, DEPTH, STEPS = 32, 3, 4
ROWS = {"fs": 16, "ds": 2}  # per-rank micro-batch: DeepSpeed's on 2 rows, so that model states (its knob) dominate
PG_TIMEOUT = timedelta(seconds=90)
DONE: dict[str, Any] = {}  # what a scenario leaves for the next (the budget run's weights, for the run by hand)


class Net(pl.LightningModule):
    """Three residual blocks (the units activation checkpointing wraps), dropout, SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * DIM, DIM)) for _ in range(DEPTH)
        )
        self.head = nn.Linear(DIM, 1)
        self.losses: list[torch.Tensor] = []  # tensors: the simulated step runs this on fake ones, which have no value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self(x).pow(2).mean()
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batch(backend: str) -> list[torch.Tensor]:
    """One micro-batch of the shapes training_step receives (what the test prices)."""
    return [torch.randn(ROWS[backend], 16, DIM)]


def loader(backend: str, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS[backend] * STEPS * world, 16, DIM, generator=g)
    return DataLoader(TensorDataset(x), batch_size=ROWS[backend], shuffle=True)


class Logged(logging.Handler):
    """What Lightning's rank_zero_info / rank_zero_warn say (rank 0 only)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def strategy(backend: str, fields: dict[str, Any]) -> Any:
    intent = {"precision": "32-true", **fields}
    if backend == "ds":
        from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

        return AutoShardDeepSpeedStrategy(intent, timeout=PG_TIMEOUT)
    from autoshard.lightning import FSDP2Strategy

    return FSDP2Strategy(intent, timeout=PG_TIMEOUT)


def full_weights(backend: str, module: nn.Module) -> dict[str, torch.Tensor]:
    if backend == "ds":
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in module.named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def fit(backend: str, fields: dict[str, Any], epochs: int = 1, ckpt_path: Path | None = None, calls: list[int] | None = None) -> dict[str, Any]:
    world = int(os.environ["BUDGET_FIT_WORLD"])
    pl.seed_everything(0, verbose=False)
    module = Net()
    if calls is not None:  # each block's first Linear, per call: a checkpointed block runs it again in backward
        calls.extend([0] * DEPTH)
        for i, block in enumerate(module.blocks):
            block[1].register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    chosen = strategy(backend, fields)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=chosen,
        precision="32-true",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    said = Logged()
    logging.getLogger("lightning.pytorch").addHandler(said)
    start = time.perf_counter()
    error: dict[str, Any] | None = None
    try:
        trainer.fit(module, loader(backend, world), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    except Exception as exc:  # a refusal: every rank must raise it, before anything is sharded
        error = {"type": type(exc).__name__, "message": str(exc), "min_world_size": getattr(exc, "min_world_size", None)}
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(said)
    decision = getattr(chosen, "budget_decision", None)
    return {
        "trainer": trainer,
        "module": module,
        "strategy": chosen,
        "error": error,
        "logs": said.lines,
        "decision": decision.to_dict() if decision is not None else None,
        "fields": {f: getattr(chosen.intent, f) for f in BUDGET_FIELDS},
        "seconds": time.perf_counter() - start,
    }


def summary(backend: str, run: dict[str, Any]) -> dict[str, Any]:
    out = {k: run[k] for k in ("error", "logs", "decision", "fields", "seconds")}
    out["losses"] = losses(run["module"])
    out["global_step"] = run["trainer"].global_step
    if backend == "ds" and run["error"] is None:
        zero = run["strategy"].config["zero_optimization"]
        out["zero_offload"] = {k: zero[k]["device"] for k in ("offload_optimizer", "offload_param") if k in zero}
        out["checkpointed"] = run["strategy"].checkpointed.get(id(run["module"]))
    return out


def losses(module: Net) -> list[float]:
    return [float(loss) for loss in module.losses]


def work() -> Path:
    return Path(os.environ["BUDGET_FIT_WORK"])


def budgets() -> dict[str, int]:
    return json.loads(os.environ["BUDGET_FIT"])


# -- the scenarios, per backend -------------------------------------------------------------------------------------
def decided(backend: str) -> dict[str, Any]:
    from autoshard.checkpoint.resume import stored_budget_decision

    run = fit(backend, {"memory_budget": budgets()[backend]})
    path = work() / f"{backend}-budget.ckpt"
    run["trainer"].save_checkpoint(path)
    out = summary(backend, run)
    out["stored"] = stored_budget_decision(path)  # what a resume reads before sharding
    DONE[backend] = {"weights": full_weights(backend, run["module"]), "losses": losses(run["module"]), "chosen": run["decision"]["chosen"]}
    return out


def by_hand(backend: str) -> dict[str, Any]:
    run = fit(backend, dict(DONE[backend]["chosen"]))
    out = summary(backend, run)
    weights, before = full_weights(backend, run["module"]), DONE[backend]["weights"]
    out["max_weight_diff_vs_budget_run"] = max(float((weights[n] - before[n]).abs().max()) for n in before)
    initial = Net().state_dict()
    out["least_weight_change"] = min(float((weights[n] - initial[n]).abs().max()) for n in before)
    out["losses_equal_budget_run"] = losses(run["module"]) == DONE[backend]["losses"]
    return out


def resumed(backend: str) -> dict[str, Any]:
    return summary(backend, fit(backend, {"memory_budget": budgets()[backend]}, epochs=2, ckpt_path=work() / f"{backend}-budget.ckpt"))


def changed(backend: str) -> dict[str, Any]:
    return summary(backend, fit(backend, {"memory_budget": "1GiB"}, epochs=2, ckpt_path=work() / f"{backend}-budget.ckpt"))


def checkpointing(backend: str) -> dict[str, Any]:
    """Each activation-checkpointing mode DeepSpeed runs, set by hand ('selective' is refused at construction there):
    which blocks ran their forward again in backward, and the losses and final weights against no checkpointing
    (recomputation restores the RNG: dropout draws the same mask)."""
    out: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for mode in (False, True, 2):
        calls: list[int] = []
        run = fit(backend, {"activation_checkpointing": mode}, calls=calls)
        weights = full_weights(backend, run["module"])
        if mode is False:
            plain = {"losses": losses(run["module"]), "weights": weights}
        out[str(mode)] = {
            **summary(backend, run),
            "calls_per_step": [c / STEPS for c in calls],
            "losses_equal_plain": losses(run["module"]) == plain["losses"],
            "max_weight_diff_vs_plain": max(float((weights[n] - plain["weights"][n]).abs().max()) for n in weights),
        }
    return out


def impossible(backend: str) -> dict[str, Any]:
    run = fit(backend, {"memory_budget": budgets()[f"{backend}_impossible"], "pinned": ("offload",)})
    out = summary(backend, run)
    params = list(run["module"].parameters())
    out["sharded"] = any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in params)
    out["model_type"] = type(run["strategy"].model).__name__
    return out


SCENARIOS = {
    f"{backend}_{name}": (lambda fn=fn, backend=backend: fn(backend))
    for backend in ("fs", "ds")
    for name, fn in (
        ("decided", decided),
        ("by_hand", by_hand),
        ("resumed", resumed),
        ("changed", changed),
        ("impossible", impossible),
        ("checkpointing", checkpointing),
    )
}


if __name__ == "__main__":
    os.environ["BUDGET_FIT_WORLD"] = os.environ["WORLD_SIZE"]  # Lightning's teardown deletes WORLD_SIZE after a fit
    from tests.distributed.harness import run_scenarios

    run_scenarios(SCENARIOS)
