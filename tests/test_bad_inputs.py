"""The bad-input catalog (docs/bad-inputs.md), one test per row: each misconfiguration is refused at Trainer
construction or at setup, before the first training step, with what is wrong, what works, and the fix.

Single process throughout: Trainer(accelerator="cpu", devices=1) reaches setup without spawning. Each test that
fits checks that no training step ran.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import autoshard  # noqa: F401  registers the strategies and guards
from autoshard import BackendUnavailableError, IncompatibleBackendError, IntentError, MethodNeeds, ShardingIntent, select_backend
from autoshard.adapters.fsdp2 import plan_fsdp2
from autoshard.backends import Availability, require
from autoshard.backends import deepspeed as deepspeed_backend
from autoshard.backends import fsdp2 as fsdp2_backend
from autoshard.checkpoint.resume import resolve_for_load
from autoshard.checkpoint.trust import CheckpointFormatError
from autoshard.demo import Blobs, DinoLike, OnlineProbe
from autoshard.errors import AutoShardError
from autoshard.lightning import FSDP2Strategy
from autoshard.memory import estimate_memory
from autoshard.needs import inspect_needs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def isolated_process_state() -> Iterator[None]:
    """In-process fits set MASTER_PORT & co. and may create a process group: undo both after each test."""
    environ = dict(os.environ)
    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **kwargs})


class Net(pl.LightningModule):
    """A plain method; ``steps`` proves a refusal came before any training step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        self.steps += 1
        features = self.body(batch[0])
        return {"loss": features.pow(2).mean(), "features": features.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoOptimizers(Net):
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.body[0].parameters(), lr=0.1), torch.optim.SGD(self.body[2].parameters(), lr=0.1)]


class Flat(Net):
    """Parameters only on the root: nothing the generic plan can shard."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.w = nn.Parameter(torch.randn(16, 4))
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return (batch[0] @ self.w).pow(2).mean()


class Mismatched(Net):
    """A teacher that is not a copy of its student (an extra output unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
        self.teacher = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 5)).requires_grad_(False)


def data() -> DataLoader:
    return DataLoader(Blobs(n=16), batch_size=8)


def refused(error: type[Exception], run: Any, *expected: str) -> str:
    """Run, expect ``error``, check every expected fragment is in the message, return it."""
    with pytest.raises(error) as info:
        run()
    text = str(info.value)
    for fragment in expected:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    return text


# -- 1-2: FSDP1 ---------------------------------------------------------------------------------------------------
def test_01_fsdp1_by_name() -> None:
    refused(IncompatibleBackendError, lambda: trainer(strategy="fsdp"), "FSDP1", "Backend that works: fsdp2", "Fix: use strategy='fsdp2'")


def test_02_fsdp1_by_class() -> None:
    """Refused where the run is configured, the Trainer: the class itself stays constructible (other libraries'
    tests build it, stable-pretraining's to test its own refusal)."""
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy()
    assert type(strategy) is FSDPStrategy
    refused(IncompatibleBackendError, lambda: trainer(strategy=strategy), "FSDP1", "Backend that works: fsdp2", "Fix: use strategy='fsdp2'")


# -- 3: precision -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["fsdp2", "auto-shard"])
def test_03_a_precision_fsdp2_cannot_run(strategy: str) -> None:
    """16-mixed used to be refused here; it runs now, with a sharded grad scaler (tests/test_fp16_fsdp2.py)."""
    text = refused(
        IncompatibleBackendError,
        lambda: trainer(strategy=strategy, precision="64-true"),
        "precision='64-true') is not supported",
        "autoshard plans fsdp2 runs only for the precisions below",
        "Fix: use Trainer(precision='bf16-mixed')",
    )
    assert "Fabric" not in text and "'16-mixed'" in text


# -- 4-6: what DeepSpeed cannot train ---------------------------------------------------------------------------------
def test_04_several_optimizers_under_deepspeed() -> None:
    needs = MethodNeeds(optimizer_sources=(("configure_optimizers", 2),))
    refused(
        IncompatibleBackendError,
        lambda: select_backend(needs, prefer="deepspeed_zero3"),
        "multiple optimizers [2 optimizers",
        "exactly one optimizer",
        "Backend that works: fsdp2",
        "Fix: use strategy='fsdp2'",
    )
    pytest.importorskip("deepspeed")
    model = TwoOptimizers()
    refused(
        IncompatibleBackendError,
        lambda: trainer(strategy="autoshard-deepspeed").fit(model, data()),
        "refused before the engine is built",
        "2 from configure_optimizers",
        "Backend that works: fsdp2",
    )
    assert model.steps == 0


def test_05_probe_optimizer_under_deepspeed() -> None:
    """One optimizer in the module plus one in a callback is two for DeepSpeed (Lightning's error says neither)."""
    model, probe = Net(), OnlineProbe()
    probe.setup(None, model, "fit")  # what Lightning does before strategy setup: the probe builds its optimizer
    needs = inspect_needs(model, callbacks=[probe])
    refused(
        IncompatibleBackendError,
        lambda: select_backend(needs, prefer="deepspeed_zero3"),
        "1 from configure_optimizers, 1 from callback OnlineProbe",
        "Backend that works: fsdp2",
    )
    pytest.importorskip("deepspeed")
    model = Net()
    refused(
        IncompatibleBackendError,
        lambda: trainer(strategy="deepspeed_stage_3", callbacks=[OnlineProbe()]).fit(model, data()),
        "refused before the engine is built",
        "1 from callback OnlineProbe",
        "Fix: use strategy='fsdp2'",
    )
    assert model.steps == 0


def test_06_ema_teacher_under_deepspeed() -> None:
    needs = inspect_needs(DinoLike())
    refused(
        IncompatibleBackendError,
        lambda: select_backend(needs, prefer="deepspeed_zero3"),
        "EMA teacher/student [teacher 'teacher' follows student 'student']",
        "placeholder",
        "Backend that works: fsdp2",
    )
    pytest.importorskip("deepspeed")
    for name in ("autoshard-deepspeed", "deepspeed_stage_3"):
        refused(
            IncompatibleBackendError,
            lambda: trainer(strategy=name).fit(DinoLike(), data()),
            "refused before the engine is built",
            "EMA teacher/student",
            "Fix: use strategy='fsdp2'",
        )


# -- 7-8: what the generic FSDP2 plan cannot shard ------------------------------------------------------------------
def test_07_no_parameter_owning_children_under_strict() -> None:
    model = Flat()
    refused(
        AutoShardError,
        lambda: trainer(strategy=FSDP2Strategy(intent={"strict": True})).fit(model, data()),
        "no parameter-owning child modules found to shard in Flat",
        "Fix: put them in child modules",
        "parallelize_fn",
    )
    assert model.steps == 0


def test_08_teacher_student_structure_mismatch() -> None:
    model = Mismatched()
    refused(
        AutoShardError,
        lambda: trainer(strategy="fsdp2").fit(model, data()),
        "EMA teacher 'teacher' and student 'student' differ in structure",
        "(5, 8) vs (4, 8)",
        "copy.deepcopy(student)",
    )
    assert model.steps == 0


# -- 9-10: world size ---------------------------------------------------------------------------------------------
def test_09_dp_times_tp_not_world_size() -> None:
    refused(
        IntentError,
        lambda: trainer(strategy=FSDP2Strategy(intent={"data_parallel_size": 3}), devices=2),
        "3 * 1 = 3 does not match the world size 2",
        "set data_parallel_size=2",
    )


def test_10_slurm_tasks_differ_from_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    refused(
        IntentError,
        lambda: trainer(strategy="fsdp2", devices=2),
        "SLURM started 4 task(s) per node but Trainer(devices=2)",
        "Fix: set Trainer(devices=4)",
        "srun --ntasks-per-node=2",
    )


# -- 11-12: what is installed -----------------------------------------------------------------------------------------
def test_11_deepspeed_not_installed() -> None:
    missing = require("autoshard-no-such-distribution", "1.0", deepspeed_backend.INSTALL)  # a real lookup that fails
    assert not missing.ok and missing.detail == "autoshard-no-such-distribution is not installed"
    absent = Availability(False, "deepspeed is not installed", deepspeed_backend.INSTALL)
    refused(
        BackendUnavailableError,
        lambda: select_backend(MethodNeeds(), prefer="deepspeed_zero3", available={"deepspeed_zero3": absent}),
        "deepspeed is not installed",
        "Backend that works: fsdp2",
        'Fix: pip install "autoshard[deepspeed]"',
    )


@pytest.mark.parametrize("package", ["torch", "lightning"])
def test_12_torch_or_lightning_too_old(package: str) -> None:
    from importlib.metadata import version

    old = require(package, "99.0", fsdp2_backend.INSTALL)  # the installed version, compared for real
    assert not old.ok and old.detail == f"{package} {version(package)} is older than the required 99.0"
    assert old.fix == f'pip install -U "{package}>=99.0"'
    refused(
        BackendUnavailableError,
        lambda: select_backend(MethodNeeds(), prefer="fsdp2", available={"fsdp2": old}),
        f"{package} {version(package)} is older than the required 99.0",
        f'Fix: pip install -U "{package}>=99.0"',
    )


# -- 13-14: names that do not exist -------------------------------------------------------------------------------
def test_13_unknown_backend() -> None:
    refused(
        IntentError,
        lambda: select_backend(MethodNeeds(), prefer="fsdp3"),
        "unknown backend 'fsdp3' (did you mean 'fsdp2'?)",
        "choose one of 'auto', 'fsdp2', 'deepspeed_zero3'",
    )
    # A Lightning strategy name that does not exist is Lightning's to refuse, at construction; ours are in its list.
    refused(ValueError, lambda: trainer(strategy="fsdp3"), "invalid strategy name")


def test_14_unknown_precision() -> None:
    refused(IntentError, lambda: FSDP2Strategy(intent={"precision": "bf17"}), "unknown precision 'bf17'", "bf16-mixed")
    refused(IntentError, lambda: ShardingIntent(precision="fp16"), "unknown precision 'fp16'", "choose one of")
    refused(ValueError, lambda: trainer(strategy="fsdp2", precision="bf17"), "Precision 'bf17' is invalid")


# -- 15-19: checkpoints -------------------------------------------------------------------------------------------
def test_15_checkpoint_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "results.csv").write_text("epoch,loss\n")
    model = Net()
    refused(
        CheckpointFormatError,
        lambda: trainer(strategy="fsdp2").fit(model, data(), ckpt_path=str(tmp_path)),
        "cannot resume",
        "is not a checkpoint",
        "no .metadata (DCP), no meta.pt (Lightning), no latest (DeepSpeed)",
        "Fix:",
    )
    assert model.steps == 0
    refused(
        CheckpointFormatError,
        lambda: trainer(strategy="fsdp2").fit(Net(), data(), ckpt_path=str(tmp_path / "nope.ckpt")),
        "nothing exists at this path",
    )


def test_16_interrupted_checkpoint(tmp_path: Path) -> None:
    """Shards without DCP's .metadata: a save that did not finish on every rank (written without autoshard)."""
    partial = tmp_path / "last.ckpt"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 64)
    model = Net()
    refused(
        CheckpointFormatError,
        lambda: trainer(strategy="fsdp2").fit(model, data(), ckpt_path=str(partial)),
        "no .metadata: the save did not finish on every rank",
        "Fix: resume from an earlier complete checkpoint",
    )
    assert model.steps == 0


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_checkpoint_formats import make_deepspeed_checkpoint

    return make_deepspeed_checkpoint(tmp_path_factory)


@pytest.mark.timeout(200)
def test_17_deepspeed_checkpoint_resumed_with_fsdp2(deepspeed_checkpoint: Path) -> None:
    model = Net()
    refused(
        CheckpointFormatError,
        lambda: trainer(strategy="fsdp2").fit(model, data(), ckpt_path=str(deepspeed_checkpoint)),
        "cannot resume with fsdp2",
        "a DeepSpeed ZeRO checkpoint (tag 'checkpoint')",
        "strategy='autoshard-deepspeed'",
        f"`autoshard consolidate {deepspeed_checkpoint} weights.pt`",
        "model.load_state_dict(torch.load('weights.pt'))",
    )
    assert model.steps == 0


@pytest.fixture
def fsdp2_checkpoint(tmp_path: Path) -> Path:
    """A real fsdp2 checkpoint: one step in this process, saved through the strategy."""
    t = trainer(strategy="fsdp2", max_steps=1)
    t.fit(Net(), data())
    path = tmp_path / "fsdp2.ckpt"
    t.save_checkpoint(path)
    return path


def test_18_fsdp2_checkpoint_resumed_with_deepspeed_message(fsdp2_checkpoint: Path) -> None:
    refused(
        CheckpointFormatError,
        lambda: resolve_for_load(fsdp2_checkpoint, "deepspeed_zero3"),
        "cannot resume with DeepSpeed",
        "written by fsdp2",
        "resume with strategy='fsdp2'",
        "autoshard consolidate",
    )


def test_18b_fsdp2_checkpoint_refused_by_the_deepspeed_strategy(fsdp2_checkpoint: Path) -> None:
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    refused(CheckpointFormatError, lambda: AutoShardDeepSpeedStrategy().load_checkpoint(fsdp2_checkpoint), "strategy='fsdp2'")


def test_19_saving_over_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    """Refused at save, before anything is written: a save replaces its path whole (that is what makes it atomic)."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "results.csv").write_text("keep me")
    t = trainer(strategy="fsdp2", max_steps=1)
    t.fit(Net(), data())
    refused(CheckpointFormatError, lambda: t.save_checkpoint(outputs), "refusing to save over", "Fix: save to a new path")
    assert (outputs / "results.csv").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


# -- 20-24: intent mistakes ---------------------------------------------------------------------------------------
def test_20_precision_given_twice_and_different() -> None:
    refused(
        IntentError,
        lambda: trainer(strategy=FSDP2Strategy(intent={"precision": "bf16-true"}), precision="32-true"),
        "ShardingIntent(precision='bf16-true') but Trainer(precision='32-true')",
        "Fix: set it once",
    )


def test_21_nvme_offload_under_fsdp2(tmp_path: Path) -> None:
    intent = {"offload": "params", "offload_device": "nvme", "nvme_path": str(tmp_path)}
    refused(
        IncompatibleBackendError,
        lambda: trainer(strategy=FSDP2Strategy(intent=intent)),
        "FSDP2 can offload to CPU memory only",
        "Backend that works: deepspeed_zero3",
        "Fix: use offload_device='cpu'",
    )


def test_22_shard_names_a_module_that_does_not_exist() -> None:
    model = Net()
    refused(
        IntentError,
        lambda: trainer(strategy=FSDP2Strategy(intent={"shard": ["encoder"]})).fit(model, data()),
        "shard names 'encoder', not a module of Net",
        "top-level modules are body",
    )
    assert model.steps == 0


def test_23_intent_field_typo() -> None:
    refused(
        IntentError,
        lambda: ShardingIntent.from_dict({"reshard_after_forwad": False}),
        "'reshard_after_forwad' (did you mean 'reshard_after_forward'?)",
        "Valid fields are",
    )


def test_24_offload_where_instead_of_what() -> None:
    refused(IntentError, lambda: ShardingIntent(offload="cpu"), "offload says what to move", "offload_device='cpu' says where")


# -- 25-29: fixes the user has not applied yet, settings that would be silently ignored ------------------------------
def test_25_auto_shard_chose_deepspeed_for_the_intent_and_the_method_has_an_ema_teacher() -> None:
    """offload='optimizer' alone makes auto-shard pick DeepSpeed; the EMA found at setup must not be answered with
    "use strategy='auto-shard'", which the user already runs."""
    pytest.importorskip("deepspeed")
    from autoshard.lightning import auto_shard

    text = refused(
        IncompatibleBackendError,
        lambda: trainer(strategy=auto_shard(intent={"offload": "optimizer"})).fit(DinoLike(), data()),
        "auto-shard chose DeepSpeed when the Trainer was built",
        "EMA teacher/student",
        "Backend that works: fsdp2",
    )
    assert text.rpartition("Fix: ")[2] == "use strategy='fsdp2'", text


def test_26_nvme_path_without_nvme_offload() -> None:
    refused(
        IntentError,
        lambda: ShardingIntent(offload="optimizer", nvme_path="/local_nvme"),
        "nvme_path='/local_nvme' is set but offload_device='cpu', so nothing would go to it",
        "Fix: set offload_device='nvme'",
    )


def test_27_zero_micro_batch_size() -> None:
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    refused(IntentError, lambda: AutoShardDeepSpeedStrategy(micro_batch_size=0), "micro_batch_size must be a positive integer, got 0")


def test_28_intent_field_misspelt_as_a_strategy_keyword() -> None:
    refused(IntentError, lambda: FSDP2Strategy(ofload="params"), "unknown ShardingIntent field(s): 'ofload'", "Fix: rename 'ofload' to 'offload'")
    assert FSDP2Strategy(offload="params").intent.offload == "params"  # the fields themselves are accepted


def test_29_tensor_parallel_without_a_layout() -> None:
    refused(
        IntentError,
        lambda: plan_fsdp2(Net(), ShardingIntent(tensor_parallel_size=1 + 1)),
        "tensor_parallel_size=2 needs a tensor-parallel layout, and Net carries none autoshard can read",
        "Fix: give the model a _tp_plan",
    )


def test_30_resume_from_another_models_checkpoint(fsdp2_checkpoint: Path) -> None:
    """torch's CheckpointException is a BaseException that escapes `except Exception`; it becomes a named refusal."""
    model = Net()
    model.extra = nn.Linear(4, 2)  # a key the checkpoint (written by a plain Net) does not have
    refused(
        CheckpointFormatError,
        lambda: trainer(strategy="fsdp2").fit(model, data(), ckpt_path=fsdp2_checkpoint),
        "extra.weight",
        "Fix:",
    )
    assert model.steps == 0


# -- 31-33: DeepSpeed limits said before the engine, or before any process ------------------------------------------
class Temperature(Net):
    """A learnable 0-dim temperature, as contrastive methods have."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.07))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return (self.body(batch[0]) / self.temperature).pow(2).mean()


def test_31_zero_dim_parameter_under_deepspeed() -> None:
    """DeepSpeed 0.19.8 fails inside deepspeed.initialize (RuntimeError 'self.dim() cannot be 0 to view Float as
    Byte'), at every stage; autoshard names the parameter first."""
    pytest.importorskip("deepspeed")
    for strategy in ("autoshard-deepspeed", "deepspeed_stage_2"):
        model = Temperature()
        t = trainer(strategy=strategy)
        text = refused(
            IncompatibleBackendError,
            lambda: t.fit(model, data()),
            "Temperature has 0-dim parameter(s) 'temperature', so it cannot train under DeepSpeed ZeRO stage",
            "Backend that works: fsdp2",
            "give the parameter shape (1,): nn.Parameter(torch.ones(1))",
        )
        assert text.rpartition("Fix: ")[2].startswith("use strategy='fsdp2'"), text
        assert model.steps == 0


def test_32_mics_keys_in_zero_overrides() -> None:
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    refused(
        IntentError,
        lambda: AutoShardDeepSpeedStrategy(zero_overrides={"mics_shard_size": 8}),
        "'zero_optimization.mics_shard_size': is MiCS, which DeepSpeed removed in 0.19.7",
        "Fix: remove it; for hybrid sharding use ShardingIntent(shard_size=N) with strategy='fsdp2'",
    )


def test_33_shard_size_under_deepspeed() -> None:
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    text = refused(
        IncompatibleBackendError,
        lambda: AutoShardDeepSpeedStrategy(shard_size="node"),
        "hybrid sharding (HSDP) [shard_size='node']",
        "DeepSpeed 0.19.7 removed",
        "ZeRO++ hpZ (zero_hpz_partition_size), is not hybrid sharding",
        "Backend that works: fsdp2",
    )
    assert text.rpartition("Fix: ")[2].startswith("use strategy='fsdp2' (or strategy='auto-shard'), which shards within shard_size groups")
    refused(  # the memory estimate, asked for directly, refuses what the matrix refuses
        IncompatibleBackendError,
        lambda: estimate_memory(Net(), ShardingIntent(shard_size=2), MethodNeeds(), 8, "deepspeed_zero3"),
        "no deepspeed_zero3 memory estimate for shard_size=2 on 8 ranks",
        "Fix: use strategy='fsdp2'",
    )


def test_catalog_has_a_test_per_row() -> None:
    """docs/bad-inputs.md and this file stay in step: every numbered row has its test."""
    import re

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "bad-inputs.md").read_text()
    rows = [line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(rows) == len(set(rows)), "a row number is used twice"
    # The catalog's tests live in this file, in tests/**/test_bad_inputs_*.py (one file per area), and, from round
    # five on, beside the feature they test (tests/test_fp16_fsdp2.py: test_196_...).
    sources = [f.read_text() for f in sorted(root.glob("tests/**/test_*.py"))]
    tests = {m for text in sources for m in re.findall(r"^def test_(\d+)_", text, flags=re.M)}
    assert len(rows) >= 15 and {f"{int(r):02d}" for r in rows} <= {f"{int(t):02d}" for t in tests}, (rows, tests)
