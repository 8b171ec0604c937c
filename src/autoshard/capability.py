"""The capability matrix: what each backend supports, as data, with the reason and remedy for every "no"."""

from __future__ import annotations

import json
import textwrap
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
    BF16_TRUE = "bf16 weights (bf16-true)"
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
    INIT_FROM = "pretrained weights into shards (init_from)"


# What the user's intent asks for. "auto" leaves fsdp2 only for a backend that fully provides one of these
# where fsdp2 does it partly: a method's needs run either way, and the accelerator is not known at construction.
# Precision is not among them: auto-shard picks its backend when the strategy is built, before the Trainer's
# precision exists, so a precision never steers it; one fsdp2 cannot run is refused once it is known.
INTENT_FEATURES = frozenset(
    {
        Feature.PER_BLOCK_SHARDING,
        Feature.CPU_OFFLOAD_PARAMS,
        Feature.CPU_OFFLOAD_OPTIMIZER,
        Feature.NVME_OFFLOAD,
        Feature.ACTIVATION_CHECKPOINTING,
        Feature.DISTRIBUTED_CHECKPOINT,
        Feature.FULL_CHECKPOINT,
        Feature.TENSOR_PARALLEL,
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


def matrix() -> dict[str, Row]:
    """Every backend's row, keyed by backend name, in preference order."""
    from autoshard.backends import BACKENDS

    return {backend.name: backend.row for backend in BACKENDS.values()}


def cell(backend: str, feature: Feature) -> Cell:
    """One cell, by backend name (or alias) and feature."""
    from autoshard.backends import get_backend

    return get_backend(backend).row[feature]


FORMATS = ("text", "markdown", "json")


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith(".") else text + "."


def _notes(rows: Mapping[str, Row], fmt: str) -> list[str]:
    """Why and what to do for every cell that is not "yes", one note per backend and shared answer."""
    lines = ["Notes (every cell that is not 'yes'):", ""]
    for name, row in rows.items():
        grouped: dict[Cell, list[str]] = {}
        for feature in Feature:
            if row[feature].support is not Support.YES:
                grouped.setdefault(row[feature], []).append(feature.value)
        for c, features in grouped.items():
            which = "every feature" if len(features) == len(Feature) else ", ".join(features)
            body = f"{_sentence(c.reason)} Fix: {_sentence(c.remedy)}"
            if fmt == "markdown":
                lines.append(f"- **{name}**, {which}: *{c.support.value}*: {body}")
            else:
                lines.append(f"{name} / {which}: {c.support.value}")
                lines += textwrap.wrap(body, width=100, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False)
    return lines


def matrix_data() -> dict[str, dict[str, object]]:
    """The matrix for scripts: per backend, its strategy string and every cell with its reason and remedy."""
    from autoshard.backends import BACKENDS

    return {
        name: {
            "strategy": b.strategy,
            "cells": {f.value: {"support": b.row[f].support.value, "reason": b.row[f].reason, "remedy": b.row[f].remedy} for f in Feature},
        }
        for name, b in BACKENDS.items()
    }


def render_matrix(fmt: str = "text", details: bool = False) -> str:
    """The matrix as a plain-text or Markdown table (the docs embed the Markdown one); ``details`` adds the notes.

    "json" is ``matrix_data()``, details always included: a script has no use for a table without its reasons.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(map(repr, FORMATS))}")
    if fmt == "json":
        return json.dumps(matrix_data(), indent=1)
    rows = matrix()
    header = ["feature", *rows]
    body = [[feature.value, *(row[feature].support.value for row in rows.values())] for feature in Feature]
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
    else:
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

        def fmt_row(r: list[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

        lines = [fmt_row(header), fmt_row(["-" * w for w in widths]), *map(fmt_row, body)]
    if details:
        lines += ["", *_notes(rows, fmt)]
    return "\n".join(lines)
