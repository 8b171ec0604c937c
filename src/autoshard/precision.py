"""Precision, resolved once: the Trainer's precision string and the intent's dtypes -> one PrecisionPlan.

A precision string ("bf16-mixed") stands for four dtypes: what the layers compute in, what is all-gathered, what
gradients are reduced in, and what the optimizer updates. ``resolve_precision`` turns the one into the other where
both the Trainer's precision and the intent are known; each backend translates the plan. Torch-free, so ``import
autoshard`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from autoshard.capability import Feature
from autoshard.errors import IntentError, closest, did_you_mean


class DtypeRequest(Protocol):
    """The three fields of a ``ShardingIntent`` that precision reads; a Protocol, so this module sits below
    ``intent`` (which imports it to validate those fields) without importing it back."""

    precision: str | None
    param_dtype: str | None
    reduce_dtype: str | None


class _Spelling(str, Enum):
    """An enum that prints as its value."""

    def __str__(self) -> str:
        return self.value


class Dtype(_Spelling):
    """The floating dtypes a plan names, spelt as torch spells them."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def bytes(self) -> int:
        return 4 if self is Dtype.FLOAT32 else 2

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.value)


class Precision(_Spelling):
    """Lightning's precision strings autoshard plans for, in the order its messages list them."""

    BF16_MIXED = "bf16-mixed"
    FP32 = "32-true"
    BF16_TRUE = "bf16-true"
    FP16_MIXED = "16-mixed"
    FP16_TRUE = "16-true"

    @property
    def autocast(self) -> bool:
        """ "-mixed": fp32 weights, layers run under autocast; "-true": the module itself is converted."""
        return self.value.endswith("-mixed")

    @property
    def dtype(self) -> Dtype:
        """The low precision the string names (float32 for 32-true)."""
        return {"bf16": Dtype.BFLOAT16, "16": Dtype.FLOAT16}.get(self.value.split("-")[0], Dtype.FLOAT32)

    @property
    def feature(self) -> Feature:
        """The capability-matrix row that says which backend runs this precision."""
        return _FEATURES[self]


_FEATURES = {
    Precision.BF16_MIXED: Feature.BF16,
    Precision.BF16_TRUE: Feature.BF16_TRUE,
    Precision.FP16_MIXED: Feature.FP16_MIXED,
    Precision.FP16_TRUE: Feature.FP16_TRUE,
    Precision.FP32: Feature.FP32,
}
PRECISIONS: tuple[str, ...] = tuple(p.value for p in Precision)
DEFAULT_PRECISION = Precision.BF16_MIXED
# Lightning's short spellings, so a YAML written for Lightning reads the same here.
_ALIASES = {"bf16": "bf16-mixed", "32": "32-true", "16": "16-mixed"}


def normalize_precision(value: object) -> Precision:
    """Accept Lightning's spellings (16, "bf16", "32-true") and return the canonical one."""
    if isinstance(value, Precision):
        return value
    text = str(value).strip().lower()
    text = _ALIASES.get(text, text)
    if text not in PRECISIONS:
        raise IntentError(
            f"unknown precision {value!r}{did_you_mean(text, PRECISIONS)}: choose one of {', '.join(PRECISIONS)}"
            f" (Lightning's short forms 'bf16', '16' and '32' work too)."
            f" Fix: precision='{closest(text, PRECISIONS) or DEFAULT_PRECISION}' (bf16-mixed is recommended for sharded training)"
        )
    return Precision(text)


@dataclass(frozen=True)
class PrecisionPlan:
    """The dtypes of one run: every backend is handed this one value, none reads a precision string again.
    ``gather`` is also the unsharded copy a forward sees; a ``master`` below float32 loses updates smaller than its
    resolution."""

    precision: Precision
    compute: Dtype
    autocast: bool
    gather: Dtype
    reduce: Dtype
    master: Dtype
    loss_scaling: bool = False


def resolve_precision(trainer_precision: object | None, intent: DtypeRequest) -> PrecisionPlan:
    """The one precision of a run, from the Trainer's (the source of truth; None: no Trainer) and the intent's.

    "-mixed" keeps fp32 weights, gathers in the low dtype (what autocast would cast to anyway: half the all-gather
    bytes) and reduces in fp32 (sums of many low-precision gradients lose bits), as torchtitan and Lightning's FSDP2
    do. "-true" converts the module: all four in the low dtype.
    """
    stated = None if intent.precision is None else normalize_precision(intent.precision)
    if trainer_precision is None:
        precision = stated or DEFAULT_PRECISION
    else:
        precision = normalize_precision(trainer_precision)
        if stated is not None and stated is not precision:
            raise IntentError(
                f"precision is given twice and differs: ShardingIntent(precision='{stated}') but"
                f" Trainer(precision='{precision}'). Fix: set it once, in the Trainer"
                f" (Trainer(precision='{stated}')), and drop it from the intent"
            )
    low = precision.dtype
    gather = Dtype(intent.param_dtype) if intent.param_dtype else low
    reduce = Dtype(intent.reduce_dtype) if intent.reduce_dtype else Dtype.FLOAT32 if precision.autocast else low
    return PrecisionPlan(
        precision=precision,
        compute=low if precision.autocast else gather,
        autocast=precision.autocast,
        gather=gather,
        reduce=reduce,
        master=Dtype.FLOAT32 if precision.autocast else low,
        loss_scaling=precision is Precision.FP16_MIXED,
    )
