"""``ShardingIntent(memory_budget=...)`` under DeepSpeed ZeRO-3: offload is the knob (none, then optimizer, then
params), each peak is DeepSpeed's own estimator plus the simulated activations (the figure ``autoshard explain
--backend deepspeed`` gives), ``explain --budget --json`` decides for DeepSpeed where the backend is DeepSpeed, and a
decision travels between ranks and checkpoints whole. In one process; the fit itself is tests/distributed/test_budget_fit.py.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

from autoshard import cli
from autoshard.backends.deepspeed import REDUCE_BUCKET_SIZE, zero3_model_states
from autoshard.budget import BudgetDecision, BudgetRefusedError, decide, price, resume_decision, stored_differs
from autoshard.checkpoint.saves import error_payload, rebuild_error
from autoshard.explain import ExplainOptions, explain
from autoshard.intent import ShardingIntent
from tests.test_bad_inputs_budget import Small, Wide, small_batch, wide_batch

FP32 = ShardingIntent(precision="32-true")


def offload_only(budget: int) -> ShardingIntent:
    """A budget that chooses the offload only (checkpointing pinned off), for the tests of offload's order."""
    return FP32.replace(memory_budget=budget, pinned=("activation_checkpointing",))


OFFLOADS = ("none", "optimizer", "params")


@functools.cache
def priced() -> dict[str, tuple[int, Any]]:
    """Each offload's (peak, price) on 2 ranks, as decide computes them."""
    return dict(zip(OFFLOADS, price(Wide, wide_batch(), FP32, 2, [{"offload": o} for o in OFFLOADS], backend="deepspeed")))


def test_each_offload_saves_more_device_memory_and_copies_more_bytes_than_the_one_before() -> None:
    peaks = [priced()[o][0] for o in OFFLOADS]
    seconds = [priced()[o][1].seconds for o in OFFLOADS]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 3, peaks
    assert seconds == sorted(seconds) and seconds[0] == 0 < seconds[1], seconds
    assert all(priced()[o][1].recompute_flops == 0 for o in OFFLOADS)  # nothing recomputed: checkpointing is not a knob here


def test_a_peak_is_deepspeeds_estimator_plus_the_simulated_activations_as_explain_gives_it() -> None:
    with torch.device("meta"):
        module = Wide()
    total = sum(p.numel() for p in module.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())  # a layer: weight + bias
    for offload in OFFLOADS:
        (estimate,) = explain(
            Wide, backend="deepspeed", intent=FP32.replace(offload=offload), world_sizes=(2,), batch=wide_batch, options=ExplainOptions(auto=False)
        ).memory
        assert priced()[offload][0] == estimate.device, offload
        # DeepSpeed's own formula (estimate_zero3_model_states_mem_needs) for the states, the simulated step for the rest
        _, gpu, _ = zero3_model_states(total, largest, 2, 1, offload != "none", offload == "params")
        bucket = 4 * REDUCE_BUCKET_SIZE  # and ZeRO-3's reduce bucket, allocated whole (32-true: fp32 gradients)
        kept = 4 * 2 * 2 * 256 * 1024  # and what it keeps gathered into the backward: both blocks' 256x1024 weights, whole
        assert estimate.device == gpu + bucket + kept + estimate.activations and estimate.activations > 0, offload


def test_the_cheapest_offload_that_fits_is_chosen_and_every_cheaper_one_shown() -> None:
    none, optimizer, params = (priced()[o][0] for o in OFFLOADS)
    decision = decide(Wide, wide_batch(), offload_only((none + optimizer) // 2), 2, backend="deepspeed")
    assert decision.chosen == {"offload": "optimizer"} and decision.peak == optimizer and decision.backend == "deepspeed_zero3"
    assert [(t.config, t.peak, t.fits) for t in decision.cheaper] == [({"offload": "none"}, none, False)]
    table = decision.table()
    assert "DeepSpeed ZeRO-3 (its estimator + the simulated activations)" in table and "chosen: offload='optimizer'" in table
    assert decision.intent(FP32).offload == "optimizer"
    tight = decide(Wide, wide_batch(), offload_only((optimizer + params) // 2), 2, backend="deepspeed")
    assert tight.chosen == {"offload": "params"} and [t.config["offload"] for t in tight.cheaper] == ["none", "optimizer"]
    roomy = decide(Wide, wide_batch(), offload_only(none), 2, backend="deepspeed")
    assert roomy.chosen == {"offload": "none"} and roomy.cheaper == []


def test_with_the_offload_pinned_only_more_ranks_help_and_the_refusal_names_them() -> None:
    none = priced()["none"][0]
    with pytest.raises(BudgetRefusedError) as info:
        decide(Wide, wide_batch(), FP32.replace(memory_budget=none - 1, pinned=("offload", "activation_checkpointing")), 2, backend="deepspeed")
    assert info.value.min_world_size == 3, str(info.value)  # 18 bytes per parameter over 3 ranks instead of 2
    assert "under DeepSpeed autoshard sets the offload and activation checkpointing only; strategy='fsdp2' can also reshard" in str(info.value)
    assert "Fix: run on 3 ranks (Trainer(devices=..., num_nodes=...)), or raise memory_budget to " in str(info.value)


def test_explain_json_auto_decides_for_deepspeed_where_the_backend_is_deepspeed(capsys: pytest.CaptureFixture[str]) -> None:
    none, optimizer, _ = (priced()[o][0] for o in OFFLOADS)
    args = ["explain", "tests.test_bad_inputs_budget:Wide", "--backend", "deepspeed", "--batch", "tests.test_bad_inputs_budget:wide_batch"]
    budget = (none + optimizer) // 2
    code = cli.main([*args, "--intent", "precision=32-true", "--world-sizes", "2", "--budget", str(budget), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    (entry,) = out["auto"]
    here = decide(Wide, wide_batch(), FP32.replace(memory_budget=budget), 2, backend="deepspeed")
    assert entry == json.loads(json.dumps(here.to_dict())), (entry["chosen"], here.chosen)  # the decision, as decide makes it
    assert entry["backend"] == "deepspeed_zero3" and set(entry["chosen"]) == {"activation_checkpointing", "offload"}
    # Wide's states dominate: checkpointing at no offload is cheaper yet saves too little; the optimizer's offload fits
    assert entry["chosen"]["offload"] == "optimizer" and entry["peak"] <= budget
    assert [c["config"]["offload"] for c in entry["cheaper"]] == ["none"] * len(entry["cheaper"]) and len(entry["cheaper"]) >= 2
    assert ShardingIntent(**entry["chosen"]).offload == "optimizer"  # pasteable


def test_a_budget_checkpoints_blocks_under_deepspeed_when_that_is_the_cheapest_saving() -> None:
    """Where activations dominate, recomputing is cheaper than copying to the host: every 2nd block, then every block,
    before any offload; 'selective' is never an option there (ZeRO-3 refuses it)."""
    plain, every_2nd, every = (
        peak for peak, _ in price(Small, small_batch(), FP32, 2, [{"activation_checkpointing": v} for v in (False, 2, True)], backend="deepspeed")
    )
    assert plain > every_2nd > every, (plain, every_2nd, every)
    decision = decide(Small, small_batch(), FP32.replace(memory_budget=(every_2nd + plain) // 2), 2, backend="deepspeed")
    assert decision.chosen == {"activation_checkpointing": 2, "offload": "none"} and decision.peak == every_2nd, decision.table()
    assert [t.config for t in decision.cheaper] == [{"activation_checkpointing": False, "offload": "none"}]
    tried = decide(Small, small_batch(), FP32.replace(memory_budget=every), 2, backend="deepspeed")
    assert tried.chosen == {"activation_checkpointing": True, "offload": "none"}, tried.table()
    assert all(t.config["activation_checkpointing"] != "selective" for t in tried.cheaper)
    assert decision.intent(FP32).activation_checkpointing == 2


def test_a_refusal_keeps_its_smallest_world_size_when_another_rank_rebuilds_it() -> None:
    refused = BudgetRefusedError("memory_budget 1.00 KiB per rank cannot be met ... Fix: run on 4 ranks", 4, None)
    again = rebuild_error(error_payload(refused), rank=1)
    assert type(again) is BudgetRefusedError and str(again) == str(refused) and again.min_world_size == 4


def test_a_deepspeed_decision_resumes_as_deepspeed_only_and_with_the_same_fields_free() -> None:
    decision = decide(Wide, wide_batch(), FP32.replace(memory_budget=priced()["none"][0]), 2, backend="deepspeed")
    stored = json.loads(json.dumps(decision.to_dict()))
    assert BudgetDecision.from_dict(stored) == decision
    intent = FP32.replace(memory_budget=decision.budget)
    assert resume_decision(stored, intent, 2, "deepspeed")[0] == decision
    again, said = resume_decision(stored, intent, 2, "fsdp2")
    assert again is None and "backend deepspeed_zero3 -> fsdp2" in said
    again, said = resume_decision(stored, intent.replace(offload="params"), 2, "deepspeed")
    assert again is None and "you now set offload" in said
    assert stored_differs(stored, decision) == ""


def test_reshard_after_forward_false_leaves_a_deepspeed_budget_as_it_was() -> None:
    """ZeRO-3 has no reshard_after_forward (the matrix's caveat, a warning at setup): asked for under a budget, the
    decision is the one made without it, the field neither chosen nor named as kept, and nothing refused."""
    none, optimizer, _ = (priced()[o][0] for o in OFFLOADS)
    asked = offload_only((none + optimizer) // 2)
    plain = decide(Wide, wide_batch(), asked, 2, backend="deepspeed")
    kept = decide(Wide, wide_batch(), asked.replace(reshard_after_forward=False), 2, backend="deepspeed")
    assert (kept.chosen, kept.peak, kept.kept) == (plain.chosen, plain.peak, plain.kept)
    assert (plain.chosen, plain.peak, plain.kept) == ({"offload": "optimizer"}, optimizer, ("activation_checkpointing",))
    assert [(t.config, t.peak) for t in kept.cheaper] == [(t.config, t.peak) for t in plain.cheaper]


def test_the_sizes_a_run_sets_in_zero_overrides_are_the_ones_its_peak_counts() -> None:
    """reduce_bucket_size (allocated whole only with contiguous_gradients), stage3_max_reuse_distance and
    stage3_param_persistence_threshold from the strategy's zero_overrides, in the estimate, the decision and at fit."""
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.budget import DecideOptions
    from autoshard.memory import EstimateOptions, estimate_memory
    from tests.test_bad_inputs_budget import budget_strategy, one_device_fit
    from tests.test_bad_inputs_round3_budget import Two, rows

    def gathered(**zero: Any) -> int:
        options = EstimateOptions(precision=None, zero_overrides=zero)
        return estimate_memory(Wide(), FP32, world_size=2, backend="deepspeed", options=options).gathered_block

    kept = 4 * 2 * 2 * 256 * 1024  # both blocks' 256x1024 weights, whole (as above)
    assert gathered() - gathered(reduce_bucket_size=1000) == 4 * (REDUCE_BUCKET_SIZE - 1000)
    assert gathered() - gathered(contiguous_gradients=False) == 4 * REDUCE_BUCKET_SIZE
    assert gathered() - gathered(stage3_max_reuse_distance=0) == kept
    assert gathered() - gathered(stage3_param_persistence_threshold=10**9) == kept  # whole anyway: not counted twice
    # The decision prices with them, and so does the strategy's decision at fit.
    zero = {"reduce_bucket_size": 1000}
    intent = FP32.replace(memory_budget="1GiB")
    default = decide(Two, rows(2), intent, 1, backend="deepspeed")
    smaller = decide(Two, rows(2), intent, 1, backend="deepspeed", options=DecideOptions(zero_overrides=zero))
    assert default.peak - smaller.peak == 4 * (REDUCE_BUCKET_SIZE - 1000)
    strategy = budget_strategy("autoshard-deepspeed", intent=intent, zero_overrides=zero)
    loader = DataLoader(TensorDataset(rows(4)[0]), batch_size=2)
    assert one_device_fit(strategy, Two(), loader).strategy.budget_decision == smaller
