"""An intent field given as a strategy keyword beside ``intent=`` (issue 39, item 3): one rule for both front ends
(Trainer, Fabric) and both engines (fsdp2 / auto-shard, autoshard-deepspeed).

A keyword that differs from a field the intent sets is refused, naming both values, as a precision given twice is
(the old rule dropped a keyword equal to its field's default, so ``checkpoint="distributed"`` beside
``intent=ShardingIntent(checkpoint="full")`` silently wrote a full file, and DeepSpeed's strategies let the keyword
win). A keyword that agrees with the intent, a keyword on a field the intent leaves at its default, a keyword alone and
an intent alone keep working. LightningCLI passes only the keys a config gives (``IntentKeywords``), so an explicit
``compile: false`` beside ``intent: {compile: auto}`` is refused there too. All in process: strategies are only built.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import autoshard  # noqa: F401  registers the strategies
from autoshard import ShardingIntent
from autoshard.errors import IntentError
from autoshard.fabric import factory as fabric_factory
from autoshard.fabric import strategies as fabric_fsdp2
from autoshard.lightning import AutoShardStrategy, FSDP2Strategy
from autoshard.lightning import auto_shard as trainer_auto_shard

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


def twice(build: Callable[[], Any], message: str) -> None:
    with pytest.raises(IntentError) as info:
        build()
    assert str(info.value) == message


CHECKPOINT_TWICE = (
    "checkpoint is given twice and differs: intent=ShardingIntent(checkpoint='full') but checkpoint='distributed' beside it."
    " Fix: set checkpoint in one place: drop checkpoint='distributed', or move it into the intent"
    " (ShardingIntent(..., checkpoint='distributed'))"
)


def test_183_the_issue_examples_are_refused_under_the_trainer_fsdp2() -> None:
    """The three examples of the issue, each a keyword equal to its field's default that used to be dropped."""
    twice(lambda: FSDP2Strategy(intent=ShardingIntent(checkpoint="full"), checkpoint="distributed"), CHECKPOINT_TWICE)
    twice(
        lambda: FSDP2Strategy(intent=ShardingIntent(compile=True), compile=False),
        "compile is given twice and differs: intent=ShardingIntent(compile=True) but compile=False beside it."
        " Fix: set compile in one place: drop compile=False, or move it into the intent (ShardingIntent(..., compile=False))",
    )
    twice(
        lambda: AutoShardStrategy(intent={"offload": "params"}, offload="none"),
        "offload is given twice and differs: intent=ShardingIntent(offload='params') but offload='none' beside it."
        " Fix: set offload in one place: drop offload='none', or move it into the intent (ShardingIntent(..., offload='none'))",
    )
    # Two fields at once are named together; a non-default keyword against a non-default field too.
    twice(
        lambda: FSDP2Strategy(
            intent=ShardingIntent(checkpoint="full", activation_checkpointing=True), checkpoint="distributed", activation_checkpointing=2
        ),
        "checkpoint and activation_checkpointing are given twice and differ: intent=ShardingIntent(checkpoint='full',"
        " activation_checkpointing=True) but checkpoint='distributed', activation_checkpointing=2 beside it. Fix: set"
        " checkpoint and activation_checkpointing in one place: drop checkpoint='distributed', activation_checkpointing=2,"
        " or move them into the intent (ShardingIntent(..., checkpoint='distributed', activation_checkpointing=2))",
    )
    with pytest.raises(IntentError, match=r"unknown offload 'parms' \(did you mean 'params'\?\).*Fix: offload='params'$"):
        FSDP2Strategy(intent={"offload": "params"}, offload="parms")  # a bad value keeps its own message, not "twice"
    # What keeps working: agreeing (as written or in another spelling), another field, a keyword alone, an intent alone.
    agreeing = FSDP2Strategy(intent=ShardingIntent(checkpoint="full", activation_checkpointing=True), checkpoint="full", activation_checkpointing=1)
    assert (agreeing.intent.checkpoint, agreeing.intent.activation_checkpointing) == ("full", True)
    merged = FSDP2Strategy(intent=ShardingIntent(checkpoint="full"), offload="params", compile=False).intent
    assert (merged.checkpoint, merged.offload, merged.compile) == ("full", "params", False)
    assert FSDP2Strategy(checkpoint="full").intent.checkpoint == "full"
    assert FSDP2Strategy(intent=ShardingIntent(checkpoint="full")).intent.checkpoint == "full"


def test_the_auto_shard_factories_of_both_front_ends_refuse_it_on_either_engine() -> None:
    """``strategy="auto-shard"`` with an intent: the same rule whether the intent leads to fsdp2 or to DeepSpeed
    (``offload='optimizer'``), from the Trainer's factory and from Fabric's."""
    for auto_shard in (trainer_auto_shard, fabric_factory.auto_shard):
        twice(lambda: auto_shard(intent=ShardingIntent(checkpoint="full"), checkpoint="distributed"), CHECKPOINT_TWICE)
        twice(
            lambda: auto_shard(intent={"offload": "optimizer"}, offload="params"),
            "offload is given twice and differs: intent=ShardingIntent(offload='optimizer') but offload='params' beside"
            " it. Fix: set offload in one place: drop offload='params', or move it into the intent (ShardingIntent(...,"
            " offload='params'))",
        )
        assert auto_shard(intent={"compile": "auto"}, compile="auto", checkpoint="full").intent.compile == "auto"


def test_fabric_fsdp2_strategies_refuse_it() -> None:
    for strategy in (fabric_fsdp2.FSDP2Strategy, fabric_fsdp2.AutoShardStrategy):
        twice(lambda: strategy(intent=ShardingIntent(checkpoint="full"), checkpoint="distributed"), CHECKPOINT_TWICE)
        built = strategy(intent=ShardingIntent(checkpoint="full"), checkpoint="full", reshard_after_forward=False).intent
        assert (built.checkpoint, built.reshard_after_forward) == ("full", False)


@needs_deepspeed
def test_deepspeed_strategies_of_both_front_ends_refuse_it() -> None:
    """DeepSpeed's strategies let the keyword win (``base.replace(**fields)``): now the same refusal as fsdp2's."""
    from autoshard.fabric.deepspeed import AutoShardDeepSpeedStrategy as FabricDeepSpeed
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy as TrainerDeepSpeed

    for strategy in (TrainerDeepSpeed, FabricDeepSpeed):
        twice(lambda: strategy(ShardingIntent(checkpoint="full"), checkpoint="distributed"), CHECKPOINT_TWICE)
        twice(
            lambda: strategy({"offload": "params"}, offload="optimizer"),
            "offload is given twice and differs: intent=ShardingIntent(offload='params') but offload='optimizer' beside"
            " it. Fix: set offload in one place: drop offload='optimizer', or move it into the intent (ShardingIntent(...,"
            " offload='optimizer'))",
        )
        built = strategy({"offload": "params"}, offload="params", checkpoint="full").intent
        assert (built.offload, built.checkpoint) == ("params", "full")
        assert strategy(offload="optimizer").intent.offload == "optimizer"


def test_184_lightning_cli_refuses_an_explicit_field_beside_a_conflicting_intent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``{intent: {compile: auto}, compile: false}`` gave 'auto': jsonargparse passed every field, defaults included,
    so the explicit ``false`` looked like one it filled in. Now it passes only the keys the config gives."""
    from lightning.pytorch.cli import LightningCLI

    from tests.test_bad_inputs import Net

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads only the config given to it

    def strategy(class_path: str, init_args: str) -> Any:
        config = tmp_path / "config.yaml"
        config.write_text(
            "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
            f"    class_path: {class_path}\n    init_args:\n" + textwrap.indent(init_args, "      ")
        )
        return LightningCLI(Net, run=False, save_config_callback=None, args=["--config", str(config)]).trainer.strategy

    fsdp2, auto = "autoshard.lightning.FSDP2Strategy", "autoshard.lightning.AutoShardStrategy"
    with pytest.raises(ValueError, match=r"compile is given twice and differs: intent=ShardingIntent\(compile='auto'\) but compile=False"):
        strategy(fsdp2, "intent:\n  compile: auto\ncompile: false\n")
    with pytest.raises(ValueError, match=r"checkpoint is given twice and differs: .* Fix: set checkpoint in one place"):
        strategy(auto, "intent:\n  checkpoint: full\ncheckpoint: distributed\n")
    assert strategy(fsdp2, "intent:\n  compile: auto\n").intent.compile == "auto"
    assert strategy(fsdp2, "intent:\n  compile: auto\ncompile: auto\n").intent.compile == "auto"
    assert strategy(fsdp2, "compile: false\n").intent.compile is False
    both = strategy(auto, "intent:\n  checkpoint: full\noffload: params\nmemory_budget: 80GB\n").intent
    assert (both.checkpoint, both.offload, both.memory_budget) == ("full", "params", 80_000_000_000)
