"""Every private Lightning member the Trainer's strategies touch: where, and why (the supported range and the
``Private`` record are ``autoshard.engine.compat``'s, shared with ``autoshard.fabric.compat``).

Lightning may rename or drop a private member in any release. Each one autoshard uses is listed here, once;
tests/lightning/test_compat.py checks every entry on the installed Lightning (so an upgrade that breaks one fails
that test, by name) and that pyproject.toml declares SUPPORTED_LIGHTNING. Outside that range, or when a listed
member is gone, ``check_lightning`` warns, once, on rank 0, when ``import autoshard`` registers the strategies, and
says what autoshard then leaves as Lightning has it (``Private.without``): a guard whose member is gone is not
installed, and Lightning's own strategies are not replaced, so nothing the user asks of Lightning itself is refused.

Public behaviours relied on as well (tested where they are used, not listed below):
- ``ModelParallelStrategy.setup`` refuses a module whose ``configure_model`` is not overridden: FSDP2Strategy sets
  an instance attribute for the duration of that call (autoshard shards instead).
- ``DeepSpeedStrategy.setup_environment`` adds only a CUDA-only refusal to ``DDPStrategy.setup_environment``, which
  the CPU path calls directly; ``setup_distributed`` checks device indices, which CPU devices lack.
- ``StrategyRegistry`` is a dict of ``{"strategy", "description", "init_params"}`` entries, read raw so that
  nothing is instantiated (autoshard.lightning.register, register_deepspeed_strategies).
"""

from __future__ import annotations

import functools
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from autoshard.engine.compat import PIN, SUPPORTED_LIGHTNING, Private, absent, engine_members

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
            "lightning/guards.py",
            "wrapped: under SLURM a task count or rank that is not a number is refused by name, before Lightning's bare int()",
            without=f"{under}a SLURM number that is not one (SLURM_NTASKS=abc) gets Lightning's own ValueError",
        ),
        Private(connector, "_cluster_environment_flag", "lightning/guards.py", "read: a cluster environment the user passed", on_instance=True),
    )


PRIVATE_MEMBERS: tuple[Private, ...] = (
    Private(
        _CONNECTOR,
        "_check_strategy_and_fallback",
        "lightning/guards.py",
        "wrapped: strategy='fsdp' or an FSDPStrategy object is refused before Lightning's own CPU check replaces our redirect",
        without="FSDP1 (strategy='fsdp', FSDPStrategy objects) is not refused by autoshard",
    ),
    Private(
        _CONNECTOR,
        "_validate_precision_choice",
        "lightning/guards.py",
        "wrapped: 16-mixed under fsdp2 is refused for strategy names too (Lightning checks instances only, says"
        " 'Fabric(...)', and on CPU turns 16-mixed into bf16-mixed right after)",
        without="16-mixed under fsdp2 is refused only once the strategy sees the Trainer's precision",
    ),
    *_slurm_guard(_CONNECTOR, ""),
    *_slurm_guard(_FABRIC_CONNECTOR, "under Fabric, "),
    Private(_CONNECTOR, "_strategy_flag", "lightning/guards.py", "read: the strategy the user passed", on_instance=True),
    Private(_CONNECTOR, "_precision_flag", "lightning/guards.py", "read: the precision the user passed", on_instance=True),
    *engine_members("lightning.pytorch.strategies", _LEFT_FSDP2, _LEFT_DEEPSPEED),
    Private(_MODEL_PARALLEL, "_save_distributed_checkpoint", "lightning/checkpoint.py", "read: a DCP directory or one full file", on_instance=True),
    Private(
        _MODEL_PARALLEL,
        "_layer_sync",
        "lightning/fsdp2.py",
        "read: Trainer(sync_batchnorm=True), which ModelParallelStrategy ignores and autoshard applies",
        on_instance=True,
    ),
    Private(
        _DEEPSPEED,
        "_layer_sync",
        "lightning/deepspeed.py",
        "read: Trainer(sync_batchnorm=True), which DeepSpeedStrategy ignores and autoshard applies",
        on_instance=True,
    ),
    Private(
        _DEEPSPEED,
        "_format_config",
        "lightning/deepspeed.py",
        "overridden: Lightning calls it lazily (setup, model_sharded_context) when the config must be final",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        _DEEPSPEED,
        "_auto_select_batch_size",
        "lightning/deepspeed.py",
        "called: Lightning's per-device batch size from the train DataLoader, so both strategies agree",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        _DEEPSPEED,
        "_init_deepspeed_distributed",
        "lightning/deepspeed.py",
        "called on CPU: MASTER_*/RANK env, gloo for a CPU root device, the strategy's timeout",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        _DEEPSPEED,
        "_init_optimizers",
        "lightning/deepspeed.py",
        "overridden: Lightning's single configure_optimizers call happens inside it, right before"
        " deepspeed.initialize; autoshard reads what it returned and refuses the method there",
        without=_LEFT_DEEPSPEED,
    ),
    Private(
        "lightning.pytorch.core.optimizer.LightningOptimizer",
        "_optimizer",
        "needs.py",
        "read: the torch optimizer a LightningOptimizer wraps",
        on_instance=True,
    ),
    Private(
        _MODEL_PARALLEL,
        "_lightning_optimizers",
        "activations/stand_in.py",
        "provided: LightningModule.optimizers() reads it from trainer.strategy; the simulated step's stand-in has it",
        on_instance=True,
    ),
    Private(
        "lightning.pytorch.core.optimizer.LightningOptimizer",
        "_to_lightning_optimizer",
        "activations/stand_in.py",
        "called: the simulated step hands a manual-optimization training_step the LightningOptimizer it would get",
    ),
    Private(
        "lightning.pytorch.core.optimizer",
        "_MockOptimizer",
        "needs.py",
        "compared by name: Lightning's stand-in when configure_optimizers returns None is no optimizer",
    ),
    Private(
        "lightning.pytorch.Trainer",
        "_run",
        "lightning/guards.py",
        "wrapped: records the ckpt_path and weights_only arguments of the fit in progress: Lightning restores a checkpoint"
        " after the strategy's setup, and a memory budget's stored decision must be read before sharding",
        without="a resume with memory_budget decides again instead of keeping the checkpoint's decision (said when they differ)",
    ),
    Private(
        "lightning.pytorch.loops.fit_loop._FitLoop",
        "_data_source",
        "lightning/budget.py",
        "read: where the train DataLoader comes from; memory_budget is decided on its first batch, before Lightning's data setup",
        on_instance=True,
    ),
    Private(
        "lightning.pytorch.callbacks.ThroughputMonitor",
        "_throughputs",
        "lightning/throughput.py",
        "written: the per-stage meters, built at setup with autoshard's Meter (step time, TFLOP/s, tokens) and the"
        " device's peak (Lightning's setup takes no peak and misses the H200)",
        on_instance=True,
    ),
    Private(
        "lightning.pytorch.LightningModule",
        "_trainer",
        "needs.py, memory.py, lightning/checkpoint.py",
        "read: the attached Trainer or None (the trainer property raises when none is attached)",
        on_instance=True,
    ),
)


def missing(owner: type | None = None) -> list[str]:
    """The listed methods and classes (of ``owner`` only, if given) that the installed Lightning lacks."""
    return [str(member) for member in absent(PRIVATE_MEMBERS, owner)]


def missing_members(owner: type | None = None) -> list[Private]:
    """``missing``, as the listed entries."""
    return absent(PRIVATE_MEMBERS, owner)


@functools.cache
def check_lightning(version: str | None = None) -> None:
    """Warn (once per version, on rank 0) when Lightning is outside SUPPORTED_LIGHTNING or lacks a listed member.

    A warning, not an error: a newer Lightning may well keep every member, and what lacks one is left as Lightning
    has it (the warning says what, and what to pin).
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    found = version or metadata.version("lightning")
    gone = missing_members() if version is None else []
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
