"""Pick a backend from what the method needs, what the intent asks and what is installed, or refuse with a fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autoshard.backends import BACKENDS, Availability, Backend, get_backend
from autoshard.capability import INTENT_FEATURES, Feature, Support
from autoshard.errors import BackendUnavailableError, IncompatibleBackendError
from autoshard.intent import SELECTIVE, ShardingIntent, as_intent
from autoshard.needs import MethodNeeds
from autoshard.precision import PrecisionPlan, resolve_precision

AUTO = ("auto", "auto-shard", "auto_shard")
AUTO_STRATEGY = "auto-shard"  # the strategy string that asks for "auto"


def features_needed(
    needs: MethodNeeds, intent: ShardingIntent, accelerator: str | None = None, precision: PrecisionPlan | None = None
) -> dict[Feature, str]:
    """Each feature this run needs, with the detail that shows where the need comes from (``precision=None``: the
    intent's, as ``explain`` plans)."""
    out: dict[Feature, str] = {}
    if needs.num_optimizers > 1:
        out[Feature.MULTIPLE_OPTIMIZERS] = f"{needs.num_optimizers} optimizers: {needs.describe_optimizers()}"
    if needs.ema_pairs:
        out[Feature.EMA_TEACHER_STUDENT] = "; ".join(f"teacher '{p.teacher}' follows student '{p.student}'" for p in needs.ema_pairs)
    if needs.multi_forward:
        out[Feature.MULTI_FORWARD] = "declared multi_forward=True"
    if needs.manual_optimization:
        out[Feature.MANUAL_OPTIMIZATION] = "automatic_optimization = False"
    if needs.root_parameters:
        out[Feature.ROOT_PARAMETERS] = "on the root: " + ", ".join(needs.root_parameters)
    named = [f"{key}=" + ", ".join(value) for key, value in (("shard", intent.shard), ("blocks", intent.blocks)) if value is not None]
    if named:
        out[Feature.PER_BLOCK_SHARDING] = "; ".join(named)
    if intent.reshard_after_forward is False:  # only as asked: a budget under DeepSpeed never chooses this field
        out[Feature.KEEP_GATHERED] = "reshard_after_forward=False"
    stated = (precision or resolve_precision(None, intent)).precision
    out[stated.feature] = f"precision='{stated}'"
    if intent.offload_device == "nvme":
        out[Feature.NVME_OFFLOAD] = f"offload='{intent.offload}', offload_device='nvme'"
    elif intent.offload == "params":
        out[Feature.CPU_OFFLOAD_PARAMS] = "offload='params'"
    elif intent.offload == "optimizer":
        out[Feature.CPU_OFFLOAD_OPTIMIZER] = "offload='optimizer'"
    if intent.activation_checkpointing == SELECTIVE:  # its own feature: DeepSpeed checkpoints blocks, not ops
        out[Feature.SELECTIVE_CHECKPOINTING] = f"activation_checkpointing={intent.activation_checkpointing!r}"
    elif intent.activation_checkpointing:
        out[Feature.ACTIVATION_CHECKPOINTING] = f"activation_checkpointing={intent.activation_checkpointing!r}"
    if intent.checkpoint == "full":
        out[Feature.FULL_CHECKPOINT] = "checkpoint='full'"
    else:
        out[Feature.DISTRIBUTED_CHECKPOINT] = "checkpoint='distributed'"
    if intent.tensor_parallel_size > 1:
        out[Feature.TENSOR_PARALLEL] = f"tensor_parallel_size={intent.tensor_parallel_size}"
    if intent.shard_size is not None:  # the dp size is not known here; a shard_size equal to it is pure FSDP
        out[Feature.HYBRID_SHARDING] = f"shard_size={intent.shard_size!r}"
    if accelerator is not None and str(accelerator).lower() == "cpu":
        out[Feature.CPU_ACCELERATOR] = "accelerator='cpu'"
    if intent.compile is True:  # 'auto' is the budget's to choose: it needs nothing until chosen
        out[Feature.COMPILE] = "compile=True"
    elif needs.compiled:
        out[Feature.COMPILE] = "compiled by the model: " + ", ".join(f"'{p}'" if p else "the whole module" for p in needs.compiled)
    if intent.init_from is not None:
        out[Feature.INIT_FROM] = f"init_from={intent.init_from if isinstance(intent.init_from, str) else dict(intent.init_from)!r}"
    return out


@dataclass(frozen=True)
class Conflict:
    """One feature a backend cannot provide (or, with ``feature=None``, the backend itself is rejected or missing)."""

    feature: Feature | None
    detail: str
    reason: str
    remedy: str

    def line(self) -> str:
        if self.feature is None:
            return f"{self.detail}: {self.reason}"
        return f"{self.feature.value} [{self.detail}]: {self.reason}"


@dataclass(frozen=True)
class Decision:
    """The chosen backend, why, its caveats, and every backend that was ruled out with what ruled it out."""

    backend: str
    strategy: str
    reasons: tuple[str, ...]
    caveats: tuple[Conflict, ...] = ()
    ruled_out: Mapping[str, tuple[Conflict, ...]] = field(default_factory=dict)
    asked: str | None = None  # the strategy the user asked for ('auto-shard'), when it is not ``strategy``

    def describe(self, caveats: bool = True) -> str:
        """The log lines; ``caveats=False`` for a log that gives them as ``warnings()``. A rejected backend (FSDP1) is
        never a candidate, so "ruled out fsdp1" would be noise; ``to_dict`` still lists it."""
        if self.asked is not None and self.asked != self.strategy:  # what was asked, then what it resolved to
            lines = [f"autoshard chose {self.backend} for strategy='{self.asked}' (strategy='{self.strategy}' names it directly)"]
        else:
            lines = [f"autoshard chose {self.backend} (strategy='{self.strategy}')"]
        lines += [f"  {r}" for r in self.reasons]
        if caveats:
            lines += [f"  caveat: {c.line()}. Fix: {c.remedy}" for c in self.caveats]
        for name, conflicts in self.ruled_out.items():
            if BACKENDS[name].rejected:
                continue
            lines.append(f"  ruled out {name}:")
            lines += [f"    - {c.line()}" for c in conflicts]
        return "\n".join(lines)

    __str__ = describe

    def warnings(self) -> list[str]:
        """One message per caveat (what the chosen backend does only partly), logged as warnings: a user must not
        miss that part of what they asked for is not done."""
        return [f"autoshard: partial support on {self.backend} for {c.feature.value} [{c.detail}]: {c.reason}. Fix: {c.remedy}" for c in self.caveats]

    def to_dict(self) -> dict[str, object]:
        def conflict(c: Conflict) -> dict[str, str | None]:
            return {"feature": c.feature.value if c.feature else None, "detail": c.detail, "reason": c.reason, "remedy": c.remedy}

        return {
            "backend": self.backend,
            "strategy": self.strategy,
            "asked": self.asked or self.strategy,
            "reasons": list(self.reasons),
            "caveats": [conflict(c) for c in self.caveats],
            "ruled_out": {n: [conflict(c) for c in cs] for n, cs in self.ruled_out.items()},
        }


@dataclass(frozen=True)
class _Verdict:
    """One backend against this run: what it cannot do, what it does only partly, and whether it is installed."""

    backend: Backend
    conflicts: tuple[Conflict, ...]
    caveats: tuple[Conflict, ...]
    installed: Availability

    @property
    def missing(self) -> Conflict | None:
        if self.installed.ok or self.backend.rejected:
            return None
        return Conflict(None, self.installed.detail, f"the {self.backend.name} backend needs it", self.installed.fix)

    @property
    def all_conflicts(self) -> tuple[Conflict, ...]:
        return self.conflicts + ((self.missing,) if self.missing else ())

    @property
    def usable(self) -> bool:
        return not self.all_conflicts

    def fixes(self, applied: str | None = None, dead: Sequence[str] = ()) -> list[str]:
        """Feature fixes first: installing a backend that could not run the method anyway fixes nothing. Alternatives
        naming the strategy already ``applied``, or one in ``dead``, are dropped unless nothing else is left."""
        remedies = [c.remedy for c in (self.conflicts or self.all_conflicts)]
        if applied:
            remedies = [r.replace(f" (or strategy='{applied}')", "") for r in remedies if r != f"use strategy='{applied}'"]
        if dead:
            remedies = [_without_alternatives(r, dead) for r in remedies]
        return list(dict.fromkeys(remedies))


def _without_alternatives(remedy: str, dead: Sequence[str]) -> str:
    kept = [part for part in remedy.split(", or ") if not any(f"strategy='{d}'" in part for d in dead)]
    return ", or ".join(kept) if kept else remedy


def _evaluate(backend: Backend, needed: Mapping[Feature, str], installed: Availability) -> _Verdict:
    if backend.rejected:  # one line, not one per feature
        c = next(iter(backend.row.values()))
        return _Verdict(backend, (Conflict(None, "rejected", c.reason, c.remedy),), (), installed)
    conflicts, caveats = [], []
    for feature, detail in needed.items():
        c = backend.row[feature]
        if c.support is Support.PARTIAL:
            caveats.append(Conflict(feature, detail, c.reason, c.remedy))
        elif not c.support.usable:
            conflicts.append(Conflict(feature, detail, c.reason, c.remedy))
    return _Verdict(backend, tuple(conflicts), tuple(caveats), installed)


def _rank(verdict: _Verdict) -> int:
    """How much of what the intent asks for this backend does only partly (see INTENT_FEATURES)."""
    return sum(c.feature in INTENT_FEATURES for c in verdict.caveats)


def _refusal(
    requested: _Verdict | None, verdicts: Mapping[str, _Verdict], works: Backend | None, applied: str | None = None
) -> IncompatibleBackendError:
    """The error for a refused request, or for a run nothing can take; it names the conflicts, what works, the fix."""
    if requested is not None and works is not None:
        b = requested.backend
        lines = [f"autoshard cannot run this on {b.name} (strategy='{b.strategy}'):"]
        lines += [f"  - {c.line()}" for c in requested.all_conflicts]
        lines.append(f"Backend that works: {works.name} (strategy='{works.strategy}').")
        lines.append("Fix: " + "; ".join(requested.fixes(applied)))
        return (IncompatibleBackendError if requested.conflicts else BackendUnavailableError)("\n".join(lines))
    # Nothing fits. Closest: a backend that only needs installing, else the one with the fewest conflicts.
    candidates = [v for v in verdicts.values() if not v.backend.rejected]
    closest = min(candidates, key=lambda v: (len(v.conflicts), v.missing is not None))
    if requested is None:
        lines = ["autoshard found no backend that can run this method with this intent:"]
    else:
        lines = [f"autoshard cannot run this on {requested.backend.name}, nor on any other backend:"]
        if requested.backend.rejected:
            candidates.insert(0, requested)
    for v in candidates:
        lines += [f"  - {v.backend.name}: {c.line()}" for c in v.all_conflicts]
    lines.append(f"Closest: {closest.backend.name} (strategy='{closest.backend.strategy}').")
    dead = [v.backend.strategy for v in candidates if v is not closest and v.conflicts]
    lines.append("Fix: " + "; ".join(closest.fixes(applied, dead)))
    return (IncompatibleBackendError if closest.conflicts else BackendUnavailableError)("\n".join(lines))


def select_backend(
    needs: MethodNeeds,
    intent: ShardingIntent | None = None,
    prefer: str = "auto",
    *,
    accelerator: str | None = None,
    available: Mapping[str, Availability] | None = None,
    applied: str | None = None,
    precision: PrecisionPlan | None = None,
) -> Decision:
    """Return the backend to use, or raise IncompatibleBackendError naming the conflict, what works and the fix.

    ``available`` overrides the install checks by backend name (``explain`` of another machine, tests); ``applied``
    is the strategy the user already runs, so that no refusal proposes it as the fix, and the decision names it as
    asked (else ``prefer``'s strategy: ``'auto-shard'`` for auto).
    """
    intent = as_intent(intent)
    wanted = None if isinstance(prefer, str) and prefer.strip().lower() in AUTO else get_backend(prefer)
    overrides = {get_backend(name).name: check for name, check in (available or {}).items()}
    needed = features_needed(needs, intent, accelerator, precision)
    verdicts = {name: _evaluate(b, needed, overrides[name] if name in overrides else b.check()) for name, b in BACKENDS.items()}
    usable = sorted((v for v in verdicts.values() if v.usable), key=_rank)  # stable: ties keep preference order
    best = usable[0] if usable else None

    if wanted is not None:
        chosen = verdicts[wanted.name]
        if not chosen.usable:
            raise _refusal(chosen, verdicts, best.backend if best else None, applied)
        by = f" (by strategy='{applied}', for what the intent asks)" if applied and applied != wanted.strategy else ""
        reasons = [f"requested: {wanted.name}{by}"]
    elif best is None:
        raise _refusal(None, verdicts, None, applied)
    else:
        chosen = best
        reasons = [_why_auto(chosen, verdicts)]
    reasons.append("needs: " + ", ".join(f"{f.value} [{d}]" for f, d in needed.items()))
    reasons.append(f"installed: {chosen.installed.detail}")
    ruled_out = {n: v.all_conflicts for n, v in verdicts.items() if n != chosen.backend.name and not v.usable}
    asked = applied or (wanted.strategy if wanted is not None else AUTO_STRATEGY)
    return Decision(chosen.backend.name, chosen.backend.strategy, tuple(reasons), chosen.caveats, ruled_out, asked)


def _why_auto(chosen: _Verdict, verdicts: Mapping[str, _Verdict]) -> str:
    """One sentence on why "auto" took this backend over the ones ahead of it in preference order."""
    ahead = []
    for v in verdicts.values():
        if v is chosen:
            break
        if v.backend.rejected:
            continue
        if v.conflicts:
            ahead.append(f"{v.backend.name} cannot run {', '.join(c.feature.value for c in v.conflicts if c.feature)}")
        elif v.missing:
            ahead.append(f"{v.backend.name} is not usable here ({v.installed.detail})")
        else:
            partly = [c.feature.value for c in v.caveats if c.feature in INTENT_FEATURES]
            ahead.append(f"{v.backend.name} only partly supports {', '.join(partly)}")
    if not ahead:
        return f"auto: {chosen.backend.name} is the first choice and runs everything needed"
    return f"auto: {chosen.backend.name}, because " + "; ".join(ahead)
