"""Every DeepSpeed member autoshard calls, unpickles or mirrors (``DEEPSPEED``), and the releases they were checked
on: DeepSpeed may change any of them in a release.

tests/test_deepspeed_compat.py checks each on the installed DeepSpeed, with the file names and partition rules that
``autoshard.checkpoint.deepspeed_layout`` restates, and fails when src/ reaches a DeepSpeed private anywhere but here.
Importing this module imports no deepspeed.
"""

from __future__ import annotations

from autoshard.privates import Private

SUPPORTED_DEEPSPEED = ">=0.19,<0.20"  # the releases the members and the checkpoint layout were checked on (0.19.8 here)
PIN = f'pip install "deepspeed{SUPPORTED_DEEPSPEED}"'

# -- every DeepSpeed member autoshard calls, unpickles or mirrors -----------------------------------------------------
# ``used_in``: the autoshard module that calls, unpickles or mirrors it (mirrored: autoshard restates what it does, so
# a change there means a change here).
_ENGINE, _ZERO_TO_FP32, _SCALER = "deepspeed.runtime.engine", "deepspeed.utils.zero_to_fp32", "deepspeed.runtime.fp16.loss_scaler"
_LAYOUT, _CONVERT = "autoshard.checkpoint.deepspeed_layout", "autoshard.convert.deepspeed"  # users

DEEPSPEED: tuple[Private, ...] = (
    Private(
        _ZERO_TO_FP32,
        "get_fp32_state_dict_from_zero_checkpoint",
        "autoshard.consolidate",
        "called: full fp32 weights of any ZeRO stage, DeepSpeed's own reconstruction (run under weights_only_loads:"
        " it unpickles with weights_only=False)",
    ),
    Private(
        _ZERO_TO_FP32,
        "_get_fp32_state_dict_from_zero3_checkpoint",
        _CONVERT,
        "mirrored by read_deepspeed: the flat fp32 groups cut by param_shapes, in order (tests compare the weights)",
    ),
    Private(_ZERO_TO_FP32, "zero3_partitioned_param_info", _LAYOUT, "mirrored by partition_numel (tests compare the two)"),
    Private(f"{_ENGINE}.DeepSpeedEngine", "_get_ckpt_name", _LAYOUT, "mirrored by model_states_name and the file patterns (tests compare the names)"),
    Private(
        f"{_ENGINE}.DeepSpeedEngine", "_get_rank_zero_ckpt_name", _LAYOUT, "mirrored by optim_states_name: bf16_ under bf16 (tests compare the names)"
    ),
    Private(
        f"{_ENGINE}.DeepSpeedEngine",
        "_common_checkpoint_state",
        _LAYOUT,
        "mirrored by ENGINE_KEYS: the engine's keys in model_states (tests read its source)",
    ),
    Private(
        f"{_ENGINE}.DeepSpeedEngine", "_save_checkpoint", _LAYOUT, "mirrored by ENGINE_KEYS: the keys it adds to that state before the client state"
    ),
    Private(
        f"{_ENGINE}.DeepSpeedEngine",
        "_get_all_zero_checkpoint_names",
        _LAYOUT,
        "mirrored by zero3_world_size: the engine loads one optimizer file per rank of the resuming run, so autoshard"
        " refuses a checkpoint written for another world size before it reads one",
    ),
    Private(
        f"{_ENGINE}.DeepSpeedEngine",
        "_copy_recovery_script",
        _CONVERT,
        "mirrored: the recovery script (RECOVERY_SCRIPT) is copied beside every checkpoint convert writes",
    ),
    Private(
        f"{_ENGINE}.DeepSpeedEngine",
        "use_node_local_storage",
        "autoshard.lightning.deepspeed",
        "called: per-node checkpoint directories are left to Lightning's own save (the publish protocol needs one directory)",
    ),
    Private(
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
        "_create_fp16_sub_groups",
        _LAYOUT,
        "mirrored by sub_groups: consecutive parameters until their partitions reach sub_group_size (tests compare)",
    ),
    Private(_SCALER, "LossScaler", _CONVERT, "built: the static loss scale of the optimizer files convert writes; unpickled (PICKLED_TYPES)"),
    Private(_SCALER, "DynamicLossScaler", _LAYOUT, "unpickled: an fp16 run's optimizer files (PICKLED_TYPES)"),
    Private(
        "deepspeed.runtime.zero.config",
        "ZeroStageEnum",
        _CONVERT,
        "built: zero_stage of the optimizer files convert writes; unpickled (PICKLED_TYPES)",
    ),
    Private(
        "deepspeed.utils.tensor_fragment", "fragment_address", _LAYOUT, "unpickled: ZeRO-1/2 optimizer files' param_slice_mappings (PICKLED_TYPES)"
    ),
    Private(
        "deepspeed.runtime.zero.partition_parameters",
        "InsertPostInitMethodToModuleSubClasses",
        "autoshard.engine.deepspeed",
        "read: its linear_bk, torch's own functional.linear, which zero.Init saves before replacing it for the process"
        " (restore_functional_linear puts it back)",
    ),
)
