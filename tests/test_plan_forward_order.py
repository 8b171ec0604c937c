"""The FSDP2 plan takes the order units actually run in, and the modules actually called (issue 39, items 1 and 2), from
one forward traced on the meta device (``adapters.forward_trace``), in process: a litgpt-shaped ``GPT`` that registers
``lm_head`` before ``transformer`` keeps ``lm_head`` gathered after forward; a unit whose forward its parent skips
(``PeftModel.forward`` calls ``base_model.model``) gives way to the module that runs; parameters read without calling
their module are refused by name. The 2-rank runs (a PeftModel trained in Fabric, the first forward's order deciding
when no example input is known) are in tests/fabric/test_peft.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard import ShardingIntent
from autoshard.adapters.fsdp2 import Reshard, plan_fsdp2, reshard_in_order
from autoshard.errors import AutoShardError

VOCAB, D = 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class GPT(nn.Module):
    """litgpt's layout: ``lm_head`` registered before ``transformer``; forward runs wte, the blocks, ln_f, lm_head."""

    def __init__(self, example: bool = True) -> None:
        super().__init__()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, D), h=nn.ModuleList(Block() for _ in range(2)), ln_f=nn.LayerNorm(D)))
        self.drop = nn.Dropout(0.5)
        self.calls = 0
        if example:
            self.example_input_array = torch.zeros(2, 4, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # side effects a traced forward must not leave behind
        self.last = idx
        self.register_buffer("cache", torch.zeros(1, device=idx.device), persistent=False)
        x = self.drop(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def kept(plan) -> dict[str, Reshard]:  # noqa: ANN001
    return {u.name: u.reshard for u in plan.units if u.reshard.keeps}


def test_182_a_litgpt_shaped_gpt_keeps_lm_head_gathered_by_its_traced_forward_order() -> None:
    """Registration order would keep ``transformer.ln_f`` and reshard ``lm_head``, which backward gathers at once; the
    traced forward keeps ``lm_head``, the plan says where its order came from, and the trace leaves the model as it was
    (weights, attributes its forward sets, the random generator)."""
    model = GPT()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    plan = plan_fsdp2(model)
    assert kept(plan) == {"lm_head": Reshard.KEPT_LAST}
    assert plan.forward_order == "traced: one forward of GPT on the meta device with its example_input_array"
    assert "reshard_after_forward (forward order: traced: one forward of GPT on the meta device" in plan.describe()
    assert plan.to_dict()["forward_order"] == plan.forward_order
    assert model.calls == 0 and not hasattr(model, "last") and not hasattr(model, "cache")
    assert all(torch.equal(p, weights[n]) and p.device.type == "cpu" for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_without_an_example_input_the_plan_says_so_and_the_first_forward_decides() -> None:
    """No input to trace with at setup: registration order, said in the plan; the order a training forward returned
    from the units in (what the strategies log at the first step) moves the kept unit to ``lm_head``."""
    plan = plan_fsdp2(GPT(example=False))
    assert plan.forward_order.startswith("registration order: GPT carries no example input"), plan.forward_order
    assert "GPT.example_input_array" in plan.forward_order
    assert kept(plan) == {"transformer.ln_f": Reshard.KEPT_LAST}
    ran = ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"]
    units = {u.name: u.reshard for u in reshard_in_order(plan, ran)}
    assert units["lm_head"] is Reshard.KEPT_LAST
    assert units["transformer.ln_f"] is Reshard.AFTER_FORWARD
    assert [u.name for u in reshard_in_order(plan, ran[:-1])] == [u.name for u in plan.units]  # lm_head never ran: unchanged
    assert reshard_in_order(plan, ran[:-1]) == plan.units


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Tuner(nn.Module):
    """peft's ``LoraModel``: holds the model, forwards to it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Wrapper(nn.Module):
    """peft's ``PeftModel``: its forward calls ``base_model.model``, never ``base_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.base_model = Tuner()
        self.example_input_array = torch.zeros(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model.model(x)


def test_a_unit_whose_forward_the_parent_skips_gives_way_to_the_module_that_runs() -> None:
    plan = plan_fsdp2(Wrapper())
    names = [u.name for u in plan.units]
    assert "base_model" not in names
    assert names[-1] == "base_model.model" and "base_model.model.blocks.0" in names
    assert plan.units[-1].reshard is Reshard.KEPT_LAST
    assert any("uses parameters of 'base_model' while it never calls it (it calls 'base_model.model' directly)" in n for n in plan.notes)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")  # transformers' notice, raised inside peft
def test_180_a_peft_lora_model_is_planned_on_the_module_its_forward_calls() -> None:
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    model = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plan = plan_fsdp2(model)
    assert [u.name for u in plan.units] == ["base_model.model.model.layers.0", "base_model.model.model.layers.1", "base_model.model"]
    assert plan.forward_order == "traced: one forward of PeftModel on the meta device with its dummy_inputs"


class ReadsHead(nn.Module):
    """Its forward reads ``head.weight`` without calling ``head``: FSDP2 would never gather it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Inner()
        self.head = nn.Linear(3, 5)
        self.example_input_array = torch.zeros(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ self.head.weight.T


def test_181_parameters_read_without_calling_their_module_are_refused_by_name_before_training() -> None:
    with pytest.raises(AutoShardError) as refused:
        plan_fsdp2(ReadsHead())
    text = str(refused.value)
    assert text.startswith("ReadsHead.forward uses the parameters of 'head' without calling 'head'")
    assert "mixed torch.Tensor and DTensor" in text
    assert text.endswith(
        "Fix: keep it whole with ShardingIntent(exclude=['head']), or call the module (`self.head(...)`) instead of reading its parameters"
    )
    plan = plan_fsdp2(ReadsHead(), ShardingIntent(exclude=["head"]))  # the Fix works
    assert "head" not in [u.name for u in plan.units]
