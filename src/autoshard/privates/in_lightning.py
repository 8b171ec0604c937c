"""Every private Lightning member autoshard touches, the Trainer's (``TRAINER``) and Fabric's (``FABRIC``): where, and
why; the one Lightning range they are verified on; and the check and refusal when the installed Lightning differs.

Lightning may rename or drop a private member in any release. tests/lightning/test_compat.py and
tests/fabric/test_fabric_registration.py check every entry on the installed Lightning (so an upgrade that breaks one
fails there, by name), and that pyproject.toml declares SUPPORTED_LIGHTNING. Outside that range, or when a listed
Trainer member is gone, ``check_lightning`` warns, once, on rank 0, when ``import autoshard`` registers the
strategies, and says what autoshard then leaves as Lightning has it (``Private.without``): a guard whose member is gone
is not installed, and Lightning's own strategies are not replaced, so nothing the user asks of Lightning itself is
refused. A strategy whose hooked member is gone refuses to be built (``lightning_lacks``), with the pin.

Public behaviours relied on as well (tested where they are used, not listed below):
- ``ModelParallelStrategy.setup`` refuses a module whose ``configure_model`` is not overridden: FSDP2Strategy sets
  an instance attribute for the duration of that call (autoshard shards instead).
- ``DeepSpeedStrategy.setup_environment`` adds only a CUDA-only refusal to ``DDPStrategy.setup_environment``, which
  the CPU path calls directly; ``setup_distributed`` checks device indices, which CPU devices lack.
- ``StrategyRegistry`` is a dict of ``{"strategy", "description", "init_params"}`` entries, read raw so that
  nothing is instantiated (autoshard.lightning.register, register_deepspeed_strategies); Fabric's
  ``STRATEGY_REGISTRY`` entries likewise.
- Fabric's ``ModelParallelStrategy.setup_module`` calls the ``parallelize_fn`` given to ``__init__``, then
  materializes meta tensors; ``fabric.save`` / ``fabric.load`` hand over the unwrapped objects.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from autoshard.errors import BackendUnavailableError
from autoshard.privates import Private, missing, provide

SUPPORTED_LIGHTNING = ">=2.6,<2.7"  # the minor release the members are verified on; pyproject.toml says the same
PIN = f'pip install "lightning{SUPPORTED_LIGHTNING}"'


def engine_members(strategies: str, left: str, left_deepspeed: str) -> tuple[Private, ...]:
    """The members ``engine/`` hooks in a front end's strategies (``strategies``: ``lightning.pytorch.strategies`` or
    ``lightning.fabric.strategies``); ``left`` / ``left_deepspeed``: what is refused when one is gone."""
    model_parallel, deepspeed = f"{strategies}.ModelParallelStrategy", f"{strategies}.DeepSpeedStrategy"
    return (
        Private(
            model_parallel,
            "_configure_launcher",
            "autoshard.engine.base",
            "overridden: construction's last step, once the precision is known",
            without=left,
        ),
        Private(
            model_parallel,
            "_data_parallel_size",
            "autoshard.engine.fsdp2",
            "set from the intent before 'auto' (tensor parallel within a node)",
            on_instance=True,
        ),
        Private(model_parallel, "_tensor_parallel_size", "autoshard.engine.fsdp2", "set with _data_parallel_size", on_instance=True),
        Private(deepspeed, "_configure_launcher", "autoshard.engine.base", "overridden, as for ModelParallelStrategy", without=left_deepspeed),
    )


_CONNECTOR = "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector"
_FABRIC_CONNECTOR = "lightning.fabric.connector._Connector"
_DEEPSPEED = "lightning.pytorch.strategies.DeepSpeedStrategy"
_MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
_LEFT_DEEPSPEED = (
    "Lightning's 'deepspeed*' names stay Lightning's own DeepSpeedStrategy (autoshard refuses nothing there) and"
    " strategy='autoshard-deepspeed' is refused"
)
_LEFT_FSDP2 = "strategy='fsdp2' and 'auto-shard' are refused (they could not set their mesh before Lightning does)"


def _slurm_guard(connector: str, under: str) -> tuple[Private, Private]:
    """The SLURM guard's members, on the Trainer's connector and on Fabric's alike."""
    return (
        Private(
            connector,
            "_choose_and_init_cluster_environment",
            "autoshard.lightning.guards",
            "wrapped: under SLURM a task count or rank that is not a number is refused by name, before Lightning's bare int()",
            without=f"{under}a SLURM number that is not one (SLURM_NTASKS=abc) gets Lightning's own ValueError",
        ),
        Private(
            connector, "_cluster_environment_flag", "autoshard.lightning.guards", "read: a cluster environment the user passed", on_instance=True
        ),
    )


def _fp16_guard(connector: str, flag: str, given: str, under: str) -> tuple[Private, Private, Private]:
    """The 16-mixed guard's members (autoshard.engine.fp16's plugin under fsdp2), on the Trainer's connector and on
    Fabric's: the method wrapped, the precision asked for and the plugin the user passed, each under its own name."""
    return (
        Private(
            connector,
            "_check_and_init_precision",
            "autoshard.lightning.guards",
            "wrapped: precision='16-mixed' under fsdp2 / auto-shard gets autoshard's plugin (a sharded grad scaler), where"
            " Lightning refuses ModelParallelStrategy with 16-mixed and on CPU runs bf16-mixed instead",
            without=f"{under}16-mixed under fsdp2 is Lightning's: refused for a strategy object, bf16-mixed on CPU, unscaled on GPU",
        ),
        Private(connector, flag, "autoshard.lightning.guards", "read: the precision the user passed", on_instance=True),
        Private(connector, given, "autoshard.lightning.guards", "read: a precision plugin the user passed (then kept)", on_instance=True),
    )


TRAINER: tuple[Private, ...] = (
    Private(
        _CONNECTOR,
        "_check_strategy_and_fallback",
        "autoshard.lightning.guards",
        "wrapped: strategy='fsdp' or an FSDPStrategy object is refused before Lightning's own CPU check replaces our redirect",
        without="FSDP1 (strategy='fsdp', FSDPStrategy objects) is not refused by autoshard",
    ),
    Private(
        _CONNECTOR,
        "_validate_precision_choice",
        "autoshard.lightning.guards",
        "wrapped: a precision fsdp2 cannot run (64-true, ...) is refused for strategy names too, in Trainer terms"
        " (Lightning checks instances only and says 'Fabric(...)')",
        without="a precision fsdp2 cannot run is refused only once the strategy sees the Trainer's precision",
    ),
    *_fp16_guard(_CONNECTOR, "_precision_flag", "_precision_plugin_flag", ""),
    *_fp16_guard(_FABRIC_CONNECTOR, "_precision_input", "_precision_instance", "under Fabric, "),
    *_slurm_guard(_CONNECTOR, ""),
    *_slurm_guard(_FABRIC_CONNECTOR, "under Fabric, "),
    Private(_CONNECTOR, "_strategy_flag", "autoshard.lightning.guards", "read: the strategy the user passed", on_instance=True),
    *engine_members("lightning.pytorch.strategies", _LEFT_FSDP2, _LEFT_DEEPSPEED),
    Private(
        _MODEL_PARALLEL, "_save_distributed_checkpoint", "autoshard.lightning.checkpoint", "read: a DCP directory or one full file", on_instance=True
    ),
    Private(
        _MODEL_PARALLEL,
        "_layer_sync",
        "autoshard.lightning.fsdp2",
        "read: Trainer(sync_batchnorm=True), which ModelParallelStrategy ignores and autoshard applies",
        on_instance=True,
    ),
    Private(
        _DEEPSPEED,
        "_layer_sync",
        "autoshard.lightning.deepspeed",
        "read: Trainer(sync_batchnorm=True), which DeepSpeedStrategy ignores and autoshard applies",
        on_instance=True,
    ),
    Private(
        _DEEPSPEED,
        "_format_config",
        "autoshard.lightning.deepspeed",
        "overridden: Lightning calls it lazily (setup, model_sharded_context) when the config must be final",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        _DEEPSPEED,
        "_auto_select_batch_size",
        "autoshard.lightning.deepspeed",
        "called: Lightning's per-device batch size from the train DataLoader, so both strategies agree",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        _DEEPSPEED,
        "_init_deepspeed_distributed",
        "autoshard.lightning.deepspeed",
        "called on CPU: MASTER_*/RANK env, gloo for a CPU root device, the strategy's timeout",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        _DEEPSPEED,
        "_init_optimizers",
        "autoshard.lightning.deepspeed",
        "overridden: Lightning's single configure_optimizers call happens inside it, right before"
        " deepspeed.initialize; autoshard reads what it returned and refuses the method there",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        "lightning.pytorch.core.optimizer.LightningOptimizer",
        "_optimizer",
        "autoshard.needs",
        "read: the torch optimizer a LightningOptimizer wraps",
        on_instance=True,
    ),
    Private(
        _MODEL_PARALLEL,
        "_lightning_optimizers",
        "autoshard.activations.stand_in",
        "provided: LightningModule.optimizers() reads it from trainer.strategy; the simulated step's stand-in has it",
        on_instance=True,
    ),
    Private(
        "lightning.pytorch.core.optimizer.LightningOptimizer",
        "_to_lightning_optimizer",
        "autoshard.activations.stand_in",
        "called: the simulated step hands a manual-optimization training_step the LightningOptimizer it would get",
    ),
    Private(
        "lightning.pytorch.core.optimizer",
        "_MockOptimizer",
        "autoshard.needs",
        "compared by name: Lightning's stand-in when configure_optimizers returns None is no optimizer",
    ),
    Private(
        "lightning.pytorch.Trainer",
        "_run",
        "autoshard.lightning.guards",
        "wrapped: records the ckpt_path and weights_only arguments of the fit in progress: Lightning restores a checkpoint"
        " after the strategy's setup, and a memory budget's stored decision must be read before sharding",
        without="a resume with memory_budget decides again instead of keeping the checkpoint's decision (said when they differ)",
    ),
    Private(
        "lightning.pytorch.loops.fit_loop._FitLoop",
        "_data_source",
        "autoshard.lightning.budget",
        "read: where the train DataLoader comes from; memory_budget is decided on its first batch, before Lightning's data setup",
        on_instance=True,
    ),
    Private(
        "lightning.pytorch.callbacks.ThroughputMonitor",
        "_throughputs",
        "autoshard.lightning.throughput",
        "written: the per-stage meters, built at setup with autoshard's Meter (step time, TFLOP/s, tokens) and the"
        " device's peak (Lightning's setup takes no peak and misses the H200)",
        on_instance=True,
    ),
    Private(
        "lightning.pytorch.LightningModule",
        "_trainer",
        "autoshard.needs, autoshard.lightning.checkpoint",
        "read: the attached Trainer or None (the trainer property raises when none is attached)",
        on_instance=True,
    ),
)


_FABRIC_DEEPSPEED = "lightning.fabric.strategies.DeepSpeedStrategy"
_FABRIC_HERE = "autoshard.fabric.deepspeed"
_LEFT_FABRIC = "Fabric(strategy='fsdp2' / 'auto-shard' / 'autoshard-deepspeed') is refused (it could not set its mesh or config)"

FABRIC: tuple[Private, ...] = (
    *engine_members("lightning.fabric.strategies", _LEFT_FABRIC, _LEFT_FABRIC),
    Private(
        _FABRIC_DEEPSPEED,
        "_format_config",
        _FABRIC_HERE,
        "overridden: the config is generated from the intent once the processes exist",
        without=_LEFT_FABRIC,
    ),
    Private(
        _FABRIC_DEEPSPEED,
        "_setup_distributed",
        _FABRIC_HERE,
        "overridden on CPU: Lightning's checks device indices, which CPU lacks",
        without=_LEFT_FABRIC,
    ),
    Private(_FABRIC_DEEPSPEED, "_set_world_ranks", _FABRIC_HERE, "called on CPU, as Lightning's _setup_distributed does", without=_LEFT_FABRIC),
    Private(_FABRIC_DEEPSPEED, "_init_deepspeed_distributed", _FABRIC_HERE, "called on CPU: env, gloo, the strategy's timeout", without=_LEFT_FABRIC),
    Private(_FABRIC_DEEPSPEED, "_config_initialized", _FABRIC_HERE, "set on CPU once the config is formatted, as Lightning does", on_instance=True),
)

# What the code elsewhere takes from here, as ``in_lightning.<name>``: each a listed member's owner, imported on use.
PROVIDED = {
    "AcceleratorConnector": "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector",
    "FabricConnector": "lightning.fabric.connector:_Connector",
    "to_lightning_optimizer": "lightning.pytorch.core.optimizer:LightningOptimizer._to_lightning_optimizer",
}


def __getattr__(name: str) -> Any:
    return provide(globals(), PROVIDED, name)


@functools.cache
def check_lightning(version: str | None = None) -> None:
    """Warn (once per version, on rank 0) when Lightning is outside SUPPORTED_LIGHTNING or lacks a listed member.

    A warning, not an error: a newer Lightning may well keep every member, and what lacks one is left as Lightning
    has it (the warning says what, and what to pin).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    found = version or metadata.version("lightning")
    gone = missing(TRAINER) if version is None else []
    if SpecifierSet(SUPPORTED_LIGHTNING).contains(Version(found), prereleases=True) and not gone:
        return
    lacks = ""
    if gone:
        left = "; ".join(dict.fromkeys(m.without for m in gone if m.without))
        lacks = f"; it lacks {', '.join(map(str, gone))}" + (f", so {left}" if left else "")
    rank_zero_warn(
        f"autoshard hooks private Lightning members verified on lightning {SUPPORTED_LIGHTNING}; found lightning"
        f" {found}{lacks}. If a strategy fails, {PIN}",
        stacklevel=3,
    )


def lightning_lacks(gone: Sequence[Private], hooked_by: str, works: str = "") -> BackendUnavailableError:
    """The refusal of a strategy whose hooked private members (``gone``) this Lightning lacks: Lightning would never
    call autoshard's overrides, so the strategy would run unchecked. ``works``: the backend that works, said."""
    return BackendUnavailableError(
        f"lightning {metadata.version('lightning')} lacks {', '.join(map(str, gone))}, which autoshard's {hooked_by}"
        f" (verified on lightning {SUPPORTED_LIGHTNING}).{works} Fix: {PIN}"
    )
