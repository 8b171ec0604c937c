"""Intent -> a complete DeepSpeed ZeRO-3 config dict, and a validator that refuses contradictory configs by key.

Pure data: importing this module imports no deepspeed, so configs can be generated, printed and checked on any
machine; ``check_zero_overrides`` reads DeepSpeed's own ZeRO config model where DeepSpeed is installed.
"""

from __future__ import annotations

import copy
import difflib
import enum
import typing
from collections.abc import Mapping
from typing import Any

from autoshard.backends import Availability, on_backend
from autoshard.backends.deepspeed import BACKEND as DEEPSPEED_BACKEND
from autoshard.backends.deepspeed import MAX_REUSE_DISTANCE, PERSISTENCE_THRESHOLD, REDUCE_BUCKET_SIZE
from autoshard.errors import IntentError
from autoshard.intent import ShardingIntent
from autoshard.mesh import ParallelDims
from autoshard.needs import MethodNeeds
from autoshard.precision import Dtype, PrecisionPlan, resolve_precision
from autoshard.select import select_backend

# ZeRO-3 knobs, in elements. DeepSpeed's own defaults for the stage-3 ones; Lightning's 2e8 for the reduce bucket
# (DeepSpeed's 5e8 doubles the transient memory for little gain); no allgather_bucket_size, which ZeRO-3 never reads.
# Parameters below the persistence threshold stay whole on every rank: partitioning tiny tensors (biases, norms) costs
# more in latency than it saves.
ZERO3_DEFAULTS: dict[str, Any] = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": REDUCE_BUCKET_SIZE,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
    "sub_group_size": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": False,
}
# Lightning's DeepSpeedStrategy fp16 defaults (loss_scale=0 means dynamic scaling), so both paths agree.
FP16_DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
AIO_DEFAULTS: dict[str, Any] = {
    "block_size": 1_048_576,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "thread_count": 1,
}
# MiCS's keys (DeepSpeed <= 0.19.6, runtime/zero/mics.py): refused, see validate_deepspeed_config.
_MICS_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather")
_COMM_DTYPE = {Dtype.FLOAT32: "fp32", Dtype.BFLOAT16: "bf16", Dtype.FLOAT16: "fp16"}
_OFFLOAD_DEVICES = ("cpu", "nvme", "none")
# A pure config generator must not depend on what this machine has installed: the strategy checks that.
_ASSUME_INSTALLED = Availability(True, "not checked when generating a config")


def precision_config(precision: PrecisionPlan) -> dict[str, Any]:
    """DeepSpeed's keys for the run's precision: the bf16 / fp16 block (32-true gets neither) and the reduce dtype.

    ``communication_data_type`` is always written: DeepSpeed's own default reduces in the low dtype, so without it
    bf16-mixed would reduce in bf16 here and in fp32 under FSDP2 (see ``autoshard.backends.on_backend``).
    """
    run = on_backend(precision, DEEPSPEED_BACKEND.name)  # refuses a param_dtype ZeRO-3 cannot gather in
    block: dict[str, Any] = {}
    if run.compute is Dtype.BFLOAT16:
        block["bf16"] = {"enabled": True}
    elif run.compute is Dtype.FLOAT16:
        block["fp16"] = dict(FP16_DEFAULTS)
    block["communication_data_type"] = _COMM_DTYPE[run.reduce]
    return block


def zero_config(intent: ShardingIntent, zero_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``zero_optimization`` block for the intent; ``zero_overrides`` replaces single keys."""
    zero: dict[str, Any] = copy.deepcopy(ZERO3_DEFAULTS)
    if intent.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = _offload_block("optimizer", intent)
    if intent.offload == "params":  # like Lightning's deepspeed_stage_3_offload: parameters and optimizer state
        zero["offload_param"] = _offload_block("params", intent)
    if intent.checkpoint == "full":
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if zero_overrides:
        zero.update(copy.deepcopy(dict(zero_overrides)))
    return zero


def _offload_block(kind: str, intent: ShardingIntent) -> dict[str, Any]:
    block: dict[str, Any] = {"device": intent.offload_device, "pin_memory": False}
    if intent.offload_device == "nvme":
        block["nvme_path"] = intent.nvme_path
        if kind == "optimizer":
            block["buffer_count"] = 4  # Adam keeps 4 tensors per parameter (param, grad, two moments)
        else:
            block.update({"buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000})
    return block


def check_intent(
    intent: ShardingIntent, needs: MethodNeeds | None = None, world_size: int | None = None, precision: PrecisionPlan | None = None
) -> None:
    """Refuse what ZeRO-3 cannot do (tensor parallel, several optimizers, EMA, ...) with the matrix's texts."""
    # Raises IncompatibleBackendError naming the feature, the backend that works (fsdp2) and the fix.
    select_backend(
        needs or MethodNeeds(),
        intent,
        prefer=DEEPSPEED_BACKEND.name,
        available={name: _ASSUME_INSTALLED for name in ("fsdp2", DEEPSPEED_BACKEND.name, "fsdp1")},
        precision=precision,
    )
    if world_size is not None:
        ParallelDims.resolve(intent, world_size)  # data_parallel_size must equal the world size: ZeRO-3 is data parallel only


def provisional_config(intent: ShardingIntent, *, micro_batch_size: int | None, zero_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a strategy holds before the Trainer exists: the ZeRO-3 block (Lightning reads the stage and offload
    early) and the micro batch. Precision and the batch arithmetic are not known yet: ``deepspeed_config`` replaces
    it once they are. Intent-only refusals (tensor parallel, bad overrides) happen here, at construction."""
    micro = 1 if micro_batch_size is None else micro_batch_size
    _positive(micro_batch_size=micro)
    check_intent(intent)
    config = {"zero_optimization": zero_config(intent, zero_overrides), "train_micro_batch_size_per_gpu": micro}
    check_overridden_stage(zero_overrides or {})
    validate_deepspeed_config(config)  # autoshard's own words first (MiCS, bucket sizes), then DeepSpeed's model
    check_zero_overrides(zero_overrides or {}, config["zero_optimization"])
    return config


def check_overridden_stage(zero_overrides: Mapping[str, Any]) -> None:
    """``zero_overrides={'stage': '3'}`` (YAML's string) or ``2``: refused as the override it is."""
    stage = zero_overrides.get("stage", 3)
    if type(stage) is not int or stage != 3:
        other = "for stages 1-2 use Lightning's strategy='deepspeed_stage_2'" if stage in (0, 1, 2) else "it is always 3"
        raise IntentError(
            f"zero_overrides['stage']={stage!r}: autoshard's DeepSpeed strategies run ZeRO stage 3 only, the integer 3."
            f" Fix: drop 'stage' from zero_overrides ({other})"
        )


def check_zero_overrides(zero_overrides: Mapping[str, Any], zero: Mapping[str, Any]) -> None:
    """``zero_overrides`` (merged into ``zero``, the ``zero_optimization`` block) against DeepSpeed's own ZeRO config
    model, its refusal reworded with the key, the value, what is expected and a Fix: a misspelt key or a value of the
    wrong type otherwise reached ``deepspeed.initialize`` as pydantic's raw ValidationError, after every process had
    started. Without DeepSpeed installed only autoshard's own checks run (the strategy's install check says the rest)."""
    if not zero_overrides:  # autoshard's own block: DeepSpeed's model is not imported for it
        return
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError
    except ImportError:
        return
    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as err:
        raise IntentError(_reworded(err.errors()[0], DeepSpeedZeroConfig)) from None


def _field_model(model: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    """The pydantic model holding the last key of ``path`` (DeepSpeed's nested offload blocks), and that key's field
    (None where the key is unknown)."""
    for key in path[:-1]:
        field = _field(model, key)
        inner = [a for a in typing.get_args(field.annotation) if hasattr(a, "model_fields")] if field else []
        model = inner[0] if inner else getattr(field, "annotation", model)
    return model, _field(model, path[-1])


def _field(model: Any, key: Any) -> Any:
    return next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)


def _expected(annotation: Any) -> str:
    """A field's type in words: ``int`` -> 'a whole number' (``Optional[int]`` too: None is never what was meant)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and len(args) < len(typing.get_args(annotation)):
        return _expected(args[0])
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in annotation)
    words = {bool: "True or False", int: "a whole number", float: "a number", str: "a string"}
    if annotation in words:
        return words[annotation]
    return "a dict of its keys" if hasattr(annotation, "model_fields") else str(annotation)


def _reworded(error: Mapping[str, Any], root: Any) -> str:
    """One pydantic error of DeepSpeed's ZeRO config model as autoshard says a refusal."""
    path = tuple(error["loc"])
    if not path:  # a check of the whole block (a model validator): no key to name
        return (
            f"zero_overrides={error['input']!r}: DeepSpeed's ZeRO config refuses the block they make ({error['msg']}), so"
            f" deepspeed.initialize would refuse it once every process had started. Fix: drop the keys that message names"
        )
    where = "".join(f"[{key!r}]" for key in path)
    model, field = _field_model(root, path)
    if error["type"] == "extra_forbidden":
        known = [f.alias or n for n, f in model.model_fields.items() if not (f.json_schema_extra or {}).get("deprecated")]  # type: ignore[union-attr]
        close = difflib.get_close_matches(str(path[-1]), known, n=1, cutoff=0.6)
        block = f" in its '{'.'.join(map(str, path[:-1]))}' block" if len(path) > 1 else ""
        fix = (
            f"spell it '{close[0]}': zero_overrides{''.join(f'[{k!r}]' for k in path[:-1])}[{close[0]!r}]={error['input']!r}" if close else "drop it"
        )
        return (
            f"zero_overrides{where}={error['input']!r}: DeepSpeed's ZeRO config has no key {str(path[-1])!r}{block}, so"
            f" deepspeed.initialize would refuse it once every process had started. Fix: {fix}"
        )
    expected = _expected(field.annotation) if field is not None else "another value"
    default = ZERO3_DEFAULTS.get(str(path[-1]), getattr(field, "default", None)) if len(path) == 1 else getattr(field, "default", None)
    if isinstance(default, (bool, float)) or (isinstance(default, int) and default < 10**15):  # not an enum's
        example = f"{default:_}" if isinstance(default, int) and not isinstance(default, bool) else repr(default)
        fix = f"zero_overrides{where}={example} ({expected}; the default, which dropping the key gives too)"
    else:
        fix = f"{expected} in zero_overrides{where}, or drop the key"
    return (
        f"zero_overrides{where}={error['input']!r}: DeepSpeed's ZeRO config expects {expected} there ({error['msg']}),"
        f" so deepspeed.initialize would refuse it once every process had started. Fix: {fix}"
    )


def _positive(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise IntentError(f"{name} must be a positive integer, got {value!r}. Fix: {name}=1 or more")


def deepspeed_config(
    intent: ShardingIntent,
    needs: MethodNeeds | None = None,
    *,
    precision: PrecisionPlan | None = None,
    world_size: int,
    micro_batch_size: int,
    accumulate_grad_batches: int = 1,
    gradient_clip_val: float | None = None,
    zero_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The complete ZeRO-3 config for ``intent`` on ``world_size`` ranks, validated; ``zero_overrides`` replaces
    individual ``zero_optimization`` keys for tuning; ``precision=None`` plans for the intent's precision."""
    _positive(world_size=world_size, micro_batch_size=micro_batch_size, accumulate_grad_batches=accumulate_grad_batches)
    precision = precision or resolve_precision(None, intent)
    check_intent(intent, needs, world_size, precision)

    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * accumulate_grad_batches * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulate_grad_batches,
        "zero_optimization": zero_config(intent, zero_overrides),
        # Lightning passes the user's torch optimizer: DeepSpeed calls every non-DeepSpeed optimizer "untested".
        "zero_allow_untested_optimizer": True,
        **precision_config(precision),
        "steps_per_print": 1_000_000,  # DeepSpeed's own progress print would interleave with Lightning's logs
        "wall_clock_breakdown": False,
    }
    if intent.offload != "none":
        # Any optimizer works with offload (slower than DeepSpeedCPUAdam); DeepSpeed refuses others by default.
        config["zero_force_ds_cpu_optimizer"] = False
    if intent.offload_device == "nvme":
        config["aio"] = dict(AIO_DEFAULTS)
    # No "activation_checkpointing" block: it configures deepspeed.checkpointing for blocks that call it themselves;
    # autoshard checkpoints the blocks with torch's checkpoint (adapters.checkpointing), as under fsdp2.
    # Always written: DeepSpeed (0.19) clips at norm 1.0 when the key is absent, silently, unlike the Trainer.
    config["gradient_clipping"] = float(gradient_clip_val or 0.0)
    validate_deepspeed_config(config, world_size=world_size)
    return config


def _refuse(key: str, problem: str, fix: str) -> None:
    raise IntentError(f"DeepSpeed config key '{key}': {problem}. Fix: {fix}")


def _positive_int(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _refuse(key, f"must be a positive integer, got {value!r}", f"set '{key}' to an integer >= 1, or remove it")
    return value


def validate_deepspeed_config(config: Mapping[str, Any], *, world_size: int | None = None) -> None:
    """Refuse contradictions DeepSpeed would report late (or not at all), naming the key and the fix."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, Mapping):
        _refuse("zero_optimization", "missing", "add {'stage': 3}, or build the config with deepspeed_config(intent, ...)")
    stage = zero.get("stage")
    if stage != 3:
        _refuse(
            "zero_optimization.stage",
            f"is {stage!r} but autoshard's DeepSpeed backend is ZeRO-3 (parameters partitioned)",
            "set zero_optimization.stage=3, or use Lightning's strategy='deepspeed_stage_2' for stages 1-2",
        )
    _check_precision(config)
    _check_batch_sizes(config, world_size)
    _check_zero_keys(zero)
    clip = config.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        _refuse(
            "gradient_clipping",
            f"must be a non-negative max norm, got {clip!r}",
            "set Trainer(gradient_clip_val=1.0) or remove it (0 disables clipping)",
        )
    comm = config.get("communication_data_type")
    if comm is not None and comm not in _COMM_DTYPE.values():
        _refuse("communication_data_type", f"is {comm!r}", f"choose one of {', '.join(map(repr, _COMM_DTYPE.values()))}")


def _check_precision(config: Mapping[str, Any]) -> None:
    """One half precision at most, and a valid fp16 loss scale."""
    enabled = [key for key in ("bf16", "fp16") if isinstance(config.get(key), Mapping) and config[key].get("enabled", False)]
    if len(enabled) > 1:
        _refuse(
            "bf16.enabled / fp16.enabled", "both are true; DeepSpeed trains in one half precision", "keep one: set the other's 'enabled' to false"
        )
    fp16 = config.get("fp16")
    if isinstance(fp16, Mapping) and fp16.get("enabled", False):
        scale = fp16.get("loss_scale", 0)
        if not isinstance(scale, (int, float)) or scale < 0:
            _refuse("fp16.loss_scale", f"is {scale!r}", "use 0 for dynamic loss scaling (recommended) or a positive static scale")


def _check_batch_sizes(config: Mapping[str, Any], world_size: int | None) -> None:
    """The micro-batch, the accumulation and the global batch agree (with the world size, when known)."""
    micro = _positive_int(config, "train_micro_batch_size_per_gpu")
    accumulate = _positive_int(config, "gradient_accumulation_steps")
    total = _positive_int(config, "train_batch_size")
    if micro is None and total is None:
        _refuse(
            "train_micro_batch_size_per_gpu",
            "missing (and so is train_batch_size)",
            "set train_micro_batch_size_per_gpu to the DataLoader batch size",
        )
    if micro is not None and accumulate is not None and total is not None:
        per_step = micro * accumulate
        if total % per_step != 0 or (world_size is not None and total != per_step * world_size):
            expected = (
                f"{micro} * {accumulate} * {world_size} = {per_step * world_size}"
                if world_size
                else f"a multiple of {micro} * {accumulate} = {per_step}"
            )
            _refuse(
                "train_batch_size",
                f"is {total} but train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size must equal it ({expected})",
                "set train_batch_size to that product, or remove it and let DeepSpeed derive it",
            )


def _check_zero_keys(zero: Mapping[str, Any]) -> None:
    """No MiCS, offload blocks DeepSpeed can run, non-negative bucket sizes."""
    for key in _MICS_KEYS:
        if key in zero:
            # DeepSpeed >= 0.19.7 refuses MiCS only inside deepspeed.initialize, after every process started.
            _refuse(
                f"zero_optimization.{key}",
                "is MiCS, which DeepSpeed removed in 0.19.7 and autoshard does not drive (its estimate, checkpoints and"
                " consolidation assume ZeRO-3 partitions over every rank)",
                "remove it; for hybrid sharding use ShardingIntent(shard_size=N) with strategy='fsdp2'",
            )
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            _refuse(f"zero_optimization.{key}", f"must be a dict such as {{'device': 'cpu'}}, got {block!r}", "set it to {'device': 'cpu'}")
        device = block.get("device", "none")
        if device not in _OFFLOAD_DEVICES:
            _refuse(f"zero_optimization.{key}.device", f"is {device!r}", f"choose one of {', '.join(map(repr, _OFFLOAD_DEVICES))}")
        if device == "nvme" and not block.get("nvme_path"):
            _refuse(
                f"zero_optimization.{key}.nvme_path",
                "missing while the offload device is 'nvme'",
                "set ShardingIntent(nvme_path='/local_nvme/...') (a directory on a local NVMe drive), or offload_device='cpu'",
            )
    for key in (
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
    ):
        value = zero.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            _refuse(
                f"zero_optimization.{key}",
                f"must be a non-negative number of elements, got {value!r}",
                f"remove it to use the default ({ZERO3_DEFAULTS[key]:,})",
            )
