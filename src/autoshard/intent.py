"""ShardingIntent: one backend-neutral description of the sharding a user wants."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoshard.errors import IntentError, did_you_mean

PRECISIONS: tuple[str, ...] = ("bf16-mixed", "32-true", "bf16-true", "16-mixed", "16-true")
DEFAULT_PRECISION = "bf16-mixed"
# Lightning's short spellings, so a YAML written for Lightning reads the same here.
_PRECISION_ALIASES: dict[str, str] = {"bf16": "bf16-mixed", "32": "32-true", "16": "16-mixed"}
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params")
OFFLOAD_DEVICES: tuple[str, ...] = ("cpu", "nvme")
CHECKPOINTS: tuple[str, ...] = ("distributed", "full")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def normalize_precision(value: object) -> str:
    """Accept Lightning's spellings (16, "bf16", "32-true") and return the canonical one."""
    text = str(value).strip().lower()
    text = _PRECISION_ALIASES.get(text, text)
    if text not in PRECISIONS:
        raise IntentError(
            f"unknown precision {value!r}{did_you_mean(text, PRECISIONS)}: choose one of {', '.join(PRECISIONS)}"
            f" (Lightning's short forms 'bf16', '16' and '32' work too; bf16-mixed is recommended for sharded training)"
        )
    return text


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        hint = did_you_mean(value, choices)
        if name == "offload" and value in OFFLOAD_DEVICES:  # offload='cpu' is the usual mix-up of the two fields
            hint = f" (offload says what to move: 'optimizer' or 'params'; offload_device={value!r} says where)"
        raise IntentError(f"unknown {name} {value!r}{hint}: choose one of {', '.join(map(repr, choices))}")
    return str(value)


def _names(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise IntentError(f"{name} must be a list of module paths such as ['backbone'], got {value!r}") from None
    for item in names:
        if not isinstance(item, str) or not item or item.startswith(".") or item.endswith("."):
            raise IntentError(f"{name} holds {item!r}: each entry must be a dotted module path such as 'backbone.blocks'")
    return names


def _size(name: str, value: object) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IntentError(f"{name} must be a positive integer or 'auto', got {value!r}")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ShardingIntent:
    """What to shard and how, independent of FSDP2 or DeepSpeed; adapters translate it.

    ``precision=None`` means "not stated": the Trainer's precision under Lightning, bf16-mixed elsewhere.
    ``shard=None`` means every trainable child subtree (plus EMA teachers); ``exclude`` removes paths.
    ``strict=True`` turns autoshard's fallbacks (replicating what it cannot shard) into errors.
    """

    shard: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    precision: str | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    offload: str = "none"
    offload_device: str = "cpu"
    nvme_path: str | None = None
    activation_checkpointing: bool = False
    checkpoint: str = "distributed"
    data_parallel_size: int | None = None
    tensor_parallel_size: int = 1
    strict: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.shard is not None:
            set_(self, "shard", _names("shard", self.shard))
            if not self.shard:
                raise IntentError("shard=[] would shard nothing: leave shard unset to shard every trainable subtree")
        set_(self, "exclude", _names("exclude", self.exclude))
        both = sorted(set(self.shard or ()) & set(self.exclude))
        if both:
            raise IntentError(f"{', '.join(both)} is both in shard and in exclude: keep it in one of them")
        if self.precision is not None:
            set_(self, "precision", normalize_precision(self.precision))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, _choice(name, str(value).replace("torch.", ""), DTYPES))
        for name in ("reshard_after_forward", "activation_checkpointing", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise IntentError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _choice("offload", self.offload, OFFLOADS)
        _choice("offload_device", self.offload_device, OFFLOAD_DEVICES)
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)):
                raise IntentError(f"nvme_path must be a directory path, got {self.nvme_path!r}")
            set_(self, "nvme_path", os.fspath(self.nvme_path))
        if self.offload_device == "nvme" and self.offload == "none":
            raise IntentError("offload_device='nvme' needs offload='optimizer' or offload='params'")
        if self.offload_device == "nvme" and not self.nvme_path:
            raise IntentError("offload_device='nvme' needs nvme_path, a directory on a local NVMe drive")
        _choice("checkpoint", self.checkpoint, CHECKPOINTS)
        set_(self, "data_parallel_size", _size("data_parallel_size", self.data_parallel_size))
        tp = _size("tensor_parallel_size", self.tensor_parallel_size)
        set_(self, "tensor_parallel_size", 1 if tp is None else tp)

    @property
    def effective_precision(self) -> str:
        """The precision to plan for when nobody stated one."""
        return self.precision or DEFAULT_PRECISION

    def mesh_sizes(self, world_size: int) -> tuple[int, int]:
        """(data_parallel, tensor_parallel) for this world; pure FSDP (dp = world, tp = 1) by default."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise IntentError(f"world size must be a positive integer, got {world_size!r}")
        tp = self.tensor_parallel_size
        dp = self.data_parallel_size if self.data_parallel_size is not None else world_size // tp
        if dp * tp == world_size:
            return dp, tp
        world = f"the world size {world_size} (nodes x devices)"
        if world_size % tp:
            raise IntentError(
                f"tensor_parallel_size={tp} does not divide {world}: choose one of"
                f" {', '.join(map(str, _divisors(world_size)))}"
            )
        raise IntentError(
            f"data_parallel_size * tensor_parallel_size = {dp} * {tp} = {dp * tp} does not match {world}: set"
            f" data_parallel_size={world_size // tp}, or leave it unset to use every rank"
        )

    def replace(self, **changes: Any) -> ShardingIntent:
        """A copy with some fields changed, validated like a new intent."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ShardingIntent:
        """Build from a plain mapping (YAML / LightningCLI); unknown keys are refused by name."""
        if data is not None and not isinstance(data, Mapping):
            raise IntentError(f"a ShardingIntent is read from a mapping of its fields, got {type(data).__name__}")
        data = dict(data or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known), key=str)
        if unknown:
            hints = "".join(f" {key!r}{did_you_mean(key, known)}" for key in unknown)
            raise IntentError(f"unknown ShardingIntent field(s):{hints}. Valid fields are {', '.join(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so the result round-trips through YAML and ``from_dict``."""
        out = dataclasses.asdict(self)
        for key in ("shard", "exclude"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out


def with_trainer_precision(intent: ShardingIntent, trainer_precision: object) -> ShardingIntent:
    """The Trainer's precision is the one that runs; an intent may repeat it but not contradict it."""
    precision = normalize_precision(trainer_precision)
    if intent.precision is not None and intent.precision != precision:
        raise IntentError(
            f"precision is given twice and differs: ShardingIntent(precision='{intent.precision}') but"
            f" Trainer(precision='{precision}'). Fix: set it once, in the Trainer"
            f" (Trainer(precision='{intent.precision}')), and drop it from the intent"
        )
    return intent.replace(precision=precision)


def as_intent(value: ShardingIntent | Mapping[str, Any] | None) -> ShardingIntent:
    """Accept an intent, a dict of its fields, or nothing (all defaults)."""
    if isinstance(value, ShardingIntent):
        return value
    if value is None or isinstance(value, Mapping):
        return ShardingIntent.from_dict(value)
    raise IntentError(f"expected a ShardingIntent or a dict of its fields, got {type(value).__name__}")


__all__ = ["ShardingIntent", "as_intent", "normalize_precision", "PRECISIONS", "DEFAULT_PRECISION"]
