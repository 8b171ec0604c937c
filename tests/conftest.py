"""Suite-wide rules: GPU tests skip with a reason where no CUDA device exists (CI, this machine)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on a machine with one (the device tool), CI has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
