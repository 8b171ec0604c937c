"""One rank of the DeepSpeed ZeRO-3 (CPU, gloo) checks of "user hooks, called exactly as Lightning calls them".

Launched by tests/distributed/test_hooks.py. stable-pretraining's probe (configure_optimizers wrapped in the
callback's setup, asserting a single call) and an EMA teacher are refused before the engine is built, by name,
whether the layers exist at construction or are built in configure_model.
"""

from __future__ import annotations

import os
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import lightning.pytorch as pl
import torch
from torch import nn

import autoshard  # noqa: F401  points Lightning's "deepspeed_stage_3" at autoshard's guarded strategy
from autoshard.errors import IncompatibleBackendError
from tests.distributed.harness import quiet_trainer, run_scenarios
from tests.distributed.hooks_worker import EMACallback, EMAWithProbe, Encoder, WrappingProbe, loader


class BuildsInConfigureModel(EMAWithProbe):
    """The student/teacher pair exists only once configure_model ran (under ZeRO-3: inside zero.Init); a stem
    exists from the start, so the module has parameters before configure_model."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.stem = nn.Linear(8, 8)
        self.nets = nn.ModuleDict()
        self.automatic_optimization = False

    def configure_model(self) -> None:
        if "student" not in self.nets:
            self.nets["student"] = Encoder()
            self.nets["teacher"] = Encoder().requires_grad_(False)

    @property
    def student(self) -> nn.Module:
        return self.nets["student"]

    @property
    def teacher(self) -> nn.Module:
        return self.nets["teacher"]

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD([*self.stem.parameters(), *self.nets["student"].parameters()], lr=0.1)]


def refused(module: pl.LightningModule) -> dict[str, Any]:
    probe = WrappingProbe()
    trainer = quiet_trainer(strategy="deepspeed_stage_3", precision="32-true", max_steps=1, callbacks=[probe, EMACallback()])
    out: dict[str, Any] = {"error": "", "message": "", "refusal": False}
    try:
        trainer.fit(module, loader())
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        out.update(error=type(exc).__name__, message=str(exc), refusal=isinstance(exc, IncompatibleBackendError))
    out["calls"] = probe.calls
    out["model_type"] = type(trainer.strategy.model).__name__
    return out


SCENARIOS = {
    "ema_probe": lambda: refused(EMAWithProbe()),
    "configure_model_builds": lambda: refused(BuildsInConfigureModel()),
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
