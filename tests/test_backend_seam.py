"""One seam per backend: what differs between engines is a field of its ``Backend``, never a name compared elsewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import autoshard
from autoshard.backends import BACKENDS, load
from autoshard.capability import Format

SRC = Path(autoshard.__file__).parent
# `x == "fsdp2"`, `"deepspeed_zero3" != y`, `x in ("fsdp2", ...)`: each backend name, quoted, next to a comparison.
_NAMES = "|".join(re.escape(name) for name in BACKENDS)
_COMPARED = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({_NAMES})["']|["']({_NAMES})["']\s*(==|!=|\bin\b)""")


def test_no_backend_name_is_compared_outside_backends_and_adapters():
    """A new backend must not need an ``if backend == ...`` anywhere else: ask the Backend instead."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("backends", "adapters"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _COMPARED.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "backend names compared outside backends/ and adapters/:\n" + "\n".join(found)


@pytest.mark.parametrize("line", ['if backend == "fsdp2":', "if 'deepspeed_zero3' != b:", 'if name not in ("fsdp2", "x"):'])
def test_the_pattern_catches_comparisons(line):
    assert _COMPARED.search(line)


def test_capability_does_not_import_the_backends():
    """capability.py holds the types the rows are made of; the backends import it, never the other way round."""
    code = "import sys, autoshard.capability; print('autoshard.backends' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("name", [n for n, b in BACKENDS.items() if not b.rejected])
def test_every_driven_backend_points_at_its_code(name):
    backend = BACKENDS[name]
    assert backend.plan or backend.config
    for path in filter(None, (backend.plan, backend.config)):
        assert callable(load(path))
    assert backend.strategy_class().__module__ == backend.lightning.partition(":")[0]
    assert backend.precision is not None and backend.memory is not None
    assert backend.writes in backend.resumes and Format.FULL in backend.resumes


def test_the_budget_asks_the_backend_record():
    """budget/ reads each backend's choices (``Backend.budget``: free fields, offload ladder, price terms) from the
    registry: it imports no engine module, so no constant of one can be compared there either."""
    engines = "|".join(re.escape(name) for name in ("fsdp1", "fsdp2", "deepspeed"))
    imported = re.compile(rf"\bautoshard\.backends\.({engines})\b")
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted((SRC / "budget").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if imported.search(line)
    ]
    assert not found, "budget/ imports an engine module instead of asking the Backend:\n" + "\n".join(found)


@pytest.mark.parametrize("name", [n for n, b in BACKENDS.items() if b.budget is not None])
def test_every_budgeted_backend_prices_its_own_offload_ladder(name):
    choices = BACKENDS[name].budget
    assert choices.offload[0] == "none" and set(choices.fields) <= {"reshard_after_forward", "activation_checkpointing", "offload", "shard_size"}
    assert choices.check == "" or callable(load(choices.check))
