"""Exceptions autoshard raises; every message names what conflicts, what works, and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class AutoShardError(Exception):
    """Base class, so callers can catch every autoshard refusal at once."""


class IntentError(AutoShardError, ValueError):
    """A ShardingIntent field (or a strategy argument) has a value autoshard cannot use."""


class IncompatibleBackendError(AutoShardError, RuntimeError):
    """The method or intent cannot run on the requested backend (or on any installed one)."""


class BackendUnavailableError(IncompatibleBackendError):
    """The backend would work but is not installed, or is too old."""


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for a near-miss, else "": a typo's fix is usually one character away."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
