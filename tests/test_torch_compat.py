"""The private torch members ``autoshard.activations`` builds on, one check each: a torch upgrade that moves one
fails here by name, with what it is for, not deep inside a simulated step.

FSDPMemTracker (torch.distributed._tools) is torch's own memory tracker for FSDP2; autoshard extends it to a
LightningModule root and several optimizers. The fake process group comes from torch's test utilities.
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


@pytest.mark.parametrize(("module", "path", "why"), MEMBERS, ids=[m[1] for m in MEMBERS])
def test_every_torch_member_activations_uses_exists(module: str, path: str, why: str) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"torch moved {module}.{path}: autoshard.activations uses it for {why}"
        obj = getattr(obj, part)


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
