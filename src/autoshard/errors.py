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


def closest(value: object, choices: Iterable[str]) -> str | None:
    """The choice a near-miss most likely meant, or None: a typo's fix is usually one character away."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for a near-miss, else ""."""
    close = closest(value, choices)
    return f" (did you mean {close!r}?)" if close else ""
