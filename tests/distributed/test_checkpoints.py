"""Checkpoints on real gloo processes: exact resume, resharding 2 <-> 1 ranks, the full-file format, a save killed
midway, and consolidation of what those runs wrote into one file for the unsharded model.

Four worker invocations share one work directory, in the order the files need: 1 rank saves; 2 ranks resume, load
the 1-rank checkpoint and use checkpoint='full'; 2 ranks get killed mid-save; 1 rank loads the 2-rank checkpoint and
resumes after the crash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from autoshard.checkpoint import Format, consolidate, detect_format, main
from autoshard.demo import DinoLike
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("checkpoint_worker.py")
TIMEOUT = 100  # per invocation (each takes 8-25 s here); a test may trigger all four, so its own limit is 450


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
    return invoke(work, "resume,load_1rank,full_format", 2)


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
        assert resume["layout"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


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
    assert full["is_file"] and full["siblings"] == ["epoch=0-step=4.ckpt"]  # no staging file left behind
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
    staged = directory / ".last.ckpt.autoshard-tmp"
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
    assert ".last.ckpt.autoshard-tmp" in after["before"]
    assert after["loaded_equals_step2"]["equal"], after["loaded_equals_step2"]
    assert after["global_step"] == 6
    assert_trained(after["weights"])
    # The next save of last.ckpt cleared what the crash left; nothing hidden remains.
    assert not [name for name in after["after"] if name.startswith(".")], after["after"]


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
