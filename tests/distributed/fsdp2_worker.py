"""One rank of the FSDP2 end-to-end checks; several scenarios run in a row in the same process pair.

Launched by tests/distributed/test_fsdp2.py through the harness (torchrun-style environment).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autoshard
from autoshard.adapters.fsdp2 import plan_fsdp2
from autoshard.demo import Blobs, DinoLike, OnlineProbe, ema_update
from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import count_collectives, quiet_trainer, run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def trainer(strategy: Any, steps: int, precision: str = "32-true", callbacks: list | None = None) -> pl.Trainer:
    return quiet_trainer(strategy=strategy, precision=precision, max_steps=steps, callbacks=callbacks or [])


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in module.named_parameters()}


def changed_and_finite(before: dict[str, torch.Tensor], module: nn.Module) -> dict[str, Any]:
    after = snapshot(module)
    changed = [n for n in before if not torch.equal(after[n], before[n])]
    return {"changed": len(changed), "total": len(before), "finite": all(bool(torch.isfinite(t).all()) for t in after.values())}


def shard_fractions(module: nn.Module) -> dict[str, float]:
    return {n: p.to_local().numel() / p.numel() for n, p in module.named_parameters() if isinstance(p, DTensor)}


class LossLog(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def scenario_dino() -> dict[str, Any]:
    """The EMA + probe method under auto-shard with bf16-mixed: trains, shards 1/2, probe stays replicated."""
    pl.seed_everything(0, verbose=False)
    model = DinoLike()
    before = snapshot(model)
    probe, log = OnlineProbe(), LossLog()
    t = trainer("auto-shard", steps=6, precision="bf16-mixed", callbacks=[probe, log])
    t.fit(model, DataLoader(Blobs(n=192), batch_size=16))
    plan = t.strategy.plan
    return {
        "decision": t.strategy.decision.backend,
        "units": [u.name for u in plan.units],
        "fractions": shard_fractions(model),
        "teacher_is_dtensor": isinstance(model.teacher.blocks[0].fc1.weight, DTensor),
        "weights": changed_and_finite(before, model),
        "losses": log.losses,
        "probe_weight": model.probe.weight.detach().flatten().tolist(),
        "probe_loss": [probe.first_loss, probe.last_loss],
        "probe_is_plain": not isinstance(model.probe.weight, DTensor),
    }


class Stack(pl.LightningModule):
    """A supervised custom stack: blocks in a ModuleList, a head in a Sequential; SGD, fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.cross_entropy(self(x), y)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def stack_data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return TensorDataset(x, y)


def scenario_equivalence() -> dict[str, Any]:
    """2 ranks x batch 8 under fsdp2 must match 1 process x batch 16 of the same samples (same init, fp32)."""
    pl.seed_everything(1, verbose=False)
    model = Stack()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    log = LossLog()
    steps = 6
    x_all, y_all = stack_data().tensors
    with torch.no_grad():
        loss_before = float(F.cross_entropy(model(x_all), y_all))
    t = trainer("fsdp2", steps=steps, callbacks=[log])
    data = stack_data()
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=False)
    t.fit(model, DataLoader(data, batch_size=8, sampler=sampler))
    # Single-process reference: DistributedSampler gives rank r the indices r, r+W, ...; a step's global batch
    # is therefore samples [16k, 16k+16). Equal per-rank batch sizes make the mean gradients identical.
    opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    for k in range(steps):
        x, y = data[16 * k : 16 * (k + 1)]
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    with torch.no_grad():
        loss_after = float(F.cross_entropy(model(x_all), y_all))  # a collective forward: every rank runs it
    sharded = snapshot(model)
    max_diff = max(float((sharded[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())
    return {
        "units": [u.name for u in t.strategy.plan.units],
        "fractions": shard_fractions(model),
        "max_diff_vs_single_process": max_diff,
        "full_loss": [loss_before, loss_after],
        "losses": log.losses,
        "weights": changed_and_finite(before, model),
    }


def scenario_ema_exact() -> dict[str, Any]:
    """The positional-zip EMA update on DTensors equals the same update on unsharded copies, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(2)
    model = DinoLike()
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(torch.randn_like(p))  # student != teacher, so the update does something
    reference = copy.deepcopy(model)
    needs = autoshard.inspect_needs(model)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))
    plan_fsdp2(model, autoshard.ShardingIntent(), needs).apply(model, mesh)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model.teacher(x)  # a forward without backward: the root must reshard, or the zip mixes Tensor and DTensor
    for _ in range(3):
        ema_update(model.teacher, model.student, 0.9)
        ema_update(reference.teacher, reference.student, 0.9)
    got = snapshot(model.teacher)
    want = {n: p.detach() for n, p in reference.teacher.named_parameters()}
    return {"ema_equal": all(torch.equal(got[n], want[n]) for n in want), "pairs": [vars(p) for p in needs.ema_pairs]}


class HFCausalLM(pl.LightningModule):
    """A HF transformers model built from a small config (no download), trained as a plain LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def scenario_hf() -> dict[str, Any]:
    pl.seed_everything(3, verbose=False)
    model = HFCausalLM()
    before = snapshot(model)
    t = trainer("fsdp2", steps=2)
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    t.fit(model, DataLoader(TensorDataset(ids), batch_size=4))
    return {
        "units": [(u.name, u.kind) for u in t.strategy.plan.units],
        "fractions": shard_fractions(model),
        "weights": changed_and_finite(before, model),
    }


def scenario_parallelize_fn() -> dict[str, Any]:
    """A user parallelize_fn replaces the plan and receives the mesh with a data_parallel slice."""
    from torch.distributed.fsdp import fully_shard

    seen: dict[str, Any] = {}

    def parallelize(module: nn.Module, device_mesh: Any) -> None:
        dp = device_mesh["data_parallel"]
        seen["dp_size"] = dp.size()
        for block in module.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(module.head, mesh=dp)
        fully_shard(module.embed, mesh=dp)

    pl.seed_everything(4, verbose=False)
    model = Stack()
    before = snapshot(model)
    t = trainer(FSDP2Strategy(parallelize_fn=parallelize), steps=2)
    t.fit(model, DataLoader(stack_data(), batch_size=8))
    return {
        "dp_size": seen.get("dp_size"),
        "plan": t.strategy.plan is None,
        "fractions": shard_fractions(model),
        "weights": changed_and_finite(before, model),
    }


def scenario_intent_knobs() -> dict[str, Any]:
    """Mixed-precision policy, CPU offload, per-block activation checkpointing and resharding reach fully_shard."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed._composable_state import _get_module_state

    intent = {
        "activation_checkpointing": True,
        "offload": "params",
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "reshard_after_forward": False,
    }
    pl.seed_everything(5, verbose=False)
    model = Stack()
    before = snapshot(model)
    t = trainer(FSDP2Strategy(intent=intent), steps=2)
    t.fit(model, DataLoader(stack_data(), batch_size=8))
    block, head = model.blocks[0], model.head
    state = _get_module_state(block)
    group = state._fsdp_param_group
    return {
        "param_dtype": str(group.mp_policy.param_dtype),
        "reduce_dtype": str(group.mp_policy.reduce_dtype),
        "offload": type(group.offload_policy).__name__,
        "block_checkpointed": "checkpoint" in (_get_registry(block) or {}),
        "head_checkpointed": "checkpoint" in (_get_registry(head) or {}),
        "block_reshard_after_forward": group.post_forward_mesh_info is not None,
        "weights": changed_and_finite(before, model),
    }


def scenario_meta_init() -> dict[str, Any]:
    """Built on meta: sharded before any rank holds the full model, materialized locally, teacher = student."""
    seen: dict[str, Any] = {}

    class AtStart(pl.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pairs = zip(pl_module.teacher.parameters(), pl_module.student.parameters())
            seen["teacher_equals_student"] = all(torch.equal(full(t), full(s)) for t, s in pairs)
            seen["meta_left"] = sum(p.is_meta for p in pl_module.parameters())
            seen["temperature"] = float(pl_module.student.temperature)

    pl.seed_everything(6, verbose=False)
    t = trainer("auto-shard", steps=2, callbacks=[OnlineProbe(), AtStart()])
    with t.init_module(empty_init=True):
        model = DinoLike()
    seen["built_on_meta"] = all(p.is_meta for p in model.parameters())
    t.fit(model, DataLoader(Blobs(n=64), batch_size=16))
    seen["fractions"] = shard_fractions(model)
    seen["finite"] = all(bool(torch.isfinite(full(p.detach())).all()) for p in model.parameters())
    return seen


def max_diff(sharded: nn.Module, reference: nn.Module) -> float:
    got = snapshot(sharded)
    return max(float((got[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())


def estimated_sent(factory: Any, precision: str) -> dict[str, int]:
    """explain's bytes sent per step by this rank (memory.Traffic), on a meta-device copy."""
    from autoshard.intent import ShardingIntent
    from autoshard.memory import EstimateOptions, estimate_memory
    from autoshard.target import build_on_meta

    estimate = estimate_memory(
        build_on_meta(factory).module, ShardingIntent(precision=precision), world_size=WORLD, options=EstimateOptions(rank=RANK)
    )
    return {t.collective: t.bytes for t in estimate.traffic}


def scenario_bf16_mixed() -> dict[str, Any]:
    """bf16-mixed under fsdp2: what is all-gathered and reduced, and 2 ranks vs 1 process under the same autocast."""
    pl.seed_everything(1, verbose=False)
    model = Stack()
    reference = copy.deepcopy(model)
    log, steps, data = LossLog(), 6, stack_data()
    x_all, y_all = data.tensors
    with torch.no_grad():
        loss_before = float(F.cross_entropy(model(x_all), y_all))
    forward_dtypes: set[str] = set()  # fully_shard prepends its all-gather: this hook sees the gathered weight
    model.blocks[0][0].register_forward_pre_hook(lambda m, args: forward_dtypes.add(str(m.weight.dtype)))
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=False)
    with count_collectives() as collectives:
        trainer("fsdp2", steps=steps, precision="bf16-mixed", callbacks=[log]).fit(model, DataLoader(data, batch_size=8, sampler=sampler))
    opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    for k in range(steps):  # the global batch of step k, as in scenario_equivalence; Lightning's bf16 autocast
        x, y = data[16 * k : 16 * (k + 1)]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(reference(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss_after = float(F.cross_entropy(model(x_all), y_all))  # a collective forward: every rank runs it
    weight = model.blocks[0][0].weight
    return {
        "full_loss": [loss_before, loss_after],
        "forward_weight_dtypes": sorted(forward_dtypes),
        "collectives": {kind: sorted(by_dtype) for kind, by_dtype in collectives.items()},
        "collective_bytes": collectives,
        "steps": steps,
        "estimated_sent": estimated_sent(Stack, "bf16-mixed"),
        "sharded_weight": [type(weight).__name__, str(weight.dtype), str(weight.grad.dtype)],
        "losses": log.losses,
        "max_diff_vs_single_process": max_diff(model, reference),
    }


class SteadyViews(DinoLike):
    """DinoLike with deterministic views (no per-rank noise), so that one process can replay the same steps."""

    def __init__(self) -> None:
        super().__init__(momentum=0.5)  # a teacher that moves visibly in a few steps

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": steady_views_loss(self, batch[0])}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=0.5)  # no Adam: its sign-like steps amplify bf16 noise


def steady_views_loss(model: DinoLike, x: torch.Tensor) -> torch.Tensor:
    from autoshard.demo import dino_loss

    _, s1 = model.student(x)
    _, s2 = model.student(x.flip(-1))
    with torch.no_grad():
        _, t1 = model.teacher(x)
        _, t2 = model.teacher(x.flip(-1))
    # Unsharpened: bf16 noise is compared with how far the teacher moves, on the gradients this scenario was sized for.
    return 0.5 * (dino_loss(s1, t2, sharpening=1.0) + dino_loss(s2, t1, sharpening=1.0))


class EMAWatch(pl.Callback):
    """Each step's EMA update, checked on the full fp32 tensors: teacher' == teacher * m + student * (1 - m).

    Callbacks' on_train_batch_end runs before the module's (where the update happens); the next batch's start
    (or the end of fit) sees the updated teacher."""

    def __init__(self) -> None:
        self.before: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self.diffs: list[float] = []
        self.teacher_dtypes: set[str] = set()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.before = (snapshot(pl_module.teacher), snapshot(pl_module.student))

    def _check(self, pl_module: Any) -> None:
        if self.before is None:
            return
        teacher, student = self.before
        after = snapshot(pl_module.teacher)
        m = pl_module.momentum
        self.diffs.append(max(float((after[n] - teacher[n].clone().mul_(m).add_(student[n], alpha=1 - m)).abs().max()) for n in after))
        self.teacher_dtypes |= {f"{type(p).__name__}:{p.dtype}" for p in pl_module.teacher.parameters()}
        self.before = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._check(pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._check(pl_module)


def scenario_ema_bf16() -> dict[str, Any]:
    """An EMA teacher under bf16 all-gathers: the update runs on the fp32 shards (exact), and the method's weights
    match one process under the same autocast within bf16's precision."""
    pl.seed_everything(7, verbose=False)
    model = SteadyViews()
    reference = copy.deepcopy(model)
    initial = snapshot(model.teacher)
    watch, steps, data = EMAWatch(), 4, Blobs(n=64)
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=False)
    trainer("fsdp2", steps=steps, precision="bf16-mixed", callbacks=[watch]).fit(model, DataLoader(data, batch_size=8, sampler=sampler))
    opt = reference.configure_optimizers()
    for k in range(steps):
        x = torch.stack([data[i][0] for i in range(16 * k, 16 * (k + 1))])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = steady_views_loss(reference, x)
        loss.backward()
        opt.step()
        ema_update(reference.teacher, reference.student, reference.momentum)
    return {
        "ema_step_diffs": watch.diffs,
        "teacher_dtypes": sorted(watch.teacher_dtypes),
        "teacher_diff_vs_single_process": max_diff(model.teacher, reference.teacher),
        "student_diff_vs_single_process": max_diff(model.student, reference.student),
        "teacher_moved": max(float((t - initial[n]).abs().max()) for n, t in snapshot(model.teacher).items()),
    }


class GatheredBeforeBackward(pl.Callback):
    """The FSDP units still gathered when the first backward starts (the plan's kept units, and nothing else)."""

    def __init__(self) -> None:
        self.names: list[str] | None = None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        from autoshard.engine.guarantees import fsdp_units

        if self.names is None:
            self.names = sorted(n for n, u in fsdp_units(pl_module) if u._get_fsdp_state()._fsdp_param_group.is_unsharded)


def view_outputs(model: nn.Module, units: list[str]) -> list[str]:
    """The units whose own forward returns a view tensor in plain PyTorch, unsharded: the warning FSDP2 gives them."""
    found: set[str] = set()

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else (output,)
        if any(torch.is_tensor(t) and t.requires_grad and t._base is not None for t in values):
            found.add(type(module).__name__)

    handles = [model.get_submodule(name).register_forward_hook(hook) for name in units]
    model.training_step(model.batch(2), 0)
    for handle in handles:
        handle.remove()
    return sorted(found)


def scenario_zoo() -> dict[str, Any]:
    """Seven small real architectures under strategy="fsdp2": 2 steps each, with FSDP2's warnings captured."""
    import warnings

    from benchmarks.arch_models import ARCHS

    out: dict[str, Any] = {}
    for arch, make in ARCHS.items():
        pl.seed_everything(8, verbose=False)
        model = make()
        plain = copy.deepcopy(model)
        before = snapshot(model)
        gathered = GatheredBeforeBackward()
        t = trainer("fsdp2", steps=2, callbacks=[gathered])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(model, DataLoader(TensorDataset(*model.batch(16)), batch_size=4))
        units = [u.name for u in t.strategy.plan.units]
        out[arch] = {
            "gathered_before_backward": gathered.names,
            "views": sorted({str(w.message).split("(")[1].split(")")[0] for w in caught if "returned a view tensor" in str(w.message)}),
            "views_unsharded": view_outputs(plain, units),
            "weights": changed_and_finite(before, model),
        }
    return out


class TwoPlayers(pl.LightningModule):
    """A GAN-shaped method in Lightning's documented pattern: manual optimization, two optimizers, and
    ``toggle_optimizer`` freezing the other player while one steps (so at the first forward one unit has no trainable
    parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.disc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        gen_opt, disc_opt = self.optimizers()
        (x,) = batch
        for opt, loss in (
            (gen_opt, lambda: F.softplus(-self.disc(self.gen(x))).mean()),  # the non-saturating GAN losses
            (disc_opt, lambda: F.softplus(self.disc(self.gen(x).detach())).mean() + F.softplus(-self.disc(x)).mean()),
        ):
            self.toggle_optimizer(opt)
            opt.zero_grad()
            self.manual_backward(loss())
            opt.step()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.gen.parameters(), lr=0.05), torch.optim.SGD(self.disc.parameters(), lr=0.05)


def scenario_two_players_bf16() -> dict[str, Any]:
    """toggle_optimizer under bf16-mixed: FSDP2 would fix the frozen player's reduce dtype to none at its first forward
    and fail its first backward (a bf16 gradient into an fp32 parameter); autoshard initializes every unit first."""
    pl.seed_everything(3, verbose=False)
    model = TwoPlayers()
    before = snapshot(model)
    data = TensorDataset(torch.randn(32, 16))
    with count_collectives() as collectives:
        trainer("fsdp2", steps=3, precision="bf16-mixed").fit(model, DataLoader(data, batch_size=4))
    after = snapshot(model)
    return {
        "changed": sorted(n for n in before if not torch.equal(after[n], before[n])),
        "names": sorted(before),
        "sharded": sorted(shard_fractions(model)),
        "finite": all(bool(torch.isfinite(t).all()) for t in after.values()),
        "reduced": sorted(collectives["reduce_scatter"]),
        "sums": {n: float(t.double().sum()) for n, t in after.items()},
    }


class ConvBN(pl.LightningModule):
    """A small ResNet-like classifier: conv + BatchNorm blocks, as torchvision's models are built."""

    def __init__(self) -> None:
        super().__init__()
        block = lambda c_in, c_out: nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())  # noqa: E731
        self.blocks = nn.ModuleList([block(3, 16), block(16, 16), block(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def scenario_batchnorm_bf16() -> dict[str, Any]:
    """BatchNorm under bf16-mixed: a bf16-gathered BatchNorm weight next to its float32 running statistics fails in
    batch_norm; the plan keeps BatchNorm's parameters whole in float32 (averaged), and the convolutions sharded."""
    pl.seed_everything(4, verbose=False)
    model = ConvBN()
    before = snapshot(model)
    data = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,)))
    trainer("fsdp2", steps=3, precision="bf16-mixed").fit(model, DataLoader(data, batch_size=4))
    after = snapshot(model)
    norm = model.blocks[0][1]
    return {
        "changed": sorted(n for n in before if not torch.equal(after[n], before[n])),
        "names": sorted(before),
        "sharded": sorted(shard_fractions(model)),
        "norm_weight": [type(norm.weight).__name__, str(norm.weight.dtype)],
        "replicated": sorted(r.name for r in model.trainer.strategy.plan.replicated),
        "sums": {n: float(t.double().sum()) for n, t in after.items()},
        "buffers": {n: float(b.double().sum()) for n, b in model.named_buffers() if b.is_floating_point()},
    }


def scenario_throughput() -> dict[str, Any]:
    """autoshard.ThroughputMonitor on 2 ranks: rank 0 counts its own micro-batch's FLOPs and logs per-device and
    whole-run rates; no rank waits for another (the counter is local)."""
    from lightning.pytorch.loggers.logger import Logger
    from torch.utils.flop_counter import FlopCounterMode

    class Kept(Logger):
        name, version = "kept", 0
        rows: list[dict[str, float]] = []

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append(dict(metrics))

    pl.seed_everything(1, verbose=False)
    model = Stack()
    counter = FlopCounterMode(display=False)
    with counter:  # the same step on one process: one rank's micro-batch of 8
        F.cross_entropy(copy.deepcopy(model)(stack_data().tensors[0][:8]), stack_data().tensors[1][:8]).backward()
    monitor = autoshard.ThroughputMonitor(window_size=2, peak_flops=1e11)
    kept = Kept()
    t = quiet_trainer(strategy="fsdp2", max_steps=6, log_every_n_steps=1, logger=kept, callbacks=[monitor])
    t.fit(model, DataLoader(stack_data(), batch_size=8))
    return {"measured": monitor.measured_flops, "expected": int(counter.get_total_flops()), "rows": [r for r in kept.rows if "train/device/mfu" in r]}


SCENARIOS = {
    "zoo": scenario_zoo,
    "meta_init": scenario_meta_init,
    "intent_knobs": scenario_intent_knobs,
    "dino": scenario_dino,
    "equivalence": scenario_equivalence,
    "ema_exact": scenario_ema_exact,
    "hf": scenario_hf,
    "parallelize_fn": scenario_parallelize_fn,
    "bf16_mixed": scenario_bf16_mixed,
    "ema_bf16": scenario_ema_bf16,
    "two_players_bf16": scenario_two_players_bf16,
    "batchnorm_bf16": scenario_batchnorm_bf16,
    "throughput": scenario_throughput,
}


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
