"""Sizes as people write them (``80GiB``, ``5GB``) and as autoshard prints them: one place for both directions."""

from __future__ import annotations

import re

from autoshard.errors import AutoShardError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int, option: str = "--budget", example: str = "80GiB", error: type[AutoShardError] = AutoShardError) -> int:
    """``80GiB`` (binary), ``5GB`` (decimal, as Hugging Face and disk vendors count), or a number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise error(f"{option} {text!r} is not a size. Fix: write it as {example}, 500MB, 2GiB or a number of bytes")
        number, unit = float(m.group(1)), m.group(2).upper()
        power = "BKMGT".index(unit[0]) if unit and unit[0] in "KMGT" else 0
        size = int(number * (1024 if "I" in unit else 1000) ** power)
    if size < 1:
        raise error(f"{option} {text!r} must be at least one byte. Fix: e.g. {option} {example}")
    return size


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: the resolution a memory budget needs."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
