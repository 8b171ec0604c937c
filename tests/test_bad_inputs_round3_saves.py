"""The bad-input catalog, rows 139-149 (docs/bad-inputs.md, "Round three: saves, loads and the command line").

``fabric.load`` never returns having loaded nothing (``strict=False`` included) and names the key the weights are
under; a training save never replaces a file autoshard did not write, and a save that cannot be written says why;
``convert`` refuses an absurd world size and clears what a dead writer staged; ``init_from``'s Fix converts only the
tensors that need it; the command line keeps stdout for its result and ends quietly on a closed pipe; module entry
points that are no command say which one is; safetensors outputs honour the umask.

In this process wherever possible (Fabric and Trainers on CPU, devices=1; the CLI through ``autoshard.cli.main``); a
child process only where the behaviour is the process's own: a fresh DeepSpeed import's log line, a closed pipe.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import autoshard  # noqa: F401  registers the strategies
from autoshard._harness import child_env
from autoshard.checkpoint.publish import CheckpointWriteError, staging_path
from autoshard.checkpoint.trust import CheckpointFormatError
from autoshard.cli import main
from autoshard.convert import ConvertError, convert
from autoshard.init_from import InitFromError, plan_init_from
from tests.test_bad_inputs import (
    isolated_process_state,  # noqa: F401  (an autouse fixture)
    refused,
)
from tests.test_bad_inputs_writes import QUIET, Net, data, lightning_dcp, read_only_dir, tree  # noqa: F401  (read_only_dir: a fixture)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:autoshard.*has no manifest"),  # the hand-made DCP sources have none
]
ROOT = Path(__file__).resolve().parents[1]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


def fabric(**intent: Any) -> Any:
    from lightning.fabric import Fabric

    from autoshard.fabric import FSDP2Strategy

    f = Fabric(accelerator="cpu", devices=1, strategy=FSDP2Strategy(intent=intent) if intent else "fsdp2")
    f.launch()
    return f


def trained(tmp_path: Path, name: str = "trainer.ckpt", **intent: Any) -> tuple[pl.Trainer, Path]:
    """A Trainer checkpoint of ``Net`` after one step (weights under 'state_dict', optimizer state beside them)."""
    from autoshard.lightning import FSDP2Strategy

    trainer = pl.Trainer(strategy=FSDP2Strategy(intent=intent) if intent else "fsdp2", max_steps=1, **QUIET)
    trainer.fit(Net(), data())
    trainer.save_checkpoint(tmp_path / name)
    return trainer, tmp_path / name


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(full(x), full(y)) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- 139-140: fabric.load never returns having loaded nothing ----------------------------------------------------------
def test_139_fabric_load_of_a_trainer_checkpoint_names_state_dict(tmp_path: Path) -> None:
    """Before: refused with "Fix: ... strict=False", and strict=False then returned with 0 of the weights loaded."""
    trainer, path = trained(tmp_path)
    saved = trainer.lightning_module
    f = fabric()
    model = f.setup_module(Net())
    assert not same_weights(model, saved)  # so that a load that loads nothing cannot pass below
    for strict in (True, False):
        text = refused(
            CheckpointFormatError,
            lambda: f.load(path, {"model": model}, strict=strict),
            f"cannot load {str(path)!r} into Net: it holds nothing under 'model', the key this state gives Net;",
            "its weights are under 'state_dict', as a Lightning Trainer's checkpoint keeps them (4 of the 4 names of Net)",
            "Fix: give the model the key its weights are saved under: fabric.load(path, {'state_dict': model})",
        )
        assert "Fix: load with fabric.load(path, state, strict=False)" not in text
    assert not same_weights(model, saved)
    rest = f.load(path, {"state_dict": model})  # the Fix: every weight loaded
    assert same_weights(model, saved) and rest["global_step"] == 1


@pytest.mark.parametrize("checkpoint", ["distributed", "full"])
def test_140_fabric_load_under_a_renamed_key(tmp_path: Path, checkpoint: str) -> None:
    """Saved as {"model": m}, loaded as {"net": m2}: the same silent no-op with strict=False, in both layouts (the full
    file used to end in a raw KeyError)."""
    f = fabric(checkpoint=checkpoint)
    model = f.setup_module(Net())
    f.save(tmp_path / "ckpt", {"model": model, "step": 3})
    other = f.setup_module(Net())
    assert not same_weights(other, model)
    for strict in (True, False):
        refused(
            CheckpointFormatError,
            lambda: f.load(tmp_path / "ckpt", {"net": other}, strict=strict),
            "it holds nothing under 'net', the key this state gives Net; its weights are under 'model' (4 of the 4 names of Net)",
            "(strict=False skips the names the two do not share, and they share none, so it would load nothing)",
            "Fix: give the model the key its weights are saved under: fabric.load(path, {'model': model})",
        )
    assert f.load(tmp_path / "ckpt", {"model": other}) == {"step": 3} and same_weights(other, model)  # the Fix
    # Beside a model that loads, one the checkpoint holds nothing of is what strict=False skips: said, not refused.
    extra = f.setup_module(Net())
    before = [full(t).clone() for t in extra.state_dict().values()]
    refused(CheckpointFormatError, lambda: f.load(tmp_path / "ckpt", {"model": other, "extra": extra}), "it holds nothing under 'extra'")
    with pytest.warns(UserWarning, match="fabric.load.*strict=False. left 'extra' as it was: it holds nothing under 'extra'"):
        f.load(tmp_path / "ckpt", {"model": other, "extra": extra}, strict=False)
    assert all(torch.equal(a, full(b)) for a, b in zip(before, extra.state_dict().values()))


# -- 141-142: a training save never replaces what autoshard did not write ----------------------------------------------
@pytest.mark.parametrize("checkpoint", ["distributed", "full"])
def test_141_training_save_over_a_users_torch_file(tmp_path: Path, checkpoint: str) -> None:
    """Before: fabric.save / trainer.save_checkpoint replaced the user's own torch.save file (by a directory, under
    checkpoint='distributed'), while a text file or a folder of other files was refused."""
    mine = tmp_path / "mine.pt"
    torch.save({"weights": torch.arange(5.0)}, mine)
    before = tree(tmp_path)
    trainer, own = trained(tmp_path, "last.ckpt", checkpoint=checkpoint)
    f = fabric(checkpoint=checkpoint)
    model = f.setup_module(Net())
    for save in (lambda: trainer.save_checkpoint(mine), lambda: f.save(mine, {"model": model})):
        refused(
            CheckpointFormatError,
            save,
            f"refusing to save over {str(mine)!r}: it is a single torch.save file, and autoshard did not write it (no"
            " mine.pt.autoshard-manifest.json beside it); a save replaces it whole, and autoshard replaces only its own earlier saves.",
            f"Fix: save to a new path, e.g. {str(tmp_path / 'mine-1.pt')!r}, or move {str(mine)!r} away first",
        )
        assert mine.is_file() and tree(tmp_path)["mine.pt"] == before["mine.pt"]
        assert not any(p.name.startswith(".mine.pt") for p in tmp_path.iterdir())  # nothing staged either
    trainer.save_checkpoint(own)  # its own earlier save (ModelCheckpoint's last.ckpt again): replaced as always
    f.save(tmp_path / "mine-1.pt", {"model": model})  # the Fix
    f.save(tmp_path / "mine-1.pt", {"model": model})  # and again: now it is autoshard's own
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".autoshard-manifest.json")) == ["last.ckpt", "mine-1.pt", "mine.pt"]


def test_141_a_stock_lightning_checkpoint_is_replaced_as_modelcheckpoint_expects(tmp_path: Path) -> None:
    """The other side of 141: ``last.ckpt`` from an earlier run with stock Lightning (no autoshard manifest) is a training
    checkpoint ModelCheckpoint replaces by design; refusing it would end the new run at its first save, after its
    first epoch. Only the version key Lightning writes into every checkpoint is read (as bytes: nothing unpickled)."""
    trainer, _ = trained(tmp_path, "first.ckpt", checkpoint="full")
    stock = tmp_path / "last.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": {"w": torch.zeros(2)}, "epoch": 0}, stock)
    trainer.save_checkpoint(stock)
    assert "pytorch-lightning_version" in torch.load(stock, weights_only=True)  # autoshard's save is there now
    assert (tmp_path / "last.ckpt.autoshard-manifest.json").is_file()
    mine = tmp_path / "mine.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, mine)  # a user's own file, even with a state_dict: refused
    with pytest.raises(CheckpointFormatError, match="refusing to save over .*mine.pt"):
        trainer.save_checkpoint(mine)


def test_142_fabric_save_where_nothing_can_be_written(tmp_path: Path, read_only_dir: Path) -> None:  # noqa: F811  (the fixture)
    """Before: a parent that is a file gave a raw FileExistsError, a read-only filesystem blamed the lock file, and a
    text file got a Fix naming a path inside that file."""
    f = fabric()
    model = f.setup_module(Net())
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    refused(
        CheckpointWriteError,
        lambda: f.save(notes / "ckpt", {"model": model}),
        f"cannot write {str(notes / 'ckpt')!r}: {str(notes)!r} is a file, not a directory; refused before anything was written.",
        f"Fix: choose an output path in a directory you can write (e.g. under {str(Path.home())!r}), or move the file {str(notes)!r} away",
    )
    text = refused(
        CheckpointWriteError,
        lambda: f.save(read_only_dir / "ckpt", {"model": model}),
        f"cannot write {str(read_only_dir / 'ckpt')!r}: the directory {str(read_only_dir)!r} is not writable (",
        f"or make {str(read_only_dir)!r} writable",
    )
    assert "lock" not in text
    refused(
        CheckpointFormatError,
        lambda: f.save(notes, {"model": model}),
        f"refusing to save over {str(notes)!r}: it is a file that torch.save did not write",
        f"Fix: save to a new path, e.g. {str(tmp_path / 'notes-1.txt')!r}, or move it away first",
    )
    assert notes.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "ro"]
    f.save(tmp_path / "notes-1.txt", {"model": model})  # the Fix works


# -- 143-144: convert: a world size that makes no sense; what a dead writer staged ------------------------------------
def test_143_convert_to_deepspeed_for_a_million_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --world-size 1000000 on a 0.05 MiB model wrote 190,187 files (1.5 GB) until it was stopped."""
    _, source = trained(tmp_path)
    out = tmp_path / "ds"
    assert main(["convert", str(source), str(out), "--to", "deepspeed", "--world-size", "1000000", "--precision", "32-true"]) == 1
    err = capsys.readouterr().err
    assert "--world-size 1,000,000 is more ranks than the largest parameter of" in err
    assert "('body.0.weight': 32): ZeRO-3 splits each parameter across every rank, so ranks 32 to 999,999 would hold padding only" in err
    assert err.rstrip().endswith("Fix: --world-size N, the devices x nodes of the run that resumes it (at most 32 for this model)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer.ckpt"]  # nothing written, nothing staged
    if importlib.util.find_spec("deepspeed") is None:
        return  # the Fix writes a DeepSpeed checkpoint: that needs deepspeed
    assert main(["convert", str(source), str(out), "--to", "deepspeed", "--world-size", "32", "--precision", "32-true", "--quiet"]) == 0
    assert len(list((out / "checkpoint").glob("*optim_states.pt"))) == 32


def test_144_convert_clears_what_a_dead_writer_staged(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a convert killed mid-write left its hidden staging (1.5 GB there) and the next convert neither removed
    nor mentioned it. Now the next writer removes and names it, and SIGTERM ends a convert as an exception that
    removes its own staging."""
    source = lightning_dcp(tmp_path / "last.ckpt")
    out = tmp_path / "hf"
    dead = staging_path(out, "999999-deadbeef")  # a writer that was killed: its pid is gone and it holds no lock
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 4096)
    assert main(["convert", str(source), str(out), "--to", "safetensors"]) == 0
    err = capsys.readouterr().err
    assert f"removed {str(dead)!r}, the staging of a convert to {str(out)!r} that did not finish (its writer is gone)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "last.ckpt"]
    weights = tmp_path / "weights.pt"  # consolidate goes through the same Publisher step
    staging_path(weights, "999999-deadbeef").write_bytes(b"\0" * 4096)
    with pytest.warns(UserWarning, match=r"removed .*\.weights\.pt\.autoshard-tmp\.999999-deadbeef', the staging of a consolidate"):
        assert main(["consolidate", str(source), str(weights)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "last.ckpt", "weights.pt", "weights.pt.autoshard-manifest.json"]
    for p in (weights, tmp_path / "weights.pt.autoshard-manifest.json"):
        p.unlink()

    import autoshard.convert.pipeline as pipeline

    real = pipeline.write_safetensors

    def killed(*args: Any, **kwargs: Any) -> Any:
        written = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's time limit, mid-write
        return written

    monkeypatch.setattr(pipeline, "write_safetensors", killed)
    with pytest.raises(SystemExit) as info:
        main(["convert", str(source), str(tmp_path / "hf2"), "--to", "safetensors"])
    assert info.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "last.ckpt"]  # its staging went with it
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # and the handler is put back


# -- 145: init_from's Fix converts only what needs converting ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_145_init_from_fix_converts_only_the_named_tensor(tmp_path: Path, kind: str) -> None:
    """Before: a float file for an int64 buffer got a Fix that turned every tensor of the file into int64."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    model = Counted()
    weights = {"lin.weight": torch.randn(2, 3), "lin.bias": torch.randn(2), "seen": torch.tensor(7.0)}
    path = tmp_path / ("w.safetensors" if kind == "safetensors" else "w.ckpt")
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(path))
    else:
        torch.save({"state_dict": weights, "epoch": 1}, path)  # a Lightning-style file: the weights under state_dict
    text = refused(
        InitFromError,
        lambda: plan_init_from(model, {"": str(path)}),
        "seen is float32 in the file and int64 in the model",
        "convert only those tensors into a new file, e.g. `python -c",
        "{'seen': torch.int64}",
    )
    assert "for k, v in" not in text  # no longer every tensor of the file
    line = text.split("`python -c ")[1].split("`")[0].strip('"')
    exec(line, {})  # the Fix's one line, as the shell would pass it to python -c
    converted = text.rsplit("init_from=", 1)[1].strip("'")
    plan_init_from(model, {"": converted})  # accepted now
    if kind == "torch":
        out = torch.load(converted, weights_only=True)
    else:
        from safetensors.torch import load_file

        out = load_file(converted)
    assert out["lin.weight"].dtype == torch.float32 and torch.equal(out["lin.weight"], weights["lin.weight"])  # left as it was
    assert out["seen"].dtype == torch.int64 and int(out["seen"]) == 7


# -- 146-148: the command line: stdout for the result, a closed pipe, module entry points ------------------------------
def run_cli(*args: str, **popen: Any) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env.pop("DS_ACCELERATOR", None)  # a CPU machine as a user has it: DeepSpeed then logs which accelerator it picked
    return subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT, **popen)


@needs_deepspeed
def test_146_consolidate_json_keeps_stdout_for_json(tmp_path: Path) -> None:
    """Before: DeepSpeed's "Setting accelerator to CPU" log line came first on stdout, so `--json | jq` failed."""
    source = lightning_dcp(tmp_path / "last.ckpt")
    done = run_cli("consolidate", str(source), str(tmp_path / "w.pt"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["out"] == str(tmp_path / "w.pt")  # the whole of stdout is the one object
    if not torch.cuda.is_available():
        assert "Setting accelerator to CPU" in done.stderr  # the line was printed: on stderr


def test_147_json_into_a_pipe_closed_early(tmp_path: Path) -> None:
    """Before: `autoshard consolidate ... --json | head -c 10` printed two tracebacks (BrokenPipeError, twice)."""
    source = lightning_dcp(tmp_path / "last.ckpt")
    env = child_env(DS_ACCELERATOR="cpu")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command prints
    child = subprocess.run(
        [sys.executable, "-m", "autoshard", "consolidate", str(source), str(tmp_path / "w.pt"), "--json"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    os.close(write)
    assert "Traceback" not in child.stderr and "BrokenPipeError" not in child.stderr, child.stderr
    assert child.returncode == 1
    assert (tmp_path / "w.pt").is_file()  # the work was done; only its report had no reader


def test_148_python_m_on_a_module_that_is_no_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `python -m autoshard.consolidate CKPT OUT` exited 0 having done nothing; `python -m autoshard.convert`
    failed with "No module named autoshard.convert.__main__". Both are refused with the command line that works."""
    source = lightning_dcp(tmp_path / "last.ckpt")
    for module, args in (
        ("autoshard.consolidate", [str(source), str(tmp_path / "w.pt")]),
        ("autoshard.convert", [str(source), str(tmp_path / "hf"), "--to", "safetensors"]),
    ):
        command = module.split(".")[1]
        monkeypatch.setattr(sys, "argv", [module, *args])
        with pytest.raises(SystemExit) as info:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"`python -m {module}` is not a command: that module holds what `autoshard {command}` runs, so nothing was done." in err
        fix = err.rstrip().rsplit("Fix: python -m ", 1)[1].split(" (or:")[0]
        assert fix == f"autoshard {command} {' '.join(args)}"
        assert main(fix.split()[1:]) == 0  # the Fix, run
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", [module, *args, "--json"])
        with pytest.raises(SystemExit) as info:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        assert info.value.code == 1 and json.loads(capsys.readouterr().out)["error"]["type"] == "UsageError"
    assert (tmp_path / "w.pt").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


# -- 149: file modes ----------------------------------------------------------------------------------------------------
def test_149_convert_to_safetensors_honours_the_umask(tmp_path: Path) -> None:
    """Before: model.safetensors was 0600 (safetensors' save_file), every other output 0644."""
    source = lightning_dcp(tmp_path / "last.ckpt")
    previous = os.umask(0o022)
    try:
        convert(source, tmp_path / "hf", "safetensors")
        os.umask(0o027)
        convert(source, tmp_path / "hf-group", "safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "hf" / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "hf" / "autoshard-manifest.json").stat().st_mode) == 0o644  # as every other output
    assert stat.S_IMODE((tmp_path / "hf-group" / "model.safetensors").stat().st_mode) == 0o640
    with pytest.raises(ConvertError):  # and an existing output is still refused (the mode change is no new write path)
        convert(source, tmp_path / "hf", "safetensors")
