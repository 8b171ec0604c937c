"""Checkpoint formats in one process: detection, the crash states a swap can leave, commit, the manifest and what it
catches, consolidation (which never replaces an existing output unless forced).

The DCP directories here are real ones (torch.distributed.checkpoint.save in this process, the Lightning layout:
model under "state_dict", optimizer under "optimizer_0", trainer state in meta.pt); the DeepSpeed one is written by
a real ZeRO-3 engine in a subprocess.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.capability import Format
from autoshard.checkpoint.formats import detect_format
from autoshard.checkpoint.publish import aside_path, commit, describe_files, integrity_problems, stage_sidecar, staging_path, write_manifest
from autoshard.checkpoint.resume import check_integrity, finish_interrupted_commit, load_failure, resolve_for_load
from autoshard.checkpoint.saves import check_replaceable, prepare_staging
from autoshard.checkpoint.trust import CheckpointFormatError
from autoshard.cli import main
from autoshard.consolidate import cmd_consolidate, consolidate, register_cli

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:autoshard.*has no manifest"),  # the Lightning-layout fixtures have none
]


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


def as_autoshard_save(path: Path) -> Path:
    """The manifest autoshard's own save writes with a checkpoint (kind "autoshard save"): a save replaces only such a
    checkpoint (docs/bad-inputs.md row 141), so a hand-made one standing for an earlier save needs it."""
    from autoshard.checkpoint.publish import KIND_SAVE, MANIFEST, describe_files, sidecar_path, write_manifest

    if path.is_dir():
        write_manifest(path / MANIFEST, describe_files(path, [p.name for p in path.iterdir() if p.is_file()]), KIND_SAVE)
    else:
        write_manifest(sidecar_path(path), describe_files(path.parent, [path.name]), KIND_SAVE)
    return path


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
    as_autoshard_save(staging_path(target))
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
        as_autoshard_save(target)  # an earlier save of autoshard's: the only kind a save replaces
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


def test_consolidate_json_is_one_object_on_success_and_on_refusal(tmp_path: Path, dcp_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.pt"
    assert main(["consolidate", str(dcp_dir), str(out), "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["out"] == str(out) and done["format"] == "distributed" and done["tensors"] == len(model().state_dict())
    assert main(["consolidate", str(dcp_dir), str(out), "--json"]) == 1  # OUT exists now: refused, as JSON
    refused = json.loads(capsys.readouterr().out)
    assert refused["command"] == "consolidate" and refused["error"]["type"] == "CheckpointFormatError"
    assert refused["error"]["message"].rstrip().endswith("to replace it")


# -- consolidate never destroys its output ---------------------------------------------------------------------------
def test_consolidate_refuses_an_existing_output_unless_forced(tmp_path: Path, dcp_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 0, and the full Lightning checkpoint at OUT was replaced by weights only."""
    out = tmp_path / "model.ckpt"
    torch.save({"state_dict": model().state_dict(), "global_step": 7, "optimizer_states": []}, out)
    before = out.read_bytes()
    assert main(["consolidate", str(dcp_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"refusing to overwrite {str(out)!r}: it already exists (a single torch.save file)" in err
    assert err.rstrip().endswith(f"Fix: choose another output path, or move {str(out)!r} away first")  # not --force:
    assert main(["consolidate", str(dcp_dir), str(out), "--force"]) == 1  # --force replaces only what consolidate wrote
    assert "even with --force" in capsys.readouterr().err and out.read_bytes() == before
    weights = tmp_path / "weights.pt"
    assert main(["consolidate", str(dcp_dir), str(weights)]) == 0
    assert main(["consolidate", str(dcp_dir), str(weights)]) == 1
    assert capsys.readouterr().err.rstrip().endswith("Fix: choose another output path, or pass --force (force=True) to replace it")
    assert main(["consolidate", str(dcp_dir), str(weights), "--force"]) == 0
    assert set(torch.load(weights, weights_only=True)) == set(model().state_dict())
    expected = [dcp_dir.name, out.name, weights.name, weights.name + ".autoshard-manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)  # no staging, no lock file left


def test_a_failed_forced_write_leaves_the_old_output_whole(tmp_path: Path, dcp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "weights.pt"
    out.write_bytes(b"PK\x03\x04 the previous weights")
    sidecar = tmp_path / "weights.pt.autoshard-manifest.json"  # written by consolidate: --force may replace it
    write_manifest(sidecar, describe_files(tmp_path, [out.name]), "autoshard consolidate")

    def disk_full(obj: object, f: str | os.PathLike[str]) -> None:
        Path(f).write_bytes(b"PK\x03\x04 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        consolidate(dcp_dir, out, force=True)
    assert out.read_bytes() == b"PK\x03\x04 the previous weights" and check_integrity(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dcp_dir.name, out.name, sidecar.name])  # no staging


def test_consolidate_never_writes_over_its_own_source(tmp_path: Path) -> None:
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": model().state_dict(), "global_step": 3}, full)
    with pytest.raises(CheckpointFormatError, match="it is the checkpoint being consolidated. Fix: choose another output path"):
        consolidate(full, full, force=True)
    assert torch.load(full, weights_only=True)["global_step"] == 3


# -- the manifest: every file's size and sha256, checked before anything is read --------------------------------------
MANIFEST = "autoshard-manifest.json"  # on-disk names are a contract: spelled out here
CORRUPTED_FIX = "Fix: restore the checkpoint from a backup, or use the previous checkpoint"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def with_manifest(path: Path) -> Path:
    """What autoshard's save adds: the manifest of every file, inside a directory or beside a file."""
    if path.is_dir():
        write_manifest(path / MANIFEST, describe_files(path, [p.name for p in path.iterdir()]))
    else:
        write_manifest(path.with_name(path.name + ".autoshard-manifest.json"), describe_files(path.parent, [path.name]))
    return path


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_refused_naming_the_file_and_both_checksums(tmp_path: Path, dcp_dir: Path) -> None:
    """Before: exit 0 and a silently changed weight (1.9e26 seen)."""
    with_manifest(dcp_dir)
    shard = dcp_dir / "__0_0.distcp"
    expected = sha256(shard)
    flip_byte(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointFormatError) as info:
        consolidate(dcp_dir, tmp_path / "weights.pt")
    text = str(info.value)
    assert f"{str(dcp_dir)!r} is corrupted: {str(shard)!r} has sha256 {sha256(shard)} where {MANIFEST} records {expected}" in text
    assert "(same size," in text and text.endswith(CORRUPTED_FIX)
    assert not (tmp_path / "weights.pt").exists()


def test_missing_and_truncated_files_are_named(dcp_dir: Path) -> None:
    with_manifest(dcp_dir)
    size = (dcp_dir / "meta.pt").stat().st_size
    (dcp_dir / "meta.pt").write_bytes((dcp_dir / "meta.pt").read_bytes()[:10])
    (dcp_dir / ".metadata").unlink()
    assert sorted(integrity_problems(dcp_dir) or []) == [
        f"{str(dcp_dir / '.metadata')!r} is missing ({MANIFEST} lists it)",
        f"{str(dcp_dir / 'meta.pt')!r} holds 10 bytes where {MANIFEST} records {size:,d}",
    ]


def test_shares_of_the_check_cover_every_file_once(dcp_dir: Path) -> None:
    """Each rank checks every world_size-th file, largest first: together, all of them."""
    with_manifest(dcp_dir)
    flip_byte(dcp_dir / "__0_0.distcp", 200)
    flip_byte(dcp_dir / "meta.pt", 100)
    shares = [integrity_problems(dcp_dir, slice(rank, None, 2)) for rank in range(2)]
    assert sorted(p.split("'")[1].rsplit("/", 1)[1] for share in shares for p in share or []) == ["__0_0.distcp", "meta.pt"]


def test_consolidate_without_a_manifest_warns_once(tmp_path: Path, dcp_dir: Path) -> None:
    """Lightning's own checkpoints and older autoshard ones have no manifest: read, unverified, with one warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consolidate(dcp_dir, tmp_path / "weights.pt")
    assert [str(w.message) for w in caught if "autoshard" in str(w.message)] == [
        f"autoshard: {str(dcp_dir)!r} has no manifest {MANIFEST!r} (written by Lightning itself or an older autoshard):"
        f" its files cannot be checked against the checksums of the save, so a corrupted file would go unnoticed"
    ]


def saved_over(target: Path, step: int) -> Path:
    """A full-file save over a full file with its manifest, up to the commit: both the new file and its manifest staged."""
    torch.save({"state_dict": {}, "global_step": 1}, target)
    with_manifest(target)
    staged = prepare_staging(target)
    torch.save({"state_dict": {}, "global_step": step}, staged)
    stage_sidecar(target)
    return staged


def test_a_full_file_and_its_manifest_are_swapped_in_together(tmp_path: Path) -> None:
    target = tmp_path / "x.ckpt"
    sidecar = tmp_path / "x.ckpt.autoshard-manifest.json"
    commit(saved_over(target, step=2), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name, sidecar.name]
    assert check_integrity(target) and torch.load(target)["global_step"] == 2
    staged = prepare_staging(target)  # a directory replaces the file: the file's manifest goes with it
    write_lightning_dcp(staged, model())
    commit(staged, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_full_file_manifest_survives_a_crash_between_its_two_renames(tmp_path: Path) -> None:
    """Killed after the file's rename, before its manifest's: the new file sits beside the old manifest, and the
    staged one (no staged file left) is the one describing it. The next save puts it in place first."""
    target = tmp_path / "model.ckpt"
    sidecar = tmp_path / "model.ckpt.autoshard-manifest.json"
    os.replace(saved_over(target, step=22), target)  # commit's first rename; killed here
    assert torch.load(target)["global_step"] == 22 and check_integrity(target)
    finish_interrupted_commit(target)
    assert not staging_path(sidecar).exists() and check_integrity(target)
    torch.save({"state_dict": {}, "global_step": 333}, target)  # replaced by hand, the manifest left stale
    with pytest.raises(CheckpointFormatError, match=f"{target.name}'? holds .* bytes where {sidecar.name} records"):
        check_integrity(target)


def test_removing_a_full_checkpoint_removes_its_manifest(tmp_path: Path) -> None:
    """ModelCheckpoint's top-k rotation calls strategy.remove_checkpoint: no orphan manifest may stay."""
    from autoshard.lightning.checkpoint import CheckpointMixin

    class Lightning:
        def remove_checkpoint(self, filepath: Path) -> None:
            Path(filepath).unlink()

    class Strategy(CheckpointMixin, Lightning):
        global_rank = 0

    target = tmp_path / "epoch=0-step=4.ckpt"
    torch.save({"state_dict": {}}, target)
    Strategy().remove_checkpoint(with_manifest(target))
    assert list(tmp_path.iterdir()) == []


def test_another_models_keys_are_named(dcp_dir: Path) -> None:
    """What resuming another model's checkpoint raises instead of torch's CheckpointException (a BaseException)."""
    other = {"0.weight": (8, 4), "0.bias": (9,), "3.weight": (2, 8)}
    text = str(load_failure(dcp_dir, "Other", other, {0: (RuntimeError("Missing key"), None)}))
    assert text.startswith(
        f"cannot resume from {str(dcp_dir)!r}: its model weights do not match this Other: 1 missing from the checkpoint:"
        " 3.weight; 2 in the checkpoint but not in the model: 2.bias, 2.weight; 1 with another shape: 0.bias"
        " (checkpoint (8,), model (9,)). Fix: resume from a checkpoint of this model"
    ), text
    same = {k: tuple(v.shape) for k, v in model().state_dict().items()}
    text = str(load_failure(dcp_dir, "Net", same, {1: (RuntimeError("optimizer_0 missing\ntrace"), None)}))
    assert "torch.distributed.checkpoint failed on rank(s) 1: RuntimeError: optimizer_0 missing. Fix:" in text


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
        done = subprocess.run([sys.executable, "-c", DEEPSPEED_WRITER, str(path), str(free_port())], capture_output=True, text=True, timeout=150)
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


def test_convert_consolidate_and_init_from_read_the_same_weights_of_a_torch_file(tmp_path: Path) -> None:
    """One rule (checkpoint.readers.torch_weights): the weights sit under a ``state_dict`` mapping when there is one,
    else they are the top level; a ``state_dict`` entry that is not a mapping is one more value of the top level."""
    from autoshard.convert.torch_file import read_full
    from autoshard.init_from import open_weights

    weights = model().state_dict()
    files = {
        "lightning": ({"state_dict": weights, "epoch": 3}, set(weights)),
        "bare": (weights, set(weights)),
        "not a mapping": ({**weights, "state_dict": 7}, set(weights)),
    }
    for name, (saved, expected) in files.items():
        path = tmp_path / f"{name.replace(' ', '_')}.pt"
        torch.save(saved, path)
        out = consolidate(path, tmp_path / f"{path.stem}-weights.pt")
        assert set(torch.load(out.out_path, weights_only=True)) == expected, name
        assert set(read_full(path).tensors) == expected, name
        assert set(open_weights(path).shapes) == expected, name
