"""torch.compile in one process: the intent's ``compile``, the matrix's answer, a model the user compiled read with its
eager names and planned as in eager mode, and the blocks the plan compiles. Training under compile on 2 ranks is
tests/distributed/test_compile.py; on a GPU with inductor, tests/test_compile_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autoshard import ShardingIntent
from autoshard.adapters.compile import Compile, compile_in_place, unwrap_compiled
from autoshard.adapters.fsdp2 import plan_fsdp2
from autoshard.backends.matrix import cell
from autoshard.capability import Feature, Support
from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.needs import MethodNeeds, compiled_modules, eager_name, inspect_needs
from autoshard.select import select_backend


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    return transformers.LlamaForCausalLM(config)


class Wrapper(nn.Module):
    """What a LightningModule holds: ``self.model = torch.compile(model)`` in ``__init__``, and a head beside it."""

    def __init__(self, model: nn.Module, compile_model: bool) -> None:
        super().__init__()
        self.model = torch.compile(model) if compile_model else model
        self.head = nn.Linear(64, 2)


# -- the intent ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "mode"), [(False, Compile.OFF), (True, Compile.BLOCKS), ("auto", Compile.AUTO), ("AUTO", Compile.AUTO)])
def test_compile_takes_true_false_or_auto(value: Any, mode: Compile) -> None:
    intent = ShardingIntent(compile=value)
    assert Compile.of(intent.compile) is mode
    assert ShardingIntent.from_dict(intent.to_dict()) == intent  # round-trips through YAML's plain types
    assert ShardingIntent().compile is False  # compile costs start-up time: off unless asked


@pytest.mark.parametrize(("value", "fix"), [("yes", "Fix: compile=True"), ("off", "Fix: compile=False"), ("inductor", "Fix: compile=True")])
def test_a_wrong_compile_value_is_refused_with_the_fix(value: str, fix: str) -> None:
    with pytest.raises(IntentError, match="compile must be True") as err:
        ShardingIntent(compile=value)
    assert fix in str(err.value)


# -- the matrix and the selector -----------------------------------------------------------------------------------------
def test_the_matrix_has_compile_fsdp2_yes_deepspeed_no_with_the_fix() -> None:
    assert cell("fsdp2", Feature.COMPILE).support is Support.YES
    deepspeed = cell("deepspeed_zero3", Feature.COMPILE)
    assert deepspeed.support is Support.NO and "strategy='fsdp2'" in deepspeed.remedy and "engine.compile()" in deepspeed.reason
    assert cell("fsdp1", Feature.COMPILE).support is Support.REJECTED


@pytest.mark.parametrize("needs", [MethodNeeds(), MethodNeeds(compiled=("model",))], ids=["compile=True", "compiled by the user"])
def test_compile_picks_fsdp2_and_deepspeed_refuses_it(needs: MethodNeeds) -> None:
    intent = ShardingIntent(compile=not needs.compiled)
    assert select_backend(needs, intent).backend == "fsdp2"
    with pytest.raises(IncompatibleBackendError, match="torch.compile of each block") as err:  # installed or not: the matrix's
        select_backend(needs, intent, prefer="deepspeed", available={"deepspeed": _installed()})
    assert "Fix:" in str(err.value) and "fsdp2" in str(err.value)


def _installed() -> Any:
    from autoshard.backends import Availability

    return Availability(True, "installed (test)")


def test_compile_auto_needs_nothing_until_the_budget_chooses_it() -> None:
    assert select_backend(MethodNeeds(), ShardingIntent(compile="auto"), prefer="deepspeed", available={"deepspeed": _installed()})


# -- a model the user compiled -------------------------------------------------------------------------------------------
def test_a_whole_model_compile_is_unwrapped_to_the_eager_names_and_planned_as_eager() -> None:
    eager, compiled = Wrapper(tiny_llama(), False), Wrapper(tiny_llama(), True)
    assert any("_orig_mod" in n for n in compiled.state_dict())  # what a checkpoint would say without autoshard
    assert compiled_modules(compiled) == ("model",) and inspect_needs(compiled, call_hooks=False).compiled == ("model",)
    assert unwrap_compiled(compiled) == ["model"]
    assert list(compiled.state_dict()) == list(eager.state_dict())  # eager names: checkpoints load either way
    assert compiled_modules(compiled) == ("model",)  # still known as compiled by the user (marked when unwrapped)
    assert unwrap_compiled(compiled) == []  # once is enough
    needs = inspect_needs(compiled, call_hooks=False)
    plan, eager_plan = plan_fsdp2(compiled, ShardingIntent(), needs), plan_fsdp2(eager, ShardingIntent(), inspect_needs(eager, call_hooks=False))
    assert [(u.name, u.kind) for u in plan.units] == [(u.name, u.kind) for u in eager_plan.units]
    layers = ["model.model.layers.0", "model.model.layers.1"]
    assert list(plan.compiled) == layers and eager_plan.compiled == ()  # the blocks inside are compiled in place
    assert "[compiled]" in plan.describe() and plan.to_dict()["compiled"] == layers


def test_compile_true_compiles_the_planned_blocks_and_a_blockless_model_is_refused() -> None:
    model = Wrapper(tiny_llama(), False)
    plan = plan_fsdp2(model, ShardingIntent(compile=True))
    assert list(plan.compiled) == [u.name for u in plan.units if u.kind.value == "block"] == ["model.model.layers.0", "model.model.layers.1"]
    assert plan_fsdp2(model, ShardingIntent(compile="auto")).compiled == ()  # 'auto' is the budget's choice
    with pytest.raises(IntentError, match="compile=True compiles the repeated blocks") as err:
        plan_fsdp2(nn.Sequential(nn.Linear(4, 4)), ShardingIntent(compile=True))
    assert "Fix: name the blocks" in str(err.value)


def test_a_compiled_module_without_blocks_is_compiled_whole_and_blocks_compiled_in_place_are_kept() -> None:
    model = nn.Module()
    model.net = torch.compile(nn.Linear(4, 4))  # no repeated blocks in it
    unwrap_compiled(model)
    assert plan_fsdp2(model, ShardingIntent(), inspect_needs(model, call_hooks=False)).compiled == ("net",)
    layer = nn.Linear(4, 4)
    layer.compile(backend="eager")  # compiled in place by the user: left as it is, options included
    call = layer._compiled_call_impl
    assert compile_in_place(layer) is False and layer._compiled_call_impl is call
    assert eager_name("model._orig_mod.layers.0._orig_mod.q") == "model.layers.0.q"


def test_a_block_compiled_in_place_keeps_its_name_hooks_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """block.compile(), not torch.compile(block): the module keeps its place, its names and its forward hooks."""
    monkeypatch.setenv("AUTOSHARD_COMPILE_BACKEND", "eager")
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(2, 4)
    want = block(x)
    calls: list[int] = []
    block.register_forward_pre_hook(lambda m, a: calls.append(1))
    names = list(block.state_dict())
    assert compile_in_place(block) is True and block._compiled_call_impl is not None
    torch.testing.assert_close(block(x), want)
    assert calls == [1] and list(block.state_dict()) == names


# -- Lightning's own handling of a compiled LightningModule ------------------------------------------------------------
def test_a_compiled_lightning_module_passed_to_fit_is_refused_by_lightning_before_any_sharding() -> None:
    """Lightning unwraps ``trainer.fit(torch.compile(module))`` itself and then refuses every strategy but its own
    single-device, DDP and FSDP ones, before autoshard's setup runs: nothing of autoshard's meets the wrapper. The
    guide says what to do instead (compile inside the module, or ShardingIntent(compile=True))."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import autoshard  # noqa: F401  (registers "fsdp2")

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Tiny()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = pl.Trainer(
        strategy="fsdp2", accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(RuntimeError, match="Using a compiled model is incompatible with the current strategy"):
        trainer.fit(torch.compile(module), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))
    assert trainer.global_step == 0 and all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_autoshard_deepspeed_with_compile_true_is_refused_when_the_trainer_is_built() -> None:
    """The matrix's "no" is said before any process starts, with the backend that works."""
    pytest.importorskip("deepspeed")
    import lightning.pytorch as pl

    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    with pytest.raises(IncompatibleBackendError, match="torch.compile of each block") as err:
        pl.Trainer(strategy=AutoShardDeepSpeedStrategy(compile=True), accelerator="cpu", devices=1, logger=False)
    assert "Fix: use strategy='fsdp2'" in str(err.value)


def test_compile_true_with_modules_the_user_sharded_uncompiled_is_refused() -> None:
    """compile=True compiles autoshard's own plan: a parallelize_fn or configure_model that sharded the modules without
    compiling them would silently train eager. Refused before any collective (no process group needed here)."""
    from autoshard.engine.sharding import shard_module

    sharded_by = "autoshard: sharded by your parallelize_fn; the generic plan is skipped"
    with pytest.raises(IntentError, match=r"sharded by your parallelize_fn.*Fix: compile each block in place"):
        shard_module(nn.Linear(2, 2), None, ShardingIntent(compile=True), MethodNeeds(), None, sharded_by=sharded_by, node_ranks=list)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_init_from_reads_weights_saved_from_a_compiled_model_under_the_eager_names(tmp_path: Any, fmt: str) -> None:
    """``torch.save(compiled.state_dict())`` writes ``_orig_mod.`` inside every name; init_from fills the eager model."""
    from autoshard.init_from import load_init_from, plan_init_from

    torch.manual_seed(0)
    saved = nn.Module()
    saved.net = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    state = saved.state_dict()
    assert all("._orig_mod." in k for k in state)
    path = tmp_path / f"w.{'pt' if fmt == 'torch' else 'safetensors'}"
    if fmt == "torch":
        torch.save(state, path)
    else:
        safetensors = pytest.importorskip("safetensors.torch")
        safetensors.save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    model = nn.Module()
    model.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    load_init_from(model, plan_init_from(model, {"": str(path)}))
    assert all(torch.equal(p, state[n.replace("net.", "net._orig_mod.", 1)]) for n, p in model.named_parameters())


def test_explain_and_the_simulated_step_read_a_compiled_model_with_its_eager_names() -> None:
    """``autoshard explain`` builds the module as the strategies find it at setup: wrappers replaced, blocks planned."""
    from autoshard.target import build_on_meta

    built = build_on_meta(lambda: Wrapper(tiny_llama(), True))
    assert not any("_orig_mod" in n for n in built.module.state_dict())
    assert any("torch.compile wrapper(s) on 'model' replaced" in note for note in built.notes)
    plan = plan_fsdp2(built.module, ShardingIntent(), inspect_needs(built.module, call_hooks=False))
    assert list(plan.compiled) == ["model.model.layers.0", "model.model.layers.1"]
