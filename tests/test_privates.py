"""The private members autoshard builds on (``autoshard.privates``), one check each: a torch upgrade that moves one
fails here by name, with what it is for, not deep inside a training step. The ledgers are complete and the privates
package is the one access point: src/ is read, a torch, Lightning or DeepSpeed private reached outside
``autoshard.privates`` fails here, and so does one the package reaches without listing it. (Lightning's and
DeepSpeed's members are checked on the installed release in tests/lightning/test_compat.py,
tests/fabric/test_fabric_registration.py and tests/test_deepspeed_compat.py.)

Behaviours of torch privates (not only their names) are checked below the lists.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from autoshard.privates import Private, in_deepspeed, in_lightning, in_torch, missing

SRC = Path(__file__).resolve().parents[1] / "src"
PRIVATES = SRC / "autoshard" / "privates"
LEDGERS = (*in_torch.TORCH, *in_lightning.TRAINER, *in_lightning.FABRIC, *in_deepspeed.DEEPSPEED)
DEPENDENCIES = ("torch", "lightning", "deepspeed")


@pytest.mark.parametrize("member", in_torch.TORCH, ids=[m.dotted for m in in_torch.TORCH])
def test_every_listed_torch_member_exists(member: Private) -> None:
    assert not missing([member]), f"torch moved {member.dotted}: {member.used_in} uses it for {member.why}"


PROVIDERS = [(module, name) for module in (in_torch, in_lightning) for name in sorted(module.PROVIDED)]


@pytest.mark.parametrize(("module", "name"), PROVIDERS, ids=[f"{m.__name__}.{n}" for m, n in PROVIDERS])
def test_every_provider_gives_its_member(module: Any, name: str) -> None:
    assert getattr(module, name) is not None


def _sources(module: str) -> str:
    """The text of an autoshard module, or of every file of a package."""
    path = SRC.joinpath(*module.split("."))
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("member", LEDGERS, ids=[f"{m.dotted} in {m.used_in}" for m in LEDGERS])
def test_every_listed_member_is_used_where_the_list_says(member: Private) -> None:
    """A stale row (the code moved, or stopped using it) is as misleading as a missing one. ``used_in`` names each
    module using it (separated by commas), by its own name or through its provider (``in_torch.broadcast_coalesced``)."""
    providers = {
        f".{name}" for module in (in_torch, in_lightning) for name, path in module.PROVIDED.items() if path.replace(":", ".") == member.dotted
    }
    for module in member.used_in.split(", "):
        source = _sources(module)
        assert any(word in source for word in {member.name, *providers}), f"{module} no longer uses {member.dotted}"


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_references(root: Path, deps: tuple[str, ...]) -> set[tuple[str, str]]:
    """(dotted name, file) for every private member of ``deps`` that code under ``root`` imports, or reaches through
    an imported name (``dist._broadcast_coalesced``, ``_random._rng_tracker``); function-local imports included."""
    found: set[tuple[str, str]] = set()
    for file in sorted(root.rglob("*.py")):
        tree, where, alias = ast.parse(file.read_text()), str(file.relative_to(root)), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in deps:
                        alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                        if any(_private(p) for p in a.name.split(".")):
                            found.add((a.name, where))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in deps:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    alias[a.asname or a.name] = full
                    if any(_private(p) for p in full.split(".")):
                        found.add((full, where))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in alias:
                    found.add((".".join([alias[value.id], *reversed(chain)]), where))
    return found


def _covered(name: str, listed: set[str]) -> bool:
    """Listed, or a module or class a listed member lives in (``import torch.utils._pytree as pytree``)."""
    return any(name == d or d.startswith(name + ".") for d in listed)


def test_no_private_is_reached_outside_the_privates_package() -> None:
    refs = private_references(SRC, DEPENDENCIES)
    outside = sorted(f"{name} ({where})" for name, where in refs if not where.startswith("autoshard/privates/"))
    assert not outside, f"take these from autoshard.privates (a provider in in_torch / in_lightning / in_deepspeed): {outside}"


def test_every_private_the_privates_package_reaches_is_listed() -> None:
    listed = {m.dotted for m in LEDGERS}
    provided = {path.replace(":", ".") for module in (in_torch, in_lightning) for path in module.PROVIDED.values()}
    reached = {name for name, _ in private_references(PRIVATES, DEPENDENCIES)} | provided
    unlisted = sorted(name for name in reached if not _covered(name, listed))
    assert not unlisted, f"add these to the ledger in autoshard.privates, with a why: {unlisted}"


def test_the_scan_finds_a_private_reached_through_an_alias(tmp_path: Path) -> None:
    """The two checks above cannot pass by finding nothing."""
    (tmp_path / "m.py").write_text(
        "import torch.distributed as dist\nfrom torch.distributed.tensor import _random\n"
        "def f():\n    from torch._utils import _flatten_dense_tensors\n    dist._broadcast_coalesced(None, [], 1, 0)\n"
        "    return _random._rng_tracker\n"
    )
    assert {n for n, _ in private_references(tmp_path, ("torch",))} == {
        "torch.distributed._broadcast_coalesced",
        "torch.distributed.tensor._random",
        "torch.distributed.tensor._random._rng_tracker",
        "torch._utils._flatten_dense_tensors",
    }
    assert len(private_references(PRIVATES, ("torch",))) > 10  # the package itself: the shim, the group registry


def test_a_module_keeps_its_parameters_in_a_dict_to_empty_refills() -> None:
    """UnshardedGradients.refresh looks each parameter up in its module's ``_parameters``: ``to_empty`` (meta
    materialization) puts a new Parameter object there, which must be found and hooked again."""
    import torch

    with torch.device("meta"):
        layer = torch.nn.Linear(2, 2)
    before = layer._parameters.get("weight")
    layer.to_empty(device="cpu")
    assert isinstance(layer._parameters.get("weight"), torch.nn.Parameter) and layer._parameters["weight"] is layer.weight
    assert layer.weight is not before  # why refresh exists: the hooks registered on the meta parameter are gone


def test_a_callback_queued_by_a_final_callback_runs_last_in_the_same_backward() -> None:
    """average_unsharded_gradients queues its reduction from a final callback so that it runs behind every callback
    queued during the backward (FSDP2's): on every rank in the same order."""
    import torch

    engine, seen = torch.autograd.Variable._execution_engine, []
    p = torch.nn.Parameter(torch.ones(2))

    def hook(param: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        engine.queue_callback(lambda: engine.queue_callback(lambda: seen.append(("second hop", torch._C._current_graph_task_id() == task))))
        engine.queue_callback(lambda: seen.append(("queued later", True)))

    p.register_post_accumulate_grad_hook(hook)
    p.sum().backward()
    assert seen == [("queued later", True), ("second hop", True)]
    assert torch._C._current_graph_task_id() == -1  # outside a backward


def test_the_instance_state_step_tracker_reads_exists() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    assert hasattr(tracker, "_peak_mem") and hasattr(tracker, "_mod_tracker"), "MemTracker's peak and module tracker moved"
    assert hasattr(tracker._mod_tracker, "_known_modules") and hasattr(tracker._mod_tracker, "_seen_modules"), (
        "ModTracker's module names moved: StepTracker names modules by their path with them"
    )


def test_the_fake_backend_registers() -> None:
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    assert "fake" in dist.Backend.backend_list, "the 'fake' process-group backend is gone: measure_step needs it"
