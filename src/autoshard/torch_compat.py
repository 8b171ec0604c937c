"""Every private torch member autoshard touches, with the module using it and why: torch may move one in any release.

tests/test_torch_compat.py checks each on the installed torch (an upgrade fails there by name, not deep inside a
training step) and fails when src/ uses a torch private not listed here. Importing this module imports no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """``module`` has ``path`` (dotted attributes below the module); ``used_in`` is the autoshard module using it."""

    module: str
    path: str
    used_in: str
    why: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.path}" if self.path else self.module

    def exists(self) -> bool:
        try:
            obj = importlib.import_module(self.module)
        except ImportError:
            return False
        for part in self.path.split(".") if self.path else ():
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True


_FSDP, _ACT, _COMPILED = "autoshard.adapters.fsdp2", "autoshard.activations", "autoshard.activations.compiled"  # users
_TRACKER, _FAKE, _C10D = "torch.distributed._tools.fsdp2_mem_tracker", "torch._subclasses.fake_tensor", "torch.distributed.distributed_c10d"
_REGISTRY = "part of the group registry that _world reads: parked and put back"

PRIVATE_MEMBERS: tuple[Member, ...] = (
    # -- FSDP2 itself and the plan's runtime ----------------------------------------------------------------------
    Member("torch.distributed._composable.fsdp", "fully_shard", _FSDP, "fallback home of fully_shard (before torch.distributed.fsdp)"),
    Member("torch.distributed._composable.fsdp", "FSDPModule", _FSDP, "fallback home, with fully_shard"),
    Member("torch.distributed._composable.fsdp", "MixedPrecisionPolicy", _FSDP, "fallback home, with fully_shard"),
    Member("torch.distributed._composable.fsdp", "CPUOffloadPolicy", _FSDP, "fallback home, with fully_shard"),
    Member("torch.distributed._composable.fsdp", "OffloadPolicy", _FSDP, "fallback home, with fully_shard"),
    Member("torch.distributed.device_mesh", "DeviceMesh._unflatten", "autoshard.mesh", "HSDP's view of the one mesh: composes with tensor parallel"),
    Member("torch", "Tensor._post_accumulate_grad_hooks", _FSDP, "reset where Module.to swapped a parameter's contents (and its hook dict)"),
    Member("torch", "Tensor._version", "autoshard.adapters.tp_plan", "a shared tensor-parallel input is reused only while not modified in place"),
    Member("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._lazy_init", _FSDP, "each unit's reduce dtype fixed before the forward"),
    Member("torch.distributed", "_broadcast_coalesced", _FSDP, "rank 0's unsharded parameters and buffers in few messages"),
    Member("torch.distributed.tensor._random", "_rng_tracker", _FSDP, "replaced on CPU meshes while meta shards are initialized"),
    Member("torch.distributed.tensor._random", "_RNGStateTracker._distribute_region", _FSDP, "the method the stand-in tracker provides"),
    Member("torch._C", "_current_graph_task_id", _FSDP, "which backward a gradient hook runs in: one reduction per backward"),
    Member("torch.autograd", "Variable._execution_engine.queue_callback", _FSDP, "the reduction runs at the end of the backward"),
    Member("torch.utils._pytree", "tree_leaves", _FSDP, "the tensors an FSDP unit returns, whose gradient arms the reduction"),
    Member("torch.utils._pytree", "tree_map", _FSDP, "a unit's view outputs cloned (clone_view_outputs)"),
    Member("torch._utils", "_flatten_dense_tensors", _FSDP, "a bucket's gradients and flags into one buffer, in one call"),
    Member("torch._utils", "_unflatten_dense_tensors", _FSDP, "that buffer back into views shaped like each gradient"),
    Member("torch", "_foreach_copy_", _FSDP, "the averages copied into the gradients, in one call"),
    Member("torch.nn.modules.batchnorm", "_BatchNorm", "autoshard.batchnorm", "every BatchNorm class, converted to SyncBatchNorm"),
    # -- torch.compile ------------------------------------------------------------------------------------------------
    Member("torch._dynamo", "OptimizedModule", "autoshard.needs", "a module the user wrapped in torch.compile: a need (compile)"),
    Member("torch._dynamo", "OptimizedModule", "autoshard.adapters.compile", "torch.compile's wrapper replaced by its _orig_mod: names stay eager"),
    Member("torch.nn", "Module._compiled_call_impl", "autoshard.needs", "a module compiled in place (module.compile()) by the user"),
    Member("torch.nn", "Module._compiled_call_impl", "autoshard.adapters.compile", "a block compiled in place already is left as it is"),
    Member("torch._functorch.aot_autograd", "aot_function", _COMPILED, "a block's joint forward-backward graph, traced on fake tensors"),
    Member("torch._functorch.partitioners", "min_cut_rematerialization_partition", _COMPILED, "inductor's partitioner: what the forward saves"),
    Member("torch.utils._pytree", "tree_flatten", _COMPILED, "a block's captured inputs as a flat list of tensors"),
    Member("torch.utils._pytree", "tree_unflatten", _COMPILED, "and back into its args and kwargs"),
    # -- checkpoints ----------------------------------------------------------------------------------------------
    Member("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict", "autoshard.checkpoint", "a DCP checkpoint read in one process"),
    Member("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner", "autoshard.checkpoint", "reads entries without a template"),
    Member("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "autoshard.init_from", "the slice a rank's shard holds"),
    # -- the simulated step (activations) ---------------------------------------------------------------------------
    Member(_TRACKER, "FSDPMemTracker", _ACT, "the tracker StepTracker extends"),
    Member(_TRACKER, "_FSDPRefType", _ACT, "its memory categories (MODEL_STATES, GATHERED, ACTIVATIONS)"),
    Member(_TRACKER, "_FSDPState", _ACT, "its phase, set in StepTracker.__init__"),
    Member(_TRACKER, "FSDPMemTracker._update_peak_stats", _ACT, "overridden: where the peak happened"),
    Member(_TRACKER, "FSDPMemTracker._register_module_and_optimizer_hooks", _ACT, "overridden: several optimizers"),
    Member(_TRACKER, "FSDPMemTracker._deregister_module_and_optimizer_hooks", _ACT, "overridden, with the above"),
    Member(_TRACKER, "FSDPMemTracker._fsdp_state_pre_forward", _ACT, "overridden: a unit called twice"),
    Member(_TRACKER, "FSDPMemTracker._update_and_maybe_create_winfos", _ACT, "called: tensors no unit owns"),
    Member(_TRACKER, "FSDPMemTracker._track_optimizer_states", _ACT, "called: each optimizer's states"),
    Member("torch.distributed._tools.mem_tracker", "MemTracker", _ACT, "its __init__ is called directly (no FSDP root needed)"),
    Member("torch.testing._internal.distributed.fake_pg", "FakeStore", _ACT, "the store of the 'fake' process group"),
    Member(_FAKE, "FakeTensorMode", _ACT, "the tensors of the simulated step"),
    Member(_FAKE, "DataDependentOutputException", _ACT, "a step that reads tensor values, said in words"),
    Member(_FAKE, "DynamicOutputShapeException", _ACT, "a value-dependent output shape, said in words"),
    Member(_FAKE, "UnsupportedOperatorException", _ACT, "an operator without a fake kernel, said in words"),
    Member("torch.utils._pytree", "tree_map_only", _ACT, "fake tensors made from the example batch"),
    Member(_C10D, "_World", _ACT, "an empty group registry while a live one is parked (parked_registry)"),
    Member(_C10D, "_world", _ACT, "parked and put back, so the live group is never touched"),
    *(
        Member(_C10D, name, _ACT, _REGISTRY)
        for name in ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag", "_group_count", "_backend")
    ),
    Member(_C10D, "_default_pg_init_method", _ACT, _REGISTRY),
    Member(_C10D, "_unregister_process_group", _ACT, "the fake groups' names leave torch's C++ registry"),
    Member(_C10D, "_register_process_group", _ACT, "the live groups' names registered again after"),
    Member(_C10D, "_update_default_pg", _ACT, "the live default group's rank is torch's again"),
    Member("torch.distributed.tensor", "DTensor._op_dispatcher", _ACT, "its sharding-propagation cache, emptied after a fake world"),
    Member("torch.distributed.tensor._redistribute", "_gen_transform_infos", _ACT, "its plan cache, emptied after a fake world"),
    Member("torch.distributed.tensor._collective_utils", "MeshTopoInfo", _ACT, "its cache of mesh topologies, emptied after a fake world"),
    Member("torch.nn", "Module._apply", "autoshard.adapters", "Module.to's own walk, with offloaded shards kept on the host"),
    Member("torch.distributed.tensor._random", "_rng_tracker", _ACT, "DTensor's RNG tracker: one made for a fake mesh never serves a live run"),
    Member("torch.distributed._composable", "checkpoint", "autoshard.adapters.checkpointing", "full activation checkpointing of a block"),
    Member("torch.utils._pytree", "tree_map_only", "autoshard.budget", "empty tensors of a given batch's shapes"),
    Member("torch.utils._pytree", "tree_map", "autoshard.budget", "a batch cut to a smaller micro-batch"),
    Member("torch.utils._pytree", "tree_leaves", "autoshard.budget", "the tensors of a batch (its rows)"),
)


def missing() -> list[Member]:
    """The listed members the installed torch lacks."""
    return [m for m in PRIVATE_MEMBERS if not m.exists()]
