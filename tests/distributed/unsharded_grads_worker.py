"""One rank of the unsharded-gradient averaging checks (tests/distributed/test_unsharded_grads.py); every scenario
runs in this one process pair. Each returns what THIS rank holds; the test compares ranks and references.

References, computed on every rank from both ranks' data (generated, not exchanged): one process on the global batch,
and the per-parameter path autoshard had before (one all_reduce and div_ per parameter, in its post-accumulate hook).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.adapters.fsdp2 import average_unsharded_gradients
from tests.distributed.harness import run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
SMALL, SMALL_NUMEL, HALF, HALF_NUMEL = 40, 32, 3, 16
SMALL_CAP = 1024  # fp32: the 0-dim scale (a module's own parameters come first) + 7 small, 8, 8, 8, 8, 1; bf16: 1


def mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))


class Many(nn.Module):
    """Many small unsharded parameters (fp32 and bf16, one 0-dim) around a body that fully_shard shards."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ParameterList([nn.Parameter(torch.randn(SMALL_NUMEL)) for _ in range(SMALL)])
        self.low = nn.ParameterList([nn.Parameter(torch.randn(HALF_NUMEL, dtype=torch.bfloat16)) for _ in range(HALF)])
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.body = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over samples of per-sample losses: the global batch's loss is the mean of the ranks' losses."""
        u = self.body(x).tanh()
        per_sample = u.square().sum(1)
        for i, p in enumerate([*self.small, *self.low]):
            per_sample = per_sample + (u[:, i % 16, None] * p.float()[None, :]).sin().sum(1)
        return (per_sample * self.scale).mean()


def data(rank: int, micro: int = 0, n: int = 4) -> torch.Tensor:
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(1000 * micro + rank))


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    from torch.distributed.tensor import DTensor

    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters() if not isinstance(p, DTensor)}


def as_lists(g: dict[str, torch.Tensor | None]) -> dict[str, list[float] | None]:
    return {n: None if t is None else t.float().flatten().tolist() for n, t in g.items()}


def max_diff(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None], names: Callable[[str], bool] = lambda n: True) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a if names(n) and a[n] is not None and b[n] is not None)


@contextmanager
def counted_all_reduces() -> Iterator[list[int]]:
    """The numel of every dist.all_reduce issued inside (looked up at call time, so every caller's is seen)."""
    sizes: list[int] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield sizes
    finally:
        dist.all_reduce = real


def per_parameter(module: nn.Module, group: Any) -> None:
    """autoshard's averaging before buckets, as it was: the reference for bitwise equality."""

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))

    for p in module.parameters():
        if p.requires_grad and not hasattr(p, "device_mesh"):
            p.register_post_accumulate_grad_hook(hook)


def built(averaging: str, cap: int | None = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # every rank, every variant: the same initial model
    model = Many()
    dp = mesh()
    fully_shard(model.body, mesh=dp)
    if averaging == "buckets":
        registered = average_unsharded_gradients(model, dp, **({"bucket_bytes": cap} if cap else {}))
        assert registered == SMALL + HALF + 1, registered
    elif averaging == "per_parameter":
        per_parameter(model, dp.get_group())
    return model


def reference(micros: int) -> dict[str, torch.Tensor | None]:
    """One process, every rank's samples: the gradient of the mean of the ranks' losses, summed over micro-batches."""
    torch.manual_seed(0)
    model = Many()
    for m in range(micros):
        (sum(model(data(r, m)) for r in range(WORLD)) / WORLD).backward()
    return {n: g for n, g in grads(model).items() if not n.startswith("body.")}  # sharded in the runs


def scenario_buckets() -> dict[str, Any]:
    """One backward and two accumulated ones, with the default and a small bucket size, against both references."""
    out: dict[str, Any] = {}
    for micros in (1, 2):
        ref = reference(micros)
        variants = {"default": built("buckets"), "small": built("buckets", SMALL_CAP), "per_parameter": built("per_parameter")}
        got: dict[str, dict[str, torch.Tensor | None]] = {}
        calls: dict[str, list[list[int]]] = {}
        for name, model in variants.items():
            calls[name] = []
            for m in range(micros):
                with counted_all_reduces() as sizes:
                    model(data(RANK, m)).backward()
                calls[name].append(sizes)
            got[name] = grads(model)
        fp32 = lambda n: not n.startswith("low.")  # noqa: E731
        bf16 = lambda n: n.startswith("low.")  # noqa: E731
        out[f"micro{micros}"] = {
            "grads": {name: as_lists(g) for name, g in got.items()},
            "all_reduce_numels": calls,
            "vs_per_parameter": {name: max_diff(got[name], got["per_parameter"]) for name in ("default", "small")},
            "vs_reference_fp32": {name: max_diff(g, ref, fp32) for name, g in got.items()},
            "vs_reference_bf16": {name: max_diff(g, ref, bf16) for name, g in got.items()},
            "reference_scale": max(float(t.abs().max()) for t in ref.values() if t is not None),
        }
    return out


class Branchy(nn.Module):
    """``only0`` is used by rank 0's data alone, ``never`` by nobody, ``always`` by both (or by nobody: ``always=False``);
    ``body`` is sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.only0 = nn.Parameter(torch.randn(8))
        self.never = nn.Parameter(torch.randn(8))
        self.always = nn.Parameter(torch.randn(8))
        self.body = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, rank: int, always: bool = True) -> torch.Tensor:
        h = self.body(x)
        loss = (h * self.always).sin().mean() if always else h.sin().mean()
        if rank == 0:  # a data-dependent branch, taken on one rank only
            loss = loss + (h * self.only0).cos().mean()
        return loss


def scenario_unused() -> dict[str, Any]:
    """A parameter one rank uses, one nobody uses; then a backward in which rank 1 reaches none of the unsharded
    parameters (only the sharded body), and one that reaches nothing of the model on any rank."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = Branchy()
    ref = copy.deepcopy(model)
    fully_shard(model.body, mesh=mesh())
    registered = average_unsharded_gradients(model, mesh())
    x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    out: dict[str, Any] = {"registered": registered}
    for always in (True, False):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with counted_all_reduces() as sizes:
            model(x[RANK], RANK, always).backward()
        (sum(ref(x[r], r, always) for r in range(WORLD)) / WORLD).backward()
        out[f"always={always}"] = {"grads": as_lists(grads(model)), "reference": as_lists(grads(ref)), "all_reduce_numels": sizes}
    before = grads(model)
    outside = torch.ones(8, requires_grad=True)  # not the model's: a backward of another model (a GAN's other half)
    with counted_all_reduces() as none_reached:
        (outside * x[RANK]).square().sum().backward()
    out["nothing_reached"] = {"all_reduce_numels": none_reached, "unchanged": as_lists(grads(model)) == as_lists(before)}
    return out


def scenario_replaced() -> dict[str, Any]:
    """Parameters replaced after registration (what materializing meta parameters with ``to_empty`` does, here by
    ``load_state_dict(assign=True)``): the new objects are averaged, in the first backward and after."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(4)
    model = Branchy()
    ref = copy.deepcopy(model)
    fully_shard(model.body, mesh=mesh())
    average_unsharded_gradients(model, mesh())
    old = model.always
    model.load_state_dict({n: p.detach().clone() for n, p in ref.named_parameters() if not n.startswith("body.")}, strict=False, assign=True)
    x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + r)) for r in range(WORLD)]
    sizes = []
    for _ in range(2):
        with counted_all_reduces() as one:
            model(x[RANK], RANK).backward()
        sizes.append(one)
        (sum(ref(x[r], r) for r in range(WORLD)) / WORLD).backward()
    return {"replaced": model.always is not old, "grads": as_lists(grads(model)), "reference": as_lists(grads(ref)), "all_reduce_numels": sizes}


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4, sparse=True)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed(ids) * self.gain).square().mean()


def scenario_sparse() -> dict[str, Any]:
    """nn.Embedding(sparse=True) left unsharded: its sparse gradient is averaged on its own, the rest in a bucket."""
    torch.manual_seed(2)
    model = Sparse()
    ref = copy.deepcopy(model)
    average_unsharded_gradients(model, mesh())
    ids = [torch.tensor([1, 2, 3]), torch.tensor([3, 4, 9])]
    with counted_all_reduces() as sizes:
        model(ids[RANK]).backward()
    (sum(ref(ids[r]) for r in range(WORLD)) / WORLD).backward()
    dense = lambda g: {n: None if t is None else t.to_dense() for n, t in g.items()}  # noqa: E731
    got, want = dense(grads(model)), dense(grads(ref))
    return {"grads": as_lists(got), "vs_reference": max_diff(got, want), "calls": len(sizes)}


def scenario_lightning_accumulate() -> dict[str, Any]:
    """strategy="fsdp2", accumulate_grad_batches=2, many small unsharded parameters: SGD weights against one process on
    the global batch, and the all_reduces issued inside each backward (one bucket each)."""
    import lightning.pytorch as pl
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from autoshard.lightning import FSDP2Strategy
    from tests.distributed.harness import quiet_trainer

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ParameterList([nn.Parameter(torch.randn(8)) for _ in range(30)])  # excluded: stays whole
            self.scale = nn.Parameter(torch.tensor(0.5))  # on the root: stays whole
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.block(x)
            return sum((h * p).sin().mean() for p in self.small) * self.scale

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class Count(pl.Callback):
        def __init__(self) -> None:
            self.per_backward: list[list[int]] = []

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._ctx = counted_all_reduces()
            self.per_backward.append(self._ctx.__enter__())

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._ctx.__exit__(None, None, None)

    pl.seed_everything(3, verbose=False)
    model = Net()
    ref, initial = copy.deepcopy(model), copy.deepcopy(model)
    steps, accumulate, batch = 2, 2, 4
    xs = torch.randn(WORLD * batch * accumulate * steps, 8, generator=torch.Generator().manual_seed(5))
    data = TensorDataset(xs)
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=False)  # rank r: samples r, r + W, ...
    count = Count()
    trainer = quiet_trainer(
        strategy=FSDP2Strategy(intent={"exclude": ["small"]}), max_steps=steps, accumulate_grad_batches=accumulate, callbacks=[count]
    )
    trainer.fit(model, DataLoader(data, batch_size=batch, sampler=sampler))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    micro = WORLD * batch  # micro-batch j of every rank together: samples [micro * j, micro * (j + 1))
    for k in range(steps):
        opt.zero_grad()
        for j in range(accumulate * k, accumulate * (k + 1)):
            (ref(xs[micro * j : micro * (j + 1)]) / accumulate).backward()
        opt.step()
    got = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return {
        "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "weights": {n: t.flatten().tolist() for n, t in got.items()},
        "vs_reference": max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters()),
        "moved": min(float((got[n] - p.detach()).abs().max()) for n, p in initial.named_parameters()),
        "all_reduce_numels": count.per_backward,
    }


def scenario_lightning_meta() -> dict[str, Any]:
    """Built on meta (``init_module(empty_init=True)``): Lightning materializes the parameters after sharding, as new
    objects. Ranks see different samples: the unsharded heads stay equal only if their gradients are averaged."""
    import lightning.pytorch as pl
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.lightning import FSDP2Strategy
    from tests.distributed.harness import quiet_trainer

    class Heads(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.heads = nn.ModuleList([nn.Linear(8, 2) for _ in range(10)])  # excluded: stays whole

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            h = self.block(batch[0])
            return sum(head(h).square().mean() for head in self.heads)  # type: ignore[return-value]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    pl.seed_everything(7, verbose=False)
    trainer = quiet_trainer(strategy=FSDP2Strategy(intent={"exclude": ["heads"]}), max_steps=3)
    with trainer.init_module(empty_init=True):
        model = Heads()
    built_on_meta = all(p.is_meta for p in model.parameters())
    xs = torch.randn(64, 8, generator=torch.Generator().manual_seed(RANK))  # each rank its own samples
    trainer.fit(model, DataLoader(TensorDataset(xs), batch_size=8))
    return {
        "built_on_meta": built_on_meta,
        "heads": {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if not isinstance(p, DTensor)},
    }


def scenario_cuda() -> dict[str, Any]:
    """Gradients on a GPU (both gloo ranks on cuda:0; gloo reduces CUDA tensors): the per-parameter path, bitwise, and
    one process on the global batch. Only run by the gpu-marked test."""
    torch.manual_seed(0)
    model = Many().cuda()
    model.body.requires_grad_(False)  # plain here: no fully_shard on CUDA under gloo
    old = copy.deepcopy(model)
    average_unsharded_gradients(model, mesh())
    per_parameter(old, mesh().get_group())
    for m in range(2):
        for net in (model, old):
            net(data(RANK, m).cuda()).backward()
    ref = reference(2)
    got, before = ({n: g for n, g in grads(net).items() if n in ref} for net in (model, old))
    return {
        "devices": sorted({str(g.device) for g in got.values() if g is not None}),
        "vs_per_parameter": max_diff(got, before),
        "vs_reference_fp32": max_diff({n: g.cpu() for n, g in got.items()}, ref, lambda n: not n.startswith("low.")),
        "grads": as_lists(got),
    }


SCENARIOS = {
    "buckets": scenario_buckets,
    "unused": scenario_unused,
    "replaced": scenario_replaced,
    "sparse": scenario_sparse,
    "lightning_accumulate": scenario_lightning_accumulate,
    "lightning_meta": scenario_lightning_meta,
    "cuda": scenario_cuda,  # the gpu-marked test asks for it; the others name theirs
}


if __name__ == "__main__":
    assert WORLD == 2, WORLD
    run_scenarios(SCENARIOS)
