"""``autoshard explain TARGET``: what autoshard would do with your module, before a single process or GPU starts.

The module is built on the meta device (no memory), then the needs, the backend decision, the matrix rows that
matter, the FSDP2 plan (or the DeepSpeed config) and a per-rank memory table are printed, as text or JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
from torch import nn

from autoshard.activations import load_batch
from autoshard.adapters.checkpointing import checkpointable_blocks
from autoshard.backends import BACKENDS, get_backend, load
from autoshard.backends.matrix import matrix, write_matrix
from autoshard.budget import (
    Ask,
    BudgetDecision,
    BudgetReport,
    DecideOptions,
    ModelStates,
    Option,
    Simulator,
    Subject,
    auto_entries,
    batch_rows,
    batch_tokens,
    check_budget,
    headroom_for,
)
from autoshard.consolidate import command_parser
from autoshard.errors import AutoShardError, IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent
from autoshard.memory import ACTIVATIONS_HINT, MemoryEstimate, fmt_bytes, memory_table, with_step
from autoshard.mesh import ParallelDims, nodes_for
from autoshard.needs import MethodNeeds
from autoshard.precision import resolve_precision
from autoshard.select import Decision, features_needed, select_backend
from autoshard.target import load_target
from autoshard.units import parse_size

DEFAULT_WORLD_SIZES = (1, 2, 8, 64)
DEFAULT_DEVICES_PER_NODE = 8
BACKEND_CHOICES = ("auto", "fsdp2", "deepspeed")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")  # Trainer(accelerator=...): only "cpu" changes the verdict
_LIST_FIELDS = ("shard", "exclude", "blocks")


# -- the intent -----------------------------------------------------------------------------------------------------
def _value(key: str, text: str) -> Any:
    """A command-line value: lists for shard/exclude, else true/false/none, integers, or the text itself."""
    if key in _LIST_FIELDS:
        return [part.strip() for part in text.split(",") if part.strip()]
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        return text


def read_intent_file(path: str) -> dict[str, Any]:
    """A YAML or JSON mapping of ShardingIntent fields, possibly under a top-level ``intent:`` key."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AutoShardError(f"cannot read --intent-file {path}: {exc.strerror or exc}. Fix: give the path of a YAML or JSON file") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AutoShardError(f'--intent-file {path} is not valid JSON: {exc}. Fix: e.g. {{"offload": "params"}}') from None
    else:
        try:
            import yaml
        except ImportError:
            raise AutoShardError(f"--intent-file {path} needs PyYAML. Fix: pip install pyyaml (or give a .json file)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None and problem else " ".join(str(exc).split())
            raise AutoShardError(
                f"--intent-file {path} is not valid YAML ({where}). Fix: one `field: value` per line, e.g. `offload: params`"
            ) from None
    if isinstance(data, Mapping) and set(data) == {"intent"}:
        data = data["intent"]
    if data is not None and not isinstance(data, Mapping):
        raise IntentError(
            f"--intent-file {path} must hold a mapping of ShardingIntent fields, got {type(data).__name__}."
            f" Fix: write one field per line, e.g. `offload: params`"
        )
    return dict(data or {})


def build_intent(pairs: Sequence[str] = (), intent_file: str | None = None, precision: str | None = None) -> ShardingIntent:
    """File first, then each ``key=value``, then ``--precision``: the later, the stronger."""
    data = read_intent_file(intent_file) if intent_file else {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise IntentError(f"--intent takes key=value, got {pair!r}. Fix: e.g. --intent offload=params")
        data[key.strip()] = _value(key.strip(), text)
    if precision is not None:
        data["precision"] = precision
    return ShardingIntent.from_dict(data)


# -- the report -----------------------------------------------------------------------------------------------------
@dataclass
class Report:
    """Everything explain found; ``text()`` for people and logs, ``to_dict()`` for machines."""

    target: str
    module: nn.Module
    intent: ShardingIntent
    needs: MethodNeeds
    features: dict[Any, str]
    decision: Decision | None = None
    error: str | None = None
    error_type: str | None = None
    plan: Any = None
    deepspeed_config: dict[str, Any] | None = None
    deepspeed_config_world: int | None = None
    memory: list[MemoryEstimate] = field(default_factory=list)
    budget: BudgetReport | None = None
    # --budget: ShardingIntent(memory_budget=...)'s decision per world size (BudgetDecision.to_dict(), or an "error")
    auto: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)
    # What was asked (--batch, --budget) but could not be estimated, with its Fix: the answer is partial (exit 1).
    incomplete: str | None = None
    # Why the table counts no activations when the table's own hint ("pass --batch") would be wrong.
    unmeasured: str | None = None

    @property
    def exit_code(self) -> int:
        """1 when autoshard refuses the run, or what was asked could not be estimated in full; 0 otherwise ("does NOT
        fit" included: that is an answer)."""
        return 1 if self.error or self.incomplete or any("error" in entry for entry in self.auto or ()) else 0

    def _feature_rows(self) -> list[dict[str, Any]]:
        rows = matrix()
        return [
            {
                "feature": feature.value,
                "detail": detail,
                "cells": {
                    name: {"support": row[feature].support.value, "reason": row[feature].reason, "remedy": row[feature].remedy}
                    for name, row in rows.items()
                },
            }
            for feature, detail in self.features.items()
        ]

    def to_dict(self) -> dict[str, Any]:
        kind, message = (self.error_type, self.error) if self.error else ("IncompleteEstimate", self.incomplete)
        return {
            "target": self.target,
            "module": type(self.module).__name__,
            "parameters": sum(p.numel() for p in self.module.parameters()),
            "intent": self.intent.to_dict(),
            "needs": self.needs.to_dict(),
            "decision": self.decision.to_dict() if self.decision else None,
            "error": {"type": kind, "message": message} if message else None,
            "incomplete": self.incomplete,
            "features": self._feature_rows(),
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "tensor_parallel": self._tensor_parallel(),
            "deepspeed_config": self.deepspeed_config,
            "memory": [e.to_dict() for e in self.memory],
            "budget": self.budget.to_dict() if self.budget is not None else None,
            "auto": self.auto,
            "notes": list(self.notes),
        }

    def _tensor_parallel(self) -> dict[str, Any] | None:
        """The model's own tensor-parallel layout: each module's style, each split parameter's dimension."""
        tp_plan = getattr(self.plan, "tp_plan", None)
        if tp_plan is None or self.intent.tensor_parallel_size == 1:
            return None
        return {
            "size": self.intent.tensor_parallel_size,
            "sources": list(tp_plan.sources),
            "modules": [{"module": path, "style": style} for path, style in tp_plan.rows()],
            "split_parameters": tp_plan.split_params(self.module),
            "notes": list(tp_plan.notes),
        }

    def text(self, color: bool = False) -> str:
        head = (lambda s: f"\x1b[1m{s}\x1b[0m") if color else (lambda s: s)  # noqa: E731
        numel = sum(p.numel() for p in self.module.parameters())
        full = sum(p.numel() * p.element_size() for p in self.module.parameters())
        out = [
            head(f"==== autoshard explain: {self.target} ===="),
            f"built {type(self.module).__name__} on the meta device: {numel:,d} parameters ({fmt_bytes(full)} unsharded), no memory used",
            f"intent: {json.dumps(self._intent_changes()) if self._intent_changes() else 'defaults'}",
            "",
            head("== needs =="),
            *self._needs_lines(),
            "",
            head("== decision =="),
        ]
        out += self.error.splitlines() if self.error else self.decision.describe().splitlines()  # type: ignore[union-attr]
        out += ["", head("== matrix rows for what this run needs =="), *self._matrix_lines()]
        if self.plan is not None:
            out += ["", head("== FSDP2 plan =="), self.plan.describe()]
        tp_plan = getattr(self.plan, "tp_plan", None)
        if tp_plan is not None and self.intent.tensor_parallel_size > 1:
            tp = self.intent.tensor_parallel_size
            out += ["", head(f"== tensor-parallel layout ({tp} ranks, the model's own plan) =="), *tp_plan.describe(self.module, tp)]
        if self.deepspeed_config is not None:
            world = self.deepspeed_config_world
            out += ["", head(f"== DeepSpeed ZeRO-3 config (world size {world}) =="), json.dumps(self.deepspeed_config, indent=2)]
        if self.memory:
            table = memory_table(self.memory)
            if self.unmeasured:  # the table's generic hint tells the user to pass the --batch they passed
                table = table.replace(f"  {ACTIVATIONS_HINT}", f"  activations are not counted: {self.unmeasured}")
            out += ["", head("== per-rank memory =="), table]
        if self.budget is not None:
            out += ["", head("== memory budget =="), self.budget.text()]
        if self.auto:
            out += ["", head("== memory budget: what ShardingIntent(memory_budget=...) would choose ==")]
            for entry in self.auto:
                if "error" in entry:
                    out += [f"world size {entry['world_size']}: refused: {entry['error']['message']}"]
                else:
                    out += BudgetDecision.from_dict(entry).table().splitlines()
        if self.notes:
            out += ["", *[f"note: {n}" for n in self.notes]]
        if self.incomplete:
            out += ["", head("== incomplete estimate =="), self.incomplete]
        if self.error:
            out += ["", "autoshard explain: refused (exit status 1); the Fix line above says what to change"]
        elif self.incomplete:
            out += ["", "autoshard explain: incomplete estimate (exit status 1); the Fix line above says how to complete it"]
        return "\n".join(out)

    def _intent_changes(self) -> dict[str, Any]:
        default = ShardingIntent().to_dict()
        return {k: v for k, v in self.intent.to_dict().items() if v != default[k]}

    def _needs_lines(self) -> list[str]:
        n = self.needs
        yes_no = lambda b: "yes" if b else "no"  # noqa: E731
        pairs = "; ".join(f"teacher '{p.teacher}' follows student '{p.student}'" for p in n.ema_pairs) or "none"
        return [
            f"optimizers: {n.num_optimizers} ({n.describe_optimizers()})",
            f"EMA teacher/student: {pairs}",
            f"several forwards per step: {yes_no(n.multi_forward)}",
            f"manual optimization: {yes_no(n.manual_optimization)}",
            f"parameters on the module root: {', '.join(n.root_parameters) or 'none'}",
            f"modules trained by callbacks (kept whole): {', '.join(n.callback_modules) or 'none'}",
        ]

    def _matrix_lines(self) -> list[str]:
        rows = self._feature_rows()
        names = list(matrix())
        header = ["feature", "needed because", *names]
        body = [[r["feature"], r["detail"], *(r["cells"][b]["support"] for b in names)] for r in rows]
        widths = [min(48, max(len(x[i]) for x in [header, *body])) for i in range(len(header))]
        clip = lambda s, w: s if len(s) <= w else s[: w - 3] + "..."  # noqa: E731
        lines = ["  ".join(clip(c, w).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *body]]
        rejected = {n for n in names if BACKENDS[n].rejected}
        for r in rows:
            for b in names:
                cell = r["cells"][b]
                if cell["support"] in ("partial", "no") and b not in rejected:
                    lines.append(f"  {b} / {r['feature']}: {cell['support']}: {cell['reason']}. Fix: {cell['remedy']}")
        lines += [f"  {b}: rejected for every feature (see `autoshard matrix --details`)" for b in sorted(rejected)]
        return lines


@dataclass(frozen=True)
class ExplainOptions:
    """How ``explain`` works beyond what it explains. ``simulate=False``: model states only; ``progress`` is called
    before each simulated step (seconds each on big models); ``auto``: with a budget, also what ``memory_budget``
    would choose at each world size (``report.auto``)."""

    accelerator: str | None = None
    micro_batch_size: int = 1
    devices_per_node: int = DEFAULT_DEVICES_PER_NODE
    simulate: bool = True
    progress: Callable[[str], None] | None = None
    auto: bool = True


def explain(
    target: str | Callable[[], Any],
    *,
    backend: str = "auto",
    intent: ShardingIntent | None = None,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    batch: str | Callable[[], Any] | None = None,
    budget: str | int | None = None,
    options: ExplainOptions | None = None,
) -> Report:
    """Build TARGET on meta and work out everything autoshard would do with it; a refusal lands in ``error``.
    ``batch``: one micro-batch per rank, for a simulated step per world size; ``budget``: device bytes per rank
    (``80GiB``). When either was asked for and the peak lacks part of the step, ``report.incomplete`` says why."""
    o = options or ExplainOptions()
    intent = intent or ShardingIntent()
    if budget is None:  # --intent memory_budget=70GiB asks the same question as --budget 70GiB
        budget = intent.memory_budget
    budget_bytes = parse_size(budget) if budget is not None else None
    factory = load_target(target) if isinstance(target, str) else target
    make_batch = load_batch(batch) if isinstance(batch, str) else batch
    # Called once now, so that a batch function that raises is refused in words before any step is simulated.
    rows = batch_rows(make_batch) if make_batch is not None else None
    subject = Subject.build(factory)  # one configure_optimizers call: needs and memory both read its optimizers
    module, needs = subject.module, subject.needs
    report = Report(
        target=target if isinstance(target, str) else getattr(target, "__name__", repr(target)),
        module=module,
        intent=intent,
        needs=needs,
        features=features_needed(needs, intent, o.accelerator),
        notes=list(subject.notes),
    )
    if not _decide_and_plan(report, backend, o.accelerator, max(world_sizes), o.micro_batch_size):
        return report
    sizes = _fitting_world_sizes(intent, world_sizes, o.devices_per_node, report.notes)
    estimates = _Estimates(report, subject, make_batch, o)
    estimates.prepare(o.simulate)
    estimates.sim.model.of(intent, sizes)  # the table's world sizes share one plan
    report.memory = [estimates.estimate(Option(intent, size)) for size in sizes]
    _say_what_is_missing(report, estimates, asked=budget_bytes is not None or (o.simulate and make_batch is not None))
    if budget_bytes is not None:
        checkpointable = bool(checkpointable_blocks(module, intent, needs))
        ask = Ask(o.devices_per_node, rows, checkpointable, _lacks)
        headroom = headroom_for(intent, _device_type(o.accelerator))
        report.budget = check_budget(estimates.estimate, intent, max(sizes), budget_bytes, ask=ask, headroom=headroom)
        if o.auto:
            report.auto = _auto(factory, make_batch, intent, sizes, budget_bytes, report.decision.backend, o)  # type: ignore[union-attr]
    return report


def _decide_and_plan(report: Report, backend: str, accelerator: str | None, world_size: int, micro_batch_size: int) -> bool:
    """The backend decision, then its plan or its config (for ``world_size``), into ``report``; False when autoshard
    refuses the run (``report.error`` says why)."""
    intent, needs, module = report.intent, report.needs, report.module
    try:
        report.decision = select_backend(needs, intent, prefer=backend, accelerator=accelerator)
    except IncompatibleBackendError as exc:
        report.error, report.error_type = str(exc), type(exc).__name__
        return False
    engine = get_backend(report.decision.backend)
    if engine.plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                report.plan = load(engine.plan)(module, intent, needs)
            except (IntentError, IncompatibleBackendError) as exc:
                if intent.tensor_parallel_size == 1:
                    raise
                # The model's tensor-parallel plan, refused before training (TPPlan.check): the run's own refusal.
                report.error, report.error_type = str(exc), type(exc).__name__
                return False
        report.notes += [f"warning: {w.message}" for w in caught if issubclass(w.category, UserWarning)]
    elif engine.config:
        report.deepspeed_config_world = world_size
        try:
            report.deepspeed_config = load(engine.config)(intent, needs, world_size=world_size, micro_batch_size=micro_batch_size)
        except AutoShardError as exc:
            report.notes.append(f"DeepSpeed config: {exc}")
    if (intent.tensor_parallel_size > 1 or intent.data_parallel_size is not None) and getattr(report.plan, "tp_plan", None) is None:
        report.notes.append("the memory table assumes pure data parallel (data_parallel_size = world size)")
    return True


class _Estimates:
    """Every estimate explain makes (the table's, then the ``--budget`` advice's candidates), cached by option, on the
    one estimator (``budget.Simulator``): model states plus a simulated step where one can run; a step that cannot
    run leaves the model states, and why in ``why``. A step costs seconds: the budget search reuses every estimate
    made before it."""

    def __init__(self, report: Report, subject: Subject, make_batch: Callable[[], Any] | None, o: ExplainOptions) -> None:
        self.report, self.make_batch = report, make_batch
        self.intent, self.module = report.intent, report.module
        self.chosen = report.decision.backend  # type: ignore[union-attr]
        has_tp = getattr(report.plan, "tp_plan", None) is not None
        tokens = batch_tokens(make_batch) if make_batch is not None and has_tp else None
        model = ModelStates(subject, self.chosen, resolve_precision(None, self.intent), o.devices_per_node, tokens=tokens)
        self.sim = Simulator(model, make_batch, self.intent, o.progress)
        self.why: dict[str, str] = {}  # an estimate's key -> why its step is partial or missing, with the Fix
        self.failures: list[str] = []  # the table's steps that raised (notes, unless the answer is incomplete anyway)
        self.done: dict[str, MemoryEstimate] = {}

    def prepare(self, simulate: bool) -> None:
        """Whether steps are simulated (asked, and a batch or an example input to run), and why not."""
        has_example = getattr(self.module, "example_input_array", None) is not None
        self.asked_step = simulate  # the user did not pass --no-step
        if not simulate:
            self.unsimulated = "--no-step asks for model states only. Fix: drop --no-step" + (
                "" if self.make_batch is not None or has_example else " and pass --batch FILE.py:make_batch"
            )
        else:
            self.unsimulated = (
                f"no --batch was given, and {type(self.module).__name__} has no example_input_array to forward. Fix: pass"
                f" --batch FILE.py:make_batch (a function of no arguments returning one micro-batch, as your DataLoader"
                f" yields it)"
            )
        self.simulate = simulate and (self.make_batch is not None or has_example)

    def estimate(self, option: Option) -> MemoryEstimate:
        key = repr(option)
        if key in self.done:
            return self.done[key]
        est = self.sim.model.of(option.intent, [option.world_size])[0]  # model states: batch-independent
        if self.simulate and option.simulate:
            est = self._with_step(option, key, est)
        elif not self.simulate:
            self.why[key] = self.unsimulated
        self.done[key] = est
        return est

    def _with_step(self, option: Option, key: str, est: MemoryEstimate) -> MemoryEstimate:
        """``est`` with the option's simulated step; when it cannot run, ``est`` alone and the reason in ``why``."""
        table = option.intent == self.intent and option.batch_divisor == 1  # not a budget candidate
        try:
            step = self.sim.measure(option.intent, option.world_size, option.batch_divisor)
        except AutoShardError as exc:  # the model states stand; say why activations are missing
            self.why[key] = str(exc)
            if table:
                self.failures.append(str(exc))
            return est
        if table:
            self.report.notes.extend(n for n in step.notes if n not in self.report.notes)
        if step.incomplete:
            self.why[key] = step.incomplete
        return with_step(est, step, self.sim.whole_step)


def _say_what_is_missing(report: Report, estimates: _Estimates, asked: bool) -> None:
    """A partial estimate is said once, with its Fix: as the answer's failure when --batch or --budget asked for the
    whole step (``asked``), else as a note."""
    partial = [e for e in report.memory if _lacks(e)]
    if partial and asked:
        e = max(partial, key=lambda e: e.world_size)  # the largest world size: the one the budget verdict is for
        reason = estimates.why.get(repr(Option(report.intent, e.world_size)), "no simulated step")
        report.incomplete = f"{_lacks(e)} not counted (world size {e.world_size}): {reason}"
    else:
        report.notes += [f"activations not counted: {f}" for f in dict.fromkeys(estimates.failures)]
    if estimates.make_batch is not None and not any(e.step_peak or e.activations for e in report.memory):
        report.unmeasured = "--no-step (model states only)" if not estimates.asked_step else "the step could not run on --batch (see below)"
    if not estimates.sim.whole_step and report.memory and report.memory[0].activations:
        report.notes.append(
            f"activations come from a simulated FSDP2 step of the same method; {estimates.chosen}'s own buffers are its estimator's figures"
        )


def _auto(
    factory: Any, make_batch: Callable[[], Any] | None, intent: ShardingIntent, sizes: Sequence[int], budget: int, backend: str, o: ExplainOptions
) -> list[dict[str, Any]]:
    """What ``ShardingIntent(memory_budget=budget)`` would choose at each world size (``budget.auto_entries``), or
    why there is no decision when the step cannot be simulated."""
    why = ""
    if not o.simulate:
        why = "memory_budget is decided on simulated steps, and --no-step skips them. Fix: drop --no-step"
    elif make_batch is None:
        why = (
            "memory_budget is decided on one micro-batch, never on model states alone. Fix: pass --batch FILE.py:make_batch"
            " (a function returning one micro-batch, as your DataLoader yields it)"
        )
    if why:
        return [{"world_size": n, "budget": budget, "error": {"type": "IncompleteEstimate", "message": why, "min_world_size": None}} for n in sizes]
    options = DecideOptions(devices_per_node=o.devices_per_node, progress=o.progress)
    return auto_entries(factory, make_batch, intent, sizes, budget, backend=backend, options=options, device_type=_device_type(o.accelerator))


def _device_type(accelerator: str | None) -> str:
    """The device whose headroom the budget keeps: ``--accelerator``'s (a laptop explaining a GPU run with
    ``--accelerator gpu`` prices it as the run's own decision at fit will), else this machine's, as ``decide``."""
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _lacks(estimate: MemoryEstimate) -> str:
    """The part of a training step an estimate's peak lacks: "" when a whole step was simulated."""
    if not (estimate.step_peak or estimate.activations):
        return "activations"
    if estimate.forward_only:
        return "the backward and the optimizer step"
    return ""


def _fitting_world_sizes(intent: ShardingIntent, sizes: Sequence[int], devices_per_node: int, notes: list[str]) -> list[int]:
    """The world sizes the intent's shard_size fits (it must divide the data-parallel size); a note for the rest."""
    kept, dropped = [], []
    for size in sizes:
        try:
            ParallelDims.resolve(intent, size, nodes_for(size, devices_per_node))
        except IntentError:
            dropped.append(size)
        else:
            kept.append(size)
    tp = intent.tensor_parallel_size
    by_tp = tp > 1 and intent.shard_size is None
    if not kept and by_tp:
        raise IntentError(
            f"tensor_parallel_size={tp} fits none of the world sizes {', '.join(map(str, sizes))} (each must be a multiple"
            f" of it). Fix: list multiples of it, e.g. --world-sizes {','.join(str(tp * k) for k in (1, 2, 4, 8))}"
        )
    if not kept:
        shard = devices_per_node if intent.shard_size == "node" else int(intent.shard_size or 1)
        raise IntentError(
            f"shard_size={intent.shard_size!r} fits none of the world sizes {', '.join(map(str, sizes))}."
            f" Fix: list world sizes that are multiples of it, e.g. --world-sizes {','.join(str(shard * k) for k in (1, 2, 8))}"
        )
    if dropped:
        field = f"tensor_parallel_size={tp}" if by_tp else f"shard_size={intent.shard_size!r}"
        notes.append(f"world size(s) {', '.join(map(str, dropped))} left out: {field} does not divide them")
    return kept


# -- command line ---------------------------------------------------------------------------------------------------
def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes takes positive integers separated by commas, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text!r}")
    return value


def world_sizes_for(
    world_sizes: Sequence[int] | None, devices: int | None, num_nodes: int | None, devices_per_node: int | None
) -> tuple[tuple[int, ...], int]:
    """The table's world sizes and the ranks per node: ``--devices N [--num-nodes M]`` mean what
    ``Trainer(devices=N, num_nodes=M)`` means (one world size, N x M); ``--world-sizes`` lists several instead.
    Both, or a --devices-per-node that disagrees with --devices, are refused rather than one silently winning."""
    trainer_words = " ".join(f"--{k} {v}" for k, v in (("devices", devices), ("num-nodes", num_nodes)) if v is not None)
    if trainer_words and world_sizes is not None:
        raise AutoShardError(
            f"{trainer_words} and --world-sizes {','.join(map(str, world_sizes))} both set the world size: {trainer_words}"
            f" is the Trainer's (devices = processes per node, world size = devices x num_nodes), --world-sizes lists"
            f" world sizes for the table. Fix: keep one, e.g. {trainer_words} alone"
        )
    if devices is not None and devices_per_node is not None and devices_per_node != devices:
        raise AutoShardError(
            f"--devices {devices} and --devices-per-node {devices_per_node} disagree: --devices is the Trainer's"
            f" processes per node, the same thing. Fix: drop --devices-per-node"
        )
    per_node = devices or devices_per_node or DEFAULT_DEVICES_PER_NODE
    if trainer_words:
        return (per_node * (num_nodes or 1),), per_node
    return tuple(world_sizes or DEFAULT_WORLD_SIZES), per_node


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="path/to/file.py:factory or package.module:factory returning a LightningModule (or (module, callbacks))",
    )
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="auto", help="the backend to explain (default: auto, as strategy='auto-shard')")
    parser.add_argument("--precision", default=None, help="Trainer precision to plan for (default: bf16-mixed)")
    parser.add_argument(
        "--intent", action="append", default=[], metavar="KEY=VALUE", help="a ShardingIntent field, repeatable (shard/exclude take comma lists)"
    )
    parser.add_argument("--intent-file", default=None, metavar="FILE", help="YAML or JSON mapping of ShardingIntent fields")
    parser.add_argument(
        "--world-sizes",
        type=_world_sizes,
        default=None,
        metavar="N,N,...",
        help="world sizes (ranks in all) for the memory table (default: 1,2,8,64)",
    )
    parser.add_argument(
        "--devices",
        type=_positive,
        default=None,
        metavar="N",
        help="as Trainer(devices=N): processes per node; the table is then for one world size, devices x --num-nodes (not with --world-sizes)",
    )
    parser.add_argument(
        "--num-nodes", type=_positive, default=None, metavar="M", help="as Trainer(num_nodes=M) (default 1): world size = devices x M"
    )
    parser.add_argument(
        "--accelerator", default=None, type=str.lower, choices=ACCELERATORS, help="'cpu' to check a CPU (gloo) run; default: a GPU run"
    )
    parser.add_argument("--micro-batch-size", type=_positive, default=1, help="per-rank batch size for the DeepSpeed config (default: 1)")
    parser.add_argument(
        "--batch",
        default=None,
        metavar="FILE.py:make_batch",
        help="a function returning one micro-batch per rank: one training step is simulated on fake tensors, so the peak includes activations (default: forward of example_input_array)",
    )
    parser.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="device memory per rank, e.g. 80GiB: says whether the largest world size fits, and if not, the fewest changes that would;"
        ' and what ShardingIntent(memory_budget=...) would choose at each world size (JSON: "auto")',
    )
    parser.add_argument(
        "--devices-per-node",
        type=_positive,
        default=None,
        metavar="N",
        help=f"ranks per node, for shard_size='node' and inter-node traffic (default: {DEFAULT_DEVICES_PER_NODE}, or --devices)",
    )
    parser.add_argument("--no-step", action="store_true", help="do not simulate a step: model states only (fast)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--write-matrix", default=None, metavar="PATH", help="regenerate the capability matrix page (docs/matrix.md) and exit")


def cmd_explain(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Run explain for parsed arguments; the exit status is ``Report.exit_code``. With --json a failure is JSON too,
    even one before the model is built: a script reads one object on stdout whatever happened."""
    stream = stream or sys.stdout
    if args.write_matrix:
        try:
            write_matrix(args.write_matrix)
        except OSError as exc:
            raise AutoShardError(
                f"cannot write the capability matrix page to {args.write_matrix}: {exc.strerror or exc}."
                f" Fix: give the path of a writable file, e.g. --write-matrix docs/matrix.md"
            ) from None
        print(f"wrote the capability matrix to {args.write_matrix}", file=stream)
        return 0
    done: dict[str, Any] = {"target": args.target}
    try:
        if not args.target:
            raise AutoShardError("explain needs a TARGET. Fix: e.g. autoshard explain autoshard.demo:DinoLike (or --write-matrix PATH)")
        sizes, per_node = world_sizes_for(args.world_sizes, args.devices, args.num_nodes, args.devices_per_node)
        intent = build_intent(args.intent, args.intent_file, args.precision)
        done["intent"] = intent.to_dict()
        report = explain(
            args.target,
            backend=args.backend,
            intent=intent,
            world_sizes=sizes,
            batch=args.batch,
            budget=args.budget,
            options=ExplainOptions(
                accelerator=args.accelerator,
                micro_batch_size=args.micro_batch_size,
                devices_per_node=per_node,
                simulate=not args.no_step,
                progress=lambda line: print(f"autoshard explain: {line}", file=sys.stderr, flush=True),
            ),
        )
    except AutoShardError as exc:
        if not args.json:
            raise
        done["error"] = {"type": type(exc).__name__, "message": str(exc)}
        print(json.dumps(done, indent=1), file=stream)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str), file=stream)
    else:
        color = stream.isatty() and "NO_COLOR" not in os.environ
        print(report.text(color=color), file=stream)
    return report.exit_code


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``autoshard explain`` to the ``autoshard`` command (cli.py calls this)."""
    summary = "show what autoshard would do with a module: needs, backend, plan, memory per rank"
    parser = command_parser(subparsers, "explain", summary, __doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    parser.set_defaults(func=cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m autoshard.explain``: the same as ``autoshard explain``, --json errors of argparse's included."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="autoshard explain", description=__doc__.splitlines()[0] if __doc__ else None, allow_abbrev=False)
    add_arguments(parser)
    as_json = "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
    if as_json:

        def refuse(message: str) -> NoReturn:  # argparse would print text and exit 2
            error = {"type": "UsageError", "message": f"{message}. Fix: see `autoshard explain --help`"}
            print(json.dumps({"target": None, "error": error}, indent=1))
            raise SystemExit(1)

        parser.error = refuse  # type: ignore[method-assign]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        if as_json and exc.code == 1:
            return 1
        raise
    try:
        return cmd_explain(args)
    except AutoShardError as exc:
        print(f"autoshard: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
