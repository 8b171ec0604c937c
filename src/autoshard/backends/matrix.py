"""The capability matrix rendered from every backend's row: ``autoshard matrix``, the JSON, and ``docs/matrix.md``
(here, not in ``capability.py``: rendering reads ``BACKENDS``, which is built from ``capability``)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from pathlib import Path

from autoshard.backends import BACKENDS, get_backend, on_backend
from autoshard.capability import Cell, Feature, Row, Support
from autoshard.intent import ShardingIntent
from autoshard.precision import Precision, resolve_precision

MATRIX_BEGIN = "<!-- BEGIN GENERATED MATRIX: python -m autoshard.explain --write-matrix docs/matrix.md -->"
MATRIX_END = "<!-- END GENERATED MATRIX -->"


def matrix() -> dict[str, Row]:
    """Every backend's row, keyed by backend name, in preference order."""
    return {backend.name: backend.row for backend in BACKENDS.values()}


def cell(backend: str, feature: Feature) -> Cell:
    """One cell, by backend name (or alias) and feature."""
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
    return {
        name: {
            "strategy": b.strategy,
            "cells": {f.value: {"support": b.row[f].support.value, "reason": b.row[f].reason, "remedy": b.row[f].remedy} for f in Feature},
        }
        for name, b in BACKENDS.items()
    }


def render_matrix(fmt: str = "text", details: bool = False) -> str:
    """The matrix as a plain-text or Markdown table; ``details`` adds the notes. "json" is ``matrix_data()``, details
    always included: a script has no use for a table without its reasons."""
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


def matrix_markdown() -> str:
    """The generated part of docs/matrix.md, between its markers."""
    return f"{MATRIX_BEGIN}\n{render_matrix('markdown', details=True)}\n{MATRIX_END}"


def write_matrix(path: str | Path) -> None:
    """Regenerate the matrix in ``path``: replace the marked block, or write a fresh page when there is none."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    if MATRIX_BEGIN in text and MATRIX_END in text:
        before, rest = text.split(MATRIX_BEGIN, 1)
        after = rest.split(MATRIX_END, 1)[1]
        text = before + matrix_markdown() + after
    else:
        text = (
            '# Capability matrix\n\nWhich backend runs which feature; every cell that is not "yes" says why and what to do.\n'
            "Generated from `autoshard.backends` (the same data the selector decides with).\n\n" + matrix_markdown() + "\n"
        )
    path.write_text(text)


def precision_table() -> str:
    """For each precision and backend, the dtypes that run (no intent overrides); the guide embeds this table."""
    lines = [
        "| precision | backend | compute | all-gather | gradient reduce | weights the optimizer updates |",
        "|---|---|---|---|---|---|",
    ]
    for precision in Precision:
        plan = resolve_precision(precision, ShardingIntent())
        for backend in (name for name, b in BACKENDS.items() if b.precision is not None):
            if not cell(backend, precision.feature).support.usable:
                lines.append(f"| {precision} | {backend} | refused | - | - | - |")
                continue
            run = on_backend(plan, backend)
            compute = f"{run.compute}, " + ("autocast" if run.autocast else "every op")
            # ZeRO-3 stores the model in the low dtype and the fp32 weights apart; FSDP2's shards are the weights.
            master = f"{run.master}" + (" master copy" if run.master is not run.gather else "")
            master += " + dynamic loss scaling" if run.loss_scaling else ""
            lines.append(f"| {precision} | {backend} | {compute} | {run.gather} | {run.reduce} | {master} |")
    return "\n".join(lines)
