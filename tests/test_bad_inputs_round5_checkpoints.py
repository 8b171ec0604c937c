"""The bad-input catalog, round five's checkpoint rows (docs/bad-inputs.md; issue 39 items 4 and 7).

``fabric.load(strict=True)`` of a full file refuses a model whose names differ, as a distributed checkpoint's load does;
a full checkpoint of a run whose optimizer keeps no state (plain SGD) resumes exactly; a weights-only checkpoint is
refused for a resume with what it lacks and how to start from its weights; ``fabric.save`` refuses what its own
``fabric.load`` would refuse to read, and the load's Fix names its own argument; ``autoshard consolidate`` never writes a
pickle under a ``.safetensors`` name nor a file where a directory was meant; Lightning's ``save_distributed_checkpoint``
is refused with the field that replaces it.

All in this process: Fabric and Trainers on CPU, devices=1; the command through ``autoshard.cli.main``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoshard  # noqa: F401  registers the strategies
from autoshard.checkpoint.publish import MANIFEST, sidecar_path
from autoshard.checkpoint.trust import CheckpointFormatError, UntrustedPickleError
from autoshard.cli import main
from autoshard.errors import IntentError
from tests.test_bad_inputs import (
    isolated_process_state,  # noqa: F401  (an autouse fixture)
    refused,
)
from tests.test_bad_inputs_writes import QUIET, tree

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.filterwarnings("ignore:autoshard.*has no manifest")]


def fabric(**intent: Any) -> Any:
    from lightning.fabric import Fabric

    from autoshard.fabric import FSDP2Strategy

    f = Fabric(accelerator="cpu", devices=1, strategy=FSDP2Strategy(intent=intent))
    f.launch()
    return f


def blocks(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in module.state_dict().items()}


class Plain(pl.LightningModule):
    """SGD without momentum keeps no optimizer state; the scheduler moves the lr the optimizer's param groups hold."""

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.momentum = momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def data() -> DataLoader:
    torch.manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


def fsdp2(**intent: Any) -> Any:
    from autoshard.lightning import FSDP2Strategy

    return FSDP2Strategy(**intent)


# -- item 4: fabric.load(strict=True) of a full file -------------------------------------------------------------------
def test_185_fabric_load_strict_of_a_full_file_names_missing_and_unexpected_keys(tmp_path: Path) -> None:
    """Before: a 2-block save loaded into a 3-block model (and a ``filter=`` save) returned normally with a block left
    as it was; a 3-block save into 2 blocks ended in torch's raw RuntimeError. Now refused as the distributed
    checkpoint's load is, in the same words, before anything is loaded; strict=False loads the names both have."""
    f = fabric(checkpoint="full")
    two, three = f.setup_module(blocks(2)), f.setup_module(blocks(3))
    f.save(tmp_path / "two.pt", {"model": two, "step": 1})
    f.save(tmp_path / "filtered.pt", {"model": three}, filter={"model": lambda name, _: name.startswith("0.")})
    f.save(tmp_path / "three.pt", {"model": three})
    before = weights(three)
    fix = "Fix: load a checkpoint of this model, or fabric.load(path, state, strict=False) to load the names both have"
    refused(
        CheckpointFormatError,
        lambda: f.load(tmp_path / "two.pt", {"model": three}),
        f"cannot load {str(tmp_path / 'two.pt')!r}: its 'model' weights do not match this Sequential: 2 missing from the checkpoint: 2.bias, 2.weight.",
        fix,
    )
    refused(
        CheckpointFormatError,
        lambda: f.load(tmp_path / "filtered.pt", {"model": three}),
        "4 missing from the checkpoint: 1.bias, 1.weight, 2.bias, 2.weight",
        fix,
    )
    assert all(torch.equal(before[k], v) for k, v in weights(three).items())  # refused before anything was loaded
    other = f.setup_module(blocks(2))
    refused(
        CheckpointFormatError,
        lambda: f.load(tmp_path / "three.pt", {"model": other}),
        "2 in the checkpoint but not in the model: 2.bias, 2.weight",
        fix,
    )
    # The same load from a distributed checkpoint says the same.
    d = fabric(checkpoint="distributed")
    d.save(tmp_path / "two-dcp", {"model": d.setup_module(blocks(2))})
    refused(
        CheckpointFormatError,
        lambda: d.load(tmp_path / "two-dcp", {"model": d.setup_module(blocks(3))}),
        "2 missing from the checkpoint: 2.bias, 2.weight",
        fix,
    )
    # The Fix: strict=False loads what matches and leaves the rest.
    assert f.load(tmp_path / "two.pt", {"model": three}, strict=False) == {"step": 1}
    now, saved = weights(three), weights(two)
    assert all(torch.equal(now[k], saved[k]) for k in saved) and torch.equal(now["2.weight"], before["2.weight"])
    f.load(tmp_path / "three.pt", {"model": other}, strict=False)
    assert all(torch.equal(v, before[k]) for k, v in weights(other).items())


# -- item 7a: an optimizer without state -------------------------------------------------------------------------------
def test_186_full_checkpoint_of_plain_sgd_resumes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """Before: resuming a checkpoint='full' Trainer checkpoint of a run on plain SGD ended in a raw IndexError
    (Lightning's rekeying reads the first state entry) and, past it, torch's AssertionError; fabric.load of such a
    Fabric file ended in the AssertionError. Now both resume, param groups (the lr the scheduler moved) included."""
    uninterrupted = pl.Trainer(strategy=fsdp2(checkpoint="full"), max_epochs=3, **QUIET)
    uninterrupted.fit(Plain(), data())
    first = pl.Trainer(strategy=fsdp2(checkpoint="full"), max_epochs=1, **QUIET)
    first.fit(Plain(), data())
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    assert torch.load(tmp_path / "epoch1.ckpt", weights_only=True)["optimizer_states"][0]["state"] == {}  # the case
    resumed = pl.Trainer(strategy=fsdp2(checkpoint="full"), max_epochs=3, **QUIET)
    resumed.fit(Plain(), data(), ckpt_path=tmp_path / "epoch1.ckpt")
    a, b = weights(uninterrupted.lightning_module), weights(resumed.lightning_module)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.optimizers[0].param_groups[0]["lr"] == uninterrupted.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**3

    f = fabric(checkpoint="full")
    net = blocks(2)
    model, optimizer = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.025
    f.save(tmp_path / "fabric.pt", {"model": model, "optimizer": optimizer})
    net = blocks(2)
    other, other_optimizer = f.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    f.load(tmp_path / "fabric.pt", {"model": other, "optimizer": other_optimizer})
    assert other_optimizer.param_groups[0]["lr"] == 0.025
    saved = weights(model)
    assert all(torch.equal(saved[k], v) for k, v in weights(other).items())


# -- item 7b: a weights-only checkpoint given to a resume --------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", ["full", "distributed"])
def test_187_resume_from_a_weights_only_checkpoint_says_what_it_lacks(tmp_path: Path, checkpoint: str) -> None:
    """Before: a raw KeyError: 'optimizer_states' (full file), or "torch.distributed.checkpoint failed ... Fix: resume
    with the LightningModule and the optimizers that wrote this checkpoint", which it was (distributed)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    run = pl.Trainer(
        strategy=fsdp2(checkpoint=checkpoint),
        max_epochs=1,
        **{**QUIET, "enable_checkpointing": True},
        callbacks=[ModelCheckpoint(tmp_path / "ck", save_weights_only=True)],
    )
    run.fit(Plain(momentum=0.9), data())
    path = tmp_path / "ck" / "epoch=0-step=2.ckpt"
    saved = weights(run.lightning_module)
    assert not all(torch.equal(saved[k], v) for k, v in weights(Plain()).items())  # trained: init_from below shows
    refused(
        CheckpointFormatError,
        lambda: pl.Trainer(strategy=fsdp2(checkpoint=checkpoint), max_epochs=2, **QUIET).fit(Plain(momentum=0.9), data(), ckpt_path=path),
        f"cannot resume from {str(path)!r}: it was saved with weights only (ModelCheckpoint(save_weights_only=True),",
        "but not 'lr_schedulers', 'optimizer_states', 'callbacks': no optimizer state, learning-rate schedulers or callback states",
        f"Fix: to start from its weights, pass strategy=FSDP2Strategy(init_from={str(path)!r}) (or ShardingIntent(init_from=...)) and fit without ckpt_path",
        "to resume exactly, save without save_weights_only",
    )
    # The Fix: the weights, at the start of a new fit (max_steps=0: set up, nothing trained).
    start = pl.Trainer(strategy=fsdp2(checkpoint=checkpoint, init_from=str(path)), max_steps=0, **QUIET)
    start.fit(Plain(momentum=0.9), data())
    assert all(torch.equal(saved[k], v) for k, v in weights(start.lightning_module).items())
    # What a weights-only checkpoint is for is not refused: validate / test with it.
    pl.Trainer(strategy=fsdp2(checkpoint=checkpoint), **QUIET).validate(
        Validated(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=4), ckpt_path=path
    )


class Validated(Plain):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).pow(2).mean()


# -- item 7c: fabric.save and fabric.load agree ------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", ["full", "distributed"])
def test_188_fabric_save_refuses_what_fabric_load_would_refuse(tmp_path: Path, checkpoint: str) -> None:
    """Before: fabric.save wrote a Path, a Namespace or a numpy scalar, and fabric.load then refused the file with
    "Fix: ... pass --trust-pickle (trust_pickle=True)", an argument fabric.load does not take."""
    import numpy as np

    f = fabric(checkpoint=checkpoint)
    model = f.setup_module(blocks(2))
    for value, name in ((tmp_path / "data", "pathlib.PosixPath"), (argparse.Namespace(lr=0.1), "argparse.Namespace"), (np.float64(0.5), "numpy")):
        refused(
            CheckpointFormatError,
            lambda: f.save(tmp_path / "ckpt", {"model": model, "extra": {"best": value, "step": 3}}),
            "fabric.save cannot save 'extra': it holds `" + name,
            "which fabric.load would refuse to read back: a checkpoint is read with torch.load(weights_only=True)",
            "nothing was written. Fix: save 'extra' as plain values (str(path), vars(namespace), float(x), x.tolist(), a tensor)",
        )
        assert not list(tmp_path.iterdir())
    f.save(
        tmp_path / "ckpt",
        {"model": model, "extra": {"best": 0.5, "data": str(tmp_path), "args": vars(argparse.Namespace(lr=0.1)), "t": torch.ones(2)}},
    )
    assert f.load(tmp_path / "ckpt", {"model": model})["extra"]["args"] == {"lr": 0.1}  # the Fix reads back
    # A file another writer pickled a Path into (no manifest: it is not autoshard's save): the load's Fix names
    # fabric.load's own argument, and it works.
    written = tmp_path / "ckpt" / "meta.pt" if checkpoint == "distributed" else tmp_path / "ckpt"
    state = torch.load(written, weights_only=True)
    state["extra"] = {"data": tmp_path}
    torch.save(state, written)
    (tmp_path / "ckpt" / MANIFEST if checkpoint == "distributed" else sidecar_path(tmp_path / "ckpt")).unlink()
    text = refused(
        UntrustedPickleError,
        lambda: f.load(tmp_path / "ckpt", {"model": model}),
        "names `pathlib.PosixPath`",
        "Fix: if you trust who wrote it (your own run), load it with fabric.load(path, state, weights_only=False)",
    )
    assert "trust_pickle" not in text and "--trust-pickle" not in text
    assert f.load(tmp_path / "ckpt", {"model": model}, weights_only=False)["extra"]["data"] == tmp_path


# -- items 7d, 7e: consolidate's output name ---------------------------------------------------------------------------
def test_189_consolidate_to_a_safetensors_name_or_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `autoshard consolidate CKPT out.safetensors` wrote a torch pickle under that name, and `... out/` wrote
    a file named `out`. Both are refused before anything is read; each Fix works."""
    from safetensors.torch import load_file

    f = fabric(checkpoint="distributed")
    model = f.setup_module(blocks(2))
    f.save(tmp_path / "ckpt", {"model": model})
    before = tree(tmp_path)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {str(tmp_path / 'out.safetensors')!r}: consolidate writes one torch.save file (a pickle), not safetensors" in err
    fix = f"`autoshard convert {tmp_path / 'ckpt'} {tmp_path / 'out'} --to safetensors` (it writes {str(tmp_path / 'out' / 'model.safetensors')!r})"
    assert fix in err and f"for a torch file, name it {str(tmp_path / 'out.pt')!r}" in err
    assert main(["consolidate", str(tmp_path / "ckpt"), f"{tmp_path / 'out'}/"]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {str(tmp_path / 'out') + '/'!r}: a path ending in a separator names a directory, and consolidate writes one file." in err
    assert f"Fix: name the file, e.g. {str(tmp_path / 'out' / 'weights.pt')!r}" in err
    assert tree(tmp_path) == before  # nothing written
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "safetensors"]) == 0  # the Fixes
    saved = weights(model)
    assert all(torch.equal(saved[k], v) for k, v in load_file(tmp_path / "out" / "model.safetensors").items())
    (tmp_path / "dir").mkdir()
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "dir" / "weights.pt")]) == 0
    assert sorted(torch.load(tmp_path / "dir" / "weights.pt", weights_only=True)) == sorted(saved)


# -- item 7f: Lightning's save_distributed_checkpoint ------------------------------------------------------------------
def test_190_save_distributed_checkpoint_names_the_checkpoint_field() -> None:
    """Before: "unknown ShardingIntent field(s): 'save_distributed_checkpoint' ... Fix: drop 'save_distributed_checkpoint'",
    which would silently write the other layout when it was False."""
    from autoshard.fabric import FSDP2Strategy as FabricFSDP2

    for strategy in (fsdp2, FabricFSDP2):
        for given, field in ((False, "'full'"), (True, "'distributed'")):
            refused(
                IntentError,
                lambda: strategy(save_distributed_checkpoint=given),
                "unknown ShardingIntent field(s): 'save_distributed_checkpoint'.",
                f"Fix: replace save_distributed_checkpoint={given} by checkpoint={field} (one of 'distributed', 'full')",
            )
    assert fsdp2(checkpoint="full").intent.checkpoint == "full"  # the Fix
