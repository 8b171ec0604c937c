"""``offload='params'`` where the run's device is not the host: Lightning's ``model_to_device`` moved the whole module to
the GPU, and FSDP2 then refused the offloaded shards ("FSDP parameters should be materialized on CPU", measured on an
H200). The move keeps the sharded parameters on the host and sends the rest to the device. Here the device is
``meta``, a non-CPU stand-in; tests/test_gpu.py trains it on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from autoshard.activations import fake_world
from autoshard.adapters.fsdp2 import to_device_keeping_offloaded


def test_sharded_parameters_stay_on_the_host_and_the_rest_goes_to_the_device() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    with fake_world(1, 0):
        mesh = init_device_mesh("cpu", (1,))
        module = nn.Linear(4, 4)
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))  # a sharded unit's
        module.register_buffer("running", torch.zeros(4))
        weight = module.weight
        to_device_keeping_offloaded(module, torch.device("meta"))
        assert isinstance(module.weight, DTensor) and module.weight.device.type == "cpu" and module.weight is weight
        assert module.bias.device.type == "meta" and module.running.device.type == "meta"
