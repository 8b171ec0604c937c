"""DeepSpeed ZeRO-3 through Lightning's DeepSpeedStrategy: one model, one optimizer, deep offload."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autoshard.backends.base import Availability, Backend, BudgetChoices, require, require_all
from autoshard.capability import Cell, Feature, Format, no, partial, yes
from autoshard.errors import IntentError
from autoshard.precision import Dtype, PrecisionPlan

if TYPE_CHECKING:
    from autoshard.memory_model import Layout, MemoryEstimate, Param, RankInputs

BACKEND_NAME = "deepspeed_zero3"
# DeepSpeed's estimator counts 18 bytes per parameter for ZeRO-3 model states (Adam in mixed precision).
# Its formula gives only the total; the split into 16-bit params / 16-bit grads / the rest is autoshard's reading.
ZERO3_BYTES_PER_PARAM = 18
# The config's reduce_bucket_size (adapters.deepspeed.ZERO3_DEFAULTS), in elements: with contiguous_gradients ZeRO-3
# allocates this bucket whole when the engine is built (stage3.py, DeepSpeed 0.19), whatever the model's size, in the
# gradient reduction's dtype (communication_data_type: fp32 under bf16-mixed, each gradient cast into it); DeepSpeed's
# estimator leaves it out.
REDUCE_BUCKET_SIZE = 200_000_000
# The config's stage3_param_persistence_threshold and stage3_max_reuse_distance (DeepSpeed's defaults), in elements:
# parameters of at most the threshold stay whole on every rank; see kept_gathered for the reuse distance.
PERSISTENCE_THRESHOLD = 100_000
MAX_REUSE_DISTANCE = 1_000_000_000

MIN_DEEPSPEED = "0.14"
INSTALL = 'pip install "autoshard[deepspeed]"'
TO_FSDP2 = "use strategy='fsdp2' (or strategy='auto-shard')"


# What ZeRO-3 does instead: partitioned_param_coordinator's __params_to_release (DeepSpeed 0.19.8), modelled by kept_gathered.
def keep_gathered_cell(distance: float | None = None) -> Cell:
    """The ``KEEP_GATHERED`` cell, with the run's ``stage3_max_reuse_distance`` when its ``zero_overrides`` set one
    (``distance``): then the Fix no longer tells the user to set what they set, only to move to fsdp2."""
    reach = "DeepSpeed's default" if distance is None else "set by zero_overrides"
    shown = MAX_REUSE_DISTANCE if distance is None else int(distance) if float(distance).is_integer() else distance  # 1e9: 1,000,000,000
    reason = (
        "ZeRO-3 has no such switch, and autoshard sets nothing for the field: once its trace is recorded (from the"
        " second step) ZeRO-3 keeps a module's parameters gathered after its forward only when their next use is within"
        f" stage3_max_reuse_distance elements of the trace ({shown:,}, {reach})"
    )
    fsdp2 = f"{TO_FSDP2} for reshard_after_forward=False"
    if distance is not None:
        return partial(f"{reason}; the rest are released and gathered again in backward", fsdp2)
    return partial(
        f"{reason}: the rest of the forward and the backward up to that module, about twice the parameters after it"
        " (three times where blocks are checkpointed). So the trailing blocks stay gathered (every block of a model of"
        " a few hundred million parameters), and the rest are released and gathered again in backward",
        "set zero_overrides={'stage3_max_reuse_distance': N} on the strategy to choose how many elements ahead ZeRO-3"
        f" keeps parameters for (0 releases each module's after its forward), or {fsdp2}",
    )


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
    # Measured by tests/distributed/test_deepspeed_multi_forward.py (a raw ZeRO-3 engine on 2 gloo ranks).
    Feature.MULTI_FORWARD: partial(
        "trains correctly: measured on 2 ranks (fp32, every parameter partitioned, 6 steps of two views, of"
        " multi-crop and of a no_grad target forward), the weights equal one process on the global batch to 4e-8;"
        " but DeepSpeed invalidates its parameter prefetch trace at every such step (measured: once per step), so"
        " parameters are gathered on demand without prefetch: a two-view step all-gathered 1.8x the parameters of a"
        " one-forward step that re-gathers for backward (3.7x one whose parameters stay live), 3 forwards 2.3x",
        "use strategy='fsdp2' (or strategy='auto-shard'), whose units are gathered per forward with prefetch; or"
        " forward the views as one batch (torch.cat) where the model has no per-batch statistics (BatchNorm)",
    ),
    Feature.MANUAL_OPTIMIZATION: yes("with a single optimizer: manual_backward drives the engine"),
    Feature.ROOT_PARAMETERS: yes("ZeRO-3 partitions every parameter, wherever it lives"),
    Feature.PER_BLOCK_SHARDING: partial(
        "ZeRO-3 partitions each parameter and gathers per module through hooks; there is no per-block plan to inspect",
        "use strategy='fsdp2' to control the sharded units",
    ),
    Feature.KEEP_GATHERED: keep_gathered_cell(),
    Feature.BF16: yes("no autocast: the engine converts the model, every op computes in bf16; fp32 master copy"),
    Feature.BF16_TRUE: yes("fp32 master copy in the optimizer"),
    Feature.FP16_MIXED: yes("every op in fp16, fp32 master copy, dynamic loss scaling"),
    Feature.FP16_TRUE: yes("fp32 master copy, dynamic loss scaling"),
    Feature.FP32: yes(),
    Feature.CPU_OFFLOAD_PARAMS: yes("offload_param.device='cpu'"),
    Feature.CPU_OFFLOAD_OPTIMIZER: yes("offload_optimizer.device='cpu'"),
    Feature.NVME_OFFLOAD: yes("offload to nvme_path"),
    Feature.ACTIVATION_CHECKPOINTING: yes(
        "autoshard checkpoints the same blocks as under fsdp2 (every block or every k-th), before the engine is built"
    ),
    # Measured (2 gloo ranks, deepspeed 0.19.8, torch 2.13): RuntimeError "aten.slice.Tensor encountered during backward
    # but not found in storage" at the first backward; every block and every k-th block train bit-exactly.
    Feature.SELECTIVE_CHECKPOINTING: no(
        "ZeRO-3 gathers each submodule's parameters in hooks inside the block, and a recomputation in backward gathers"
        " them again where the forward found them prefetched, so torch's selective cache meets ops it never saw and"
        " stops the backward",
        "activation_checkpointing=True (every block) or 2 (every 2nd block), or strategy='fsdp2' for 'selective'",
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
        TO_FSDP2 + ", or load the weights into the module before trainer.fit (every rank then holds the whole model until ZeRO-3 partitions it)",
    ),
    Feature.HYBRID_SHARDING: no(
        "shard_size means parameters, gradients and optimizer state sharded within each group and replicated across"
        " groups. In DeepSpeed that was MiCS (mics_shard_size: parameters partitioned over the shard group, gradients"
        " reduce-scattered there then all-reduced across the replica groups, optimizer state per group), which"
        " DeepSpeed 0.19.7 removed (its config now raises 'MiCS ZeRO-3 sharding has been removed'). What remains,"
        " ZeRO++ hpZ (zero_hpz_partition_size), is not hybrid sharding: it adds a second copy of the parameters,"
        " partitioned within the group for the backward all-gather only; the parameters' own partition, the"
        " gradients and the optimizer states stay sharded over every rank (the forward gather and the gradient"
        " reduce-scatter still span all of them)",
        TO_FSDP2 + ", which shards within shard_size groups; or drop shard_size to shard over every rank under ZeRO-3",
    ),
    Feature.COMPILE: no(
        "autoshard does not drive DeepSpeed's own engine.compile() (one torch.compile of the whole engine module,"
        " with ZeRO-3's parameter-gathering hooks inside it): not made to work or measured here, and Lightning's"
        " DeepSpeedStrategy refuses a compiled LightningModule ('Using a compiled model is incompatible')",
        TO_FSDP2 + ", which compiles each block before fully_shard; or drop compile (and the model's torch.compile) to train eager under ZeRO-3",
    ),
}


def check() -> Availability:
    from autoshard.backends import fsdp2

    return require_all(fsdp2.check(), require("deepspeed", MIN_DEEPSPEED, INSTALL))


def precision(plan: PrecisionPlan) -> PrecisionPlan:
    """What ZeRO-3 runs for ``plan``: it differs from FSDP2 in three ways.

    Under Lightning's DeepSpeedStrategy there is no autocast (the engine converts the model, so "-mixed" computes
    every op in the low dtype), the parameters are stored and gathered in the low dtype, and the optimizer always
    keeps an fp32 master copy, with dynamic loss scaling for fp16. Gradients are reduced in the plan's dtype
    (``communication_data_type``). A gather dtype other than the low dtype (``param_dtype``) is refused there.
    """
    low = plan.precision.dtype
    if plan.gather is not low:
        raise IntentError(
            f"param_dtype='{plan.gather}' contradicts precision='{plan.precision}': under DeepSpeed the compute"
            f" dtype of the parameters follows the precision ({low} here). Backend that can cast"
            f" separately: fsdp2. Fix: drop param_dtype, or set the Trainer precision that computes in"
            f" {plan.gather}"
        )
    return dataclasses.replace(plan, compute=low, autocast=False, master=Dtype.FLOAT32, loss_scaling=low is Dtype.FLOAT16)


def zero3_model_states(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int,
    num_nodes: int = 1,
    cpu_offload: bool = False,
    cpu_offload_params: bool = False,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(cpu bytes per node, gpu bytes per rank, largest layer bytes): DeepSpeed's
    ``estimate_zero3_model_states_mem_needs``, restated so that estimating never imports deepspeed."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        factor = (18 if cpu_offload_params else 16) * gpus_factor
        per = factor if zero_init else max(4 * num_gpus_per_node, factor)
        cpu_mem = total_params * per * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def zero_size(inputs: RankInputs, key: str, default: int) -> int:
    """A zero_optimization size as the run's config has it: the user's zero_overrides, else autoshard's default."""
    return int(inputs.zero_overrides.get(key, default))


def kept_gathered(layout: Layout, reuse_distance: int = MAX_REUSE_DISTANCE, persistence: int = PERSISTENCE_THRESHOLD) -> int:
    """Bytes of the parameters ZeRO-3 keeps gathered, whole on every rank in the gather dtype, from their forward into
    their backward: all live when the backward starts, the activations' peak. Once its trace is recorded (from the
    second step) DeepSpeed releases a module's parameters after its forward only when the trace does not reach their
    next use within ``reuse_distance`` elements (partitioned_param_coordinator's __params_to_release, DeepSpeed 0.19).
    The trace walked here: the modules in registration order, taken as the forward's, then the backward in reverse,
    where a checkpointed block is forwarded again once its last module is reached. Parameters within the persistence
    threshold (``persistence`` elements) are whole anyway, and not counted. The prefetch also keeps what it has looked past, but it looks 5e7
    not-yet-gathered elements ahead (stage3_prefetch_bucket_size), within the reuse distance under these defaults."""
    from itertools import accumulate

    from autoshard.memory_model import numel

    modules: dict[str, list[Param]] = {}
    for p in layout.params.values():
        modules.setdefault(p.name.rpartition(".")[0], []).append(p)
    forward, backward, recomputed = list(modules), list[str](), set[str]()
    for name in reversed(forward):
        backward.append(name)
        block = next((b for b in layout.recomputed if name == b or name.startswith(b + ".")), None)
        if block is not None and block not in recomputed:  # after its last module's backward fetch (measured)
            recomputed.add(block)
            backward += [n for n in forward if n == block or n.startswith(block + ".")]
    elements = [0, *accumulate(sum(numel(p.shape) for p in modules[n]) for n in forward + backward)]
    first_in_backward: dict[str, int] = {}
    for j, name in enumerate(backward):
        first_in_backward.setdefault(name, j)
    kept = 0
    for i, name in enumerate(forward):
        if elements[len(forward) + first_in_backward[name]] - elements[i + 1] < reuse_distance:  # to its next use
            kept += sum(numel(p.shape) * p.gather_elsize for p in modules[name] if numel(p.shape) > persistence)
    return kept


def memory(layout: Layout, inputs: RankInputs) -> MemoryEstimate:
    """DeepSpeed's own estimator figures, split into categories, with the sizes of the run's zero_optimization config
    (``zero_overrides`` over autoshard's defaults); ``overrides`` is unused (its formula assumes Adam).
    A ``shard_size`` that makes replicas is refused, as the matrix refuses it: DeepSpeed's estimators take no shard
    group."""
    from autoshard.errors import AutoShardError, IncompatibleBackendError
    from autoshard.memory_model import MemoryEstimate, numel
    from autoshard.units import fmt_bytes

    intent, sourced, world_size, num_nodes = inputs.intent, inputs.sourced, inputs.world_size, inputs.num_nodes
    if world_size % num_nodes:
        raise AutoShardError(f"world size {world_size} is not a multiple of num_nodes={num_nodes}. Fix: world size = num_nodes x devices per node")
    if inputs.dims.hybrid:
        cell = ROW[Feature.HYBRID_SHARDING]
        raise IncompatibleBackendError(
            f"no {BACKEND_NAME} memory estimate for shard_size={intent.shard_size!r} on {world_size} ranks: {cell.reason}."
            f" Backend that works: fsdp2 (strategy='fsdp2'). Fix: {cell.remedy}"
        )
    per_node = world_size // num_nodes
    total = sum(numel(p.shape) for p in layout.params.values())
    offload_opt = intent.offload in ("optimizer", "params")
    offload_params = intent.offload == "params"
    cpu_mem, gpu_mem, largest_mem = zero3_model_states(
        total, layout.largest_layer_params, per_node, num_nodes, offload_opt, offload_params, inputs.zero_init
    )
    contiguous = bool(inputs.zero_overrides.get("contiguous_gradients", True))  # the bucket is allocated whole only then
    bucket = zero_size(inputs, "reduce_bucket_size", REDUCE_BUCKET_SIZE) * layout.precision.reduce.bytes if contiguous else 0
    reuse_distance = zero_size(inputs, "stage3_max_reuse_distance", MAX_REUSE_DISTANCE)
    kept = kept_gathered(layout, reuse_distance, zero_size(inputs, "stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD))
    states = int(ZERO3_BYTES_PER_PARAM * total / world_size)
    params = grads = int(2 * total / world_size)  # 16-bit parameters and gradients, 2 bytes each
    offloaded = ("parameters", "gradients", "optimizer_states") if offload_params else ("gradients", "optimizer_states") if offload_opt else ()
    notes = [
        "ZeRO-3 figures are DeepSpeed's estimate_zero3_model_states_mem_needs (18 bytes per parameter, Adam in mixed"
        " precision; the gathered block is 4 bytes x the largest layer); the split into 16-bit params (2 B),"
        " 16-bit grads (2 B) and optimizer states with fp32 master weights (14 B) is autoshard's reading",
        "parameters below stage3_param_persistence_threshold stay whole on every rank; DeepSpeed's formula ignores them",
        f"the gathered row adds ZeRO-3's gradient reduce bucket ({fmt_bytes(bucket)}: reduce_bucket_size elements of the"
        f" reduction dtype, {layout.precision.reduce}, allocated whole when the engine is built), which DeepSpeed's formula"
        " leaves out",
        f"the gathered row adds the parameters ZeRO-3 keeps gathered from forward into backward ({fmt_bytes(kept)}: each"
        f" module whose next use is within stage3_max_reuse_distance ({reuse_distance:,}) elements of the trace,"
        " whole on every rank), which DeepSpeed's formula leaves out",
    ]
    names = {type(o).__name__ for _, o in sourced}
    if names - {"Adam", "AdamW", "DeepSpeedCPUAdam", "FusedAdam"}:
        notes.append(f"DeepSpeed's formula assumes Adam; this method uses {', '.join(sorted(names))}")
    if intent.offload_device == "nvme" and intent.offload != "none":
        notes.append("offload_device='nvme': the offloaded states live on NVMe; the CPU figure bounds the staging buffers")
    estimate = MemoryEstimate(
        backend=BACKEND_NAME,
        world_size=world_size,
        rank=inputs.rank,
        precision=layout.precision.precision.value,
        gather_dtype=layout.precision.gather.value,
        parameters=params,
        gradients=grads,
        optimizer_states=states - params - grads,
        ema_teacher=0,
        unsharded=0,
        gathered_block=largest_mem + bucket + kept,
        gathered_unit="",
        full_model_states=ZERO3_BYTES_PER_PARAM * total,
        offloaded=offloaded,
        host=cpu_mem,
        optimizers=tuple(f"{type(o).__name__} ({s})" for s, o in sourced),
        notes=tuple(notes),
    )
    assert estimate.device == gpu_mem + bucket + kept, (estimate.device, gpu_mem)  # DeepSpeed's figure, the bucket, the kept parameters
    return estimate


def host_bytes(states: MemoryEstimate, offload: str, reshard: bool) -> int:
    """Per step: 'optimizer' sends the gradient partition to the host and brings the updated parameter partition
    back; 'params' also brings the parameter partition in for the forward's and the backward's gathers."""
    return {"none": 0, "optimizer": states.parameters + states.gradients, "params": 2 * states.parameters + states.gradients}[offload]


BUDGET = BudgetChoices(
    fields=("activation_checkpointing", "offload"),  # no resharding, no shard group under ZeRO-3
    offload=("none", "optimizer", "params"),
    selective=False,  # the matrix refuses it (Feature.SELECTIVE_CHECKPOINTING: ZeRO-3's gathers run inside the block)
    host_bytes=host_bytes,
    peaks="DeepSpeed ZeRO-3 (its estimator + the simulated activations)",
    limits="under DeepSpeed autoshard sets the offload and activation checkpointing only; strategy='fsdp2' can also reshard and group shards",
    check="autoshard.adapters.deepspeed:check_intent",
)

BACKEND = Backend(
    name=BACKEND_NAME,
    strategy="autoshard-deepspeed",
    row=ROW,
    check=check,
    config="autoshard.adapters.deepspeed:deepspeed_config",
    lightning="autoshard.lightning.deepspeed:AutoShardDeepSpeedStrategy",
    precision=precision,
    memory=memory,
    host_memory="CPU memory (DeepSpeed, per node)",
    budget=BUDGET,
    writes=Format.DEEPSPEED,
    resumes=(Format.DEEPSPEED, Format.FULL),
)
