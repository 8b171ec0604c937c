"""init_from on 2 gloo ranks: a truncated safetensors file is refused on every rank, with its cause, before anything
is loaded or sharded (tests/distributed/init_from_reads_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_workers

pytest.importorskip("safetensors")
pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("init_from_reads_worker.py")


@pytest.mark.timeout(200)
def test_every_rank_names_a_truncated_init_from_file(tmp_path: Path) -> None:
    ranks = run_workers(WORKER, ["--scenarios", "truncated_safetensors"], tmp_path / "out", 2, 150)
    for rank, result in enumerate(ranks):
        run = result["truncated_safetensors"]
        assert run["error"] == "InitFromError", (rank, run)
        assert "truncated.safetensors' is truncated: it holds" in run["message"] and "Fix: download or copy the file again" in run["message"], run
        assert not run["loaded"], rank
