"""The suite's own rules (tests/conftest.py), each shown to bite: a test module that changes the process environment
at import is refused at collection (it changed how every other test ran: DS_ACCELERATOR=cpu, set by one module, moved
the GPU DeepSpeed tests' models to the CPU in `pytest -m gpu`), and GPU tests skip saying only what they need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def collect(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / "test_probe.py"
    probe.write_text(body)
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.conftest", "-p", "no:cacheprovider", str(probe)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_module_that_sets_a_watched_environment_variable_at_import_is_refused(tmp_path: Path) -> None:
    run = collect(tmp_path, 'import os\nos.environ["DS_ACCELERATOR"] = "cuda"\n\ndef test_x():\n    pass\n')
    assert run.returncode != 0
    assert "importing the test modules changed environment variable(s) DS_ACCELERATOR" in run.stderr + run.stdout
    assert "Fix: set it inside the test (monkeypatch.setenv)" in run.stderr + run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip shows where no CUDA device exists")
def test_gpu_tests_skip_saying_only_what_they_need(tmp_path: Path) -> None:
    run = collect(tmp_path, "import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SKIPPED [1] " in run.stdout and run.stdout.split("SKIPPED [1] ")[1].split("\n")[0].endswith(": needs a CUDA GPU")
