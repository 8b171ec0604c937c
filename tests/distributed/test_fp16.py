"""precision="16-mixed" on FSDP2 (issue 39, item 8), on 2 real gloo processes with real fp16 autocast on CPU and a real
loss scaler, in the Trainer and in Fabric: equal to one process under 16-mixed on the global batch (same skipped steps,
weights within fp16 noise), gradients clipped after unscaling, a forced overflow in one rank's gradient shard skipped on
both ranks, the scaler's state saved and resumed exactly (a DCP directory and a full file; fabric.save / fabric.load).
One process pair runs it all (tests/distributed/fp16_worker.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("fp16_worker.py")
CLIP = 0.05  # the worker's gradient_clip_val / max_norm
FP16_NOISE = 1e-5  # weights of order 0.3 after 6 SGD steps; measured 7.2e-7 (reduction order, fp16 all-gather)
FORCED = (1, 4)  # the steps whose batch on rank 1 overflows the head's rows 2-3 (rank 1's shard of the head)
UNINTERRUPTED = [32768.0, 16384.0, 16384.0, 16384.0, 8192.0, 8192.0]  # step 0: torch's initial scale overflows too


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, ["--scenarios", "trainer,fabric,fabric_fused"], tmp_path_factory.mktemp("fp16"), nprocs=2, timeout=240)


@pytest.mark.timeout(270)
@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_16_mixed_matches_one_process_with_the_same_skipped_steps(ranks: list[dict[str, Any]], front: str) -> None:
    r0, r1 = (r[front] for r in ranks)
    trainer = ranks[0]["trainer"]
    assert trainer["plugin"] == ["MixedPrecision", "16-mixed", "cpu", "ShardedLossScaler"]  # CPU: not bf16-mixed
    assert trainer["weight_dtype"] == "torch.float32"
    assert r0["scales"] == r1["scales"] == trainer["want_scales"] == UNINTERRUPTED  # the reference skips the same steps
    assert r0["vs_reference"] == r1["vs_reference"]
    assert ranks[0]["trainer"]["gain"] == ranks[1]["trainer"]["gain"]  # the parameter kept whole: one value per rank
    assert max(r0["vs_reference"]) <= FP16_NOISE, r0["vs_reference"]
    assert trainer["moved_from_initial"] > 1e-3  # trained: the comparison is not between untouched copies
    # Clipping was active on every step taken (norm above CLIP): matching the reference, it ran after unscaling.
    taken = [n for n in trainer["want_norms"] if math.isfinite(n)]
    assert len(taken) == 3 and min(taken) > 5 * CLIP, trainer["want_norms"]


@pytest.mark.timeout(270)
@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_an_overflow_in_one_ranks_shard_is_skipped_on_both_ranks(ranks: list[dict[str, Any]], front: str) -> None:
    """Rank 0's own unscaled gradients are finite at the forced steps; it skips them all the same, as rank 1 does."""
    r0, r1 = (r[front] for r in ranks)
    for step in FORCED:
        assert r0["finite"][step] and not r1["finite"][step], (r0["finite"], r1["finite"])
        assert r0["scales"][step] == r0["scales"][step - 1] / 2
    if front == "trainer":
        assert r0["head_rows"] == [2, 8] and r0["gain_whole"]  # rank 1 holds rows 2-3; a plain gradient beside DTensors
        assert r0["moved"] == r1["moved"] == [False, False, True, True, False, True]  # no shard moved on a skipped step


@pytest.mark.timeout(270)
def test_198_a_fused_optimizer_skips_the_overflow_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    """AdamW(fused=True), no clipping: torch's scaler checks for infs itself for a fused step (this rank's shard only:
    rank 0 used to step while rank 1 skipped, and their scales parted)."""
    r0, r1 = (r["fabric_fused"] for r in ranks)
    assert r0 == r1 == {"moved": [False, False, True], "scales": UNINTERRUPTED[:3]}


@pytest.mark.timeout(270)
@pytest.mark.parametrize("checkpoint", ["distributed", "full"])
def test_the_trainer_resumes_the_scaler_exactly(ranks: list[dict[str, Any]], checkpoint: str) -> None:
    """Saved after epoch 1 (scale halved by the forced overflow), resumed in a new Trainer: the scale it starts from,
    every later scale, the scaler's state and the weights are the uninterrupted run's."""
    for rank in ranks:
        run, resumed = rank["trainer"], rank["trainer"][f"resume_{checkpoint}"]
        assert resumed["saved_scale"] == UNINTERRUPTED[2] != 2.0**16
        assert resumed["scales"] == run["scales"][3:]
        assert resumed["scaler"] == run["scaler"] == run["want_scaler"]
        assert resumed["vs_uninterrupted"] == 0.0


@pytest.mark.timeout(270)
def test_fabric_saves_and_loads_the_scaler(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        fabric = rank["fabric"]
        assert fabric["scaler_type"] == "ShardedLossScaler"
        assert fabric["loaded"] == {"epoch": 1, "remainder": [], "scale": UNINTERRUPTED[2], "scales": UNINTERRUPTED[3:]}
        assert fabric["resumed_scaler"] == fabric["scaler"] == rank["trainer"]["want_scaler"]
        assert fabric["vs_uninterrupted"] == 0.0
