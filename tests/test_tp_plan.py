"""Reading and checking a model's own tensor-parallel plan, without processes (autoshard.adapters.tp_plan).

What users care about here: the plan autoshard applies is the model's (every wildcard resolved to the modules that
exist, nested inside a LightningModule or not), and what would train wrongly is refused before training with numbers
and a Fix. Applying the plan needs a process group: tests/distributed/test_tp.py.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from autoshard.adapters.tp_plan import MOE_STYLES, STYLES, StyleKind, find_tp_plan
from autoshard.errors import IncompatibleBackendError, IntentError

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
LLAMA_ROWS = [
    ("self_attn.q_proj", "colwise"),
    ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"),
    ("self_attn.o_proj", "rowwise"),
    ("mlp.gate_proj", "colwise"),
    ("mlp.up_proj", "colwise"),
    ("mlp.down_proj", "rowwise"),
]


def llama(**changes: object) -> nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, **changes}))


class Wrapper(nn.Module):
    """A LightningModule's shape: the transformers model at ``self.model``, a probe of one's own beside it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.probe = nn.Linear(64, 3)


def expected_llama_rows(prefix: str = "") -> list[tuple[str, str]]:
    rows = [(f"{prefix}model.embed_tokens", "embedding_rowwise")]
    rows += [(f"{prefix}model.layers.{i}.{path}", style) for i in range(2) for path, style in LLAMA_ROWS]
    return [*rows, (f"{prefix}lm_head", "colwise_gather_output")]


def test_llama_plan_resolves_every_wildcard_in_module_order() -> None:
    plan = find_tp_plan(llama())
    assert plan is not None
    assert plan.rows() == expected_llama_rows()
    assert plan.roots == ("",) and plan.unmatched == () and plan.notes == []
    assert "LlamaForCausalLM" in plan.sources[0]


def test_a_model_nested_in_a_lightning_module_gets_paths_relative_to_the_outer_module() -> None:
    plan = find_tp_plan(Wrapper(llama()))
    assert plan is not None
    assert plan.rows() == expected_llama_rows("model.")
    assert plan.roots == ("model",)  # the probe beside it is outside: it stays a plain tensor
    assert all(not path.startswith("probe") for path, _ in plan.rows())


def test_without_transformers_resolved_plan_it_is_built_from_config_and_class_plans() -> None:
    """Older transformers keep no resolved instance plan: the class's ``_tp_plan`` and the config's
    ``base_model_tp_plan`` under the base model's prefix give the same layout (the embedding rule comes from the
    tied head only, below)."""
    model = llama()
    del model.__dict__["_tp_plan"]
    plan = find_tp_plan(model)
    assert plan is not None
    assert plan.rows() == [row for row in expected_llama_rows() if row[0] != "model.embed_tokens"]
    assert "LlamaForCausalLM._tp_plan + LlamaConfig.base_model_tp_plan" in plan.sources[0]


def test_a_tied_embedding_gets_the_split_of_its_head() -> None:
    """lm_head is colwise (vocabulary rows): the tied embedding gets embedding_rowwise, the same rows, so the one
    tensor keeps one layout; said in the plan's notes."""
    model = llama(tie_word_embeddings=True)
    del model.__dict__["_tp_plan"]
    plan = find_tp_plan(model)
    assert plan is not None
    assert ("model.embed_tokens", "embedding_rowwise") in plan.rows()
    entry = next(e for e in plan.entries if e.path == "model.embed_tokens")
    assert entry.why == "tied to 'lm_head.weight', which the plan splits on dimension 0"
    assert plan.notes == ["'model.embed_tokens' gets 'embedding_rowwise': tied to 'lm_head.weight', which the plan splits on dimension 0"]
    plan.check(model, 2)  # one layout: accepted


def test_qwen3_norms_keep_their_gradient_summing_style() -> None:
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, head_dim=16))
    plan = find_tp_plan(model)
    assert plan is not None
    norms = [(p, s) for p, s in plan.rows() if "norm" in p]
    assert norms == [(f"model.layers.{i}.self_attn.{n}_norm", "replicated_with_grad_allreduce") for i in range(2) for n in ("q", "k")]
    assert STYLES["replicated_with_grad_allreduce"].kind is StyleKind.REPLICATE_SUM_GRADS
    plan.check(model, 2)


def test_an_expert_parallel_plan_is_left_alone_and_said() -> None:
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SIZES, num_local_experts=4))
    plan = find_tp_plan(model)
    assert plan is not None
    assert not any("experts" in path for path, _ in plan.rows())
    assert "experts stay whole on every tensor-parallel rank" in plan.notes[0]
    plan.check(model, 2)


class Plain(nn.Module):
    """A model of one's own with a plain ``_tp_plan`` dict: wildcards are one path component."""

    _tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "blocks.*.gone": "colwise"}

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2))


def test_a_plain_tp_plan_attribute_is_a_plan_and_unmatched_keys_are_noted() -> None:
    plan = find_tp_plan(Plain())
    assert plan is not None
    assert plan.rows() == [("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"), ("blocks.1.up", "colwise"), ("blocks.1.down", "rowwise")]
    assert plan.unmatched == ("blocks.*.gone",)
    assert plan.notes == ["plan key 'blocks.*.gone' names no module or parameter of this model: ignored"]


def test_no_plan_is_none() -> None:
    """A module without any plan, and a transformers model whose family has none (GPT-2): the caller's refusal stands."""
    assert find_tp_plan(nn.Sequential(nn.Linear(4, 4))) is None
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    assert find_tp_plan(Wrapper(gpt2)) is None


# -- refusals -----------------------------------------------------------------------------------------------------
def test_heads_not_divisible_name_both_counts_and_the_sizes_that_work() -> None:
    model = llama()
    plan = find_tp_plan(model)
    assert plan is not None
    plan.check(model, 1)
    plan.check(model, 2)
    with pytest.raises(IntentError) as err:
        plan.check(model, 4)  # 4 query heads would split, 2 key/value heads would not
    assert str(err.value) == (
        "tensor_parallel_size=4 does not divide the attention heads of 'model.layers.0.self_attn' (num_attention_heads=4"
        " and num_key_value_heads=2): each tensor-parallel rank must hold whole query and key/value heads."
        " Fix: tensor_parallel_size= one of 1, 2"
    )


def test_a_split_dimension_that_does_not_divide_is_refused() -> None:
    model = llama(intermediate_size=130)  # 130 divides by 2
    plan = find_tp_plan(model)
    assert plan is not None
    plan.check(model, 2)
    model = llama(intermediate_size=130, num_attention_heads=8, num_key_value_heads=4)  # heads divide by 4, 130 does not
    plan = find_tp_plan(model)
    with pytest.raises(IntentError, match=r"does not divide 'model.layers.0.mlp.gate_proj.weight' dimension 0 \(colwise\), which is 130") as err:
        plan.check(model, 4)  # type: ignore[union-attr]
    assert str(err.value).endswith("Fix: tensor_parallel_size= one of 1, 2")


class Styled(nn.Module):
    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self._tp_plan = plan
        self.attn = nn.Linear(8, 8)
        self.experts = nn.Linear(8, 8)
        self.packed = nn.Linear(8, 16)
        self.conv = nn.Conv1d(8, 8, 1)


def test_unsupported_styles_are_named_moe_first() -> None:
    model = Styled({"attn": "colwise", "packed": "packed_colwise", "experts": "moe_tp_experts", "conv": "sequence_parallel"})
    plan = find_tp_plan(model)
    with pytest.raises(IncompatibleBackendError) as err:
        plan.check(model, 2)  # type: ignore[union-attr]
    text = str(err.value)
    assert text.index("'moe_tp_experts' (mixture-of-experts experts split") < text.index("'packed_colwise'") < text.index("'sequence_parallel'")
    assert "on 'experts'" in text and "has no mixture-of-experts layout yet" in text
    assert text.endswith(
        "Fix: set tensor_parallel_size=1 (FSDP alone), or pass FSDP2Strategy(parallelize_fn=fn), where fn lays out these modules itself on device_mesh['tensor_parallel']"
    )
    assert set(MOE_STYLES) >= {"moe_tp_experts", "grouped_gemm"}


def test_an_unknown_style_and_a_parameter_rule_are_refused_by_name() -> None:
    model = Styled({"attn": "colwize", "experts.weight": "local_params"})
    with pytest.raises(IncompatibleBackendError) as err:
        find_tp_plan(model).check(model, 2)  # type: ignore[union-attr]
    assert "'colwize' (not a style autoshard knows) on 'attn'" in str(err.value)
    assert "'local_params' (a parameter-level rule run on local tensors) on 'experts.weight'" in str(err.value)


def test_a_style_on_a_module_it_cannot_split_is_refused() -> None:
    model = Styled({"conv": "colwise"})
    with pytest.raises(IncompatibleBackendError) as err:
        find_tp_plan(model).check(model, 2)  # type: ignore[union-attr]
    assert str(err.value).startswith("the tensor-parallel plan gives 'conv' (Conv1d) the style 'colwise', which splits Linear layers only")


class TiedTwoWays(nn.Module):
    """An input embedding split by hidden columns tied to a head split by vocabulary rows: one tensor, two layouts."""

    _tp_plan = {"embed": "embedding_colwise", "head": "colwise_gather_output"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_tensor_split_two_ways_is_refused() -> None:
    model = TiedTwoWays()
    with pytest.raises(IncompatibleBackendError) as err:
        find_tp_plan(model).check(model, 2)  # type: ignore[union-attr]
    assert str(err.value).startswith(
        "'embed.weight' and 'head.weight' are one tied tensor, but the tensor-parallel plan would split it two ways:"
        " 'embed.weight' split on dimension 1; 'head.weight' split on dimension 0."
    )
    assert "Fix: untie them (e.g. config.tie_word_embeddings=False)" in str(err.value)


def test_tp_size_must_be_a_positive_integer() -> None:
    model = llama()
    with pytest.raises(IntentError, match="tensor_parallel_size must be a positive integer, got 0"):
        find_tp_plan(model).check(model, 0)  # type: ignore[union-attr]


# -- what the layout costs: per-rank bytes and traffic (autoshard.memory, autoshard explain) ----------------------
def test_per_rank_states_under_tp_are_the_shards_the_ranks_hold() -> None:
    """dp 2 x tp 2, fp32: each rank holds 22,688 parameter elements of the tiny Llama (counted on 4 gloo ranks in
    tests/distributed/test_tp.py: a quarter of every split weight, half of every norm); gradients the same, AdamW
    twice that; the unsharded figure stays the whole model's."""
    from autoshard.intent import ShardingIntent
    from autoshard.memory import estimate_memory_many
    from autoshard.needs import MethodNeeds

    model = llama()
    opt = torch.optim.AdamW(model.parameters())
    tp2, tp1 = (
        estimate_memory_many(model, ShardingIntent(tensor_parallel_size=tp, precision="32-true"), MethodNeeds(), [4], "fsdp2", optimizers=[opt])[0]
        for tp in (2, 1)
    )
    assert tp2.parameters == 22_688 * 4 and tp2.gradients == tp2.parameters
    assert tp2.optimizer_states == 2 * tp2.parameters + 4 * 21  # exp_avg, exp_avg_sq; one step count per tensor
    assert tp2.full_model_states == tp1.full_model_states and tp2.world_size == 4 and tp2.shard_group == 4
    assert tp2.gathered_block < tp1.gathered_block  # a block is all-gathered over dp only, a tp slice of it


def test_tp_collectives_join_the_traffic_rows() -> None:
    from autoshard.intent import ShardingIntent
    from autoshard.memory import EstimateOptions, estimate_memory_many
    from autoshard.needs import MethodNeeds

    model = llama()
    opt = torch.optim.AdamW(model.parameters())
    intent = ShardingIntent(tensor_parallel_size=2, precision="32-true")
    with_tokens = estimate_memory_many(model, intent, MethodNeeds(), [4], "fsdp2", optimizers=[opt], options=EstimateOptions(tokens=32))[0]
    rows = {t.collective: t for t in with_tokens.traffic}
    # forward, per token: 2 layers x (o_proj + down_proj) and the embedding all-reduce 64 floats (ring: 2 (g-1)/g)
    assert rows["tensor parallel: all-reduce of activations (forward)"].bytes == 5 * 64 * 4 * 32
    # backward, per token: 2 layers x (q/k/v, gate/up: siblings share one input, SharedInput) and the head all-reduce
    # their 64-wide input gradient
    assert rows["tensor parallel: all-reduce of activations (backward)"].bytes == 5 * 64 * 4 * 32
    # the head's logits: 128 per token, half of them sent (ring all-gather, g = 2)
    assert rows["tensor parallel: all-gather of activations (forward)"].bytes == 128 * 4 * 32 // 2
    assert rows["all-gather of parameters (forward, backward)"].group == 2  # fully_shard's, over dp only
    without = estimate_memory_many(model, intent, MethodNeeds(), [4], "fsdp2", optimizers=[opt])[0]
    assert not any(t.collective.startswith("tensor parallel") for t in without.traffic)
    assert any("tensor-parallel traffic per token" in n and "(pass --batch to count it)" in n for n in without.notes)


class LitLlama(pl.LightningModule):
    """What ``autoshard explain`` builds: a LightningModule holding the tiny Llama at ``self.model``."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, "num_attention_heads": heads}))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def test_explain_lists_the_layout_and_counts_its_traffic() -> None:
    from autoshard.explain import ExplainOptions, explain
    from autoshard.intent import ShardingIntent

    report = explain(
        LitLlama, backend="fsdp2", intent=ShardingIntent(tensor_parallel_size=2), world_sizes=(1, 2, 4), options=ExplainOptions(simulate=False)
    )
    assert report.error is None
    layout = report.to_dict()["tensor_parallel"]
    assert layout["size"] == 2 and {"module": "model.lm_head", "style": "colwise_gather_output"} in layout["modules"]
    assert layout["split_parameters"]["model.model.layers.0.self_attn.o_proj.weight"] == 1
    assert "model.model.norm.weight" not in layout["split_parameters"]  # whole on each tensor-parallel rank
    assert [e.world_size for e in report.memory] == [2, 4]
    assert "world size(s) 1 left out: tensor_parallel_size=2 does not divide them" in report.notes
    text = report.text()
    assert "== tensor-parallel layout (2 ranks, the model's own plan) ==" in text
    assert "model.model.layers.*.self_attn.o_proj  rowwise" in text and "weight (64, 64) -> (64, 32) per rank; all-reduce of the output" in text
    assert "the memory table assumes pure data parallel" not in text


def test_explain_refuses_what_setup_refuses() -> None:
    from autoshard.explain import ExplainOptions, explain
    from autoshard.intent import ShardingIntent

    report = explain(
        lambda: LitLlama(heads=2),
        backend="fsdp2",
        intent=ShardingIntent(tensor_parallel_size=4),
        world_sizes=(4, 8),
        options=ExplainOptions(simulate=False),
    )
    assert report.exit_code == 1 and report.error_type == "IntentError"
    assert report.error.startswith("tensor_parallel_size=4 does not divide the attention heads of 'model.model.layers.0.self_attn'")  # type: ignore[union-attr]
