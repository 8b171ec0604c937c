"""The bad-input catalog, issue 39 (round four of real clients): a stale ``NODE_RANK``, a memory budget whose first
step is skipped, ``zero_overrides`` mistakes, and the decision line naming the strategy asked for. In process: each
refusal happens where the Trainer, Fabric or the strategy is built, before any process waits.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import autoshard  # noqa: F401  registers the strategies and guards
from autoshard.backends import Availability
from autoshard.errors import AutoShardError, IntentError
from tests.test_bad_inputs import refused

LAUNCHED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def isolated_environment() -> Iterator[None]:
    """Trainer and Fabric construction set MASTER_PORT & co., the tests set NODE_RANK: undo them all."""
    environ = dict(os.environ)
    for key in [k for k in os.environ if k in LAUNCHED or k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        del os.environ[key]
    yield
    os.environ.clear()
    os.environ.update(environ)


def test_192_a_stale_node_rank_is_refused_before_any_process_waits() -> None:
    """``NODE_RANK=1`` left in the shell: an fsdp2 fit, even with ``devices=1``, waited at 'MEMBER: 2/1' forever.
    Refused when the Trainer (or Fabric) is built, naming the variable and the Fix; node 1 of a real two-node launch
    (``num_nodes=2`` with MASTER_ADDR and MASTER_PORT) is built as before, and a node above 0 with no port to meet node
    0 at is refused too."""
    from lightning.fabric import Fabric

    def trainer(**kwargs: object) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", strategy="fsdp2", logger=False, enable_checkpointing=False, **kwargs)  # type: ignore[arg-type]

    os.environ["NODE_RANK"] = "1"
    for strategy in ("fsdp2", "auto-shard"):
        refused(
            IntentError,
            lambda strategy=strategy: pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False),
            "NODE_RANK=1 is set in the environment, so Lightning numbers this node's processes from rank 1",
            "Trainer(devices=1) describes one node, node 0, with rank 0 only: rank 1 would wait at 'MEMBER: 2/1' forever",
            "Fix: `unset NODE_RANK` and run the script again",
        )
    refused(IntentError, lambda: trainer(devices=2), "rank 2 would wait at 'MEMBER: 3/2'", "Fix: `unset NODE_RANK`")
    refused(IntentError, lambda: Fabric(accelerator="cpu", devices=2, strategy="fsdp2"), "Fabric(devices=2) describes", "Fix: `unset NODE_RANK`")
    refused(
        IntentError,
        lambda: trainer(devices=1, num_nodes=2),
        "MASTER_PORT is not set",
        "so this process is on node 1 (rank 1 of 2)",
        "Fix: for a run on this machine alone, `unset NODE_RANK` and Trainer(num_nodes=1)",
    )
    os.environ.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert trainer(devices=2, num_nodes=2).node_rank == 1  # a real launch of node 1 of 2
    del os.environ["NODE_RANK"]
    os.environ["GROUP_RANK"] = "3"  # Lightning reads it when NODE_RANK is absent
    refused(IntentError, lambda: trainer(devices=1, num_nodes=2), "GROUP_RANK=3 is set", "Fix: `unset GROUP_RANK`")
    os.environ["NODE_RANK"] = "0"  # what Lightning's own launcher, and a fit before in this process, leave
    assert trainer(devices=2).node_rank == 0


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_195_the_decision_line_names_the_strategy_asked_for_and_what_it_resolved_to(caplog: pytest.LogCaptureFixture) -> None:
    """``strategy='auto-shard'`` logged "autoshard chose fsdp2 (strategy='fsdp2')", as if fsdp2 had been asked for:
    the Trainer's log, Fabric's and ``autoshard explain`` now name what was asked and what it resolved to; a strategy
    asked by its own name reads as before."""
    from lightning.fabric import Fabric

    from autoshard.explain import explain
    from autoshard.needs import MethodNeeds
    from autoshard.select import select_backend

    auto = "autoshard chose fsdp2 for strategy='auto-shard' (strategy='fsdp2' names it directly)"
    with caplog.at_level(logging.INFO):
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="auto-shard", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(Small(), DataLoader(torch.randn(4, 4), batch_size=2))
        fabric = Fabric(accelerator="cpu", devices=1, strategy="auto-shard")
        fabric.launch()
        model = Small()
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    chose = [r.getMessage().splitlines()[0] for r in caplog.records if r.getMessage().startswith("autoshard chose")]
    assert chose == [auto, auto], chose
    assert explain(Small).text().count(auto) == 1
    assert select_backend(MethodNeeds(), prefer="fsdp2").describe().splitlines()[0] == "autoshard chose fsdp2 (strategy='fsdp2')"
    # auto-shard built autoshard's DeepSpeed strategy for the intent: that strategy's decision says so
    deepspeed = select_backend(
        MethodNeeds(), prefer="autoshard-deepspeed", applied="auto-shard", available={"deepspeed_zero3": Availability(True, "test")}
    )
    assert deepspeed.describe().splitlines()[:2] == [
        "autoshard chose deepspeed_zero3 for strategy='auto-shard' (strategy='autoshard-deepspeed' names it directly)",
        "  requested: deepspeed_zero3 (by strategy='auto-shard', for what the intent asks)",
    ]
    assert deepspeed.to_dict()["asked"] == "auto-shard"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_194_zero_overrides_mistakes_are_refused_at_construction_in_words() -> None:
    """A misspelt key or a value of the wrong type in ``zero_overrides`` reached ``deepspeed.initialize`` as pydantic's
    raw ValidationError, after every process had started: refused when the strategy is built (the Trainer's and
    Fabric's), with the key, the value, what DeepSpeed expects and a Fix (the key's spelling when it is close)."""
    from autoshard.fabric.deepspeed import AutoShardDeepSpeedStrategy as FabricDeepSpeed
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    for strategy in (AutoShardDeepSpeedStrategy, FabricDeepSpeed):
        refused(
            IntentError,
            lambda strategy=strategy: strategy(zero_overrides={"stage3_prefetch_bucket_sise": 10_000_000}),
            "zero_overrides['stage3_prefetch_bucket_sise']=10000000: DeepSpeed's ZeRO config has no key 'stage3_prefetch_bucket_sise'",
            "Fix: spell it 'stage3_prefetch_bucket_size': zero_overrides['stage3_prefetch_bucket_size']=10000000",
        )
    refused(
        IntentError,
        lambda: AutoShardDeepSpeedStrategy(zero_overrides={"offload_optimizer": {"device": "cpu", "pin_memroy": True}}),
        "no key 'pin_memroy' in its 'offload_optimizer' block",
        "Fix: spell it 'pin_memory': zero_overrides['offload_optimizer']['pin_memory']=True",
    )
    refused(
        IntentError,
        lambda: AutoShardDeepSpeedStrategy(zero_overrides={"sub_group_size": 1.5}),
        "zero_overrides['sub_group_size']=1.5: DeepSpeed's ZeRO config expects a whole number there",
        "Fix: zero_overrides['sub_group_size']=1_000_000_000 (a whole number; the default, which dropping the key gives too)",
    )
    refused(
        IntentError,
        lambda: AutoShardDeepSpeedStrategy(zero_overrides={"overlap_comm": "maybe"}),
        "zero_overrides['overlap_comm']='maybe': DeepSpeed's ZeRO config expects True or False there",
        "Fix: zero_overrides['overlap_comm']=True",
    )
    refused(
        IntentError,
        lambda: AutoShardDeepSpeedStrategy(zero_overrides={"stage": "3"}),
        "zero_overrides['stage']='3': autoshard's DeepSpeed strategies run ZeRO stage 3 only, the integer 3",
        "Fix: drop 'stage' from zero_overrides (it is always 3)",
    )
    refused(
        IntentError,
        lambda: AutoShardDeepSpeedStrategy(zero_overrides={"stage3_prefetch_bucket_size": "big"}),
        "'zero_optimization.stage3_prefetch_bucket_size': must be a non-negative number of elements, got 'big'",
        "Fix: remove it to use the default (50,000,000)",
    )
    kept = AutoShardDeepSpeedStrategy(zero_overrides={"stage3_prefetch_bucket_size": 1000, "overlap_comm": False})
    assert kept.zero_overrides == {"stage3_prefetch_bucket_size": 1000, "overlap_comm": False}


class SkipsWarmUp(Small):
    """Skips its first ``warm_up`` batches (returns None: Lightning runs no backward or optimizer step for them)."""

    warm_up = 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx < self.warm_up else loss


def test_193_a_memory_budget_with_a_training_step_that_skips_its_first_batch() -> None:
    """The budget's simulated step ran ``training_step(batch, 0)`` only, and a method that skips that batch was refused
    with advice about the batch's shapes. Now the next batch_idx is measured and the run trains as without a budget
    (the same weights); a method that skips both batch_idx 0 and 1 is refused saying so, with a Fix about the step."""
    from autoshard.lightning import FSDP2Strategy

    def fit(strategy: FSDP2Strategy, model: Small) -> Small:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(model, DataLoader(torch.arange(32.0).view(8, 4) / 32, batch_size=2))
        return model

    torch.manual_seed(0)
    plain, budgeted = SkipsWarmUp(), SkipsWarmUp()
    budgeted.load_state_dict(plain.state_dict())
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    fit(FSDP2Strategy(), plain)
    fit(FSDP2Strategy(memory_budget="1GiB"), budgeted)
    for (name, a), b in zip(plain.state_dict().items(), budgeted.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()) and not torch.equal(a.full_tensor(), before[name]), name

    always = SkipsWarmUp()
    always.warm_up = 2
    refused(
        AutoShardError,
        lambda: fit(FSDP2Strategy(memory_budget="1GiB"), always),
        "training_step returned None on the first batch of the train DataLoader, float32[2, 4], for batch_idx 0 and 1:",
        "so there is no training step to measure (the batch's shapes are not the cause)",
        "Fix: make training_step return the loss (or a dict with 'loss') for batch_idx 1",
    )
