"""Every private torch member autoshard touches, with the module using it and why (``TORCH``), and where the code
takes each from: torch may move one in any release.

tests/test_privates.py checks each on the installed torch (an upgrade fails there by name, not deep inside a training
step) and fails when src/ reaches a torch private anywhere but here. Importing this module imports no torch: each
provider (``PROVIDED``: ``in_torch.tree_map``) imports its member on first use.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator
from typing import Any

from autoshard.privates import Private, provide

_FSDP, _ACT, _COMPILED = "autoshard.adapters.fsdp2", "autoshard.activations", "autoshard.activations.compiled"  # users
_BUDGET, _PYTREE = "autoshard.budget", "torch.utils._pytree"
_HERE = "autoshard.privates.in_torch"  # used by a function below (fsdp2_api, parked_registry, ...)
_TRACKER, _FAKE, _C10D = "torch.distributed._tools.fsdp2_mem_tracker", "torch._subclasses.fake_tensor", "torch.distributed.distributed_c10d"
_MEM_TRACKER = f"{_TRACKER}.FSDPMemTracker"
# torch.distributed's group registry: module globals of distributed_c10d that its ``_world`` object reads through
# properties, plus the default group's init method and backend name.
_REGISTRY_GLOBALS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
_REGISTRY_VALUES = ("_group_count", "_backend", "_default_pg_init_method")
_REGISTRY = "part of the group registry that _world reads: parked and put back (parked_registry)"

TORCH: tuple[Private, ...] = (
    # -- FSDP2 itself and the plan's runtime ----------------------------------------------------------------------
    Private("torch.distributed._composable.fsdp", "fully_shard", _HERE, "fallback home of fully_shard (before torch.distributed.fsdp)"),
    Private("torch.distributed._composable.fsdp", "FSDPModule", _HERE, "fallback home, with fully_shard"),
    Private("torch.distributed._composable.fsdp", "MixedPrecisionPolicy", _HERE, "fallback home, with fully_shard"),
    Private("torch.distributed._composable.fsdp", "CPUOffloadPolicy", _HERE, "fallback home, with fully_shard"),
    Private("torch.distributed._composable.fsdp", "OffloadPolicy", _HERE, "fallback home, with fully_shard"),
    Private("torch.distributed.device_mesh.DeviceMesh", "_unflatten", "autoshard.mesh", "HSDP's view of the one mesh: composes with tensor parallel"),
    Private("torch.Tensor", "_post_accumulate_grad_hooks", _FSDP, "reset where Module.to swapped a parameter's contents (and its hook dict)"),
    Private("torch.Tensor", "_version", "autoshard.adapters.tp_plan", "a shared tensor-parallel input is reused only while not modified in place"),
    Private("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", "_lazy_init", _FSDP, "each unit's reduce dtype fixed before the forward"),
    Private("torch.distributed", "_broadcast_coalesced", _FSDP, "rank 0's unsharded parameters and buffers in few messages"),
    Private("torch.distributed.tensor._random", "_rng_tracker", f"{_FSDP}, {_HERE}", "replaced on CPU meta init; parked with the group registry"),
    Private("torch.distributed.tensor._random._RNGStateTracker", "_distribute_region", _FSDP, "the method the stand-in tracker provides"),
    Private("torch._C", "_current_graph_task_id", _FSDP, "which backward a gradient hook runs in: one reduction per backward"),
    Private("torch.autograd.Variable._execution_engine", "queue_callback", _FSDP, "the reduction runs at the end of the backward"),
    Private(_PYTREE, "tree_leaves", f"{_FSDP}, {_BUDGET}", "the tensors a unit returns (they arm the reduction), or a batch holds"),
    Private(_PYTREE, "tree_map", f"{_FSDP}, {_BUDGET}", "a unit's view outputs cloned (clone_view_outputs); a batch cut to a micro-batch"),
    Private("torch._utils", "_flatten_dense_tensors", _FSDP, "a bucket's gradients and flags into one buffer, in one call"),
    Private("torch._utils", "_unflatten_dense_tensors", _FSDP, "that buffer back into views shaped like each gradient"),
    Private("torch", "_foreach_copy_", _FSDP, "the averages copied into the gradients, in one call"),
    Private("torch.nn.modules.batchnorm", "_BatchNorm", "autoshard.batchnorm", "every BatchNorm class, converted to SyncBatchNorm"),
    Private(
        "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
        "_unscale_grads_",
        "autoshard.engine.fp16",
        "overridden: 16-mixed's scaler unscales each DTensor gradient's local shard (torch's mixes DTensor and plain ones)",
    ),
    Private(
        "torch.amp.grad_scaler.GradScaler",
        "_check_inf_per_device",
        "autoshard.engine.fp16",
        "overridden: a fused optimizer's inf check, all-reduced over every rank like unscale_'s",
    ),
    # -- torch.compile ------------------------------------------------------------------------------------------------
    Private("torch._dynamo", "OptimizedModule", _HERE, "compile_wrapper: a module wrapped in torch.compile (needs, adapters.compile)"),
    Private("torch.nn.Module", "_compiled_call_impl", _HERE, "compiled_in_place: a module.compile() by the user or autoshard (needs, compile)"),
    Private("torch._functorch.aot_autograd", "aot_function", _COMPILED, "a block's joint forward-backward graph, traced on fake tensors"),
    Private("torch._functorch.partitioners", "min_cut_rematerialization_partition", _COMPILED, "inductor's partitioner: what the forward saves"),
    Private(_PYTREE, "tree_flatten", _COMPILED, "a block's captured inputs as a flat list of tensors"),
    Private(_PYTREE, "tree_unflatten", _COMPILED, "and back into its args and kwargs"),
    # -- checkpoints ----------------------------------------------------------------------------------------------
    Private("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict", "autoshard.checkpoint", "a DCP checkpoint read in one process"),
    Private("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner", "autoshard.checkpoint", "reads entries without a template"),
    Private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "autoshard.init_from", "the slice a rank's shard holds"),
    # -- the simulated step (activations) ---------------------------------------------------------------------------
    Private(_TRACKER, "FSDPMemTracker", _ACT, "the tracker StepTracker extends"),
    Private(_TRACKER, "_FSDPRefType", _ACT, "its memory categories (MODEL_STATES, GATHERED, ACTIVATIONS)"),
    Private(_TRACKER, "_FSDPState", _ACT, "its phase, set in StepTracker.__init__"),
    Private(_MEM_TRACKER, "_update_peak_stats", _ACT, "overridden: where the peak happened"),
    Private(_MEM_TRACKER, "_register_module_and_optimizer_hooks", _ACT, "overridden: several optimizers"),
    Private(_MEM_TRACKER, "_deregister_module_and_optimizer_hooks", _ACT, "overridden, with the above"),
    Private(_MEM_TRACKER, "_fsdp_state_pre_forward", _ACT, "overridden: a unit called twice"),
    Private(_MEM_TRACKER, "_update_and_maybe_create_winfos", _ACT, "called: tensors no unit owns"),
    Private(_MEM_TRACKER, "_track_optimizer_states", _ACT, "called: each optimizer's states"),
    Private("torch.distributed._tools.mem_tracker", "MemTracker", _ACT, "its __init__ is called directly (no FSDP root needed)"),
    Private(_MEM_TRACKER, "__torch_dispatch__", _ACT, "wrapped: DTensor's sharding propagation is not counted (torch < 2.13 did)"),
    Private("torch.distributed.tensor._sharding_prop", "ShardingPropagator", _ACT, "DTensor's sharding propagation, whose ops are not counted"),
    Private(
        "torch.distributed.tensor._sharding_prop.ShardingPropagator",
        "_propagate_tensor_meta_non_cached",
        _ACT,
        "wrapped while a step is tracked: the ops it runs to learn output shapes hold no memory of the step (torch < 2.13 counted them)",
    ),
    Private("torch.testing._internal.distributed.fake_pg", "FakeStore", _ACT, "the store of the 'fake' process group"),
    Private(_FAKE, "FakeTensorMode", _ACT, "the tensors of the simulated step"),
    Private(_FAKE, "DataDependentOutputException", _ACT, "a step that reads tensor values, said in words"),
    Private(_FAKE, "DynamicOutputShapeException", _ACT, "a value-dependent output shape, said in words"),
    Private(_FAKE, "UnsupportedOperatorException", _ACT, "an operator without a fake kernel, said in words"),
    Private(_PYTREE, "tree_map_only", f"{_ACT}, {_BUDGET}", "fake tensors made from the example batch; empty ones of a batch's shapes"),
    Private(_C10D, "_World", _HERE, "an empty group registry while a live one is parked (parked_registry)"),
    Private(_C10D, "_world", _HERE, "parked and put back, so the live group is never touched"),
    *(Private(_C10D, name, _HERE, _REGISTRY) for name in _REGISTRY_GLOBALS + _REGISTRY_VALUES),
    Private(_C10D, "_unregister_process_group", _HERE, "the fake groups' names leave torch's C++ registry"),
    Private(_C10D, "_register_process_group", _HERE, "the live groups' names registered again after"),
    Private(_C10D, "_update_default_pg", _HERE, "the live default group's rank is torch's again"),
    Private("torch.distributed.tensor.DTensor", "_op_dispatcher", _HERE, "its sharding-propagation cache, emptied after a fake world"),
    Private("torch.distributed.tensor._redistribute", "_gen_transform_infos", _HERE, "its plan cache, emptied after a fake world"),
    Private("torch.distributed.tensor._collective_utils", "MeshTopoInfo", _HERE, "its cache of mesh topologies, emptied after a fake world"),
    Private("torch.nn.Module", "_apply", "autoshard.adapters", "Module.to's own walk, with offloaded shards kept on the host"),
    Private("torch.distributed._composable", "checkpoint", "autoshard.adapters.checkpointing", "full activation checkpointing of a block"),
)


# What the code elsewhere takes from here, as ``in_torch.<name>``: each a member listed above, imported on first use.
PROVIDED = {
    "tree_leaves": f"{_PYTREE}:tree_leaves",
    "tree_map": f"{_PYTREE}:tree_map",
    "tree_map_only": f"{_PYTREE}:tree_map_only",
    "tree_flatten": f"{_PYTREE}:tree_flatten",
    "tree_unflatten": f"{_PYTREE}:tree_unflatten",
    "broadcast_coalesced": "torch.distributed:_broadcast_coalesced",
    "current_graph_task_id": "torch._C:_current_graph_task_id",
    "execution_engine": "torch.autograd:Variable._execution_engine",
    "flatten_dense_tensors": "torch._utils:_flatten_dense_tensors",
    "unflatten_dense_tensors": "torch._utils:_unflatten_dense_tensors",
    "foreach_copy_": "torch:_foreach_copy_",
    "BatchNorm": "torch.nn.modules.batchnorm:_BatchNorm",
    "aot_function": "torch._functorch.aot_autograd:aot_function",
    "min_cut_rematerialization_partition": "torch._functorch.partitioners:min_cut_rematerialization_partition",
    "load_state_dict": "torch.distributed.checkpoint.state_dict_loader:_load_state_dict",
    "EmptyStateDictLoadPlanner": "torch.distributed.checkpoint.default_planner:_EmptyStateDictLoadPlanner",
    "compute_local_shape_and_global_offset": "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
    "FSDPMemTracker": f"{_TRACKER}:FSDPMemTracker",
    "FSDPRefType": f"{_TRACKER}:_FSDPRefType",
    "FSDPState": f"{_TRACKER}:_FSDPState",
    "MemTracker": "torch.distributed._tools.mem_tracker:MemTracker",
    "ShardingPropagator": "torch.distributed.tensor._sharding_prop:ShardingPropagator",
    "FakeStore": "torch.testing._internal.distributed.fake_pg:FakeStore",  # importing it registers the "fake" backend
    "FakeTensorMode": f"{_FAKE}:FakeTensorMode",
    "DataDependentOutputException": f"{_FAKE}:DataDependentOutputException",
    "DynamicOutputShapeException": f"{_FAKE}:DynamicOutputShapeException",
    "UnsupportedOperatorException": f"{_FAKE}:UnsupportedOperatorException",
    "composable_checkpoint": "torch.distributed._composable:checkpoint",
}


def __getattr__(name: str) -> Any:
    return provide(globals(), PROVIDED, name)


def fsdp2_api() -> tuple[Any, Any, Any, Any, Any]:
    """fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy (public since torch 2.6)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    return fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy


def compile_wrapper() -> Any:
    """torch.compile's wrapper class (``OptimizedModule``), or ``()`` when torch._dynamo was never imported: nothing
    was compiled then, and importing it costs a second. For ``isinstance``."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo.OptimizedModule if dynamo is not None else ()


def compiled_in_place(module: Any) -> bool:
    """Compiled by ``module.compile()``."""
    return module._compiled_call_impl is not None


def rng_tracker() -> Any:
    """DTensor's RNG tracker (None until a random op on a DTensor makes one)."""
    from torch.distributed.tensor import _random

    return _random._rng_tracker


def set_rng_tracker(tracker: Any) -> None:
    from torch.distributed.tensor import _random

    _random._rng_tracker = tracker


def empty_group_registry() -> Any:
    """An empty torch.distributed group registry from now on; the one before is returned (keep it referenced)."""
    import torch.distributed.distributed_c10d as c10d

    previous, c10d._world = c10d._world, c10d._World()
    return previous


# Names of fake groups: far above any live count. A name a fake group once held was seen to stay unresolvable for
# the live group that took it next (2 gloo ranks, a decision on rank 0 between the mesh and the sharding).
_FAKE_NAMES = itertools.count(10**9, 10**4)


@contextlib.contextmanager
def parked_registry() -> Iterator[None]:
    """An empty torch.distributed group registry inside, the one from before (live groups and all) after. The fake
    groups are unregistered one by one: ``destroy_process_group()`` would unregister the live groups' names too."""
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world
    saved = {name: getattr(c10d, name) for name in _REGISTRY_GLOBALS + _REGISTRY_VALUES}
    tracker = rng_tracker()
    for name in _REGISTRY_GLOBALS:
        setattr(c10d, name, {})
    c10d._backend, c10d._default_pg_init_method = None, None
    c10d._group_count = next(_FAKE_NAMES)  # fake groups take names no live group will ever have
    c10d._world = c10d._World()
    set_rng_tracker(None)
    try:
        yield
    finally:
        for group, name in list(c10d._pg_names.items()):
            group.shutdown()
            c10d._unregister_process_group(name)
        for name, value in saved.items():  # the live count too: ranks that ran no fake world name new groups alike (gloo meets under the name)
            setattr(c10d, name, value)
        for group, name in saved["_pg_names"].items():  # a fake group may have shared a live one's name: the live one wins
            c10d._unregister_process_group(name)
            c10d._register_process_group(name, group)
        c10d._world = world
        c10d._update_default_pg(world.default_pg)  # torch's C++ side keeps the default group's rank: the live one's again
        set_rng_tracker(tracker)
        forget_fake_meshes()


def forget_fake_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans reachable from Python: their keys compare meshes by
    ranks, dims and device type, so a fake mesh equal to a live one could serve the live run its fake groups. Not
    enough on its own (some caches are out of reach): a live CPU mesh can equal the simulation's, so ``budget.decide``
    keeps the forked child there and parks in this process only once CUDA is initialised (its meshes are CUDA's)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
