"""An exception raised under fake tensors, in words (most are reads of values fake tensors do not have), with the
line of the user's code that raised."""

from __future__ import annotations

import os

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
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException

    where = _user_line(exc)
    if isinstance(exc, DataDependentOutputException):
        return f"it reads a tensor's value{where} (.item(), .tolist(), `if tensor:`), and fake tensors have no values"
    if isinstance(exc, DynamicOutputShapeException):
        return f"an op's output shape depends on tensor values{where} (nonzero, unique, boolean-mask indexing), unknown on fake tensors"
    if isinstance(exc, UnsupportedOperatorException):
        return f"an operator has no fake-tensor implementation{where} ({exc})"
    text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}{where}"


def reads_values(exc: BaseException) -> bool:
    """An op fake tensors cannot run (a value read, a value-dependent shape, no fake kernel), not a wrong input."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException

    return isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException))
