"""DeepSpeed strategies in one process: registration, and every refusal reached through Trainer.fit on CPU.

The refusals happen when fitting right after Lightning's own (single) configure_optimizers call, before the engine
is built, so a devices=1 Trainer reaches them without spawning. 2 real processes: a probe that builds its optimizer
in its own setup hook in tests/distributed/test_deepspeed_engine.py, stable-pretraining's probe and EMA patterns in
tests/distributed/test_hooks.py.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autoshard.errors import BackendUnavailableError, IncompatibleBackendError, IntentError

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install 'autoshard[deepspeed]')"),
]

from autoshard.lightning import deepspeed as ds_lightning  # noqa: E402
from autoshard.lightning.deepspeed import (  # noqa: E402
    LIGHTNING_DEEPSPEED_NAMES,
    AutoShardDeepSpeedStrategy,
    GuardedDeepSpeedStrategy,
    register_deepspeed_strategies,
)

register_deepspeed_strategies(StrategyRegistry)  # idempotent; `import autoshard` does it too


def make_trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.body(batch[0])).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoOptimizers(Net):
    """A GAN-like method: one optimizer per sub-network."""

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]


class Probe(pl.Callback):
    """An online probe owning its optimizer (an attribute), as evaluation callbacks do."""

    def __init__(self) -> None:
        self.linear = nn.Linear(8, 3)
        self.optimizer = torch.optim.SGD(self.linear.parameters(), lr=0.1)


class StudentTeacher(Net):
    """DINO/BYOL style: the teacher is a frozen deepcopy of the student, updated by EMA."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)


class OnlineTarget(Net):
    """Same EMA pattern under other names: found by structure (frozen mirror of a trainable subtree), not by name."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.target = copy.deepcopy(self.online).requires_grad_(False)


class MultiForward(Net):
    autoshard_needs = {"multi_forward": True}


REFUSALS = {
    "two_optimizers": (TwoOptimizers, [], "multiple optimizers", "2 optimizers"),
    "probe_callback": (Net, [Probe], "multiple optimizers", "callback Probe"),
    "ema_student_teacher": (StudentTeacher, [], "EMA teacher/student", "teacher 'teacher' follows student 'student'"),
    "ema_by_structure": (OnlineTarget, [], "EMA teacher/student", "teacher 'target' follows student 'online'"),
}


@pytest.mark.parametrize("strategy", ["deepspeed_stage_3", "deepspeed_stage_3_offload", "autoshard-deepspeed"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_at_setup_with_the_feature_the_backend_that_works_and_the_fix(case: str, strategy: str) -> None:
    module_class, callbacks, feature, detail = REFUSALS[case]
    trainer = make_trainer(strategy, callbacks=[c() for c in callbacks])
    assert isinstance(trainer.strategy, GuardedDeepSpeedStrategy)
    with pytest.raises(IncompatibleBackendError) as info:
        trainer.fit(module_class(), loader())
    text = str(info.value)
    assert f"{module_class.__name__} cannot train under DeepSpeed ZeRO stage 3" in text, text
    assert feature in text and detail in text, text
    assert "Backend that works: fsdp2 (strategy='fsdp2')" in text, text
    assert "Fix: use strategy='fsdp2'" in text, text
    # Refused before the engine existed (autoshard called no hook: Lightning's call is the one counted).
    assert type(trainer.strategy.model).__name__ != "DeepSpeedEngine"


@pytest.mark.parametrize("stage_name", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload"])
def test_stages_1_and_2_refuse_only_several_optimizers(stage_name: str) -> None:
    """Parameters stay whole below stage 3: EMA and several forwards are fine there, several optimizers are not."""
    for module_class in (StudentTeacher, MultiForward):
        trainer = make_trainer(stage_name)
        module = module_class()
        trainer.strategy.connect(module)
        module.trainer = trainer
        decision = trainer.strategy.check_method(trainer)
        assert decision.backend == "deepspeed_zero3"
    with pytest.raises(IncompatibleBackendError, match=r"(?s)stage [12].*multiple optimizers.*Fix: use strategy='fsdp2'"):
        make_trainer(stage_name).fit(TwoOptimizers(), loader())


def test_registration_keeps_lightnings_init_params_and_is_idempotent() -> None:
    lightning_own = _StrategyRegistry()
    DeepSpeedStrategy.register_strategies(lightning_own)  # what Lightning registers, read from Lightning itself
    register_deepspeed_strategies(StrategyRegistry)
    register_deepspeed_strategies(StrategyRegistry)
    assert set(LIGHTNING_DEEPSPEED_NAMES) == set(lightning_own)
    for name in LIGHTNING_DEEPSPEED_NAMES:
        entry = StrategyRegistry[name]
        assert entry["strategy"] is GuardedDeepSpeedStrategy, name
        assert entry["init_params"] == lightning_own[name]["init_params"], name
        assert entry["description"] == lightning_own[name]["description"], name
    assert StrategyRegistry["autoshard-deepspeed"]["strategy"] is AutoShardDeepSpeedStrategy
    offload = make_trainer("deepspeed_stage_3_offload").strategy
    assert offload.zero_stage == 3 and offload.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert make_trainer("deepspeed_stage_2").strategy.zero_stage == 2


def test_precision_stated_twice_and_differing_is_refused() -> None:
    strategy = AutoShardDeepSpeedStrategy({"precision": "bf16-mixed"})
    with pytest.raises(IntentError) as info:
        make_trainer(strategy, precision="32-true").fit(Net(), loader())
    text = str(info.value)
    assert "ShardingIntent(precision='bf16-mixed')" in text and "Trainer(precision='32-true')" in text
    assert "Fix: set it once, in the Trainer" in text


def test_trainer_precision_fills_an_unstated_intent_precision() -> None:
    strategy = AutoShardDeepSpeedStrategy()
    assert "bf16" not in strategy.config  # no precision is guessed before the Trainer's is known
    trainer = make_trainer(strategy, precision="32-true")
    assert strategy.intent.precision is None and strategy.precision_plan.precision == "32-true"
    with pytest.raises(IncompatibleBackendError):  # refused at setup, after the precision was resolved
        trainer.fit(TwoOptimizers(), loader())


def test_param_dtype_is_judged_against_the_trainers_precision_not_a_default() -> None:
    """ZeRO-3 gathers in the precision's dtype: param_dtype='float32' is fine under 32-true, refused under bf16-mixed,
    and the refusal comes when the Trainer is built, not from a provisional bf16-mixed config."""
    strategy = AutoShardDeepSpeedStrategy(param_dtype="float32")
    make_trainer(strategy, precision="32-true")
    assert strategy.precision_plan.gather == "float32"
    with pytest.raises(IntentError, match=r"param_dtype='float32' contradicts precision='bf16-mixed'.*Fix:"):
        make_trainer(AutoShardDeepSpeedStrategy(param_dtype="float32"), precision="bf16-mixed")


def test_guarded_lightning_names_resolve_the_trainers_precision() -> None:
    assert make_trainer("deepspeed_stage_3", precision="16-mixed").strategy.precision_plan.precision == "16-mixed"


def test_intent_only_refusals_happen_at_construction() -> None:
    with pytest.raises(IncompatibleBackendError, match=r"(?s)tensor parallel.*Backend that works: fsdp2.*Fix:"):
        AutoShardDeepSpeedStrategy(tensor_parallel_size=2)


def test_intent_fields_as_arguments_and_config_arguments_refused() -> None:
    strategy = AutoShardDeepSpeedStrategy(offload="optimizer", checkpoint="full")
    assert strategy.intent.offload == "optimizer"
    assert strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert strategy.config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    with pytest.raises(IntentError, match=r"does not take stage=.*Fix: .*strategy='deepspeed_stage_2'"):
        AutoShardDeepSpeedStrategy(stage=2)
    with pytest.raises(IntentError, match=r"does not take offload_optimizer=.*Fix: set ShardingIntent\(offload='optimizer'\)"):
        AutoShardDeepSpeedStrategy(offload_optimizer=True)


def test_missing_deepspeed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails, as when it is absent
    for make in (AutoShardDeepSpeedStrategy, lambda: make_trainer("deepspeed_stage_3")):
        with pytest.raises(BackendUnavailableError) as info:
            make()
        text = str(info.value)
        assert 'pip install "autoshard[deepspeed]"' in text and "fsdp2" in text, text


def test_deepspeed_accelerator_other_than_cpu_is_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed picks its accelerator at import (cpu on this machine); this stands in for a CUDA build used with
    # accelerator="cpu", a case this machine cannot produce for real.
    monkeypatch.setattr(ds_lightning, "deepspeed_accelerator", lambda: "cuda")
    with pytest.raises(IncompatibleBackendError, match=r"(?s)DeepSpeed's accelerator is 'cuda'.*fsdp2.*Fix: export DS_ACCELERATOR=cpu"):
        make_trainer(AutoShardDeepSpeedStrategy()).fit(Net(), loader())


def test_a_gpu_trainer_with_deepspeed_on_its_cpu_accelerator_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA stand-in: DS_ACCELERATOR=cpu left in the environment of a GPU run (it happened in our own GPU suite)
    made DeepSpeed keep the model on the CPU and fail in an nccl broadcast ("No backend type associated with device
    type cpu"). The strategy refuses it before Lightning's CUDA path, naming the variable."""
    monkeypatch.setattr(AutoShardDeepSpeedStrategy, "_on_cpu", lambda self: False)  # as on a GPU Trainer
    assert ds_lightning.deepspeed_accelerator() == "cpu"
    with pytest.raises(IncompatibleBackendError, match=r"(?s)DeepSpeed's accelerator is 'cpu' \(DS_ACCELERATOR=cpu.*Fix: unset DS_ACCELERATOR"):
        make_trainer(AutoShardDeepSpeedStrategy()).fit(Net(), loader())


def test_a_lightning_without_the_hooked_members_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ds_lightning, "missing", lambda ledger, owner: ["DeepSpeedStrategy._format_config"])
    with pytest.raises(BackendUnavailableError, match=r'lacks DeepSpeedStrategy._format_config.*Fix: pip install "lightning'):
        AutoShardDeepSpeedStrategy()


def test_import_autoshard_does_not_import_deepspeed_and_installs_the_guard() -> None:
    code = (
        "import sys, autoshard, autoshard.adapters.deepspeed, autoshard.lightning.deepspeed\n"
        "from lightning.pytorch.strategies import StrategyRegistry as R\n"
        "print('deepspeed' in sys.modules, R['deepspeed_stage_3']['strategy'].__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "GuardedDeepSpeedStrategy"], out


class Temperature(Net):
    """A learnable 0-dim temperature (CLIP, DINO): DeepSpeed 0.19.8 crashes on it in deepspeed.initialize."""

    def __init__(self, shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(shape))
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return (self.head(self.body(batch[0])) / self.temperature).pow(2).mean()


class ScaleBuiltInConfigureModel(Net):
    """The 0-dim parameter comes from a submodule built in configure_model, i.e. under ZeRO-3's zero.Init."""

    def configure_model(self) -> None:
        self.scale = Temperature().requires_grad_(False)  # any module with a 0-dim parameter


@pytest.mark.parametrize("strategy", ["autoshard-deepspeed", "deepspeed_stage_3", "deepspeed_stage_2"])
def test_a_zero_dim_parameter_is_refused_by_name_before_the_engine(strategy: str) -> None:
    trainer = make_trainer(strategy)
    module = Temperature()
    with pytest.raises(IncompatibleBackendError) as info:
        trainer.fit(module, loader())
    text = str(info.value)
    assert text.startswith("Temperature has 0-dim parameter(s) 'temperature', so it cannot train under DeepSpeed ZeRO stage"), text
    assert "'self.dim() cannot be 0 to view Float as Byte'" in text and "Backend that works: fsdp2" in text, text
    assert text.endswith(
        "Fix: use strategy='fsdp2' (it keeps 0-dim parameters whole on every rank), or give the parameter"
        " shape (1,): nn.Parameter(torch.ones(1)) instead of nn.Parameter(torch.tensor(1.0))"
    ), text
    assert type(trainer.strategy.model).__name__ != "DeepSpeedEngine" and module.steps == 0


def test_a_zero_dim_parameter_built_under_zero_init_is_refused_too() -> None:
    with pytest.raises(IncompatibleBackendError) as info:
        make_trainer("deepspeed_stage_3").fit(ScaleBuiltInConfigureModel(), loader())
    text = str(info.value)
    assert text.startswith("A 0-dim parameter built in configure_model under ZeRO-3's zero.Init"), text
    assert "Fix: use strategy='fsdp2'" in text, text
    assert isinstance(info.value.__cause__, RuntimeError)  # DeepSpeed's own error, kept as the cause


def test_the_refusal_is_still_needed_deepspeed_itself_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without autoshard's check DeepSpeed fails inside deepspeed.initialize: when a DeepSpeed release fixes it, this
    fails, and the refusal (and its bad-inputs row) can go."""
    monkeypatch.setattr(ds_lightning, "zero_dim_parameters", lambda module: [])
    with pytest.raises(RuntimeError, match="cannot be 0 to view"):
        make_trainer("autoshard-deepspeed").fit(Temperature(), loader())


@pytest.mark.parametrize("strategy", ["autoshard-deepspeed", "deepspeed_stage_2"])
def test_the_fix_a_shape_1_parameter_trains(strategy: str) -> None:
    trainer = make_trainer(strategy)
    module = Temperature(shape=(1,))
    trainer.fit(module, loader())
    assert trainer.global_step == 1 and module.steps == 1
    assert type(trainer.strategy.model).__name__ == "DeepSpeedEngine"
    # ZeRO-3's zero.Init replaced torch.nn.functional.linear "until manually reset"; the strategy's teardown reset it
    assert torch.nn.functional.linear is torch._C._nn.linear, torch.nn.functional.linear


def test_sync_batchnorm_converts_in_place_and_one_rank_needs_nothing() -> None:
    """Lightning's DeepSpeedStrategy ignores Trainer(sync_batchnorm=True); autoshard converts the layers in place
    before the engine when there are several ranks (the global statistics: tests/distributed/test_deepspeed_hsdp.py,
    4 ranks). One rank's batch is the global batch: the layers stay BatchNorm and the fit runs."""
    from autoshard.batchnorm import SyncBatchNorm

    class WithBN(Net):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.seen: list[type] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append(type(self.body[1]))
            return super().training_step(batch, batch_idx)

    module = WithBN()
    weight, running = module.body[1].weight, module.body[1].running_mean
    assert ds_lightning.sync_batchnorm(module) == 1
    assert type(module.body[1]) is SyncBatchNorm and module.body[1].process_group is None  # None: the whole world
    assert module.body[1].weight is weight and module.body[1].running_mean is running  # same objects: optimizer refs hold

    module = WithBN()
    trainer = make_trainer("autoshard-deepspeed", sync_batchnorm=True)
    trainer.fit(module, loader())
    assert module.seen == [nn.BatchNorm1d] and trainer.global_step == 1


def test_shard_size_is_refused_at_construction_with_the_reason() -> None:
    for shard_size in (2, "node"):
        with pytest.raises(IncompatibleBackendError) as info:
            AutoShardDeepSpeedStrategy(shard_size=shard_size)
        text = str(info.value)
        assert f"hybrid sharding (HSDP) [shard_size={shard_size!r}]" in text, text
        assert "DeepSpeed 0.19.7 removed" in text and "zero_hpz_partition_size" in text, text
        assert text.endswith(
            "Fix: use strategy='fsdp2' (or strategy='auto-shard'), which shards within shard_size groups;"
            " or drop shard_size to shard over every rank under ZeRO-3"
        ), text


def test_auto_shard_never_picks_deepspeed_for_shard_size() -> None:
    """offload='optimizer' alone would pick DeepSpeed (tests/test_bad_inputs.py, row 25); with shard_size the matrix
    rules DeepSpeed out and auto-shard builds fsdp2; with NVMe offload as well nothing fits, and the refusal says why."""
    from autoshard.lightning import AutoShardStrategy

    assert not isinstance(make_trainer(AutoShardStrategy(offload="optimizer", shard_size=1)).strategy, GuardedDeepSpeedStrategy)
    with pytest.raises(IncompatibleBackendError) as info:
        AutoShardStrategy(offload="optimizer", offload_device="nvme", nvme_path="/tmp/nvme", shard_size=1)
    text = str(info.value)
    assert "deepspeed_zero3: hybrid sharding (HSDP) [shard_size=1]" in text and "fsdp2: NVMe offload" in text, text
    assert "Fix: " in text, text
