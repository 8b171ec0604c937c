"""`import autoshard` replacing another library's "fsdp2" registration is said once, on rank 0, by class."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

OTHER_FIRST = """
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

class OtherFSDP2(ModelParallelStrategy):
    pass

StrategyRegistry.register("fsdp2", OtherFSDP2, description="another library's fsdp2")
import autoshard
import autoshard.lightning
autoshard.lightning.register()  # idempotent: said once
assert StrategyRegistry["fsdp2"]["strategy"] is autoshard.lightning.FSDP2Strategy
"""
MESSAGE = (
    "autoshard: Trainer(strategy='fsdp2') was registered by __main__.OtherFSDP2; import autoshard replaced it with"
    " autoshard.lightning.FSDP2Strategy. To train with the other one, pass it as an object:"
    " Trainer(strategy=OtherFSDP2(...))"
)


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_replacing_another_fsdp2_is_logged_once_on_rank_zero_only() -> None:
    text = run(OTHER_FIRST)
    assert text.count(MESSAGE) == 1, text
    assert MESSAGE not in run(OTHER_FIRST, RANK="1")
    assert "was registered by" not in run("import autoshard")  # nothing replaced, nothing said


# -- everything `import autoshard` changes: listed in one place, and undone exactly --------------------------------
UNINSTALL = r"""
import json
import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as Connector

def snapshot():
    return {"registry": {name: id(entry) for name, entry in dict.items(StrategyRegistry)},
            "connector": {name: id(value) for name, value in vars(Connector).items()},
            "fsdp": {name: id(value) for name, value in vars(FSDPStrategy).items()}}

def outcome(**kwargs):
    try:
        t = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)
        return type(t.strategy).__module__ + "." + type(t.strategy).__qualname__
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)[:80]

stock = snapshot()
import autoshard
import autoshard.lightning as al
from autoshard.install_record import TRAINER_KINDS  # the Trainer's part of the one record (Fabric's stays)
targets = [c.target for c in al.installed(TRAINER_KINDS)]
installed = snapshot()
FSDPStrategy()  # constructible with autoshard installed (other libraries' tests build it)
with_autoshard = {"fsdp": outcome(strategy="fsdp"), "fsdp_object": outcome(strategy=FSDPStrategy())}
undone = [c.target for c in al.uninstall()]
restored = snapshot()
stock_behaviour = {"fsdp": outcome(strategy="fsdp"), "fsdp_object": outcome(strategy=FSDPStrategy()),
                   "fsdp2": outcome(strategy="fsdp2"), "deepspeed": outcome(strategy="deepspeed")}
al.register()
again = {"targets": [c.target for c in al.installed(TRAINER_KINDS)], "fsdp": outcome(strategy="fsdp"), "fsdp2": outcome(strategy="fsdp2")}
print("RESULT " + json.dumps(dict(stock=stock, installed=installed, restored=restored, targets=targets, undone=undone,
                      with_autoshard=with_autoshard, stock_behaviour=stock_behaviour, again=again)), flush=True)
"""


@pytest.fixture(scope="module")
def uninstalled() -> dict:
    import json

    line = next(line for line in run(UNINSTALL).splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.timeout(300)
def test_uninstall_puts_back_every_registry_entry_and_method_by_identity(uninstalled: dict) -> None:
    stock, installed, restored = uninstalled["stock"], uninstalled["installed"], uninstalled["restored"]
    assert installed != stock  # the import changed something: the comparison below can fail
    assert restored == stock  # every entry and attribute is the very object it was: nothing added, nothing left
    assert uninstalled["undone"] == list(reversed(uninstalled["targets"]))
    assert installed["fsdp"] == stock["fsdp"]  # FSDPStrategy itself is never patched


@pytest.mark.timeout(300)
def test_after_uninstall_lightning_behaves_as_stock_and_register_installs_again(uninstalled: dict) -> None:
    refused = "IncompatibleBackendError: FSDP1 (strategy='fsdp' / FSDPStrategy) is refused by autoshard"
    assert all(text.startswith(refused) for text in uninstalled["with_autoshard"].values()), uninstalled["with_autoshard"]
    stock = uninstalled["stock_behaviour"]
    for key in ("fsdp", "fsdp_object"):  # Lightning's own CPU refusal, not autoshard's redirect
        assert stock[key].startswith("ValueError: The strategy `fsdp` requires a GPU accelerator"), stock[key]
    assert stock["fsdp2"].startswith("ValueError: You selected an invalid strategy name: `strategy='fsdp2'`")
    assert stock["deepspeed"] == "lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy"
    again = uninstalled["again"]
    assert again["targets"] == uninstalled["targets"] and again["fsdp"].startswith(refused)
    assert again["fsdp2"] == "autoshard.lightning.fsdp2.FSDP2Strategy"


def test_the_docs_list_every_change_the_import_makes() -> None:
    """docs/lightning-changes.md is generated from the one record the changes leave, the Trainer's and Fabric's: the
    page and the code agree."""
    from pathlib import Path

    import autoshard
    import autoshard.lightning
    from autoshard.install_record import CHANGES_BEGIN, CHANGES_END, ChangeKind, changes_markdown, installed

    autoshard.register()
    page = (Path(__file__).resolve().parents[2] / "docs" / "lightning-changes.md").read_text()
    block = CHANGES_BEGIN + page.split(CHANGES_BEGIN, 1)[1].split(CHANGES_END, 1)[0] + CHANGES_END
    assert block == changes_markdown(), "regenerate: python -m autoshard.lightning docs/lightning-changes.md"
    assert len(installed()) == block.count("\n| ") - 1 >= 15  # one row per change (the header aside)
    fabric = [c.target for c in installed() if c.kind is ChangeKind.FABRIC_REGISTRY]
    assert fabric == [f"lightning.fabric STRATEGY_REGISTRY[{n!r}]" for n in ("fsdp2", "auto-shard", "autoshard-deepspeed")]
    assert all(f"| `{target}` | Fabric registry entry |" in block for target in fabric)


# -- one record, one undo: autoshard.uninstall() puts back the Trainer's and Fabric's Lightning alike --------------
ONE_RECORD = r"""
import json
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector as Connector

def snapshot():
    return {"trainer": {name: id(entry) for name, entry in dict.items(StrategyRegistry)},
            "fabric": {name: id(entry) for name, entry in dict.items(STRATEGY_REGISTRY)},
            "connector": {name: id(value) for name, value in vars(Connector).items()}}

stock = snapshot()
import autoshard
import autoshard.fabric as af
import autoshard.lightning as al
from autoshard.install_record import installed
kinds = sorted({c.kind.value for c in installed()})
targets = [c.target for c in installed()]
installed_now = snapshot()
undone = [c.target for c in autoshard.uninstall()]
restored = snapshot()
left = [c.target for c in installed()]
autoshard.register()
again = sorted(c.target for c in installed())
trainer_only = [c.target for c in al.uninstall()]  # each side undoes its own part only
after_trainer = {"fabric_left": [c.target for c in af.installed()], "snapshot": snapshot()}
fabric_only = [c.target for c in af.uninstall()]
print("RESULT " + json.dumps(dict(stock=stock, installed=installed_now, restored=restored, kinds=kinds, targets=targets,
                                  undone=undone, left=left, again=again, trainer_only=trainer_only,
                                  after_trainer=after_trainer, fabric_only=fabric_only, final=snapshot())), flush=True)
"""


@pytest.mark.timeout(300)
def test_one_record_and_autoshard_uninstall_undoes_the_trainer_and_fabric_alike() -> None:
    import json

    result = json.loads(next(line for line in run(ONE_RECORD).splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))
    stock, installed = result["stock"], result["installed"]
    assert result["kinds"] == ["Fabric registry entry", "registry entry", "wrapped method"]
    for side in ("trainer", "fabric", "connector"):
        assert installed[side] != stock[side], side  # the import changed each: the comparisons below can fail
    assert result["restored"] == stock  # both registries and the connector: every entry the very object it was
    assert result["undone"] == result["targets"][::-1] and result["left"] == []
    assert result["again"] == sorted(result["targets"])
    # autoshard.lightning.uninstall() undoes the Trainer's part, autoshard.fabric.uninstall() Fabric's.
    assert {t for t in result["trainer_only"] if "STRATEGY_REGISTRY" in t} == set()
    assert result["after_trainer"]["snapshot"]["trainer"] == stock["trainer"]
    assert result["after_trainer"]["snapshot"]["fabric"] != stock["fabric"] and len(result["after_trainer"]["fabric_left"]) == 3
    assert len(result["fabric_only"]) == 3 and result["final"] == stock
