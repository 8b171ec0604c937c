"""Where in the *user's* code an exception was raised: the innermost frame outside torch, Lightning and autoshard.

Refusals quote that line (``at model.py:42 `x = self.head(y)```) so the user sees their code, not ours. One place, so
that the simulated step (``activations``) and the sharding guarantees (``engine.guarantees``) agree on it.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

AUTOSHARD_DIR = str(Path(__file__).resolve().parent) + os.sep


def user_frames(exc: BaseException, *, skip_site_packages: bool = False) -> list[traceback.FrameSummary]:
    """The traceback's frames outside torch, Lightning and autoshard (and, if asked, any installed package)."""
    import lightning
    import torch

    libraries = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, lightning)) + (AUTOSHARD_DIR,)
    return [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(libraries) and not (skip_site_packages and "site-packages" in f.filename)
    ]
