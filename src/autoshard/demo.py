"""`make demo`: 2 CPU processes train a small DINO-like EMA method with an online probe under strategy="auto-shard".

The method is a plain LightningModule: no configure_model, nothing autoshard-specific. Run it with
``python -m autoshard.demo [--steps N] [--devices N]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    """Pre-norm residual MLP block: the unit a ViT-like stack is sharded by."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Encoder(nn.Module):
    """Backbone + projection head; ``temperature`` lives on the encoder root on purpose (the EMA gotcha)."""

    def __init__(self, in_dim: int = 16, dim: int = 32, depth: int = 3, out_dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, out_dim))
        self.temperature = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Lets the model be built on the meta device and materialized shard by shard."""
        nn.init.constant_(self.temperature, 0.5)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.features(x)
        return feats, self.head(feats) / self.temperature.abs().clamp(min=0.05)


class DinoLike(pl.LightningModule):
    """Student/teacher self-distillation: two views through the student, one through the EMA teacher."""

    def __init__(self, in_dim: int = 16, dim: int = 32, depth: int = 3, momentum: float = 0.9, lr: float = 1e-2) -> None:
        super().__init__()
        self.student = Encoder(in_dim, dim, depth)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        self.momentum = momentum
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x, _ = batch
        view1 = x + 0.1 * torch.randn_like(x)
        view2 = x + 0.1 * torch.randn_like(x)
        feats, s1 = self.student(view1)
        _, s2 = self.student(view2)
        with torch.no_grad():
            _, t1 = self.teacher(view1)
            _, t2 = self.teacher(view2)
        loss = 0.5 * (dino_loss(s1, t2) + dino_loss(s2, t1))
        self.log("loss", loss, prog_bar=True)
        return {"loss": loss, "features": feats.detach()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        ema_update(self.teacher, self.student, self.momentum)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.student.parameters(), lr=self.lr)


TEACHER_SHARPENING = 0.5  # teacher temperature / student temperature (DINO: 0.04 / 0.1)


def dino_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, sharpening: float = TEACHER_SHARPENING) -> torch.Tensor:
    """Cross-entropy from the sharpened teacher to the student: without the sharpening (DINO's lower teacher
    temperature) the loss stays near the teacher's own entropy and does not fall."""
    target = F.softmax(teacher_logits.float() / sharpening, -1)
    return -(target * F.log_softmax(student_logits.float(), -1)).sum(-1).mean()


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """The positional zip every EMA method uses; correct only if both are sharded identically."""
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(momentum).add_(s.detach(), alpha=1 - momentum)


class OnlineProbe(pl.Callback):
    """A linear probe trained by its own optimizer on detached features (like stable-pretraining's OnlineProbe)."""

    def __init__(self, dim: int = 32, classes: int = 4, lr: float = 0.1) -> None:
        self.dim, self.classes, self.lr = dim, classes, lr
        self.optimizer: torch.optim.Optimizer | None = None
        self.first_loss = self.last_loss = float("nan")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if getattr(pl_module, "probe", None) is None:
            pl_module.probe = nn.Linear(self.dim, self.classes)
        self.optimizer = torch.optim.SGD(pl_module.probe.parameters(), lr=self.lr)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.optimizer is not None
        logits = pl_module.probe(outputs["features"].float())
        loss = F.cross_entropy(logits, batch[1])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.last_loss = float(loss.detach())
        if self.first_loss != self.first_loss:  # nan: first batch
            self.first_loss = self.last_loss


def make_batch(batch_size: int = 32, in_dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch as the demo's DataLoader yields it: ``autoshard explain --batch autoshard.demo:make_batch``."""
    return torch.randn(batch_size, in_dim), torch.randint(0, 4, (batch_size,))


class Blobs(Dataset):
    """Gaussian blobs: a classification task a probe can learn and a self-distillation method can fit."""

    def __init__(self, n: int = 256, in_dim: int = 16, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        centers = 3 * torch.randn(classes, in_dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, in_dim, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def local_state_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this rank really holds: local shards of parameters and gradients, and optimizer state tensors."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    params = sum(local(p).numel() * p.element_size() for p in module.parameters())
    grads = sum(local(p.grad).numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    states = sum(
        local(v).numel() * v.element_size()
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"params": params, "grads": grads, "optimizer": states}


class LossTrace(pl.Callback):
    """The method's loss at its first and its last step, for the closing line: did it train?"""

    def __init__(self) -> None:
        self.first_loss = self.last_loss = float("nan")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last_loss = float(outputs["loss"].detach())
        if self.first_loss != self.first_loss:  # nan: first batch
            self.first_loss = self.last_loss


class MemoryReport(pl.Callback):
    """One line per rank: what it holds, against the unsharded total; rank 0 prints them all (ranks printing for
    themselves interleave)."""

    def __init__(self, probe: OnlineProbe | None = None) -> None:
        self.probe = probe

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)  # torch optimizers: Lightning wraps them only in module.optimizers()
        if self.probe is not None and self.probe.optimizer is not None:
            optimizers.append(self.probe.optimizer)
        held = local_state_bytes(pl_module, optimizers)
        full = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        line = (
            f"[rank {trainer.global_rank}] memory: params {held['params'] / 1024:.1f} KiB of {full / 1024:.1f} KiB"
            f" unsharded ({held['params'] / full:.0%}), grads {held['grads'] / 1024:.1f} KiB,"
            f" optimizer state {held['optimizer'] / 1024:.1f} KiB, peak RSS {rss:.0f} MiB"
        )
        lines: list[Any] | None = [line]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            lines = [None] * trainer.world_size if trainer.global_rank == 0 else None
            torch.distributed.gather_object(line, lines, dst=0)
        if lines is not None and trainer.global_rank == 0:
            print("\n".join(lines), flush=True)


def dino_with_probe() -> tuple[DinoLike, list[pl.Callback]]:
    """The demo's method and its probe callback: ``autoshard explain autoshard.demo:dino_with_probe``."""
    return DinoLike(), [OnlineProbe()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args(argv)

    import autoshard  # noqa: F401  registers strategy="auto-shard"

    # Lightning 2.6's own use of a torch API deprecated in torch 2.10+, once per rank: not the user's to act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    probe, trace = OnlineProbe(), LossTrace()
    trainer = pl.Trainer(
        strategy="auto-shard",
        accelerator="cpu",
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[probe, trace, MemoryReport(probe)],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = DinoLike()
    trainer.fit(model, DataLoader(Blobs(), batch_size=32, shuffle=True))
    if trainer.global_rank == 0:
        print(
            f"demo done: {args.steps} steps, method loss {trace.first_loss:.3f} -> {trace.last_loss:.3f},"
            f" probe loss {probe.first_loss:.3f} -> {probe.last_loss:.3f} (rank 0)",
            flush=True,
        )


if __name__ == "__main__":
    from autoshard._harness import worker_main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Each rank ends as the test workers do: on torch 2.13 a normal exit tears gloo's threads down during interpreter
    # finalization and now and then aborts ("terminate called without an active exception", exit -6) after the demo's
    # work is done (seen in make test); worker_main destroys the groups first, then leaves through os._exit.
    worker_main(main)
