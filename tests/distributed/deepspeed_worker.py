"""One rank of the DeepSpeed CPU checks; launched by test_deepspeed_engine.py through the harness.

``engine``: raw ZeRO-3 engines built from autoshard's ``deepspeed_config`` train (bf16 AdamW; fp32 SGD compared
with a single process). ``lightning``: Trainers with AutoShardDeepSpeedStrategy train with automatic, then manual
optimization, then a probe callback that builds its optimizer in ``setup()`` is refused, all in the same processes.
``reuse`` (one process): what ZeRO-3 keeps gathered from forward into backward, and the gradient reduce bucket it
allocates, against the memory estimate.
Each rank writes ``rank<R>.json``; the test asserts on those numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from datetime import timedelta
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch
from torch import nn

from tests.distributed.harness import worker_main, write_result

PG_TIMEOUT = timedelta(seconds=int(os.environ.get("AUTOSHARD_TEST_PG_TIMEOUT", "90")))
IN, HIDDEN = 256, 512  # HIDDEN x IN = 131072 elements: above ZeRO-3's default persistence threshold (1e5)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank, as a real job loading one checkpoint
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def make_data(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(IN, 1, generator=g) / IN**0.5
    g.manual_seed(100 + rank)  # each rank its own slice of the data, as a DistributedSampler gives
    x = torch.randn(n, IN, generator=g)
    return x, torch.tanh(x @ w)


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Gather every ZeRO-3 partition and copy the full tensors (collective: every rank must call it)."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().float().clone() for name, p in params.items()}


def partition_report(module: nn.Module) -> dict[str, dict[str, Any]]:
    return {
        name: {"full": int(p.ds_numel), "local": int(p.ds_tensor.numel()), "placeholder": int(p.numel())} for name, p in module.named_parameters()
    }


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float((after[name] - before[name]).abs().max()) for name in before}


MICRO, ACCUMULATE, STEPS = 16, 2, 10


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def sgd(params: Any) -> torch.optim.Optimizer:
    # Linear in the gradient, so a comparison is exact to rounding (Adam amplifies rounding where grads are ~0).
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def single_process_sgd(steps: list[list[tuple[torch.Tensor, torch.Tensor]]], clip: float | None = None) -> dict[str, torch.Tensor]:
    """Plain fp32 training in one process, one list of global micro-batches per step: what ZeRO-3 must reproduce."""
    model = make_model()
    optimizer = sgd(model.parameters())
    for micro_batches in steps:
        optimizer.zero_grad()
        for x, y in micro_batches:
            (nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_weights(world: int) -> dict[str, torch.Tensor]:
    """The raw-engine run in one process: each global micro-batch is the union of every rank's micro-batch."""
    data = [make_data(r, MICRO * ACCUMULATE * STEPS) for r in range(world)]

    def global_micro(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = slice(i * MICRO, (i + 1) * MICRO)
        return torch.cat([x[part] for x, _ in data]), torch.cat([y[part] for _, y in data])

    return single_process_sgd([[global_micro(step * ACCUMULATE + m) for m in range(ACCUMULATE)] for step in range(STEPS)])


def train_engine(precision: str | None, rank: int, world: int, make_optimizer: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    import deepspeed

    from autoshard.adapters.deepspeed import deepspeed_config
    from autoshard.intent import ShardingIntent

    t0 = time.perf_counter()
    config = deepspeed_config(ShardingIntent(precision=precision), world_size=world, micro_batch_size=MICRO, accumulate_grad_batches=ACCUMULATE)
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    before = full_weights(engine.module)
    x, y = make_data(rank, MICRO * ACCUMULATE * STEPS)
    x_eval, y_eval = make_data(99, 64)  # the same held-out batch on both ranks
    dtype = next(engine.module.parameters()).dtype

    def eval_loss() -> float:
        with torch.no_grad():  # a ZeRO-3 forward gathers partitions: every rank runs it
            return float(nn.functional.mse_loss(engine(x_eval.to(dtype)).float(), y_eval))

    eval_before = eval_loss()
    losses: list[float] = []
    for step in range(STEPS):
        step_losses = []
        for micro in range(ACCUMULATE):
            i = (step * ACCUMULATE + micro) * MICRO
            loss = nn.functional.mse_loss(engine(x[i : i + MICRO].to(dtype)).float(), y[i : i + MICRO])
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))
    eval_after = eval_loss()
    after = full_weights(engine.module)
    result = {
        "config": config,
        "param_dtype": str(dtype),
        # gathering really reassembles the partitions: the full weights equal the model's initial ones
        "gathered_equals_initial": all(torch.equal(before[n], initial[n].to(dtype).float()) for n in initial),
        "losses": losses,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "global_steps": int(engine.global_steps),
        "partition": partition_report(engine.module),
        "max_change": changed(before, after),
        "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
        "seconds": time.perf_counter() - t0,
    }
    return result, after


def run_engine(rank: int) -> dict[str, Any]:
    import deepspeed

    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo", timeout=PG_TIMEOUT)
    world = torch.distributed.get_world_size()
    results: dict[str, Any] = {"world_size": world, "seconds_init_distributed": time.perf_counter() - t0}
    results["bf16-mixed"], _ = train_engine(None, rank, world, adamw)  # None: the intent's default precision
    results["32-true"], trained = train_engine("32-true", rank, world, sgd)
    reference = reference_weights(world)
    results["32-true"]["max_diff_vs_single_process"] = max(float((trained[n] - reference[n]).abs().max()) for n in reference)
    results["seconds_total"] = time.perf_counter() - t0
    return results


LIGHTNING_BATCH, LIGHTNING_STEPS, CLIP = 8, 3, 1.0
QUIET: dict[str, Any] = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def lightning_reference(x: torch.Tensor, y: torch.Tensor, world: int, accumulate: int, clip: float | None) -> dict[str, torch.Tensor]:
    """What the 2-rank fit must equal: one process, global batches of world x 8 consecutive samples.

    Each rank reads samples rank::world in order (the test's own loader), so each step's global batch is one
    consecutive chunk; equal per-rank sizes make the mean of rank means the global mean.
    """
    chunk = LIGHTNING_BATCH * world
    starts = [[(step * accumulate + micro) * chunk for micro in range(accumulate)] for step in range(LIGHTNING_STEPS)]
    weights = single_process_sgd([[(x[k : k + chunk], y[k : k + chunk]) for k in step] for step in starts], clip)
    return {f"net.{n}": p for n, p in weights.items()}


def run_lightning(rank: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    class Regressor(pl.LightningModule):
        def __init__(self, manual: bool) -> None:
            super().__init__()
            self.net = make_model()
            self.automatic_optimization = not manual
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses.append(float(loss.detach()))
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

    world = int(os.environ["WORLD_SIZE"])  # Lightning's environment teardown deletes WORLD_SIZE after a fit
    results: dict[str, Any] = {}
    t0 = time.perf_counter()
    for mode in ("automatic", "manual"):
        t = time.perf_counter()
        # automatic: DeepSpeed (not Lightning) accumulates 2 batches and clips; manual: one batch per step, no clip
        accumulate, clip = (2, CLIP) if mode == "automatic" else (1, None)
        module = Regressor(manual=mode == "manual")
        x, y = make_data(0, LIGHTNING_BATCH * world * LIGHTNING_STEPS * accumulate)
        # Each rank its round-robin slice, unshuffled, so the single-process reference is exact.
        loader = DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=LIGHTNING_BATCH)
        # automatic states the precision in the intent too; manual leaves it to the Trainer, the source of truth
        strategy = AutoShardDeepSpeedStrategy({"precision": "32-true"} if mode == "automatic" else None, timeout=PG_TIMEOUT)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            precision="32-true",
            max_steps=LIGHTNING_STEPS,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            use_distributed_sampler=False,
            **QUIET,
        )
        before = {n: p.detach().clone() for n, p in module.named_parameters()}  # plain tensors before setup
        trainer.fit(module, loader)
        engine = strategy.deepspeed_engine
        after = full_weights(engine.module)
        reference = lightning_reference(x, y, world, accumulate, clip)
        results[mode] = {
            "engine": type(engine).__name__,
            "config": strategy.config,
            "root_device": str(strategy.root_device),
            "process_group_backend": torch.distributed.get_backend(),
            "global_step": trainer.global_step,
            "engine_global_steps": int(engine.global_steps),
            "losses": module.losses,
            "partition": partition_report(engine.module),
            "max_change": changed(before, after),
            "max_diff_vs_single_process": max(float((after[n] - reference[n]).abs().max()) for n in reference),
            "finite": all(bool(torch.isfinite(t).all()) for t in after.values()) and all(map(math.isfinite, module.losses)),
            "seconds": time.perf_counter() - t,
        }
    results["probe_refused_at_setup"] = probe_refusal(Regressor, world)
    results["seconds_total"] = time.perf_counter() - t0
    return results


def probe_refusal(module_class: Any, world: int) -> dict[str, Any]:
    """A probe callback that builds its optimizer in setup() (as stable-pretraining's does) is seen only at
    strategy.setup, after the process group exists: both ranks must refuse there, before any engine, and not hang."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from autoshard.demo import OnlineProbe
    from autoshard.errors import IncompatibleBackendError
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    t = time.perf_counter()
    probe = OnlineProbe(dim=HIDDEN, classes=2)
    strategy = AutoShardDeepSpeedStrategy(timeout=PG_TIMEOUT)
    x, y = make_data(0, 16)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=1, callbacks=[probe], **QUIET)
    message, error = "", ""
    try:
        trainer.fit(module_class(manual=False), DataLoader(TensorDataset(x, y), batch_size=8))
    except IncompatibleBackendError as exc:
        message, error = str(exc), type(exc).__name__
    return {
        "error": error,
        "message": message,
        "probe_optimizer_built": probe.optimizer is not None,
        "model_type_at_refusal": type(strategy.model).__name__,
        "seconds": time.perf_counter() - t,
    }


# Three blocks of two layers and a head, each layer 262,656 elements (its weight above the default persistence
# threshold, its bias within it); each run: ZeRO-3's stage3_max_reuse_distance in those elements (None: autoshard's
# config as it is) and activation_checkpointing (2: blocks 0 and 2 forwarded again in the backward).
WIDTH, LAYER = 512, 512 * 512 + 512
REUSE_RUNS = ((0, False), (6 * LAYER + 1, False), (6 * LAYER + 1, 2), (10 * LAYER + 1, 2), (None, False), (None, 2))


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, WIDTH))


def gathered_into_backward(reuse: int | None, checkpointing: bool | int) -> dict[str, Any]:
    """The partitioned parameters a ZeRO-3 engine (bf16, autoshard's config) holds gathered when a step's forward
    ends, at the second and third steps (the first records the trace): what the backward starts with. A reuse
    distance comes without prefetch, which alone keeps a model this small gathered."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from autoshard.adapters.checkpointing import checkpoint_blocks
    from autoshard.adapters.deepspeed import deepspeed_config
    from autoshard.intent import ShardingIntent

    intent = ShardingIntent(activation_checkpointing=checkpointing)
    overrides = {} if reuse is None else {"stage3_max_reuse_distance": reuse, "stage3_prefetch_bucket_size": 0}
    config = deepspeed_config(intent, world_size=1, micro_batch_size=4, zero_overrides=overrides)
    model = make_blocks()
    checkpoint_blocks(model, intent)  # as the strategies do, before the engine is built
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=sgd(model.parameters()), config=config, dist_init_required=False)
    held: list[int] = []
    names: list[list[str]] = []
    for _ in range(3):
        loss = engine(torch.randn(4, WIDTH, dtype=torch.bfloat16)).float().pow(2).mean()
        live = [(n, p) for n, p in engine.module.named_parameters() if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist]
        held.append(sum(int(p.ds_numel) * p.element_size() for _, p in live))
        names.append([n for n, _ in live])
        engine.backward(loss)
        engine.step()
    return {"reuse": reuse, "checkpointing": checkpointing, "held": held[1:], "names": names[1:]}


# (precision, reduce_dtype) of each engine whose gradient reduce bucket is measured; a small bucket (elements).
BUCKET_RUNS = (("bf16-mixed", None), ("bf16-mixed", "bfloat16"), ("32-true", None))
BUCKET = 4096


def reduce_bucket_bytes(precision: str, reduce_dtype: str | None) -> dict[str, Any]:
    """The bytes of the gradient reduce bucket a ZeRO-3 engine built from autoshard's config allocates (DeepSpeed
    0.19: one buffer per reduction dtype, reduce_bucket_size elements of it, with contiguous_gradients)."""
    import deepspeed

    from autoshard.adapters.deepspeed import deepspeed_config
    from autoshard.intent import ShardingIntent

    intent = ShardingIntent(precision=precision, reduce_dtype=reduce_dtype)
    config = deepspeed_config(intent, world_size=1, micro_batch_size=4, zero_overrides={"reduce_bucket_size": BUCKET})
    model = make_blocks()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=sgd(model.parameters()), config=config, dist_init_required=False)
    buffers = [b.buffer for b in engine.optimizer.ipg_buckets.values() if b.buffer is not None]
    return {"precision": precision, "reduce_dtype": reduce_dtype, "bytes": sum(b.numel() * b.element_size() for b in buffers)}


def run_reuse(rank: int) -> dict[str, Any]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=PG_TIMEOUT)
    return {
        "runs": [gathered_into_backward(reuse, checkpointing) for reuse, checkpointing in REUSE_RUNS],
        "buckets": [reduce_bucket_bytes(precision, reduce_dtype) for precision, reduce_dtype in BUCKET_RUNS],
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("mode", choices=("engine", "lightning", "reuse"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    result = {"engine": run_engine, "lightning": run_lightning, "reuse": run_reuse}[args.mode](rank)
    write_result(args.out, rank, result)


if __name__ == "__main__":
    worker_main(main)
