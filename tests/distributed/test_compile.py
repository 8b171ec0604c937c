"""torch.compile under fsdp2 on 2 real gloo processes, fp32, a tiny Hugging Face Llama with an EMA teacher.

``ShardingIntent(compile=True)`` (Trainer and Fabric) and a user's whole-model ``torch.compile`` under
``strategy="auto-shard"`` train to the eager losses, with the same per-block all-gathers and reduce-scatters (the hooks
``fully_shard`` adds still fire inside compiled blocks), the same checkpoint keys (no ``_orig_mod.``), and each run
resumes from the other's checkpoint. One process pair runs every scenario; the backend is ``aot_eager`` (dynamo traces
each block and runs the traced graph; inductor's code generation is the GPU test's: tests/test_compile_gpu.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("compile_worker.py")
LOSSES = 1e-4  # the bound; fp32 aot_eager gives the eager losses exactly here
STEPS = 6  # 2 epochs of 3 steps per rank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AUTOSHARD_COMPILE_BACKEND", "aot_eager")
        scenarios = "eager,compile,user_compiled,fabric"
        return run_workers(WORKER, ["--scenarios", scenarios], tmp_path_factory.mktemp("compile"), nprocs=2, timeout=400)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) < LOSSES


@pytest.mark.timeout(450)
def test_compile_true_trains_like_eager_with_the_same_keys(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        eager, compiled = r["eager"], r["compile"]
        assert eager["steps"] == compiled["steps"] == STEPS
        assert _close(compiled["losses"], eager["losses"]), (compiled["losses"], eager["losses"])
        assert eager["losses"][-1] < eager["losses"][0]  # it trains
        assert compiled["keys"] == eager["keys"] and not any("_orig_mod" in k for k in compiled["keys"])
        # Every decoder layer, the EMA teacher's too, is its own fully_shard unit, compiled in place, half on each rank.
        assert compiled["plan_compiled"] == compiled["blocks"] and len(compiled["blocks"]) == 4
        assert all(v == {"unit": True, "compiled": True, "shard": 0.5} for v in compiled["layers"].values()), compiled["layers"]
        assert not any(v["compiled"] for v in eager["layers"].values())
        assert compiled["graphs"] > 0 and eager["graphs"] == 0  # dynamo really traced the blocks
        # ... and none of autoshard's hooks on them: they run eager, as fully_shard's own (a traced hook is a guard
        # check per call; clone_view_outputs had become a graph of its own, one more compiled call per block)
        assert compiled["autoshard_frames"] == [] and r["user_compiled"]["autoshard_frames"] == []


@pytest.mark.timeout(450)
def test_per_block_collectives_still_run_under_compile(ranks: list[dict[str, Any]]) -> None:
    """The Accelerate failure (hooks bypassed by a compiled wrapper) would show as fewer all-gathers and reduce-scatters."""
    for r in ranks:
        eager = r["eager"]["collectives"]
        assert r["compile"]["collectives"] == eager
        assert r["user_compiled"]["collectives"] == eager
        assert r["fabric"]["compile"]["collectives"] == r["fabric"]["eager"]["collectives"]
        student_blocks = [b for b in r["eager"]["blocks"] if not b.startswith("teacher")]
        # each student block gathered in forward and again in backward, its gradient reduce-scattered, every step
        assert eager["all_gather"] >= STEPS * 2 * len(student_blocks)
        assert eager["reduce_scatter"] >= STEPS * len(student_blocks)


@pytest.mark.timeout(450)
def test_a_whole_model_torch_compile_is_sharded_per_block_with_eager_names(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        user, eager = r["user_compiled"], r["eager"]
        assert user["wrapped_as"] == "OptimizedModule" and user["compiled_needs"] == ["model"]
        assert user["units"] == eager["units"]  # the plan finds the blocks it finds in eager mode
        assert user["ema_pairs"] == eager["ema_pairs"] == [{"teacher": "teacher", "student": "model"}]
        assert all(v == {"unit": True, "compiled": True, "shard": 0.5} for v in user["layers"].values()), user["layers"]
        assert user["keys"] == eager["keys"] and not any("_orig_mod" in k for k in user["keys"])
        assert _close(user["losses"], eager["losses"]), (user["losses"], eager["losses"])


@pytest.mark.timeout(450)
def test_compiled_and_eager_runs_resume_from_each_others_checkpoints(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        second_epoch = r["eager"]["losses"][STEPS // 2 :]
        assert _close(r["user_compiled"]["eager_from_compiled"], second_epoch)
        assert _close(r["user_compiled"]["compiled_from_eager"], second_epoch)


@pytest.mark.timeout(450)
def test_fabric_compile_true_trains_like_eager(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        eager, compiled = r["fabric"]["eager"], r["fabric"]["compile"]
        assert _close(compiled["losses"], eager["losses"]) and len(eager["losses"]) == STEPS
        assert all(v == {"unit": True, "compiled": True, "shard": 0.5} for v in compiled["layers"].values()), compiled["layers"]
        assert not any(v["compiled"] for v in eager["layers"].values())
        assert compiled["keys"] == eager["keys"] and not any("_orig_mod" in k for k in compiled["keys"])
        assert compiled["autoshard_frames"] == []
    assert ranks[0]["fabric"]["eager"]["losses"] != ranks[1]["fabric"]["eager"]["losses"]  # each rank its own batches
