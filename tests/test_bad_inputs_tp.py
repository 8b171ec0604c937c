"""The bad-input catalog, rows 100-109 (docs/bad-inputs.md): tensor parallel from the model's own plan.

Each refusal comes from ``TPPlan.check``, which runs before any parameter is split; the rows that are not refused
say what autoshard does instead. No process group: the plan is read and checked on modules built on the meta device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autoshard.adapters.tp_plan import find_tp_plan
from autoshard.errors import IncompatibleBackendError, IntentError

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
UNSUPPORTED_FIX = (
    "Fix: set tensor_parallel_size=1 (FSDP alone), or pass FSDP2Strategy(parallelize_fn=fn), where fn lays out these"
    " modules itself on device_mesh['tensor_parallel']"
)


def meta(cls: str, config: str, **changes: Any) -> nn.Module:
    with torch.device("meta"):
        return getattr(transformers, cls)(getattr(transformers, config)(**{**SIZES, **changes}))


def refused(error: type[Exception], module: nn.Module, tp: int, *expected: str) -> str:
    """Check ``module``'s own plan for ``tp`` ranks, expect ``error``, check every fragment is in the message."""
    plan = find_tp_plan(module)
    assert plan is not None
    with pytest.raises(error) as info:
        plan.check(module, tp)
    text = str(info.value)
    for fragment in expected:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    return text


class Styled(nn.Module):
    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self._tp_plan = plan
        self.attn = nn.Linear(8, 8)
        self.experts = nn.Linear(8, 8)
        self.packed = nn.Linear(8, 16)
        self.conv = nn.Conv1d(8, 8, 1)


def test_100_heads_not_divisible_by_the_tensor_parallel_size() -> None:
    model = meta("LlamaForCausalLM", "LlamaConfig")
    refused(
        IntentError,
        model,
        4,
        "tensor_parallel_size=4 does not divide the attention heads of 'model.layers.0.self_attn' (num_attention_heads=4 and num_key_value_heads=2)",
        "each tensor-parallel rank must hold whole query and key/value heads",
        "Fix: tensor_parallel_size= one of 1, 2",
    )
    find_tp_plan(model).check(model, 2)  # type: ignore[union-attr]  # what the Fix offers is accepted


def test_101_mixture_of_experts_styles_are_named_first() -> None:
    text = refused(
        IncompatibleBackendError,
        Styled({"packed": "packed_colwise", "experts": "moe_tp_experts", "attn": "grouped_gemm"}),
        2,
        "'moe_tp_experts' (mixture-of-experts experts split across tensor-parallel ranks) on 'experts'",
        "'grouped_gemm' (mixture-of-experts grouped matmul of expert parallelism) on 'attn'",
        "has no mixture-of-experts layout yet",
        UNSUPPORTED_FIX,
    )
    assert text.index("grouped_gemm") < text.index("packed_colwise") and text.index("moe_tp_experts") < text.index("packed_colwise")


def test_102_other_unsupported_styles_are_named() -> None:
    refused(
        IncompatibleBackendError,
        Styled({"packed": "packed_colwise", "conv": "sequence_parallel", "attn": "colwize", "experts.weight": "local_params"}),
        2,
        "'packed_colwise' (fused weights packed along the output dimension (strided shards)) on 'packed'",
        "'sequence_parallel' (activations split along the sequence between layers) on 'conv'",
        "'colwize' (not a style autoshard knows) on 'attn'",
        "'local_params' (a parameter-level rule run on local tensors) on 'experts.weight'",
        UNSUPPORTED_FIX,
    )


def test_103_a_split_style_on_a_module_it_cannot_split() -> None:
    refused(
        IncompatibleBackendError,
        Styled({"conv": "colwise"}),
        2,
        "the tensor-parallel plan gives 'conv' (Conv1d) the style 'colwise', which splits Linear layers only",
        "Fix: set tensor_parallel_size=1, or pass FSDP2Strategy(parallelize_fn=fn) that lays out 'conv' itself",
    )


class TiedTwoWays(nn.Module):
    _tp_plan = {"embed": "embedding_colwise", "head": "colwise_gather_output"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight


def test_104_a_tied_tensor_split_two_ways() -> None:
    refused(
        IncompatibleBackendError,
        TiedTwoWays(),
        2,
        "'embed.weight' and 'head.weight' are one tied tensor, but the tensor-parallel plan would split it two ways:"
        " 'embed.weight' split on dimension 1; 'head.weight' split on dimension 0",
        "Fix: untie them (e.g. config.tie_word_embeddings=False), or give both modules styles that split the same dimension",
    )


def test_105_a_split_dimension_not_divisible() -> None:
    refused(
        IntentError,
        meta("LlamaForCausalLM", "LlamaConfig", intermediate_size=130, num_attention_heads=8, num_key_value_heads=4),
        4,
        "tensor_parallel_size=4 does not divide 'model.layers.0.mlp.gate_proj.weight' dimension 0 (colwise), which is 130",
        "Fix: tensor_parallel_size= one of 1, 2",
    )


def test_106_a_tied_embedding_the_plan_leaves_whole_gets_its_heads_split() -> None:
    model = meta("LlamaForCausalLM", "LlamaConfig", tie_word_embeddings=True)
    del model.__dict__["_tp_plan"]  # older transformers: no resolved plan, so no embedding rule of its own
    plan = find_tp_plan(model)
    assert plan is not None
    assert dict(plan.rows())["model.embed_tokens"] == "embedding_rowwise"
    assert "'model.embed_tokens' gets 'embedding_rowwise': tied to 'lm_head.weight', which the plan splits on dimension 0" in plan.notes
    plan.check(model, 2)


def test_107_an_expert_parallel_plan_is_not_applied_and_said() -> None:
    model = meta("MixtralForCausalLM", "MixtralConfig", num_local_experts=4)
    plan = find_tp_plan(model)
    assert plan is not None
    assert any("also has an expert-parallel plan" in n and "the experts stay whole on every tensor-parallel rank" in n for n in plan.notes)
    plan.check(model, 2)


def test_108_explain_world_sizes_the_tensor_parallel_size_does_not_divide() -> None:
    from autoshard.explain import ExplainOptions, explain
    from autoshard.intent import ShardingIntent

    def factory() -> nn.Module:
        return meta("LlamaForCausalLM", "LlamaConfig")

    with pytest.raises(IntentError) as info:
        explain(factory, backend="fsdp2", intent=ShardingIntent(tensor_parallel_size=2), world_sizes=(1, 3), options=ExplainOptions(simulate=False))
    assert str(info.value) == (
        "tensor_parallel_size=2 fits none of the world sizes 1, 3 (each must be a multiple of it). Fix: list multiples of"
        " it, e.g. --world-sizes 2,4,8,16"
    )
