"""The fsdp2 / auto-shard strategies in one process: registration, guards and refusals, with their exact texts."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autoshard import IncompatibleBackendError, IntentError
from autoshard.errors import AutoShardError
from autoshard.lightning import AutoShardStrategy, FSDP2Strategy
from autoshard.mesh import ParallelDims


def trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return pl.Trainer(**{**defaults, **kwargs})


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


def test_strategies_are_registered_by_name() -> None:
    assert isinstance(trainer(strategy="fsdp2").strategy, FSDP2Strategy)
    assert type(trainer(strategy="auto-shard").strategy) is AutoShardStrategy


def test_default_sizes_are_pure_fsdp_not_lightnings_tensor_parallel() -> None:
    strategy = FSDP2Strategy()
    assert ParallelDims.resolve(strategy.intent, 8) == ParallelDims(1, 8, 1)


def test_shard_size_is_resolved_once_with_num_nodes_when_the_trainer_is_built() -> None:
    """'node' is the devices of one node; the (replicas, shard) split is kept for the plan; the mesh stays dp x 1."""
    built = pl.Trainer(strategy=FSDP2Strategy(shard_size="node"), accelerator="cpu", devices=2, num_nodes=2, logger=False)
    assert built.strategy.hsdp_sizes == (2, 2) and built.strategy.describe_mesh()["hsdp"] == (2, 2)
    assert (built.strategy._data_parallel_size, built.strategy._tensor_parallel_size) == (4, 1)
    assert pl.Trainer(strategy=FSDP2Strategy(), accelerator="cpu", devices=2, logger=False).strategy.hsdp_sizes is None
    with pytest.raises(IntentError, match="shard_size=3 does not divide the data-parallel size 4"):
        pl.Trainer(strategy=FSDP2Strategy(shard_size=3), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(IntentError) as info:
        pl.Trainer(strategy=FSDP2Strategy(shard_size=2, parallelize_fn=lambda m, mesh: None), accelerator="cpu", devices=4, logger=False)
    assert "a parallelize_fn replaces it, so the shard size would be ignored. Fix: drop parallelize_fn" in str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: trainer(strategy="fsdp"),
        lambda: trainer(strategy=__import__("lightning.pytorch.strategies", fromlist=["FSDPStrategy"]).FSDPStrategy()),
    ],
)
def test_fsdp1_is_refused_with_a_redirect(make: Any) -> None:
    with pytest.raises(IncompatibleBackendError) as info:
        make()
    text = str(info.value)
    assert "FSDP1" in text and "several forwards per step" in text
    assert "Backend that works: fsdp2" in text and "Fix: use strategy='fsdp2'" in text


@pytest.mark.parametrize("strategy", ["fsdp2", "auto-shard", "instance"])
def test_a_precision_fsdp2_cannot_run_is_refused_in_trainer_terms(strategy: str) -> None:
    with pytest.raises(IncompatibleBackendError) as info:
        trainer(strategy=FSDP2Strategy() if strategy == "instance" else strategy, precision="64-true")
    text = str(info.value)
    assert "precision='64-true') is not supported" in text and "Fabric" not in text
    assert "'bf16-mixed', '32-true', 'bf16-true', '16-mixed', '16-true'" in text
    assert "Fix: use Trainer(precision='bf16-mixed') (recommended)" in text


@pytest.mark.parametrize(
    ("stated", "intent", "gather", "reduce"),
    [
        ("bf16-mixed", {}, "bfloat16", "float32"),  # autocast, bf16 all-gather, fp32 reduce: the FSDP2 standard
        ("bf16-mixed", {"param_dtype": "float32"}, "float32", "float32"),  # the opt-out
        ("32-true", {}, "float32", "float32"),
        ("bf16-true", {}, "bfloat16", "bfloat16"),
        ("16-mixed", {}, "float16", "float32"),  # as bf16-mixed, with loss scaling (tests/test_fp16_fsdp2.py)
    ],
)
def test_the_trainers_precision_is_resolved_once_with_the_intent(stated: str, intent: dict, gather: str, reduce: str) -> None:
    for where in ("trainer", "both"):
        strategy = FSDP2Strategy(intent={**intent, **({"precision": stated} if where == "both" else {})})
        trainer(strategy=strategy, precision=stated)
        plan = strategy.precision_plan
        assert (plan.precision, plan.gather, plan.reduce) == (stated, gather, reduce)
        assert plan.autocast is stated.endswith("-mixed")


class GatherDtypes(Net):
    """Records the dtype of the weight each forward of ``body[0]`` (an FSDP unit) sees: the all-gathered copy.

    fully_shard prepends its all-gather hook, so this hook runs after it, whenever it was registered."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.body[0].register_forward_pre_hook(lambda module, args: self.seen.add(str(module.weight.dtype)))


def test_bf16_mixed_all_gathers_in_bf16_and_keeps_fp32_weights() -> None:
    """One rank, real fully_shard: the forward sees bf16 weights; the sharded weights, grads and steps stay fp32."""
    from torch.distributed.tensor import DTensor

    model = GatherDtypes()
    t = trainer(strategy="fsdp2", precision="bf16-mixed", max_steps=2)
    t.fit(model, loader())
    weight = model.body[0].weight
    assert model.seen == {"torch.bfloat16"}
    assert isinstance(weight, DTensor) and weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
    opted_out = GatherDtypes()
    trainer(strategy=FSDP2Strategy(param_dtype="float32"), precision="bf16-mixed", max_steps=1).fit(opted_out, loader())
    assert opted_out.seen == {"torch.float32"}


@pytest.mark.parametrize("strategy", ["auto-shard", "instance"])
def test_auto_shard_treats_precision_in_the_intent_and_in_the_trainer_alike(strategy: str) -> None:
    """auto-shard picks its backend before the Trainer's precision exists: the intent's precision does not steer
    it either; 16-mixed, in the intent or in the Trainer, stays on fsdp2 (it used to leave for DeepSpeed)."""
    for intent in ({}, {"precision": "16-mixed"}):
        chosen = AutoShardStrategy(intent=intent) if strategy == "instance" or intent else "auto-shard"
        assert chosen == "auto-shard" or type(chosen) is AutoShardStrategy
        built = trainer(strategy=chosen, precision="16-mixed")
        assert type(built.strategy) is AutoShardStrategy and built.strategy.precision_plan.loss_scaling


def test_precision_given_twice_must_agree() -> None:
    with pytest.raises(IntentError, match=r"ShardingIntent\(precision='bf16-true'\) but Trainer\(precision='32-true'\)"):
        trainer(strategy=FSDP2Strategy(intent={"precision": "bf16-true"}), precision="32-true")
    agreed = FSDP2Strategy(intent={"precision": "bf16-mixed"})
    trainer(strategy=agreed, precision="bf16-mixed")
    assert agreed.precision_plan.precision == "bf16-mixed"


def test_mesh_that_cannot_match_the_world_is_refused_at_construction() -> None:
    with pytest.raises(IntentError) as info:
        trainer(strategy=FSDP2Strategy(intent={"data_parallel_size": 3}), devices=2)
    assert "3 * 1 = 3 does not match the world size 2" in str(info.value)
    assert "data_parallel_size=2" in str(info.value)


def test_slurm_tasks_must_match_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(IntentError) as info:
        trainer(strategy="fsdp2", devices=2)
    text = str(info.value)
    assert "SLURM started 4 task(s) per node but Trainer(devices=2)" in text
    assert "Fix: set Trainer(devices=4), or launch with `srun --ntasks-per-node=2" in text


class RootParams(Net):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.body(batch[0]) * self.scale).pow(2).mean()


def test_root_parameters_refused_under_strict_with_parallelize_fn_hint() -> None:
    with pytest.raises(AutoShardError) as info:
        trainer(strategy=FSDP2Strategy(intent={"strict": True})).fit(RootParams(), loader())
    text = str(info.value)
    assert "parameters live directly on RootParams: scale" in text and "parallelize_fn" in text


def test_root_parameters_warn_and_train_when_not_strict() -> None:
    model = RootParams()
    before = model.scale.detach().clone()
    with pytest.warns(UserWarning, match="parameters live directly on RootParams: scale"):
        t = trainer(strategy="fsdp2", max_steps=2)
        t.fit(model, loader())
    assert not torch.equal(model.scale.detach(), before)
    assert [r.why for r in t.strategy.plan.replicated] == ["parameter on the LightningModule root"]


class Flat(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (batch[0] @ self.w).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_no_parameter_owning_children_strict() -> None:
    with pytest.raises(AutoShardError, match="no parameter-owning child modules found to shard in Flat"):
        trainer(strategy=FSDP2Strategy(intent={"strict": True})).fit(Flat(), loader())


class Mismatch(Net):
    autoshard_needs = {"ema_pairs": [("teacher", "body")]}

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).requires_grad_(False)


def test_teacher_student_structure_mismatch_fails_fast() -> None:
    with pytest.raises(AutoShardError) as info:
        trainer(strategy="auto-shard").fit(Mismatch(), loader())
    text = str(info.value)
    assert "EMA teacher 'teacher' and student 'body' differ in structure" in text
    assert "(3, 8) vs (2, 8)" in text and "copy.deepcopy(student)" in text


class UserSharded(Net):
    """Shards only body[0]: the generic plan would shard body[2] too (every parameter-owning child)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.body[0], mesh=self.device_mesh["data_parallel"])


def test_user_configure_model_sharding_is_respected(caplog: pytest.LogCaptureFixture) -> None:
    """The user's fully_shard stands as written (Shard(0) on the strategy's mesh), and the plan is skipped for it."""
    from torch.distributed.tensor import DTensor, Shard

    planned = trainer(strategy="fsdp2", max_steps=1)
    planned.fit(Net(), loader())
    assert planned.strategy.plan is not None  # the control: without configure_model, autoshard plans
    model, t = UserSharded(), trainer(strategy="fsdp2", max_steps=1)
    with caplog.at_level("INFO"):
        t.fit(model, loader())
    weight = model.body[0].weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    assert weight.device_mesh == t.strategy.device_mesh["data_parallel"]
    assert not isinstance(model.body[2].weight, DTensor)  # the plan would have sharded it
    assert t.strategy.plan is None
    assert "modules already sharded (your configure_model); the generic plan is skipped" in caplog.text


NVME = {"offload": "optimizer", "offload_device": "nvme", "nvme_path": "/tmp/nvme"}


def test_auto_shard_is_a_registered_factory_that_picks_deepspeed_when_the_intent_needs_it() -> None:
    """ "auto-shard" names a factory (Lightning's registry calls it): a strategy class, never a constructor returning
    another class. The factory builds DeepSpeed for an intent only DeepSpeed runs; the class itself refuses one."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import StrategyRegistry

    from autoshard.lightning import auto_shard

    assert dict.get(StrategyRegistry, "auto-shard")["strategy"] is auto_shard
    strategy = auto_shard(intent=NVME)
    assert type(strategy).__name__ == "AutoShardDeepSpeedStrategy" and strategy.requested_as == "auto-shard"
    assert type(auto_shard(intent={"offload": "params"})) is AutoShardStrategy
    assert "__new__" not in vars(AutoShardStrategy)
    with pytest.raises(IntentError) as info:
        AutoShardStrategy(intent=NVME)
    text = str(info.value)
    assert text.startswith("AutoShardStrategy is auto-shard's fsdp2 strategy, but this intent needs deepspeed_zero3")
    assert text.split("Fix: ")[1].startswith("build it with autoshard.lightning.auto_shard(...) and the same arguments")
    with pytest.raises(IntentError, match="DeepSpeed takes no parallelize_fn. Fix: drop parallelize_fn"):
        auto_shard(intent=NVME, parallelize_fn=lambda m, mesh: None)


def test_lightning_cli_yaml(tmp_path: Any) -> None:
    """`trainer: {strategy: auto-shard, precision: bf16-mixed}` and an intent in YAML both resolve."""
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: autoshard.lightning.AutoShardStrategy\n"
        "    init_args:\n      intent:\n        reshard_after_forward: false\n        checkpoint: full\n"
        "  precision: bf16-mixed\n  accelerator: cpu\n  devices: 1\n"
    )
    cli = LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AutoShardStrategy)
    assert strategy.intent.reshard_after_forward is False and strategy.intent.checkpoint == "full"
    assert strategy.intent.precision is None and strategy.precision_plan.precision == "bf16-mixed"
    cli = LightningCLI(
        Net, run=False, args=["--trainer.strategy=auto-shard", "--trainer.accelerator=cpu", "--trainer.devices=1"], save_config_callback=None
    )
    assert isinstance(cli.trainer.strategy, AutoShardStrategy)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class MetaNoReset(Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = NoReset()


def test_meta_init_without_reset_parameters_is_refused() -> None:
    t = trainer(strategy="fsdp2")
    with t.init_module(empty_init=True):
        model = MetaNoReset()
    with pytest.raises(AutoShardError) as info:
        t.fit(model, loader())
    assert "NoReset own parameters or buffers and define no reset_parameters()" in str(info.value)
    assert "Fix: define reset_parameters() on them" in str(info.value)
