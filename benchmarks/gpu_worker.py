"""One configuration of the GPU benchmark (benchmarks/gpu_check.py), in a process of its own (fresh CUDA state, exact
peaks): a Hugging Face Llama in a plain LightningModule, bf16-mixed, fused AdamW, world size 1, trained for a few
steps under one strategy. Writes one JSON object: step time (median after warm-up), tokens/s, MFU, the allocator's
peak allocated and reserved, what the device holds outside the allocator, and, for autoshard's fsdp2 configurations,
the simulated peak of the same step (``autoshard.activations.measure_step`` + model states, as explain computes it).

    python benchmarks/gpu_worker.py CONFIG --out result.json [--layers 16 --hidden 2048 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

PEAK_BF16 = 989.4e12  # H100/H200 SXM dense bf16 (the MFU denominator of shared/README.md's fifth pass)
# --cpu: the smoke run of the whole script on a machine without a GPU (gpu_check.py --smoke): timings and allocator
# figures mean nothing there, but every configuration, the decision tables and the JSON are exercised.
CUDA = torch.cuda.is_available()


def cuda_figure(read: Any) -> int:
    """An allocator figure on CUDA; 0 in a CPU smoke run."""
    return int(read()) if CUDA else 0


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        use_cache=False,
        attn_implementation="sdpa",
    )


def module_class(args: argparse.Namespace, hand_written: bool = False, compile_layers: bool = False) -> type:
    import lightning.pytorch as pl
    from transformers import LlamaForCausalLM

    config = llama_config(args)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            device = "cuda" if torch.cuda.is_available() else "cpu"
            with torch.device(device if not args.meta else "meta"):
                self.model = LlamaForCausalLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids = batch[0] if isinstance(batch, (list, tuple)) else batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=torch.cuda.is_available())

        def configure_model(self) -> None:
            if not hand_written:
                return
            # The plan an expert writes (torchtitan's): each decoder layer a unit (compiled in place first, so its
            # hooks fire), then the root; bf16 gathers, fp32 reduce.
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = self.device_mesh["data_parallel"]
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in self.model.model.layers:
                if compile_layers:
                    layer.compile()
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(self.model, mesh=mesh, mp_policy=mp)

    return LM


def tuned_deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ZeRO-3 config an expert writes for one GPU node (DeepSpeed's tuning guide): overlapped, contiguous
    gradients, large buckets and prefetch, small parameters kept whole, no clipping (as the other runs)."""
    return {  # the micro-batch and accumulation come from the Trainer (Lightning refuses them here)
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "sub_group_size": 1e9,
        },
    }


def matched_deepspeed_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``AutoShardDeepSpeedStrategy``'s arguments for the tuned config: its zero block, and its gradient reduction in
    bf16 (DeepSpeed's default under bf16, where autoshard's bf16-mixed reduces in fp32 as FSDP2 does). DeepSpeed reads
    the same ZeRO config from both (tests/adapters/test_deepspeed_config.py), so what the two rows differ by is
    autoshard's own."""
    return {"reduce_dtype": "bfloat16", "zero_overrides": dict(tuned_deepspeed_config(args)["zero_optimization"])}


def leaf_blocks(module_cls: type) -> type:
    """The module with each decoder layer a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_modules``): DeepSpeed
    gathers and releases a layer's parameters at once, from the layer's hooks, instead of hooking every submodule.
    On CPU that took a third of ZeRO-3's host time per step away, below FSDP2's (docs/benchmarks.md); measured here
    before autoshard does it."""

    class Leaf(module_cls):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__()
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(self.model, [type(self.model.model.layers[0])])

    return Leaf


def strategy_for(name: str, args: argparse.Namespace) -> tuple[Any, type]:
    """(the Trainer's strategy, the module class) of one configuration."""
    from autoshard.lightning.fsdp2 import FSDP2Strategy

    plain = module_class(args)
    if name == "plain":
        return "auto", plain
    if name == "auto-shard":
        return "auto-shard", plain
    if name == "hand-written":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), module_class(args, hand_written=True)
    if name == "hand-written-compiled":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), module_class(args, True, True)
    if name == "compile":
        return FSDP2Strategy(compile=True), plain
    if name.startswith("ac-"):
        mode = name[3:]
        return FSDP2Strategy(activation_checkpointing={"true": True, "selective": "selective"}.get(mode, mode.isdigit() and int(mode))), plain
    if name == "budget-diagnose":  # budget-20GiB, decided once more before fit (see run)
        return FSDP2Strategy(memory_budget="20GiB"), plain
    if name.startswith("budget-"):
        return FSDP2Strategy(memory_budget=name[len("budget-") :]), plain
    if name == "deepspeed":
        return "autoshard-deepspeed", plain
    if name == "deepspeed-knobs":  # autoshard-deepspeed with the tuned config's three sizes: which part of the gap they are
        from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

        tuned = tuned_deepspeed_config(args)["zero_optimization"]
        knobs = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
        return AutoShardDeepSpeedStrategy(zero_overrides={k: tuned[k] for k in knobs}), plain
    if name == "deepspeed-matched":  # every speed key of the tuned config, its bf16 gradient reduction too: autoshard's own cost
        from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

        return AutoShardDeepSpeedStrategy(**matched_deepspeed_arguments(args)), plain
    if name == "deepspeed-leaf":  # deepspeed-matched, each decoder layer fetched whole (one hook, like an FSDP2 unit)
        from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

        return AutoShardDeepSpeedStrategy(**matched_deepspeed_arguments(args)), leaf_blocks(plain)
    if name == "deepspeed-tuned":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=tuned_deepspeed_config(args)), plain
    raise SystemExit(f"unknown configuration {name!r}")


class StepClock:
    """CUDA-synchronised wall time of each step; the allocator's peaks over the measured steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.start = warmup, [], 0.0

    def callback(self) -> Any:
        import lightning.pytorch as pl

        clock = self

        class Clock(pl.Callback):
            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                if CUDA:
                    torch.cuda.synchronize()
                if batch_idx == clock.warmup and CUDA:
                    torch.cuda.reset_peak_memory_stats()
                clock.start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                if CUDA:
                    torch.cuda.synchronize()
                if batch_idx >= clock.warmup:
                    clock.times.append(time.perf_counter() - clock.start)

        return Clock()


def simulated_peak(name: str, args: argparse.Namespace, strategy: Any, module_cls: type) -> int | None:
    """The device peak explain gives for this fsdp2 configuration (model states + the simulated step), or None."""
    from autoshard.lightning.fsdp2 import FSDP2Strategy

    if name == "auto-shard":
        intent = None
    elif isinstance(strategy, FSDP2Strategy) and strategy.intent.memory_budget is None:
        intent = strategy.intent
    else:
        return None
    from autoshard.activations import measure_step
    from autoshard.intent import ShardingIntent
    from autoshard.memory import EstimateOptions, estimate_memory, with_step
    from autoshard.precision import resolve_precision

    intent = intent or ShardingIntent()
    precision = resolve_precision("bf16-mixed", intent)
    ids = torch.zeros(args.micro_batch, args.seq, dtype=torch.long)
    args.meta = True
    try:
        step = measure_step(module_cls, intent, 1, precision, make_batch=lambda: [ids])
        with torch.device("meta"):
            module = module_cls()
        return with_step(estimate_memory(module, intent, world_size=1, options=EstimateOptions(precision=precision)), step, True).device
    finally:
        args.meta = False


def decided_before_fit(model: Any, ids: torch.Tensor, strategy: Any) -> dict[str, Any]:
    """The budget decided on the module as fit will see it (built on the GPU, CUDA initialised) but before fit (no
    process group, no Trainer): with the at-fit table and the CPU stage's (simulated.json "decision"), it tells
    whether a difference comes from the fit's context (session 7: every checkpointing candidate at 26.41 GiB at fit,
    16.53 GiB for every block in a fresh process)."""
    from autoshard.budget import DecideOptions, decide

    start = time.perf_counter()
    try:
        decision = decide(model, [ids], strategy.requested, 1, device_type="cuda", options=DecideOptions(precision="bf16-mixed"))
    except Exception as exc:  # noqa: BLE001  the diagnosis reports, the fit still runs
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "seconds": round(time.perf_counter() - start, 1)}
    return {"table": decision.table(), "decision": decision.to_dict(), "seconds": round(time.perf_counter() - start, 1)}


class StepLog:
    """Every simulated step this process runs (before fit and at fit, where CUDA keeps the decision in this process),
    by kind at its peak: which tensors make a peak, e.g. the flat 26.41 GiB = 32 bytes per parameter of session 7
    (at fit, AdamW fused; the CPU stage's price had fused=False). Wraps ``autoshard.activations.measure_step``,
    which the simulator looks up at each call."""

    def __init__(self) -> None:
        import autoshard.activations as activations

        self.module, self.original, self.steps = activations, activations.measure_step, []
        activations.measure_step = self.measure

    def measure(self, factory: Any, intent: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.original(factory, intent, *args, **kwargs)
        self.steps.append(
            {
                "activation_checkpointing": intent.activation_checkpointing,
                "offload": intent.offload,
                "cuda_initialized": torch.cuda.is_initialized(),
                "peak": step.peak,
                "at": step.at,
                "by_kind": dict(step.by_kind),
                "forward_only": step.forward_only,
            }
        )
        return step

    def close(self) -> list[dict[str, Any]]:
        self.module.measure_step = self.original
        return self.steps


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import autoshard  # noqa: F401  registers the strategies

    args.meta = False
    strategy, module_cls = strategy_for(name, args)
    result: dict[str, Any] = {"config": name}
    if args.simulate:
        t = time.perf_counter()
        result["simulated_peak"] = simulated_peak(name, args, strategy, module_cls)
        result["simulate_s"] = round(time.perf_counter() - t, 1)
    steps = args.warmup + args.steps
    ids = torch.randint(0, args.vocab, (steps * args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))
    clock = StepClock(args.warmup)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu" if CUDA else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        callbacks=[clock.callback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t = time.perf_counter()
    model = module_cls()
    params = sum(p.numel() for p in model.parameters())
    log = StepLog() if name.startswith("budget-") else None
    if name == "budget-diagnose":
        result["before_fit"] = decided_before_fit(model, ids[: args.micro_batch], strategy)
    try:
        trainer.fit(model, DataLoader(TensorDataset(ids), batch_size=args.micro_batch))
    finally:
        if log is not None:
            result["simulated_steps"] = log.close()
    result["fit_s"] = round(time.perf_counter() - t, 1)
    step = statistics.median(clock.times)
    tokens = args.micro_batch * args.seq
    flops = (6 * params + 12 * args.layers * args.hidden * args.seq) * tokens
    free, total = torch.cuda.mem_get_info() if CUDA else (0, 0)
    decision = getattr(trainer.strategy, "budget_decision", None)
    result.update(
        params=params,
        step_ms=round(step * 1e3, 2),
        step_ms_min=round(min(clock.times) * 1e3, 2),
        step_ms_max=round(max(clock.times) * 1e3, 2),
        tokens_per_s=round(tokens / step),
        mfu=round(flops / step / PEAK_BF16, 4),
        peak_allocated=cuda_figure(torch.cuda.max_memory_allocated),
        peak_reserved=cuda_figure(torch.cuda.max_memory_reserved),
        outside_allocator=(total - free) - cuda_figure(torch.cuda.memory_reserved),  # the CUDA context, NCCL, library workspaces
        device_total=total,
        steps_timed=len(clock.times),
        chosen=decision.chosen if decision is not None else None,
        decided_peak=decision.peak if decision is not None else None,
        decision_table=decision.table() if decision is not None else None,
        decision=decision.to_dict() if decision is not None else None,
        dynamo=dynamo_counts(),
    )
    return result


def dynamo_counts() -> dict[str, Any]:
    """What dynamo compiled in this run: the compiled rows should read alike (same graphs, frames, no break); autoshard's
    hooks traced on frames of their own had given compile=True one graph more, called at every block call (issue 31)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["total"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("config")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--simulate", action="store_true", help="also the simulated peak (fsdp2 configurations)")
    args = parser.parse_args()
    try:
        result = run(args.config, args)
    except BaseException as exc:  # noqa: BLE001  one configuration's failure is one row of the table
        result = {"config": args.config, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("traceback", "decision_table")}, default=str), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
