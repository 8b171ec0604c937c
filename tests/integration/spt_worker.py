"""One rank of the opt-in stable-pretraining 0.1.8 check (tests/integration/test_stable_pretraining.py).

A BYOL-like method written the library's way: ``spt.Module`` with a ``TeacherStudentWrapper`` backbone, the EMA
update done by ``TeacherStudentCallback``, and an ``OnlineProbe`` whose optimizer is built inside the wrapped
``configure_optimizers`` (which asserts it runs once). spt's own ``configure_model`` shards by itself under any
ModelParallelStrategy, with fully_shard's default resharding: autoshard must keep its guarantees anyway.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# PyPI's torchvision for torch 2.13 is a CUDA build: with CPU torch its import fails on these two op schemas
# (../shared/README.md). Defining them lets spt (which imports torchvision) load; nothing here calls them.
_shim = torch.library.Library("torchvision", "FRAGMENT")
_shim.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_shim.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import lightning.pytorch as pl  # noqa: E402
import stable_pretraining as spt  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchmetrics  # noqa: E402
from stable_pretraining.backbone.utils import TeacherStudentWrapper  # noqa: E402
from stable_pretraining.callbacks import OnlineProbe, TeacherStudentCallback  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import autoshard  # noqa: E402, F401  (after spt: autoshard's "fsdp2" replaces spt's, and says so)
from tests.distributed.harness import quiet_trainer, run_scenarios  # noqa: E402

RANK = int(os.environ["RANK"])


class Views(Dataset):
    def __len__(self) -> int:
        return 128

    def __getitem__(self, idx: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(idx)
        x = torch.randn(16, generator=g)
        return {"view0": x, "view1": x + 0.05 * torch.randn(16, generator=g), "label": int(x[0] > 0)}


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(16, 32)  # owned by the backbone's root: the no-reshard gotcha without a fix
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = x + block(x)
        return x


def byol_forward(self: Any, batch: dict[str, Any], stage: str) -> dict[str, Any]:
    online = self.predictor(self.projector(self.backbone.forward_student(batch["view0"])))
    with torch.no_grad():
        target = self.backbone.forward_teacher(batch["view1"])
    embedding = self.backbone.forward_student(batch["view0"]).detach()
    loss = (2 - 2 * F.cosine_similarity(online, self.projector(target).detach(), dim=-1)).mean()
    return {"loss": loss, "embedding": embedding, "label": batch["label"]}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def scenario_byol_with_probe() -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = spt.Module(
        forward=byol_forward,
        backbone=TeacherStudentWrapper(Backbone(), base_ema_coefficient=0.9),
        projector=nn.Linear(32, 32),
        predictor=nn.Linear(32, 32),
        optim={"optimizer": {"type": "AdamW", "lr": 1e-2}, "scheduler": "ConstantLR"},
    )
    probe = OnlineProbe(
        module,
        name="probe",
        input="embedding",
        target="label",
        probe=nn.Linear(32, 2),
        loss=nn.CrossEntropyLoss(),
        optimizer={"type": "SGD", "lr": 0.1},
        metrics={"top1": torchmetrics.classification.MulticlassAccuracy(2)},
    )
    teacher_before = [full(p.detach()).clone() for p in module.backbone.teacher.parameters()]
    trainer = quiet_trainer(strategy="auto-shard", max_steps=4, callbacks=[probe, TeacherStudentCallback()])
    trainer.fit(module, DataLoader(Views(), batch_size=8))
    teacher_after = [full(p.detach()) for p in module.backbone.teacher.parameters()]
    probe_module = module.callbacks_modules["probe"]
    return {
        "backend": trainer.strategy.decision.backend,
        "student_sharded": all(isinstance(p, DTensor) for p in module.backbone.student.parameters()),
        "teacher_sharded": all(isinstance(p, DTensor) for p in module.backbone.teacher.parameters()),
        "teacher_moved": any(not torch.equal(a, b) for a, b in zip(teacher_before, teacher_after)),
        "probe_weights": [full(p.detach()).flatten().tolist() for p in probe_module.parameters()],
        "teacher_weights": [t.flatten().tolist() for t in teacher_after],
    }


if __name__ == "__main__":
    run_scenarios({"byol_with_probe": scenario_byol_with_probe})
