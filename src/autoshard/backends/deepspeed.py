"""DeepSpeed ZeRO-3 through Lightning's DeepSpeedStrategy: one model, one optimizer, deep offload."""

from __future__ import annotations

from autoshard.backends import Availability, Backend, require, require_all
from autoshard.capability import Feature, no, partial, yes

MIN_DEEPSPEED = "0.14"
INSTALL = 'pip install "autoshard[deepspeed]"'
TO_FSDP2 = "use strategy='fsdp2' (or strategy='auto-shard')"

ROW = {
    Feature.MULTIPLE_OPTIMIZERS: no(
        "a DeepSpeed engine wraps exactly one optimizer (Lightning: 'DeepSpeed currently only supports single"
        " optimizer'), and optimizers owned by callbacks such as online probes count too",
        TO_FSDP2,
    ),
    Feature.EMA_TEACHER_STUDENT: no(
        "ZeRO-3 replaces every parameter outside a forward with an empty partitioned placeholder, so the"
        " teacher's EMA update would read and write placeholders; nothing upstream detects this",
        TO_FSDP2,
    ),
    Feature.MULTI_FORWARD: no(
        "ZeRO-3 prefetches parameters by the trace of one forward per step; several forwards before a backward"
        " invalidate the trace and re-gather every parameter each pass",
        TO_FSDP2,
    ),
    Feature.MANUAL_OPTIMIZATION: yes("with a single optimizer: manual_backward drives the engine"),
    Feature.ROOT_PARAMETERS: yes("ZeRO-3 partitions every parameter, wherever it lives"),
    Feature.PER_BLOCK_SHARDING: partial(
        "ZeRO-3 partitions each parameter and gathers per module through hooks; there is no per-block plan to inspect",
        "use strategy='fsdp2' to control the sharded units",
    ),
    Feature.BF16: yes("no autocast: the engine converts the model, every op computes in bf16; fp32 master copy"),
    Feature.BF16_TRUE: yes("fp32 master copy in the optimizer"),
    Feature.FP16_MIXED: yes("every op in fp16, fp32 master copy, dynamic loss scaling"),
    Feature.FP16_TRUE: yes("fp32 master copy, dynamic loss scaling"),
    Feature.FP32: yes(),
    Feature.CPU_OFFLOAD_PARAMS: yes("offload_param.device='cpu'"),
    Feature.CPU_OFFLOAD_OPTIMIZER: yes("offload_optimizer.device='cpu'"),
    Feature.NVME_OFFLOAD: yes("offload to nvme_path"),
    Feature.ACTIVATION_CHECKPOINTING: partial(
        "the activation_checkpointing config block only configures deepspeed.checkpointing; the model's blocks must"
        " call deepspeed.checkpointing.checkpoint themselves",
        "call deepspeed.checkpointing.checkpoint in your blocks, or use strategy='fsdp2', which checkpoints per block for you",
    ),
    Feature.DISTRIBUTED_CHECKPOINT: yes("DeepSpeed's own sharded checkpoint directory"),
    Feature.FULL_CHECKPOINT: partial(
        "ZeRO-3 saves a sharded directory; the full fp32 weights come from DeepSpeed's zero_to_fp32 conversion",
        "run `autoshard consolidate CKPT_DIR OUT.pt` after training",
    ),
    Feature.TENSOR_PARALLEL: no("Lightning's DeepSpeedStrategy is data parallel only", TO_FSDP2 + " with parallelize_fn"),
    Feature.CPU_ACCELERATOR: partial(
        "Lightning's DeepSpeedStrategy accepts only CUDA; autoshard's subclass runs ZeRO-3 on CPU (gloo) for tests, slowly",
        "use accelerator='gpu' for real runs",
    ),
    Feature.INIT_FROM: no(
        "autoshard loads init_from into FSDP2 shards only: under ZeRO-3 the weights would have to enter each parameter"
        " partition inside Lightning's setup, before deepspeed.initialize copies them into the fp32 master partitions,"
        " and there is no hook between the two",
        TO_FSDP2 + ", or load the weights into the module before trainer.fit (every rank then holds the whole model"
        " until ZeRO-3 partitions it)",
    ),
}


def check() -> Availability:
    from autoshard.backends import fsdp2

    return require_all(fsdp2.check(), require("deepspeed", MIN_DEEPSPEED, INSTALL))


BACKEND = Backend(
    name="deepspeed_zero3",
    strategy="autoshard-deepspeed",
    row=ROW,
    check=check,
)
