"""Checkpoints on real gloo processes: exact resume, resharding 2 <-> 1 ranks, the full-file format, a save killed
midway, the manifest of every file and what it catches, another model's checkpoint, and consolidation of what those
runs wrote into one file for the unsharded model.

Four worker invocations share one work directory, in the order the files need: 1 rank saves; 2 ranks resume, load
the 1-rank checkpoint, use checkpoint='full', resume another model and a corrupted copy; 2 ranks get killed mid-save;
1 rank loads the 2-rank checkpoint and resumes after the crash.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from autoshard.capability import Format
from autoshard.checkpoint.formats import detect_format
from autoshard.cli import main
from autoshard.consolidate import consolidate
from autoshard.demo import DinoLike
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("checkpoint_worker.py")
TIMEOUT = 150  # per invocation (each takes 8-45 s here); a test may trigger all four, so its own limit is 450
MANIFEST = "autoshard-manifest.json"  # the on-disk names are a contract: spelled out, not imported
CORRUPTED_FIX = "Fix: restore the checkpoint from a backup, or use the previous checkpoint"


def invoke(work: Path, scenarios: str, nprocs: int) -> list[dict[str, Any]]:
    return run_workers(WORKER, ["--scenarios", scenarios, "--work", str(work)], work / f"out-{scenarios}", nprocs, TIMEOUT)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def one_rank_saved(work: Path) -> list[dict[str, Any]]:
    return invoke(work, "save_1rank", 1)


@pytest.fixture(scope="module")
def two_ranks(work: Path, one_rank_saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return invoke(work, "resume,load_1rank,full_format,mismatch,corrupt", 2)


@pytest.fixture(scope="module")
def crashed(work: Path) -> dict[str, Any]:
    """Both ranks SIGKILL themselves while writing last.ckpt at step 4; the directory is copied as the crash left it."""
    with pytest.raises(AssertionError) as info:
        invoke(work, "crash", 2)
    shutil.copytree(work / "wc", work / "wc_as_crashed", symlinks=True)
    ranks = [json.loads((work / "out-crash" / f"rank{r}.json").read_text()) for r in range(2)]
    return {"error": str(info.value).splitlines()[0], "ranks": ranks, "dir": work / "wc_as_crashed"}


@pytest.fixture(scope="module")
def one_rank_after(work: Path, two_ranks: list[dict[str, Any]], crashed: dict[str, Any]) -> list[dict[str, Any]]:
    return invoke(work, "after_crash,load_2rank", 1)


def assert_trained(weights: dict[str, Any]) -> None:
    assert weights["finite"], weights
    assert weights["changed"] == weights["total"] > 0, weights


@pytest.mark.timeout(450)
def test_resume_continues_bit_for_bit(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        resume = rank["resume"]
        # Every parameter (student, EMA teacher, probe), every optimizer state entry, the step counter.
        assert resume["final_equals_uninterrupted"]["equal"], resume["final_equals_uninterrupted"]
        assert resume["final_equals_uninterrupted"]["compared"] > 100
        assert resume["loaded_equals_saved"]["equal"], resume["loaded_equals_saved"]
        assert resume["steps"] == [8, 8]
        for weights in resume["weights"]:
            assert_trained(weights)
        assert resume["warnings"] == []
        assert resume["layout"] == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST, "meta.pt"]


@pytest.mark.timeout(450)
def test_probe_callback_optimizer_state_is_checkpointed(two_ranks: list[dict[str, Any]]) -> None:
    """Lightning saves only trainer.optimizers; autoshard adds the probe's, so its momentum survives the resume."""
    assert_trained(two_ranks[0]["resume"]["weights"][1])
    keys = two_ranks[0]["resume"]["probe_momentum_keys"]
    assert "probe_optimizer/probe.weight/momentum_buffer" in keys and "probe_optimizer/probe.bias/momentum_buffer" in keys


@pytest.mark.timeout(450)
def test_saved_at_1_rank_resumes_at_2(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        loaded = rank["load_1rank"]
        assert loaded["loaded_equals_saved"]["equal"], loaded["loaded_equals_saved"]
        assert_trained(loaded["weights"])
    assert any("saved at world size 1, resumed at 2" in w for w in two_ranks[0]["load_1rank"]["warnings"])


@pytest.mark.timeout(450)
def test_saved_at_2_ranks_resumes_at_1(one_rank_after: list[dict[str, Any]]) -> None:
    loaded = one_rank_after[0]["load_2rank"]
    assert loaded["loaded_equals_saved"]["equal"], loaded["loaded_equals_saved"]
    # Lightning counts an epoch in per-rank batches: the 2-rank epoch end (4 batches) is mid-epoch at 1 rank (8).
    assert loaded["next_epoch"] == [1, 0]
    assert_trained(loaded["weights"])
    assert any("per-rank RNG states cannot be mapped" in w for w in loaded["warnings"])


@pytest.mark.timeout(450)
def test_full_single_file_format_resumes_exactly(two_ranks: list[dict[str, Any]]) -> None:
    full = two_ranks[0]["full_format"]
    # No staging file left behind; the manifest sits beside the file.
    assert full["is_file"] and full["siblings"] == ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.autoshard-manifest.json"]
    assert full["loaded_equals_saved"]["equal"], full["loaded_equals_saved"]
    assert full["same_as_distributed_format"]["equal"], full["same_as_distributed_format"]
    for weights in full["weights"]:
        assert_trained(weights)


@pytest.mark.timeout(450)
def test_kill_during_save_leaves_previous_checkpoint_intact(crashed: dict[str, Any], work: Path) -> None:
    assert "exited with -9" in crashed["error"], crashed["error"]  # SIGKILL, mid-write
    assert crashed["ranks"][0]["crash"]["saved"] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    for rank in crashed["ranks"]:
        assert_trained(rank["crash"]["weights"])  # 4 steps trained before the kill
    directory: Path = crashed["dir"]
    (staged,) = directory.glob(".last.ckpt.autoshard-tmp.*")  # the killed save's own staging (pid and random token)
    assert sorted(p.name for p in staged.iterdir()) == ["__0_0.distcp", "__1_0.distcp"]  # partial shards, no .metadata
    assert detect_format(staged).format is Format.INCOMPLETE
    assert detect_format(directory / "last.ckpt").format is Format.DCP
    # last.ckpt still holds step 2, whole: consolidated, it equals the weights captured at step 2.
    out = consolidate(directory / "last.ckpt", work / "after_crash_weights.pt")
    weights = torch.load(out.out_path, weights_only=True)
    reference = torch.load(work / "wc_ref_step2.pt", weights_only=True)
    assert set(weights) == {k.removeprefix("param/") for k in reference if k.startswith("param/")}
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[f"param/{name}"]), name


@pytest.mark.timeout(450)
def test_resume_from_last_after_the_crash(one_rank_after: list[dict[str, Any]]) -> None:
    after = one_rank_after[0]["after_crash"]
    assert any(name.startswith(".last.ckpt.autoshard-tmp.") for name in after["before"]), after["before"]
    assert ".last.ckpt.autoshard-lock" in after["before"]  # the killed rank 0 held it: harmless, its flock died with it
    assert after["loaded_equals_step2"]["equal"], after["loaded_equals_step2"]
    assert after["global_step"] == 6
    assert_trained(after["weights"])
    # The next save of last.ckpt cleared what the crash left; nothing hidden remains.
    assert not [name for name in after["after"] if name.startswith(".")], after["after"]


def recorded(manifest: Path) -> dict[str, Any]:
    return json.loads(manifest.read_text())["files"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(450)
def test_manifest_covers_every_file_both_ranks_wrote(two_ranks: list[dict[str, Any]], work: Path) -> None:
    """Each rank hashed its own shard; rank 0 added .metadata and meta.pt; the full file has its own beside it."""
    ckpt = work / "w2" / "epoch=0-step=4.ckpt"
    files = recorded(ckpt / MANIFEST)
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    for name, entry in files.items():
        assert entry == {"size": (ckpt / name).stat().st_size, "sha256": sha256(ckpt / name)}, name
    full = work / "wf" / "epoch=0-step=4.ckpt"
    assert recorded(full.with_name(full.name + ".autoshard-manifest.json")) == {full.name: {"size": full.stat().st_size, "sha256": sha256(full)}}


@pytest.mark.timeout(450)
def test_resume_refuses_a_same_size_corruption_on_every_rank(two_ranks: list[dict[str, Any]], work: Path) -> None:
    bad = work / "corrupt" / "epoch=0-step=4.ckpt"
    shard = bad / "__1_0.distcp"
    assert two_ranks[0]["corrupt"]["flipped"]["size"] == (work / "w2" / "epoch=0-step=4.ckpt" / shard.name).stat().st_size
    for rank in two_ranks:  # before: both ranks resumed from it silently
        refused = rank["corrupt"]["refused"]
        assert refused["type"] == "CheckpointFormatError" and refused["autoshard"], refused
        text = refused["message"]
        expected = recorded(bad / MANIFEST)[shard.name]["sha256"]
        assert f"{str(bad)!r} is corrupted: {str(shard)!r} has sha256 {sha256(shard)} where {MANIFEST} records {expected}" in text
        assert text.endswith(CORRUPTED_FIX), text


@pytest.mark.timeout(450)
def test_resume_without_a_manifest_loads_with_one_warning(two_ranks: list[dict[str, Any]], work: Path) -> None:
    """Lightning's own checkpoints and older autoshard ones have no manifest: they load, unverified, and say so once."""
    unverified = work / "no_manifest" / "epoch=0-step=4.ckpt"
    assert two_ranks[0]["corrupt"]["unverified_warnings"] == [
        f"autoshard: {str(unverified)!r} has no manifest {MANIFEST!r} (written by Lightning itself or an older autoshard):"
        f" its files cannot be checked against the checksums of the save, so a corrupted file would go unnoticed"
    ]
    assert two_ranks[1]["corrupt"]["unverified_warnings"] == []  # rank 0 warns


@pytest.mark.timeout(450)
def test_consolidate_refuses_a_same_size_corruption(two_ranks: list[dict[str, Any]], work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 0, and one weight of the output silently changed."""
    bad = work / "corrupt" / "epoch=0-step=4.ckpt"
    out = work / "from-corrupt.pt"
    assert main(["consolidate", str(bad), str(out)]) == 1
    text = capsys.readouterr().err
    assert f"{str(bad / '__1_0.distcp')!r} has sha256 {sha256(bad / '__1_0.distcp')} where {MANIFEST} records" in text
    assert text.rstrip().endswith(CORRUPTED_FIX) and not out.exists()


@pytest.mark.timeout(450)
def test_resume_from_another_models_checkpoint_names_the_keys_on_every_rank(two_ranks: list[dict[str, Any]], work: Path) -> None:
    """Before: torch's CheckpointException, a BaseException that escapes `except Exception`."""
    ckpt = work / "w2" / "epoch=0-step=4.ckpt"
    for rank in two_ranks:
        failed = rank["mismatch"]
        assert failed["type"] == "CheckpointFormatError" and failed["is_exception"] and failed["autoshard"], failed
        assert failed["message"].startswith(
            f"cannot resume from {str(ckpt)!r}: its model weights do not match this AnotherModel:"
            " 2 missing from the checkpoint: head.bias, head.weight;"
            " 2 in the checkpoint but not in the model: probe.bias, probe.weight. Fix: resume from a checkpoint of this model"
        ), failed["message"]


def unsharded_model() -> DinoLike:
    model = DinoLike()
    model.probe = torch.nn.Linear(32, 4)  # the probe the callback attached before sharding
    return model


@pytest.mark.timeout(450)
@pytest.mark.parametrize("source", ["w2/epoch=0-step=4.ckpt", "wf/epoch=0-step=4.ckpt"], ids=["dcp-2-ranks", "full-file"])
def test_consolidate_loads_into_the_unsharded_model(source: str, two_ranks: list[dict[str, Any]], work: Path) -> None:
    out = consolidate(work / source, work / f"consolidated-{source.split('/')[0]}.pt")
    assert out.format is (Format.DCP if source.startswith("w2") else Format.FULL)
    weights = torch.load(out.out_path, weights_only=True)
    model = unsharded_model()
    model.load_state_dict(weights, strict=True)
    reference = torch.load(work / "w2_ref.pt", weights_only=True)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), reference[f"param/{name}"]), name
    assert out.tensors == len(weights) and out.seconds < 10


@pytest.mark.timeout(450)
def test_consolidate_command_line(two_ranks: list[dict[str, Any]], work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = work / "cli" / "weights.pt"
    assert main(["consolidate", str(work / "w2" / "epoch=0-step=4.ckpt"), str(target)]) == 0
    assert "model.load_state_dict(torch.load(" in capsys.readouterr().out
    unsharded_model().load_state_dict(torch.load(target, weights_only=True), strict=True)
    assert main(["consolidate", str(work / "w2"), str(work / "cli" / "nope.pt")]) == 1
    text = capsys.readouterr().err
    assert "is not a checkpoint" in text and "pass one of them, e.g." in text and "epoch=1-step=8.ckpt" in text
    # Before: exit 0, and the full Lightning checkpoint (trainer state, optimizer) was replaced by weights only.
    lightning_file = work / "wf" / "epoch=0-step=4.ckpt"
    before = lightning_file.read_bytes()
    assert main(["consolidate", str(work / "w2" / "epoch=0-step=4.ckpt"), str(lightning_file)]) == 1
    text = capsys.readouterr().err
    assert f"refusing to overwrite {str(lightning_file)!r}: it already exists (a single torch.save file)" in text
    # A training checkpoint is not consolidate's output: the fix is not --force, which would be refused too.
    assert text.rstrip().endswith(f"Fix: choose another output path, or move {str(lightning_file)!r} away first")
    assert main(["consolidate", str(work / "w2" / "epoch=0-step=4.ckpt"), str(lightning_file), "--force"]) == 1
    assert "even with --force" in capsys.readouterr().err
    assert lightning_file.read_bytes() == before
