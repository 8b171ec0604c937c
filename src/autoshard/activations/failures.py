"""An exception raised under fake tensors, in words (most are reads of values fake tensors do not have), with the
line of the user's code that raised."""

from __future__ import annotations

import os

from autoshard.privates import in_torch
from autoshard.tracebacks import user_frames


def _user_line(exc: BaseException) -> str:
    """Where the user's code raised: the innermost frame outside torch, Lightning, transformers and autoshard."""
    frames = user_frames(exc, skip_site_packages=True)
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} `{(f.line or '').strip()}`"


def describe_failure(exc: BaseException) -> str:
    """An exception raised under fake tensors, in words: most are reads of values fake tensors do not have."""
    where = _user_line(exc)
    if isinstance(exc, in_torch.DataDependentOutputException):
        return f"it reads a tensor's value{where} (.item(), .tolist(), `if tensor:`), and fake tensors have no values"
    if isinstance(exc, in_torch.DynamicOutputShapeException):
        return f"an op's output shape depends on tensor values{where} (nonzero, unique, boolean-mask indexing), unknown on fake tensors"
    if isinstance(exc, in_torch.UnsupportedOperatorException):
        return f"an operator has no fake-tensor implementation{where} ({exc})"
    text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}{where}"


def reads_values(exc: BaseException) -> bool:
    """An op fake tensors cannot run (a value read, a value-dependent shape, no fake kernel), not a wrong input."""
    return isinstance(exc, (in_torch.DataDependentOutputException, in_torch.DynamicOutputShapeException, in_torch.UnsupportedOperatorException))
