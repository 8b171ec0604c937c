"""Checkpoint formats in one process: detection, the crash states a swap can leave, commit, consolidation.

The DCP directories here are real ones (torch.distributed.checkpoint.save in this process, the Lightning layout:
model under "state_dict", optimizer under "optimizer_0", trainer state in meta.pt); the DeepSpeed one is written by
a real ZeRO-3 engine in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.checkpoint import (
    CheckpointFormatError,
    Format,
    aside_path,
    check_replaceable,
    cmd_consolidate,
    commit,
    consolidate,
    detect_format,
    finish_interrupted_commit,
    prepare_staging,
    register_cli,
    resolve_for_load,
    staging_path,
)


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def write_lightning_dcp(path: Path, net: nn.Module, step: int = 3, with_meta: bool = True) -> None:
    """What ModelParallelStrategy writes: DCP shards + .metadata, then meta.pt with the trainer state."""
    import torch.distributed.checkpoint as dcp

    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"state_dict": net.state_dict(), "optimizer_0": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=str(path))
    if with_meta:
        torch.save({"global_step": step, "epoch": 0}, path / "meta.pt")


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    path = tmp_path / "epoch=0-step=3.ckpt"
    write_lightning_dcp(path, model())
    return path


# -- detection ----------------------------------------------------------------------------------------------------
def test_detects_every_format(tmp_path: Path, dcp_dir: Path) -> None:
    assert detect_format(dcp_dir).format is Format.DCP
    raw = tmp_path / "raw"
    write_lightning_dcp(raw, model(), with_meta=False)
    assert detect_format(raw).format is Format.DCP_RAW
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": model().state_dict()}, full)
    assert detect_format(full).format is Format.FULL
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert detect_format(partial).format is Format.INCOMPLETE
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    assert detect_format(junk).format is Format.UNKNOWN
    (tmp_path / "empty").write_bytes(b"")
    assert "an empty file" in detect_format(tmp_path / "empty").detail
    assert detect_format(tmp_path / "nope").format is Format.MISSING
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert "symlink" in detect_format(tmp_path / "dangling").detail
    deepspeed_like = tmp_path / "ds"
    (deepspeed_like / "global_step5").mkdir(parents=True)
    (deepspeed_like / "latest").write_text("global_step5")
    info = detect_format(deepspeed_like)
    assert info.format is Format.DEEPSPEED and info.tag == "global_step5"


def test_torn_shards_under_an_intact_looking_metadata_are_incomplete(dcp_dir: Path) -> None:
    """Stock Lightning overwrites last.ckpt in place: killed midway, the old .metadata and meta.pt stay next to
    truncated shards (seen: 11,858 of 439,788 bytes), and DCP's load dies with EOFError. Detected from .metadata alone."""
    shard = dcp_dir / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    info = detect_format(dcp_dir)
    assert info.format is Format.INCOMPLETE and "shard __0_0.distcp holds 100 bytes where .metadata expects" in info.detail
    with pytest.raises(CheckpointFormatError, match="a save overwrote it in place and was interrupted"):
        resolve_for_load(dcp_dir)


# -- the states an interrupted save can leave -----------------------------------------------------------------------
def test_staging_names_are_hidden_and_never_match_last_ckpt(tmp_path: Path) -> None:
    """ModelCheckpoint's ckpt_path='last' search takes names ending in .ckpt that start with 'last'."""
    for sibling in (staging_path(tmp_path / "last.ckpt"), aside_path(tmp_path / "last.ckpt")):
        assert sibling.parent == tmp_path and sibling.name.startswith(".last.ckpt.") and sibling.suffix != ".ckpt"


def test_crash_between_the_two_renames_loads_the_new_complete_checkpoint(tmp_path: Path, dcp_dir: Path) -> None:
    target = tmp_path / "last.ckpt"
    dcp_dir.rename(aside_path(target))  # the old one, moved aside
    write_lightning_dcp(staging_path(target), model(), step=9)  # the new one, complete, not yet renamed in
    with pytest.warns(UserWarning, match="a save to it was interrupted"):
        assert resolve_for_load(target) == staging_path(target)
    # The next save first finishes the swap, so nothing complete is lost when it clears its staging.
    assert finish_interrupted_commit(target) == staging_path(target)
    assert torch.load(target / "meta.pt")["global_step"] == 9
    assert prepare_staging(target) == staging_path(target) and not aside_path(target).exists()


def test_crash_while_writing_keeps_the_old_checkpoint(tmp_path: Path, dcp_dir: Path) -> None:
    target = tmp_path / "last.ckpt"
    dcp_dir.rename(target)
    staged = staging_path(target)
    write_lightning_dcp(staged, model(), with_meta=False)  # every rank wrote, rank 0 died before meta.pt
    assert resolve_for_load(target) == target  # the uncommitted save is ignored
    assert torch.load(target / "meta.pt")["global_step"] == 3


def test_aside_copy_is_used_when_the_new_one_is_incomplete(tmp_path: Path, dcp_dir: Path) -> None:
    target = tmp_path / "last.ckpt"
    dcp_dir.rename(aside_path(target))
    staging_path(target).mkdir()
    (staging_path(target) / "__0_0.distcp").write_bytes(b"partial")
    with pytest.warns(UserWarning):
        assert resolve_for_load(target) == aside_path(target)


def test_a_torn_staging_file_is_never_loaded(tmp_path: Path) -> None:
    target = tmp_path / "model.ckpt"
    staging_path(target).write_bytes(b"PK\x03\x04 torn in the middle")
    with pytest.raises(CheckpointFormatError, match="nothing exists at this path .the first save to it was interrupted"):
        resolve_for_load(target)


# -- commit -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old_kind,new_kind", [("dir", "dir"), ("file", "file"), ("file", "dir"), ("dir", "file"), (None, "dir")])
def test_commit_replaces_whole_and_leaves_nothing_behind(tmp_path: Path, old_kind: str | None, new_kind: str) -> None:
    target = tmp_path / "x.ckpt"

    def make(path: Path, kind: str, step: int) -> None:
        if kind == "dir":
            write_lightning_dcp(path, model(), step=step)
        else:
            torch.save({"state_dict": {}, "global_step": step}, path)

    if old_kind:
        make(target, old_kind, 1)
    staged = prepare_staging(target)
    make(staged, new_kind, 2)
    commit(staged, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]
    step = torch.load(target / "meta.pt" if new_kind == "dir" else target)["global_step"]
    assert step == 2


def test_commit_over_a_symlink_leaves_its_target_alone(tmp_path: Path, dcp_dir: Path) -> None:
    link = tmp_path / "last.ckpt"
    os.symlink(dcp_dir.name, link)
    staged = prepare_staging(link)
    write_lightning_dcp(staged, model(), step=7)
    commit(staged, link)
    assert not link.is_symlink() and torch.load(link / "meta.pt")["global_step"] == 7
    assert torch.load(dcp_dir / "meta.pt")["global_step"] == 3


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "results.csv").write_text("a,b")
    with pytest.raises(CheckpointFormatError, match="refusing to save over .* a save replaces it whole"):
        check_replaceable(outputs)
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")


# -- refusals on load -----------------------------------------------------------------------------------------------
def test_parent_directory_of_checkpoints_names_them(tmp_path: Path, dcp_dir: Path) -> None:
    with pytest.raises(CheckpointFormatError) as info:
        resolve_for_load(tmp_path)
    assert "is not a checkpoint" in str(info.value) and "pass one of them" in str(info.value)
    assert dcp_dir.name in str(info.value)


def test_bare_weights_file_is_not_a_resumable_checkpoint(tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    torch.save(model().state_dict(), weights)
    with pytest.raises(CheckpointFormatError, match=r"weights only.*model.load_state_dict\(torch.load"):
        resolve_for_load(weights)


def test_dcp_without_trainer_state_points_to_consolidate(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_lightning_dcp(raw, model(), with_meta=False)
    with pytest.raises(CheckpointFormatError, match="no Lightning trainer state.*autoshard consolidate"):
        resolve_for_load(raw)


# -- consolidation ------------------------------------------------------------------------------------------------
def test_consolidate_dcp_into_plain_state_dict(tmp_path: Path, dcp_dir: Path) -> None:
    out = consolidate(dcp_dir, tmp_path / "w" / "weights.pt")
    assert out.format is Format.DCP and out.key == "state_dict" and out.tensors == 4
    weights = torch.load(out.out_path, weights_only=True)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    fresh.load_state_dict(weights, strict=True)
    import torch.distributed.checkpoint as dcp

    expected = {"state_dict": {k: torch.empty_like(v) for k, v in model().state_dict().items()}}
    dcp.load(expected, checkpoint_id=str(dcp_dir))
    assert all(torch.equal(weights[k], v) for k, v in expected["state_dict"].items())
    assert not staging_path(out.out_path).exists()


def test_consolidate_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="nothing exists"):
        consolidate(tmp_path / "missing", tmp_path / "o.pt")
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": model().state_dict()}, full)
    (tmp_path / "outdir").mkdir()
    with pytest.raises(CheckpointFormatError, match="it is a directory"):
        consolidate(full, tmp_path / "outdir")


def test_register_cli_adds_consolidate(tmp_path: Path, dcp_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="autoshard")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["consolidate", str(dcp_dir), str(tmp_path / "o.pt")])
    assert args.func is cmd_consolidate and args.tag is None
    assert args.func(args) == 0
    assert "consolidated distributed checkpoint" in capsys.readouterr().out


# -- DeepSpeed: a real ZeRO-3 checkpoint, converted through DeepSpeed's own zero_to_fp32 ----------------------------
DEEPSPEED_WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", OMP_NUM_THREADS="1")
    import torch, deepspeed
    from torch import nn
    class Wrapper(nn.Module):  # Lightning's _LightningModuleWrapperBase: keys get '_forward_module.'
        def __init__(self, inner):
            super().__init__()
            self._forward_module = inner
        def forward(self, x):
            return self._forward_module(x)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=Wrapper(net), optimizer=torch.optim.AdamW(net.parameters(), lr=0.1),
                                      config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(sys.argv[1], tag="checkpoint")
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        torch.save({k: p.detach().clone() for k, p in engine.module._forward_module.named_parameters()}, sys.argv[1] + ".ref")
    """
)


def make_deepspeed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ZeRO-3 checkpoint from one CPU process (~10 s), written once per session and shared by test modules."""
    pytest.importorskip("deepspeed")
    from tests.distributed.harness import free_port

    path = tmp_path_factory.getbasetemp() / "deepspeed-zero3" / "epoch=0-step=2.ckpt"
    if not Path(str(path) + ".ref").exists():
        done = subprocess.run(
            [sys.executable, "-c", DEEPSPEED_WRITER, str(path), str(free_port())], capture_output=True, text=True, timeout=150
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return path


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_deepspeed_checkpoint(tmp_path_factory)


@pytest.mark.deepspeed
@pytest.mark.timeout(200)
def test_deepspeed_checkpoint_is_detected_and_consolidated(deepspeed_checkpoint: Path, tmp_path: Path) -> None:
    info = detect_format(deepspeed_checkpoint)
    assert info.format is Format.DEEPSPEED and info.tag == "checkpoint"
    out = consolidate(deepspeed_checkpoint, tmp_path / "weights.pt")
    assert out.format is Format.DEEPSPEED
    weights = torch.load(out.out_path, weights_only=True)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    fresh.load_state_dict(weights, strict=True)  # '_forward_module.' removed
    reference = torch.load(str(deepspeed_checkpoint) + ".ref", weights_only=True)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor.float()), name


@pytest.mark.deepspeed
@pytest.mark.timeout(200)
def test_deepspeed_checkpoint_refused_by_fsdp2_with_conversion(deepspeed_checkpoint: Path) -> None:
    with pytest.raises(CheckpointFormatError) as info:
        resolve_for_load(deepspeed_checkpoint, "fsdp2")
    text = str(info.value)
    assert "a DeepSpeed ZeRO checkpoint (tag 'checkpoint')" in text and "strategy='autoshard-deepspeed'" in text
    assert f"autoshard consolidate {deepspeed_checkpoint} weights.pt" in text
