"""Every private Lightning Fabric member autoshard's Fabric strategies touch: where, and why (the Trainer's are listed
in ``autoshard.lightning.compat``, with the same ``Private`` record and the same supported range).

tests/fabric/test_fabric_registration.py checks every entry on the installed Lightning, so an upgrade that drops one
fails by name; a strategy whose hooked member is gone refuses to be built (``missing``), with the pin.

Public behaviours relied on as well: ``STRATEGY_REGISTRY`` entries are dicts whose ``"strategy"`` is called with
``"init_params"`` when ``Fabric()`` is built (read raw, never called, by ``autoshard.fabric.register``);
``Fabric.setup`` hands the unwrapped module to ``Strategy.setup_module_and_optimizers`` (``setup_module`` without
optimizers) and ``setup_optimizers`` to ``setup_optimizer``; ``ModelParallelStrategy.setup_module`` calls the
``parallelize_fn`` given to ``__init__`` and then materializes meta tensors; ``fabric.save`` / ``fabric.load`` call
``save_checkpoint`` / ``load_checkpoint`` with the unwrapped objects.
"""

from __future__ import annotations

from autoshard.engine.compat import Private, absent, engine_members

_DEEPSPEED = "lightning.fabric.strategies.DeepSpeedStrategy"
_LEFT = "Fabric(strategy='fsdp2' / 'auto-shard' / 'autoshard-deepspeed') is refused (it could not set its mesh or config)"

FABRIC_PRIVATE_MEMBERS: tuple[Private, ...] = (
    *engine_members("lightning.fabric.strategies", _LEFT, _LEFT),
    Private(
        _DEEPSPEED,
        "_format_config",
        "fabric/deepspeed.py",
        "overridden: Fabric calls it once the processes exist; the config is generated from the intent there",
        without=_LEFT,
    ),
    Private(
        _DEEPSPEED,
        "_setup_distributed",
        "fabric/deepspeed.py",
        "overridden on CPU only: Lightning's checks device indices, which CPU devices lack",
        without=_LEFT,
    ),
    Private(_DEEPSPEED, "_set_world_ranks", "fabric/deepspeed.py", "called on CPU, as Lightning's _setup_distributed does", without=_LEFT),
    Private(
        _DEEPSPEED,
        "_init_deepspeed_distributed",
        "fabric/deepspeed.py",
        "called on CPU: MASTER_*/RANK env, gloo for a CPU root device, the strategy's timeout",
        without=_LEFT,
    ),
    Private(
        _DEEPSPEED, "_config_initialized", "fabric/deepspeed.py", "set on CPU after the config is formatted, as Lightning does", on_instance=True
    ),
)


def missing(owner: type | None = None) -> list[str]:
    """The listed methods (of ``owner`` only, if given) that the installed Lightning Fabric lacks."""
    return [str(member) for member in absent(FABRIC_PRIVATE_MEMBERS, owner)]
