"""What ``memory_budget`` decides, as values: the price of a configuration (``Rates``, ``Cost``), each configuration
tried (``Tried``), the decision (``BudgetDecision``, stored in checkpoints) and the refusal (``BudgetRefusedError``)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autoshard.backends import get_backend
from autoshard.errors import IntentError
from autoshard.intent import BUDGET_FIELDS, COMPILE_AUTO, ShardingIntent
from autoshard.memory import fmt_bytes

DEFAULTS: dict[str, Any] = {"reshard_after_forward": True, "activation_checkpointing": False, "offload": "none", "shard_size": None, "compile": False}
OFFLOAD_SAVING = {"none": 0, "optimizer": 1, "params": 2}  # what each offload leaves off the device, least first


class BudgetRefusedError(IntentError):
    """No configuration fits ``memory_budget`` at this world size; ``min_world_size``: the smallest at which one does,
    ``micro_batch``: the largest micro-batch that fits here with every saving on (None: none, or unknown)."""

    def __init__(self, message: str, min_world_size: int | None = None, micro_batch: int | None = None) -> None:
        # Every value in args: a strategy's other ranks rebuild rank 0's refusal from them (lightning.checkpoint).
        super().__init__(message, min_world_size, micro_batch)
        self.min_world_size = min_world_size
        self.micro_batch = micro_batch

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Rates:
    """What one step's extra work costs per second, so that recomputation, collectives and host copies compare in one
    unit. The defaults: a nominal H100-class node (NVLink, 200 Gb/s InfiniBand per GPU, PCIe 5 x16), recomputation
    calibrated on one H200 (make gpu-check, a 0.9B Llama, bf16-mixed): every block recomputed cost 39.1 ms for 9.35
    TFLOP (about 240 TFLOP/s); selective checkpointing 105.5 ms for 4.67 TFLOP, 5.4 times as much per FLOP (its
    op-level policy runs in Python for every op): ``selective_factor`` ranks it after every block, as measured.
    benchmarks/budget_cost_order.py measures the rates on the machine at hand."""

    flops_per_s: float = 240e12
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 25e9
    host_bytes_per_s: float = 25e9
    selective_factor: float = 5.4
    compile_speedup: float = 1.28  # the H200's Llama: each decoder layer compiled in place, 133.5 -> 104.4 ms per step

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


RATES_ENV = "AUTOSHARD_RATES"  # a rates file of `autoshard calibrate`, read by every decision of the process
RATES_FORMAT = "autoshard-rates"  # the "format" a rates file carries: calibrate replaces only files that have it


def is_rates_file(path: Path) -> bool:
    """Whether ``path`` holds a rates file ``autoshard calibrate`` wrote (one it may replace)."""
    try:
        return json.loads(path.read_text()).get("format") == RATES_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_rates(path: str | os.PathLike[str]) -> Rates:
    """The rates in a file ``autoshard calibrate`` wrote (JSON: nothing is unpickled), refused in words otherwise."""
    named = os.environ.get(RATES_ENV) == str(path)
    where = f"{str(path)!r}" + (f" (named by {RATES_ENV})" if named else "")

    def fix() -> str:  # on refusal only: calibrate replaces a rates file of its own, never a file someone else wrote
        if not Path(path).exists() or is_rates_file(Path(path)):
            command = f"autoshard calibrate --out {str(path)!r}"
        else:
            command = f"autoshard calibrate --out NEW.json (it replaces only a rates file it wrote){f' and {RATES_ENV}=NEW.json' if named else ''}"
        return command + (f", or unset {RATES_ENV}" if named else "")

    try:
        data = json.loads(Path(path).read_text())
        rates = Rates(**data["rates"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IntentError(f"cannot read the rates file {where}: {type(exc).__name__}: {exc}. Fix: {fix()}") from None
    bad = [k for k, v in rates.to_dict().items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
    if bad:
        raise IntentError(f"the rates file {where} has {', '.join(bad)} not a positive number. Fix: {fix()}")
    return rates


def default_rates() -> Rates:
    """The rates a decision prices with when none are passed: the file ``AUTOSHARD_RATES`` names, else the built-in."""
    path = os.environ.get(RATES_ENV)
    return read_rates(path) if path else Rates()


@dataclass(frozen=True)
class Headroom:
    """Device memory a run needs beyond the tensors the simulated step counts: the CUDA context, NCCL buffers and
    library workspaces (``fixed`` bytes), and the caching allocator's reserved-but-unused blocks (``fraction`` of the
    peak). A budget is what the device has: the chosen peak may reach ``limit(budget)``."""

    fixed: int = 0
    fraction: float = 0.0

    def limit(self, budget: int) -> int:
        """The largest simulated peak that leaves this headroom within ``budget``."""
        return int((budget - self.fixed) / (1.0 + self.fraction))

    def budget_for(self, peak: int) -> int:
        """The smallest budget whose limit admits ``peak``."""
        return self.fixed + int(peak * (1.0 + self.fraction)) + 1

    def words(self) -> str:
        if not self.fixed and not self.fraction:
            return "no headroom"
        return f"headroom {fmt_bytes(self.fixed)}" + (f" + {self.fraction:.0%} of the peak" if self.fraction else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Measured on one H200 (docs/benchmarks.md, make gpu-check): outside the caching allocator (the CUDA context with
# cuBLAS loaded, NCCL) 1.29 GiB under fsdp2 and 1.68 GiB under DeepSpeed, so 2 GiB leaves room for NCCL's buffers
# on more ranks; the allocator's reserved over max_memory_allocated up to 9.4% (activation checkpointing), so 10%.
CUDA_HEADROOM = Headroom(fixed=2 << 30, fraction=0.10)
NO_HEADROOM = Headroom()


def headroom_for(intent: ShardingIntent, device_type: str) -> Headroom:
    """The user's ``memory_headroom`` (bytes kept free), else the device's."""
    if intent.memory_headroom is not None:
        return Headroom(fixed=intent.memory_headroom)
    return CUDA_HEADROOM if device_type == "cuda" else NO_HEADROOM


@dataclass(frozen=True)
class Cost:
    """The estimated price of one configuration, per step: seconds by cause, and the quantities behind them."""

    recompute_flops: int = 0
    gather_bytes_intra: int = 0
    gather_bytes_inter: int = 0
    host_bytes: int = 0
    seconds: float = 0.0
    selective: bool = False  # recomputed under selective checkpointing's op-level policy (Rates.selective_factor)
    compiled_flops: int = 0  # the step's FLOPs run by compiled blocks: faster by Rates.compile_speedup

    def at(self, rates: Rates) -> float:
        """The same quantities priced at other rates (the cost-order benchmark measures this machine's)."""
        return (
            self.recompute_flops * (rates.selective_factor if self.selective else 1.0) / rates.flops_per_s
            + self.gather_bytes_intra / rates.intra_node_bytes_per_s
            + self.gather_bytes_inter / rates.inter_node_bytes_per_s
            + self.host_bytes / rates.host_bytes_per_s
            - self.compiled_flops * (1 - 1 / rates.compile_speedup) / rates.flops_per_s
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tried:
    """One configuration the decision looked at. ``simulated=False``: its peak is a lower bound, from a configuration
    that saves at least as much in every field and already does not fit. ``runs=False``: its step cannot run.
    ``at``: where in the simulated step its peak is (the tracker's words; "" when no step of its own gave the peak):
    a peak in the optimizer step is one no activation checkpointing lowers."""

    config: dict[str, Any]
    peak: int
    cost: Cost
    fits: bool
    why: str = ""
    simulated: bool = True
    runs: bool = True
    at: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cost"] = out.pop("cost")  # last, as stored before
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tried:
        return cls(
            dict(data["config"]),
            int(data["peak"]),
            Cost(**data.get("cost", {})),
            bool(data["fits"]),
            data.get("why", ""),
            bool(data.get("simulated", True)),
            bool(data.get("runs", True)),
            str(data.get("at", "")),
        )


@dataclass(frozen=True)
class BudgetDecision:
    """What ``memory_budget`` chose at one world size: ``chosen`` holds ShardingIntent fields, ``kept`` names those the
    user set; stored in checkpoints."""

    budget: int
    world_size: int
    chosen: dict[str, Any]
    peak: int
    cost: Cost
    cheaper: list[Tried]
    batch: str = ""
    kept: tuple[str, ...] = ()
    rates: Rates = field(default_factory=Rates)
    num_nodes: int = 1
    backend: str = "fsdp2"  # the backend the peaks are for: fsdp2's simulated step, or DeepSpeed's estimator + activations
    headroom: Headroom = field(default_factory=Headroom)  # kept free beside the peak: peak <= headroom.limit(budget)
    at: str = ""  # where in the simulated step the chosen configuration peaks (Tried.at)

    def intent(self, base: ShardingIntent) -> ShardingIntent:
        """``base`` with the chosen fields: what the run trains with."""
        return base.replace(**self.chosen)

    def table(self) -> str:
        """The decision table a strategy logs on rank 0 at fit."""
        head = (
            f"autoshard memory budget: {fmt_bytes(self.budget)} per rank, world size {self.world_size}"
            + (f" on {self.num_nodes} nodes" if self.num_nodes > 1 else "")
            + (f", {peaks}" if (peaks := get_backend(self.backend).budget.peaks) else "")  # type: ignore[union-attr]
            + (f", micro-batch {self.batch}" if self.batch else "")
            + (
                f"\n  {self.headroom.words()} (CUDA context, communication buffers, allocator fragmentation): the simulated"
                f" peak may reach {fmt_bytes(self.headroom.limit(self.budget))}"
                if self.headroom != Headroom()
                else ""
            )
        )
        at = f" (at: {self.at})" if self.at else ""
        lines = [head, f"  chosen: {describe_config(self.chosen)}", f"    peak {fmt_bytes(self.peak)} per rank{at}; {_cost_words(self.cost)}"]
        if self.cheaper:
            lines.append("  cheaper, and why each does not fit (cheapest first):")
            for t in self.cheaper:
                peak = "cannot run" if not t.runs else f"{'>= ' if not t.simulated else ''}{fmt_bytes(t.peak)}"
                lines.append(f"    {describe_config(t.config):<72} peak {peak:>11}  {t.why}" + (f"; at: {t.at}" if t.at else ""))
        else:
            lines.append("  nothing cheaper: this is the cheapest configuration")
        if self.kept:
            lines.append(f"  kept as you set them: {', '.join(self.kept)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: stored in the checkpoint, printed by ``autoshard explain --budget --json``."""
        return {"world_size": self.world_size, **asdict(self), "cheaper": [t.to_dict() for t in self.cheaper], "kept": list(self.kept)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BudgetDecision:
        return cls(
            budget=int(data["budget"]),
            world_size=int(data["world_size"]),
            chosen=dict(data["chosen"]),
            peak=int(data["peak"]),
            cost=Cost(**data.get("cost", {})),
            cheaper=[Tried.from_dict(t) for t in data.get("cheaper", [])],
            batch=data.get("batch", ""),
            kept=tuple(data.get("kept", ())),
            rates=Rates(**data.get("rates", {})),
            num_nodes=int(data.get("num_nodes", 1)),
            backend=str(data.get("backend", "fsdp2")),
            headroom=Headroom(**data.get("headroom", {})),
            at=str(data.get("at", "")),
        )


def describe_config(config: dict[str, Any]) -> str:
    """``activation_checkpointing=2, offload='params'``: the fields that differ from ShardingIntent's defaults, as
    a user writes them ("defaults" when none does)."""
    changed = [f"{k}={v!r}" for k, v in config.items() if DEFAULTS.get(k, object()) != v or type(DEFAULTS.get(k)) is not type(v)]
    return ", ".join(changed) or "defaults (nothing changed)"


def _cost_words(cost: Cost) -> str:
    parts = []
    if cost.recompute_flops:
        parts.append(f"{cost.recompute_flops / 1e9:.3g} GFLOP recomputed")
    if cost.gather_bytes_intra or cost.gather_bytes_inter:
        parts.append(f"{fmt_bytes(cost.gather_bytes_intra + cost.gather_bytes_inter)} all-gathered/reduced")
    if cost.host_bytes:
        parts.append(f"{fmt_bytes(cost.host_bytes)} host<->device")
    if cost.compiled_flops:
        parts.append(f"compiled blocks: {cost.compiled_flops / 1e9:.3g} GFLOP run faster; compiling them once at start-up is not counted")
    if cost.seconds < 0:
        return f"saves ~{-cost.seconds * 1e3:.3g} ms/step estimated ({'; '.join(parts)})"
    return f"costs ~{cost.seconds * 1e3:.3g} ms/step estimated ({'; '.join(parts) or 'nothing extra'})"


def free_fields(intent: ShardingIntent, num_nodes: int, backend: str = "fsdp2") -> list[str]:
    """The fields the user left at their defaults among those the backend's budget sets, shard_size only when there are several nodes to group by."""
    fields = get_backend(backend).budget.fields  # type: ignore[union-attr]
    free = [
        f for f in BUDGET_FIELDS if getattr(intent, f) == DEFAULTS[f] and type(getattr(intent, f)) is type(DEFAULTS[f]) and f not in intent.pinned
    ]
    auto = ["compile"] if intent.compile == COMPILE_AUTO and get_backend(backend).budget.compile else []  # type: ignore[union-attr]
    return [f for f in free if f in fields and (f != "shard_size" or num_nodes > 1)] + auto
