"""PyTorch FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy: the backend for every method."""

from __future__ import annotations

from autoshard.backends import Availability, Backend, require
from autoshard.capability import Feature, no, partial, yes

MIN_TORCH = "2.4"
INSTALL = f'pip install "torch>={MIN_TORCH}"'  # Lightning's range: autoshard.lightning.compat
DEEPSPEED_IF_ALLOWED = "strategy='autoshard-deepspeed' if the method has one optimizer, no EMA teacher and one forward per step"

ROW = {
    Feature.MULTIPLE_OPTIMIZERS: yes("each optimizer sees its own sharded DTensor parameters"),
    Feature.EMA_TEACHER_STUDENT: yes("teacher and student are sharded identically, so the positional EMA zip stays exact"),
    Feature.MULTI_FORWARD: yes("per-parameter sharding has no flat-parameter state machine to break"),
    Feature.MANUAL_OPTIMIZATION: yes(),
    Feature.ROOT_PARAMETERS: partial(
        "parameters that live directly on the LightningModule cannot be sharded by the generic plan"
        " (sharding the root breaks training_steps that call children directly); autoshard keeps them"
        " replicated and averages their gradients across ranks",
        "move them into a child module, or pass parallelize_fn to shard them yourself",
    ),
    Feature.PER_BLOCK_SHARDING: yes("blocks are the parameter-owning elements of every ModuleList / Sequential"),
    Feature.BF16: yes("autocast; parameters all-gathered in bf16, gradients reduced in fp32, fp32 weights updated"),
    Feature.BF16_TRUE: partial(
        "the module is converted to bf16 (Lightning's meaning of bf16-true): no fp32 master copy, so updates smaller"
        " than bf16's resolution (about 1/256 of a weight) are lost; ZeRO-3 keeps an fp32 master copy",
        "use precision='bf16-mixed' (fp32 weights, bf16 compute and all-gather), or " + DEEPSPEED_IF_ALLOWED,
    ),
    Feature.FP16_MIXED: no(
        "Lightning's ModelParallelStrategy refuses precision='16-mixed': it has no sharded gradient scaler, so fp16"
        " autocast would train unscaled",
        "use precision='bf16-mixed', or " + DEEPSPEED_IF_ALLOWED,
    ),
    Feature.FP16_TRUE: partial(
        "the module is converted to fp16: no fp32 master copy and no loss scaling, so small updates are lost and"
        " small gradients underflow; ZeRO-3 keeps an fp32 master copy and scales the loss",
        "use precision='bf16-mixed', or " + DEEPSPEED_IF_ALLOWED,
    ),
    Feature.FP32: yes(),
    Feature.CPU_OFFLOAD_PARAMS: yes("CPUOffloadPolicy keeps sharded parameters, gradients and optimizer state on CPU"),
    Feature.CPU_OFFLOAD_OPTIMIZER: partial(
        "FSDP2 has no optimizer-only offload; CPUOffloadPolicy offloads parameters, gradients and optimizer"
        " state together and runs the optimizer step on CPU",
        "use offload='params' to accept that, or " + DEEPSPEED_IF_ALLOWED,
    ),
    Feature.NVME_OFFLOAD: no(
        "FSDP2 can offload to CPU memory only",
        "use offload_device='cpu', or " + DEEPSPEED_IF_ALLOWED,
    ),
    Feature.ACTIVATION_CHECKPOINTING: yes("applied per block before sharding"),
    Feature.DISTRIBUTED_CHECKPOINT: yes("torch.distributed.checkpoint directory, reshardable on resume"),
    Feature.FULL_CHECKPOINT: yes("full state dict gathered on rank 0 into one file"),
    Feature.TENSOR_PARALLEL: partial(
        "autoshard builds the 2-D (data_parallel, tensor_parallel) mesh but has no generic tensor-parallel layout",
        "pass parallelize_fn that applies parallelize_module on device_mesh['tensor_parallel']",
    ),
    Feature.CPU_ACCELERATOR: yes("runs on gloo; used by autoshard's own tests"),
    Feature.INIT_FROM: yes("after sharding, each rank reads only its own rows of the safetensors, torch or DCP file"),
}


def check() -> Availability:
    return require("torch", MIN_TORCH, INSTALL)


BACKEND = Backend(
    name="fsdp2",
    strategy="fsdp2",
    row=ROW,
    check=check,
)
