"""Every private Lightning member autoshard touches exists on the installed Lightning, and one range is declared.

A Lightning upgrade that renames or drops one of them fails ``test_every_listed_private_member_exists`` by name.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from autoshard.lightning import compat
from autoshard.lightning.compat import PRIVATE_MEMBERS, SUPPORTED_LIGHTNING, Private, check_lightning, missing

ROOT = Path(__file__).resolve().parents[2]


def _connector() -> Any:
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return _AcceleratorConnector(accelerator="cpu", devices=1)


def _lightning_optimizer() -> Any:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return LightningOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def _module() -> Any:
    import lightning.pytorch as pl

    return pl.LightningModule()


def _model_parallel() -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy()


def _deepspeed() -> Any:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy()


# An instance of each owner of instance attributes: what its __init__ sets only an instance shows.
INSTANCES: dict[str, Callable[[], Any]] = {
    "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector": _connector,
    "lightning.pytorch.core.optimizer.LightningOptimizer": _lightning_optimizer,
    "lightning.pytorch.LightningModule": _module,
    "lightning.pytorch.strategies.ModelParallelStrategy": _model_parallel,
    "lightning.pytorch.strategies.DeepSpeedStrategy": _deepspeed,
}


@pytest.mark.parametrize("member", PRIVATE_MEMBERS, ids=str)
def test_every_listed_private_member_exists(member: Private) -> None:
    if member.on_instance:
        assert member.owner in INSTANCES, f"add a factory for {member.owner} to INSTANCES"
        assert hasattr(INSTANCES[member.owner](), member.name), f"{member} is gone: it is {member.why} ({member.used_in})"
    else:
        assert str(member) not in missing(), f"{member} is gone: it is {member.why} ({member.used_in})"


def test_pyproject_declares_the_supported_range() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {r.name: r for r in map(Requirement, project["dependencies"])}
    assert requirements["lightning"].specifier == SpecifierSet(SUPPORTED_LIGHTNING)


def test_a_lightning_outside_the_range_warns_once() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lightning()  # the installed Lightning is the supported one
    for version in ("2.5.3", "2.7.0"):
        with pytest.warns(UserWarning, match=rf"verified on lightning {SUPPORTED_LIGHTNING}; found lightning {version}\."):
            check_lightning(version)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_lightning(version)  # said once


def test_a_missing_member_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    gone = Private("lightning.pytorch.strategies.DeepSpeedStrategy", "_renamed_in_2_7", "nowhere", "a stand-in")
    monkeypatch.setattr(compat, "PRIVATE_MEMBERS", (*PRIVATE_MEMBERS, gone))
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    assert missing(DeepSpeedStrategy) == ["DeepSpeedStrategy._renamed_in_2_7"]
    assert missing(ModelParallelStrategy) == []


def test_the_check_runs_when_autoshard_registers() -> None:
    code = (
        "import warnings; warnings.filterwarnings('error', message='autoshard hooks private Lightning members')\n"
        "from importlib import metadata; real = metadata.version\n"
        "metadata.version = lambda name: '2.7.1' if name == 'lightning' else real(name)\n"
        "import autoshard, lightning.pytorch\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "found lightning 2.7.1" in done.stderr, done.stderr[-2000:]
