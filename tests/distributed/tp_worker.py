"""One rank of the tensor-parallel plan checks: 4 gloo processes as data parallel 2 x tensor parallel 2.

Launched by tests/distributed/test_tp.py through the harness. Each scenario builds a tiny model from one seed on every
rank, keeps an unsharded copy as the single-process reference (trained here, on every rank, on the global batch),
lays the other copy out with ``find_tp_plan(model).apply(model, mesh["tp"])``, shards each decoder layer and the
root with ``fully_shard`` over ``mesh["dp"]``, and trains both with fp32 AdamW: each data-parallel rank reads its half
of the global batch, both ranks of a tensor-parallel pair read the same half. Each scenario returns what THIS rank
saw: losses, the largest weight difference from the reference, placements, local sizes, and the local gradients of
the parameters the plan keeps whole (the test compares them across the ranks of a tensor-parallel pair).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from autoshard.adapters.tp_plan import find_tp_plan
from autoshard.lightning import FSDP2Strategy
from tests.distributed.checkpoint_worker import Capture, compare, full_state
from tests.distributed.harness import quiet_trainer, run_scenarios

STEPS = 4
# AdamW's eps: a gradient near it (Qwen2's key bias, zero in exact arithmetic) turns fp32 rounding into updates of up to
# lr, whatever the layout; 1e-6 keeps the comparison about the layout. The first step's gradients are compared directly.
EPS = 1e-6
BATCH, SEQ, VOCAB = 4, 8, 128


def tiny_config(family: str, tied: bool = False) -> Any:
    import transformers

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    config_cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    return getattr(transformers, config_cls)(**sizes, **extra, tie_word_embeddings=tied, attn_implementation="eager")


def tiny_model(family: str, tied: bool = False) -> nn.Module:
    import transformers

    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[family]
    torch.manual_seed(0)  # the same whole model on every rank
    return getattr(transformers, cls)(tiny_config(family, tied))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def reference(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batch: its losses, and its first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    losses, first = [], {}
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first


class MLP(nn.Module):
    """A model of one's own with a plain ``_tp_plan``: a norm the plan leaves whole between two split layers."""

    _tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def _placements(model: nn.Module) -> dict[str, Any]:
    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        out[name] = {
            "placements": [str(x) for x in p.placements],
            "mesh": list(p.device_mesh.mesh_dim_names or ()),
            "local": p.to_local().numel(),
            "full": p.numel(),
        }
    return out


def _diffs(model: nn.Module, ref: nn.Module) -> dict[str, float]:
    """Per parameter, the largest difference between the sharded model's full weights and the reference's."""
    ref_params = dict(ref.named_parameters())
    return {  # full_tensor is a collective: every rank, same order
        name: (p.full_tensor().detach() - ref_params[name].detach()).abs().max().item() for name, p in model.named_parameters()
    }


def _whole_grads(model: nn.Module) -> dict[str, list[float]]:
    """Local gradients of the parameters the plan keeps whole on tp (their last placement is Replicate)."""
    return {
        n: p.grad.to_local().flatten().tolist()
        for n, p in model.named_parameters()
        if p.grad is not None and p.placements[-1].is_replicate() and p.dim() == 1
    }


def train_tp(family: str, tied: bool = False) -> dict[str, Any]:
    ref = tiny_model(family, tied)
    model = copy.deepcopy(ref)
    ref_losses, ref_grads = reference(ref)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = find_tp_plan(model)
    assert plan is not None
    plan.apply(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    dp_rank, losses, grads, grad_diffs, comms = mesh["dp"].get_local_rank(), [], {}, {}, {}
    for step, ids in enumerate(batches()):
        local = ids.chunk(2)[dp_rank]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = model(input_ids=local, labels=local).loss
            loss.backward()
        if step == 0:
            # The layout's collectives as torch ran them (DTensor's functional collectives; fully_shard's are c10d's).
            comms = {e.key: e.count for e in prof.key_averages() if e.key.startswith("_c10d_functional::")}
            grads = _whole_grads(model)
            grad_diffs = {n: (p.grad.full_tensor() - ref_grads[n]).abs().max().item() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(total.item() / 2)
    return {
        "rows": plan.rows(),
        "losses": losses,
        "ref_losses": ref_losses,
        "diffs": _diffs(model, ref),
        "params": _placements(model),
        "whole_grads": grads,
        "grad_diffs": grad_diffs,
        "comms": comms,
        "expected_comms": [[c.collective, c.phase] for c in plan.collectives(model)],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "coordinate": mesh.get_coordinate(),
    }


def tp_only(family: str) -> dict[str, Any]:
    """The plan alone, no fully_shard: gradients averaged over dp by hand, partial ones summed by the plan's hook."""
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    ref_losses, _ = reference(ref)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    find_tp_plan(model).apply(model, mesh["tp"])  # type: ignore[union-attr]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    dp_rank, dp_group, losses, norm_grad = mesh["dp"].get_local_rank(), mesh["dp"].get_group(), [], ""
    for ids in batches():
        local = ids.chunk(2)[dp_rank]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        norm_grad = norm_grad or str(model.model.layers[0].self_attn.q_norm.weight.grad.placements)
        for p in model.parameters():
            grad = p.grad.to_local()
            dist.all_reduce(grad, group=dp_group)
            grad.div_(2)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / 2)
    return {"losses": losses, "ref_losses": ref_losses, "norm_grad": norm_grad}


def plain() -> dict[str, Any]:
    """A module's own ``_tp_plan`` (no transformers), FSDP over dp on the root only."""
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 16, generator=g) for _ in range(STEPS)]

    def step(m: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> float:
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=EPS)
    ref_losses = [step(ref, x, opt) for x in xs]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    find_tp_plan(model).apply(model, mesh["tp"])  # type: ignore[union-attr]
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for x in xs:
        loss = model(x.chunk(2)[dp_rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(total.item() / 2)
    return {"losses": losses, "ref_losses": ref_losses, "diffs": _diffs(model, ref), "params": _placements(model)}


def meta() -> dict[str, Any]:
    """The layout applied to a model built on the meta device (as autoshard builds it), no data moved."""
    with torch.device("meta"):
        model = tiny_model("llama", tied=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    find_tp_plan(model).apply(model, mesh["tp"])  # type: ignore[union-attr]
    return {
        "meta": all(p.is_meta for p in model.parameters()),
        "params": {n: [str(x) for x in p.placements] for n, p in model.named_parameters()},
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


# -- through Lightning: FSDP2Strategy(tensor_parallel_size=2) -------------------------------------------------------
SAMPLES = 16  # 8 sequences per data-parallel rank at dp 2: 4 steps of 2 per epoch
CHECKPOINTS = Path("checkpoints")  # in the 4-rank launch's directory (the workers' cwd)


def sequences() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))


class CausalLM(pl.LightningModule):
    """A LightningModule holding a transformers decoder at ``self.model``; it records what each rank trained on."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__()
        self.model = tiny_model(family)
        self.losses: list[float] = []
        self.batches: list[list[list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        self.batches.append(ids.tolist())
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=EPS)


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def lightning_fit() -> dict[str, Any]:
    """dp 2 x tp 2 through the strategy: the ranks of a tp pair read one batch, the sampler spans the 2 dp ranks, and
    the run matches one process trained on the dp ranks' batches put together."""
    module = CausalLM()
    ref = copy.deepcopy(module.model)
    trainer = quiet_trainer(strategy=FSDP2Strategy(tensor_parallel_size=2), precision="32-true", max_epochs=1)
    trainer.fit(module, DataLoader(sequences(), batch_size=2, shuffle=False))
    sampler = trainer.train_dataloader.sampler
    mesh = trainer.strategy.device_mesh
    coordinates, batches, losses = _gather(mesh.get_coordinate()), _gather(module.batches), _gather(module.losses)
    dp_ranks = sorted((c[0], r) for r, c in enumerate(coordinates) if c[1] == 0)  # one rank per dp coordinate
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=EPS)
    ref_losses = []
    for step in range(len(module.batches)):
        ids = torch.tensor([row for _, r in dp_ranks for row in batches[r][step]])
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    global_losses = [sum(losses[r][step] for _, r in dp_ranks) / len(dp_ranks) for step in range(len(module.batches))]
    params = dict(module.model.named_parameters())
    ref_params = dict(ref.named_parameters())
    return {
        "mesh": [list(mesh.mesh_dim_names or ()), list(mesh.shape)],
        "coordinates": coordinates,
        "sampler": [getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)],
        "batches": batches,
        "losses": global_losses,
        "ref_losses": ref_losses,
        "diffs": {n: (p.full_tensor().detach() - ref_params[n].detach()).abs().max().item() for n, p in params.items()},
        "placements": {n: [str(x) for x in p.placements] for n, p in params.items()},
    }


def resume_run(checkpoints: Path | None, ckpt_path: Path | None, max_epochs: int, tp: int, max_steps: int = -1) -> dict[str, Any]:
    """One fit of CausalLM on ``tp`` tensor-parallel ranks (from ``ckpt_path`` if given), saving at every epoch end
    into ``checkpoints``; the full state right after the restore, at every epoch end and at the end."""
    module, capture = CausalLM(), Capture(None)
    savers = [ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_top_k=-1, filename="{epoch}-{step}")] if checkpoints else []
    trainer = quiet_trainer(strategy=FSDP2Strategy(tensor_parallel_size=tp), precision="32-true", max_epochs=max_epochs, max_steps=max_steps,
                            callbacks=[capture, *savers], enable_checkpointing=bool(savers), num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, DataLoader(sequences(), batch_size=2, shuffle=False), ckpt_path=ckpt_path)
    return {"start": capture.start, "epochs": capture.epochs, "final": full_state(trainer, module, None), "step": trainer.global_step}


def resumed(saved: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Loaded == saved, bit for bit (weights, AdamW state, step counter), then it trained on."""
    return {
        "loaded_equals_saved": compare(saved, run["start"], ignore=("next_epoch",)),
        "optimizer_entries": len([k for k in saved if k.startswith("optimizer/") and "exp_avg" in k]),
        "trained": len([k for k in run["final"] if k.startswith("param/") and not torch.equal(run["start"][k], run["final"][k])]),
        "steps": [saved["global_step"], run["step"]],
    }


def resume_across_tp() -> dict[str, Any]:
    """tp 2 (dp 2) saves at epoch 0; tp 1 (dp 4) on the same 4 ranks resumes it and saves at epoch 1; tp 2 resumes that."""
    tp2 = resume_run(CHECKPOINTS / "tp2", None, 1, tp=2)
    saved = next((CHECKPOINTS / "tp2").glob("epoch=0-*.ckpt"))
    tp1 = resume_run(CHECKPOINTS / "tp1", saved, 2, tp=1)
    back = resume_run(None, next((CHECKPOINTS / "tp1").glob("epoch=1-*.ckpt")), 3, tp=2)
    if dist.get_rank() == 0:  # for the 2-rank launch and for convert (the test process)
        torch.save(tp2["epochs"][0], CHECKPOINTS / "tp2_epoch0.pt")
    dist.barrier()
    return {"tp2_to_tp1": resumed(tp2["epochs"][0], tp1), "tp1_to_tp2": resumed(tp1["epochs"][0], back), "saved": saved.name}


def resume_on_2_ranks() -> dict[str, Any]:
    """The 4-rank tp 2 checkpoint resumed on 2 ranks, as tp 1 (dp 2) and as tp 2 (dp 1); from inside the 4-rank
    launch's directory."""
    here = Path("..") / CHECKPOINTS
    saved = torch.load(here / "tp2_epoch0.pt", weights_only=True)
    ckpt = next((here / "tp2").glob("epoch=0-*.ckpt"))
    return {f"tp{tp}": resumed(saved, resume_run(None, ckpt, 2, tp=tp)) for tp in (1, 2)}


if __name__ == "__main__":
    run_scenarios(
        {
            "llama": lambda: train_tp("llama"),
            "llama_tied": lambda: train_tp("llama", tied=True),
            "qwen2": lambda: train_tp("qwen2"),
            "qwen3": lambda: train_tp("qwen3"),
            "qwen3_tp_only": lambda: tp_only("qwen3"),
            "plain": plain,
            "meta": meta,
            "lightning_fit": lightning_fit,
            "resume_across_tp": resume_across_tp,
            "resume_on_2_ranks": resume_on_2_ranks,
        }
    )
