"""The capability matrix's data types: features, support levels, cells, checkpoint formats (only types, so that
``backends/`` builds its rows from them without a cycle)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class Feature(str, Enum):
    """A thing a method or an intent may need from a backend."""

    MULTIPLE_OPTIMIZERS = "multiple optimizers"
    EMA_TEACHER_STUDENT = "EMA teacher/student"
    MULTI_FORWARD = "several forwards per step"
    MANUAL_OPTIMIZATION = "manual optimization"
    ROOT_PARAMETERS = "parameters on the module root"
    PER_BLOCK_SHARDING = "per-block sharding"
    KEEP_GATHERED = "parameters kept gathered until backward (reshard_after_forward=False)"
    BF16 = "bf16 precision"
    BF16_TRUE = "bf16 weights (bf16-true)"
    FP16_MIXED = "fp16 mixed precision (16-mixed)"
    FP16_TRUE = "fp16 weights (16-true)"
    FP32 = "fp32 precision"
    CPU_OFFLOAD_PARAMS = "CPU offload of parameters"
    CPU_OFFLOAD_OPTIMIZER = "CPU offload of optimizer state only"
    NVME_OFFLOAD = "NVMe offload"
    ACTIVATION_CHECKPOINTING = "activation checkpointing"
    SELECTIVE_CHECKPOINTING = "op-level (selective) activation checkpointing"
    DISTRIBUTED_CHECKPOINT = "distributed (sharded) checkpoint"
    FULL_CHECKPOINT = "full single-file checkpoint"
    TENSOR_PARALLEL = "tensor parallel"
    CPU_ACCELERATOR = "CPU accelerator (gloo)"
    INIT_FROM = "pretrained weights into shards (init_from)"
    HYBRID_SHARDING = "hybrid sharding (HSDP)"
    COMPILE = "torch.compile of each block"


# What the user's intent asks for. "auto" leaves fsdp2 only for a backend that fully provides one of these
# where fsdp2 does it partly: a method's needs run either way, and the accelerator is not known at construction.
# Precision is not among them: auto-shard picks its backend when the strategy is built, before the Trainer's
# precision exists, so a precision never steers it; one fsdp2 cannot run is refused once it is known.
INTENT_FEATURES = frozenset(
    {
        Feature.PER_BLOCK_SHARDING,
        Feature.KEEP_GATHERED,
        Feature.CPU_OFFLOAD_PARAMS,
        Feature.CPU_OFFLOAD_OPTIMIZER,
        Feature.NVME_OFFLOAD,
        Feature.ACTIVATION_CHECKPOINTING,
        Feature.SELECTIVE_CHECKPOINTING,
        Feature.DISTRIBUTED_CHECKPOINT,
        Feature.FULL_CHECKPOINT,
        Feature.TENSOR_PARALLEL,
        Feature.HYBRID_SHARDING,
        Feature.COMPILE,
    }
)


class Support(str, Enum):
    """How far a backend provides a feature.

    Three words, one meaning each (docs/architecture.md): "rejected" is this value, every cell of a backend
    autoshard never drives (FSDP1); "refused" is an error raised to the user (asking for a rejected backend, or a
    "no" the run needs); "ruled out" is a backend the selector did not choose for one run (``Decision.ruled_out``).
    """

    YES = "yes"
    PARTIAL = "partial"
    NO = "no"
    REJECTED = "rejected"

    @property
    def usable(self) -> bool:
        return self in (Support.YES, Support.PARTIAL)


@dataclass(frozen=True)
class Cell:
    """One backend x feature answer; a "no" always carries why and what to do instead."""

    support: Support
    reason: str = ""
    remedy: str = ""

    def __post_init__(self) -> None:
        if self.support is not Support.YES and not (self.reason and self.remedy):
            raise ValueError(f"a {self.support.value!r} cell needs a reason and a remedy")


def yes(reason: str = "") -> Cell:
    """Shorthands that keep the backend rows readable."""
    return Cell(Support.YES, reason)


def partial(reason: str, remedy: str) -> Cell:
    return Cell(Support.PARTIAL, reason, remedy)


def no(reason: str, remedy: str) -> Cell:
    return Cell(Support.NO, reason, remedy)


Row = Mapping[Feature, Cell]


class Format(str, Enum):
    """What a checkpoint path holds, as far as the files on disk tell; here because each torch-free ``Backend``
    states the formats it writes and resumes."""

    DCP = "distributed"  # Lightning / autoshard DCP directory: .metadata + meta.pt
    DCP_RAW = "dcp-without-trainer-state"  # a torch.distributed.checkpoint directory without Lightning's meta.pt
    FULL = "full"  # one torch.save file
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO directory: latest + <tag>/*model_states.pt
    INCOMPLETE = "incomplete"  # shards (or meta.pt) without DCP's .metadata: a save that did not finish
    MISSING = "missing"
    UNKNOWN = "unknown"
