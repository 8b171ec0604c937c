"""Activation memory of one step on fake tensors: what grows with the batch, what checkpointing and bf16 save,
what sharding does (model states / N, activations unchanged), and the fallbacks and refusals a user meets."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoshard.activations import StepMemory, load_batch, measure_step
from autoshard.demo import DinoLike
from autoshard.errors import AutoShardError
from autoshard.intent import ShardingIntent
from autoshard.precision import resolve_precision


class GPT(pl.LightningModule):
    """A tiny Hugging Face GPT-2 (2 blocks, width 64): blocks are the units activation checkpointing wraps."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens(batch: int) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (batch, 64))]


def blobs(batch: int) -> list[torch.Tensor]:
    return [torch.randn(batch, 16), torch.randint(0, 4, (batch,))]


@functools.cache
def measured(model: str, batch: int, ac: bool = False, precision: str = "bf16-mixed", world: int = 2) -> StepMemory:
    """One measurement per configuration, shared by the tests that compare them."""
    intent = ShardingIntent(activation_checkpointing=ac)
    factory, make = (GPT, tokens) if model == "gpt2" else (lambda: DinoLike(dim=32, depth=2), blobs)
    return measure_step(factory, intent, world, resolve_precision(precision, intent), make_batch=lambda: make(batch))


def test_the_peak_adds_up_and_names_where_it_happened() -> None:
    step = measured("gpt2", 8)
    assert step.peak == step.model_states + step.gathered + step.activations
    assert step.activations > 0 and step.gathered > 0 and step.model_states > 0
    assert step.at.startswith(("forward of ", "backward of ", "optimizer step")), step.at
    assert not step.forward_only
    kinds = step.to_dict()["by_kind"]
    assert kinds["OptState"] > 0, kinds  # the warm-up step created the optimizer states before the measured one


def test_activations_grow_linearly_with_the_batch() -> None:
    small, large = measured("gpt2", 8), measured("gpt2", 16)
    assert 1.7 <= large.activations / small.activations <= 2.3, (small.activations, large.activations)
    grown = large.activations - small.activations
    assert abs(large.model_states - small.model_states) < 0.05 * grown  # what grows is activations, not states


def test_activation_checkpointing_cuts_activations() -> None:
    plain, checkpointed = measured("gpt2", 16), measured("gpt2", 16, ac=True)
    assert checkpointed.activations < 0.75 * plain.activations, (plain.activations, checkpointed.activations)
    assert checkpointed.activation_checkpointing and not plain.activation_checkpointing


def test_bf16_mixed_activations_are_smaller_than_fp32() -> None:
    bf16, fp32 = measured("gpt2", 16), measured("gpt2", 16, precision="32-true")
    assert bf16.activations < 0.85 * fp32.activations, (bf16.activations, fp32.activations)


def test_world_size_shards_model_states_not_activations() -> None:
    two, four = measured("dino", 256, world=2), measured("dino", 256, world=4)
    sharded = lambda s: dict(s.by_kind)["Sharded Param"]  # noqa: E731
    assert 0.45 <= sharded(four) / sharded(two) <= 0.55, (sharded(two), sharded(four))
    assert abs(four.activations - two.activations) <= 0.05 * two.activations, (two.activations, four.activations)
    assert four.peak < two.peak


class Stack(pl.LightningModule):
    """Four residual MLP blocks (the plan finds them, activation checkpointing wraps them) and a head: small enough
    that a simulated step takes a fraction of a second, deep enough that every k-th block differs from every block."""

    def __init__(self, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(depth)
        )
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def rows(n: int, dim: int = 64) -> list[torch.Tensor]:
    return [torch.randn(n, 16, dim)]


@functools.cache
def stacked(ac: bool | int | str) -> StepMemory:
    intent = ShardingIntent(activation_checkpointing=ac)
    return measure_step(Stack, intent, 2, resolve_precision("bf16-mixed", intent), make_batch=lambda: rows(64))


def test_checkpointing_modes_order_the_simulated_peak_and_price_it_in_recomputed_flops() -> None:
    none, second, selective, every = (stacked(ac) for ac in (False, 2, "selective", True))
    assert none.activations > second.activations > every.activations, (none.activations, second.activations, every.activations)
    assert none.activations > selective.activations > every.activations, (selective.activations, every.activations)
    assert [s.activation_checkpointing for s in (none, second, selective, every)] == [False, 2, "selective", True]
    # The price: the forward FLOPs recomputed. Every block recomputes all four blocks' forward, every 2nd block two.
    recomputed = {ac: s.flops - none.flops for ac, s in (("2", second), ("selective", selective), ("all", every))}
    assert none.flops > 0 and recomputed["all"] > recomputed["2"] > 0, recomputed
    assert recomputed["2"] == pytest.approx(recomputed["all"] / 2, rel=0.01), recomputed
    # Selective recomputes cheap ops and every second matmul whose output backward needs: here none is (a Linear's
    # backward needs its input, not its output), so its price is well under a whole forward.
    assert 0 <= recomputed["selective"] < recomputed["all"] / 2, recomputed


class WithExample(pl.LightningModule):
    """forward is defined and example_input_array is set; training_step needs a Trainer (it reads self.trainer)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.example_input_array = torch.zeros(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        scale = 1.0 / self.trainer.accumulate_grad_batches
        return self(batch).pow(2).mean() * scale

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_without_a_batch_function_only_the_forward_of_the_example_runs() -> None:
    intent = ShardingIntent()
    step = measure_step(WithExample, intent, 2, resolve_precision("32-true", intent))
    assert step.forward_only
    assert step.activations >= 2 * 64 * 64 * 4  # each block's GELU input is saved for backward (64 x 64 fp32)
    assert any("forward(example_input_array) only" in n for n in step.notes), step.notes


def test_a_training_step_that_needs_a_trainer_falls_back_to_the_forward_with_the_reason() -> None:
    intent = ShardingIntent()
    step = measure_step(WithExample, intent, 2, resolve_precision("32-true", intent), make_batch=lambda: torch.zeros(64, 32))
    assert step.forward_only
    assert step.incomplete.startswith("training_step could not run on the batch from <lambda>"), step.incomplete
    assert "float32[64, 32]" in step.incomplete and "is not attached to a `Trainer`" in step.incomplete
    assert "self.trainer.accumulate_grad_batches" in step.incomplete and "Fix:" in step.incomplete
    assert not dist.is_initialized()


class ReadsValues(WithExample):
    """Branches on a tensor's value in forward: fake tensors have none."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.blocks[0](x)
        return self.blocks[1](x)


def test_a_model_fake_tensors_cannot_run_is_refused_in_words_and_the_group_is_gone() -> None:
    intent = ShardingIntent()
    with pytest.raises(AutoShardError, match=r"reads a tensor's value .*`if x\.sum\(\) > 0:`.*Fix:"):
        measure_step(ReadsValues, intent, 2, resolve_precision("32-true", intent), make_batch=lambda: torch.zeros(64, 32))
    assert not dist.is_initialized()  # the fake process group is destroyed on error too


def test_beside_a_live_process_group_the_step_runs_in_this_process_and_the_live_group_is_untouched() -> None:
    """A strategy deciding a memory budget at setup has its process group up (on a GPU, CUDA too, where a forked
    child cannot run). The simulation parks the live registry and puts it back: same default group, same names, same
    rank on torch's C++ side, collectives still work, and the result equals the one without a live group."""
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.tensor._random as dtensor_random

    intent = ShardingIntent()
    alone = measure_step(WithExample, intent, 2, resolve_precision("32-true", intent))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        live = dist.group.WORLD
        names, count, tracker = dict(c10d._world.pg_names), c10d._world.group_count, dtensor_random._rng_tracker
        beside = measure_step(WithExample, intent, 2, resolve_precision("32-true", intent))
        assert dist.group.WORLD is live and dict(c10d._world.pg_names) == names and c10d._world.group_count == count
        assert dtensor_random._rng_tracker is tracker
        assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        ones = torch.ones(2)
        dist.all_reduce(ones)
        assert ones.tolist() == [1.0, 1.0]
        c10d._resolve_process_group(names[live])  # its name still resolves in torch's C++ registry
    finally:
        dist.destroy_process_group()
    assert beside.peak == alone.peak and beside.peak > 0


def test_load_batch_reads_a_file_function(tmp_path: Path) -> None:
    path = tmp_path / "batches.py"
    path.write_text("import torch\n\ndef make_batch():\n    return torch.zeros(3, 2)\n")
    assert load_batch(f"{path}:make_batch")().shape == (3, 2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("batches.py", "not path/to/file.py:function or package.module:function"),
        ("missing_dir/batches.py:make_batch", "does not exist"),
        ("autoshard.demo:no_such_function", "could not load --batch"),
        ("autoshard.demo:BUFFER", "could not load --batch"),
        ("autoshard.activations:MODEL_STATES", "not a function"),
    ],
)
def test_a_bad_batch_spec_is_refused_with_the_fix(spec: str, message: str) -> None:
    with pytest.raises(AutoShardError, match=f"{message}.*Fix:"):
        load_batch(spec)


def test_callbacks_batch_end_runs_and_what_fake_tensors_stop_is_noted() -> None:
    from autoshard.demo import dino_with_probe

    intent = ShardingIntent()
    step = measure_step(dino_with_probe, intent, 2, resolve_precision("bf16-mixed", intent), make_batch=lambda: blobs(32))
    assert not step.forward_only  # the probe's own forward, backward and step ran; its float(loss) log could not
    assert any(n.startswith("OnlineProbe.on_train_batch_end stopped") and "tensor's value" in n for n in step.notes), step.notes


def test_units_kept_gathered_after_forward_raise_the_gathered_bytes_at_the_peak() -> None:
    intent = ShardingIntent(reshard_after_forward=False)
    kept = measure_step(GPT, intent, 2, resolve_precision("bf16-mixed", intent), make_batch=lambda: tokens(8))
    resharded = measured("gpt2", 8)
    assert kept.gathered > resharded.gathered, (resharded.gathered, kept.gathered)
    assert kept.activations == pytest.approx(resharded.activations, rel=0.05)


def test_hybrid_sharding_shards_over_the_group_in_the_simulated_step() -> None:
    intent = ShardingIntent(shard_size=2)
    hybrid = measure_step(lambda: DinoLike(dim=32, depth=2), intent, 4, resolve_precision("bf16-mixed", intent), make_batch=lambda: blobs(256))
    pure_on_two = measured("dino", 256, world=2)
    sharded = lambda s: dict(s.by_kind)["Sharded Param"]  # noqa: E731
    assert sharded(hybrid) == sharded(pure_on_two)  # states / shard_size, not / world size


class TwoOptimizersManual(pl.LightningModule):
    """A GAN-shaped manual step: two optimizers and their schedulers, a closure, manual_backward, self.log."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))
        self.disc = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        z, real = batch
        g_loss = self.disc(self.gen(z)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

        def closure() -> torch.Tensor:
            d_loss = self.disc(real).mean() - self.disc(self.gen(z).detach()).mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            return d_loss

        opt_d.step(closure=closure)
        sched_g.step()
        sched_d.step()
        self.log_dict({"g_loss": g_loss})

    def configure_optimizers(self) -> Any:
        g, d = torch.optim.Adam(self.gen.parameters()), torch.optim.Adam(self.disc.parameters())
        return [g, d], [torch.optim.lr_scheduler.StepLR(g, 1), {"scheduler": torch.optim.lr_scheduler.StepLR(d, 1)}]


def test_a_manual_step_runs_with_lightning_optimizers_schedulers_and_a_closure() -> None:
    intent = ShardingIntent()
    step = measure_step(
        TwoOptimizersManual, intent, 2, resolve_precision("bf16-mixed", intent), make_batch=lambda: (torch.randn(32, 16), torch.randn(32, 32))
    )
    assert not step.forward_only and step.incomplete == "" and step.activations > 0
    numel = sum(p.numel() for p in TwoOptimizersManual().parameters())
    # Both optimizers stepped through LightningOptimizer: Adam's two fp32 states of every parameter, half per rank.
    assert dict(step.by_kind)["OptState"] >= 2 * 4 * numel // 2, step.by_kind
    assert not dist.is_initialized()


class ReadsTheDatamodule(TwoOptimizersManual):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.classes = self.trainer.datamodule.num_classes
        super().training_step(batch, batch_idx)


def test_a_manual_step_reading_what_the_stand_in_trainer_lacks_names_it() -> None:
    intent = ShardingIntent()
    with pytest.raises(AutoShardError) as info:
        measure_step(
            ReadsTheDatamodule, intent, 2, resolve_precision("bf16-mixed", intent), make_batch=lambda: (torch.randn(32, 16), torch.randn(32, 32))
        )
    message = str(info.value)
    assert "self.trainer.datamodule is not available in autoshard's simulated step" in message
    assert "`self.classes = self.trainer.datamodule.num_classes`" in message and "measuring_callback()" in message


def test_the_private_lightning_member_the_manual_step_uses() -> None:
    """LightningOptimizer._to_lightning_optimizer: how Lightning itself wraps an optimizer for self.optimizers()."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    class Strategy:
        def optimizer_step(self, optimizer: Any, closure: Any, **kwargs: Any) -> Any:
            return optimizer.step(closure=closure, **kwargs)

    p = nn.Parameter(torch.ones(2))
    strategy = Strategy()
    wrapped = LightningOptimizer._to_lightning_optimizer(torch.optim.SGD([p], lr=1.0), strategy)  # type: ignore[arg-type]
    p.grad = torch.ones(2)
    wrapped.step()
    assert isinstance(wrapped, LightningOptimizer) and torch.equal(p.detach(), torch.zeros(2))


def test_tensor_parallel_is_refused_by_the_simulated_step_with_the_reason() -> None:
    from autoshard.activations import measure_step

    with pytest.raises(AutoShardError) as caught:
        intent = ShardingIntent(tensor_parallel_size=2)
        measure_step(Stack, intent, 4, resolve_precision("32-true", intent), make_batch=lambda: rows(8))
    assert "does not lay the model out by its tensor-parallel plan" in str(caught.value)
    assert str(caught.value).endswith(
        "Fix: measure with tensor_parallel_size=1 (the activations of a data-parallel rank), or measure on real devices"
    )


def test_dtensor_sharding_propagation_is_not_counted_in_the_peak() -> None:
    """DTensor learns an op's output shapes by running it once more on fake tensors of its own: no memory of the step.
    torch 2.11 did that at every fused or foreach optimizer step, and the tracker counted it: the simulated step of a
    0.9B Llama with AdamW(fused=True) peaked at 32 bytes per parameter where the GPU held 20 (session 7's flat
    26.41 GiB, every checkpointing candidate alike). On this torch it happens at an op's first sight: the same op
    costs the same, seen first or again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from autoshard.activations.tracker import step_tracker
    from autoshard.activations.world import fake_world
    from autoshard.privates import in_torch

    peaks = []
    with fake_world(1, 0):
        mesh = init_device_mesh("cpu", (1,))
        with in_torch.FakeTensorMode(allow_non_fake_inputs=True):
            x = DTensor.from_local(torch.empty(1000, 1000), mesh, [Shard(0)])  # 4 MB
            for _ in range(2):
                tracker = step_tracker(nn.Linear(2, 2))
                with tracker:
                    y = torch.mul(x, 3.0)  # first time: DTensor propagates its sharding (a 4 MB fake tensor)
                    del y
                peaks.append(tracker.peak_by_kind()["Activation"])
    assert peaks == [4_000_000, 4_000_000]


def test_a_measured_step_that_raises_leaves_no_tracker_behind() -> None:
    """measuring_callback enters its tracker at the batch's start and left it only at the batch's end: a step that
    raised kept its dispatch mode and its wrapper of DTensor's sharding propagation in the process."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from autoshard.activations import measuring_callback

    class Raises(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1:
                raise RuntimeError("the step failed")
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    original = ShardingPropagator._propagate_tensor_meta_non_cached
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[measuring_callback(1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    with pytest.raises(RuntimeError, match="the step failed"):
        trainer.fit(Raises(), data)
    assert ShardingPropagator._propagate_tensor_meta_non_cached is original
    assert _get_current_dispatch_mode_stack() == []


FORK_AFTER = """
import os, sys, torch
if sys.argv[1] == "step":  # a simulated step: explain, decide before fit
    from autoshard.activations import measure_step
    from autoshard.intent import ShardingIntent
    from autoshard.precision import resolve_precision
    from tests.test_budget_decide import Small, batch

    measure_step(Small, ShardingIntent(), 2, resolve_precision(None, ShardingIntent()), make_batch=batch)
else:  # a fit under the strategy: torch's fully_shard makes fake tensors itself, then the training's backward
    from autoshard._harness import quiet_trainer
    from autoshard.lightning import FSDP2Strategy
    from tests.test_budget_decide import Small, batch

    trainer = quiet_trainer(strategy=FSDP2Strategy(), devices=1, max_steps=1)
    trainer.fit(Small(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(batch()[0]), batch_size=4))
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        os.write(write, b"ok")
    except Exception as exc:
        os.write(write, str(exc).encode()[:200])
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 200).decode())
"""


@pytest.mark.parametrize("before", ["step", "fit"])
def test_a_process_that_simulated_a_step_or_fit_can_still_fork_a_child_that_trains(before: str) -> None:
    """The decision beside a live gloo group runs in a forked child. Where torch is built with CUDA and has no GPU (a
    CPU run of the usual pip wheel), a fake step, or a fit (fully_shard makes fake tensors), first in the process left
    every later child unable to run a backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"): FakeTensorMode's stand-in CUDA guard counts a device. Seen with torch 2.11's CUDA wheel on this
    machine (where both cases failed: a second fit could not decide its budget); this suite's CPU build never showed
    it. A fresh process each, so that nothing else started autograd's engine first."""
    import subprocess
    import sys

    from autoshard._harness import child_env

    env = child_env(PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(Path(__file__).parents[1])]))
    done = subprocess.run([sys.executable, "-c", FORK_AFTER, before], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout[-2000:]
