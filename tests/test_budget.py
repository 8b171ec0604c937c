"""``autoshard explain --batch --budget``: the peak includes activations, and a run that does not fit gets the
settings that do, each estimated again in full."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from autoshard import cli
from autoshard.budget import CUDA_HEADROOM, Headroom
from autoshard.demo import DinoLike, make_batch
from autoshard.errors import AutoShardError, IntentError
from autoshard.explain import ExplainOptions, Report, explain
from autoshard.intent import ShardingIntent
from autoshard.units import parse_size

TARGET = "autoshard.demo:DinoLike"
BATCH = "autoshard.demo:make_batch"


@pytest.fixture(scope="module")
def table() -> Report:
    return explain(TARGET, world_sizes=(2, 8), batch=BATCH)


def test_the_peak_includes_activations(table: Report) -> None:
    for e in table.memory:
        assert e.activations > 0 and e.step_peak == e.total and not e.forward_only
        assert e.total > e.model_states + e.step_gathered  # activations are part of the peak
        assert e.total == e.model_states + e.step_gathered + e.activations + e.other_at_peak
    two, eight = table.memory
    assert two.activations == eight.activations  # ranks shard states, not activations
    assert eight.model_states < two.model_states / 3
    text = table.text()
    assert "activations + temporaries at the peak" in text and "= peak per rank (simulated training step)" in text


def test_json_memory_entries_carry_activations_and_the_total_includes_them(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["explain", TARGET, "--world-sizes", "2", "--batch", BATCH, "--budget", "80GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["error"] is None and out["incomplete"] is None
    assert out["budget"] == {
        "budget": 80 * 2**30,
        "world_size": 2,
        "peak": out["memory"][0]["device"],
        "fits": True,
        "changes": [],
        "notes": [],
        "missing": "",
        "headroom": (CUDA_HEADROOM if torch.cuda.is_available() else Headroom()).to_dict(),  # what decide keeps free here
    }
    (entry,) = out["memory"]
    assert entry["activations"] > 0
    assert entry["total"] == entry["model_states"] + entry["step_gathered"] + entry["activations"] + entry["other_at_peak"]


def test_a_bigger_micro_batch_needs_more_activation_memory(table: Report) -> None:
    bigger = explain(TARGET, world_sizes=(2,), batch=lambda: make_batch(128))
    ratio = bigger.memory[0].activations / table.memory[0].activations
    # 4x the rows: about 4x the activations at the peak (the peak's moment can move, so not exactly)
    assert 3.0 < ratio < 5.0, ratio


def test_a_run_that_fits_says_so_and_proposes_nothing(table: Report) -> None:
    report = explain(TARGET, world_sizes=(8,), batch=BATCH, budget=2 * table.memory[1].total, options=ExplainOptions(auto=False))
    assert report.budget is not None and report.budget.fits and report.budget.changes == ()
    assert "fits" in report.text() and "does NOT fit" not in report.text()


def test_a_run_that_does_not_fit_gets_changes_that_do(table: Report) -> None:
    budget = int(table.memory[1].total * 0.85)
    report = explain(TARGET, world_sizes=(8,), batch=BATCH, budget=budget, options=ExplainOptions(auto=False))
    verdict = report.budget
    assert verdict is not None and not verdict.fits and verdict.peak == table.memory[1].device
    fitting = {c.change.split(" ")[0]: c for c in verdict.changes if c.fits}
    assert {"activation_checkpointing=True", "micro-batch", "offload='params'"} <= set(fitting), verdict.changes
    assert all(c.peak <= budget for c in fitting.values())
    # Each change is a full estimate: the same figure explain gives with that setting.
    checkpointed = explain(TARGET, world_sizes=(8,), batch=BATCH, intent=ShardingIntent(activation_checkpointing=True))
    assert fitting["activation_checkpointing=True"].peak == checkpointed.memory[0].device
    assert checkpointed.memory[0].activations < table.memory[1].activations
    assert "changes that fit, cheapest first:" in report.text()


def test_nothing_fits_a_tiny_budget_and_it_says_what_was_tried() -> None:
    report = explain(TARGET, world_sizes=(8,), batch=BATCH, budget="8KiB", options=ExplainOptions(auto=False))
    assert report.budget is not None and not any(c.fits for c in report.budget.changes)
    text = report.budget.text()
    assert "nothing autoshard tried fits" in text and "activation_checkpointing=True" in text


def test_without_a_batch_example_input_array_is_forwarded() -> None:
    class WithExample(DinoLike):
        def __init__(self) -> None:
            super().__init__()
            self.example_input_array = torch.randn(4, 16)

        def forward(self, x: torch.Tensor) -> Any:
            return self.student(x)

    report = explain(WithExample, world_sizes=(2,))
    (e,) = report.memory
    assert e.forward_only and e.activations > 0
    assert "simulated forward" in report.text()


def test_no_batch_and_no_example_counts_states_only_and_says_how_to_add_activations() -> None:
    report = explain(TARGET, world_sizes=(2,))
    assert report.memory[0].activations == 0 and report.memory[0].step_peak == 0
    assert "activations are not counted: pass --batch FILE.py:make_batch" in report.text()


@pytest.mark.parametrize("text", ["80 gigs", "0GiB", "-1"])
def test_a_budget_that_is_not_a_size_is_refused(text: str) -> None:
    with pytest.raises(AutoShardError, match=r"--budget .* Fix: .*80GiB"):
        parse_size(text)


def test_sizes_read_like_people_write_them() -> None:
    assert parse_size("80GiB") == 80 * 2**30 and parse_size("5GB") == 5 * 10**9 and parse_size("1.5KiB") == 1536


def test_world_sizes_the_shard_size_does_not_divide_are_left_out_with_a_note() -> None:
    report = explain(TARGET, world_sizes=(2, 4, 8), intent=ShardingIntent(shard_size=4), options=ExplainOptions(simulate=False))
    assert [e.world_size for e in report.memory] == [4, 8]
    assert any("world size(s) 2 left out: shard_size=4" in n for n in report.notes)
    with pytest.raises(IntentError, match=r"fits none of the world sizes 2, 3\. Fix: .*--world-sizes 4,8,32"):
        explain(TARGET, world_sizes=(2, 3), intent=ShardingIntent(shard_size=4), options=ExplainOptions(simulate=False))


def test_more_ranks_are_proposed_in_whole_nodes() -> None:
    from autoshard.budget import whole_nodes

    assert [whole_nodes(n, 8) for n in (4, 8, 12, 16, 20)] == [4, 8, 16, 16, 24]


def test_under_hybrid_sharding_a_bigger_shard_group_is_proposed(table: Report) -> None:
    by_four = explain(TARGET, world_sizes=(8,), batch=BATCH, intent=ShardingIntent(shard_size=4)).memory[0].device
    hybrid = explain(TARGET, world_sizes=(8,), batch=BATCH, intent=ShardingIntent(shard_size=2), budget=by_four, options=ExplainOptions(auto=False))
    verdict = hybrid.budget
    assert verdict is not None and not verdict.fits
    groups = [c for c in verdict.changes if c.change.startswith("shard_size=")]
    assert [(c.change, c.fits, c.peak) for c in groups] == [("shard_size=4 (was 2)", True, by_four)], verdict.changes
    assert not any(c.change.endswith("ranks (Trainer num_nodes x devices)") for c in verdict.changes)  # ranks do not help
    # Past the last group size that divides the world, sharding over every rank is what is left.
    tight = explain(
        TARGET, world_sizes=(8,), batch=BATCH, intent=ShardingIntent(shard_size=2), budget=table.memory[1].total, options=ExplainOptions(auto=False)
    )
    assert [c.change for c in tight.budget.changes if c.change.startswith("shard_size=")] == ["shard_size=None (shard over every rank)"]


def test_deepspeed_peak_adds_the_simulated_activations_to_its_own_estimate() -> None:
    import textwrap

    report = explain(SingleOptimizer, backend="deepspeed", world_sizes=(2,), batch=lambda: (torch.randn(64, 64),))
    (e,) = report.memory
    assert e.activations > 0 and e.step_peak == 0  # the step ran FSDP2's plan: only its activations are DeepSpeed's
    assert e.total == e.model_states + e.gathered_block + e.activations
    assert "activations + temporaries (simulated training step)" in report.text()
    assert any("simulated FSDP2 step" in n for n in report.notes), textwrap.shorten(str(report.notes), 300)


class SingleOptimizer(DinoLike.__mro__[1]):  # a plain LightningModule: one optimizer, no EMA, so DeepSpeed can run it
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.body(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


class NeedsThirtyTwoRows(SingleOptimizer):
    """Its step only runs on the micro-batch given (a fixed reshape): a smaller one cannot be simulated."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.body(x.reshape(32, 2, 64).sum(1)).pow(2).mean()


def test_a_change_whose_step_cannot_be_simulated_is_never_said_to_fit() -> None:
    full = explain(NeedsThirtyTwoRows, world_sizes=(2,), batch=lambda: (torch.randn(64, 64),))
    (e,) = full.memory
    assert e.activations > 0 and not full.incomplete
    report = explain(
        NeedsThirtyTwoRows, world_sizes=(2,), batch=lambda: (torch.randn(64, 64),), budget=e.device - 1, options=ExplainOptions(auto=False)
    )
    verdict = report.budget
    assert verdict is not None and verdict.fits is False and report.exit_code == 0
    (smaller,) = [c for c in verdict.changes if c.change.startswith("micro-batch")]
    assert smaller.change == "micro-batch 32 (was 64)" and not smaller.fits and smaller.missing == "activations"
    assert "not estimated in full (its simulated step could not run), so no verdict:" in verdict.text()


def wide_rows(n: int) -> Any:
    return lambda: [torch.randn(n, 16 if n > 2 else 4, 256)]


def test_more_ranks_are_the_smallest_world_size_that_fits_found_by_search_not_doubling() -> None:
    from tests.test_bad_inputs_budget import Wide  # model states dominate: ranks help

    three = explain(Wide, world_sizes=(3,), batch=wide_rows(2)).memory[0].device
    report = explain(Wide, world_sizes=(2,), batch=wide_rows(2), budget=three, options=ExplainOptions(auto=False))
    ranks = [c for c in report.budget.changes if c.change.endswith("ranks (Trainer num_nodes x devices)")]
    assert [(c.change, c.fits, c.peak) for c in ranks] == [("3 ranks (Trainer num_nodes x devices)", True, three)], report.budget.changes


def test_when_no_change_fits_alone_the_fewest_together_are_proposed_and_the_smaller_ones_shown() -> None:
    """Activations and states both large: no single change fits, a pair does. Nothing with three changes or more
    ranks is proposed (the advice once said "16 ranks + checkpointing + offload + micro-batch 1" where two sufficed)."""
    from tests.test_bad_inputs_budget import Wide

    report = explain(Wide, world_sizes=(2,), batch=wide_rows(64), budget="6MiB", options=ExplainOptions(auto=False))
    verdict = report.budget
    fitting = [c for c in verdict.changes if c.fits]
    assert len(fitting) == 1 and fitting[0].change.count(" + ") == 1 and fitting[0].peak <= 6 * 2**20, verdict.changes
    tried = [c.change for c in verdict.changes if not c.fits]
    singles = [c for c in tried if " + " not in c]
    assert {c.split(" ")[0] for c in singles} == {"activation_checkpointing=True", "micro-batch", "offload='params'"}, tried
    assert all(c.count(" + ") <= 1 for c in tried) and not any("ranks" in c for c in verdict_lines(verdict))
    text = verdict.text()
    assert "changes that fit, cheapest first:" in text and "estimated, not enough on its own:" in text


def verdict_lines(verdict: Any) -> list[str]:
    return [c.change for c in verdict.changes]


def test_explain_json_gains_auto_one_decision_per_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "explain",
            "tests.test_budget_decide:Small",
            "--batch",
            "tests.test_budget_decide:batch",
            "--world-sizes",
            "2,4",
            "--budget",
            "1GiB",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [e["world_size"] for e in out["auto"]] == [2, 4]
    for entry in out["auto"]:
        assert entry["budget"] == 2**30 and entry["peak"] <= 2**30 and entry["cheaper"] == []
        assert ShardingIntent(**entry["chosen"]) == ShardingIntent(reshard_after_forward=False)  # pasteable
    text = explain("tests.test_budget_decide:Small", world_sizes=(2,), batch="tests.test_budget_decide:batch", budget="1GiB").text()
    assert "== memory budget: what ShardingIntent(memory_budget=...) would choose ==" in text and "chosen: reshard_after_forward=False" in text
