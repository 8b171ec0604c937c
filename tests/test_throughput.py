"""``autoshard.ThroughputMonitor``: what a user reads in the logs of a run (Lightning's ThroughputMonitor metrics,
with FLOPs measured and the peak looked up), and that measuring changes nothing in the run.

A tiny token model (embedding, a block, a head): batches of token ids, so samples, tokens and FLOPs all appear.
"""

from __future__ import annotations

import copy
import csv
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import autoshard
from autoshard.errors import AutoShardError
from autoshard.lightning import throughput
from autoshard.lightning.throughput import ThroughputMonitor, batch_size, device_peak_flops, token_count

VOCAB, SEQ, BATCH, STEPS = 32, 8, 4, 5


@pytest.fixture(autouse=True, scope="module")
def _environment_as_it_was() -> Any:
    """A fit in this process sets LOCAL_RANK, MASTER_PORT...: a later module's Lightning launcher would take them for
    its own."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TokenModel(pl.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)

    def loss(self, batch: Any) -> torch.Tensor:
        ids, labels = batch
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens(n: int = BATCH * STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))


def fit(model: pl.LightningModule, callbacks: list[Any], tmp_path: Path, validate: bool = False, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        **{
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": STEPS,
            "log_every_n_steps": 1,
            "logger": CSVLogger(tmp_path, name="run"),
            "callbacks": callbacks,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **kwargs,
        }
    )
    trainer.fit(model, DataLoader(tokens(), batch_size=BATCH), DataLoader(tokens(3 * BATCH), batch_size=BATCH) if validate else None)
    return trainer


def logged(trainer: pl.Trainer) -> list[dict[str, float]]:
    """The rows of the run's metrics.csv, empty cells left out."""
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def counted_step(model: TokenModel) -> int:
    """FLOPs of one training step of ``model``'s architecture on one batch, counted outside any Trainer."""
    fresh = copy.deepcopy(model)
    counter = FlopCounterMode(display=False)
    with counter:
        fresh.loss(next(iter(DataLoader(tokens(), batch_size=BATCH)))).backward()
    return int(counter.get_total_flops())


def test_an_fsdp2_run_logs_step_time_samples_tokens_tflops_and_mfu(tmp_path: Path) -> None:
    """Under autoshard's fsdp2 strategy: Lightning's names plus step time, TFLOP/s and tokens/s; the FLOPs per batch
    are FlopCounterMode's count of the same step; MFU is FLOP/s over the given peak."""
    model = TokenModel()
    expected = counted_step(model)
    peak = 1e10
    monitor = ThroughputMonitor(peak_flops=peak, window_size=2)
    trainer = fit(model, [monitor], tmp_path, strategy="fsdp2")
    assert type(trainer.strategy).__name__ == "FSDP2Strategy"
    assert monitor.measured_flops == expected > 0
    rows = [r for r in logged(trainer) if "train/device/mfu" in r]
    assert len(rows) >= 2, logged(trainer)
    for row in rows:
        per_batch = row["train/device/batches_per_sec"]
        assert row["train/device/samples_per_sec"] == pytest.approx(BATCH * per_batch) and per_batch > 0
        assert row["train/device/tokens_per_sec"] == pytest.approx(BATCH * SEQ * per_batch)
        assert row["train/device/step_time"] == pytest.approx(1 / per_batch)
        assert row["train/device/flops_per_sec"] == pytest.approx(expected * per_batch)
        assert row["train/device/tflops_per_sec"] == pytest.approx(row["train/device/flops_per_sec"] / 1e12)
        assert row["train/device/mfu"] == pytest.approx(row["train/device/flops_per_sec"] / peak)
    assert trainer.logged_metrics["train/device/mfu"] == pytest.approx(rows[-1]["train/device/mfu"])


def test_measuring_changes_nothing_in_the_run_and_a_cpu_logs_no_mfu_without_a_peak(tmp_path: Path) -> None:
    """The counted step trains exactly as an unobserved one (same weights after the run), the user's module gains no
    attribute, and with no peak known (a CPU) FLOP/s are logged and MFU is not. Validation during fit is measured
    too, without training FLOPs (its batches run no backward)."""
    pl.seed_everything(0)
    plain, watched = TokenModel(), TokenModel()
    watched.load_state_dict(plain.state_dict())
    fit(plain, [], tmp_path / "plain", logger=False)
    monitor = ThroughputMonitor(window_size=2)
    trainer = fit(watched, [monitor], tmp_path / "watched", validate=True, val_check_interval=2)
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name
    assert not hasattr(watched, "flops_per_batch")
    assert monitor.measured_flops == counted_step(TokenModel())
    rows = logged(trainer)
    assert any(r.get("train/device/tflops_per_sec", 0) > 0 for r in rows)
    assert not any("train/device/mfu" in r for r in rows)
    validated = [r for r in rows if "validate/device/samples_per_sec" in r]
    assert validated and all(r["validate/device/tokens_per_sec"] > 0 and "validate/device/flops_per_sec" not in r for r in validated)


def test_with_activation_checkpointing_the_recomputed_forward_is_counted(tmp_path: Path) -> None:
    """What the device computes: the checkpointed blocks' forward runs twice, so the count exceeds the plain step's
    (and stays below twice it: the backward is not recomputed); the run logs as without checkpointing."""
    from autoshard.lightning import FSDP2Strategy

    model = TokenModel()
    plain = counted_step(model)
    monitor = ThroughputMonitor(window_size=2)
    trainer = fit(model, [monitor], tmp_path, strategy=FSDP2Strategy(activation_checkpointing=True))
    assert trainer.strategy.intent.activation_checkpointing is True
    assert monitor.measured_flops is not None and plain < monitor.measured_flops < 2 * plain
    assert any(r.get("train/device/tflops_per_sec", 0) > 0 for r in logged(trainer))


def test_a_step_that_raises_while_counted_leaves_no_counter_behind(tmp_path: Path) -> None:
    """The user sees their error, and the process runs on without FlopCounterMode (a notebook's next cell)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    class Fails(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1:
                raise RuntimeError("the user's own error")
            return self.loss(batch)

    with pytest.raises(RuntimeError, match="the user's own error"):
        fit(Fails(), [ThroughputMonitor(window_size=2)], tmp_path, logger=False)
    assert _get_current_dispatch_mode() is None


def test_191_a_batch_that_ran_no_backward_is_not_taken_for_a_step(tmp_path: Path) -> None:
    """A ``training_step`` that returns None (Lightning skips the backward) on the counted batch: the next batch is
    counted, so FLOP/s are a full step's; one that never runs a backward gets a warning and no FLOP/s, not a forward's
    count (a third of a step) logged for every batch."""

    class SkipsOne(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            loss = self.loss(batch)
            return None if batch_idx == 1 else loss  # e.g. a loss found not finite

    model = SkipsOne()
    expected = counted_step(model)
    monitor = ThroughputMonitor(window_size=2)
    rows = logged(fit(model, [monitor], tmp_path / "one"))
    assert monitor.measured_flops == expected
    assert any(r.get("train/device/flops_per_sec", 0) > 0 for r in rows)

    class SkipsAll(TokenModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            self.loss(batch)
            return None

    monitor = ThroughputMonitor(window_size=2)
    with pytest.warns(
        UserWarning,
        match=r"ran a backward.*a training_step that returns None makes Lightning skip the backward.* No FLOPs were measured, so FLOP/s and MFU are not logged.* Fix: ThroughputMonitor\(flops_per_batch=\.\.\.\)",
    ):
        rows = logged(fit(SkipsAll(), [monitor], tmp_path / "all"))
    assert monitor.measured_flops is None
    assert any(r.get("train/device/samples_per_sec", 0) > 0 for r in rows)
    assert not any("train/device/flops_per_sec" in r for r in rows)


def test_the_users_flops_win_and_nothing_is_measured(tmp_path: Path) -> None:
    """Lightning's convention (a ``flops_per_batch`` attribute on the module) and the argument are used as given."""

    class Counted(TokenModel):
        flops_per_batch = 7e6

    monitor = ThroughputMonitor(window_size=2, peak_flops=1e9)
    rows = [r for r in logged(fit(Counted(), [monitor], tmp_path / "module")) if "train/device/mfu" in r]
    assert monitor.measured_flops is None and rows
    assert all(r["train/device/flops_per_sec"] == pytest.approx(7e6 * r["train/device/batches_per_sec"]) for r in rows)

    monitor = ThroughputMonitor(window_size=2, flops_per_batch=3_000_000)
    rows = [r for r in logged(fit(TokenModel(), [monitor], tmp_path / "argument")) if "train/device/flops_per_sec" in r]
    assert monitor.measured_flops is None and rows
    assert all(r["train/device/flops_per_sec"] == pytest.approx(3e6 * r["train/device/batches_per_sec"]) for r in rows)


def test_a_compiled_block_still_compiles_and_is_counted(tmp_path: Path) -> None:
    """A module first called under FlopCounterMode is never compiled (torch 2.13): the count waits for batch 2."""
    graphs: list[int] = []

    def recording(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(1)
        return gm.forward

    model = TokenModel()
    expected = counted_step(model)
    for block in model.blocks:
        block.compile(backend=recording)
    monitor = ThroughputMonitor(window_size=2)
    fit(model, [monitor], tmp_path, logger=False)
    assert graphs, "the compiled blocks never compiled"
    assert monitor.measured_flops == expected


def test_samples_and_tokens_from_the_batch() -> None:
    ids = torch.zeros(4, 8, dtype=torch.long)
    assert (batch_size((ids, torch.zeros(4))), token_count((ids, torch.zeros(4)))) == (4, 32)
    assert token_count({"pixels": torch.zeros(3, 2, 2), "input_ids": ids}) == 32  # the first integer tensor of 2+ dims
    assert token_count([torch.zeros(6, 5), torch.zeros(6, dtype=torch.long)]) == 6  # class labels are not tokens
    with pytest.raises(AutoShardError, match=r"Fix: ThroughputMonitor\(batch_size_fn="):
        batch_size({"name": "no tensors"})


def test_images_log_samples_and_no_tokens(tmp_path: Path) -> None:
    class Images(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(6, 3)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=STEPS, log_every_n_steps=1, logger=CSVLogger(tmp_path), callbacks=[ThroughputMonitor(window_size=2)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Images(), DataLoader(TensorDataset(torch.randn(20, 6), torch.randint(0, 3, (20,))), batch_size=4))
    rows = logged(trainer)
    assert any(r.get("train/device/samples_per_sec", 0) > 0 for r in rows)
    assert not any("train/device/tokens_per_sec" in r or "train/lengths" in r for r in rows)


def test_the_peak_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense bf16 peaks: the H200 as torch names it (Lightning's table misses that name and lists sparse figures);
    Lightning's table for the rest; an unknown GPU warns with the fix; a CPU has none, silently."""
    cuda = torch.device("cuda", 0)
    for name, peak in [
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert device_peak_flops(cuda, torch.bfloat16) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU 9000")
    with pytest.warns(UserWarning, match=r"MFU is not logged .* Fix: ThroughputMonitor\(peak_flops=\.\.\.\)"):
        assert device_peak_flops(cuda, torch.bfloat16) is None
    assert device_peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_a_lightningcli_config_adds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML of the guide: the callback by class path, Lightning's window and autoshard's peak as init_args."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])
    callback = {"class_path": "autoshard.ThroughputMonitor", "init_args": {"window_size": 50, "peak_flops": 1e12}}
    config = {"trainer": {"strategy": "auto-shard", "accelerator": "cpu", "devices": 1, "logger": False, "callbacks": [callback]}}
    trainer = LightningCLI(TokenModel, run=False, args=config, save_config_callback=None).trainer
    (monitor,) = [c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)]
    assert (monitor.kwargs["window_size"], monitor.peak_flops, monitor.length_fn) == (50, 1e12, token_count)


def test_the_tensor_parallel_size_that_makes_the_count_too_high_is_found() -> None:
    """Under tensor parallelism the counter sees DTensor matmuls whole (measured: 2 ranks, colwise + rowwise Linear,
    the count is the full model's): the monitor warns when the strategy's mesh has a tensor-parallel dim above 1."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.activations import fake_world
    from autoshard.lightning.throughput import tensor_parallel_size

    with fake_world(4, 0):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        assert tensor_parallel_size(SimpleNamespace(device_mesh=mesh)) == 2
        flat = init_device_mesh("cpu", (4,), mesh_dim_names=("data_parallel",))
        assert tensor_parallel_size(SimpleNamespace(device_mesh=flat)) == 1
    assert tensor_parallel_size(SimpleNamespace()) == 1  # DDP, DeepSpeed: no mesh
    from lightning.pytorch.strategies import ModelParallelStrategy

    assert tensor_parallel_size(ModelParallelStrategy()) == 1  # its mesh is not built before setup


def test_the_package_exports_it() -> None:
    assert autoshard.ThroughputMonitor is ThroughputMonitor is throughput.ThroughputMonitor
    from lightning.pytorch.callbacks import ThroughputMonitor as Lightnings

    assert issubclass(ThroughputMonitor, Lightnings)


@pytest.mark.gpu
def test_mfu_on_cuda_is_logged_and_between_0_and_1(tmp_path: Path) -> None:
    """On a GPU Lightning's table (or DENSE_PEAKS) knows: MFU is logged, and below 1 (FLOPs are not overcounted)."""

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(4)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    monitor = ThroughputMonitor(window_size=4)
    trainer = pl.Trainer(
        strategy="auto-shard", accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=12, log_every_n_steps=1,
        logger=CSVLogger(tmp_path), callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(12 * 256, 2048)), batch_size=256))
    assert monitor.available_flops, f"no peak known for {torch.cuda.get_device_name()}"
    assert monitor.measured_flops == pytest.approx(3 * 2 * 256 * 2048 * 2048 * 4, rel=0.3)
    mfu = [r["train/device/mfu"] for r in logged(trainer) if "train/device/mfu" in r]
    assert mfu and all(0 < m < 1 for m in mfu), mfu
