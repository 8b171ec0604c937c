"""The memory estimator: optimizer states per type, meta = real, exact per-rank shards, DeepSpeed's own figures."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard.backends.deepspeed import REDUCE_BUCKET_SIZE, zero3_model_states
from autoshard.demo import DinoLike, OnlineProbe
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.memory import EstimateOptions, collect_optimizers, estimate_memory, estimate_memory_many, memory_table
from autoshard.memory_model import shard_rows
from autoshard.needs import MethodNeeds, inspect_needs

NO_NEEDS = MethodNeeds(optimizer_sources=())


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    return sum(local(v).numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def held(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    size = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    total = sum(size(p) for p in module.parameters()) + sum(size(p.grad) for p in module.parameters() if p.grad is not None)
    return total + (state_bytes(optimizer) if optimizer is not None else 0)


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: int = 6) -> None:
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.randn(4, inputs)).pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)


OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p),
    "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, amsgrad=True),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "RMSprop-centered-momentum": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p),
    "Adagrad": lambda p: torch.optim.Adagrad(p),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
    "Adafactor": lambda p: torch.optim.Adafactor(p),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_states_counted_per_type_as_torch_allocates_them(name: str) -> None:
    model = mlp()
    optimizer = OPTIMIZERS[name](model.parameters())
    estimate = estimate_memory(model, needs=NO_NEEDS, optimizers=[optimizer])
    one_step(model, optimizer)
    assert estimate.optimizer_states == state_bytes(optimizer), name
    assert estimate.model_states == held(model, optimizer)


def test_param_groups_are_read_one_by_one() -> None:
    model = mlp()
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[2].parameters()}], lr=0.1)
    estimate = estimate_memory(model, needs=NO_NEEDS, optimizers=[optimizer])
    one_step(model, optimizer)
    assert estimate.optimizer_states == state_bytes(optimizer) == (30 + 5) * 4


def test_unknown_optimizer_is_a_stated_guess_and_can_be_told() -> None:
    class Lion(torch.optim.Optimizer):
        def __init__(self, params: object) -> None:
            super().__init__(params, {"lr": 1e-4})

    model = mlp()
    guess = estimate_memory(model, needs=NO_NEEDS, optimizers=[Lion(model.parameters())])
    told = estimate_memory(model, needs=NO_NEEDS, optimizers=[Lion(model.parameters())], options=EstimateOptions(state_tensors={"Lion": 1}))
    numel = sum(p.numel() for p in model.parameters())
    assert guess.optimizer_states == 2 * 4 * numel and told.optimizer_states == 4 * numel
    assert any("Lion" in note and "state_tensors" in note for note in guess.notes)


def dino_with_probe(device: str) -> tuple[DinoLike, OnlineProbe]:
    with torch.device(device):
        torch.manual_seed(0)
        model, probe = DinoLike(dim=33), OnlineProbe(dim=33)
        probe.setup(None, model, "fit")
    return model, probe


def test_meta_module_estimates_exactly_like_the_real_one() -> None:
    estimates = {}
    for device in ("meta", "cpu"):
        model, probe = dino_with_probe(device)
        needs = inspect_needs(model, callbacks=[probe])
        estimates[device] = [e.to_dict() for e in estimate_memory_many(model, None, needs, [1, 2, 8, 64], callbacks=[probe])]
    assert estimates["meta"] == estimates["cpu"]
    one = estimates["meta"][0]
    assert one["parameters"] == one["ema_teacher"] and one["unsharded"] > 0  # teacher mirrors student; probe whole


def test_callback_optimizers_count_on_their_modules() -> None:
    model, probe = dino_with_probe("meta")
    probe.optimizer = torch.optim.SGD(model.probe.parameters(), lr=0.1, momentum=0.9)
    sources = [s for s, _ in collect_optimizers(model, [probe])]
    assert sources == ["configure_optimizers", "callback OnlineProbe"]
    estimate = estimate_memory(model, None, inspect_needs(model, callbacks=[probe]), 2, callbacks=[probe])
    probe_part = next(p for p in estimate.unsharded_parts if p.name == "probe")
    numel = sum(p.numel() for p in model.probe.parameters())
    assert probe_part.bytes == 3 * 4 * numel  # parameter + gradient + momentum buffer, whole on every rank


@pytest.mark.parametrize("rows,world", [(13, 2), (33, 8), (5, 64), (64, 64), (3, 2)])
def test_shard_rows_follow_torch_chunk(rows: int, world: int) -> None:
    chunks = [c.shape[0] for c in torch.chunk(torch.empty(rows), world)]
    chunks += [0] * (world - len(chunks))
    assert [shard_rows(rows, world, r) for r in range(world)] == chunks


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[object]:
    """A single-process stand-in for ``world_size`` ranks: real fully_shard, shapes exact, values meaningless."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


class Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 13)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(2))
        self.frozen = nn.Linear(13, 7).requires_grad_(False)
        self.head = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.frozen(x)) * self.scale


@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (8, 3), (64, 0), (64, 63)])
def test_exact_bytes_per_rank_against_real_fully_shard(world: int, rank: int) -> None:
    from autoshard.adapters.fsdp2 import plan_fsdp2

    model = Uneven()
    twin = copy.deepcopy(model).to("meta")
    estimate = estimate_memory(
        twin, needs=NO_NEEDS, world_size=world, optimizers=[torch.optim.AdamW(twin.parameters())], options=EstimateOptions(rank=rank)
    )
    assert any("parameters live directly on Uneven" in note for note in estimate.notes)
    with fake_world(world, rank) as mesh, pytest.warns(UserWarning):
        plan_fsdp2(model, ShardingIntent(), NO_NEEDS).apply(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed, as the estimate assumes: bf16 all-gathers
            one_step(model, optimizer, inputs=8)
        assert estimate.model_states == held(model, optimizer), memory_table([estimate])
        with pytest.raises(AutoShardError, match="already sharded"):
            collect_optimizers(model)


def test_precision_policy_offload_and_resharding_change_what_they_should() -> None:
    model, probe = dino_with_probe("meta")
    needs = inspect_needs(model, callbacks=[probe])
    base = estimate_memory(model, None, needs, 8, callbacks=[probe])
    half = estimate_memory(model, {"precision": "bf16-true"}, needs, 8, callbacks=[probe])
    assert half.parameters * 2 == base.parameters and half.gradients * 2 == base.gradients
    # bf16-mixed (the default) all-gathers in bf16: half the gathered block of the fp32 opt-out, same model states
    assert base.gather_dtype == "bfloat16" and "largest gathered block (transient, bfloat16)" in memory_table([base])
    assert f"largest unit: '{base.gathered_unit}', all-gathered in bfloat16" in memory_table([base])
    gathered_fp32 = estimate_memory(model, {"param_dtype": "float32"}, needs, 8, callbacks=[probe])
    assert gathered_fp32.gathered_block == 2 * base.gathered_block and gathered_fp32.model_states == base.model_states
    assert estimate_memory(model, {"precision": "32-true"}, needs, 8, callbacks=[probe]).gathered_block == gathered_fp32.gathered_block
    kept = estimate_memory(model, {"reshard_after_forward": False}, needs, 8, callbacks=[probe])
    assert kept.gathered_block > 3 * base.gathered_block  # every student unit stays gathered until backward
    offload = estimate_memory(model, {"offload": "params"}, needs, 8, callbacks=[probe])
    assert offload.host == offload.parameters + offload.gradients + offload.optimizer_states + offload.ema_teacher
    assert offload.device == offload.unsharded + offload.gathered_block
    assert "=" in memory_table([base]) and "\x1b" not in memory_table([base])


def test_configure_optimizers_that_needs_a_trainer_gets_a_fix() -> None:
    class NeedsTrainer(DinoLike):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.trainer.max_steps)

    with torch.device("meta"):
        model = NeedsTrainer()
    with pytest.raises(AutoShardError, match="pass optimizers="):
        estimate_memory(model, needs=MethodNeeds())


@pytest.mark.deepspeed
@pytest.mark.parametrize("world,nodes", [(1, 1), (8, 1), (64, 8)])
@pytest.mark.parametrize("offload", ["none", "optimizer", "params"])
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_figures_are_deepspeeds_own(world: int, nodes: int, offload: str, zero_init: bool) -> None:
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 256), nn.Linear(256, 64))
    total, largest = stage3.model_to_params(model)
    cpu, gpu, largest_mem = stage3.estimate_zero3_model_states_mem_needs(
        total,
        largest,
        num_gpus_per_node=world // nodes,
        num_nodes=nodes,
        cpu_offload=offload != "none",
        cpu_offload_params=offload == "params",
        zero_init=zero_init,
    )
    with torch.device("meta"):
        twin = copy.deepcopy(model).to("meta")
    optimizer = torch.optim.AdamW(twin.parameters())
    estimate = estimate_memory(
        twin,
        {"offload": offload},
        NO_NEEDS,
        world,
        "deepspeed",
        optimizers=[optimizer],
        options=EstimateOptions(num_nodes=nodes, zero_init=zero_init),
    )
    bucket = REDUCE_BUCKET_SIZE * 4  # ZeRO-3's reduce bucket, allocated whole (bf16-mixed: reduced in fp32)
    assert (estimate.host, estimate.device, estimate.gathered_block) == (cpu, gpu + bucket, largest_mem + bucket)
    assert zero3_model_states(total, largest, world // nodes, nodes, offload != "none", offload == "params", zero_init) == (cpu, gpu, largest_mem)
