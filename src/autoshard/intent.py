"""ShardingIntent: one backend-neutral description of the sharding a user wants."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from autoshard.errors import IntentError, closest, did_you_mean
from autoshard.precision import Dtype, normalize_precision
from autoshard.units import parse_size

OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params")
OFFLOAD_DEVICES: tuple[str, ...] = ("cpu", "nvme")
CHECKPOINTS: tuple[str, ...] = ("distributed", "full")
DTYPES: tuple[str, ...] = tuple(d.value for d in Dtype)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        hint, fix = did_you_mean(value, choices), f"{name}={closest(value, choices) or choices[0]!r}"
        if name == "offload" and value in OFFLOAD_DEVICES:  # offload='cpu' is the usual mix-up of the two fields
            hint = f" (offload says what to move: 'optimizer' or 'params'; offload_device={value!r} says where)"
            fix = f"offload='params', offload_device={value!r}"
        raise IntentError(f"unknown {name} {value!r}{hint}: choose one of {', '.join(map(repr, choices))}. Fix: {fix}")
    return str(value)


def _names(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise IntentError(f"{name} must be a list of module paths, got {value!r}. Fix: {name}=['backbone'] (dotted paths of modules)") from None
    for item in names:
        if not isinstance(item, str) or not item or item.startswith(".") or item.endswith("."):
            raise IntentError(
                f"{name} holds {item!r}: each entry must be a dotted module path."
                f" Fix: write it as a path such as 'backbone.blocks' (no leading or trailing dot)"
            )
    return names


def _blocks(value: object) -> tuple[str, ...] | None:
    """Block class names (``'GPT2Block'``) or module paths; None: found by the plan; (): none, a unit per subtree."""
    if value is None:
        return None
    try:
        return _names("blocks", value)
    except IntentError:
        raise IntentError(
            f"blocks must list module class names or module paths, got {value!r}. Fix: blocks=['GPT2Block'] (a class"
            f" as `print(model)` shows it) or blocks=['model.transformer.h.0', ...] (module paths)"
        ) from None


def _init_from(value: object) -> str | tuple[tuple[str, str], ...] | None:
    """A path (the whole module) or {module path: path}; checked for shape here, opened at setup."""
    if value is None:
        return None
    fix = "Fix: init_from='weights.safetensors' (the whole LightningModule) or init_from={'model': 'hf-model-dir/'}"
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not path:
            raise IntentError(f"init_from='' names no file. {fix}")
        return str(path)
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((k, v) for k, v in items)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise IntentError(f"init_from must be a path or a mapping of module path to path, got {value!r}. {fix}") from None
    if not pairs:
        raise IntentError("init_from={} loads nothing. Fix: leave init_from unset, or map a module path to a weights path")
    out = []
    for module, path in pairs:
        if not isinstance(module, str) or module.startswith(".") or module.endswith("."):
            raise IntentError(f"init_from key {module!r} must be a dotted module path ('' for the whole module). {fix}")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise IntentError(f"init_from[{module!r}] must be a path, got {path!r}. {fix}")
        out.append((module, str(os.fspath(path))))
    modules = [m for m, _ in out]
    nested = sorted({a for a in modules for b in modules if a != b and (not b or a.startswith(b + "."))})
    if len(set(modules)) != len(modules) or nested:
        raise IntentError(
            f"init_from maps {', '.join(map(repr, nested or modules))} inside another mapped module: each tensor must come from one file. Fix: map disjoint submodules"
        )
    return tuple(out)


SELECTIVE = "selective"  # activation_checkpointing: op-level selective checkpointing (torchtitan's policy)
_AC_WORDS = {"full": True, "all": True, "yes": True, "on": True, "none": False, "no": False, "off": False, "op": SELECTIVE}


def _activation_checkpointing(value: object) -> bool | int | str:
    """False, True (every block), k >= 2 (every k-th block; k = 1 is True, one spelling per setting) or 'selective'
    (op-level). Why more than on/off: a memory budget needs steps between nothing recomputed and everything."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 1:
        return True if value == 1 else value
    if isinstance(value, str) and value.strip().lower() == SELECTIVE:
        return SELECTIVE
    word = str(value).strip().lower()
    if word in _AC_WORDS:
        fix = f"activation_checkpointing={_AC_WORDS[word]!r}"
    elif isinstance(value, int) and not isinstance(value, bool):  # k < 1: no block would be checkpointed
        fix = "activation_checkpointing=False (no checkpointing), or a k >= 1 (1: every block, 2: every second block)"
    elif word.isdigit() and int(word) >= 1:
        fix = f"activation_checkpointing={int(word)} (a number, not a string)"
    elif closest(word, (SELECTIVE,)):
        fix = f"activation_checkpointing={SELECTIVE!r}"
    else:
        fix = "activation_checkpointing=True (every block), 2 (every second block) or 'selective' (op-level)"
    raise IntentError(
        f"activation_checkpointing must be True (every block), False, 'selective' (op-level: recompute cheap ops, keep"
        f" matmul and attention outputs) or a whole number k >= 1 (every k-th block), got {value!r}. Fix: {fix}"
    )


COMPILE_AUTO = "auto"  # compile: memory_budget may choose it (it costs start-up time); off without a budget
_COMPILE_WORDS = {"true": True, "yes": True, "on": True, "blocks": True, "false": False, "no": False, "off": False, "none": False}


def _compile(value: object) -> bool | str:
    """False (eager), True (each planned block compiled in place before fully_shard) or 'auto' (the budget decides)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() == COMPILE_AUTO:
        return COMPILE_AUTO
    word = str(value).strip().lower()
    fix = f"compile={_COMPILE_WORDS[word]!r}" if word in _COMPILE_WORDS else "compile=True (each block compiled), False or 'auto'"
    raise IntentError(
        f"compile must be True (torch.compile each planned block, in place, before fully_shard), False (eager) or"
        f" 'auto' (memory_budget decides), got {value!r}. Fix: {fix}"
    )


def _memory_budget(value: object) -> int | None:
    """Device bytes per rank: an int (numpy's, or a whole float such as YAML's 8.0e+10), or a size string read by
    ``autoshard.units.parse_size`` ('70GiB', '80GB'); ``parse_size`` refuses any other type, saying what is wanted."""
    if value is None:
        return None
    return parse_size(value, option="memory_budget", example="70GiB", error=IntentError)  # type: ignore[arg-type]


def _memory_headroom(value: object, budget: int | None) -> int | None:
    """Device bytes the budget keeps free: a size as for memory_budget, or 0 (the simulated peak may fill the budget)."""
    if value is None:
        return None
    if budget is None:
        raise IntentError(
            f"memory_headroom={value!r} without memory_budget keeps nothing free. Fix: add memory_budget='70GiB', or drop memory_headroom"
        )
    # As memory_budget reads sizes (a whole float such as YAML's 2.0e+9 too), and any zero ('0GiB', 0.0) is 0.
    headroom = parse_size(value, option="memory_headroom", example="2GiB", error=IntentError, minimum=0)  # type: ignore[arg-type]
    if headroom >= budget:
        raise IntentError(
            f"memory_headroom={value!r} leaves nothing of memory_budget for the run. Fix: a headroom below the budget, e.g. memory_headroom='2GiB'"
        )
    return headroom


BUDGET_FIELDS: tuple[str, ...] = ("reshard_after_forward", "activation_checkpointing", "offload", "shard_size")


def _pinned(value: object, budget: int | None) -> tuple[str, ...]:
    """Fields memory_budget must leave as they are even at their defaults (a field the user changed is kept anyway)."""
    names = _names("pinned", value) if value else ()
    unknown = [n for n in names if n not in BUDGET_FIELDS]
    if unknown:
        hint = "".join(f" {n!r}{did_you_mean(n, BUDGET_FIELDS)}" for n in unknown)
        raise IntentError(
            f"pinned names field(s) memory_budget does not choose:{hint}. It chooses {', '.join(BUDGET_FIELDS)}."
            f" Fix: pinned=('offload',) (keep offload='none' even when offloading would be cheapest), or drop the others"
        )
    if names and budget is None:
        raise IntentError(
            f"pinned={names!r} without memory_budget pins nothing: without a budget no field is chosen for you."
            f" Fix: add memory_budget='70GiB', or drop pinned"
        )
    return tuple(dict.fromkeys(names))


def _size(name: str, value: object) -> int | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IntentError(f"{name} must be a positive integer or 'auto', got {value!r}. Fix: {name}='auto' (or a whole number >= 1)")
    return value


def _shard_size(value: object) -> int | str | None:
    """None (every data-parallel rank), a positive int, or "node"; checked against the world in ``mesh.ParallelDims.resolve``."""
    if value is None or value == "node":
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IntentError(
            f"shard_size must be a positive integer or 'node', got {value!r}. Fix: shard_size=8 (ranks per shard"
            f" group), shard_size='node' (the devices of one node), or leave it unset to shard over every rank"
        )
    return value


@dataclass(frozen=True)
class ShardingIntent:
    """What to shard and how, independent of FSDP2 or DeepSpeed; adapters translate it (docs/guide.md).

    ``precision=None``: not stated (the Trainer's precision under Lightning, bf16-mixed elsewhere); ``param_dtype`` /
    ``reduce_dtype`` replace the all-gather / gradient-reduce dtypes it implies. ``shard=None``: every trainable child
    subtree (plus EMA teachers). ``blocks=[]``: one unit per subtree. ``shard_size``: hybrid sharding within groups of
    that many data-parallel ranks (``'node'``: one node's). ``strict=True`` turns fallbacks into errors. ``init_from``
    (a path, or ``{module path: path}`` stored as pairs so the intent stays immutable) is opened at setup, on the
    machines that train; ``Trainer.fit(ckpt_path=...)`` is restored after it and wins. ``memory_budget`` chooses the
    fields left at their defaults among BUDGET_FIELDS (and ``compile='auto'``), keeping ``memory_headroom`` free;
    ``pinned`` keeps some at their defaults.
    """

    shard: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    blocks: tuple[str, ...] | None = None
    precision: str | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    offload: str = "none"
    offload_device: str = "cpu"
    nvme_path: str | None = None
    activation_checkpointing: bool | int | str = False
    checkpoint: str = "distributed"
    data_parallel_size: int | None = None
    tensor_parallel_size: int = 1
    shard_size: int | str | None = None
    strict: bool = False
    init_from: str | Mapping[str, str] | tuple[tuple[str, str], ...] | None = None
    memory_budget: int | float | str | None = None  # float: YAML writes 8.0e+10; a whole number of bytes
    memory_headroom: int | float | str | None = None
    pinned: tuple[str, ...] = ()
    compile: bool | str = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "init_from", _init_from(self.init_from))
        if self.shard is not None:
            set_(self, "shard", _names("shard", self.shard))
            if not self.shard:
                raise IntentError("shard=[] would shard nothing. Fix: leave shard unset to shard every trainable subtree")
        set_(self, "exclude", _names("exclude", self.exclude))
        set_(self, "blocks", _blocks(self.blocks))
        both = sorted(set(self.shard or ()) & set(self.exclude))
        if both:
            raise IntentError(f"{', '.join(both)} is both in shard and in exclude. Fix: keep it in one of them")
        if self.precision is not None:
            set_(self, "precision", normalize_precision(self.precision).value)
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, _choice(name, str(value).replace("torch.", ""), DTYPES))
        set_(self, "activation_checkpointing", _activation_checkpointing(self.activation_checkpointing))
        set_(self, "memory_budget", _memory_budget(self.memory_budget))
        set_(self, "memory_headroom", _memory_headroom(self.memory_headroom, self.memory_budget))
        set_(self, "compile", _compile(self.compile))
        set_(self, "pinned", _pinned(self.pinned, self.memory_budget))
        for name in ("reshard_after_forward", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise IntentError(f"{name} must be true or false, got {getattr(self, name)!r}. Fix: {name}=True or {name}=False")
        _choice("offload", self.offload, OFFLOADS)
        _choice("offload_device", self.offload_device, OFFLOAD_DEVICES)
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)):
                raise IntentError(f"nvme_path must be a directory path, got {self.nvme_path!r}. Fix: nvme_path='/local_nvme/offload'")
            set_(self, "nvme_path", os.fspath(self.nvme_path))
        if self.offload_device == "nvme" and self.offload == "none":
            raise IntentError("offload_device='nvme' with offload='none' offloads nothing. Fix: add offload='optimizer' or offload='params'")
        if self.offload_device == "nvme" and not self.nvme_path:
            raise IntentError("offload_device='nvme' needs a directory to offload to. Fix: add nvme_path=, a directory on a local NVMe drive")
        if self.nvme_path is not None and self.offload_device != "nvme":
            # Silently ignoring it would offload to CPU memory while the user believes NVMe takes the load.
            raise IntentError(
                f"nvme_path={self.nvme_path!r} is set but offload_device={self.offload_device!r}, so nothing would go to it."
                f" Fix: set offload_device='nvme' (with offload='optimizer' or 'params'), or drop nvme_path"
            )
        _choice("checkpoint", self.checkpoint, CHECKPOINTS)
        set_(self, "data_parallel_size", _size("data_parallel_size", self.data_parallel_size))
        tp = _size("tensor_parallel_size", self.tensor_parallel_size)
        set_(self, "tensor_parallel_size", 1 if tp is None else tp)
        set_(self, "shard_size", _shard_size(self.shard_size))

    def replace(self, **changes: Any) -> ShardingIntent:
        """A copy with some fields changed, validated like a new intent."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ShardingIntent:
        """Build from a plain mapping (YAML / LightningCLI); unknown keys are refused by name."""
        if data is not None and not isinstance(data, Mapping):
            raise IntentError(
                f"a ShardingIntent is read from a mapping of its fields, got {type(data).__name__}."
                f" Fix: write it as a mapping, e.g. {{'offload': 'params', 'exclude': ['probe']}}"
            )
        data = dict(data or {})
        _refuse_unknown(data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so the result round-trips through YAML and ``from_dict``."""
        out = dataclasses.asdict(self)
        if isinstance(out["init_from"], tuple):
            out["init_from"] = dict(out["init_from"])
        for key in ("shard", "exclude", "blocks", "pinned"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out


def _rename_or_drop(key: object, known: list[str], value: Any = None) -> str:
    if key == "save_distributed_checkpoint":  # Lightning ModelParallelStrategy's argument is the checkpoint field here
        return f"replace save_distributed_checkpoint={value!r} by checkpoint={'distributed' if value else 'full'!r} (one of 'distributed', 'full')"
    near = closest(key, known)
    return f"rename {key!r} to {near!r}" if near else f"drop {key!r}"


def _refuse_unknown(names: Mapping[str, Any]) -> None:
    known = [f.name for f in dataclasses.fields(ShardingIntent)]
    unknown = sorted(set(names) - set(known), key=str)
    if unknown:
        hints = "".join(f" {key!r}{did_you_mean(key, known)}" for key in unknown)
        raise IntentError(
            f"unknown ShardingIntent field(s):{hints}. Valid fields are {', '.join(known)}."
            f" Fix: {'; '.join(_rename_or_drop(key, known, names[key]) for key in unknown)}"
        )


# The type of a strategy's ``**intent_fields: Unpack[IntentKeywords]``: every field, none required. Why not
# ``**intent_fields: Any``: jsonargparse (LightningCLI) then reads the fields from ``ShardingIntent``'s signature and
# passes every one, defaults included, so a default it filled in could not be told from a value the user wrote;
# with a TypedDict it passes only the keys the config gives.
IntentKeywords = TypedDict("IntentKeywords", {f.name: f.type for f in dataclasses.fields(ShardingIntent)}, total=False)  # type: ignore[misc]


def as_intent(value: ShardingIntent | Mapping[str, Any] | None, **fields: Any) -> ShardingIntent:
    """Accept an intent, a dict of its fields, or nothing (all defaults); ``fields`` (keywords given beside it, as a
    strategy takes them) set the fields the intent leaves at their defaults.

    A keyword that differs from a field the intent sets is refused, as a precision given twice is: neither silently
    wins, for both front ends and both engines (every strategy builds its intent here).
    """
    _refuse_unknown(fields)
    if isinstance(value, ShardingIntent):
        base = value
    elif value is None or isinstance(value, Mapping):
        base = ShardingIntent.from_dict(value)
    else:
        raise IntentError(
            f"expected a ShardingIntent or a dict of its fields, got {type(value).__name__}."
            f" Fix: pass intent=ShardingIntent(...) or intent={{'offload': 'params'}}"
        )
    default = ShardingIntent()
    twice = [name for name, asked in fields.items() if getattr(base, name) != getattr(default, name) and not _agrees(base, name, asked)]
    if twice:
        stated = ", ".join(f"{name}={getattr(base, name)!r}" for name in twice)
        beside = ", ".join(f"{name}={fields[name]!r}" for name in twice)
        names = " and ".join(twice)
        raise IntentError(
            f"{names} {'is' if len(twice) == 1 else 'are'} given twice and {'differs' if len(twice) == 1 else 'differ'}:"
            f" intent=ShardingIntent({stated}) but {beside} beside it. Fix: set {names} in one place: drop {beside},"
            f" or move {'it' if len(twice) == 1 else 'them'} into the intent (ShardingIntent(..., {beside}))"
        )
    return base.replace(**fields) if fields else base


def _agrees(intent: ShardingIntent, name: str, asked: Any) -> bool:
    """Whether keyword ``name=asked`` means what ``intent`` already says (``1`` and ``True`` for
    activation_checkpointing, ``'bf16'`` and ``'bf16-mixed'``). A value invalid beside the intent's other fields
    differs; one invalid on its own too (``offload='parms'``) is refused as such, with its own fix."""
    try:
        return getattr(intent.replace(**{name: asked}), name) == getattr(intent, name)
    except IntentError as beside:
        try:
            ShardingIntent(**{name: asked})
        except IntentError:
            raise beside from None
        return False
