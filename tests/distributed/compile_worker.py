"""One rank of the torch.compile checks: 2 gloo processes, fp32, a tiny Hugging Face Llama with an EMA teacher.

Launched by tests/distributed/test_compile.py through the harness; every scenario runs in this one process pair, in
order (imports dominate the cost). ``AUTOSHARD_COMPILE_BACKEND=aot_eager`` (set by the test): dynamo traces every
compiled block and runs the traced graphs, without inductor's code generation, so what is checked is the hooks, the
names and the numbers, not the kernels.

- ``eager``: ``strategy="fsdp2"``, 2 epochs, a checkpoint after each; its losses, checkpoint keys, collectives.
- ``compile``: the same with ``ShardingIntent(compile=True)``: each decoder layer (the student's and the EMA
  teacher's) compiled in place before ``fully_shard``.
- ``user_compiled``: ``self.model = torch.compile(LlamaForCausalLM(cfg))`` in ``__init__`` under
  ``strategy="auto-shard"``; then each of the eager and the compiled model resumed from the other's first epoch.
- ``fabric``: ``Fabric(strategy=FSDP2Strategy(compile=True))`` against the same loop eager.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from autoshard.demo import ema_update
from autoshard.lightning import FSDP2Strategy
from tests.distributed.harness import fsdp2_collectives, quiet_trainer, run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
VOCAB, SEQ, SAMPLES, BATCH, EPOCHS = 64, 8, 12, 2, 2
WORK = Path.cwd()  # the harness starts every rank in the same output directory


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same whole model on every rank and in every scenario
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    return LlamaForCausalLM(config)


class LlamaWithTeacher(pl.LightningModule):
    """A causal LM plus an EMA teacher it is distilled towards: the teacher's blocks are units too."""

    def __init__(self, user_compile: bool = False) -> None:
        super().__init__()
        model = tiny_llama()
        self.teacher = copy.deepcopy(model).requires_grad_(False)
        self.model = torch.compile(model) if user_compile else model
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return step_loss(self.model, self.teacher, batch[0], self.losses)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            ema_update(self.teacher, self.model, 0.9)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


def step_loss(model: nn.Module, teacher: nn.Module, ids: torch.Tensor, losses: list[float]) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    with torch.no_grad():
        target = teacher(input_ids=ids).logits
    loss = out.loss + 0.1 * F.mse_loss(out.logits, target)
    losses.append(float(loss.detach()))
    return loss


def data() -> DataLoader:
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=BATCH)


class Collectives:
    """How many all-gathers and reduce-scatters FSDP2 issues while inside (it calls these two, looked up per call)."""

    def __enter__(self) -> Collectives:
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self.names = fsdp2_collectives()
        self.saved = tuple(getattr(dist, name) for name in self.names)
        gather, scatter = self.saved

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            self.counts["all_gather"] += 1
            return gather(*args, **kwargs)

        def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
            self.counts["reduce_scatter"] += 1
            return scatter(*args, **kwargs)

        for name, wrapper in zip(self.names, (all_gather, reduce_scatter)):
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in zip(self.names, self.saved):
            setattr(dist, name, original)


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def autoshard_frames() -> list[str]:
    """autoshard's functions dynamo has compiled a frame of (a cache entry on their code): none, as for fully_shard's
    own hooks. A hook traced on its own frame costs a guard check per call, and clone_view_outputs had become a
    compiled graph returning its input: one more compiled call and autograd node per block (issue 31's gap)."""
    import gc
    import types

    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    import autoshard

    root = str(Path(autoshard.__file__).parent)
    codes = {f.__code__ for f in gc.get_objects() if type(f) is types.FunctionType and f.__code__.co_filename.startswith(root)}
    return sorted(f"{Path(c.co_filename).name}:{c.co_name}" for c in codes if _debug_get_cache_entry_list(c))


def checkpoint_keys(path: Path) -> list[str]:
    """The tensor keys a DCP checkpoint directory holds (model and optimizer state), as torch reads them."""
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(k for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith(("state_dict.", "optimizer")))


def layers(module: LlamaWithTeacher) -> dict[str, Any]:
    """Per decoder layer (student and teacher): sharded by its own fully_shard, compiled in place, its weights' shard."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for name, sub in module.named_modules():
        if type(sub).__name__.endswith("DecoderLayer"):
            weight = sub.self_attn.q_proj.weight
            out[name] = {
                "unit": isinstance(sub, FSDPModule),
                "compiled": sub._compiled_call_impl is not None,
                "shard": weight.to_local().shape[0] / weight.shape[0] if isinstance(weight, DTensor) else 1.0,
            }
    return out


def fit(module: LlamaWithTeacher, strategy: Any, name: str, ckpt_path: str | None = None) -> dict[str, Any]:
    saver = ModelCheckpoint(dirpath=WORK / name, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = quiet_trainer(strategy=strategy, max_epochs=EPOCHS, callbacks=[saver], enable_checkpointing=True)
    before = graphs()
    with Collectives() as collectives:
        trainer.fit(module, data(), ckpt_path=ckpt_path)
    plan = trainer.strategy.plan
    return {
        "losses": module.losses,
        "steps": trainer.global_step,
        "keys": checkpoint_keys(WORK / name / f"epoch={EPOCHS - 1}.ckpt"),
        "collectives": collectives.counts,
        "graphs": graphs() - before,
        "autoshard_frames": autoshard_frames(),
        "layers": layers(module),
        "units": [u.name for u in plan.units],
        "blocks": [u.name for u in plan.units if u.kind.value == "block"],
        "plan_compiled": list(plan.compiled),
        "ema_pairs": [vars(p) for p in trainer.strategy.needs.ema_pairs],
        "compiled_needs": list(trainer.strategy.needs.compiled),
    }


def scenario_eager() -> dict[str, Any]:
    return fit(LlamaWithTeacher(), "fsdp2", "eager")


def scenario_compile() -> dict[str, Any]:
    return fit(LlamaWithTeacher(), FSDP2Strategy(compile=True), "compile")


def scenario_user_compiled() -> dict[str, Any]:
    """The user's whole-model torch.compile under auto-shard; then each run resumes from the other's first epoch: an
    eager model from this run's checkpoint, a compiled one from the eager run's."""
    module = LlamaWithTeacher(user_compile=True)
    wrapped = type(module.model).__name__
    out = fit(module, "auto-shard", "user_compiled")
    eager_from_compiled = fit(LlamaWithTeacher(), "fsdp2", "eager_from_compiled", str(WORK / "user_compiled" / "epoch=0.ckpt"))
    compiled_from_eager = fit(LlamaWithTeacher(user_compile=True), "auto-shard", "compiled_from_eager", str(WORK / "eager" / "epoch=0.ckpt"))
    return {
        **out,
        "wrapped_as": wrapped,
        "eager_from_compiled": eager_from_compiled["losses"],
        "compiled_from_eager": compiled_from_eager["losses"],
    }


def scenario_fabric() -> dict[str, Any]:
    """Fabric's loop, eager and with compile=True: each step's loss, the layers compiled and sharded, the state keys."""
    from lightning.fabric import Fabric

    from autoshard.fabric.strategies import FSDP2Strategy as FabricFSDP2

    out: dict[str, Any] = {}
    for label, strategy in (("eager", FabricFSDP2()), ("compile", FabricFSDP2(compile=True))):
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true")
        fabric.launch()
        module = LlamaWithTeacher()
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.model.parameters(), lr=1e-2))
        loader = fabric.setup_dataloaders(data())
        losses: list[float] = []
        before = graphs()
        with Collectives() as collectives:
            for _ in range(EPOCHS):
                for (ids,) in loader:
                    loss = step_loss(model.model, model.teacher, ids, losses)
                    fabric.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    with torch.no_grad():
                        ema_update(module.teacher, module.model, 0.9)
        out[label] = {
            "losses": losses,
            "collectives": collectives.counts,
            "graphs": graphs() - before,
            "autoshard_frames": autoshard_frames(),
            "layers": layers(module),
            "keys": sorted(model.state_dict()),
        }
    return out


SCENARIOS = {"eager": scenario_eager, "compile": scenario_compile, "user_compiled": scenario_user_compiled, "fabric": scenario_fabric}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)
