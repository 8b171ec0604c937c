"""Precision resolved once: the dtypes each precision string stands for, how each backend runs them, and the guide's
table of them (generated from the code, so it cannot drift)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autoshard import Feature, IntentError, MethodNeeds, ShardingIntent, Support, matrix, select_backend
from autoshard.adapters.fsdp2 import plan_fsdp2, policies
from autoshard.backends import Availability, on_backend
from autoshard.backends.matrix import precision_table
from autoshard.precision import Dtype, Precision, resolve_precision

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
ALL_INSTALLED = {name: Availability(True, "installed (test)") for name in ("fsdp2", "deepspeed_zero3", "fsdp1")}

# precision -> (compute, autocast, gather, reduce, master): Lightning's meaning, FSDP2's standard for "-mixed".
EXPECTED = {
    "bf16-mixed": ("bfloat16", True, "bfloat16", "float32", "float32"),
    "32-true": ("float32", False, "float32", "float32", "float32"),
    "bf16-true": ("bfloat16", False, "bfloat16", "bfloat16", "bfloat16"),
    "16-mixed": ("float16", True, "float16", "float32", "float32"),
    "16-true": ("float16", False, "float16", "float16", "float16"),
}


@pytest.mark.parametrize("precision", list(EXPECTED))
def test_each_precision_string_stands_for_one_set_of_dtypes(precision: str) -> None:
    plan = resolve_precision(precision, ShardingIntent())
    assert (plan.compute, plan.autocast, plan.gather, plan.reduce, plan.master) == EXPECTED[precision]
    assert plan.loss_scaling is (precision == "16-mixed")
    assert resolve_precision(None, ShardingIntent(precision=precision)) == plan  # no Trainer: the intent's


def test_unstated_precision_is_bf16_mixed_and_the_trainer_fills_it() -> None:
    assert resolve_precision(None, ShardingIntent()).precision is Precision.BF16_MIXED
    assert resolve_precision("32", ShardingIntent()).precision is Precision.FP32  # Lightning's short spelling


def test_the_intents_dtypes_replace_the_gather_and_reduce_dtypes() -> None:
    opted_out = resolve_precision("bf16-mixed", ShardingIntent(param_dtype="float32"))
    assert (opted_out.compute, opted_out.autocast, opted_out.gather, opted_out.reduce) == ("bfloat16", True, "float32", "float32")
    cheap = resolve_precision("bf16-mixed", ShardingIntent(reduce_dtype="bfloat16"))
    assert (cheap.gather, cheap.reduce, cheap.master) == ("bfloat16", "bfloat16", "float32")
    cast = resolve_precision("32-true", ShardingIntent(param_dtype="bfloat16"))
    assert (cast.compute, cast.gather, cast.master) == ("bfloat16", "bfloat16", "float32")  # no autocast: the gather


def test_an_intent_contradicting_the_trainer_is_refused_naming_both() -> None:
    with pytest.raises(IntentError) as info:
        resolve_precision("32-true", ShardingIntent(precision="bf16-true"))
    assert str(info.value) == (
        "precision is given twice and differs: ShardingIntent(precision='bf16-true') but Trainer(precision='32-true')."
        " Fix: set it once, in the Trainer (Trainer(precision='bf16-true')), and drop it from the intent"
    )
    assert resolve_precision("bf16", ShardingIntent(precision="bf16-mixed")).precision == "bf16-mixed"


@pytest.mark.parametrize(
    ("precision", "intent", "policy"),
    [
        ("bf16-mixed", {}, (torch.bfloat16, torch.float32)),  # torchtitan's and Lightning's FSDP2 examples
        ("bf16-mixed", {"param_dtype": "float32"}, (None, None)),  # the opt-out: what autoshard passed before
        ("32-true", {}, (None, None)),
        ("bf16-true", {}, (None, None)),  # the module is already bf16: nothing to cast
        ("bf16-true", {"reduce_dtype": "float32"}, (None, torch.float32)),
        ("32-true", {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, (torch.bfloat16, torch.float32)),
    ],
)
def test_fsdp2_gets_the_plan_as_a_mixed_precision_policy(precision: str, intent: dict, policy: tuple) -> None:
    mp, _ = policies(resolve_precision(precision, ShardingIntent(**intent)), ShardingIntent(**intent), "cpu")
    assert (mp.param_dtype, mp.reduce_dtype) == policy


def test_the_plan_reaches_the_fsdp2_plan_and_its_printed_settings() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plan = plan_fsdp2(model, ShardingIntent(), precision=resolve_precision("32-true", ShardingIntent()))
    assert plan.to_dict()["settings"]["mp_policy"] == {"param_dtype": "float32", "reduce_dtype": "float32"}
    assert plan_fsdp2(model).to_dict()["settings"]["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def test_deepspeed_runs_the_plan_without_autocast_and_with_fp32_master_weights() -> None:
    for precision in ("bf16-mixed", "bf16-true", "16-true"):
        run = on_backend(resolve_precision(precision, ShardingIntent()), "deepspeed_zero3")
        assert not run.autocast and run.master is Dtype.FLOAT32
        assert run.gather is run.compute is Precision(precision).dtype
    assert on_backend(resolve_precision("16-true", ShardingIntent()), "deepspeed_zero3").loss_scaling
    plan = resolve_precision("bf16-mixed", ShardingIntent(param_dtype="float32"))
    assert on_backend(plan, "fsdp2") is plan
    with pytest.raises(IntentError, match=r"param_dtype='float32' contradicts precision='bf16-mixed'.*Fix: drop param_dtype"):
        on_backend(plan, "deepspeed_zero3")


def test_where_numerics_differ_the_matrix_says_so() -> None:
    """bf16-true / 16-true keep no fp32 copy under FSDP2 but do under ZeRO-3: partial fsdp2 cells, with the fix."""
    rows = matrix()
    for feature in (Feature.BF16_TRUE, Feature.FP16_TRUE):
        cell = rows["fsdp2"][feature]
        assert cell.support is Support.PARTIAL and "no fp32 master copy" in cell.reason and "ZeRO-3 keeps" in cell.reason
        assert cell.remedy.startswith("use precision='bf16-mixed'")
        assert rows["deepspeed_zero3"][feature].support is Support.YES
    decision = select_backend(MethodNeeds(), ShardingIntent(precision="bf16-true"), available=ALL_INSTALLED)
    assert decision.backend == "fsdp2"  # a caveat, not a reason to leave fsdp2: precision never steers auto
    assert [c.feature for c in decision.caveats] == [Feature.BF16_TRUE]
    assert "caveat: bf16 weights (bf16-true) [precision='bf16-true']" in decision.describe()


def test_the_guide_table_is_the_generated_one() -> None:
    page = GUIDE.read_text()
    block = re.search(
        r"<!-- BEGIN GENERATED PRECISION TABLE: autoshard\.backends\.matrix\.precision_table\(\) -->\n(.*?)\n<!-- END GENERATED PRECISION TABLE -->",
        page,
        flags=re.S,
    )
    assert block, "docs/guide.md lost its generated precision table"
    assert block.group(1) == precision_table(), "docs/guide.md's precision table is stale: paste precision_table() into it"
    assert page.index("<!-- BEGIN GENERATED PRECISION TABLE") > page.index("## Mixed precision")
