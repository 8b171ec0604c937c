"""The decision's search: the price of each configuration (the cost order below), and the cheapest configuration
whose simulated peak fits (when none does, ``decide`` asks ``ranks`` and ``batch`` for more ranks or a smaller micro-batch)."""

# The cost order. Every free field's option has a price, in estimated seconds per step on nominal hardware (Rates):
#   - activation checkpointing: the FLOPs its recomputation adds to the simulated step (forward, backward and
#     recomputation counted by torch's FlopCounterMode), at Rates.flops_per_s;
#   - reshard_after_forward=True: the all-gather bytes of the traffic model (memory.py: a unit is gathered again in
#     backward), at the link's rate (inter-node bytes at Rates.inter_node_bytes_per_s, the rest intra-node);
#   - offload='params': host-device bytes per step (each rank's shard of the parameters copied in for every
#     all-gather, its gradient shard copied out), at Rates.host_bytes_per_s;
#   - a smaller shard group (shard_size='node'): more memory (states divide by fewer ranks), less cross-node traffic:
#     its price is the traffic model's bytes at each link's rate, like resharding;
#   - compile=True (only under compile='auto', fsdp2): each block compiled in place; a saving, not a cost: the step's
#     FLOPs run Rates.compile_speedup times faster (its start-up, each block compiled once, is not priced), and the
#     simulated step counts the compiled blocks' activations (activations.compiled).
# A configuration's price is the sum. The cheapest configuration whose simulated peak fits the budget is chosen;
# ties go to fewer changes. Every cheaper configuration is listed with its peak and why it does not fit.
#
# Under DeepSpeed ZeRO-3 (backend='deepspeed') the knobs chosen are activation checkpointing (priced as above) and
# offload: 'none', then 'optimizer'
# (offload_optimizer: each step the gradient partition goes to the host, the updated parameter partition comes back),
# then 'params' (offload_param too: the parameter partition comes in for the forward's and the backward's gathers,
# gradients go out, the step runs on the host). Each saves more device memory than the one before and copies more.
# A peak there is DeepSpeed's own estimator (estimate_zero3_model_states_mem_needs: 4 x the largest layer + 18, 2 or
# 0 bytes per parameter / ranks) plus the activations of a simulated step of the same method (explain does the same).
# Activation checkpointing wraps the same blocks there as fsdp2's plan (``adapters.checkpointing.checkpointable_blocks``),
# so the simulated step with those blocks checkpointed gives DeepSpeed's activations too; 'selective' is not an option
# there (the matrix refuses it, Feature.SELECTIVE_CHECKPOINTING: ZeRO-3's gathers run inside the block).

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autoshard.backends import BudgetChoices, get_backend
from autoshard.budget.batch import batch_function
from autoshard.budget.decision import OFFLOAD_SAVING, Cost, Rates, Tried, default_rates, describe_config
from autoshard.budget.meta import meta_factory
from autoshard.budget.simulator import ModelStates, Simulator, Subject
from autoshard.errors import AutoShardError
from autoshard.intent import SELECTIVE, ShardingIntent
from autoshard.memory import fmt_bytes


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _choices(backend: str) -> BudgetChoices:
    return get_backend(backend).budget  # type: ignore[return-value]  # decide refused a backend without one


def _ac_options(blocks: int, backend: str) -> list[bool | int | str]:
    """False, every k-th block (k = 2, and 4 from 8 blocks), selective (where the backend takes it: not DeepSpeed),
    every block: steps between nothing and all."""
    if blocks == 0:
        return [False]
    every = [k for k in (2, 4) if k < blocks and (k == 2 or blocks >= 8)]
    return [False, *every, *([SELECTIVE] if _choices(backend).selective else []), True]


def _saves_at_least(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether configuration ``a`` saves at least as much memory as ``b`` in every field (so peak(a) <= peak(b))."""
    for key, va in a.items():
        vb = b[key]
        if va == vb and type(va) is type(vb):
            continue
        if key == "reshard_after_forward" and not (va is True and vb is False):
            return False
        if key == "offload" and OFFLOAD_SAVING[va] < OFFLOAD_SAVING[vb]:
            return False
        if key == "shard_size" and not (va is None and vb == "node"):
            return False
        if key == "activation_checkpointing" and not _ac_saves_at_least(va, vb):
            return False
        if key == "compile" and not (va is True and vb is False):
            return False
    return True


def _ac_saves_at_least(a: bool | int | str, b: bool | int | str) -> bool:
    if b is False or a is True:
        return True
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and not isinstance(b, bool):
        return a <= b  # every 2nd block saves more than every 4th
    return False


def config_cost(sim: Simulator, config: dict[str, Any], world_size: int, flops: dict[Any, int], rates: Rates) -> Cost:
    states = sim.states(config, world_size)
    ac = config.get("activation_checkpointing", sim.base.activation_checkpointing)
    base_ac = False if "activation_checkpointing" in config else sim.base.activation_checkpointing
    recompute = max(0, flops.get(ac, 0) - flops.get(base_ac, 0)) if ac in flops and base_ac in flops else 0
    offload = config.get("offload", sim.base.offload)
    reshard = config.get("reshard_after_forward", sim.base.reshard_after_forward)
    host = _choices(sim.backend).host_bytes(states, offload, reshard)  # see the cost order above
    compiled = flops.get(ac, 0) if config.get("compile", sim.base.compile) is True else 0
    selective = ac == SELECTIVE and recompute > 0
    cost = Cost(recompute, states.intra_node_bytes, states.inter_node_bytes, host, selective=selective, compiled_flops=compiled)
    return replace(cost, seconds=cost.at(rates))


def price(
    module: Any,
    batch: Any,
    intent: ShardingIntent,
    world_size: int,
    configs: Sequence[dict[str, Any]],
    *,
    rates: Rates | None = None,
    precision: Any = None,
    backend: str = "fsdp2",
) -> list[tuple[int, Cost]]:
    """(device peak per rank, price) of each configuration (ShardingIntent fields over ``intent``), as ``decide``
    computes them on ``backend``: one simulated step each, plus one without activation checkpointing for the
    recomputed FLOPs. ``precision``: a resolved plan, or what a Trainer takes ("bf16-mixed"), as ``decide``."""
    from autoshard.precision import PrecisionPlan, resolve_precision

    rates = rates or default_rates()
    base = intent.replace(memory_budget=None, memory_headroom=None, pinned=())
    plan = precision if isinstance(precision, PrecisionPlan) else resolve_precision(precision, intent)
    states = ModelStates(Subject.build(meta_factory(module)), get_backend(backend).name, plan, world_size)
    sim = Simulator(states, batch_function(batch), base, None)
    flops: dict[Any, int] = {}
    peaks: dict[str, int] = {}
    for config in [{**c, "activation_checkpointing": False} for c in configs] + list(configs):
        estimate, step_flops = sim.step(dict(config), world_size)
        flops.setdefault(config.get("activation_checkpointing", base.activation_checkpointing), step_flops)
        peaks[config_key(config)] = estimate.device
    return [(peaks[config_key(c)], config_cost(sim, dict(c), world_size, flops, rates)) for c in configs]


def _options(field_name: str, blocks: int, backend: str) -> list[Any]:
    """Each free field's options, cheapest (least saving) first."""
    return {
        "reshard_after_forward": [False, True],
        "activation_checkpointing": _ac_options(blocks, backend),
        "offload": list(_choices(backend).offload),
        "shard_size": ["node", None],
        "compile": [False, True] if blocks else [False],
    }[field_name]


def search_configs(
    sim: Simulator, world_size: int, budget: int, rates: Rates, free: list[str], blocks: int, limit_words: str = "the budget"
) -> tuple[Tried | None, list[Tried], dict[str, Any]]:
    """(the cheapest configuration that fits or None, every cheaper one tried, the most saving configuration).

    Order of work, to simulate few steps: the cheapest configuration first (it fits: done); then the most saving
    one (it does not: nothing fits at this world size); then one step per activation-checkpointing option (its
    recomputed FLOPs are its price); then the rest in price order, skipping (as lower bounds) those that save no
    more than one already over the budget. ``budget`` is the largest peak admitted (the budget less its headroom, which
    ``limit_words`` names in the table).
    """
    grid = [dict(zip(free, values)) for values in itertools.product(*(_options(f, blocks, sim.backend) for f in free))]
    most = grid[-1]
    flops: dict[Any, int] = {}
    peaks: dict[str, int] = {}
    ats: dict[str, str] = {}  # where each simulated configuration peaks
    changes = lambda c: sum(c[f] != getattr(sim.base, f) for f in free)  # noqa: E731  ties: fewer changes
    # The cheapest: nothing recomputed, nothing offloaded, the cheapest resharding and shard group by the traffic
    # model (no step needed to price those; at one rank resharding is free, so the default stays).
    plain = [c for c in grid if not c.get("activation_checkpointing") and c.get("offload", "none") == "none"]
    cheapest = min(plain, key=lambda c: (config_cost(sim, c, world_size, flops, rates).seconds, changes(c)))

    def simulate(config: dict[str, Any]) -> int:
        estimate, step_flops = sim.step(config, world_size)
        flops.setdefault(config.get("activation_checkpointing", sim.base.activation_checkpointing), step_flops)
        peaks[config_key(config)] = estimate.device
        ats[config_key(config)] = estimate.step_at
        return estimate.device

    if simulate(cheapest) <= budget:  # a failure here is the step's own (nothing saved yet): it stands
        cost = config_cost(sim, cheapest, world_size, flops, rates)
        return Tried(cheapest, peaks[config_key(cheapest)], cost, True, at=ats[config_key(cheapest)]), [], most
    if simulate(most) > budget:
        return None, [], most
    cannot: dict[Any, str] = {}  # activation-checkpointing option -> why its step cannot run (the cheapest step ran)
    if "activation_checkpointing" in free:
        for option in _ac_options(blocks, sim.backend):
            try:
                simulate({**cheapest, "activation_checkpointing": option})
            except AutoShardError as exc:
                cannot[option] = cannot_run(sim, {"activation_checkpointing": option}, exc)
    priced = sorted(grid, key=lambda c: (config_cost(sim, c, world_size, flops, rates).seconds, changes(c)))
    tried: list[Tried] = []
    over: list[dict[str, Any]] = []
    for config in priced:
        cost = config_cost(sim, config, world_size, flops, rates)
        failed = cannot.get(config.get("activation_checkpointing", sim.base.activation_checkpointing))
        if failed is not None:
            tried.append(Tried(config, 0, cost, False, failed, simulated=False, runs=False))
            continue
        dominant = next((o for o in over if _saves_at_least(o, config)), None)
        if config_key(config) not in peaks and dominant is not None:
            bound = peaks[config_key(dominant)]
            why = f"saves no more than {describe_config(dominant)}, which peaks at {fmt_bytes(bound)} (over {limit_words}): not simulated"
            tried.append(Tried(config, bound, cost, False, why, simulated=False))
            continue
        try:
            peak = peaks[config_key(config)] if config_key(config) in peaks else simulate(config)
        except AutoShardError as exc:
            tried.append(Tried(config, 0, cost, False, cannot_run(sim, config, exc), simulated=False, runs=False))
            continue
        at = ats.get(config_key(config), "")
        if peak <= budget:
            return Tried(config, peak, cost, True, at=at), tried, most
        over.append(config)
        tried.append(Tried(config, peak, cost, False, f"{fmt_bytes(peak - budget)} over {limit_words}", at=at))
    return None, tried, most  # unreachable: the most saving configuration fits


def cannot_run(sim: Simulator, config: dict[str, Any], exc: AutoShardError) -> str:
    """Why a candidate's step cannot run, with its Fix, for the decision table: the candidate is left out and the
    decision goes on (the cheapest configuration's step ran, so the batch and the model are fine)."""
    cause = _first_error(str(exc))
    selective = config.get("activation_checkpointing") == SELECTIVE
    if selective and uses_hf_cache(sim.module):
        fix = (
            "set use_cache=False in the model's config (Hugging Face's own gradient checkpointing does: a cache made in"
            " forward is not recomputed alike), or set activation_checkpointing yourself"
        )
    else:
        fix = "set activation_checkpointing, offload and reshard_after_forward yourself to choose without it"
    return f"its simulated step fails ({cause}). Fix: {fix}"


def uses_hf_cache(module: Any) -> bool:
    """Whether a Hugging Face model inside ``module`` keeps a key/value cache in training (``config.use_cache``)."""
    return any(getattr(getattr(m, "config", None), "use_cache", False) is True for m in module.modules())


def _first_error(message: str) -> str:
    """The innermost ``SomeError: text`` of a message, up to its first sentence (the reason, without our wrapping)."""
    import re

    found = re.findall(r"\b([A-Z]\w*(?:Error|Exception): [^\n]*?)(?:\. |\.$|$)", message)
    return found[-1] if found else message.split(". Fix:")[0]
