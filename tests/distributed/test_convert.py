"""Checkpoints that move, on real gloo processes and real engines: DeepSpeed ZeRO-3 (2 ranks) -> fsdp2 (1 rank) and
fsdp2 (1 rank) -> DeepSpeed (2 ranks) with the optimizer state, and a pretrained GPT-2 into fsdp2 shards.

Three worker invocations share one work directory (tests/distributed/convert_worker.py says which writes what).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed]
WORKER = Path(__file__).with_name("convert_worker.py")
TIMEOUT = 150  # per invocation (8-20 s each here)
FP32_NOISE = 1e-6  # other reduction orders (ZeRO's reduce-scatter vs one rank): seen 3e-8


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("convert")


def invoke(work: Path, scenarios: str, nprocs: int, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.setenv("CONVERT_WORK", str(work))
    return run_workers(WORKER, ["--scenarios", scenarios], work / f"out-{scenarios}-{nprocs}", nprocs, TIMEOUT)


@pytest.fixture(scope="module")
def deepspeed_2(work: Path) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        return invoke(work, "deepspeed_run,init_from", 2, mp)


@pytest.fixture(scope="module")
def fsdp2_1(work: Path, deepspeed_2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        return invoke(work, "to_fsdp2,fsdp2_run", 1, mp)


@pytest.fixture(scope="module")
def deepspeed_again(work: Path, fsdp2_1: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as mp:
        return invoke(work, "to_deepspeed", 2, mp)


def assert_loaded_exactly(result: dict[str, Any]) -> None:
    """Every weight (fp32 master), AdamW moment and step, the buffer: bit for bit; counters and schedule too."""
    assert result["missing"] == []
    for kind in ("param", "exp_avg", "exp_avg_sq", "step", "buffer"):
        assert result[kind]["n"] > 0 and result[kind]["unequal"] == 0, (kind, result[kind])
    assert result["param"]["n"] == 6 and result["buffer"]["n"] == 1
    assert result["global_step"] == [4, 4]
    assert result["epoch"] == [0, 1]  # saved at the end of epoch 0, resumed at the start of epoch 1
    assert result["lr"][0] == result["lr"][1] and result["scheduler_last_epoch"] == [4, 4]


def assert_continues(result: dict[str, Any]) -> None:
    """The 4 steps after the resume match the uninterrupted run of the other backend within fp32 noise."""
    assert result["missing"] == []
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert result[kind]["max_diff"] < FP32_NOISE, (kind, result[kind])
    assert result["step"]["unequal"] == 0 and result["buffer"]["unequal"] == 0
    assert result["global_step"] == [8, 8] and result["lr"][0] == result["lr"][1] and result["scheduler_last_epoch"] == [8, 8]


@pytest.mark.timeout(400)
def test_deepspeed_checkpoint_resumes_on_fsdp2_at_another_world_size(deepspeed_2: list[dict[str, Any]], fsdp2_1: list[dict[str, Any]]) -> None:
    run = deepspeed_2[0]["deepspeed_run"]
    assert all(r["deepspeed_run"]["ranks_agree"] for r in deepspeed_2) and run["steps"] == 8
    converted = run["converted"]
    assert (converted["source_format"], converted["target"], converted["source_world_size"]) == ("deepspeed", "dcp", 2)
    assert (converted["tensors"], converted["parameters"], converted["buffers"]) == (7, 6, 1)
    assert converted["optimizer_states"] == 18 and converted["optimizer_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    resumed = fsdp2_1[0]["to_fsdp2"]
    assert resumed["world_size"] == 1
    assert_loaded_exactly(resumed["loaded_vs_deepspeed"])
    assert_continues(resumed["final_vs_uninterrupted"])


@pytest.mark.timeout(500)
def test_fsdp2_checkpoint_resumes_on_deepspeed_at_another_world_size(fsdp2_1: list[dict[str, Any]], deepspeed_again: list[dict[str, Any]]) -> None:
    converted = fsdp2_1[0]["fsdp2_run"]["converted"]
    assert (converted["source_format"], converted["target"]) == ("distributed", "deepspeed")
    assert (converted["source_world_size"], converted["target_world_size"]) == (1, 2)
    for rank in deepspeed_again:
        resumed = rank["to_deepspeed"]
        assert resumed["world_size"] == 2 and resumed["ranks_agree"]
        assert_loaded_exactly(resumed["loaded_vs_fsdp2"])
        assert_continues(resumed["final_vs_uninterrupted"])


LOADS = ("hf_sharded_dir", "safetensors_file", "torch_file", "dcp_dir", "ema_teacher")


@pytest.mark.timeout(400)
def test_pretrained_gpt2_loads_into_shards_bit_exactly(deepspeed_2: list[dict[str, Any]]) -> None:
    ranks = [r["init_from"] for r in deepspeed_2]
    assert "model.safetensors.index.json" in ranks[0]["written"]["files"]  # transformers split it: the index is read
    for name in LOADS:
        per_rank = [r[name] for r in ranks]
        for out in per_rank:
            assert out["error"] is None, (name, out)
            assert out["mismatched"] == [] and out["compared"] == (58 if name == "ema_teacher" else 29), (name, out)
            assert out["tied"], name  # lm_head.weight is still transformer.wte.weight
            assert out["sharded_params"] > 0 and out["ranks_agree"], name
            # meta init: no rank read the whole model, only its own rows
            assert out["bytes_read"] <= 0.6 * out["model_bytes"], (name, out)
            if name in ("hf_sharded_dir", "safetensors_file"):  # counted by the OS too: read syscalls, no mmap
                assert out["bytes_read"] <= out["io_bytes"] <= 0.6 * out["model_bytes"], (name, out)
        assert sum(out["bytes_read"] for out in per_rank) >= per_rank[0]["bytes_total"] == per_rank[0]["model_bytes"]
    assert all(r["ema_teacher"]["copied_teachers"] == ["teacher"] for r in ranks)
    assert all(r["hf_sharded_dir"]["copied_teachers"] == [] for r in ranks)


@pytest.mark.timeout(400)
def test_pretrained_mismatch_is_named_before_sharding_on_every_rank(deepspeed_2: list[dict[str, Any]]) -> None:
    ranks = [r["init_from"] for r in deepspeed_2]
    wrong = [r["wrong_prefix"] for r in ranks]
    assert wrong[0]["error"] == "InitFromError" and wrong[0]["message"] == wrong[1]["message"]
    assert "29 missing from the file: student.lm_head.weight" in wrong[0]["message"]
    assert "28 in the file but not in the model: transformer.h.0.attn.c_attn.bias" in wrong[0]["message"]
    assert "Fix: init_from={'student': " in wrong[0]["message"]
    shapes = [r["other_shapes"] for r in ranks]
    assert shapes[0]["error"] == "InitFromError" and shapes[0]["message"] == shapes[1]["message"]
    assert "28 with another shape: student.transformer.h.0.attn.c_attn.bias (file (96,), model (144,))" in shapes[0]["message"]
    assert "Nothing was loaded or sharded yet. Fix:" in shapes[0]["message"]
