"""One rank of the 16-mixed-on-FSDP2 checks (tests/distributed/test_fp16.py); every scenario runs in this one process
pair. Each returns what THIS rank holds; the test compares ranks and the reference.

The reference, computed on every rank from the global batch (generated, not exchanged): one process, the same initial
weights, real fp16 autocast on CPU and torch's own ``GradScaler("cpu")``: scale, backward, unscale, clip, step, update.

The forced overflow: sample 9 (rank 1's second batch) multiplies the head's outputs 2 and 3 by 1e4, so the scaled
loss's gradient overflows fp16 in rows 2 and 3 of the head alone: rank 1's shard of it. Rank 0's own gradients stay
finite; it must skip that step all the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoshard  # noqa: F401  registers the strategy names
from tests.distributed.harness import run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OUT = Path(sys.argv[sys.argv.index("--out") + 1])
BATCH, STEPS_PER_EPOCH, EPOCHS = 4, 3, 2  # per rank
LR, CLIP = 0.1, 0.05
OVERFLOW_SAMPLE = 9  # rank 1's second batch (a DistributedSampler without shuffling: rank r takes r, r + 2, ...)


class Model(nn.Module):
    """Two independent terms, so an overflow in the head's rows 2-3 reaches no other gradient; ``gain`` sits on the
    root (autoshard keeps it whole: a plain gradient beside the DTensor ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 4)
        self.gain = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        return (self.head(x) * mult).mean() + self.gain * self.body(x).square().mean()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    n = WORLD * BATCH * STEPS_PER_EPOCH
    x = 0.5 * torch.randn(n, 8, generator=torch.Generator().manual_seed(11))
    mult = torch.ones(n, 4)
    mult[OVERFLOW_SAMPLE, 2:] = 1e4
    return x, mult


def initial() -> Model:
    torch.manual_seed(5)
    return Model()


def full(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def reference() -> dict[str, Any]:
    """One process on the global batch: real fp16 autocast, torch's plain GradScaler, clipping after unscale."""
    model = initial()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    x, mult = data()
    scales, norms, weights = [], [], []
    rows = WORLD * BATCH
    for _ in range(EPOCHS):
        for k in range(STEPS_PER_EPOCH):
            with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = model(x[rows * k : rows * (k + 1)], mult[rows * k : rows * (k + 1)])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
            weights.append(full(model))
    return {"scales": scales, "norms": norms, "weights": weights, "scaler": scaler.state_dict()}


def loader() -> Any:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dataset = TensorDataset(*data())
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, num_replicas=WORLD, rank=RANK, shuffle=False))


def lightning_module() -> Any:
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            inner = initial()
            self.body, self.head, self.gain = inner.body, inner.head, inner.gain

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return Model.forward(self, *batch)  # type: ignore[arg-type]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Net()


def recorder() -> Any:
    import lightning.pytorch as pl

    class Record(pl.Callback):
        """Per step: this rank's unscaled gradients finite or not (before clipping), whether its shards moved, the
        scale after the update, every weight whole."""

        def __init__(self) -> None:
            self.finite: list[bool] = []
            self.moved: list[bool] = []
            self.scales: list[float] = []
            self.weights: list[dict[str, torch.Tensor]] = []
            self.before: list[torch.Tensor] = []

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.finite.append(all(bool(torch.isfinite(local(p.grad)).all()) for p in pl_module.parameters() if p.grad is not None))
            self.before = [local(p).detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = [local(p).detach() for p in pl_module.parameters()]
            self.moved.append(any(not torch.equal(a, b) for a, b in zip(self.before, now)))
            self.scales.append(trainer.precision_plugin.scaler.get_scale())
            self.weights.append(full(pl_module))

    return Record()


def fit(epochs: int, checkpoint: str = "distributed", ckpt_path: Path | None = None) -> tuple[Any, Any, Any]:
    from autoshard.lightning import FSDP2Strategy
    from tests.distributed.harness import quiet_trainer

    record = recorder()
    trainer = quiet_trainer(
        strategy=FSDP2Strategy(checkpoint=checkpoint), precision="16-mixed", max_epochs=epochs, gradient_clip_val=CLIP, callbacks=[record]
    )
    model = lightning_module()
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model, record


def scenario_trainer() -> dict[str, Any]:
    """Trainer(strategy="fsdp2", precision="16-mixed") for 2 epochs against the reference, then the same run stopped
    after epoch 1, saved (a DCP directory, and one full file) and resumed in a new Trainer."""
    from torch.distributed.tensor import DTensor

    want = reference()
    trainer, model, record = fit(EPOCHS)
    plugin = trainer.precision_plugin
    result: dict[str, Any] = {
        "plugin": [type(plugin).__name__, plugin.precision, plugin.device, type(plugin.scaler).__name__],
        "head_rows": list(local(model.head.weight).shape) if isinstance(model.head.weight, DTensor) else None,
        "gain_whole": not isinstance(model.gain, DTensor),
        "gain": float(model.gain),  # each rank's own copy: equal only if every rank took the same steps
        "weight_dtype": str(model.body[0].weight.dtype),  # the shards: fp32 master weights
        "finite": record.finite,
        "moved": record.moved,
        "scales": record.scales,
        "want_scales": want["scales"],
        "want_norms": want["norms"],
        "vs_reference": [diff(got, ref) for got, ref in zip(record.weights, want["weights"])],
        "moved_from_initial": diff(record.weights[-1], full(initial())),
        "scaler": plugin.scaler.state_dict(),
        "want_scaler": want["scaler"],
    }
    final = record.weights[-1]
    for checkpoint in ("distributed", "full"):
        path = OUT / f"epoch1-{checkpoint}.ckpt"
        first, _, _ = fit(1, checkpoint)
        first.save_checkpoint(path)
        saved_scale = first.precision_plugin.scaler.get_scale()
        again, resumed, record = fit(EPOCHS, checkpoint, ckpt_path=path)
        result[f"resume_{checkpoint}"] = {
            "saved_scale": saved_scale,
            "scales": record.scales,
            "vs_uninterrupted": diff(full(resumed), final),
            "scaler": again.precision_plugin.scaler.state_dict(),
        }
    return result


def mine(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of global batch ``k``, as the Trainer's DistributedSampler deals it."""
    x, mult = data()
    rows = WORLD * BATCH
    picked = slice(rows * k + RANK, rows * (k + 1), WORLD)
    return x[picked], mult[picked]


def scenario_fabric() -> dict[str, Any]:
    """Fabric(strategy="fsdp2", precision="16-mixed"): the user's loop with fabric.backward and fabric.clip_gradients,
    against the reference; fabric.save after epoch 1, fabric.load into a new Fabric, the second epoch again."""
    from lightning.fabric import Fabric

    want = reference()

    def built() -> tuple[Any, Any, Any]:
        f = Fabric(accelerator="cpu", devices=WORLD, strategy="fsdp2", precision="16-mixed")
        f.launch()
        model = initial()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model, opt = f.setup(model, opt)
        return f, model, opt

    finite: list[bool] = []  # this rank's unscaled gradients, per step of the first run

    def steps(f: Any, model: Any, opt: Any, epochs: range) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
        scales, weights = [], []
        for _ in epochs:
            for k in range(STEPS_PER_EPOCH):
                f.backward(model(*mine(k)))
                f.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)  # unscales; an overflow step is skipped
                finite.append(all(bool(torch.isfinite(local(p.grad)).all()) for p in model.parameters() if p.grad is not None))
                opt.step()
                opt.zero_grad(set_to_none=True)
                scales.append(f.strategy.precision.scaler.get_scale())
                weights.append(full(model.module))
        return scales, weights

    f, model, opt = built()
    scales, weights = steps(f, model, opt, range(1))
    path = OUT / "fabric-epoch1"
    f.save(path, {"model": model, "optimizer": opt, "epoch": 1})
    more, rest = steps(f, model, opt, range(1, EPOCHS))
    scales, weights = scales + more, weights + rest
    g, model2, opt2 = built()
    state = {"model": model2, "optimizer": opt2, "epoch": 0}
    remainder = g.load(path, state)
    loaded_scale = g.strategy.precision.scaler.get_scale()
    again, _ = steps(g, model2, opt2, range(1, EPOCHS))
    return {
        "scaler_type": type(f.strategy.precision.scaler).__name__,
        "scales": scales,
        "finite": finite[: len(scales)],
        "vs_reference": [diff(got, ref) for got, ref in zip(weights, want["weights"])],
        "loaded": {"epoch": state["epoch"], "remainder": sorted(remainder), "scale": loaded_scale, "scales": again},
        "vs_uninterrupted": diff(full(model2.module), weights[-1]),
        "scaler": f.strategy.precision.scaler.state_dict(),
        "resumed_scaler": g.strategy.precision.scaler.state_dict(),
    }


def scenario_fabric_fused() -> dict[str, Any]:
    """AdamW(fused=True) and no clipping: torch's scaler then leaves the unscaling to the optimizer and checks for
    infs itself, which on FSDP2 sees this rank's shard only."""
    from lightning.fabric import Fabric

    f = Fabric(accelerator="cpu", devices=WORLD, strategy="fsdp2", precision="16-mixed")
    f.launch()
    model = initial()
    model, opt = f.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    moved, scales = [], []
    for k in range(STEPS_PER_EPOCH):
        before = [local(p).detach().clone() for p in model.parameters()]
        f.backward(model(*mine(k)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        moved.append(any(not torch.equal(a, local(p)) for a, p in zip(before, model.parameters())))
        scales.append(f.strategy.precision.scaler.get_scale())
    return {"moved": moved, "scales": scales}


if __name__ == "__main__":
    torch.manual_seed(0)
    run_scenarios({"trainer": scenario_trainer, "fabric": scenario_fabric, "fabric_fused": scenario_fabric_fused})
