"""The capability matrix: what each backend supports, as data, with the reason and remedy for every "no"."""

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
    BF16 = "bf16 precision"
    FP16_MIXED = "fp16 mixed precision (16-mixed)"
    FP16_TRUE = "fp16 weights (16-true)"
    FP32 = "fp32 precision"
    CPU_OFFLOAD_PARAMS = "CPU offload of parameters"
    CPU_OFFLOAD_OPTIMIZER = "CPU offload of optimizer state only"
    NVME_OFFLOAD = "NVMe offload"
    ACTIVATION_CHECKPOINTING = "activation checkpointing"
    DISTRIBUTED_CHECKPOINT = "distributed (sharded) checkpoint"
    FULL_CHECKPOINT = "full single-file checkpoint"
    TENSOR_PARALLEL = "tensor parallel"
    CPU_ACCELERATOR = "CPU accelerator (gloo)"


class Support(str, Enum):
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
    return Cell(Support.YES, reason)


def partial(reason: str, remedy: str) -> Cell:
    return Cell(Support.PARTIAL, reason, remedy)


def no(reason: str, remedy: str) -> Cell:
    return Cell(Support.NO, reason, remedy)


Row = Mapping[Feature, Cell]


def matrix() -> dict[str, Row]:
    """Every backend's row, keyed by backend name, in preference order."""
    from autoshard.backends import BACKENDS

    return {backend.name: backend.row for backend in BACKENDS.values()}


def cell(backend: str, feature: Feature) -> Cell:
    from autoshard.backends import get_backend

    return get_backend(backend).row[feature]


def render_matrix(fmt: str = "text", details: bool = False) -> str:
    """The matrix as a plain-text or Markdown table (the docs embed the Markdown one)."""
    rows = matrix()
    names = list(rows)
    header = ["feature", *names]
    body = [[feature.value, *(rows[n][feature].support.value for n in names)] for feature in Feature]
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    elif fmt == "text":
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        fmt_row = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        lines = [fmt_row(header), fmt_row(["-" * w for w in widths]), *map(fmt_row, body)]
    else:
        raise ValueError(f"unknown format {fmt!r}: choose 'text' or 'markdown'")
    if details:
        lines.append("")
        bullet = "- " if fmt == "markdown" else "  "
        for name in names:
            grouped: dict[Cell, list[str]] = {}
            for feature in Feature:
                if rows[name][feature].support is not Support.YES:
                    grouped.setdefault(rows[name][feature], []).append(feature.value)
            for c, features in grouped.items():
                lines.append(f"{bullet}{name}, {', '.join(features)}: {c.support.value}. {c.reason} Fix: {c.remedy}")
    return "\n".join(lines)
