"""The private torch members ``autoshard.activations`` builds on, one check each: a torch upgrade that moves one
fails here by name, with what it is for, not deep inside a simulated step.

FSDPMemTracker (torch.distributed._tools) is torch's own memory tracker for FSDP2; autoshard extends it to a
LightningModule root and several optimizers. The fake process group comes from torch's test utilities.
The bucketed averaging of unsharded gradients (autoshard.adapters.fsdp2) leans on the autograd engine's callbacks
and torch's flatten helpers, listed below the activations' members.
"""

from __future__ import annotations

import importlib

import pytest

# (module, attribute path, what activations.py does with it)
MEMBERS = [
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", "the tracker StepTracker extends"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "_FSDPRefType", "its memory categories (MODEL_STATES, GATHERED, ACTIVATIONS)"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "_FSDPState", "its phase, set in StepTracker.__init__"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._update_peak_stats", "overridden: where the peak happened"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._register_module_and_optimizer_hooks", "overridden: several optimizers"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._deregister_module_and_optimizer_hooks", "overridden, with the above"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._fsdp_state_pre_forward", "overridden: a unit called twice"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._update_and_maybe_create_winfos", "called: tensors no unit owns"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker._track_optimizer_states", "called: each optimizer's states"),
    ("torch.distributed._tools.mem_tracker", "MemTracker", "its __init__ is called directly (no FSDP root needed)"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", "the store of the 'fake' process group"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode", "the tensors of the simulated step"),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException", "a step that reads tensor values, said in words"),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException", "a value-dependent output shape, said in words"),
    ("torch._subclasses.fake_tensor", "UnsupportedOperatorException", "an operator without a fake kernel, said in words"),
]


def check_member(module: str, path: str, user: str, why: str) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"torch moved {module}.{path}: {user} uses it for {why}"
        obj = getattr(obj, part)


@pytest.mark.parametrize(("module", "path", "why"), MEMBERS, ids=[m[1] for m in MEMBERS])
def test_every_torch_member_activations_uses_exists(module: str, path: str, why: str) -> None:
    check_member(module, path, "autoshard.activations", why)


# (module, attribute path, what adapters/fsdp2.py's bucketed gradient averaging does with it)
FSDP2_MEMBERS = [
    ("torch._C", "_current_graph_task_id", "which backward a gradient hook runs in: one reduction per backward"),
    ("torch.autograd", "Variable._execution_engine.queue_callback", "the reduction runs at the end of the backward"),
    ("torch.utils._pytree", "tree_leaves", "the tensors an FSDP unit returns, whose gradient arms the reduction"),
    ("torch._utils", "_flatten_dense_tensors", "a bucket's gradients and flags into one buffer, in one call"),
    ("torch._utils", "_unflatten_dense_tensors", "that buffer back into views shaped like each gradient"),
    ("torch", "_foreach_copy_", "the averages copied into the gradients, in one call"),
]


@pytest.mark.parametrize(("module", "path", "why"), FSDP2_MEMBERS, ids=[m[1] for m in FSDP2_MEMBERS])
def test_every_torch_member_the_gradient_averaging_uses_exists(module: str, path: str, why: str) -> None:
    check_member(module, path, "autoshard.adapters.fsdp2", why)


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
