"""``autoshard explain`` for a Fabric loop (no LightningModule): ``fabric_target(model, optimizers, loss)`` plans the
model as ``Fabric(strategy="fsdp2")`` does at setup and simulates one step that runs the user's own loss."""

from __future__ import annotations

import torch
from torch import nn

from autoshard.errors import AutoShardError
from autoshard.explain import ExplainOptions, explain
from autoshard.fabric import fabric_target


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_explain_plans_like_fabric_and_the_step_runs_the_users_loss() -> None:
    seen: list[tuple[int, ...]] = []

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(batch.shape))
        return model(batch).pow(2).mean()

    def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.AdamW(model.embed.parameters()),
            torch.optim.SGD([*model.blocks.parameters(), *model.head.parameters()], lr=0.1, momentum=0.9),
        ]

    report = explain(fabric_target(Net, optimizers, loss), batch=lambda: torch.randn(4, 6), world_sizes=(2,))
    assert report.error is None and report.incomplete is None, (report.error, report.incomplete)
    assert report.target == "fabric_target(Net)" and report.decision is not None and report.decision.backend == "fsdp2"
    assert [u.name for u in report.plan.units] == ["blocks.0", "blocks.1", "embed", "head"]  # what fabric.setup shards
    assert report.needs.num_optimizers == 2
    assert seen and set(seen) == {(4, 6)}  # the simulated step called the loss on the batch
    (estimate,) = report.memory
    assert estimate.activations > 0 and estimate.step_peak > estimate.model_states, estimate
    assert Net().__class__ is Net  # the user's class is untouched: the methods live on a subclass made for explain


def test_a_factory_that_returns_no_module_is_refused() -> None:
    report_or_error = None
    try:
        report_or_error = explain(fabric_target(lambda: "not a module"), options=ExplainOptions(simulate=False))  # type: ignore[arg-type,return-value]
    except AutoShardError as exc:
        report_or_error = str(exc)
    assert isinstance(report_or_error, str) and "returned str, not an nn.Module" in report_or_error, report_or_error
