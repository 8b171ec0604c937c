"""PyTorch FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy: the backend for every method."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autoshard.backends.base import Availability, Backend, BudgetChoices, require
from autoshard.capability import Feature, Format, no, partial, yes

if TYPE_CHECKING:
    from autoshard.memory_model import Layout, MemoryEstimate, RankInputs, Traffic
    from autoshard.precision import PrecisionPlan

BACKEND_NAME = "fsdp2"

MIN_TORCH = "2.4"
INSTALL = f'pip install "torch>={MIN_TORCH}"'  # Lightning's range: autoshard.privates.in_lightning
DEEPSPEED_IF_ALLOWED = "strategy='autoshard-deepspeed' if the method has one optimizer and no EMA teacher"

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
    Feature.KEEP_GATHERED: yes(
        "fully_shard's own reshard_after_forward=False on each planned unit: its parameters stay gathered until its"
        " backward, which gathers nothing again; EMA teachers and forwards without grad still reshard"
    ),
    Feature.BF16: yes("autocast; parameters all-gathered in bf16, gradients reduced in fp32, fp32 weights updated"),
    Feature.BF16_TRUE: partial(
        "the module is converted to bf16 (Lightning's meaning of bf16-true): no fp32 master copy, so updates smaller"
        " than bf16's resolution (about 1/256 of a weight) are lost; ZeRO-3 keeps an fp32 master copy",
        "use precision='bf16-mixed' (fp32 weights, bf16 compute and all-gather), or " + DEEPSPEED_IF_ALLOWED,
    ),
    Feature.FP16_MIXED: yes(
        "autocast in fp16, parameters all-gathered in fp16, gradients reduced in fp32, fp32 weights updated; dynamic loss"
        " scaling by autoshard's sharded grad scaler (Lightning's ModelParallelStrategy has none): an inf or NaN in any"
        " rank's gradient shard skips the step on every rank, gradients are clipped after unscaling, and the scaler's"
        " state is saved and resumed with the checkpoint (on CPU too, where Lightning would run bf16-mixed)"
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
    Feature.SELECTIVE_CHECKPOINTING: yes("torchtitan's op-level policy, inside each block's forward"),
    Feature.DISTRIBUTED_CHECKPOINT: yes("torch.distributed.checkpoint directory, reshardable on resume"),
    Feature.FULL_CHECKPOINT: yes("full state dict gathered on rank 0 into one file"),
    Feature.TENSOR_PARALLEL: partial(
        "laid out from the model's own plan (transformers' base_model_tp_plan and _tp_plan, or a _tp_plan dict):"
        " colwise and rowwise layers with their gathered-output and split-input variants, vocabulary-parallel"
        " embeddings, whole norms (gradient-summed where the plan says so), tied weights kept one tensor; then"
        " fully_shard over the data-parallel ranks of the same mesh; or laid out by your parallelize_fn. Not covered:"
        " sequence parallelism, mixture-of-experts, packed and per-head-unit styles (refused by name before training),"
        " and explain's simulated step (model states and traffic are estimated, activations are not)",
        "for a model without a plan, or with a style autoshard refuses, pass parallelize_fn that applies"
        " parallelize_module on device_mesh['tensor_parallel']",
    ),
    Feature.CPU_ACCELERATOR: yes("runs on gloo; used by autoshard's own tests"),
    Feature.INIT_FROM: yes("after sharding, each rank reads only its own rows of the safetensors, torch or DCP file"),
    Feature.HYBRID_SHARDING: yes(
        "fully_shard on a 2-D (replicate, shard) mesh of the data-parallel ranks: sharded within each shard_size group, replicated across groups"
    ),
    Feature.COMPILE: yes(
        "each planned block compiled in place (block.compile()) after activation checkpointing and before fully_shard"
        " (torchtitan's order), so FSDP2's per-block all-gathers and reduce-scatters still run; a model the user"
        " compiled (torch.compile, an OptimizedModule) is unwrapped first, so checkpoints keep the eager names"
    ),
}


def check() -> Availability:
    return require("torch", MIN_TORCH, INSTALL)


def precision(plan: PrecisionPlan) -> PrecisionPlan:
    """FSDP2 runs the resolved plan as is: autocast, MixedPrecisionPolicy's gather and reduce dtypes."""
    return plan


def memory(layout: Layout, inputs: RankInputs) -> MemoryEstimate:
    """Exact per-rank bytes under FSDP2's Shard(0) (uneven shards included), over the world or, with
    ``shard_size``, over the rank's shard group; ``num_nodes`` places ranks for 'node' and traffic; ``zero_init``: unused.
    """
    from autoshard.memory_model import CATEGORIES, MemoryEstimate, UnshardedPart, local_shape, numel, optimizer_bytes, outside_param
    from autoshard.units import fmt_bytes

    sourced, overrides, rank, world_size, num_nodes = inputs.sourced, inputs.overrides, inputs.rank, inputs.world_size, inputs.num_nodes
    group = inputs.dims.dp_shard
    local = lambda p: local_shape(p, group, rank % group)  # noqa: E731
    states, summaries, notes = optimizer_bytes(sourced, layout, local, overrides)
    full_states, _, _ = optimizer_bytes(sourced, layout, lambda p: p.shape, overrides)
    extra = {pid: outside_param(sourced, pid) for pid in states if pid not in layout.params}
    all_params = {**layout.params, **{pid: p for pid, p in extra.items() if p is not None}}
    buckets = dict.fromkeys(CATEGORIES, 0)
    parts: dict[str, int] = {}
    full = 0
    for pid, p in all_params.items():
        own = numel(local(p)) * p.elsize
        grad = own if p.trainable else 0
        state = states.get(pid, 0)
        full += numel(p.shape) * p.elsize * (2 if p.trainable else 1) + full_states.get(pid, 0)
        if not p.sharded:
            buckets["unsharded"] += own + grad + state
            parts[p.part] = parts.get(p.part, 0) + own + grad + state
        elif p.teacher:
            buckets["ema_teacher"] += own
            buckets["gradients"] += grad
            buckets["optimizer_states"] += state
        else:
            buckets["parameters"] += own
            buckets["gradients"] += grad
            buckets["optimizer_states"] += state
    held = [(u.name, u.gathered) for u in layout.units if not u.reshard_after_forward]
    transient = [(u.name, u.gathered) for u in layout.units if u.reshard_after_forward]
    largest = max(transient, key=lambda u: u[1], default=("", 0))
    gathered = sum(b for _, b in held) + largest[1]
    notes = list(layout.notes) + notes
    if held:
        notes.append(
            f"reshard_after_forward=False keeps {len(held)} unit(s) gathered from forward to backward"
            f" ({fmt_bytes(sum(b for _, b in held))} counted in the gathered block)"
        )
    offloaded: tuple[str, ...] = ()
    if inputs.intent.offload != "none":
        offloaded = ("parameters", "gradients", "optimizer_states", "ema_teacher")
        notes.append("CPUOffloadPolicy: sharded parameters, gradients and optimizer states live in CPU memory")
    return MemoryEstimate(
        backend=BACKEND_NAME,
        world_size=world_size,
        rank=rank,
        precision=layout.precision.precision.value,
        gather_dtype=layout.precision.gather.value,
        gathered_block=gathered,
        gathered_unit=max(layout.units, key=lambda u: u.gathered).name if layout.units else "",
        full_model_states=full,
        offloaded=offloaded,
        host=sum(buckets[c] for c in offloaded),
        unsharded_parts=tuple(UnshardedPart(n, b, layout.whys.get(n, "")) for n, b in parts.items()),
        optimizers=tuple(summaries),
        notes=tuple(dict.fromkeys(notes)),
        shard_group=group,
        num_nodes=num_nodes,
        traffic=traffic(layout, all_params, world_size, group, num_nodes),
        **buckets,
    )


def traffic(layout: Layout, params: Mapping[int, Any], world_size: int, group: int, num_nodes: int) -> tuple[Traffic, ...]:
    """Bytes each rank sends per step, ring model, one forward per unit (a method that forwards a unit k times
    gathers it k times); fully_shard's padding of uneven shards is left out (a fraction of a percent)."""
    from autoshard.memory_model import Traffic, numel

    per_node = world_size // num_nodes
    replicas = world_size // group
    ring = lambda n, g: n * (g - 1) // g if g > 1 else 0  # noqa: E731
    gathers = sum(u.gathered * (1 if u.teacher or not u.reshard_after_forward else 2) for u in layout.units)
    reduced = sum(u.reduced for u in layout.units)
    whole = sum(numel(p.shape) * p.elsize for p in params.values() if not p.sharded and p.trainable)
    out = [
        Traffic("all-gather of parameters (forward, backward)", group, ring(gathers, group), group > per_node),
        Traffic("reduce-scatter of gradients", group, ring(reduced, group), group > per_node),
    ]
    if replicas > 1:
        out.append(Traffic("all-reduce of gradient slices across replicas", replicas, 2 * ring(reduced // group, replicas), num_nodes > 1))
    if whole and world_size > 1:
        out.append(Traffic("all-reduce of parameters left whole", world_size, 2 * ring(whole, world_size), num_nodes > 1))
    return tuple(t for t in out if t.bytes)


def host_bytes(states: MemoryEstimate, offload: str, reshard: bool) -> int:
    """offload='params' (CPUOffloadPolicy): each rank's shard of the parameters copied in for every all-gather (twice
    when resharded after forward), its gradient shard copied out."""
    if offload == "none":
        return 0
    return (states.parameters + states.ema_teacher) * (2 if reshard else 1) + states.gradients


BUDGET = BudgetChoices(
    fields=("reshard_after_forward", "activation_checkpointing", "offload", "shard_size"),
    offload=("none", "params"),
    selective=True,
    host_bytes=host_bytes,
    compile=True,
)

BACKEND = Backend(
    name=BACKEND_NAME,
    strategy="fsdp2",
    row=ROW,
    check=check,
    plan="autoshard.adapters.fsdp2:plan_fsdp2",
    lightning="autoshard.lightning.fsdp2:FSDP2Strategy",
    precision=precision,
    memory=memory,
    budget=BUDGET,
    writes=Format.DCP,
    resumes=(Format.DCP, Format.FULL),
)
