"""Every private Lightning member autoshard touches exists on the installed Lightning, and one range is declared.

A Lightning upgrade that renames or drops one of them fails ``test_every_listed_private_member_exists`` by name.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from autoshard.privates import Private, in_lightning, missing
from autoshard.privates.in_lightning import PIN, SUPPORTED_LIGHTNING, TRAINER, check_lightning

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


def _fit_loop() -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit_loop


def _fabric_connector() -> Any:
    from lightning.fabric.connector import _Connector

    return _Connector(accelerator="cpu", devices=1)


def _throughput_monitor() -> Any:
    from lightning.pytorch.callbacks import ThroughputMonitor

    return ThroughputMonitor(batch_size_fn=len)


# An instance of each owner of instance attributes: what its __init__ sets only an instance shows.
INSTANCES: dict[str, Callable[[], Any]] = {
    "lightning.pytorch.loops.fit_loop._FitLoop": _fit_loop,
    "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector": _connector,
    "lightning.fabric.connector._Connector": _fabric_connector,
    "lightning.pytorch.core.optimizer.LightningOptimizer": _lightning_optimizer,
    "lightning.pytorch.LightningModule": _module,
    "lightning.pytorch.strategies.ModelParallelStrategy": _model_parallel,
    "lightning.pytorch.strategies.DeepSpeedStrategy": _deepspeed,
    "lightning.pytorch.callbacks.ThroughputMonitor": _throughput_monitor,
}


@pytest.mark.parametrize("member", TRAINER, ids=str)
def test_every_listed_private_member_exists(member: Private) -> None:
    if member.on_instance:
        assert member.owner in INSTANCES, f"add a factory for {member.owner} to INSTANCES"
        assert hasattr(INSTANCES[member.owner](), member.name), f"{member} is gone: it is {member.why} ({member.used_in})"
    else:
        assert member not in missing(TRAINER), f"{member} is gone: it is {member.why} ({member.used_in})"


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
    monkeypatch.setattr(in_lightning, "TRAINER", (*TRAINER, gone))
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    assert [str(m) for m in missing(in_lightning.TRAINER, DeepSpeedStrategy)] == ["DeepSpeedStrategy._renamed_in_2_7"]
    assert missing(in_lightning.TRAINER, ModelParallelStrategy) == []


def test_the_check_runs_when_autoshard_registers() -> None:
    code = (
        "import warnings; warnings.filterwarnings('error', message='autoshard hooks private Lightning members')\n"
        "from importlib import metadata; real = metadata.version\n"
        "metadata.version = lambda name: '2.7.1' if name == 'lightning' else real(name)\n"
        "import autoshard, lightning.pytorch\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "found lightning 2.7.1" in done.stderr, done.stderr[-2000:]


# -- a Lightning release that drops a member autoshard hooks: warned once, Lightning's own strategy left as it is ---
@pytest.fixture
def reinstall(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``register()`` again inside the test (with a member deleted); afterwards Lightning and autoshard as before."""
    import autoshard  # noqa: F401
    import autoshard.lightning as al

    al.uninstall()
    check_lightning.cache_clear()
    try:
        yield al
    finally:
        monkeypatch.undo()  # the deleted member is back before autoshard installs again
        al.uninstall()
        check_lightning.cache_clear()
        al.register()


def _register_warnings(al: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        al.register()
        al.uninstall()
        al.register()  # a second registration (after uninstall) does not say it again
    return [str(w.message) for w in caught if "autoshard hooks private Lightning members" in str(w.message)]


def test_without_a_deepspeed_hook_lightnings_deepspeed_names_stay_lightnings(reinstall: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    from autoshard.errors import BackendUnavailableError
    from autoshard.lightning.deepspeed import LIGHTNING_DEEPSPEED_NAMES

    monkeypatch.delattr(DeepSpeedStrategy, "_init_optimizers")
    (warning,) = _register_warnings(reinstall)
    assert warning.startswith(f"autoshard hooks private Lightning members verified on lightning {SUPPORTED_LIGHTNING}; found lightning")
    assert (
        "it lacks DeepSpeedStrategy._init_optimizers, so Lightning's 'deepspeed*' names stay Lightning's own"
        " DeepSpeedStrategy (autoshard refuses nothing there) and strategy='autoshard-deepspeed' is refused."
        f" If a strategy fails, {PIN}"
    ) in warning
    assert all(StrategyRegistry[name]["strategy"] is DeepSpeedStrategy for name in LIGHTNING_DEEPSPEED_NAMES)
    assert not any(c.target.startswith("StrategyRegistry['deepspeed") for c in reinstall.installed())
    pytest.importorskip("deepspeed")
    built = pl.Trainer(strategy="deepspeed", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert type(built.strategy) is DeepSpeedStrategy  # the user's explicit choice, not refused
    with pytest.raises(BackendUnavailableError, match=r"lacks DeepSpeedStrategy\._init_optimizers.*Fix: pip install"):
        pl.Trainer(strategy="autoshard-deepspeed", accelerator="cpu", devices=1, logger=False)


@pytest.mark.parametrize("name", ["_check_strategy_and_fallback", "_validate_precision_choice"])
def test_without_a_connector_method_its_guard_is_skipped_and_said(reinstall: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    monkeypatch.delattr(_AcceleratorConnector, name)
    (warning,) = _register_warnings(reinstall)  # the import does not fail, and says it once
    member = next(m for m in TRAINER if m.name == name)
    assert f"it lacks _AcceleratorConnector.{name}, so {member.without}." in warning
    assert not hasattr(_AcceleratorConnector, name)  # nothing put in its place
    targets = [c.target for c in reinstall.installed()]
    assert f"_AcceleratorConnector.{name}" not in targets and "StrategyRegistry['fsdp2']" in targets


def test_without_model_parallel_hooks_autoshards_own_fsdp2_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its hooks Lightning would never call autoshard's _configure_launcher: its "auto" sizes would silently
    mean tensor parallel. autoshard's own names refuse with the pin; nothing of Lightning's is touched."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from autoshard.errors import BackendUnavailableError
    from autoshard.lightning import AutoShardStrategy, FSDP2Strategy

    # _configure_launcher is inherited too (deleting it here would not make it missing): a stand-in member instead
    gone = Private("lightning.pytorch.strategies.ModelParallelStrategy", "_renamed_in_2_7", "nowhere", "a stand-in")
    monkeypatch.setattr(in_lightning, "TRAINER", (*TRAINER, gone))
    assert [str(m) for m in missing(in_lightning.TRAINER, ModelParallelStrategy)] == ["ModelParallelStrategy._renamed_in_2_7"]
    for strategy in (FSDP2Strategy, AutoShardStrategy):
        with pytest.raises(BackendUnavailableError) as info:
            strategy()
        text = str(info.value)
        assert "lacks ModelParallelStrategy._renamed_in_2_7, which autoshard's fsdp2 strategies hook" in text
        assert text.endswith(f"Fix: {PIN}")
