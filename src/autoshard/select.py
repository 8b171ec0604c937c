"""Pick a backend from what the method needs, what the intent asks and what is installed, or refuse with a fix."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from autoshard.backends import BACKENDS, Availability, Backend, get_backend
from autoshard.capability import Feature, Support
from autoshard.errors import BackendUnavailableError, IncompatibleBackendError
from autoshard.intent import ShardingIntent
from autoshard.needs import MethodNeeds

_PRECISION_FEATURE = {
    "bf16-mixed": Feature.BF16,
    "bf16-true": Feature.BF16,
    "16-mixed": Feature.FP16_MIXED,
    "16-true": Feature.FP16_TRUE,
    "32-true": Feature.FP32,
}


def features_needed(needs: MethodNeeds, intent: ShardingIntent, accelerator: str | None = None) -> dict[Feature, str]:
    """Each feature this run needs, with the detail that shows where the need comes from."""
    out: dict[Feature, str] = {}
    if needs.num_optimizers > 1:
        out[Feature.MULTIPLE_OPTIMIZERS] = f"{needs.num_optimizers} optimizers ({needs.describe_optimizers()})"
    if needs.ema_pairs:
        out[Feature.EMA_TEACHER_STUDENT] = "; ".join(f"teacher '{p.teacher}' follows student '{p.student}'" for p in needs.ema_pairs)
    if needs.multi_forward:
        out[Feature.MULTI_FORWARD] = "declared multi_forward=True"
    if needs.manual_optimization:
        out[Feature.MANUAL_OPTIMIZATION] = "automatic_optimization = False"
    if needs.root_parameters:
        out[Feature.ROOT_PARAMETERS] = "on the root: " + ", ".join(needs.root_parameters)
    if intent.shard is not None:
        out[Feature.PER_BLOCK_SHARDING] = "shard=" + ", ".join(intent.shard)
    precision = intent.effective_precision
    out[_PRECISION_FEATURE[precision]] = f"precision='{precision}'"
    if intent.offload_device == "nvme":
        out[Feature.NVME_OFFLOAD] = f"offload='{intent.offload}', offload_device='nvme'"
    elif intent.offload == "params":
        out[Feature.CPU_OFFLOAD_PARAMS] = "offload='params'"
    elif intent.offload == "optimizer":
        out[Feature.CPU_OFFLOAD_OPTIMIZER] = "offload='optimizer'"
    if intent.activation_checkpointing:
        out[Feature.ACTIVATION_CHECKPOINTING] = "activation_checkpointing=True"
    if intent.checkpoint == "full":
        out[Feature.FULL_CHECKPOINT] = "checkpoint='full'"
    else:
        out[Feature.DISTRIBUTED_CHECKPOINT] = "checkpoint='distributed'"
    if intent.tensor_parallel_size > 1:
        out[Feature.TENSOR_PARALLEL] = f"tensor_parallel_size={intent.tensor_parallel_size}"
    if accelerator == "cpu":
        out[Feature.CPU_ACCELERATOR] = "accelerator='cpu'"
    return out


@dataclass(frozen=True)
class Conflict:
    """One feature a backend cannot provide (or, with ``feature=None``, the backend is not installed)."""

    feature: Feature | None
    detail: str
    reason: str
    remedy: str

    def line(self) -> str:
        if self.feature is None:
            return f"{self.detail}: {self.reason}"
        return f"{self.feature.value} ({self.detail}): {self.reason}"


@dataclass(frozen=True)
class Decision:
    """The chosen backend, why, its caveats, and every other backend with what ruled it out."""

    backend: str
    strategy: str
    reasons: tuple[str, ...]
    caveats: tuple[Conflict, ...] = ()
    rejected: Mapping[str, tuple[Conflict, ...]] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"autoshard decision: {self.backend} (strategy='{self.strategy}')"]
        lines += [f"  because: {r}" for r in self.reasons]
        lines += [f"  caveat: {c.line()}. {c.remedy}" for c in self.caveats]
        for name, conflicts in self.rejected.items():
            lines.append(f"  refused {name}:")
            lines += [f"    - {c.line()}" for c in conflicts]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        def conflict(c: Conflict) -> dict[str, str | None]:
            return {"feature": c.feature.value if c.feature else None, "detail": c.detail, "reason": c.reason, "remedy": c.remedy}

        return {
            "backend": self.backend,
            "strategy": self.strategy,
            "reasons": list(self.reasons),
            "caveats": [conflict(c) for c in self.caveats],
            "rejected": {n: [conflict(c) for c in cs] for n, cs in self.rejected.items()},
        }


def _evaluate(backend: Backend, needed: Mapping[Feature, str], available: Availability) -> tuple[list[Conflict], list[Conflict]]:
    conflicts, caveats = [], []
    for feature, detail in needed.items():
        c = backend.row[feature]
        if c.support is Support.PARTIAL:
            caveats.append(Conflict(feature, detail, c.reason, c.remedy))
        elif not c.support.usable:
            conflicts.append(Conflict(feature, detail, c.reason, c.remedy))
    if not available.ok and backend.name != "fsdp1":
        conflicts.append(Conflict(None, available.detail, f"the {backend.name} backend needs it", available.fix))
    return conflicts, caveats


def _refusal(backend: str, conflicts: list[Conflict], works: Backend | None) -> str:
    lines = [f"autoshard cannot run this on {backend}:"]
    lines += [f"  - {c.line()}" for c in conflicts]
    if works is not None:
        lines.append(f"Backend that works: {works.name} (strategy='{works.strategy}').")
    else:
        lines.append("No installed backend can run it as configured.")
    fixes = list(dict.fromkeys(c.remedy for c in conflicts))
    lines.append("Fix: " + "; ".join(fixes))
    return "\n".join(lines)


def select_backend(
    needs: MethodNeeds,
    intent: ShardingIntent | None = None,
    prefer: str = "auto",
    *,
    accelerator: str | None = None,
    available: Mapping[str, Availability] | None = None,
) -> Decision:
    """Return the backend to use, or raise IncompatibleBackendError naming the conflict, what works and the fix.

    ``available`` overrides the installed-package checks (for ``autoshard explain`` of another machine).
    """
    intent = intent or ShardingIntent()
    wanted = None if prefer == "auto" else get_backend(prefer)
    needed = features_needed(needs, intent, accelerator)
    checks = {name: (available or {}).get(name) or b.check() for name, b in BACKENDS.items()}
    verdicts = {name: _evaluate(b, needed, checks[name]) for name, b in BACKENDS.items()}
    fsdp1 = BACKENDS["fsdp1"].row[Feature.MULTI_FORWARD]
    rejected_fsdp1 = [Conflict(None, "FSDP1 is refused", fsdp1.reason, fsdp1.remedy)]
    usable = [n for n, (conflicts, _) in verdicts.items() if not conflicts and n != "fsdp1"]
    usable.sort(key=lambda n: bool(verdicts[n][1]))  # no caveats first; ties keep preference order
    best = BACKENDS[usable[0]] if usable else None

    if wanted is not None and wanted.name == "fsdp1":
        raise IncompatibleBackendError(_refusal("fsdp1", rejected_fsdp1, best))
    chosen = wanted or best
    if chosen is None:
        # Nothing fits: report the backend closest to working (fewest conflicts) and its fixes.
        closest = min((n for n in verdicts if n != "fsdp1"), key=lambda n: len(verdicts[n][0]))
        lines = ["autoshard found no backend that can run this method with this intent:"]
        for name, (conflicts, _) in verdicts.items():
            for c in conflicts if name != "fsdp1" else rejected_fsdp1:
                lines.append(f"  - {name}: {c.line()}")
        fixes = list(dict.fromkeys(c.remedy for c in verdicts[closest][0]))
        lines.append(f"Closest: {closest} (strategy='{BACKENDS[closest].strategy}').")
        lines.append("Fix: " + "; ".join(fixes))
        raise IncompatibleBackendError("\n".join(lines))
    conflicts, caveats = verdicts[chosen.name]
    if conflicts:
        error = BackendUnavailableError if all(c.feature is None for c in conflicts) else IncompatibleBackendError
        alternative = best if best is not None and best.name != chosen.name else None
        raise error(_refusal(chosen.name, conflicts, alternative))
    reasons = [f"requested {chosen.name}" if wanted else f"{chosen.name} supports everything needed"]
    reasons.append("needs: " + ", ".join(f"{f.value} [{d}]" for f, d in needed.items()))
    reasons.append(f"installed: {checks[chosen.name].detail}")
    rejected = {n: tuple(cs if n != "fsdp1" else rejected_fsdp1) for n, (cs, _) in verdicts.items() if n != chosen.name and (cs or n == "fsdp1")}
    if wanted is None:
        for n in usable:
            if n != chosen.name:
                rejected[n] = tuple(verdicts[n][1]) or (Conflict(None, "usable", f"ranks after {chosen.name} in preference order", ""),)
    return Decision(chosen.name, chosen.strategy, tuple(reasons), tuple(caveats), rejected)
