"""Several forwards per step under DeepSpeed ZeRO-3, measured on 2 CPU processes (gloo): what the matrix cell says.

The cell (backends/deepspeed.py, Feature.MULTI_FORWARD) is "partial" on these numbers: the training is right (equal
to one process on the global batch), the prefetch trace is lost every step, so more is all-gathered. One process
pair runs every case (raw engines, then one Trainer); about 30 s.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from autoshard.backends import deepspeed as deepspeed_backend
from autoshard.capability import Feature, Support
from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("deepspeed_multi_forward_worker.py")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install 'autoshard[deepspeed]')"),
]
PAIR_TIMEOUT = 240  # the first DeepSpeed CPU run compiles a shared-memory op (about 60 s), cached afterwards
SEVERAL = {"two_views": 2, "multi_crop": 3, "no_grad_target": 2, "two_views_tight": 2}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(WORKER, [], tmp_path_factory.mktemp("ds_multi_forward"), nprocs=2, timeout=PAIR_TIMEOUT)


def gathered(run: dict[str, Any]) -> int:
    """Elements all-gathered in the last step (the first records DeepSpeed's trace and differs)."""
    return run["per_step"][-1]["gathered"]


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_several_forwards_train_like_one_process_on_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        for method in ("one_forward", "one_forward_tight", *SEVERAL):
            run = rank[method]
            assert run["partitioned"] and run["global_steps"] == 6, method
            assert run["max_change"] > 1e-2, method  # the weights moved: the comparison below can fail
            assert run["max_diff_vs_single_process"] < 1e-6, (method, run["max_diff_vs_single_process"])
            expected = SEVERAL.get(method, 1)
            assert all(step["forwards"] == expected for step in run["per_step"]), (method, run["per_step"])


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_the_prefetch_trace_is_lost_every_step_and_the_matrix_says_how_much(ranks: list[dict[str, Any]]) -> None:
    """The figures written in the matrix cell are the ones measured here."""
    rank = ranks[0]
    for method in ("one_forward", "one_forward_tight"):
        assert all(step["invalidations"] == 0 for step in rank[method]["per_step"]), method
    for method in SEVERAL:
        assert all(step["invalidations"] == 1 for step in rank[method]["per_step"]), method
    regathering, live = gathered(rank["one_forward_tight"]), gathered(rank["one_forward"])
    figures = {
        "1.8x": gathered(rank["two_views"]) / regathering,
        "3.7x": gathered(rank["two_views"]) / live,
        "2.3x": gathered(rank["multi_crop"]) / regathering,
    }
    assert gathered(rank["two_views_tight"]) == gathered(rank["two_views"])  # no trace, no prefetch: settings change nothing
    cell = deepspeed_backend.ROW[Feature.MULTI_FORWARD]
    assert cell.support is Support.PARTIAL and "trains correctly" in cell.reason
    for written, measured in figures.items():
        assert f"{measured:.1f}x" == written and written in cell.reason, (written, measured)


@pytest.mark.timeout(PAIR_TIMEOUT + 30)
def test_a_trainer_runs_a_declared_multi_forward_method_and_warns_once_on_rank_zero(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        run = rank["lightning"]
        assert run["engine"] == "DeepSpeedEngine" and run["global_step"] == 6 and run["decision"] == "deepspeed_zero3"
        assert run["max_diff_vs_single_process"] < 1e-6, run["max_diff_vs_single_process"]
    caveat = "autoshard: partial support on deepspeed_zero3 for several forwards per step [declared multi_forward=True]"
    assert [w for w in ranks[0]["lightning"]["warnings"] if w.startswith(caveat)] != []
    assert sum(w.startswith(caveat) for w in ranks[0]["lightning"]["warnings"]) == 1
    assert ranks[1]["lightning"]["warnings"] == []  # rank 0 only
