"""``ShardingIntent(memory_budget=...)``: the cheapest configuration whose simulated peak fits, every cheaper one with
its peak and why it does not, the user's own fields kept, and a decision a checkpoint can store and a resume keep."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from autoshard.activations import measure_step
from autoshard.budget import BudgetDecision, DecideOptions, Rates, decide, describe_config, resume_decision
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.memory import EstimateOptions, estimate_memory, fmt_bytes, with_step
from autoshard.precision import resolve_precision
from tests.test_activations import Stack


class Small(Stack):
    """Three blocks (so every 2nd block differs from every block), SGD: a simulated step in about a second."""

    def __init__(self) -> None:
        super().__init__(dim=32, depth=3)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batch() -> list[torch.Tensor]:
    return [torch.randn(32, 16, 32)]


@functools.cache
def peak_of(**config: Any) -> int:
    """The device peak of one configuration at world size 2, as explain's table computes it (states + a step)."""
    intent = ShardingIntent(**config)
    precision = resolve_precision(None, intent)
    step = measure_step(Small, intent, 2, precision, make_batch=batch)
    with torch.device("meta"):
        module = Small()
    return with_step(estimate_memory(module, intent, world_size=2, options=EstimateOptions(precision=precision)), step, True).device


@functools.cache
def decided(budget: int, flops_per_s: float = Rates().flops_per_s) -> BudgetDecision:
    return decide(Small, batch(), ShardingIntent(memory_budget=budget), 2, options=DecideOptions(rates=Rates(flops_per_s=flops_per_s)))


def test_a_budget_the_cheapest_configuration_fits_changes_nothing_that_costs() -> None:
    roomy = peak_of(reshard_after_forward=False) + 1
    decision = decided(roomy)
    assert decision.chosen == {"reshard_after_forward": False, "activation_checkpointing": False, "offload": "none"}
    assert decision.cheaper == [] and decision.peak == roomy - 1
    assert "nothing cheaper: this is the cheapest configuration" in decision.table()


def test_the_cheapest_configuration_that_fits_is_chosen_and_every_cheaper_one_shown_with_its_peak() -> None:
    budget = (peak_of(reshard_after_forward=False) + peak_of(reshard_after_forward=False, activation_checkpointing=True)) // 2
    decision = decided(budget)
    assert decision.peak <= budget < decision.cheaper[0].peak
    assert decision.peak == peak_of(**decision.chosen)  # the figure explain gives for the same configuration, set by hand
    seconds = [t.cost.seconds for t in decision.cheaper]
    assert seconds == sorted(seconds) and seconds[-1] <= decision.cost.seconds  # cheapest first, all cheaper than the choice
    for tried in decision.cheaper:
        assert not tried.fits and tried.peak > budget, tried
        assert "over the budget" in tried.why
    assert decision.chosen["activation_checkpointing"] is not False  # checkpointing is what makes it fit here
    table = decision.table()
    assert f"chosen: {describe_config(decision.chosen)}" in table and "cheaper, and why each does not fit" in table
    assert all(describe_config(t.config) in table for t in decision.cheaper)
    # Where each simulated peak is, as the simulated step of that configuration says it: the table shows it.
    chosen = ShardingIntent(**decision.chosen)
    assert decision.at == measure_step(Small, chosen, 2, resolve_precision(None, chosen), make_batch=batch).at != ""
    assert f"per rank (at: {decision.at});" in table
    for tried in (t for t in decision.cheaper if t.simulated):
        assert tried.at.startswith(("forward", "backward", "optimizer step", "training_step")), tried
        assert f"over the budget; at: {tried.at}" in table


def test_the_cost_order_decides_when_recomputation_is_dear_offload_wins() -> None:
    # Checkpointing every block fits, and so does selective checkpointing (no matmul recomputed here) with offload:
    # at the nominal rates recomputing is cheaper; at 1 GFLOP/s it costs more than copying shards to the host and back.
    budget = peak_of(reshard_after_forward=False, activation_checkpointing="selective", offload="params") + 1
    cheap_flops, dear_flops = decided(budget), decided(budget, flops_per_s=1e9)
    assert cheap_flops.chosen["offload"] == "none" and cheap_flops.cost.recompute_flops > 0, cheap_flops.chosen
    assert dear_flops.cost.recompute_flops < cheap_flops.cost.recompute_flops, (cheap_flops.chosen, dear_flops.chosen)
    assert dear_flops.chosen["offload"] == "params" and dear_flops.cost.host_bytes > 0, dear_flops.chosen
    assert dear_flops.peak <= budget and cheap_flops.peak <= budget


def test_fields_the_user_set_are_kept() -> None:
    budget = peak_of(reshard_after_forward=False, activation_checkpointing=True) + 1
    decision = decide(Small, batch(), ShardingIntent(memory_budget=budget, offload="params", reshard_after_forward=False), 2)
    assert set(decision.chosen) == {"activation_checkpointing"} and decision.kept == ("reshard_after_forward", "offload")
    assert all(set(t.config) == {"activation_checkpointing"} for t in decision.cheaper)
    pinned = decide(Small, batch(), ShardingIntent(memory_budget=budget, pinned=("offload",)), 2)
    assert "offload" not in pinned.chosen and "offload" in pinned.kept and pinned.peak <= budget
    assert "kept as you set them: offload" in pinned.table()


def test_the_decision_round_trips_through_json_and_resume_keeps_it_unless_budget_or_world_change() -> None:
    decision = decided(peak_of(reshard_after_forward=False) + 1)
    stored = json.loads(json.dumps(decision.to_dict()))
    assert BudgetDecision.from_dict(stored) == decision
    intent = ShardingIntent(memory_budget=decision.budget)
    kept, said = resume_decision(stored, intent, 2)
    assert kept == decision and said.startswith("autoshard memory budget: kept the checkpoint's decision")
    again, why = resume_decision(stored, intent, 4)
    assert again is None and "world size 2 -> 4" in why
    again, why = resume_decision(stored, intent.replace(memory_budget=decision.budget * 2), 2)
    assert again is None and "memory_budget" in why and "decided again" in why
    assert resume_decision(None, intent, 2) == (None, "")
    assert decision.intent(ShardingIntent(exclude=("head",))).exclude == ("head",)


def test_a_module_instance_is_copied_to_meta_never_changed_and_decided_beside_a_live_process_group(tmp_path: Path) -> None:
    """At fit, a strategy holds the real module and the process group is already up: the simulated steps run in this
    process beside it (no child: a forked one cannot use CUDA); the module and the real group stay as they were."""
    module = Small()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    budget = peak_of(reshard_after_forward=False) + 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        decision = decide(module, batch(), ShardingIntent(memory_budget=budget), 2)
        ones = torch.ones(2)
        dist.all_reduce(ones)  # the live group still works
    finally:
        dist.destroy_process_group()
    assert decision == decided(budget)
    assert ones.tolist() == [1.0, 1.0]
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert not any(p.is_meta for p in module.parameters())


def test_once_cuda_is_initialised_the_decision_beside_a_live_group_forks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA stand-in: a strategy's setup on a GPU has initialised CUDA, and a forked child cannot use it ("CUDA error:
    initialization error", measured on an H200). There the simulated steps run in this process, the live group's
    registry parked meanwhile: no child process is started, the decision is the same, and the live group still works."""
    import multiprocessing.process

    def no_child(self: object) -> None:
        raise AssertionError("a child process was started after CUDA was initialised")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_child)
    budget = peak_of(reshard_after_forward=False) + 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        decision = decide(Small(), batch(), ShardingIntent(memory_budget=budget), 2, device_type="cpu")
        ones = torch.ones(2)
        dist.all_reduce(ones)
    finally:
        dist.destroy_process_group()
    assert decision == decided(budget) and ones.tolist() == [1.0, 1.0]


def test_no_batch_means_no_decision() -> None:
    with pytest.raises(IntentError, match=r"never decides from model states alone.* Fix: pass the batch"):
        decide(Small, None, ShardingIntent(memory_budget="1GiB"), 2)
    with pytest.raises(IntentError, match=r"decide needs a memory budget\. Fix: ShardingIntent\(memory_budget='70GiB'\)"):
        decide(Small, batch(), ShardingIntent(), 2)


def test_on_a_cuda_machine_offload_is_simulated_without_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA stand-in: where torch.cuda.is_available() is True, the offload candidate's simulated step (fake tensors
    on a CPU mesh) must not ask for pinned memory (FakeTensorMode: "NYI: aten._pin_memory.default"): offload is only
    pinned for a CUDA mesh, and a decision that needs offload is still made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    budget = peak_of(reshard_after_forward=False, activation_checkpointing="selective", offload="params") + 1
    decision = decide(Small, batch(), ShardingIntent(memory_budget=budget, memory_headroom=0), 2, options=DecideOptions(rates=Rates(flops_per_s=1e9)))
    assert decision.chosen["offload"] == "params" and decision.peak <= budget


class GPT2(pl.LightningModule):
    """A Hugging Face GPT-2 decoder, 4 layers. Its default config keeps a KV cache in training (use_cache=True),
    which selective recomputation cannot replay. Also the GPU tests' model (tests/test_budget_gpu.py, test_gpu.py)."""

    def __init__(self, use_cache: bool = True, width: int = 64, vocab: int = 512, seq: int = 64) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq, bos_token_id=0, eos_token_id=0, use_cache=use_cache)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def test_a_candidate_whose_step_cannot_run_is_left_out_with_its_reason_and_the_decision_goes_on() -> None:
    """GPT-2 with use_cache=True: the selective candidate fails in the simulated backward. It is one row of the
    table (its reason, the use_cache Fix), and the decision goes on to a configuration that runs and fits."""
    from autoshard.budget import price

    ids = [torch.randint(0, 512, (8, 64))]
    none, every = (False, True)
    (high, _), (low, _) = price(GPT2, ids, ShardingIntent(), 2, [{"activation_checkpointing": none}, {"activation_checkpointing": every}])
    decision = decide(GPT2, ids, ShardingIntent(memory_budget=(high + low) // 2), 2)
    assert decision.chosen["activation_checkpointing"] not in (False, "selective") and decision.peak <= (high + low) // 2
    failed = [t for t in decision.cheaper if not t.runs]
    assert failed and all(t.config["activation_checkpointing"] == "selective" for t in failed)
    assert "aten.slice.Tensor encountered during backward" in failed[0].why and "Fix: set use_cache=False" in failed[0].why
    assert "empty_like_batch" not in failed[0].why and "make_batch" not in failed[0].why  # the batch is fine: never blamed
    assert "cannot run" in decision.table()
    assert BudgetDecision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision


def test_a_budget_is_what_the_device_has_the_peak_leaves_the_headroom_free() -> None:
    """On CUDA the chosen peak leaves room for what the simulated step does not count (context, NCCL, allocator
    fragmentation): by default CUDA_HEADROOM, or memory_headroom; a CPU run keeps none. The table says it."""
    from autoshard.budget import CUDA_HEADROOM, Headroom

    plain = peak_of(reshard_after_forward=False)
    room = 64 << 10
    budget = plain + room
    assert decide(Small, batch(), ShardingIntent(memory_budget=budget), 2, device_type="cpu").chosen["activation_checkpointing"] is False
    kept = decide(Small, batch(), ShardingIntent(memory_budget=budget, memory_headroom=room + 1), 2, device_type="cpu")
    assert kept.headroom == Headroom(fixed=room + 1) and kept.peak + room + 1 <= budget < plain + room + 1
    assert kept.chosen != {"reshard_after_forward": False, "activation_checkpointing": False, "offload": "none"}
    limit = fmt_bytes(budget - room - 1)  # "over" is over what the headroom leaves, never the budget itself
    assert "headroom 64.00 KiB" in kept.table() and f"over the {limit} left after the headroom" in kept.table()
    assert all(t.why.endswith(f"over the {limit} left after the headroom") for t in kept.cheaper if t.simulated), kept.cheaper
    with pytest.raises(IntentError, match=r"less than the headroom 2\.00 GiB \+ 10% of the peak a cuda run keeps free.*Fix: .*memory_headroom=0"):
        decide(Small, batch(), ShardingIntent(memory_budget=budget), 2, device_type="cuda")
    roomy = decide(Small, batch(), ShardingIntent(memory_budget="4GiB"), 2, device_type="cuda")
    assert roomy.headroom == CUDA_HEADROOM and roomy.peak <= CUDA_HEADROOM.limit(4 << 30)
    assert BudgetDecision.from_dict(json.loads(json.dumps(kept.to_dict()))) == kept
    with pytest.raises(IntentError, match=r"memory_headroom='2GiB' without memory_budget keeps nothing free\. Fix:"):
        ShardingIntent(memory_headroom="2GiB")
