"""``import autoshard`` registers "fsdp2", "auto-shard" and "autoshard-deepspeed" in Lightning Fabric's own registry, in
whichever order the imports come, without importing a strategy; ``uninstall`` puts the registry
back; the private Fabric members autoshard hooks exist; Fabric's "auto" sizes (tensor parallel within a node) are
replaced by the intent's. Fresh interpreters where the import order matters.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

NAMES = ["fsdp2", "auto-shard", "autoshard-deepspeed"]


def run(code: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "JSM_NAMESPACE_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


AUTOSHARD_FIRST = r"""
import json, sys
import autoshard
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
out = {"names": [n for n in ("fsdp2", "auto-shard", "autoshard-deepspeed") if n in STRATEGY_REGISTRY],
       "strategies": "autoshard.fabric.strategies" in sys.modules}
from autoshard.fabric import AutoShardStrategy, FSDP2Strategy, auto_shard
for name in ("fsdp2", "auto-shard"):
    f = Fabric(accelerator="cpu", devices=2, strategy=name)
    out[name] = [type(f.strategy).__name__, f.strategy._data_parallel_size, f.strategy._tensor_parallel_size]
f = Fabric(accelerator="cpu", devices=4, strategy=FSDP2Strategy(tensor_parallel_size=2, shard_size=1))
s = f.strategy
out["tp"] = [s._data_parallel_size, s._tensor_parallel_size, [s.dims.dp_replicate, s.dims.dp_shard, s.dims.tp], s.describe_mesh()]
out["entry"] = STRATEGY_REGISTRY["auto-shard"]["strategy"].__module__ + "." + STRATEGY_REGISTRY["auto-shard"]["strategy"].__name__
out["new"] = "__new__" in vars(AutoShardStrategy)
if DEEPSPEED:
    chosen = auto_shard(offload="optimizer")  # only DeepSpeed offloads optimizer state alone
    out["auto_offload_optimizer"] = [type(chosen).__name__, chosen.requested_as]
    try:
        AutoShardStrategy(offload="optimizer")
    except Exception as exc:
        out["class_refuses"] = type(exc).__name__ + ": " + str(exc)
print("RESULT " + json.dumps(out))
"""
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.timeout(300)
def test_import_autoshard_first_registers_and_the_names_build_pure_fsdp() -> None:
    """Registering imports no strategy (the entries build theirs when Fabric() does). Fabric's ModelParallelStrategy
    "auto" means tensor parallel = processes per node: autoshard's sizes are dp = world, tp = 1."""
    result = run(AUTOSHARD_FIRST.replace("DEEPSPEED", str(HAS_DEEPSPEED)))
    assert result["names"] == NAMES and not result["strategies"]
    assert result["fsdp2"] == ["FSDP2Strategy", 2, 1]
    assert result["auto-shard"] == ["AutoShardStrategy", 2, 1]
    # The sizes Fabric builds its mesh with are the run's dims, resolved once (hybrid sharding and tensor parallel).
    hsdp_tp = {"data_parallel_size": 2, "tensor_parallel_size": 2, "world_size": 4, "hsdp": [2, 1]}
    assert result["tp"] == [2, 2, [2, 1, 2], hsdp_tp]
    # "auto-shard" is a registered factory, as for the Trainer: no constructor returning another class.
    assert result["entry"] == "autoshard.fabric.factory.auto_shard" and not result["new"]
    if HAS_DEEPSPEED:
        assert result["auto_offload_optimizer"] == ["AutoShardDeepSpeedStrategy", "auto-shard"]
        assert result["class_refuses"] == (
            "IntentError: autoshard.fabric.AutoShardStrategy is auto-shard's fsdp2 strategy, but this intent needs"
            " deepspeed_zero3 (only it has what the intent asks for), so an fsdp2 strategy object cannot run it. Fix:"
            " build it with autoshard.fabric.auto_shard(...) and the same arguments (what Fabric(strategy='auto-shard')"
            " calls), which returns autoshard's Fabric DeepSpeed strategy for this intent"
        )


UNINSTALL = r"""
import json
from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy

class OtherFSDP2(ModelParallelStrategy):
    pass

STRATEGY_REGISTRY.register("fsdp2", OtherFSDP2, description="another library's fsdp2")
stock = {name: id(entry) for name, entry in dict.items(STRATEGY_REGISTRY)}
import autoshard
import autoshard.fabric as af
targets = [c.target for c in af.installed()]
af.register()  # idempotent
ours = STRATEGY_REGISTRY["fsdp2"]["strategy"].__name__
undone = [c.target for c in af.uninstall()]
restored = {name: id(entry) for name, entry in dict.items(STRATEGY_REGISTRY)}
af.register()
print("RESULT " + json.dumps({"same": stock == restored, "targets": targets, "undone": undone, "ours": ours,
                              "again": [c.target for c in af.installed()]}))
"""


@pytest.mark.timeout(300)
def test_fabric_imported_first_another_fsdp2_replaced_and_uninstall_restores_the_registry() -> None:
    """lightning.fabric imported (and another library's "fsdp2" registered) before ``import autoshard``."""
    out = subprocess.run([sys.executable, "-c", UNINSTALL], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))
    assert result["same"] and result["ours"] == "FSDP2Strategy"
    assert result["targets"] == [f"lightning.fabric STRATEGY_REGISTRY[{n!r}]" for n in NAMES]
    assert result["undone"] == result["targets"][::-1] and result["again"] == result["targets"]
    said = "autoshard: Fabric(strategy='fsdp2') was registered by __main__.OtherFSDP2; import autoshard replaced it with autoshard.fabric.strategies.FSDP2Strategy"
    assert (out.stdout + out.stderr).count(said) == 2  # once per registration that replaced it: not on the idempotent call


def test_every_private_fabric_member_autoshard_hooks_exists() -> None:
    """Methods on the classes; instance attributes on an instance (built, not launched)."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from autoshard.privates import missing
    from autoshard.privates.in_lightning import FABRIC

    assert missing(FABRIC) == []
    instance = ModelParallelStrategy(lambda m, mesh: m)
    for member in FABRIC:
        if member.on_instance and member.owner.endswith("ModelParallelStrategy"):
            assert hasattr(instance, member.name), member
    if importlib.util.find_spec("deepspeed") is not None:
        from lightning.fabric.strategies import DeepSpeedStrategy

        deepspeed_instance = DeepSpeedStrategy(stage=3)
        for member in FABRIC:
            if member.on_instance and member.owner.endswith("DeepSpeedStrategy"):
                assert hasattr(deepspeed_instance, member.name), member
