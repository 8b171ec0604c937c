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
from autoshard.fabric import AutoShardStrategy
for name in ("fsdp2", "auto-shard"):
    f = Fabric(accelerator="cpu", devices=2, strategy=name)
    out[name] = [type(f.strategy).__name__, f.strategy._data_parallel_size, f.strategy._tensor_parallel_size]
if DEEPSPEED:
    chosen = AutoShardStrategy(offload="optimizer")  # only DeepSpeed offloads optimizer state alone
    out["auto_offload_optimizer"] = [type(chosen).__name__, chosen.requested_as]
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
    if HAS_DEEPSPEED:
        assert result["auto_offload_optimizer"] == ["AutoShardDeepSpeedStrategy", "auto-shard"]


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
undone = [c.name for c in af.uninstall()]
restored = {name: id(entry) for name, entry in dict.items(STRATEGY_REGISTRY)}
af.register()
print("RESULT " + json.dumps({"same": stock == restored, "targets": targets, "undone": undone, "ours": ours,
                              "again": [c.name for c in af.installed()]}))
"""


@pytest.mark.timeout(300)
def test_fabric_imported_first_another_fsdp2_replaced_and_uninstall_restores_the_registry() -> None:
    """lightning.fabric imported (and another library's "fsdp2" registered) before ``import autoshard``."""
    out = subprocess.run([sys.executable, "-c", UNINSTALL], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))
    assert result["same"] and result["ours"] == "FSDP2Strategy"
    assert result["targets"] == [f"lightning.fabric STRATEGY_REGISTRY[{n!r}]" for n in NAMES]
    assert result["undone"] == NAMES[::-1] and result["again"] == NAMES
    said = "autoshard: Fabric(strategy='fsdp2') was registered by __main__.OtherFSDP2; import autoshard replaced it with autoshard.fabric.strategies.FSDP2Strategy"
    assert (out.stdout + out.stderr).count(said) == 2  # once per registration that replaced it: not on the idempotent call


def test_every_private_fabric_member_autoshard_hooks_exists() -> None:
    """Methods on the classes; instance attributes on an instance (built, not launched)."""
    from lightning.fabric.strategies import ModelParallelStrategy

    from autoshard.fabric.compat import FABRIC_PRIVATE_MEMBERS, missing

    assert missing() == []
    instance = ModelParallelStrategy(lambda m, mesh: m)
    for member in FABRIC_PRIVATE_MEMBERS:
        if member.on_instance and member.owner.endswith("ModelParallelStrategy"):
            assert hasattr(instance, member.name), member
    if importlib.util.find_spec("deepspeed") is not None:
        from lightning.fabric.strategies import DeepSpeedStrategy

        deepspeed_instance = DeepSpeedStrategy(stage=3)
        for member in FABRIC_PRIVATE_MEMBERS:
            if member.on_instance and member.owner.endswith("DeepSpeedStrategy"):
                assert hasattr(deepspeed_instance, member.name), member
