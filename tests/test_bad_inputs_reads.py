"""Checkpoint reads, never execute, never guess: rows 50-69 of the bad-input catalog (docs/bad-inputs.md), one
``test_NN_...`` each, plus one test per type autoshard lets a pickle build (checkpoint.TRUSTED_TYPES).

Every refusal names the file and ends with a Fix; where the Fix is a command or a call, the test runs it and checks
that it works. Real files throughout: a Lightning DeepSpeed ZeRO-3 checkpoint written by a real engine on the CPU (in a
subprocess, about 8 s), a ZeRO-2 one for the type only ZeRO-1/2 files hold, real Lightning and fsdp2 checkpoints.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard  # noqa: F401  registers the strategies
from autoshard._harness import child_env
from autoshard.checkpoint import trust as ckpt
from autoshard.checkpoint.resume import resolve_for_load
from autoshard.checkpoint.trust import CheckpointFormatError, UntrustedPickleError, load_torch_file
from autoshard.cli import main as cli
from autoshard.consolidate import consolidate
from autoshard.convert import ConvertError, ConvertOptions, convert, write_dcp
from autoshard.init_from import InitFromError, load_init_from, plan_init_from
from tests.distributed.harness import free_port
from tests.test_bad_inputs import data, isolated_process_state, trainer  # noqa: F401  (an autouse fixture)
from tests.test_bad_inputs import refused as refused_with
from tests.test_convert import trained_state

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*has no manifest:UserWarning"),  # stock DeepSpeed / hand-made sources
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]
MANIFEST = "autoshard-manifest.json"  # on-disk names are a contract: spelled out, not imported


def refused(error: type[BaseException], run: Any, *expected: str) -> str:
    """The catalog's check (tests/test_bad_inputs.py), and that the message ends with a Fix."""
    text = refused_with(error, run, *expected)
    assert "Fix: " in text, text
    return text


class RunsCode:
    """What a crafted checkpoint hides: unpickling it runs ``touch MARKER`` (any command would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def crafted(path: Path, marker: Path) -> Path:
    """A Lightning-looking .ckpt whose pickle runs a command; checked to really run it when loaded unsafely."""
    torch.save({"state_dict": {"body.weight": torch.ones(2, 2)}, "epoch": 0, "global_step": 1, "loops": {}, "x": RunsCode(marker)}, path)
    torch.load(path, weights_only=False)  # the payload works: this is what the refusals below prevent
    assert marker.exists()
    marker.unlink()
    return path


class Net(pl.LightningModule):
    def __init__(self, width: int = 32, data_dir: Path | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, width))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.body(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "step"}}


@pytest.fixture
def dcp(tmp_path: Path) -> Path:
    """A DCP checkpoint of trained weights and AdamW state, with Lightning's trainer state (what fsdp2 saves)."""
    path = tmp_path / "epoch=0-step=2.ckpt"
    write_dcp(trained_state(path), path)
    return path


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real fsdp2 checkpoint: two steps of Net in this process, saved through the strategy."""
    path = tmp_path_factory.mktemp("fsdp2") / "last.ckpt"
    t = trainer(strategy="fsdp2")
    t.fit(Net(), data())
    t.save_checkpoint(path)
    if dist.is_initialized():
        dist.destroy_process_group()
    return path


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Lightning checkpoint with what Lightning puts in one: callbacks, a scheduler, hyper-parameters."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    folder = tmp_path_factory.mktemp("lightning")
    t = trainer(
        max_epochs=2,
        max_steps=-1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(folder, monitor="loss", save_last=True), EarlyStopping("loss")],
    )
    t.fit(Net(), data())
    return folder / "last.ckpt"


LIGHTNING_DEEPSPEED_WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import lightning.pytorch as pl, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import autoshard
    class Net(pl.LightningModule):
        def __init__(self, hidden: int = 8):
            super().__init__()
            self.save_hyperparameters()
            self.body = nn.Linear(4, hidden)
            self.head = nn.Linear(hidden, 2)
            self.register_buffer("centre", torch.zeros(2))
        def training_step(self, batch, batch_idx):
            return (self.head(torch.tanh(self.body(batch[0]))) - self.centre).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)
    torch.manual_seed(0)
    t = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, strategy="autoshard-deepspeed", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t.fit(Net(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    t.save_checkpoint(sys.argv[1])
    """
)


@pytest.fixture(scope="module")
def lightning_deepspeed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Lightning DeepSpeed ZeRO-3 checkpoint (strategy='autoshard-deepspeed', one CPU process)."""
    pytest.importorskip("deepspeed")
    path = tmp_path_factory.mktemp("deepspeed") / "last.ckpt"
    done = subprocess.run(
        [sys.executable, "-c", LIGHTNING_DEEPSPEED_WRITER, str(path)], capture_output=True, text=True, timeout=240, check=False, env=child_env()
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return path


def stock_copy(source: Path, to: Path) -> Path:
    """A copy without autoshard's manifest: what Lightning's own deepspeed_stage_3 (or DeepSpeed) writes."""
    shutil.copytree(source, to)
    (to / MANIFEST).unlink(missing_ok=True)
    return to


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# -- 50-53: a pickle never runs code ------------------------------------------------------------------------------
def test_50_checkpoint_whose_pickle_runs_code_converted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "MARKER"
    evil = crafted(tmp_path / "last.ckpt", marker)
    refused(
        UntrustedPickleError,
        lambda: convert(evil, tmp_path / "hf", "safetensors"),
        f"cannot convert: {str(evil)!r} is a pickle that names `posix.system`",
        "torch.load(weights_only=True)",
        "Fix: if you trust who wrote it (your own run), pass --trust-pickle (trust_pickle=True)",
    )
    assert cli(["convert", str(evil), str(tmp_path / "hf"), "--to", "safetensors", "--quiet"]) == 1
    assert "`posix.system`" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_51_checkpoint_whose_pickle_runs_code_consolidated_or_loaded(tmp_path: Path, lightning_deepspeed: Path) -> None:
    """consolidate (a full file, and a DeepSpeed file read by DeepSpeed's zero_to_fp32, which passes
    weights_only=False itself) and init_from refuse it too."""
    marker = tmp_path / "MARKER"
    evil = crafted(tmp_path / "last.ckpt", marker)
    refused(UntrustedPickleError, lambda: consolidate(evil, tmp_path / "w.pt"), "cannot consolidate", "`posix.system`", "--trust-pickle")
    refused(
        InitFromError,
        lambda: plan_init_from(nn.Linear(2, 2), {"": str(evil)}),
        "`posix.system`",
        f"Fix: write the weights alone with `autoshard consolidate {evil} weights.pt --trust-pickle`",
    )
    ds = stock_copy(lightning_deepspeed, tmp_path / "ds.ckpt")
    states = ds / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    torch.save({**saved, "x": RunsCode(marker)}, states)
    refused(UntrustedPickleError, lambda: consolidate(ds, tmp_path / "w.pt"), f"{str(states)!r} is a pickle that names `posix.system`")
    with ckpt.weights_only_loads(), pytest.raises(pickle.UnpicklingError):  # what zero_to_fp32's own load runs under
        torch.load(states, weights_only=False)
    assert not marker.exists() and not (tmp_path / "w.pt").exists()


def test_52_dcp_metadata_whose_pickle_runs_code(tmp_path: Path, dcp: Path, fsdp2_checkpoint: Path) -> None:
    """torch reads DCP's .metadata with plain pickle (any global): autoshard reads it first, allowing DCP's classes."""
    marker = tmp_path / "MARKER"
    for path in (dcp, shutil.copytree(fsdp2_checkpoint, tmp_path / "fsdp2.ckpt")):
        (path / MANIFEST).unlink(missing_ok=True)
        (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
        for run in (
            lambda p=path: convert(p, tmp_path / "out", "safetensors"),
            lambda p=path: consolidate(p, tmp_path / "w.pt"),
            lambda p=path: resolve_for_load(p),
        ):
            refused(
                UntrustedPickleError,
                run,
                f"{str(path / '.metadata')!r} is a pickle that names `posix.system`",
                "Fix: restore the checkpoint from a backup",
            )
    assert not marker.exists()


def test_53_trust_pickle_is_an_explicit_opt_in(tmp_path: Path) -> None:
    """A Lightning checkpoint whose hyper-parameters hold a Path: refused by name; --trust-pickle converts it."""
    t = trainer()
    t.fit(Net(data_dir=Path("/data/blobs")), data())
    t.save_checkpoint(tmp_path / "last.ckpt")
    refused(UntrustedPickleError, lambda: convert(tmp_path / "last.ckpt", tmp_path / "hf", "safetensors"), "`pathlib.PosixPath`", "--trust-pickle")
    assert cli(["convert", str(tmp_path / "last.ckpt"), str(tmp_path / "hf"), "--to", "safetensors", "--trust-pickle", "--quiet"]) == 0
    assert cli(["consolidate", str(tmp_path / "last.ckpt"), str(tmp_path / "w.pt"), "--trust-pickle"]) == 0
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert set(weights) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}


# -- 54-57: DeepSpeed tags and files, never a guess --------------------------------------------------------------
def test_54_stale_deepspeed_latest(tmp_path: Path, lightning_deepspeed: Path) -> None:
    """'latest' names a tag that is gone: autoshard used to read the oldest tag present, without a word."""
    ds = stock_copy(lightning_deepspeed, tmp_path / "run.ckpt")
    shutil.copytree(ds / "checkpoint", ds / "global_step1")
    (ds / "latest").write_text("global_step9")
    present = "whose 'latest' names tag 'global_step9', which is not there (tags present: checkpoint, global_step1)"
    text = refused(
        CheckpointFormatError,
        lambda: convert(ds, tmp_path / "hf", "safetensors"),
        "cannot convert",
        present,
        "never guesses another",
        "Fix: pass --tag with the one you mean, e.g. --tag global_step1",
    )
    refused(CheckpointFormatError, lambda: consolidate(ds, tmp_path / "w.pt"), "cannot consolidate", present)
    refused(
        CheckpointFormatError,
        lambda: resolve_for_load(ds, "deepspeed_zero3"),
        "cannot resume",
        present,
        f"Fix: write the tag to resume into it, e.g. `echo global_step1 > {str(ds / 'latest')!r}`",
    )
    assert "--tag" in text and not (tmp_path / "hf").exists()
    assert convert(ds, tmp_path / "hf", "safetensors", ConvertOptions(tag="checkpoint")).tensors == 5  # the Fix
    assert consolidate(ds, tmp_path / "w.pt", tag="global_step1").tensors == 5
    (ds / "latest").write_text("global_step1")
    assert resolve_for_load(ds, "deepspeed_zero3") == ds


def test_55_deepspeed_tag_that_does_not_exist(tmp_path: Path, lightning_deepspeed: Path) -> None:
    ds = stock_copy(lightning_deepspeed, tmp_path / "run.ckpt")
    for run in (
        lambda: convert(ds, tmp_path / "hf", "safetensors", ConvertOptions(tag="global_step2")),
        lambda: consolidate(ds, tmp_path / "w.pt", tag="global_step2"),
    ):
        refused(
            CheckpointFormatError,
            run,
            f"{str(ds)!r} with --tag 'global_step2': no such tag directory (its tags: checkpoint; 'latest' names 'checkpoint')",
            "Fix: --tag checkpoint, or leave --tag out to read the tag 'latest' names",
        )
    assert cli(["consolidate", str(ds), str(tmp_path / "w.pt"), "--tag", "checkpoint"]) == 0


def test_56_truncated_deepspeed_shard(tmp_path: Path, lightning_deepspeed: Path) -> None:
    ds = stock_copy(lightning_deepspeed, tmp_path / "run.ckpt")
    shard = ds / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    truncate(shard)
    for action, run in (
        ("convert", lambda: convert(ds, tmp_path / "hf", "safetensors")),
        ("consolidate", lambda: consolidate(ds, tmp_path / "w.pt")),
    ):
        refused(
            CheckpointFormatError,
            run,
            f"cannot {action}: {str(shard)!r} (",
            "bytes) cannot be read",
            "truncated or damaged",
            "Fix: copy the checkpoint again from where it was written, or use an earlier one",
        )


def test_57_truncated_full_ckpt(tmp_path: Path, lightning_ckpt: Path) -> None:
    cut = tmp_path / "last.ckpt"
    shutil.copyfile(lightning_ckpt, cut)
    truncate(cut)
    for action, run in (
        ("convert", lambda: convert(cut, tmp_path / "hf", "safetensors")),
        ("consolidate", lambda: consolidate(cut, tmp_path / "w.pt")),
        ("resume", lambda: resolve_for_load(cut)),
    ):
        refused(CheckpointFormatError, run, f"cannot {action}: {str(cut)!r} (", "truncated or damaged", "Fix: copy the checkpoint again")
    assert consolidate(lightning_ckpt, tmp_path / "w.pt").tensors == 4  # the Fix: the whole file


# -- 58: an interrupted DCP save ---------------------------------------------------------------------------------
def test_58_dcp_checkpoint_without_or_with_a_torn_metadata(tmp_path: Path, dcp: Path) -> None:
    """The Fix names a complete checkpoint beside it (it used to say: pass the .ckpt path, which the user had done)."""
    for name, damage in (("no-metadata.ckpt", lambda p: (p / ".metadata").unlink()), ("torn.ckpt", lambda p: truncate(p / ".metadata"))):
        broken = shutil.copytree(dcp, tmp_path / name)
        damage(broken)
        for action, run in (
            ("convert", lambda p=broken: convert(p, tmp_path / "hf", "safetensors")),
            ("consolidate", lambda p=broken: consolidate(p, tmp_path / "w.pt")),
        ):
            text = refused(
                CheckpointFormatError,
                run,
                f"cannot {action}: {str(broken)!r} is a distributed checkpoint",
                f"Fix: {action} an earlier complete checkpoint, e.g. {str(dcp)!r}",
            )
            assert " is has " not in text and "ModelCheckpoint printed" not in text
    assert consolidate(dcp, tmp_path / "w.pt").tensors == 5  # the Fix


# -- 59-60: resume ------------------------------------------------------------------------------------------------
def test_59_resume_from_another_models_checkpoint_with_other_shapes(tmp_path: Path, fsdp2_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """strict=False skips missing and unexpected names, not another shape: the Fix leaves those out, and works."""
    model = Net(width=16)  # body.2 is (16, 32) here, (32, 32) in the checkpoint
    text = refused(
        CheckpointFormatError,
        lambda: trainer(strategy="fsdp2").fit(model, data(), ckpt_path=fsdp2_checkpoint),
        "2 with another shape: body.2.bias (checkpoint (32,), model (16,))",
        "strict=False skips missing and unexpected names only",
    )
    monkeypatch.chdir(tmp_path)
    command = re.search(r"run `autoshard (consolidate [^`]+)`", text).group(1)  # type: ignore[union-attr]
    assert cli(shlex.split(command)) == 0
    snippet = re.search(r", then (sd = .*?) before trainer.fit", text).group(1)  # type: ignore[union-attr]
    fresh = Net(width=16)
    before = fresh.body[2].weight.detach().clone()
    exec(snippet, {"torch": torch, "model": fresh})  # noqa: S102 - the Fix, as printed, is what the test checks
    saved = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert torch.equal(fresh.body[0].weight, saved["body.0.weight"]) and torch.equal(fresh.body[2].weight, before)


def test_60_deepspeed_checkpoint_for_3_ranks_resumed_on_2(tmp_path: Path, dcp: Path) -> None:
    pytest.importorskip("deepspeed")
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    three = tmp_path / "ds3"
    convert(dcp, three, "deepspeed", ConvertOptions(world_size=3, precision="32-true"))
    text = refused(
        CheckpointFormatError,
        lambda: resolve_for_load(three, "deepspeed_zero3", world_size=2),
        "ZeRO-3 partitions are for 3 ranks (zero_pp_rank_0 ... zero_pp_rank_2), and this run has 2 (devices x nodes)",
        "cannot reshard them",
        f"Fix: `autoshard convert {three} {three}-world2 --to deepspeed --world-size 2`",
    )
    refused(CheckpointFormatError, lambda: AutoShardDeepSpeedStrategy().load_checkpoint(three), "this run has 1", "--world-size 1")
    command = re.search(r"Fix: `autoshard (convert [^`]+)`", text).group(1)  # type: ignore[union-attr]
    assert cli([*shlex.split(command), "--quiet"]) == 0  # the Fix
    assert resolve_for_load(Path(f"{three}-world2"), "deepspeed_zero3", world_size=2) == Path(f"{three}-world2")


# -- 61: convert --module -----------------------------------------------------------------------------------------
def test_61_convert_module_names_a_buffer(tmp_path: Path, dcp: Path) -> None:
    """'centre' is a buffer at the top level: it used to be offered as a submodule to pass."""
    text = refused(
        ConvertError,
        lambda: convert(dcp, tmp_path / "hf", "safetensors", ConvertOptions(module="centre")),
        "--module 'centre' names a buffer of",
        "not a submodule",
        "Fix: pass one of its submodules: 'body', 'head'",
    )
    assert "'centre'" not in text.split("Fix:")[1]
    assert convert(dcp, tmp_path / "hf", "safetensors", ConvertOptions(module="body")).tensors == 2  # the Fix


# -- 62-63: init_from ---------------------------------------------------------------------------------------------
def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def test_62_init_from_integers_into_float_weights(tmp_path: Path) -> None:
    """An int64 file used to load into float weights silently; a float16 one loads, and the log says it was cast."""
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ints = save_safetensors({"weight": torch.arange(12).reshape(3, 4), "bias": torch.zeros(3, dtype=torch.int64)}, tmp_path / "ints.safetensors")
    refused(
        InitFromError,
        lambda: plan_init_from(model, {"": str(ints)}),
        f"init_from {str(ints)!r} does not match Linear: bias is int64 in the file and float32 in the model (and 1 more: weight)",
        "cast int values into float tensors",
        "nothing was loaded",
        "Fix: point init_from at this model's own weights",
    )
    half = {"weight": torch.randn(3, 4).half(), "bias": torch.randn(3).half()}
    plan = plan_init_from(model, {"": str(save_safetensors(half, tmp_path / "half.safetensors"))})
    report = load_init_from(model, plan)
    assert "2 tensor(s) cast from the file's float16 to the model's float32 (bias, weight)" in report.describe()
    assert torch.equal(model.weight, half["weight"].float()) and model.weight.dtype == torch.float32


def test_63_init_from_truncated_safetensors(tmp_path: Path) -> None:
    """Refused while planning, which every rank does (tests/distributed/test_init_from_reads.py: on 2 gloo ranks); it
    used to fail at load on the ranks reading past the end only, while rank 0 printed 'loaded'."""
    pytest.importorskip("safetensors")
    path = save_safetensors({"weight": torch.randn(64, 4), "bias": torch.randn(64)}, tmp_path / "model.safetensors")
    truncate(path)
    refused(
        InitFromError,
        lambda: plan_init_from(nn.Linear(4, 64), {"": str(path)}),
        f"init_from: {str(path)!r} is truncated: it holds",
        "bytes where its safetensors header says",
        "Fix: download or copy the file again",
    )


# -- not refused any more ---------------------------------------------------------------------------------------
def test_ddp_checkpoint_to_safetensors_needs_no_optimizer_names(tmp_path: Path, lightning_ckpt: Path) -> None:
    """A single-device / DDP .ckpt keys optimizer state by position: weights-only output does not need it (the
    refusal used to say "convert the weights alone with --to safetensors", to a user who had passed it)."""
    done = convert(lightning_ckpt, tmp_path / "hf", "safetensors")
    assert done.tensors == 4 and any("keyed by position" in note for note in done.notes)
    with pytest.raises(ConvertError, match="keyed by position"):
        convert(lightning_ckpt, tmp_path / "ds", "deepspeed", ConvertOptions(world_size=1, precision="32-true"))


# -- the types a pickle may build, one test each -------------------------------------------------------------------
ZERO2_WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", OMP_NUM_THREADS="1")
    import torch, deepspeed
    from torch import nn
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.1),
                                      config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(sys.argv[1], tag="global_step2")
    """
)


def without(name: str) -> tuple[str, ...]:
    assert name in ckpt.TRUSTED_TYPES
    return tuple(t for t in ckpt.TRUSTED_TYPES if t != name)


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum"])
def test_zero3_optimizer_files_need_exactly_this_type(name: str, lightning_deepspeed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    optim = lightning_deepspeed / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert name in torch.serialization.get_unsafe_globals_in_checkpoint(str(optim))
    assert load_torch_file(optim)["optimizer_state_dict"]["zero_stage"] == 3
    assert consolidate(lightning_deepspeed, tmp_path / "w.pt").tensors == 5  # through DeepSpeed's zero_to_fp32, forced safe
    monkeypatch.setattr(ckpt, "TRUSTED_TYPES", without(name))
    refused(UntrustedPickleError, lambda: load_torch_file(optim), f"`{name}`")


@pytest.mark.deepspeed
@pytest.mark.timeout(200)
def test_zero2_optimizer_files_need_fragment_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "deepspeed.utils.tensor_fragment.fragment_address"
    pytest.importorskip("deepspeed")
    done = subprocess.run(
        [sys.executable, "-c", ZERO2_WRITER, str(tmp_path / "z2"), str(free_port())], capture_output=True, text=True, timeout=150, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    optim = tmp_path / "z2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert name in torch.serialization.get_unsafe_globals_in_checkpoint(str(optim))
    assert consolidate(tmp_path / "z2", tmp_path / "w.pt").tensors == 4
    monkeypatch.setattr(ckpt, "TRUSTED_TYPES", without(name))
    refused(UntrustedPickleError, lambda: consolidate(tmp_path / "z2", tmp_path / "w2.pt"), f"`{name}`")


def test_fp16_loss_scaler_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 run's optimizer file holds DeepSpeed's DynamicLossScaler (no fp16 DeepSpeed on this CPU: built by the
    constructor the engine calls, with DeepSpeed's own defaults)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import get_float16_config

    scaler = CreateLossScaler(torch.half, 0, True, get_float16_config({"fp16": {"enabled": True}}).dynamic_loss_scale_args())
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": True}}, tmp_path / "optim.pt")
    loaded = load_torch_file(tmp_path / "optim.pt")["optimizer_state_dict"]["loss_scaler"]
    assert type(loaded).__name__ == "DynamicLossScaler" and loaded.cur_scale == scaler.cur_scale
    monkeypatch.setattr(ckpt, "TRUSTED_TYPES", without("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"))
    refused(UntrustedPickleError, lambda: load_torch_file(tmp_path / "optim.pt"), "DynamicLossScaler")


def test_lightning_files_need_no_type_of_their_own(lightning_ckpt: Path, fsdp2_checkpoint: Path, lightning_deepspeed: Path) -> None:
    """LIGHTNING_TYPES is empty, measured: a Lightning .ckpt (callbacks, scheduler, hyper-parameters), fsdp2's meta.pt
    and the client state in a Lightning DeepSpeed model_states file hold nothing weights_only refuses."""
    assert ckpt.LIGHTNING_TYPES == ()
    files = [lightning_ckpt, fsdp2_checkpoint / "meta.pt", lightning_deepspeed / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    for f in files:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(str(f)) == [], f
        loaded = load_torch_file(f)
        assert "global_step" in loaded and "loops" in loaded, f


# -- storage access on any device ------------------------------------------------------------------------------------
def test_init_from_into_shards_on_another_device(tmp_path: Path) -> None:
    """The fast read path wrote through ``.numpy()`` into the shard, which fails for a shard Lightning already moved to
    the GPU; ``meta`` stands in for it here (the reads happen, the copies are no-ops)."""
    pytest.importorskip("safetensors")
    path = save_safetensors({"weight": torch.randn(8, 4), "bias": torch.randn(8)}, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = nn.Linear(4, 8)
    report = load_init_from(model, plan_init_from(model, {"": str(path)}))
    assert report.tensors == 2 and report.bytes_read == 40 * 4


@pytest.mark.gpu
def test_init_from_into_cuda_shards(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    tensors = {"weight": torch.randn(8, 4), "bias": torch.randn(8)}
    path = save_safetensors(tensors, tmp_path / "model.safetensors")
    model = nn.Linear(4, 8).cuda()
    load_init_from(model, plan_init_from(model, {"": str(path)}))
    assert torch.equal(model.weight.cpu(), tensors["weight"]) and torch.equal(model.bias.cpu(), tensors["bias"])
