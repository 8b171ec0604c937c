"""Every private Lightning Fabric member autoshard's Fabric strategies touch: where, and why (the Trainer's are listed
in ``autoshard.lightning.compat``, with the same ``Private`` record and the same supported range).

tests/fabric/test_fabric_registration.py checks every entry on the installed Lightning; a strategy whose hooked member
is gone refuses to be built (``missing``), with the pin. Public behaviours relied on as well: ``STRATEGY_REGISTRY``
entries are read raw, never called; ``ModelParallelStrategy.setup_module`` calls the ``parallelize_fn`` given to
``__init__``, then materializes meta tensors; ``fabric.save`` / ``fabric.load`` hand over the unwrapped objects.
"""

from __future__ import annotations

from autoshard.engine.compat import Private, absent, engine_members

_DEEPSPEED = "lightning.fabric.strategies.DeepSpeedStrategy"
_HERE = "fabric/deepspeed.py"
_LEFT = "Fabric(strategy='fsdp2' / 'auto-shard' / 'autoshard-deepspeed') is refused (it could not set its mesh or config)"

FABRIC_PRIVATE_MEMBERS: tuple[Private, ...] = (
    *engine_members("lightning.fabric.strategies", _LEFT, _LEFT),
    Private(_DEEPSPEED, "_format_config", _HERE, "overridden: the config is generated from the intent once the processes exist", without=_LEFT),
    Private(_DEEPSPEED, "_setup_distributed", _HERE, "overridden on CPU: Lightning's checks device indices, which CPU lacks", without=_LEFT),
    Private(_DEEPSPEED, "_set_world_ranks", _HERE, "called on CPU, as Lightning's _setup_distributed does", without=_LEFT),
    Private(_DEEPSPEED, "_init_deepspeed_distributed", _HERE, "called on CPU: env, gloo, the strategy's timeout", without=_LEFT),
    Private(_DEEPSPEED, "_config_initialized", _HERE, "set on CPU once the config is formatted, as Lightning does", on_instance=True),
)


def missing(owner: type | None = None) -> list[str]:
    """The listed methods (of ``owner`` only, if given) that the installed Lightning Fabric lacks."""
    return [str(member) for member in absent(FABRIC_PRIVATE_MEMBERS, owner)]
