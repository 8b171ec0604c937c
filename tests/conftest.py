"""Suite-wide rules: GPU tests skip with a reason where no CUDA device exists; DeepSpeed runs on its CPU accelerator
where there is none (set here once, never by a test module); collecting the suite changes no environment variable."""

from __future__ import annotations

import os

import pytest
import torch

_ENVIRON: dict[str, str | None] = {}
# What changes how another test runs: the accelerator DeepSpeed picks, the launcher's world, the devices, the threads.
# (Libraries set variables of their own at import, e.g. torch's PYTORCH_NVML_BASED_CUDA_CHECK: not ours to police.)
_WATCHED = (
    "DS_ACCELERATOR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        # In-process DeepSpeed tests train on CPU. Never set by a test module at import: collecting the suite (also
        # `pytest -m gpu`) imports every module, and DeepSpeed reads it once per process, so on a CUDA machine its
        # engines would then place models on the CPU and broadcast them on an nccl group.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _ENVIRON.update({k: os.environ.get(k) for k in _WATCHED})
    # As an autoshard strategy does when it is built: autograd's engine started before any test makes a fake tensor
    # (fully_shard does), or with torch's CUDA wheel and no GPU every forked budget decision after it fails its
    # backward, and the suite's outcome depends on its order (tests/test_activations.py: ..._fork_a_child_that_trains).
    from autoshard.activations import settle_autograd_engine

    settle_autograd_engine()


def pytest_collection_finish(session: pytest.Session) -> None:
    changed = [k for k in _WATCHED if _ENVIRON[k] != os.environ.get(k)]
    if changed:
        raise pytest.UsageError(
            f"importing the test modules changed environment variable(s) {', '.join(changed)}: a module that sets one at import"
            f" changes every other test of the run (DS_ACCELERATOR=cpu moved the GPU DeepSpeed tests' models to the CPU)."
            f" Fix: set it inside the test (monkeypatch.setenv) or in tests/conftest.py"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_leaks_between_modules() -> object:
    """Single-process Trainer tests leave a 1-rank process group (Lightning never destroys it); drop it per module
    so that tests needing their own (fake) process group run instead of skipping."""
    yield
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A DeepSpeed engine caches the world group inside DeepSpeed: its own destroy releases that cache as well,
        # where torch's alone would leave it stale for the next module's engine ("Group ... is not registered").
        deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
        if deepspeed_comm is not None and deepspeed_comm.cdb is not None:
            deepspeed_comm.destroy_process_group()
        else:
            dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_functional_linear_leak() -> object:
    """DeepSpeed's zero.Init replaces torch.nn.functional.linear for the rest of the process (its memory-efficient
    autograd Function); autoshard's DeepSpeed strategies put it back at teardown. A test that leaves it replaced would
    change every later test's numerics (selective checkpointing saved other tensors, losses moved 3e-4): it fails here,
    and the original is put back so that the rest of the suite is unaffected."""
    original = torch.nn.functional.linear
    yield
    current = torch.nn.functional.linear
    if current is not original and getattr(current, "__module__", "") == "deepspeed.runtime.zero.linear":
        torch.nn.functional.linear = original
        pytest.fail("this test left torch.nn.functional.linear replaced by DeepSpeed's zero3_linear_wrap (zero.Init)")


@pytest.fixture(autouse=True)
def _rank_zero_only_rank_restored() -> object:
    """Lightning sets ``rank_zero_only.rank`` (a process-wide value) to the rank a Trainer or Fabric finds, e.g. the
    SLURM_PROCID a test sets: left at 1, every later rank-zero warning and log of this process was silent (tests of
    warnings then failed after test_slurm only)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank
