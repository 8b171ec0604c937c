"""Gradients of unsharded parameters (probes, root and 0-dim parameters) are averaged in buckets, one all_reduce per
bucket per backward: ranks equal, equal to one process on the global batch and bitwise to the per-parameter path
autoshard had before, with gradient accumulation, unused parameters and Lightning; 2 real gloo processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.harness import run_workers

WORKER = Path(__file__).with_name("unsharded_grads_worker.py")
CPU_SCENARIOS = "buckets,unused,replaced,sparse,lightning_accumulate,lightning_meta"
# Many: a 0-dim fp32 scale, 40 fp32 parameters of 32 and 3 bf16 of 16 (a module's own parameters come first); each
# bucket carries one flag per parameter. Default 25 MiB: every fp32 one in one bucket (1 + 1280 + 41 flags), bf16 in
# another (48 + 3). 1 KiB: scale + 7 small, then 8, 8, 8, 8, 1 small (32 numel + a flag each), then bf16.
DEFAULT_BUCKETS = [1 + 40 * 32 + 41, 3 * 16 + 3]
SMALL_BUCKETS = [1 + 7 * 32 + 8, 8 * 33, 8 * 33, 8 * 33, 8 * 33, 33, 3 * 16 + 3]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One process pair runs every scenario (imports dominate the cost of a 2-process run)."""
    return run_workers(WORKER, ["--scenarios", CPU_SCENARIOS], tmp_path_factory.mktemp("unsharded_grads"), nprocs=2, timeout=240)


@pytest.mark.distributed
@pytest.mark.timeout(270)
@pytest.mark.parametrize("micros", [1, 2], ids=["one_backward", "two_accumulated"])
def test_one_all_reduce_per_bucket_per_backward(ranks: list[dict[str, Any]], micros: int) -> None:
    for rank in ranks:
        calls = rank["buckets"][f"micro{micros}"]["all_reduce_numels"]
        assert calls["default"] == [DEFAULT_BUCKETS] * micros
        assert calls["small"] == [SMALL_BUCKETS] * micros
        assert [len(c) for c in calls["per_parameter"]] == [44] * micros  # what it was: one per parameter


@pytest.mark.distributed
@pytest.mark.timeout(270)
@pytest.mark.parametrize("micros", [1, 2], ids=["one_backward", "two_accumulated"])
def test_averages_equal_one_process_on_the_global_batch_and_the_per_parameter_path(ranks: list[dict[str, Any]], micros: int) -> None:
    """Accumulated micro-batches too: every backward is reduced, the sum of averages is the average of the sums."""
    r0, r1 = (r["buckets"][f"micro{micros}"] for r in ranks)
    assert r0["grads"] == r1["grads"]  # ranks agree exactly, every variant
    scale = r0["reference_scale"]
    for result in (r0, r1):
        assert result["vs_per_parameter"] == {"default": 0.0, "small": 0.0}  # bitwise, 2 ranks
        assert all(d <= 1e-6 * scale for d in result["vs_reference_fp32"].values()), result["vs_reference_fp32"]
        assert all(d <= 1e-2 * scale for d in result["vs_reference_bf16"].values()), result["vs_reference_bf16"]
    assert all(g is not None for g in r0["grads"]["default"].values())


def close(got: list[float] | None, want: list[float] | None) -> bool:
    if got is None or want is None:
        return got is want
    return torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)


@pytest.mark.distributed
@pytest.mark.timeout(270)
@pytest.mark.parametrize("always", [True, False], ids=["other_params_used", "rank1_uses_none_of_them"])
def test_a_parameter_some_ranks_did_not_use_neither_hangs_nor_differs(ranks: list[dict[str, Any]], always: bool) -> None:
    """``only0`` is used on rank 0 alone: both ranks get rank 0's gradient / 2 (DDP's find_unused_parameters), as one
    process on both ranks' data computes; ``never`` keeps grad None everywhere (optimizers skip it). With
    ``always=False`` rank 1's backward reaches only the sharded body: it still joins the reduction."""
    r0, r1 = (r["unused"][f"always={always}"] for r in ranks)
    assert r0["grads"] == r1["grads"]
    assert r0["all_reduce_numels"] == r1["all_reduce_numels"] == [3 * 8 + 3]
    for name, got in r0["grads"].items():
        assert close(got, r0["reference"][name]), name
    assert r0["grads"]["never"] is None and r0["grads"]["only0"] is not None
    assert (r0["grads"]["always"] is None) is (not always)


@pytest.mark.distributed
@pytest.mark.timeout(270)
def test_a_backward_that_reaches_none_of_the_model_issues_nothing(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["unused"]["nothing_reached"] == {"all_reduce_numels": [], "unchanged": True}


@pytest.mark.distributed
@pytest.mark.timeout(270)
def test_parameters_replaced_after_setup_are_averaged(ranks: list[dict[str, Any]]) -> None:
    """Materializing meta parameters (``to_empty``) puts new Parameter objects in the module after sharding: the new
    ones are averaged, from the first backward on (two accumulated here, against one process)."""
    r0, r1 = ranks[0]["replaced"], ranks[1]["replaced"]
    assert r0["replaced"] and r0["grads"] == r1["grads"]
    for name, got in r0["grads"].items():
        assert close(got, r0["reference"][name]), name
    assert r0["all_reduce_numels"] == [[3 * 8 + 3]] * 2


@pytest.mark.distributed
@pytest.mark.timeout(270)
def test_a_sparse_embedding_is_averaged_on_its_own(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks[0]["sparse"], ranks[1]["sparse"]
    assert r0["grads"] == r1["grads"]
    assert r0["vs_reference"] <= 1e-7 and r1["vs_reference"] <= 1e-7
    assert r0["calls"] == 2  # the embedding's own, then the bucket holding `gain`


@pytest.mark.distributed
@pytest.mark.timeout(270)
def test_lightning_accumulate_grad_batches_matches_one_process(ranks: list[dict[str, Any]]) -> None:
    """strategy fsdp2, accumulate_grad_batches=2, 31 unsharded parameters: one bucket reduced in each of the 4
    backwards, weights after 2 SGD steps those of one process on the global batch."""
    r0, r1 = ranks[0]["lightning_accumulate"], ranks[1]["lightning_accumulate"]
    assert r0["sharded"] == ["block.0.bias", "block.0.weight"]
    assert r0["weights"] == r1["weights"]
    assert r0["vs_reference"] <= 1e-5, r0["vs_reference"]
    assert r0["moved"] > 1e-3  # every parameter trained: the comparison is not between untouched copies
    assert r0["all_reduce_numels"] == r1["all_reduce_numels"] == [[30 * 8 + 1 + 31]] * 4


@pytest.mark.distributed
@pytest.mark.timeout(270)
def test_meta_built_unsharded_parameters_stay_equal_across_ranks(ranks: list[dict[str, Any]]) -> None:
    """Lightning materializes meta parameters after sharding, as new objects: each rank trained on its own samples,
    so the 20 unsharded head parameters agree only if their gradients were averaged."""
    r0, r1 = ranks[0]["lightning_meta"], ranks[1]["lightning_meta"]
    assert r0["built_on_meta"] and len(r0["heads"]) == 20
    assert r0["heads"] == r1["heads"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gradients_on_a_gpu(tmp_path: Path) -> None:
    """The same averaging with CUDA gradients (2 gloo ranks sharing cuda:0): not run here, needs a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r0, r1 = run_workers(WORKER, ["--scenarios", "cuda"], tmp_path, nprocs=2, timeout=280)
    assert r0["cuda"]["devices"] == ["cuda:0"]
    assert r0["cuda"]["grads"] == r1["cuda"]["grads"]
    for rank in (r0, r1):
        assert rank["cuda"]["vs_per_parameter"] == 0.0
        assert rank["cuda"]["vs_reference_fp32"] <= 1e-5, rank["cuda"]


def test_buckets_follow_dtype_device_and_size() -> None:
    """Registration order within a dtype and device, cut at the byte cap; a parameter above it gets its own."""
    from autoshard.adapters.fsdp2 import grad_buckets

    with torch.device("meta"):
        a, b, c, big, d = (torch.empty(n) for n in (100, 100, 100, 1000, 10))  # fp32: 400, 400, 400, 4000, 40 bytes
        h = torch.empty(100, dtype=torch.bfloat16)
    layout = grad_buckets([a, h, b, c, big, d], bucket_bytes=1000)
    assert [[id(t) for t in bucket] for bucket in layout] == [[id(a), id(b)], [id(c)], [id(big)], [id(d)], [id(h)]]
    assert [[id(t) for t in bucket] for bucket in grad_buckets([a, h, b, c, big, d], bucket_bytes=25 * 2**20)] == [
        [id(a), id(b), id(c), id(big), id(d)],
        [id(h)],
    ]


def test_averaging_runs_on_a_non_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients on meta (a stand-in for a GPU: no host reads, no numpy) through a fake 2-rank group: the reduction
    runs at the end of backward and writes back exactly the reached parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.activations import fake_world
    from autoshard.adapters.fsdp2 import average_unsharded_gradients

    sizes: list[int] = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *args, **kwargs: (sizes.append(t.numel()), real(t, *args, **kwargs))[1])
    with fake_world(2, 0), torch.device("meta"):
        model = nn.ParameterDict({"used": nn.Parameter(torch.ones(4)), "scalar": nn.Parameter(torch.ones(())), "unused": nn.Parameter(torch.ones(3))})
        assert average_unsharded_gradients(model, init_device_mesh("cpu", (2,))) == 3
        assert average_unsharded_gradients(model, init_device_mesh("cpu", (2,))) == 0  # idempotent
        (model["used"] * model["scalar"]).sum().backward()
        assert sizes == [4 + 1 + 3 + 3]  # one bucket: every registered parameter and a flag each
        assert model["used"].grad.device.type == "meta" and model["scalar"].grad.shape == ()
        assert model["unused"].grad is None
    assert not dist.is_initialized()
