"""How a worker process ends (issue 28, item 7: "CI never flakes"). A worker that died at exit with ``terminate called
without an active exception`` (exit -6) after writing every result failed a clean clone's CI: the launcher now names
such a worker and why, and an error inside a worker still ends it with its traceback and a non-zero code although
every worker now leaves through ``os._exit`` (tests/distributed/harness.py says why)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("exit_worker.py")
STUB = Path(__file__).with_name("exit_stub.py")
TESTS = Path(__file__).resolve().parents[1]
EXITS = {"run_scenarios", "worker_main"}  # the harness's two ways out: groups destroyed, then os._exit


def ends_through_the_harness(body: list[ast.stmt]) -> bool:
    """The statements' last one calls run_scenarios/worker_main, or branches into paths that all do."""
    last = body[-1]
    if isinstance(last, ast.If):
        return ends_through_the_harness(last.body) and bool(last.orelse) and ends_through_the_harness(last.orelse)
    call = last.value if isinstance(last, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in EXITS


def test_every_test_worker_ends_through_the_harness() -> None:
    """A worker with a ``__main__`` of its own that returns normally carries live gloo threads into interpreter
    shutdown (the abort this file is about): every path of every test worker's main ends in the harness."""
    mains = {}
    for path in sorted(TESTS.rglob("*_worker.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                mains[path.relative_to(TESTS).as_posix()] = ends_through_the_harness(node.body)
    assert len(mains) >= 20, mains  # the scan found the workers
    assert [name for name, ok in mains.items() if not ok] == []


def test_a_worker_aborting_at_exit_fails_the_run_and_is_named(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as info:
        run_workers(STUB, ["abort"], tmp_path, nprocs=2, timeout=60)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 exited with -6 (SIGABRT); aborted (rank 1: 'terminate called without an active exception')"), first
    assert "torn down during interpreter shutdown" in first and "worker_main" in first


def test_an_abort_only_a_log_reports_fails_the_run(tmp_path: Path) -> None:
    """Every exit code 0 (a launcher outlived its aborted child): the log's line still fails the run, by name."""
    with pytest.raises(AssertionError) as info:
        run_workers(STUB, ["abort_reported"], tmp_path, nprocs=2, timeout=60)
    assert str(info.value).startswith("rank 1's log reports 'terminate called without an active exception'"), str(info.value)[:300]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_an_error_in_a_worker_keeps_its_traceback_and_a_nonzero_code(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as info:
        run_workers(WORKER, ["--scenarios", "raise_on_rank_1"], tmp_path, nprocs=2, timeout=120)
    message = str(info.value)
    assert message.startswith(("rank 0 exited with 1\n", "rank 1 exited with 1\n")), message[:300]
    assert "aborted" not in message.splitlines()[0], message[:300]
    rank1 = (tmp_path / "rank1.log").read_text()
    assert "worker (rank 1) failed:\nTraceback (most recent call last):" in rank1, rank1[-2000:]
    assert rank1.rstrip().endswith("ValueError: planted failure on rank 1"), rank1[-2000:]
    assert not (tmp_path / "rank1.json").exists()
