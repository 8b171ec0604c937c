"""``Fabric(strategy="fsdp2" / "auto-shard" / "autoshard-deepspeed")`` on 2 real gloo processes, against one process on
the global batch: the optimizer built before setup and after (AdamW, SGD with momentum), its state kept when moved,
bf16-mixed, EMA teachers inside the model and set up apart, two optimizers, a second setup call, meta-device init (with
init_from), unsharded parameters and buffers, DeepSpeed on CPU and its refusals, and fabric.save / a NEW process's
fabric.load continuing bit for bit, the checkpoint read by ``autoshard consolidate`` / ``convert``.

Two process pairs in all: one runs every scenario (imports dominate a run's cost), the second only loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("fabric_worker.py")
FIRST = [
    "optimizer_before_setup",
    "stale_with_lightning_alone",
    "optimizer_after_setup",
    "optimizer_before_setup_module",
    "state_kept",
    "bf16_mixed",
    "ema_inside",
    "ema_apart_student_first",
    "ema_apart_teacher_first",
    "two_optimizers",
    "second_setup",
    "meta_init",
    "meta_init_from",
    "meta_ema_apart",
    "unsharded_root",
    "save_and_continue",
    "gan_toggle_bf16",
]
DEEPSPEED = ["deepspeed_refusals", "deepspeed_trains"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
EXACT = 1e-6  # fp32 on 2 ranks against one process: reduction order only


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fabric")


@pytest.fixture(scope="module")
def ranks(shared: Path) -> list[dict[str, Any]]:
    scenarios = FIRST + (DEEPSPEED if HAS_DEEPSPEED else [])
    return run_workers(WORKER, ["--scenarios", ",".join(scenarios)], shared / "first", nprocs=2, timeout=500)


@pytest.fixture(scope="module")
def resumed(shared: Path, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """New processes: nothing of the first run but its checkpoint."""
    return run_workers(WORKER, ["--scenarios", "load_and_continue"], shared / "second", nprocs=2, timeout=300)


def both(ranks: list[dict[str, Any]], scenario: str, key: str) -> list[Any]:
    return [rank[scenario][key] for rank in ranks]


@pytest.mark.timeout(600)
def test_optimizer_built_before_setup_trains_like_one_process(ranks: list[dict[str, Any]]) -> None:
    """fabric.setup(model, optimizer) with the optimizer built first (AdamW): moved onto the shards, exact; Lightning's
    own ModelParallelStrategy leaves it stepping the old tensors (the model never moves)."""
    for rank in ranks:
        result = rank["optimizer_before_setup"]
        assert result["vs_reference"] < EXACT, result
        assert result["moved"] > 1e-2 and result["optimizer_holds_model"]
        shares = result["fractions"]
        assert shares["embed.weight"] == shares["blocks.0.lin.weight"] == 0.5 and max(shares.values()) <= 2 / 3, shares
        assert rank["stale_with_lightning_alone"]["vs_reference"] > 1e-2  # the bug this fixes: the check can fail
    assert len(set(both(ranks, "optimizer_before_setup", "checksum"))) == 1


@pytest.mark.timeout(600)
def test_optimizer_built_after_setup_and_handed_over_later(ranks: list[dict[str, Any]]) -> None:
    """SGD with momentum: built after setup_module (FSDP2's order), or before it and handed to setup_optimizers."""
    for rank in ranks:
        assert rank["optimizer_after_setup"]["vs_reference"] < EXACT
        assert rank["optimizer_before_setup_module"]["vs_reference"] < EXACT
    assert len(set(both(ranks, "optimizer_after_setup", "checksum"))) == 1


@pytest.mark.timeout(600)
def test_an_optimizer_state_moves_with_its_parameters(ranks: list[dict[str, Any]]) -> None:
    """AdamW stepped once before setup: its moments are cut to each rank's shard, and training continues exactly."""
    for rank in ranks:
        assert rank["state_kept"]["vs_reference"] < EXACT
        assert rank["state_kept"]["state_kinds"] == ["DTensor"]


@pytest.mark.timeout(600)
def test_bf16_mixed_gathers_in_bf16_and_reduces_in_fp32(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        result = rank["bf16_mixed"]
        assert set(result["collectives"]["all_gather"]) == {"bfloat16"}, result["collectives"]
        assert set(result["collectives"]["reduce_scatter"]) == {"float32"}, result["collectives"]
        assert result["weight_dtypes"] == ["torch.float32"]
        # bf16 rounding differs from one process under autocast by far less than bf16 differs from fp32.
        assert result["vs_reference"] < min(1e-2, result["reference_vs_fp32"] / 10), result
    assert len(set(both(ranks, "bf16_mixed", "checksum"))) == 1


@pytest.mark.timeout(600)
def test_a_gan_set_up_apart_with_toggled_freezing_trains_under_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """Generator and discriminator set up apart, each frozen while the other steps (Lightning's toggle_optimizer): the
    discriminator's first forward runs frozen, and every unit still reduces in fp32 (FSDP2's lazy init done at setup,
    every parameter counted trainable); without it the first discriminator backward fails in FSDP2's reduce."""
    for rank in ranks:
        result = rank["gan_toggle_bf16"]
        assert result["error"] is None, result["error"]
        assert set(result["collectives"]["reduce_scatter"]) == {"float32"}, result["collectives"]
        assert set(result["collectives"]["all_gather"]) == {"bfloat16"}, result["collectives"]
        # Within bf16 rounding of one process under autocast, far below what training moved the weights.
        assert result["vs_reference"] < min(1e-2, result["moved"] / 20), result
    assert len(set(both(ranks, "gan_toggle_bf16", "checksum"))) == 1


@pytest.mark.timeout(600)
def test_ema_teacher_is_sharded_like_its_student_and_updates_exactly(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        inside = rank["ema_inside"]
        assert inside["vs_reference"] < EXACT and inside["teacher_moved"] > 1e-3, inside
        assert inside["placements_equal"] and inside["teacher_sharded"]
        assert inside["teacher_dtensor_after_no_grad_forward"] == [True] * 3  # resharded after its no_grad forward
        for order in ("ema_apart_student_first", "ema_apart_teacher_first"):  # teacher = deepcopy(student), set up apart
            apart = rank[order]
            assert apart["vs_reference"] < EXACT, (order, apart)
            assert apart["placements_equal"] and apart["teacher_fractions"]["embed.weight"] == 0.5, (order, apart)


@pytest.mark.timeout(600)
def test_two_optimizers_train_under_fsdp2(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        result = rank["two_optimizers"]
        assert result["vs_reference"] < EXACT
        assert result["optimizers"] == "1 from fabric.setup call 1: AdamW over 'gen', 1 from fabric.setup call 1: SGD over 'disc'"


@pytest.mark.timeout(600)
def test_a_second_setup_call_counts_and_trains(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        result = rank["second_setup"]
        assert result["vs_reference"] < EXACT
        assert result["setups"] == ["fabric.setup call 1: Net with AdamW over all of Net", "fabric.setup call 2: Net with SGD over all of Net"]
        assert result["fractions"]["blocks.1.lin.weight"] == 0.5


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_refuses_two_optimizers_and_a_second_setup_naming_both(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        text = rank["deepspeed_refusals"]["two_optimizers"]
        assert text.startswith("IncompatibleBackendError: Pair cannot train under DeepSpeed ZeRO stage 3"), text
        assert "AdamW over 'gen'" in text and "SGD over 'disc'" in text and "\nFix: use strategy='fsdp2'" in text, text
        second = rank["deepspeed_trains"]["second_setup"]
        assert "cannot take a second fabric.setup call" in second and "issues/19773" in second, second
        assert "Already set up: fabric.setup call 1: Net with AdamW over all of Net. Now: fabric.setup call 2: Net" in second
        assert "Fix: use Fabric(strategy='fsdp2')" in second


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_trains_on_cpu_like_one_process(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        result = rank["deepspeed_trains"]
        assert result["vs_reference"] < 1e-5, result["vs_reference"]
        assert result["loaded_vs_saved"] == 0.0 and result["step"] == 3  # fabric.save / fabric.load through the writer
        assert result["partitioned"] and max(result["partitioned"]) <= 2 / 3 and result["partitioned"][0] == 0.5, result["partitioned"]


@pytest.mark.timeout(600)
def test_meta_device_init_and_init_from(ranks: list[dict[str, Any]]) -> None:
    """fabric.init_module(empty_init=True), the optimizer built on meta parameters: materialized shards (distinct
    per rank, the same whole on every rank), trained exactly; init_from fills each shard from the file, half each."""
    for rank in ranks:
        meta = rank["meta_init"]
        assert meta["on_meta"] and meta["vs_reference"] < EXACT and meta["shard_rows_differ"] > 1e-2, meta
        assert rank["meta_init_from"]["vs_file"] == 0.0
        assert rank["meta_init_from"]["read_share"] < 0.75
        for order, apart in rank["meta_ema_apart"].items():  # a meta-initialized teacher set up apart starts as its student
            assert apart["on_meta"] and apart["teacher_vs_student"] == 0.0 and apart["sharded_alike"], (order, apart)
    assert len(set(both(ranks, "meta_init", "checksum"))) == 1


@pytest.mark.timeout(600)
def test_unsharded_parameters_and_buffers_start_from_rank_0_and_stay_equal(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        result = rank["unsharded_root"]
        assert result["after_setup"] == {"scale": 1.0, "offset": [0.0, 0.0, 0.0]}
        assert result["vs_reference"] < EXACT
    assert len(set(both(ranks, "unsharded_root", "scale"))) == 1


@pytest.mark.timeout(900)
def test_fabric_load_in_new_processes_continues_bit_for_bit(ranks: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    """Dropout draws per rank: weights, optimizer state, the user's "step" and each rank's RNG state come back."""
    for first, second in zip(ranks, resumed):
        saved, loaded = first["save_and_continue"], second["load_and_continue"]
        assert loaded["step"] == 2 and loaded["rest"] == []
        assert loaded["loaded"] == saved["saved"]
        assert loaded["final"] == saved["final"]  # exactly: lists of floats compared for equality


@pytest.mark.timeout(600)
def test_the_checkpoint_is_published_whole_and_read_by_consolidate_and_convert(shared: Path, ranks: list[dict[str, Any]], tmp_path: Path) -> None:
    from autoshard.checkpoint.publish import MANIFEST, staged_siblings
    from autoshard.consolidate import consolidate
    from autoshard.convert import ConvertError, ConvertOptions, convert

    ckpt = shared / "ckpt"
    assert (ckpt / MANIFEST).is_file() and (ckpt / "meta.pt").is_file() and not staged_siblings(ckpt)
    saved = {n: torch.tensor(v) for n, v in ranks[0]["save_and_continue"]["saved"].items()}
    done = consolidate(ckpt, tmp_path / "weights.pt")
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert done.key == "model" and weights.keys() == saved.keys()
    assert all(torch.equal(weights[n], saved[n]) for n in saved)
    convert(ckpt, tmp_path / "hf", "safetensors")
    from safetensors.torch import load_file

    exported = load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[n], saved[n]) for n in saved)
    if HAS_DEEPSPEED:  # autoshard-deepspeed's fabric.save: published with its manifest, consolidated by zero_to_fp32
        assert (shared / "ds_ckpt" / MANIFEST).is_file() and not staged_siblings(shared / "ds_ckpt")
        consolidate(shared / "ds_ckpt", tmp_path / "ds.pt")
        ds_weights = torch.load(tmp_path / "ds.pt", weights_only=True)
        ds_saved = {n: torch.tensor(v) for n, v in ranks[0]["deepspeed_trains"]["saved"].items()}
        assert ds_weights.keys() == ds_saved.keys() and all(torch.equal(ds_weights[n], ds_saved[n]) for n in ds_saved)
    with pytest.raises(ConvertError, match="no Lightning trainer state") as refused:
        convert(ckpt, tmp_path / "ds", "deepspeed", ConvertOptions(world_size=2, precision="32-true"))
    assert "Fix: convert the weights with --to safetensors" in str(refused.value)
