"""One rank of the Fabric checks (tests/fabric/test_fabric.py): every scenario runs in this one process pair, each with
its own ``Fabric``. Each returns what THIS rank holds; references are computed on every rank from the global batch
(generated, not exchanged): one process, the same initial weights, the same optimizer, the same steps.

``--resume``: the second run (new processes) of the save / load scenario; it reads the checkpoint the first run left
beside its output directory.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # a worker process; never when a test module imports from it (collection)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch
import torch.distributed as dist
from torch import nn

import autoshard  # noqa: F401  registers Fabric's strategy names
from tests.distributed.harness import count_collectives, run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH = 8
STEPS = 3
OUT = Path(sys.argv[sys.argv.index("--out") + 1])
SHARED = OUT.parent  # the test's tmp directory: the checkpoint and the init_from file live here


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """An embedding, two repeated blocks (autoshard's block units) and a head."""

    def __init__(self, d: int = 16, dropout: float = 0.0, out: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.drop(h))


class Scaled(Net):
    """A parameter on the root (replicated, gradients averaged) and a buffer (rank 0's broadcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 1.0 + RANK))  # each rank its own: setup must broadcast rank 0's
        self.register_buffer("offset", torch.full((3,), float(RANK)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale + self.offset


class Pair(nn.Module):
    """Two networks trained by two optimizers (a generator and a discriminator, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = Net()
        self.disc = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gen(x).pow(2).mean() + self.disc(x).pow(2).mean()


class WithTeacher(nn.Module):
    """DINO / BYOL's shape: a student and its frozen EMA copy, the teacher forwarded without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.student = Net()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        out = self.student(x)
        return (out - target).pow(2).mean() + out.pow(2).mean()


# -- helpers -------------------------------------------------------------------------------------------------------------
def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``; a rank trains on its rows (a per-sample mean: the global loss is the ranks' mean)."""
    return torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(100 + step))


def mine(x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0] // WORLD
    return x[RANK * rows : (RANK + 1) * rows]


def fabric(strategy: Any = "fsdp2", precision: str = "32-true") -> Any:
    from lightning.fabric import Fabric

    f = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision)
    f.launch()
    return f


def full(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective for sharded ones: every rank calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone() for n, p in module.named_parameters()}


def unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, "module", module)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max_diff(a, b)


def fractions(module: nn.Module) -> dict[str, float]:
    from torch.distributed.tensor import DTensor

    return {n: p.to_local().numel() / p.numel() for n, p in module.named_parameters() if isinstance(p, DTensor)}


def checksum(weights: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in weights.values()))


def train(
    model: nn.Module,
    optimizers: list[Any],
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    steps: range,
    f: Any = None,
    after: Callable[[], None] | None = None,
    x_of: Callable[[int], torch.Tensor] | None = None,
) -> None:
    for step in steps:
        x = (x_of or (lambda s: mine(batch(s))))(step)
        loss = loss_of(model, x)
        if f is not None:
            f.backward(loss)
        else:
            loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if after is not None:
            after()


def reference(
    model: nn.Module,
    optimizers: list[Any],
    loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    after: Callable[[], None] | None = None,
    steps: int = STEPS,
    precision: str = "32-true",
) -> dict[str, torch.Tensor]:
    """One process on the global batch."""
    import contextlib

    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext

    def loss_in(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with ctx():
            return loss_of(m, x)

    train(model, optimizers, loss_in, range(steps), after=after, x_of=batch)
    return full(model)


def squares(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).float().pow(2).mean()


def net(seed: int = 0, cls: type[nn.Module] = Net, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs)


# -- scenarios -----------------------------------------------------------------------------------------------------------
def optimizer_before_setup() -> dict[str, Any]:
    """The common Fabric idiom: the optimizer is built first, then fabric.setup(model, optimizer). AdamW, auto-shard."""
    f = fabric("auto-shard")
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    start = full(model)
    model, opt = f.setup(model, opt)
    shards = fractions(unwrap(model))
    train(model, [opt], squares, range(STEPS), f)
    got = full(unwrap(model))
    ref_model = net()
    want = reference(ref_model, [torch.optim.AdamW(ref_model.parameters(), lr=0.05, weight_decay=0.01)], squares)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    return {
        "fractions": shards,
        "vs_reference": max_diff(got, want),
        "moved": moved(got, start),
        "checksum": checksum(got),
        "optimizer_holds_model": held == {id(p) for p in unwrap(model).parameters()},
    }


def stale_with_lightning_alone() -> dict[str, Any]:
    """The same idiom under Lightning's own ModelParallelStrategy (fully_shard per child, dp = world): the optimizer keeps
    the pre-sharding parameters. Shows that optimizer_before_setup's check can fail."""
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
        for child in (module.embed, *module.blocks, module.head):
            fully_shard(child, mesh=mesh["data_parallel"])
        return module

    f = fabric(ModelParallelStrategy(parallelize, data_parallel_size=WORLD, tensor_parallel_size=1))
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    model, opt = f.setup(model, opt)
    train(model, [opt], squares, range(STEPS), f)
    got = full(unwrap(model))
    ref_model = net()
    want = reference(ref_model, [torch.optim.AdamW(ref_model.parameters(), lr=0.05, weight_decay=0.01)], squares)
    return {"vs_reference": max_diff(got, want)}


def optimizer_after_setup() -> dict[str, Any]:
    """FSDP2's recommended order: setup_module, then the optimizer from the sharded parameters. SGD with momentum,
    auto-shard."""
    f = fabric("auto-shard")
    model = f.setup_module(net())
    opt = f.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    train(model, [opt], squares, range(STEPS), f)
    got = full(unwrap(model))
    ref_model = net()
    want = reference(ref_model, [torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)], squares)
    return {"vs_reference": max_diff(got, want), "fractions": fractions(unwrap(model)), "checksum": checksum(got)}


def optimizer_before_setup_module() -> dict[str, Any]:
    """Built before, handed over later through setup_optimizers (after setup_module): moved there. SGD, momentum."""
    f = fabric()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = f.setup_module(model)
    opt = f.setup_optimizers(opt)
    train(model, [opt], squares, range(STEPS), f)
    got = full(unwrap(model))
    ref_model = net()
    want = reference(ref_model, [torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)], squares)
    return {"vs_reference": max_diff(got, want), "decision": f.strategy.decision.describe(caveats=False)}


def state_kept() -> dict[str, Any]:
    """An optimizer that already stepped before setup: its state (AdamW's moments) is cut to each rank's shard and kept."""
    f = fabric()
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    squares(model, batch(0)).backward()  # one step on the global batch, before setup, on every rank alike
    opt.step()
    opt.zero_grad(set_to_none=True)
    model, opt = f.setup(model, opt)
    kinds = sorted({type(v).__name__ for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()})
    train(model, [opt], squares, range(1, STEPS), f)
    got = full(unwrap(model))
    ref_model = net()
    want = reference(ref_model, [torch.optim.AdamW(ref_model.parameters(), lr=0.05)], squares)
    return {"vs_reference": max_diff(got, want), "state_kinds": kinds}


def bf16_mixed() -> dict[str, Any]:
    """precision='bf16-mixed': parameters all-gathered in bf16, gradients reduced in fp32, fp32 weights."""
    f = fabric(precision="bf16-mixed")
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    with count_collectives() as counts:
        train(model, [opt], squares, range(STEPS), f)
    got = full(unwrap(model))
    ref_model = net()
    want = reference(ref_model, [torch.optim.AdamW(ref_model.parameters(), lr=0.05)], squares, precision="bf16-mixed")
    fp32_model = net()
    fp32 = reference(fp32_model, [torch.optim.AdamW(fp32_model.parameters(), lr=0.05)], squares)
    return {
        "collectives": counts,
        "weight_dtypes": sorted({str(p.dtype) for p in unwrap(model).parameters()}),
        "vs_reference": max_diff(got, want),
        "reference_vs_fp32": max_diff(want, fp32),
        "checksum": checksum(got),
    }


def _ema_update(teacher: nn.Module, student: nn.Module, momentum: float = 0.9) -> None:
    with torch.no_grad():
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.mul_(momentum).add_(s.detach(), alpha=1 - momentum)


def ema_inside() -> dict[str, Any]:
    """Teacher and student in one model: sharded alike, the no_grad teacher resharded, the EMA update exact."""
    from torch.distributed.tensor import DTensor

    f = fabric()
    model = net(cls=WithTeacher)
    opt = torch.optim.AdamW(model.student.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    inner = unwrap(model)
    after_forward: list[bool] = []

    def update() -> None:
        after_forward.append(all(isinstance(p, DTensor) for p in inner.teacher.parameters()))
        _ema_update(inner.teacher, inner.student)

    train(model, [opt], lambda m, x: m(x), range(STEPS), f, after=update)
    got = full(inner)
    ref = net(cls=WithTeacher)
    want = reference(
        ref, [torch.optim.AdamW(ref.student.parameters(), lr=0.05)], lambda m, x: m(x), after=lambda: _ema_update(ref.teacher, ref.student)
    )
    placements = [(str(t.placements), str(s.placements)) for t, s in zip(inner.teacher.parameters(), inner.student.parameters())]
    teacher = {n: t for n, t in got.items() if n.startswith("teacher.")}
    return {
        "vs_reference": max_diff(got, want),
        "teacher_moved": max_diff(teacher, {n: t for n, t in full(net(cls=WithTeacher)).items() if n.startswith("teacher.")}),
        "placements_equal": all(a == b for a, b in placements),
        "teacher_sharded": bool(fractions(inner.teacher)) and all(abs(v - 0.5) < 0.2 for v in fractions(inner.teacher).values()),
        "teacher_dtensor_after_no_grad_forward": after_forward,
    }


def ema_apart(teacher_first: bool) -> dict[str, Any]:
    """teacher = copy.deepcopy(student), set up in its own fabric.setup_module call (before or after the student's)."""
    f = fabric()
    student = net()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=0.05)
    if teacher_first:
        teacher = f.setup_module(teacher)
        student, opt = f.setup(student, opt)
    else:
        student, opt = f.setup(student, opt)
        teacher = f.setup_module(teacher)
    s, t = unwrap(student), unwrap(teacher)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(x)
        out = m(x)
        return (out - target).pow(2).mean() + out.pow(2).mean()

    train(student, [opt], loss, range(STEPS), f, after=lambda: _ema_update(t, s))
    got_t = full(t)
    ref_s = net()
    ref_t = copy.deepcopy(ref_s).requires_grad_(False)

    def ref_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = ref_t(x)
        out = m(x)
        return (out - target).pow(2).mean() + out.pow(2).mean()

    reference(ref_s, [torch.optim.AdamW(ref_s.parameters(), lr=0.05)], ref_loss, after=lambda: _ema_update(ref_t, ref_s))
    placements = [(str(a.placements), str(b.placements)) for a, b in zip(t.parameters(), s.parameters())]
    return {
        "vs_reference": max_diff(got_t, full(ref_t)),
        "placements_equal": all(a == b for a, b in placements),
        "teacher_fractions": fractions(t),
    }


def ema_apart_student_first() -> dict[str, Any]:
    return ema_apart(teacher_first=False)


def ema_apart_teacher_first() -> dict[str, Any]:
    return ema_apart(teacher_first=True)


def two_optimizers() -> dict[str, Any]:
    """Two optimizers in one fabric.setup call (AdamW on the generator, SGD with momentum on the discriminator)."""
    f = fabric()
    model = net(cls=Pair)
    opt_g = torch.optim.AdamW(model.gen.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(model.disc.parameters(), lr=0.1, momentum=0.9)
    model, opt_g, opt_d = f.setup(model, opt_g, opt_d)
    train(model, [opt_g, opt_d], lambda m, x: m(x), range(STEPS), f)
    got = full(unwrap(model))
    ref = net(cls=Pair)
    want = reference(
        ref, [torch.optim.AdamW(ref.gen.parameters(), lr=0.05), torch.optim.SGD(ref.disc.parameters(), lr=0.1, momentum=0.9)], lambda m, x: m(x)
    )
    return {"vs_reference": max_diff(got, want), "optimizers": f.strategy.needs.describe_optimizers()}


def second_setup() -> dict[str, Any]:
    """Two models, two fabric.setup calls (a GAN set up apart), each with its optimizer built before setup."""
    f = fabric()
    gen, disc = net(1), net(2)
    opt_g = torch.optim.AdamW(gen.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    gen, opt_g = f.setup(gen, opt_g)
    disc, opt_d = f.setup(disc, opt_d)
    train(gen, [opt_g, opt_d], lambda m, x: m(x).pow(2).mean() + disc(x).pow(2).mean(), range(STEPS), f)
    got = {**{f"gen.{k}": v for k, v in full(unwrap(gen)).items()}, **{f"disc.{k}": v for k, v in full(unwrap(disc)).items()}}
    ref_g, ref_d = net(1), net(2)
    both = nn.ModuleDict({"gen": ref_g, "disc": ref_d})
    want = reference(
        both,
        [torch.optim.AdamW(ref_g.parameters(), lr=0.05), torch.optim.SGD(ref_d.parameters(), lr=0.1, momentum=0.9)],
        lambda m, x: m["gen"](x).pow(2).mean() + m["disc"](x).pow(2).mean(),
    )
    return {
        "vs_reference": max_diff(got, want),
        "setups": [s.describe() for s in f.strategy.setups],
        "fractions": {**fractions(unwrap(gen)), **fractions(unwrap(disc))},
    }


def gan_steps(
    gen: nn.Module, disc: nn.Module, opts: tuple[Any, Any], backward: Callable[[torch.Tensor], None], x_of: Callable[[int], torch.Tensor]
) -> None:
    """A GAN's alternating steps, with Lightning's ``toggle_optimizer`` done by hand: the discriminator frozen
    (requires_grad=False) while the generator steps, the generator frozen while the discriminator steps."""
    opt_g, opt_d = opts
    for step in range(STEPS):
        z, real = x_of(step), x_of(STEPS + step)  # noise, and the "real" samples
        disc.requires_grad_(False)
        g_loss = (disc(gen(z)).float() - 1).pow(2).mean()
        backward(g_loss)
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        disc.requires_grad_(True)
        gen.requires_grad_(False)
        d_loss = (disc(real).float() - 1).pow(2).mean() + disc(gen(z)).float().pow(2).mean()
        backward(d_loss)
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        gen.requires_grad_(True)


def pair_weights(gen: nn.Module, disc: nn.Module) -> dict[str, torch.Tensor]:
    return {**{f"gen.{k}": v for k, v in full(gen).items()}, **{f"disc.{k}": v for k, v in full(disc).items()}}


def gan_toggle_bf16() -> dict[str, Any]:
    """A generator and a discriminator set up apart, each with its SGD, under bf16-mixed, each frozen while the other
    steps: the discriminator's first forward runs frozen. FSDP2 fixes a unit's reduce dtype at its first forward from
    the parameters that require grad then, so without autoshard's early lazy init (``init_sharded_units``) its later
    backward fails ("a gradient with dtype BFloat16 to a tensor with grad_dtype Float")."""
    import contextlib

    f = fabric(precision="bf16-mixed")
    gen, disc = net(1, out=6), net(2, out=1)
    gen, opt_g = f.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    disc, opt_d = f.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
    start = pair_weights(unwrap(gen), unwrap(disc))
    error = None
    try:
        with count_collectives() as counts:
            gan_steps(gen, disc, (opt_g, opt_d), f.backward, lambda s: mine(batch(s)))
    except RuntimeError as exc:  # the failure this guards against, reported rather than raised: the test names it
        error, counts = str(exc).splitlines()[0], {}
    got = pair_weights(unwrap(gen), unwrap(disc))

    def one_process(precision: str) -> dict[str, torch.Tensor]:
        ref_g, ref_d = net(1, out=6), net(2, out=1)
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16-mixed" else contextlib.nullcontext

        class Autocast(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                with ctx():
                    return self.inner(x)

        opts = (torch.optim.SGD(ref_g.parameters(), lr=0.1), torch.optim.SGD(ref_d.parameters(), lr=0.1))
        gan_steps(Autocast(ref_g), Autocast(ref_d), opts, lambda loss: loss.backward(), batch)
        return pair_weights(ref_g, ref_d)

    want, fp32 = one_process("bf16-mixed"), one_process("32-true")
    return {
        "error": error,
        "collectives": counts,
        "vs_reference": max_diff(got, want),
        "reference_vs_fp32": max_diff(want, fp32),
        "moved": moved(got, start),
        "checksum": checksum(got),
    }


def deepspeed_refusals() -> dict[str, Any]:
    """autoshard-deepspeed refuses two optimizers (naming both) and a second setup call (naming both), before any engine."""
    out: dict[str, Any] = {}
    f = fabric("autoshard-deepspeed")
    model = net(cls=Pair)
    try:
        f.setup(model, torch.optim.AdamW(model.gen.parameters(), lr=0.05), torch.optim.SGD(model.disc.parameters(), lr=0.1))
    except Exception as exc:  # noqa: BLE001 - the text is the result
        out["two_optimizers"] = f"{type(exc).__name__}: {exc}"
    return out


def deepspeed_trains() -> dict[str, Any]:
    """autoshard-deepspeed on CPU (gloo): ZeRO-3 partitions, one optimizer built before setup, like one process."""
    f = fabric("autoshard-deepspeed")
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    engine = model._forward_module
    partitioned = [p.ds_tensor.numel() / max(p.ds_numel, 1) for p in engine.module.parameters()]
    train(model, [opt], squares, range(STEPS), f)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        got = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    ref_model = net()
    want = reference(ref_model, [torch.optim.AdamW(ref_model.parameters(), lr=0.05)], squares)
    # fabric.save through the crash-safe writer (manifest, one rename), then fabric.load into the same engine after a
    # step that moved it: the saved weights come back.
    f.save(SHARED / "ds_ckpt", {"model": model, "optimizer": opt, "step": STEPS})
    train(model, [opt], squares, range(STEPS, STEPS + 1), f)
    state = {"model": model, "optimizer": opt, "step": 0}
    f.load(SHARED / "ds_ckpt", state)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        loaded = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    second = None
    try:
        f.setup(net(3), torch.optim.SGD(net(3).parameters(), lr=0.1))
    except Exception as exc:  # noqa: BLE001 - the text is the result
        second = f"{type(exc).__name__}: {exc}"
    return {
        "vs_reference": max_diff(got, want),
        "partitioned": partitioned,
        "second_setup": second,
        "loaded_vs_saved": max_diff(loaded, got),
        "step": state["step"],
        "saved": {n: t.tolist() for n, t in got.items()},
    }


def meta_init() -> dict[str, Any]:
    """fabric.init_module(empty_init=True), the optimizer built on the meta parameters, then fabric.setup: materialized
    shards (each its own random values, ranks agreeing on the whole), the optimizer moved onto them, training as one
    process from the same start."""
    f = fabric()
    with f.init_module(empty_init=True):
        model = Net()
    on_meta = all(p.is_meta for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    start = full(unwrap(model))
    rows_differ = float((start["blocks.0.lin.weight"][:8] - start["blocks.0.lin.weight"][8:]).abs().max())
    train(model, [opt], squares, range(STEPS), f)
    ref = Net()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(start[n])
    want = reference(ref, [torch.optim.AdamW(ref.parameters(), lr=0.05)], squares)
    return {"on_meta": on_meta, "vs_reference": max_diff(full(unwrap(model)), want), "shard_rows_differ": rows_differ, "checksum": checksum(start)}


def meta_init_from() -> dict[str, Any]:
    """ShardingIntent(init_from=FILE) with empty_init: each rank's shards hold the file's weights."""
    from autoshard.fabric import FSDP2Strategy
    from autoshard.intent import ShardingIntent

    path = SHARED / "init.pt"
    weights = net(7).state_dict()
    if RANK == 0:
        torch.save(weights, path)
    dist.barrier()
    f = fabric(FSDP2Strategy(ShardingIntent(init_from=str(path))))
    with f.init_module(empty_init=True):
        model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = f.setup(model, opt)
    got = full(unwrap(model))
    report = f.strategy.init_reports[1]
    return {"vs_file": max_diff(got, {n: t.float() for n, t in weights.items()}), "read_share": report.bytes_read / report.bytes_total}


def meta_ema_apart() -> dict[str, Any]:
    """A student and its EMA teacher built on the meta device (``teacher = copy.deepcopy(student)``), set up apart, in
    either order: materialized, the teacher starts as an exact copy of its student, shard for shard."""
    out = {}
    for order in ("student_first", "teacher_first"):
        f = fabric()
        with f.init_module(empty_init=True):
            student = Net()
        teacher = copy.deepcopy(student).requires_grad_(False)
        on_meta = all(p.is_meta for p in (*student.parameters(), *teacher.parameters()))
        if order == "teacher_first":
            teacher = f.setup_module(teacher)
        student = f.setup_module(student)
        if order == "student_first":
            teacher = f.setup_module(teacher)
        s, t = full(unwrap(student)), full(unwrap(teacher))
        out[order] = {
            "on_meta": on_meta,
            "teacher_vs_student": max_diff(t, s),
            "sharded_alike": fractions(unwrap(teacher)) == fractions(unwrap(student)),
        }
    return out


def unsharded_root() -> dict[str, Any]:
    """A parameter on the root and a buffer, each rank with its own values: rank 0's broadcast at setup, the root
    parameter's gradients averaged, training as one process (started from rank 0's values)."""
    import warnings

    f = fabric()
    model = net(cls=Scaled)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "parameters live directly on Scaled": said, expected here
        model, opt = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = unwrap(model)
    after_setup = {"scale": float(inner.scale), "offset": inner.offset.tolist()}
    train(model, [opt], squares, range(STEPS), f)
    got = full(inner)
    ref = net(cls=Scaled)
    with torch.no_grad():
        ref.scale.fill_(1.0)  # rank 0's
        ref.offset.fill_(0.0)
    want = reference(ref, [torch.optim.SGD(ref.parameters(), lr=0.1)], squares)
    return {"after_setup": after_setup, "vs_reference": max_diff(got, want), "scale": float(inner.scale)}


# -- save, then load in new processes -------------------------------------------------------------------------------------
CKPT = SHARED / "ckpt"
RESUME_STEPS = 2


def dropout_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def save_and_continue() -> dict[str, Any]:
    """Two steps, fabric.save, two more (the uninterrupted run the resumed one must equal, bit for bit). Dropout draws
    per rank, so the RNG states are part of what must come back."""
    f = fabric()
    model = net(dropout=0.2, cls=Net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    torch.manual_seed(1234 + RANK)
    train(model, [opt], dropout_loss, range(RESUME_STEPS), f)
    saved = full(unwrap(model))
    f.save(CKPT, {"model": model, "optimizer": opt, "step": RESUME_STEPS})
    train(model, [opt], dropout_loss, range(RESUME_STEPS, 2 * RESUME_STEPS), f)
    final = full(unwrap(model))
    return {"saved": {n: t.tolist() for n, t in saved.items()}, "final": {n: t.tolist() for n, t in final.items()}}


def load_and_continue() -> dict[str, Any]:
    f = fabric()
    model = net(5, dropout=0.2, cls=Net)  # another init: everything must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    torch.manual_seed(99)  # another RNG state: the checkpoint's must replace it
    state = {"model": model, "optimizer": opt, "step": 0}
    rest = f.load(CKPT, state)
    loaded = full(unwrap(model))
    train(model, [opt], dropout_loss, range(state["step"], 2 * RESUME_STEPS), f)
    final = full(unwrap(model))
    return {
        "step": state["step"],
        "rest": sorted(rest),
        "loaded": {n: t.tolist() for n, t in loaded.items()},
        "final": {n: t.tolist() for n, t in final.items()},
    }


SCENARIOS = {
    "optimizer_before_setup": optimizer_before_setup,
    "stale_with_lightning_alone": stale_with_lightning_alone,
    "optimizer_after_setup": optimizer_after_setup,
    "optimizer_before_setup_module": optimizer_before_setup_module,
    "state_kept": state_kept,
    "bf16_mixed": bf16_mixed,
    "ema_inside": ema_inside,
    "ema_apart_student_first": ema_apart_student_first,
    "ema_apart_teacher_first": ema_apart_teacher_first,
    "two_optimizers": two_optimizers,
    "second_setup": second_setup,
    "meta_init": meta_init,
    "meta_init_from": meta_init_from,
    "meta_ema_apart": meta_ema_apart,
    "unsharded_root": unsharded_root,
    "save_and_continue": save_and_continue,
    "load_and_continue": load_and_continue,
    "gan_toggle_bf16": gan_toggle_bf16,
    "deepspeed_refusals": deepspeed_refusals,
    "deepspeed_trains": deepspeed_trains,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
