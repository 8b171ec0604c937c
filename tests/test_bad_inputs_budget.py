"""The bad-input catalog, rows 120-136 (docs/bad-inputs.md): memory budgets and activation checkpointing modes.

A budget is never met by guessing: a value that is not a size, a mode that does not exist, a decision without a batch
and a budget nothing meets are each refused with the fix, and an impossible budget names the smallest world size that
fits (found by search) or, when none does, the micro-batch that would. At fit (rows 131-136): what a budget cannot
decide under DeepSpeed is refused when the strategy is built, an empty train DataLoader or a sharding of your own
before anything is sharded, and a resume says when it does not keep the checkpoint's decision. The fits here (rows
132, 136) run last, in-process on one CPU device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autoshard import cli
from autoshard.activations import fake_world, measure_step
from autoshard.adapters.checkpointing import apply_checkpointing
from autoshard.backends.deepspeed import REDUCE_BUCKET_SIZE
from autoshard.budget import BudgetRefusedError, decide, resume_decision, stored_differs
from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.memory import EstimateOptions, estimate_memory, with_step
from autoshard.precision import resolve_precision
from tests.test_activations import Stack

SAVING = {"reshard_after_forward": True, "activation_checkpointing": True}  # everything but offload


class Small(Stack):
    """Activations dominate: more ranks do not help it."""

    def __init__(self) -> None:
        super().__init__(dim=32, depth=3)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Wide(Stack):
    """Model states dominate (wide layers, AdamW, a tiny batch): more ranks help it."""

    def __init__(self) -> None:
        super().__init__(dim=256, depth=2)


def small_batch() -> list[torch.Tensor]:
    return [torch.randn(32, 16, 32)]


def wide_batch() -> list[torch.Tensor]:
    return [torch.randn(2, 4, 256)]


@functools.cache
def wide_peak(world_size: int) -> int:
    intent = ShardingIntent(**SAVING)
    precision = resolve_precision(None, intent)
    step = measure_step(Wide, intent, world_size, precision, make_batch=wide_batch)
    with torch.device("meta"):
        module = Wide()
    return with_step(estimate_memory(module, intent, world_size=world_size, options=EstimateOptions(precision=precision)), step, True).device


def test_120_a_memory_budget_that_is_not_a_size_is_refused() -> None:
    with pytest.raises(IntentError) as info:
        ShardingIntent(memory_budget="70 gigs")
    assert str(info.value) == "memory_budget '70 gigs' is not a size. Fix: write it as 70GiB, 500MB, 2GiB or a number of bytes"
    assert ShardingIntent(memory_budget="70GiB").memory_budget == 70 * 2**30 and ShardingIntent(memory_budget=1000).memory_budget == 1000


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("yes", "Fix: activation_checkpointing=True"),
        ("selectve", "Fix: activation_checkpointing='selective'"),
        ("2", "Fix: activation_checkpointing=2 (a number, not a string)"),
        (0, "Fix: activation_checkpointing=False (no checkpointing), or a k >= 1 (1: every block, 2: every second block)"),
    ],
)
def test_121_an_activation_checkpointing_mode_that_does_not_exist_is_refused(value: Any, fix: str) -> None:
    with pytest.raises(IntentError) as info:
        ShardingIntent(activation_checkpointing=value)
    assert str(info.value).startswith("activation_checkpointing must be True (every block), False, 'selective' (op-level")
    assert str(info.value).endswith(f"got {value!r}. {fix}")


def test_122_pinned_names_what_the_budget_chooses_and_needs_a_budget() -> None:
    with pytest.raises(
        IntentError,
        match=r"pinned names field\(s\) memory_budget does not choose: 'ofload' \(did you mean 'offload'\?\).* Fix: pinned=\('offload',\)",
    ):
        ShardingIntent(memory_budget="1GiB", pinned=["ofload"])
    with pytest.raises(IntentError, match=r"without memory_budget pins nothing.* Fix: add memory_budget='70GiB', or drop pinned"):
        ShardingIntent(pinned=("offload",))


def test_123_a_budget_is_never_decided_without_a_batch() -> None:
    with pytest.raises(IntentError) as info:
        decide(Small, None, ShardingIntent(memory_budget="1GiB"), 2)
    assert "autoshard never decides from model states alone" in str(info.value) and "Fix: pass the batch" in str(info.value)


def test_124_a_budget_more_ranks_meet_names_the_smallest_world_size_found_by_search() -> None:
    budget = wide_peak(3)
    assert wide_peak(2) > budget  # two ranks do not fit, three do: the answer is 3, not the doubled 4
    with pytest.raises(BudgetRefusedError) as info:
        decide(Wide, wide_batch(), ShardingIntent(memory_budget=budget, pinned=("offload",)), 2)
    assert info.value.min_world_size == 3
    assert re.search(
        r"cannot be met at world size 2: even activation_checkpointing=True peaks at .* The smallest world size at which a configuration fits is 3 \(found by search",
        str(info.value),
    )
    assert "Fix: run on 3 ranks" in str(info.value)


def test_125_a_budget_no_world_size_meets_names_the_micro_batch_that_fits() -> None:
    intent = ShardingIntent(memory_budget="600KiB")
    with pytest.raises(BudgetRefusedError) as info:
        decide(Small, small_batch(), intent, 2)
    error = info.value
    assert error.min_world_size is None and error.micro_batch is not None and error.micro_batch < 32
    assert "no world size up to 4096 fits: activations and what stays whole do not shrink with ranks" in str(error)
    assert re.search(r"peaks at [\d.]+ KiB per rank \(at: (forward|backward) of [^)]*\) on the micro-batch", str(error)), str(error)
    n = error.micro_batch
    assert f"Fix: DataLoader(batch_size={n}) with Trainer(accumulate_grad_batches={32 // n}) keeps the global batch" in str(error)
    fits = decide(Small, [torch.randn(n, 16, 32)], intent, 2)  # and it does fit
    assert fits.peak <= 600 * 1024


def test_126_a_budget_with_tensor_parallel_is_refused_until_the_step_simulates_it() -> None:
    with pytest.raises(IntentError, match=r"memory_budget with tensor_parallel_size=2 is not decided yet.* Fix: drop memory_budget"):
        decide(Small, small_batch(), ShardingIntent(memory_budget="1GiB", tensor_parallel_size=2), 2)


def test_127_explain_json_answers_an_impossible_budget_with_an_error_entry_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", f"{__name__}:Small", "--batch", f"{__name__}:small_batch", "--budget", "600KiB", "--world-sizes", "2", "--json"]
    code = cli.main(argv)
    out = json.loads(capsys.readouterr().out)
    (entry,) = out["auto"]
    assert code == 1 and entry["world_size"] == 2 and entry["budget"] == 600 * 1024
    assert entry["error"]["type"] == "BudgetRefusedError" and entry["error"]["min_world_size"] is None
    assert "Fix: DataLoader(batch_size=" in entry["error"]["message"]


def test_128_a_block_checkpointed_twice_is_refused() -> None:
    block = Small().blocks[0]
    apply_checkpointing(block, True, 0)
    with pytest.raises(IntentError) as info:
        apply_checkpointing(block, "selective", 0)
    assert str(info.value) == (
        "Sequential is already activation-checkpointed (torch.distributed._composable.checkpoint was applied to it"
        " before). Fix: checkpoint each block once: leave it to ShardingIntent(activation_checkpointing=...)"
    )


def test_129_a_budget_is_decided_before_sharding_not_after() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        module = Small()
    with fake_world(2, 0):
        fully_shard(module.blocks[0], mesh=init_device_mesh("cpu", (2,)))
    with pytest.raises(IntentError) as info:
        decide(module, small_batch(), ShardingIntent(memory_budget="1GiB"), 2)
    assert str(info.value) == (
        "memory_budget is decided before sharding, but Small.blocks.0.0.weight is already sharded. Fix: decide on the"
        " unsharded module (the strategy does, at setup, before fully_shard)"
    )


# -- 131-135: the budget at fit, and under DeepSpeed --------------------------------------------------------------------
SELECTIVE_UNDER_DEEPSPEED = (
    "autoshard cannot run this on deepspeed_zero3 (strategy='autoshard-deepspeed'):\n"
    "  - op-level (selective) activation checkpointing [activation_checkpointing='selective']: ZeRO-3 gathers each"
    " submodule's parameters in hooks inside the block, and a recomputation in backward gathers them again where the"
    " forward found them prefetched, so torch's selective cache meets ops it never saw and stops the backward\n"
    "Backend that works: fsdp2 (strategy='fsdp2').\n"
    "Fix: activation_checkpointing=True (every block) or 2 (every 2nd block), or strategy='fsdp2' for 'selective'"
)
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@needs_deepspeed
def test_131_selective_activation_checkpointing_under_deepspeed_is_refused_when_the_strategy_is_built() -> None:
    from autoshard.fabric.deepspeed import AutoShardDeepSpeedStrategy as FabricDeepSpeed
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    for build in (AutoShardDeepSpeedStrategy, FabricDeepSpeed):  # the matrix's cell, said at construction
        with pytest.raises(IncompatibleBackendError) as built:
            build(activation_checkpointing="selective")
        assert str(built.value) == SELECTIVE_UNDER_DEEPSPEED
    with pytest.raises(IncompatibleBackendError) as decided:
        decide(Small, small_batch(), ShardingIntent(memory_budget="1GiB", activation_checkpointing="selective"), 2, backend="deepspeed")
    assert str(decided.value) == SELECTIVE_UNDER_DEEPSPEED
    AutoShardDeepSpeedStrategy(activation_checkpointing=2)  # every k-th block and every block run there
    AutoShardDeepSpeedStrategy(memory_budget="70GiB", activation_checkpointing=True)


class Flat(Small):
    """No repeated block: a single wide layer between the input and the head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32)])


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_138_activation_checkpointing_on_a_model_without_a_block_to_checkpoint_is_refused_not_ignored(backend: str) -> None:
    from autoshard.adapters.checkpointing import checkpoint_blocks
    from autoshard.adapters.fsdp2 import plan_fsdp2

    intent = ShardingIntent(activation_checkpointing=True)
    with pytest.raises(IntentError) as info:
        plan_fsdp2(Flat(), intent) if backend == "fsdp2" else checkpoint_blocks(Flat(), intent)
    assert str(info.value) == (
        "activation_checkpointing=True checkpoints repeated blocks (transformer layers, residual stages), and Flat has none"
        " that trains (none found by structure), so nothing would be recomputed and no memory saved. Fix: name the blocks,"
        " ShardingIntent(blocks=['MyBlock']) (class names or module paths as print(model) shows them), or drop"
        " activation_checkpointing"
    )
    frozen = Small().requires_grad_(False)
    frozen.head.requires_grad_(True)
    with pytest.raises(IntentError, match="Small has none that trains"):
        plan_fsdp2(frozen, intent) if backend == "fsdp2" else checkpoint_blocks(frozen, intent)
    named = intent.replace(blocks=("head",))
    assert (plan_fsdp2(Small(), named).units if backend == "fsdp2" else checkpoint_blocks(Small(), named)) is not None


def test_133_a_memory_budget_for_a_backend_it_does_not_decide_for_is_refused() -> None:
    with pytest.raises(IntentError) as info:
        decide(Small, small_batch(), ShardingIntent(memory_budget="1GiB"), 2, backend="fsdp1")
    assert str(info.value) == "memory_budget decides for fsdp2 and DeepSpeed ZeRO-3, not fsdp1. Fix: backend='fsdp2'"


def test_134_a_resume_whose_decision_chose_a_field_you_now_set_decides_again_and_says_so() -> None:
    stored = decide(Small, small_batch(), ShardingIntent(memory_budget="1GiB"), 2).to_dict()
    kept, said = resume_decision(stored, ShardingIntent(memory_budget="1GiB"), 2)
    assert kept is not None and said == "autoshard memory budget: kept the checkpoint's decision (reshard_after_forward=False)"
    again, said = resume_decision(stored, ShardingIntent(memory_budget="1GiB", offload="params"), 2)
    assert again is None and said == ("autoshard memory budget: decided again, the checkpoint's decision was for another run (you now set offload)")


def test_135_a_resume_that_could_not_keep_the_checkpoints_decision_warns_with_the_fields_to_set() -> None:
    # 3 MiB beside ZeRO-3's reduce bucket (allocated whole; bf16-mixed reduces in fp32) and the 2 MiB of weights it keeps
    # gathered
    budget = 4 * REDUCE_BUCKET_SIZE + (5 << 20)
    stored = decide(Wide, wide_batch(), ShardingIntent(memory_budget=budget, pinned=("activation_checkpointing",)), 2, backend="deepspeed")
    assert stored.chosen == {"offload": "optimizer"}
    made_here = dataclasses.replace(stored, chosen={"offload": "none"}, peak=stored.cheaper[0].peak)
    said = stored_differs(stored.to_dict(), made_here)
    assert said.startswith("autoshard memory budget: the checkpoint's run trained with offload='optimizer' (peak ")
    assert "it trains with defaults (nothing changed) (peak " in said and "the values are the same, memory and speed differ" in said
    assert said.endswith("Fix: to train as before, drop memory_budget and set ShardingIntent(offload='optimizer')")
    assert stored_differs(stored.to_dict(), stored) == "" and stored_differs(None, stored) == ""
    assert stored_differs(stored.to_dict(), dataclasses.replace(made_here, budget=2 * stored.budget)) == ""  # another run


class Empty(Small):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(0, 16, 32)), batch_size=4)


def one_device_fit(strategy: Any, model: Any, data: Any = None) -> Any:
    """One in-process fit on this machine's CPU (the 1-rank process group stays for the module: tests/conftest.py);
    the environment variables it sets are put back. Returns the Trainer."""
    import lightning.pytorch as pl

    environ = dict(os.environ)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, data)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return trainer


def budget_strategy(name: str, **fields: Any) -> Any:
    if name == "fsdp2":
        from autoshard.lightning import FSDP2Strategy

        return FSDP2Strategy(**fields)
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    return AutoShardDeepSpeedStrategy(**fields)


@pytest.mark.parametrize("name", ["fsdp2", pytest.param("autoshard-deepspeed", marks=needs_deepspeed)])
def test_132_a_memory_budget_at_fit_with_an_empty_train_dataloader_is_refused_before_sharding(name: str) -> None:
    model = Empty()
    with pytest.raises(IntentError) as info:
        one_device_fit(budget_strategy(name, memory_budget="1GiB", precision="32-true"), model)
    assert str(info.value) == (
        "memory_budget is decided on the first batch of the train DataLoader (the micro-batch training_step receives),"
        " and Empty's train DataLoader yielded none (an empty dataset, or drop_last=True with fewer samples than"
        " batch_size); nothing was sharded. Fix: give Trainer.fit a train DataLoader with at least one batch, or drop"
        " memory_budget and set the fields yourself (autoshard explain --budget shows each configuration's peak)"
    )
    assert not any(hasattr(p, "ds_id") or hasattr(p, "placements") for p in model.parameters())


def test_136_a_memory_budget_with_a_parallelize_fn_is_refused_before_anything_is_sharded() -> None:
    from autoshard.lightning import FSDP2Strategy

    called: list[str] = []
    model = Small()
    strategy = FSDP2Strategy(memory_budget="1GiB", parallelize_fn=lambda module, mesh: called.append(type(module).__name__))
    with pytest.raises(IntentError) as info:
        one_device_fit(strategy, model, DataLoader(TensorDataset(torch.randn(8, 16, 32)), batch_size=4))
    assert str(info.value) == (
        "memory_budget chooses the settings of autoshard's own sharding plan (activation checkpointing, resharding,"
        " offload), and your parallelize_fn replaces it, so the decision would be ignored; nothing was sharded. Fix: drop"
        " memory_budget and set what your own sharding needs yourself (autoshard explain --budget shows each"
        " configuration's peak), or let autoshard shard (no parallelize_fn, no fully_shard in configure_model)"
    )
    assert called == [] and not any(hasattr(p, "placements") for p in model.parameters())
