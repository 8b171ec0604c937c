"""What compiling a block saves in activation memory, counted on fake tensors (``activations.compiled``), against
what one H200 measured (docs/benchmarks.md, "GPU: make gpu-check on one H200")."""

from __future__ import annotations

import pytest
import torch

from autoshard.activations.compiled import block_saving

transformers = pytest.importorskip("transformers")

GIB = 2**30


def llama_layer(hidden: int, ffn: int, heads: int, kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        return LlamaDecoderLayer(config, 0)


def saving(layer: torch.nn.Module, batch: int, seq: int, hidden: int, head_dim: int) -> object:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
        cos = torch.empty(1, seq, head_dim, dtype=torch.bfloat16)
        return block_saving(layer, (x,), {"position_embeddings": (cos, torch.empty_like(cos))}, torch.bfloat16)


def test_compiling_the_decoder_layers_of_the_h200_llama_saves_what_the_h200_measured() -> None:
    """0.9B Llama (hidden 2048, ffn 5632, 16 heads, 8 kv heads), 4 x 2048 tokens, bf16 gathers: compiling each of
    the 16 layers lowered the measured peak from 27.09 to 23.71 GiB (3.38 GiB); the count is within 5% of it."""
    found = saving(llama_layer(2048, 5632, 16, 8), 4, 2048, 2048, 128)
    assert found.compiled < found.eager
    assert 16 * found.saved / GIB == pytest.approx(27.09 - 23.71, rel=0.05)


def test_the_saving_grows_with_the_batch_and_leaves_parameters_and_inputs_out() -> None:
    """Saved activations are per row of the batch plus what all rows share (the rotary tables): each further two rows
    keep the same bytes, eager and compiled; the parameters (alive anyway) are not counted."""
    layer = llama_layer(256, 704, 4, 2)
    two, four, six = (saving(layer, rows, 128, 256, 64) for rows in (2, 4, 6))
    assert four.eager - two.eager == six.eager - four.eager > 0
    assert four.compiled - two.compiled == six.compiled - four.compiled > 0
    assert 0 < two.saved < four.saved < six.saved
    weights = sum(p.numel() * 2 for p in layer.parameters())
    assert saving(layer, 1, 1, 256, 64).eager < weights / 10  # one token: the weights are not in it


def tiny_llama_module() -> type:
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=128,
        use_cache=False,
        attn_implementation="sdpa",
    )

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    return LM


def test_the_simulated_step_of_compiled_blocks_peaks_lower_by_what_each_block_keeps_less() -> None:
    """compile=True: the simulated step (eager on fake tensors) peaks lower than eager by what the two decoder layers'
    compiled graphs keep less, and says so; checkpointed blocks keep only their input, compiled or not: no change."""
    from autoshard import ShardingIntent
    from autoshard.activations import measure_step
    from autoshard.precision import resolve_precision

    module = tiny_llama_module()

    def step(**fields: object) -> object:
        intent = ShardingIntent(precision="bf16-mixed", **fields)
        return measure_step(module, intent, 1, resolve_precision(None, intent), make_batch=lambda: torch.zeros(4, 128, dtype=torch.long))

    eager, compiled = step(), step(compile=True)
    layer = saving(module().model.model.layers[0].to("meta"), 4, 128, 256, 64)
    assert eager.peak - compiled.peak == eager.activations - compiled.activations == 2 * layer.saved > 0
    assert any(note.startswith("compile: 2 block(s) compiled in place") for note in compiled.notes)
    assert step(activation_checkpointing=True, compile=True).peak == step(activation_checkpointing=True).peak

    class WrappedByTheUser(module):  # a whole-model torch.compile: its blocks are compiled at setup, as compile=True's
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.compile(self.model)

    intent = ShardingIntent(precision="bf16-mixed")
    wrapped = measure_step(WrappedByTheUser, intent, 1, resolve_precision(None, intent), make_batch=lambda: torch.zeros(4, 128, dtype=torch.long))
    assert wrapped.peak == compiled.peak


def test_compile_auto_compiles_when_the_defaults_do_not_fit_and_before_any_recomputation() -> None:
    """compile='auto' under a memory budget: the run stays eager when the defaults fit (no start-up cost); when they
    do not, compiled blocks (fewer activations, a faster step) come before recomputation or offload; under DeepSpeed,
    which autoshard does not compile, the budget leaves compile alone. A Trainer's precision string is taken as the
    run's precision."""
    from autoshard import ShardingIntent
    from autoshard.budget import DecideOptions, decide

    module = tiny_llama_module()
    batch = torch.zeros(4, 128, dtype=torch.long)
    options = DecideOptions(precision="bf16-mixed")

    def chosen(budget: int, **fields: object) -> dict[str, object]:
        intent = ShardingIntent(memory_budget=budget, memory_headroom=0, compile="auto", **fields)
        return decide(module, batch, intent, 1, options=options).chosen

    eager = decide(module, batch, ShardingIntent(memory_budget=2**40, memory_headroom=0), 1, options=options).peak
    compiled = decide(module, batch, ShardingIntent(memory_budget=2**40, memory_headroom=0, compile=True), 1, options=options).peak
    assert compiled < eager
    assert chosen(eager).get("compile") is False
    assert chosen(compiled) == {"reshard_after_forward": True, "activation_checkpointing": False, "offload": "none", "compile": True}
    assert "compile" not in decide(module, batch, ShardingIntent(memory_budget=2**40, compile="auto"), 1, backend="deepspeed", options=options).chosen
