"""Models the benchmarks share: a step-time model (with its hand-sharded twin), a 150 MB model, large module trees."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: the unit both autoshard and the hand-written version shard."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class StepModel(pl.LightningModule):
    """A plain supervised stack (about 3.2 M parameters at dim 256): nothing autoshard-specific in it."""

    def __init__(self, in_dim: int = 64, dim: int = 256, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HandShardedStepModel(StepModel):
    """The same model sharded by hand the way the FSDP2 docs show: one fully_shard per block, then the rest.

    ``reshard_after_forward=None`` is fully_shard's default. Here every unit is a sibling with no sharded parent,
    so each becomes an FSDP root and None then means False: nothing is resharded between forward and backward
    (fewer all-gathers, the whole model gathered at the peak). ``True`` is what autoshard's plan passes.
    """

    reshard_after_forward: bool | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.embed, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.head, mesh=mesh, reshard_after_forward=self.reshard_after_forward)


class HandShardedResharding(HandShardedStepModel):
    """The hand-written version with autoshard's setting: every unit reshards after forward."""

    reshard_after_forward = True


class HandCompiled(HandShardedResharding):
    """torchtitan's order by hand: each block compiled in place (``block.compile()``), then ``fully_shard``-ed."""

    def configure_model(self) -> None:
        for block in self.blocks:
            block.compile()
        super().configure_model()


class BigModel(pl.LightningModule):
    """About 151 MB of fp32 weights (9 x 2048x2048 linears): large enough that building it whole shows in RSS."""

    def __init__(self, dim: int = 2048, depth: int = 9) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


# -- module trees for plan timing -----------------------------------------------------------------------------------
MODULES_PER_BLOCK = 10  # block, norm1, attn, attn.qkv, attn.proj, norm2, mlp, mlp.0, mlp.1, mlp.2


class TreeBlock(nn.Module):
    """A ViT-like block: nested attention and MLP submodules, ten modules in all."""

    def __init__(self, dim: int, scalar: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim)
        self.attn.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        if scalar:
            self.gamma = nn.Parameter(torch.ones(()))  # layer-scale as a 0-dim parameter


def tree(modules: int, shape: str = "vit", dim: int = 8) -> nn.Module:
    """About ``modules`` modules in one of four shapes; build it under ``torch.device("meta")``."""
    blocks = max(1, modules // MODULES_PER_BLOCK)
    if shape == "ema":  # teacher/student, each half the tree
        root = nn.Module()
        root.student = tree(modules // 2, "vit", dim)
        root.teacher = copy.deepcopy(root.student).requires_grad_(False)
        return root
    root = nn.Module()
    root.backbone = nn.Module()
    root.backbone.blocks = nn.ModuleList(TreeBlock(dim, scalar=shape == "scalars") for _ in range(blocks))
    root.head = nn.Linear(dim, 2)
    if shape == "frozen_norms":  # fine-tuning with frozen first norms
        for block in root.backbone.blocks:
            block.norm1.requires_grad_(False)
    return root


TREE_SHAPES = ("vit", "ema", "scalars", "frozen_norms")
