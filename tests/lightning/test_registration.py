"""`import autoshard` replacing another library's "fsdp2" registration is said once, on rank 0, by class."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

OTHER_FIRST = """
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

class OtherFSDP2(ModelParallelStrategy):
    pass

StrategyRegistry.register("fsdp2", OtherFSDP2, description="another library's fsdp2")
import autoshard
import autoshard.lightning
autoshard.lightning.register()  # idempotent: said once
assert StrategyRegistry["fsdp2"]["strategy"] is autoshard.lightning.FSDP2Strategy
"""
MESSAGE = (
    "autoshard: Trainer(strategy='fsdp2') was registered by __main__.OtherFSDP2; import autoshard replaced it with"
    " autoshard.lightning.FSDP2Strategy. To train with the other one, pass it as an object:"
    " Trainer(strategy=OtherFSDP2(...))"
)


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_replacing_another_fsdp2_is_logged_once_on_rank_zero_only() -> None:
    text = run(OTHER_FIRST)
    assert text.count(MESSAGE) == 1, text
    assert MESSAGE not in run(OTHER_FIRST, RANK="1")
    assert "was registered by" not in run("import autoshard")  # nothing replaced, nothing said
