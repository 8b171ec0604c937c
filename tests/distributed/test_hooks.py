"""User hooks are called exactly as Lightning calls them, and autoshard's guarantees hold whoever sharded.

2 real gloo processes per backend: one pair runs every FSDP2 scenario (fsdp2 and auto-shard), one pair the
DeepSpeed ZeRO-3 (CPU) refusals. stable-pretraining's probe and EMA patterns are reproduced in the workers.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent
WRAPPED = "configure_optimizers (wrapped on the instance, as probe callbacks do)"


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_workers(HERE / "hooks_worker.py", [], tmp_path_factory.mktemp("hooks_fsdp2"), nprocs=2, timeout=300)


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'autoshard[deepspeed]')")
    return run_workers(HERE / "hooks_deepspeed_worker.py", [], tmp_path_factory.mktemp("hooks_ds"), nprocs=2, timeout=300)


@pytest.mark.timeout(330)
@pytest.mark.parametrize("scenario", ["probe_once_fsdp2", "probe_once_auto_shard"])
def test_probe_wrapping_configure_optimizers_runs_once_and_trains(fsdp2: list[dict[str, Any]], scenario: str) -> None:
    for rank in fsdp2:
        run = rank[scenario]
        assert "error" not in run, run.get("error")
        assert run["calls"] == 1  # Lightning's own call only: autoshard called no hook to inspect the method
        assert run["teacher_changed"]
    # the decision printed after Lightning's call counts what it returned, and says where the second one came from
    assert fsdp2[0][scenario]["optimizers"] == f"2 from {WRAPPED}"
    assert f"multiple optimizers [2 optimizers: 2 from {WRAPPED}]" in fsdp2[0][scenario]["decision"]
    assert fsdp2[0][scenario]["teacher"] == fsdp2[1][scenario]["teacher"]
    assert fsdp2[0][scenario]["probe"] == fsdp2[1][scenario]["probe"]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("scenario", ["configure_model_shards", "parallelize_fn_shards"])
def test_ema_guarantee_holds_when_the_user_sharded(fsdp2: list[dict[str, Any]], scenario: str) -> None:
    """fully_shard's default leaves a teacher root gathered after its no_grad forward; autoshard reshards it."""
    for rank in fsdp2:
        run = rank[scenario]
        assert "error" not in run, run.get("error")
        assert run["plan"] and run["teacher_is_dtensor"] and run["head_is_plain"]
        assert run["teacher_changed"] and run["head_changed"]
        assert run["student_sharded_after_no_grad_forward"]
    assert fsdp2[0][scenario]["teacher"] == fsdp2[1][scenario]["teacher"]
    assert fsdp2[0][scenario]["head"] == fsdp2[1][scenario]["head"]  # unsharded: gradients averaged across ranks


@pytest.mark.timeout(330)
def test_reading_a_sharded_weight_directly_names_the_module_and_the_fix(fsdp2: list[dict[str, Any]]) -> None:
    for rank in fsdp2:
        run = rank["direct_weight_read"]
        assert run["error"] == "AutoShardError", run
        text = run["message"]
        assert re.match(
            r"ReadsAWeight.training_step mixed plain tensors with sharded parameters \(torch: aten\.[\w.]+ got mixed torch.Tensor and DTensor\)\. ",
            text,
        ), text
        assert "The parameters of 'child' are still sharded (DTensor) at that point" in text, text
        assert "'head'" not in text and "'embed'" not in text, text  # the uncalled head waits too: not named
        assert "it was not called in this step" in text and "like `self.child.weight`" in text, text
        assert text.splitlines()[-1] == (
            "Fix: keep 'child' unsharded with Trainer(strategy=FSDP2Strategy(intent=ShardingIntent(exclude=['child']))),"
            " or call the module (`self.child(...)`) instead of reading its parameters"
        ), text
        assert "got mixed torch.Tensor and DTensor" in run["cause"]
        assert run["fixed_trains"]


@pytest.mark.deepspeed
@pytest.mark.timeout(330)
@pytest.mark.parametrize("scenario", ["ema_probe", "configure_model_builds"])
def test_deepspeed_refuses_ema_and_probe_before_the_engine_without_calling_hooks(deepspeed: list[dict[str, Any]], scenario: str) -> None:
    teacher = "teacher 'teacher' follows student 'student'" if scenario == "ema_probe" else "teacher 'nets.teacher' follows student 'nets.student'"
    for rank in deepspeed:
        run = rank[scenario]
        assert run["refusal"], run
        text = run["message"]
        assert "cannot train under DeepSpeed ZeRO stage 3 (GuardedDeepSpeedStrategy); refused before the engine is built" in text
        assert f"EMA teacher/student [{teacher}]" in text, text
        assert f"multiple optimizers [2 optimizers: 2 from {WRAPPED}]" in text, text
        assert "Backend that works: fsdp2 (strategy='fsdp2')" in text and "Fix: use strategy='fsdp2'" in text, text
        assert run["calls"] == 1 and run["model_type"] != "DeepSpeedEngine"
