"""One rank of the checks of tests/fabric/test_peft.py (issue 39, items 1 and 2), one process pair for all: LoRA on a
tiny Hugging Face Llama, the ``PeftModel`` given straight to ``fabric.setup`` under ``strategy="auto-shard"``; and a
litgpt-shaped ``GPT`` (``lm_head`` registered before ``transformer``, no example input) whose first training forward
decides which unit stays gathered. Each against one process on the global batch; each scenario returns what THIS rank
holds; the reference is computed on every rank from the global batch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import autoshard  # noqa: F401  registers Fabric's strategy names
from tests.distributed.harness import run_scenarios

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
GLOBAL_BATCH, TOKENS, VOCAB, STEPS = 4, 6, 64, 3


def lora_model(task_type: str | None) -> nn.Module:
    """The same tiny Llama with LoRA on q and v on every rank (seeded); ``task_type=None`` gives the base ``PeftModel``,
    whose forward calls ``base_model.model`` directly, skipping the ``LoraModel`` between them."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type=task_type)
    return peft.get_peft_model(model, lora)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, TOKENS), generator=torch.Generator().manual_seed(100 + step))


def full(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole, by its name in the PeftModel (a collective for the sharded ones)."""
    from torch.distributed.tensor import DTensor

    module = getattr(module, "module", module)
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def train(model: nn.Module, opt: torch.optim.Optimizer, rows: slice, backward: Any) -> list[float]:
    losses = []
    for step in range(STEPS):
        x = batch(step)[rows]
        loss = model(input_ids=x, labels=x).loss
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def fabric_lora(task_type: str | None) -> dict[str, Any]:
    """fabric.setup(peft_model, AdamW built before setup) under auto-shard, three steps on this rank's rows."""
    from lightning.fabric import Fabric

    f = Fabric(accelerator="cpu", devices=WORLD, strategy="auto-shard")
    f.launch()
    model = lora_model(task_type)
    start = full(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model, opt = f.setup(model, opt)
    rows = GLOBAL_BATCH // WORLD
    train(model, opt, slice(RANK * rows, (RANK + 1) * rows), f.backward)
    got = full(model)
    ref = lora_model(task_type)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    train(ref, ref_opt, slice(None), lambda loss: loss.backward())
    want = full(ref)
    plan = f.strategy.plan
    return {
        "vs_reference": max(float((got[n] - want[n]).abs().max()) for n in want),
        "moved": max(float((got[n] - start[n]).abs().max()) for n in start),
        "same_names": sorted(got) == sorted(want),
        "units": [u.name for u in plan.units],
        "forward_order": plan.forward_order,
        "notes": plan.notes,
    }


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class GPT(nn.Module):
    """litgpt's layout: ``lm_head`` registered first, the blocks in a ModuleDict that forward reads piece by piece."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, d), h=nn.ModuleList(Block(d) for _ in range(2)), ln_f=nn.LayerNorm(d)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def gpt_order() -> dict[str, Any]:
    """No example input at setup: registration order until the first training forward shows the real one."""
    from lightning.fabric import Fabric
    from torch.distributed.tensor import DTensor

    f = Fabric(accelerator="cpu", devices=WORLD, strategy="auto-shard")
    f.launch()
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, opt = f.setup(model, opt)
    plan = f.strategy.plan
    before = {u.name: u.reshard.keeps for u in plan.units}
    rows = GLOBAL_BATCH // WORLD
    gathered = []
    for step in range(STEPS):
        loss = gpt_loss(model, batch(step)[RANK * rows : (RANK + 1) * rows])
        inner = model.module
        gathered.append({n: not isinstance(inner.get_parameter(f"{n}.weight"), DTensor) for n in ("lm_head", "transformer.ln_f")})
        f.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.module.named_parameters()}
    torch.manual_seed(0)
    ref = GPT()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        gpt_loss(ref, batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return {
        "vs_reference": max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters()),
        "kept_at_setup": before,
        "kept_after": {u.name: u.reshard.keeps for u in plan.units},
        "gathered_after_forward": gathered,
        "forward_order": plan.forward_order,
    }


def peft_model() -> dict[str, Any]:
    return fabric_lora(None)


def peft_causal_lm() -> dict[str, Any]:
    return fabric_lora("CAUSAL_LM")


if __name__ == "__main__":
    run_scenarios({"peft_model": peft_model, "peft_causal_lm": peft_causal_lm, "gpt_order": gpt_order})
