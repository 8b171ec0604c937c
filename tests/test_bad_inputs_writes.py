"""The bad-input catalog, checkpoint writes (docs/bad-inputs.md rows 34-49): nothing a write replaces was not written
by autoshard, concurrent writers take turns, a destination nothing can be written to is refused before a large
source is read, AsyncCheckpointIO saves complete files, autoshard-deepspeed checkpoints are checked like fsdp2 ones,
and rank 0's error keeps its type on every rank.

Real writers throughout: the CLI, consolidate and convert in this process, two real processes (forks) for the
concurrent writers, Lightning Trainers on CPU (fsdp2 and a DeepSpeed ZeRO-3 engine, devices=1), and 2 gloo ranks for
row 47.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autoshard  # noqa: E402, F401  registers the strategies
from autoshard.checkpoint.publish import MANIFEST, aside_path, sidecar_path, staging_path
from autoshard.checkpoint.resume import check_integrity
from autoshard.checkpoint.trust import CheckpointFormatError  # noqa: E402
from autoshard.cli import main  # noqa: E402
from autoshard.consolidate import consolidate  # noqa: E402
from autoshard.convert import ConvertError, ConvertOptions, convert  # noqa: E402
from autoshard.lightning import FSDP2Strategy  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:autoshard.*has no manifest"),  # the hand-made DCP sources have none
]
from autoshard._harness import child_env  # noqa: E402
from tests.test_bad_inputs import isolated_process_state  # noqa: E402, F401  (an autouse fixture)

FORK = multiprocessing.get_context("fork")
QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def refused(error: type[Exception], run: Any, *expected: str) -> str:
    """Run, expect ``error``, check every expected fragment is in the message and that it ends with a Fix."""
    with pytest.raises(error) as info:
        run()
    text = str(info.value)
    for fragment in expected:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    assert "Fix: " in text.rpartition(". ")[2] or "Fix: " in text, text
    return text


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) with its bytes: what "nothing was touched" compares."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def lightning_dcp(path: Path, features: int = 8) -> Path:
    """A Lightning-layout DCP checkpoint (torch.distributed.checkpoint in this process; trainer state in meta.pt)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, 2))
    dcp.save({"state_dict": net.state_dict()}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    torch.save({"global_step": 2, "epoch": 0}, path / "meta.pt")
    return path


class Net(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.body(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # a state to save (an empty one trips Lightning)


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


# -- 34-38: convert --force replaces only its own output of the same kind ---------------------------------------------
def test_34_convert_force_into_the_directory_holding_the_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `autoshard convert v/last.ckpt v --to dcp --force` emptied v/: the source, a sibling and notes."""
    v = tmp_path / "v"
    v.mkdir()
    lightning_dcp(v / "last.ckpt")
    lightning_dcp(v / "epoch=0-step=2.ckpt")
    (v / "notes.txt").write_text("keep me")
    before = tree(v)
    for force in ([], ["--force"]):
        assert main(["convert", str(v / "last.ckpt"), str(v), "--to", "dcp", *force]) == 1
        err = capsys.readouterr().err
        assert f"refusing to write {str(v)!r}: it holds the checkpoint being converted ({str(v / 'last.ckpt')!r})" in err
        assert "so even --force never does" in err
        assert err.rstrip().endswith(f"Fix: choose a new output path outside it, e.g. {str(tmp_path / 'v-dcp')!r}")  # beside v, not in it
    assert tree(v) == before and sorted(p.name for p in tmp_path.iterdir()) == ["v"]


def test_35_convert_into_a_project_directory(tmp_path: Path) -> None:
    """Before: the same call with DST = a project folder deleted its src/ and README."""
    source = lightning_dcp(tmp_path / "run" / "last.ckpt")
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('mine')")
    (project / "README.md").write_text("# mine")
    before = tree(project)
    text = refused(
        ConvertError,
        lambda: convert(source, project, "safetensors"),
        f"refusing to overwrite {str(project)!r}: it already exists (a directory holding README.md, src",
        "autoshard did not write it (no autoshard-manifest.json in it)",
    )
    assert "--force" in text and not text.rstrip().endswith("to replace it")  # the fix is not --force: refused too
    refused(ConvertError, lambda: convert(source, project, "safetensors", ConvertOptions(force=True)), "even with --force")
    assert tree(project) == before
    done = convert(source, tmp_path / "weights", "safetensors")  # works instead: a new path
    assert (done.out_path / "model.safetensors").is_file()


def test_36_convert_into_a_directory_inside_the_source(tmp_path: Path) -> None:
    source = lightning_dcp(tmp_path / "last.ckpt")
    before = tree(source)
    refused(
        ConvertError,
        lambda: convert(source, source / "hf", "safetensors"),
        f"it is inside the checkpoint being converted ({str(source)!r})",
        f"Fix: choose a new output path outside it, e.g. {str(source) + '-safetensors'!r}",
    )
    assert tree(source) == before


def test_37_convert_force_over_an_output_of_another_kind(tmp_path: Path) -> None:
    source = lightning_dcp(tmp_path / "last.ckpt")
    out = tmp_path / "out"
    convert(source, out, "safetensors")
    before = tree(out)
    refused(
        ConvertError,
        lambda: convert(source, out, "deepspeed", ConvertOptions(force=True, world_size=1, precision="32-true")),
        "even with --force",
        "it was written by 'autoshard convert --to safetensors', not by 'autoshard convert --to deepspeed'",
    )
    assert tree(out) == before
    convert(source, out, "safetensors", ConvertOptions(force=True))  # works: the same kind
    assert json.loads((out / MANIFEST).read_text())["kind"] == "autoshard convert --to safetensors"


def test_38_convert_force_over_its_own_output_holding_a_file_of_yours(tmp_path: Path) -> None:
    source = lightning_dcp(tmp_path / "last.ckpt")
    out = tmp_path / "hf"
    convert(source, out, "safetensors")
    (out / "config.json").write_text("{}")  # the user completed the Hugging Face directory
    refused(
        ConvertError,
        lambda: convert(source, out, "safetensors", ConvertOptions(force=True)),
        "it also holds config.json, which its autoshard-manifest.json does not list",
    )
    assert (out / "config.json").read_text() == "{}"


# -- 39-40: consolidate --force replaces only a file consolidate wrote ------------------------------------------------
def test_39_consolidate_force_over_a_file_it_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = lightning_dcp(tmp_path / "last.ckpt")
    lightning_file = tmp_path / "model.ckpt"  # a Lightning checkpoint (trainer state, optimizer): not weights
    torch.save({"state_dict": {}, "global_step": 7, "optimizer_states": []}, lightning_file)
    before = lightning_file.read_bytes()
    assert main(["consolidate", str(source), str(lightning_file), "--force"]) == 1
    err = capsys.readouterr().err
    assert f"refusing to overwrite {str(lightning_file)!r} even with --force: it already exists (a single torch.save file)" in err
    assert "autoshard did not write it (no model.ckpt.autoshard-manifest.json beside it): --force replaces only a file consolidate wrote" in err
    assert err.rstrip().endswith(f"Fix: choose another output path, or move {str(lightning_file)!r} away first")
    assert lightning_file.read_bytes() == before
    weights = tmp_path / "weights.pt"  # works: consolidate's own output, recognised by the manifest it writes beside it
    assert main(["consolidate", str(source), str(weights)]) == main(["consolidate", str(source), str(weights), "--force"]) == 0
    assert json.loads(sidecar_path(weights).read_text())["kind"] == "autoshard consolidate" and check_integrity(weights)


def test_40_consolidate_into_the_checkpoint_directory(tmp_path: Path) -> None:
    """DeepSpeed's zero_to_fp32.py habit: the output inside the checkpoint, which the next save replaces whole."""
    source = lightning_dcp(tmp_path / "last.ckpt")
    before = tree(source)
    refused(
        CheckpointFormatError,
        lambda: consolidate(source, source / "pytorch_model.bin"),
        "it is inside the checkpoint being consolidated",
        f"Fix: choose an output path outside it, e.g. {str(tmp_path / 'weights.pt')!r}",
    )
    assert tree(source) == before


# -- 41-42: a destination nothing can be written to, refused before the source is read ----------------------------------
@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing can be created in: permissions for a user, a read-only mount for root (whom permissions
    do not stop)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"root without mount rights: no read-only directory to test with ({mounted.stderr.strip()})")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def corrupted_source(tmp_path: Path) -> Path:
    """A checkpoint whose reading fails loudly (a changed shard): a refusal that names the destination instead proves
    the destination was checked first, before anything was read."""
    from autoshard.checkpoint.publish import describe_files, write_manifest

    source = lightning_dcp(tmp_path / "last.ckpt")
    write_manifest(source / MANIFEST, describe_files(source, [p.name for p in source.iterdir()]))
    shard = next(source.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    return source


def test_41_read_only_destination(tmp_path: Path, read_only_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a traceback (PermissionError / OSError: Read-only file system) after the whole source was read."""
    source = corrupted_source(tmp_path)
    for command in (
        ["consolidate", str(source), str(read_only_dir / "weights.pt")],
        ["convert", str(source), str(read_only_dir / "hf"), "--to", "safetensors"],
    ):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert f"the directory {str(read_only_dir)!r} is not writable (" in err and "refused before reading the checkpoint" in err
        assert "is corrupted" not in err and "Traceback" not in err
        assert err.rstrip().endswith(f"or make {str(read_only_dir)!r} writable")


def test_42_destination_under_a_file(tmp_path: Path) -> None:
    source = corrupted_source(tmp_path)
    (tmp_path / "results").write_text("a file, not a directory")
    refused(
        CheckpointFormatError,
        lambda: consolidate(source, tmp_path / "results" / "weights.pt"),
        f"{str(tmp_path / 'results')!r} is a file, not a directory",
        "refused before reading the checkpoint",
    )
    refused(
        ConvertError,
        lambda: convert(source, tmp_path / "results" / "sub" / "hf", "safetensors"),
        f"{str(tmp_path / 'results')!r} is a file, not a directory, so {str(tmp_path / 'results' / 'sub')!r} cannot be created",
    )


# -- 43-44: two writers, one destination: they take turns -------------------------------------------------------------
def _consolidate_at(barrier: Any, queue: Any, source: str, out: str, force: bool) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the OpenMP pool its parent started (it hangs)
    try:
        barrier.wait(60)
        consolidate(source, out, force=force)
        queue.put(("ok", ""))
    except Exception as exc:
        barrier.abort()
        queue.put((type(exc).__name__, str(exc)))


def run_together(target: Any, *args: Any, n: int = 2, timeout: float = 120, context: Any = FORK) -> list[tuple[str, str]]:
    """``target(barrier, queue, *args)`` in ``n`` processes released at once; their results."""
    barrier, queue = context.Barrier(n), context.Queue()
    procs = [context.Process(target=target, args=(barrier, queue, *args)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, p.exitcode
    return sorted(results)


def test_43_two_consolidates_to_one_output_at_once(tmp_path: Path) -> None:
    """Before: one fixed staging name; the second writer deleted the first one's staging, and one published the
    other's partial file (then failed with FileNotFoundError). The source is a full file: DCP's reader does not
    survive a fork of a process that used it, and the writes are what is tested."""
    torch.manual_seed(0)
    source = tmp_path / "last.ckpt"  # 8 MiB of weights: the two writes overlap
    torch.save({"state_dict": {f"layer{i}.weight": torch.randn(512, 512) for i in range(8)}, "global_step": 2}, source)
    expected = consolidate(source, tmp_path / "reference.pt")
    reference = torch.load(expected.out_path, weights_only=True)
    out = tmp_path / "weights.pt"
    for round_ in range(3):
        assert run_together(_consolidate_at, str(source), str(out), True) == [("ok", ""), ("ok", "")], round_
        loaded = torch.load(out, weights_only=True)
        assert set(loaded) == set(reference) and all(torch.equal(loaded[k], v) for k, v in reference.items())
        assert check_integrity(out)
    out.unlink()
    sidecar_path(out).unlink()
    (first, text), (second, _) = run_together(_consolidate_at, str(source), str(out), False)  # the second one waits
    assert (first, second) == ("CheckpointFormatError", "ok") and "refusing to overwrite" in text, text
    assert text.endswith("Fix: choose another output path, or pass --force (force=True) to replace it")
    assert check_integrity(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt",
        "reference.pt",
        "reference.pt.autoshard-manifest.json",
        "weights.pt",
        "weights.pt.autoshard-manifest.json",
    ]


def test_44_two_processes_save_one_full_checkpoint_at_once(tmp_path: Path) -> None:
    """Two training jobs (or two ModelCheckpoints) saving the same path: before, each removed the other's staging
    and one could publish the other's partial file. Now the second waits for the first and both files are whole."""
    from tests.distributed.publish_worker import save_at

    path = tmp_path / "last.ckpt"  # two different models (seeded by their ports), 8 MiB files
    results = run_together(save_at, str(path), 1024, context=multiprocessing.get_context("spawn"))
    assert [r[0] for r in results] == ["ok", "ok"], results
    assert check_integrity(path)  # the whole file of one of them, and its own manifest
    saved = torch.load(path, weights_only=False)
    assert str(float(saved["state_dict"]["body.0.weight"].sum())) in {r[1] for r in results}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.autoshard-manifest.json"]


# -- 45: AsyncCheckpointIO ---------------------------------------------------------------------------------------------
def test_45_async_checkpoint_io_saves_a_complete_file(tmp_path: Path) -> None:
    """Before: AsyncCheckpointIO returned before writing, and the save hashed and renamed a file not yet there
    (FileNotFoundError), or a partial one. Now the write completes first: the file is whole and its manifest matches."""
    import time

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    class SlowDisk(TorchCheckpointIO):
        """A network filesystem: the write takes a while."""

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            time.sleep(0.3)
            super().save_checkpoint(checkpoint, path, storage_options)

    model = Net()
    trainer = pl.Trainer(strategy=FSDP2Strategy(checkpoint="full"), plugins=[AsyncCheckpointIO(SlowDisk())], max_steps=1, **QUIET)
    trainer.fit(model, data())
    path = tmp_path / "model.ckpt"
    with pytest.warns(UserWarning, match="AsyncCheckpointIO: the crash-safe full-file save .* writes through the wrapped CheckpointIO"):
        trainer.save_checkpoint(path)
    assert check_integrity(path) and torch.load(path, weights_only=False)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "model.ckpt.autoshard-manifest.json"]
    resumed = Net()
    pl.Trainer(strategy=FSDP2Strategy(checkpoint="full"), max_steps=2, **QUIET).fit(resumed, data(), ckpt_path=path)
    assert resumed.steps == 1  # resumed at step 1, trained the one step left


# -- 46, 48: autoshard-deepspeed checkpoints carry and check the manifest -------------------------------------------
@pytest.fixture(scope="module")
def deepspeed_round(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real DeepSpeed ZeRO-3 engine on CPU under autoshard-deepspeed, in its own process (~10 s): it saves, then
    resumes a copy with one flipped byte and the intact checkpoint. Paths and outcomes, as JSON."""
    pytest.importorskip("deepspeed")
    import sys

    work = tmp_path_factory.mktemp("ds")
    (work / "ckpt").mkdir()
    worker = Path(__file__).parent / "distributed" / "publish_worker.py"
    env = child_env(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run([sys.executable, str(worker), "--deepspeed", str(work)], env=env, cwd=work, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return {**json.loads((work / "result.json").read_text()), "saved": work / "ckpt" / "last.ckpt"}


@pytest.mark.deepspeed
@pytest.mark.timeout(200)
def test_46_a_flipped_byte_in_an_autoshard_deepspeed_checkpoint(deepspeed_round: dict[str, Any]) -> None:
    """Before: autoshard-deepspeed saves had no manifest; a flipped byte changed exp_avg silently."""
    manifest = deepspeed_round["manifest"]
    assert manifest["kind"] == "autoshard save" and "latest" in manifest["files"]
    assert any(name.startswith("checkpoint/") and "optim_states" in name for name in manifest["files"])
    assert deepspeed_round["save_warnings"] == [] and deepspeed_round["listing"] == ["bad", "last.ckpt"]  # no staging, no lock
    bad, flipped = deepspeed_round["bad"], deepspeed_round["flipped"]
    assert bad["type"] == "CheckpointFormatError" and bad["steps"] == 0, bad  # refused before DeepSpeed read it
    assert f"is corrupted: {flipped!r} has sha256" in bad["message"] and f"where {MANIFEST} records" in bad["message"]
    assert bad["message"].endswith("Fix: restore the checkpoint from a backup, or use the previous checkpoint")
    assert deepspeed_round["good"] == {"steps": 1, "global_step": 2}  # works: the intact one, checked, then resumed


def flipped_copy(source: Path, where: Path) -> tuple[Path, Path]:
    """A copy of the checkpoint with one byte of a DeepSpeed partition changed (same size: only a checksum sees it)."""
    shutil.copytree(source, where)
    shard = sorted(where.glob("checkpoint/*optim_states.pt"))[0]
    data_ = bytearray(shard.read_bytes())
    data_[len(data_) // 2] ^= 0x40
    shard.write_bytes(bytes(data_))
    return where, shard


@pytest.mark.deepspeed
@pytest.mark.timeout(200)
def test_64_resume_of_a_deepspeed_checkpoint_whose_pickle_runs_code(deepspeed_round: dict[str, Any]) -> None:
    """Before: DeepSpeed's engine reads its files with torch.load(weights_only=False), so resuming ran the command.
    (A read-side row, tested here beside the DeepSpeed round it shares.)"""
    evil = deepspeed_round["evil"]
    assert evil["ran"] is False and evil["steps"] == 0, evil
    assert evil["type"] == "UntrustedPickleError", evil
    assert "cannot resume" in evil["message"] and "`posix.system`" in evil["message"], evil["message"]
    assert evil["message"].rpartition("Fix: ")[2].startswith("if you trust who wrote it (your own run), resume with trainer.fit(model, ckpt_path=")
    assert "weights_only=False" in evil["message"]


@pytest.mark.deepspeed
@pytest.mark.timeout(200)
def test_48_consolidate_and_convert_check_an_autoshard_deepspeed_checkpoint(deepspeed_round: dict[str, Any], tmp_path: Path) -> None:
    bad, shard = flipped_copy(deepspeed_round["saved"], tmp_path / "bad.ckpt")
    refused(CheckpointFormatError, lambda: consolidate(bad, tmp_path / "w.pt"), f"{str(shard)!r} has sha256")
    refused(CheckpointFormatError, lambda: convert(bad, tmp_path / "dcp", "dcp"), f"{str(shard)!r} has sha256")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.ckpt"]
    with warnings.catch_warnings(record=True) as caught:  # before: "has no manifest" on every autoshard-deepspeed save
        warnings.simplefilter("always")
        consolidate(deepspeed_round["saved"], tmp_path / "w.pt")
    assert not [str(w.message) for w in caught if "no manifest" in str(w.message)]


# -- 47: rank 0's error on every rank ------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_47_rank0_error_keeps_its_type_on_every_rank(tmp_path: Path) -> None:
    """Before: rank 1 raised RuntimeError("rank 0 failed while checkpointing: FileExistsError: ...") and lost rank
    0's traceback. Now every rank raises rank 0's type, with rank 0's traceback as the cause."""
    from tests.distributed.harness import run_workers

    worker = Path(__file__).parent / "distributed" / "publish_worker.py"
    ranks = [r["rank0_failure"] for r in run_workers(worker, ["--scenarios", "rank0_failure"], tmp_path, 2, 150)]
    assert ranks[0]["type"] == ranks[1]["type"] == "autoshard.checkpoint.publish.CheckpointWriteError", ranks  # row 142: was FileExistsError
    assert ranks[0]["message"] == ranks[1]["message"] and "not-a-directory' is a file, not a directory" in ranks[1]["message"]
    assert ranks[1]["cause_type"] == "RankZeroTraceback"
    assert ranks[1]["cause"].startswith("rank 0's traceback (re-raised on rank 1):\nTraceback") and "acquire" in ranks[1]["cause"]


# -- 49: a save killed between its two renames, under a name of its own ---------------------------------------------------
def test_49_a_save_killed_between_its_renames_still_resumes(tmp_path: Path) -> None:
    """Staging names are unique to each writer now; the complete checkpoint a killed save left is still found."""
    trainer = pl.Trainer(strategy="fsdp2", max_steps=1, **QUIET)
    trainer.fit(Net(), data())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    os.rename(path, aside_path(path))  # the previous checkpoint, moved aside
    trainer.save_checkpoint(tmp_path / "new.ckpt")
    os.rename(tmp_path / "new.ckpt", staging_path(path, "4242-0badcafe"))  # the new one, complete, killed before its rename
    resumed = Net()
    with pytest.warns(UserWarning, match=r"a save to it was interrupted and left the complete checkpoint .*autoshard-tmp\.4242-0badcafe"):
        pl.Trainer(strategy="fsdp2", max_steps=2, **QUIET).fit(resumed, data(), ckpt_path=path)
    assert resumed.steps == 1
    trainer.save_checkpoint(path)  # the next save puts the complete one back first, then clears the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_130_a_lock_file_that_cannot_be_opened(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A lock file another user's crashed writer left (here: a directory in its place, as root reads any file) used
    to end the save in a raw OSError; it is refused naming the lock file, and nothing is written."""
    from autoshard.checkpoint.publish import CheckpointWriteError, Publisher, lock_path

    source = lightning_dcp(tmp_path / "last.ckpt")
    weights = tmp_path / "weights.pt"
    lock_path(weights).mkdir()
    assert main(["consolidate", str(source), str(weights)]) == 1
    err = capsys.readouterr().err
    assert f"cannot open {str(lock_path(weights))!r}" in err and "(EISDIR: Is a directory)" in err, err
    assert err.rstrip().endswith(
        f"Fix: if no process is writing {str(weights)!r}, remove the lock file (a crashed writer left it), or write to another path"
    )
    assert not weights.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", lock_path(weights).name])
    with pytest.raises(CheckpointWriteError, match="the lock file that keeps two writers of"):
        Publisher(weights).acquire()
