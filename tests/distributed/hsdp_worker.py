"""One rank of the hybrid-sharding (HSDP) checks: 4 gloo processes, ``FSDP2Strategy(shard_size=2)`` against pure FSDP,
and DCP checkpoints resumed across a change of shard size and of world size.

Launched by tests/distributed/test_hsdp.py through the harness; each scenario returns what THIS rank holds, and the
test compares ranks and scenarios. Both training scenarios build the same model from the same seed on every rank and
read the same batches, in fp32, so HSDP and FSDP must end on the same weights. The resume scenarios chain: an HSDP
save (4 ranks) resumed under pure FSDP (4 ranks), which saves again, resumed under HSDP; then a 2-rank launch (cwd
inside the 4-rank one's, so ``../checkpoints``) resumes the HSDP save under pure FSDP.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DataLoader, TensorDataset

from autoshard.demo import ema_update
from autoshard.lightning import FSDP2Strategy
from tests.distributed.checkpoint_worker import Capture, compare, full_state
from tests.distributed.harness import JOB_WORLD_SIZE, quiet_trainer, run_scenarios

STEPS = 8


class Regressor(pl.LightningModule):
    """A student MLP with an EMA teacher, and a root parameter the plan keeps whole (its gradient is averaged)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.student = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            self.teacher(x)  # forwarded, as a method's teacher is; it takes no part in the loss
        loss = F.mse_loss(self.student(x * self.scale), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        ema_update(self.teacher, self.student, 0.9)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(samples: int | None = None) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples or STEPS * 4 * JOB_WORLD_SIZE, 8, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(8, 4, generator=g)))


def fit(**intent: Any) -> dict[str, Any]:
    torch.manual_seed(0)  # the same whole model on every rank: each keeps its own chunk of it
    model = Regressor()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = quiet_trainer(strategy=FSDP2Strategy(**intent), precision="32-true", max_epochs=1)
    trainer.fit(model, DataLoader(data(), batch_size=4, shuffle=False))
    params = dict(model.named_parameters())
    sharded = {n: p for n, p in params.items() if isinstance(p, DTensor)}
    # full_tensor is a collective: every rank gathers every parameter, in the same order
    full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}
    mesh = next(iter(sharded.values())).device_mesh
    return {
        "hsdp": trainer.strategy.hsdp_sizes,
        "mesh_shape": list(mesh.shape),
        "mesh_dims": list(mesh.mesh_dim_names or ()),
        "coordinate": mesh.get_coordinate(),
        "sharded": sorted(sharded),
        "placements": {n: [str(x) for x in p.placements] for n, p in sharded.items()},
        "hsdp_placements": all(p.placements == (Replicate(), Shard(0)) for p in sharded.values()),
        "same_mesh": all(p.device_mesh == mesh for p in sharded.values()),
        "rows": {n: [p.to_local().shape[0], p.shape[0]] for n, p in sharded.items()},
        "local": {n: p.to_local().detach().flatten().tolist() for n, p in sharded.items()},
        "full": {n: t.flatten().tolist() for n, t in full.items()},
        "changed": {n: not torch.equal(full[n], start[n]) for n in full},
        "losses": model.losses,
        "rank": dist.get_rank(),
    }


def scenario_hsdp() -> dict[str, Any]:
    return fit(shard_size=2)


def scenario_fsdp() -> dict[str, Any]:
    return fit()


# -- DCP resume across shard sizes and world sizes -------------------------------------------------------------------
CHECKPOINTS = Path("checkpoints")  # in the 4-rank launch's directory (the workers' cwd)
RESUME_SAMPLES = 64  # the same data at every world size: 4 steps per epoch at 4 ranks, 8 at 2


class Resumable(Regressor):
    """The HSDP model with AdamW, whose per-parameter state (step, exp_avg, exp_avg_sq) must come back exactly."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def resume_run(checkpoints: Path | None, ckpt_path: Path | None, max_epochs: int, max_steps: int = -1, **intent: Any) -> dict[str, Any]:
    """One fit of Resumable (from ``ckpt_path`` if given), saving at every epoch end into ``checkpoints`` (None: no
    saves); the state right after the restore, at every epoch end and at the end, unsharded: weights, optimizer."""
    torch.manual_seed(0)
    model, capture = Resumable(), Capture(None)
    savers = [ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_top_k=-1, filename="{epoch}-{step}")] if checkpoints else []
    trainer = quiet_trainer(strategy=FSDP2Strategy(**intent), precision="32-true", max_epochs=max_epochs, max_steps=max_steps,
                            callbacks=[capture, *savers], enable_checkpointing=bool(savers), num_sanity_val_steps=0)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data(RESUME_SAMPLES), batch_size=4, shuffle=False), ckpt_path=ckpt_path)
    return {
        "start": capture.start,
        "epochs": capture.epochs,
        "final": full_state(trainer, model, None),
        "losses": model.losses,
        "global_step": trainer.global_step,
        "hsdp": trainer.strategy.hsdp_sizes,
        # Every fit warns once that the root parameter `scale` is partly supported (the model's own choice); what
        # is checked is that resuming adds no warning of its own.
        "warnings": [str(w.message) for w in caught if "autoshard" in str(w.message) and "partial support" not in str(w.message)],
    }


def resumed_report(saved: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
    """Loaded == saved, bit for bit (weights, AdamW state, step counter), then it trained on."""
    optimizer = sorted(k for k in saved if k.startswith("optimizer/") and "exp_avg" in k)
    return {
        "loaded_equals_saved": compare(saved, resumed["start"], ignore=("next_epoch",)),
        "optimizer_entries": len(optimizer),
        "trained": sorted(k for k in resumed["final"] if k.startswith("param/") and not torch.equal(resumed["start"][k], resumed["final"][k])),
        "losses": resumed["losses"],
        "steps": [saved["global_step"], resumed["global_step"]],
        "hsdp": resumed["hsdp"],
        "warnings": resumed["warnings"],
    }


def scenario_resume_across_shard_sizes() -> dict[str, Any]:
    """HSDP (2 x 2) saves at epoch 0; pure FSDP on the same 4 ranks resumes it and saves at epoch 1; HSDP resumes that."""
    hsdp = resume_run(CHECKPOINTS / "hsdp", None, 1, shard_size=2)
    saved = CHECKPOINTS / "hsdp" / "epoch=0-step=4.ckpt"
    fsdp = resume_run(CHECKPOINTS / "fsdp", saved, 2)
    back = resume_run(None, CHECKPOINTS / "fsdp" / "epoch=1-step=8.ckpt", 3, shard_size=2)
    if dist.get_rank() == 0:  # for the 2-rank launch
        torch.save(hsdp["epochs"][0], CHECKPOINTS / "hsdp_epoch0.pt")
    dist.barrier()
    return {
        "saved_hsdp": hsdp["hsdp"],
        "hsdp_to_fsdp": resumed_report(hsdp["epochs"][0], fsdp),
        "fsdp_to_hsdp": resumed_report(fsdp["epochs"][0], back),
        "layout": sorted(p.name for p in saved.iterdir()),
    }


def scenario_resume_on_2_ranks() -> dict[str, Any]:
    """The 4-rank HSDP checkpoint resumed under pure FSDP on 2 ranks (run from a directory inside the 4-rank one)."""
    here = Path("..") / CHECKPOINTS
    saved = torch.load(here / "hsdp_epoch0.pt", weights_only=True)
    resumed = resume_run(None, here / "hsdp" / "epoch=0-step=4.ckpt", 2, max_steps=7)  # 3 more steps
    return resumed_report(saved, resumed)


SCENARIOS = {
    "hsdp": scenario_hsdp,
    "fsdp": scenario_fsdp,
    "resume_across_shard_sizes": scenario_resume_across_shard_sizes,
    "resume_on_2_ranks": scenario_resume_on_2_ranks,
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
