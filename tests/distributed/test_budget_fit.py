"""``ShardingIntent(memory_budget=...)`` at fit, on 2 real gloo ranks, under fsdp2 and autoshard-deepspeed.

A run given only a memory budget picks the cheapest configuration that fits (the same decision ``decide`` makes in this
process on the same shapes), logs it on rank 0 with every cheaper configuration and why it does not fit, stores it in
the checkpoint, and trains exactly like that configuration set by hand (fp32: the same losses, the same weights). A
resume keeps the decision; another budget decides again and says so; an impossible budget is refused on both ranks
before anything is sharded, with the smallest world size that fits. One process pair runs every scenario
(budget_fit_worker.py); the budgets are computed here with ``price``, from the same module and batch shapes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from autoshard.budget import BudgetDecision, BudgetRefusedError, decide, price
from autoshard.intent import ShardingIntent
from autoshard.memory import fmt_bytes
from tests.distributed.budget_fit_worker import STEPS, Net, batch
from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("budget_fit_worker.py")
TIMEOUT = 420  # one pair, ten fits and six decisions (about 2-3 minutes on 2 shared cores; DeepSpeed's first run builds an op)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
BACKENDS = ("fs", "ds") if HAS_DEEPSPEED else ("fs",)
NAME = {"fs": "fsdp2", "ds": "deepspeed"}
FP32 = ShardingIntent(precision="32-true")


@functools.cache
def budgets() -> dict[str, int]:
    """A budget between the cheapest configuration's peak and a cheaper-to-fit one's, per backend (under DeepSpeed one
    that needs the optimizer offloaded and every 2nd block checkpointed), and one that only more ranks meet (offload
    pinned): the peak of the most saving configuration at 4 ranks."""
    plain, checkpointed = price(
        Net, batch("fs"), FP32, 2, [{"reshard_after_forward": False}, {"reshard_after_forward": False, "activation_checkpointing": True}]
    )
    offloaded, offloaded_checkpointed = price(
        Net, batch("ds"), FP32, 2, [{"offload": "optimizer"}, {"offload": "optimizer", "activation_checkpointing": 2}], backend="deepspeed"
    )
    ((saving_fs, _),) = price(Net, batch("fs"), FP32, 4, [{"reshard_after_forward": True, "activation_checkpointing": True}])
    ((saving_ds, _),) = price(Net, batch("ds"), FP32, 4, [{"offload": "none"}], backend="deepspeed")
    return {
        "fs": (plain[0] + checkpointed[0]) // 2,
        "ds": (offloaded[0] + offloaded_checkpointed[0]) // 2,  # both knobs: the optimizer offloaded and every 2nd block
        "fs_impossible": saving_fs,
        "ds_impossible": saving_ds,
    }


def in_process(backend: str, budget: int, **fields: Any) -> BudgetDecision:
    """What ``decide`` chooses here, without a process group, for the module class and batch shapes the run uses."""
    return decide(Net, batch(backend), FP32.replace(memory_budget=budget, **fields), 2, backend=NAME[backend])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    work = tmp_path_factory.mktemp("budget_fit")
    scenarios = [f"{b}_{s}" for b in BACKENDS for s in ("decided", "by_hand", "resumed", "changed", "impossible")]
    scenarios += ["ds_checkpointing"] if HAS_DEEPSPEED else []
    saved = {k: os.environ.get(k) for k in ("BUDGET_FIT", "BUDGET_FIT_WORK")}
    os.environ.update(BUDGET_FIT=json.dumps(budgets()), BUDGET_FIT_WORK=str(work))
    try:
        return run_workers(WORKER, ["--scenarios", ",".join(scenarios)], work / "out", nprocs=2, timeout=TIMEOUT)
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_budget_alone_picks_logs_and_stores_the_cheapest_configuration_that_fits(ranks: list[dict[str, Any]], backend: str) -> None:
    budget = budgets()[backend]
    run = [r[f"{backend}_decided"] for r in ranks]
    assert run[0]["error"] is None and run[0]["decision"] == run[1]["decision"], run[0]["error"]  # every rank, one decision
    decision = BudgetDecision.from_dict(run[0]["decision"])
    assert decision == in_process(backend, budget), (decision.chosen, in_process(backend, budget).chosen)
    # The cheapest that fits: it fits, and every cheaper configuration is shown over the budget, with its peak.
    assert decision.peak <= budget and decision.cheaper, decision.table()
    assert all(not t.fits and t.peak > budget and t.why for t in decision.cheaper)
    # Rank 0 logged the table (only rank 0), the choice with its peak, then every cheaper one and why.
    (table,) = [line for line in run[0]["logs"] if line.startswith("autoshard memory budget: ")]
    assert table == decision.table() and not any(line.startswith("autoshard memory budget") for line in run[1]["logs"])
    assert "cheaper, and why each does not fit" in table and all(t.why in table for t in decision.cheaper)
    # The run trains with the chosen fields; the checkpoint holds the decision a resume reads before sharding.
    assert all(run[0]["fields"][k] == v for k, v in decision.chosen.items()), (run[0]["fields"], decision.chosen)
    assert run[0]["stored"] == run[0]["decision"]
    assert run[0]["global_step"] == STEPS
    if backend == "ds":  # both of DeepSpeed's knobs reached the engine: the config's offload, the blocks checkpointed
        assert decision.chosen == {"activation_checkpointing": 2, "offload": "optimizer"}, decision.table()
        assert run[0]["zero_offload"] == {"offload_optimizer": "cpu"} and run[0]["checkpointed"] == ["blocks.0", "blocks.2"]
    else:
        assert decision.chosen["activation_checkpointing"] is not False or decision.chosen["reshard_after_forward"] is True


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_budget_run_trains_exactly_like_its_configuration_set_by_hand(ranks: list[dict[str, Any]], backend: str) -> None:
    for rank in ranks:
        run = rank[f"{backend}_by_hand"]
        assert run["error"] is None and run["decision"] is None, run["error"]  # no budget, nothing decided
        assert not any(line.startswith("autoshard memory budget") for line in run["logs"])
        assert run["losses_equal_budget_run"], run["losses"]
        assert run["max_weight_diff_vs_budget_run"] == 0.0
        assert run["least_weight_change"] > 0  # every parameter trained: equal weights are not two untouched models


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resume_keeps_the_stored_decision_and_another_budget_decides_again_and_says_so(ranks: list[dict[str, Any]], backend: str) -> None:
    first = ranks[0][f"{backend}_decided"]["decision"]
    kept = ranks[0][f"{backend}_resumed"]
    assert kept["error"] is None and kept["decision"] == first and kept["global_step"] == 2 * STEPS, kept["error"]
    assert any(line.startswith("autoshard memory budget: kept the checkpoint's decision") for line in kept["logs"]), kept["logs"]
    assert ranks[1][f"{backend}_resumed"]["decision"] == first  # rank 1 got rank 0's reading by broadcast
    again = ranks[0][f"{backend}_changed"]
    assert again["error"] is None and again["global_step"] == 2 * STEPS, again["error"]
    (said,) = [line for line in again["logs"] if "decided again" in line]
    assert f"(memory_budget {fmt_bytes(first['budget'])} -> 1.00 GiB)" in said, said
    decision = BudgetDecision.from_dict(again["decision"])
    assert decision.budget == 2**30 and decision.cheaper == [] and decision == in_process(backend, 2**30)
    assert ranks[1][f"{backend}_changed"]["decision"] == again["decision"]


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
def test_deepspeed_checkpoints_every_block_or_every_kth_and_trains_exactly_as_without(ranks: list[dict[str, Any]]) -> None:
    """Real ZeRO-3 on 2 gloo ranks: the blocks the mode names run their forward again in backward (the rest once), and
    the losses and the final weights equal the run without checkpointing, bit for bit."""
    for rank in ranks:
        runs = rank["ds_checkpointing"]
        for mode, recomputed in (("False", []), ("True", ["blocks.0", "blocks.1", "blocks.2"]), ("2", ["blocks.0", "blocks.2"])):
            run = runs[mode]
            assert run["error"] is None and run["global_step"] == STEPS, run["error"]
            assert run["checkpointed"] == recomputed, (mode, run["checkpointed"])
            assert run["calls_per_step"] == [2.0 if f"blocks.{i}" in recomputed else 1.0 for i in range(3)], (mode, run["calls_per_step"])
            assert run["losses_equal_plain"] and run["max_weight_diff_vs_plain"] == 0.0, (mode, run["losses"])
    (said,) = [line for line in ranks[0]["ds_checkpointing"]["2"]["logs"] if "under DeepSpeed ZeRO-3" in line]  # rank 0 says which
    assert said == "autoshard: activation checkpointing (every 2nd block) under DeepSpeed ZeRO-3: 2 block(s): blocks.0, blocks.2", said


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_impossible_budget_is_refused_on_every_rank_before_sharding_with_the_smallest_world_size(
    ranks: list[dict[str, Any]], backend: str
) -> None:
    budget = budgets()[f"{backend}_impossible"]
    with pytest.raises(BudgetRefusedError) as here:
        in_process(backend, budget, pinned=("offload",))
    assert here.value.min_world_size in (3, 4)  # the most saving configuration fits at 4 ranks by construction
    for rank in ranks:
        run = rank[f"{backend}_impossible"]
        assert run["error"] == {"type": "BudgetRefusedError", "message": str(here.value), "min_world_size": here.value.min_world_size}
        assert not run["sharded"] and run["model_type"] == "Net" and run["global_step"] == 0
    assert f"The smallest world size at which a configuration fits is {here.value.min_world_size}" in str(here.value)
