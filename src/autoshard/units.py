"""Sizes as people write them (``80GiB``, ``5GB``) and as autoshard prints them: one place for both directions."""

from __future__ import annotations

import difflib
import math
import numbers
import re

from autoshard.errors import AutoShardError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# The units read (case-insensitively): bytes, decimal (powers of 1000) and binary (powers of 1024); "80G" is decimal.
UNITS: tuple[str, ...] = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")
_SCALES: dict[str, int] = {
    "": 1,
    "B": 1,
    **{f"{p}": 1000**i for i, p in enumerate("KMGT", 1)},
    **{f"{p}B": 1000**i for i, p in enumerate("KMGT", 1)},
    **{f"{p}IB": 1024**i for i, p in enumerate("KMGT", 1)},
}


def parse_size(
    text: str | int | float, option: str = "--budget", example: str = "80GiB", error: type[AutoShardError] = AutoShardError, minimum: int = 1
) -> int:
    """``80GiB`` (binary), ``5GB`` (decimal, as Hugging Face and disk vendors count), or a number of bytes: an int
    (numpy's too), a float that is a whole number (YAML reads ``8.0e+10`` as one), or such a number as a string.
    ``minimum=0`` where nothing is a size too (``memory_headroom='0GiB'``)."""
    if isinstance(text, bool) or not isinstance(text, (str, numbers.Real)):
        raise error(
            f"{option} must be a number of bytes (an int) or a size string such as '{example}', got"
            f" {type(text).__name__} {text!r}. Fix: {option}='{example}'"
        )
    if isinstance(text, numbers.Integral):
        size = int(text)
    elif isinstance(text, numbers.Real):  # a float: YAML's 8.0e+10, Python's 80e9, numpy's float64
        size = _whole_bytes(float(text), text, option, example, error)
    else:
        m = _SIZE.match(text)
        if not m or len(m.group(2)) > 3:  # a word, not a misspelt unit ('70 gigs')
            raise error(
                f"{option} {text!r} is not a size. Fix: write it as {', '.join(dict.fromkeys([example, '500MB', '2GiB']))} or a number of bytes"
            )
        number, unit = m.group(1), m.group(2)
        scale = _SCALES.get(unit.upper())
        if scale is None:
            meant = _unit_meant(unit)
            fixed = f"{number}{meant or re.sub(r'^[0-9.]+', '', example)}"
            raise error(
                f"{option} {text!r} has the unit '{unit}', which autoshard does not read: the units are"
                f" {', '.join(UNITS)} (KiB, MiB, GiB, TiB: powers of 1024; KB, MB, GB, TB: powers of 1000), or none"
                f" for bytes. Fix: {option} {fixed!r}" + ("" if meant else " (or the unit you meant)")
            )
        size = _whole_bytes(float(number) * scale, text, option, example, error) if scale == 1 else int(float(number) * scale)
    if size < minimum:
        raise error(f"{option} {text!r} {'must be at least one byte' if minimum == 1 else 'must not be negative'}. Fix: e.g. {option} {example}")
    return size


def _whole_bytes(value: float, text: object, option: str, example: str, error: type[AutoShardError]) -> int:
    """A number of bytes given as a float: whole (``8.0e+10``) is read, a fraction of a byte is refused."""
    if math.isfinite(value) and value.is_integer():
        return int(value)
    fix = f"{option}={max(1, round(value))} (an int), or a size string such as '{example}'" if math.isfinite(value) else f"{option}='{example}'"
    raise error(f"{option} {text!r} is not a whole number of bytes. Fix: {fix}")


def _unit_meant(unit: str) -> str | None:
    """The one unit closest to a misspelt one (``'GIb'`` -> ``'GiB'``); None when none or several are as close."""
    scores = sorted(((difflib.SequenceMatcher(None, unit.upper(), u.upper()).ratio(), u) for u in UNITS), reverse=True)
    best, second = scores[0], scores[1]
    return best[1] if best[0] >= 0.6 and best[0] > second[0] else None


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: the resolution a memory budget needs."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
