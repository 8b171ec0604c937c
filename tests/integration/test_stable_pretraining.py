"""Opt-in: autoshard under real stable-pretraining 0.1.8 code, 2 gloo processes (skipped when it is not installed).

CI runs the same patterns without the library (tests/distributed/test_hooks.py); docs/guide.md says how to install
it for this test (its torchvision needs a shim with CPU torch, see spt_worker.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_workers

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("stable_pretraining") is None,
        reason="stable-pretraining is not installed: run `make spt-check` (docs/guide.md, section 'stable-pretraining')",
    ),
]


@pytest.mark.timeout(400)
def test_byol_with_online_probe_trains_under_auto_shard(tmp_path: Path) -> None:
    ranks: list[dict[str, Any]] = run_workers(Path(__file__).with_name("spt_worker.py"), [], tmp_path, nprocs=2, timeout=360)
    results = [r["byol_with_probe"] for r in ranks]
    for result in results:
        assert result["backend"] == "fsdp2"
        assert result["student_sharded"] and result["teacher_sharded"]
        assert result["teacher_moved"]  # the EMA update ran on sharded teachers, no "mixed Tensor and DTensor"
    # The probe trains unsharded: its gradients are averaged, so both ranks hold the same probe.
    assert results[0]["probe_weights"] == results[1]["probe_weights"]
    assert results[0]["teacher_weights"] == results[1]["teacher_weights"]
