"""Tensor parallel from the model's own plan against a hand-written torchtitan-style plan: ``python benchmarks/tp_step.py``.

4 gloo ranks on CPU, data parallel 2 x tensor parallel 2, one transformers Llama (hidden 256, 4 layers, 8 query and 4
key/value heads, vocabulary 2048), fp32 AdamW, micro-batches of 2 x 128 tokens per data-parallel rank. Both layouts
run in the same processes, on the same data, alternating in rounds; then ``fully_shard`` of each decoder layer and
the root over the data-parallel ranks:

- ``autoshard``: ``find_tp_plan(model).apply(model, mesh["tp"])``: transformers' own plan (``base_model_tp_plan`` +
  ``_tp_plan``), each projection a ``ColwiseParallel`` / ``RowwiseParallel`` taking a plain tensor, norms whole;
- ``hand-written``: what torchtitan writes per model (without its sequence parallelism, which needs the attention mask
  built for the whole sequence): ``PrepareModuleInput`` on the attention and the MLP, so that their projections share
  one DTensor input, the same ``ColwiseParallel`` / ``RowwiseParallel`` on the projections, vocabulary-parallel
  embedding, gathered head, norms replicated through ``distribute_module``.

Reported per step: the median time, and the collectives torch's profiler saw (count and kind). The step times are
CPU gloo times on a shared 2-core machine: they show the ratio, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=2048)
BATCH, SEQ = 2, 128
COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast")


def build() -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, attn_implementation="sdpa"))


def hand_written(model: Any, tp_mesh: Any) -> None:
    """torchtitan's structure on transformers' Llama modules, without sequence parallelism."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        plan[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()}, desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False
        )
        plan[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{layer}.{proj}"] = ColwiseParallel()
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{layer}.{proj}"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)

    def inputs(module: Any, args: Any, mesh: Any) -> Any:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

    for name, module in model.named_modules():
        if name.endswith("norm"):
            distribute_module(module, tp_mesh, input_fn=inputs, output_fn=lambda module, out, mesh: out.to_local())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    from autoshard._harness import write_result
    from autoshard.adapters.tp_plan import find_tp_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    base = build()
    models, opts = {}, {}
    for name in ("autoshard", "hand-written"):
        model = copy.deepcopy(base)
        if name == "autoshard":
            find_tp_plan(model).apply(model, mesh["tp"])  # type: ignore[union-attr]
        else:
            hand_written(model, mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        models[name], opts[name] = model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    batches = [torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(args.steps + 1)]

    def step(name: str, ids: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        loss = models[name](input_ids=ids, labels=ids).loss
        loss.backward()
        opts[name].step()
        opts[name].zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    for name in models:
        step(name, batches[0])  # warm-up
    for ids in batches[1:]:
        for name in models:
            times[name].append(step(name, ids))
            losses[name].append(models[name](input_ids=ids, labels=ids).loss.item())
    counts: dict[str, dict[str, int]] = {}
    for name in models:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(name, batches[1])
        seen: Counter[str] = Counter()
        for event in prof.key_averages():
            if any(c in event.key.lower() for c in COLLECTIVES) and "barrier" not in event.key.lower():
                seen[event.key] += event.count
        counts[name] = dict(seen)
    write_result(args.out, dist.get_rank(), {"times": times, "losses": losses, "collectives": counts})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set by the harness: this process is a rank
    args = parser.parse_args()
    if args.out is not None:
        worker(args)
        return
    import tempfile

    from autoshard._harness import run_workers

    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_workers(Path(__file__), ["--steps", str(args.steps)], Path(tmp), nprocs=4, timeout=1200)
    r0 = ranks[0]
    print(f"dp 2 x tp 2 on 4 CPU gloo ranks, {args.steps} timed steps per layout (median), Llama {SIZES}, {BATCH} x {SEQ} tokens per dp rank")
    for name in r0["times"]:
        slowest = [max(r["times"][name][i] for r in ranks) for i in range(args.steps)]
        print(f"  {name:<13} step {statistics.median(slowest) * 1e3:8.1f} ms   final loss {r0['losses'][name][-1]:.4f}")
        for key, n in sorted(r0["collectives"][name].items()):
            print(f"      {n:4d} x {key}")
    if os.environ.get("TP_STEP_JSON"):
        Path(os.environ["TP_STEP_JSON"]).write_text(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    main()
