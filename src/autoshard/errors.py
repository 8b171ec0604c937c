"""Exceptions autoshard raises; every message names what conflicts, what works, and the fix."""

from __future__ import annotations


class AutoShardError(Exception):
    """Base class, so callers can catch every autoshard refusal at once."""


class IntentError(AutoShardError, ValueError):
    """A ShardingIntent field (or a strategy argument) has a value autoshard cannot use."""


class IncompatibleBackendError(AutoShardError, RuntimeError):
    """The method or intent cannot run on the requested backend (or on any installed one)."""


class BackendUnavailableError(IncompatibleBackendError):
    """The backend would work but is not installed, or is too old."""
