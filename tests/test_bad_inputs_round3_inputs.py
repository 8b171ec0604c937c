"""The bad-input catalog, rows 150-159 (docs/bad-inputs.md): tensor-parallel plans, Fabric's setup, the launch
environment and intent values (issue 29, round three).

A tensor-parallel plan that splits nothing or pairs its styles wrongly is refused (at plan time, or at the first
forward, before any optimizer step) naming the plan key to change; an optimizer over another module is refused at
``fabric.setup``; a stale ``LOCAL_RANK`` or a SLURM number set by hand is refused when the Trainer (or Fabric) is
built, before any process waits; sizes are read as written or refused naming what is wanted. In process, except
row 155, whose fit runs in a child with a hard timeout (a regression hangs there, and fails here).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoshard  # noqa: F401  registers the strategies and guards
from autoshard.adapters.fsdp2 import tensor_parallel_plan
from autoshard.adapters.tp_plan import find_tp_plan
from autoshard.errors import AutoShardError, IncompatibleBackendError, IntentError
from autoshard.intent import ShardingIntent
from tests.test_bad_inputs import refused

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated_environment() -> Iterator[None]:
    """Trainer and Fabric construction set MASTER_PORT & co., the tests set LOCAL_RANK and SLURM's: undo them all."""
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)


class Layers(nn.Module):
    """Two blocks of a Megatron MLP pair and a whole third layer, under ``layers.*``; ``plan`` is its ``_tp_plan``."""

    def __init__(self, plan: dict[str, str]) -> None:
        super().__init__()
        self._tp_plan = plan
        self.layers = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(8, 16), "fc2": nn.Linear(16, 8), "fc3": nn.Linear(8, 8)}) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer["fc3"](layer["fc2"](torch.relu(layer["fc1"](x))))
        return self.head(x)


GOOD_PLAN = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}


MESHES = itertools.count()


def first_forward(plan: dict[str, str]) -> None:
    """Lay ``Layers(plan)`` out on 2 tensor-parallel ranks (rank 0 of a fake group: no communication, real shapes) and
    run one forward and backward. Each call's mesh has a name of its own: DTensor caches redistributions by mesh
    equality, and an equal mesh of an earlier fake world would send this one's collectives to that world's group."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.activations import fake_world

    with fake_world(2, 0):
        model = Layers(plan)
        tp = tensor_parallel_plan(model, 2)
        assert tp is not None
        tp.apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=(f"round3_tp{next(MESHES)}",)))
        model(torch.randn(3, 8)).sum().backward()


# -- 150-153: tensor-parallel plans ---------------------------------------------------------------------------------------
def test_150_a_tensor_parallel_plan_that_matches_no_module() -> None:
    """``blocks.*`` where the modules are ``layers.*``: it used to train whole copies on every tensor-parallel rank,
    while a model with no plan at all is refused (row 29). Refused where setup plans, before anything is sharded."""
    model = Layers({"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"})
    text = refused(
        IntentError,
        lambda: tensor_parallel_plan(model, 2),
        "the tensor-parallel plan of Layers._tp_plan matches no module of Layers:",
        "'blocks.*.fc1' (did you mean 'layers.*.fc1'?), 'blocks.*.fc2' (did you mean 'layers.*.fc2'?)",
        "so nothing would be split across the 2 tensor-parallel ranks",
        "Layers's Linear and Embedding layers: 'layers.*.fc1', 'layers.*.fc2', 'layers.*.fc3', 'head'",
        "Fix: rename the plan's keys: 'blocks.*.fc1' -> 'layers.*.fc1', 'blocks.*.fc2' -> 'layers.*.fc2'",
    )
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # nothing was split
    # A plan that names modules but splits none of them is the same harm: refused too.
    refused(IntentError, lambda: tensor_parallel_plan(Layers({"layers.*.fc3": "replicate"}), 2), "splits no module of Layers")
    # The Fix: the renamed plan is the one that splits.
    fixed = tensor_parallel_plan(Layers(GOOD_PLAN), 2)
    assert fixed is not None and [s for _, s in fixed.rows()] == ["colwise", "rowwise"] * 2 and "Fix:" in text


def test_151_a_plan_with_some_keys_that_match_nothing_warns() -> None:
    """One misspelt key among good ones: the rest splits, and the modules it meant stay whole. Warned, naming the key
    and its close match. transformers' own generic plans have such keys for some configurations (Qwen3-MoE's dense
    MLP keys, DeepSeek-V3's q_proj with q_lora_rank): those are noted in the plan (autoshard explain), not warned."""
    model = Layers({**GOOD_PLAN, "layers.*.fc4": "replicate"})
    with pytest.warns(UserWarning) as caught:
        tensor_parallel_plan(model, 2)
    text = " ".join(str(w.message) for w in caught)
    assert "has key(s) that name no module of Layers: 'layers.*.fc4' (did you mean 'layers.*.fc3'?)" in text
    assert "Fix: rename the plan's keys: 'layers.*.fc4' -> 'layers.*.fc3'" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor_parallel_plan(Layers({**GOOD_PLAN, "layers.*.fc3": "replicate"}), 2)  # the Fix: no warning
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        deepseek = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**sizes))
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    dead = find_tp_plan(deepseek)  # its plan names q_proj, which a configuration with q_lora_rank lacks
    assert dead is not None and "model.layers.*.self_attn.q_proj" in dead.unmatched and dead.unmatched_own == ()
    llama._tp_plan = {**llama._tp_plan, "model.layers.*.mlp.shared_experts.gate_proj": "colwise"}  # such a key, on a model autoshard lays out
    plan = find_tp_plan(llama)
    assert plan is not None and plan.unmatched == ("model.layers.*.mlp.shared_experts.gate_proj",)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan.check(llama, 2)


def test_152_a_colwise_layer_without_a_rowwise_partner_is_refused_at_plan_time() -> None:
    """Nothing rowwise in the plan: every colwise output would reach a whole layer as a slice (a bare matmul shape
    error in the first forward). Refused when the plan is checked; the Fix names the likely partner."""
    refused(
        IncompatibleBackendError,
        lambda: tensor_parallel_plan(Layers({"layers.*.fc1": "colwise"}), 2),
        "splits 'layers.*.fc1' colwise and nothing rowwise",
        "(8 of 16 for 'layers.0.fc1' on 2 ranks)",
        "Fix: give the layer that reads each colwise output the style 'rowwise' (e.g. add 'layers.*.fc2': 'rowwise' if"
        " 'layers.0.fc2' reads the output of 'layers.0.fc1')",
    )
    refused(
        IncompatibleBackendError,
        lambda: tensor_parallel_plan(Layers({"layers.*.fc2": "rowwise"}), 2),
        "splits 'layers.*.fc2' rowwise and nothing colwise",
        "'rowwise_split_input'",
    )
    first_forward({**GOOD_PLAN})  # the Fix trains


def test_153_swapped_or_unpaired_styles_are_refused_at_the_first_forward() -> None:
    """Styles a plan-time check cannot see wrong (both kinds present): the first forward checks each layer's input
    width against its layout, before torch's bare "mat1 and mat2 shapes cannot be multiplied", and names the key."""
    refused(
        IncompatibleBackendError,
        lambda: first_forward({"layers.*.fc1": "rowwise", "layers.*.fc2": "colwise"}),
        "'layers.0.fc1' is rowwise in the tensor-parallel plan ('layers.*.fc1': 'rowwise')",
        "it receives all 8: no colwise layer feeds it; the plan makes 'layers.*.fc2' after it colwise, so the two styles look swapped",
        "Fix: swap them: {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'}",
    )
    refused(
        IncompatibleBackendError,
        lambda: first_forward({"layers.*.fc1": "colwise", "layers.*.fc3": "rowwise"}),
        "'layers.0.fc2' is whole on every rank (the plan names no style for it), so it takes all 16 of its input features,"
        " but it receives 8 on each of the 2 tensor-parallel ranks: the slice the colwise 'layers.0.fc1' before it hands on",
        "Fix: give 'layers.*.fc2' the style 'rowwise'",
    )
    refused(
        IncompatibleBackendError,
        lambda: first_forward({**GOOD_PLAN, "layers.*.fc3": "colwise"}),
        "'layers.1.fc1' is 'colwise' in the tensor-parallel plan ('layers.*.fc1')",
        "the slice the colwise 'layers.0.fc3' before it hands on",
        "Fix: make 'layers.*.fc3' 'colwise_gather_output' (its whole output on every rank), or leave 'layers.*.fc3' out of the plan",
    )
    first_forward({**GOOD_PLAN, "layers.*.fc3": "colwise_gather_output"})  # the Fix trains


# -- 154: Fabric ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["fsdp2", pytest.param("autoshard-deepspeed", marks=needs_deepspeed)])
def test_154_fabric_setup_with_an_optimizer_over_another_module(strategy: str) -> None:
    """``fabric.setup(model, opt)`` where ``opt`` was built over another module: accepted, the model never trained."""
    from lightning.fabric import Fabric

    from tests.test_bad_inputs_fabric import Net

    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model, other = Net(), Net(width=6)
    refused(
        AutoShardError,
        lambda: fabric.setup(model, torch.optim.SGD(other.parameters(), lr=0.1)),
        "fabric.setup(Net, ...) was given optimizer SGD, which holds none of Net's 4 trainable parameter(s): it holds 4"
        " parameter(s) of another module, shaped (6, 4), (6,), (2, 6), (2,)",
        "Net would compute gradients that nothing applies and never train",
        "Fix: build the optimizer from this model's parameters, `optimizer = torch.optim.SGD(model.parameters(), ...)`",
    )
    if strategy == "fsdp2":  # the Fix: the model trains (DeepSpeed's engine is built in rows 110-112's file)
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        before = [p.detach().clone() for p in model.parameters()]
        fabric.backward(model(torch.randn(4, 4)).pow(2).mean())
        opt.step()
        assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


# -- 155-156: the launch environment ----------------------------------------------------------------------------------------
FIT = """
import sys, torch, lightning.pytorch as pl
import autoshard
from torch.utils.data import DataLoader

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4))
    def training_step(self, batch, i):
        return self.body(batch).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = pl.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Net(), DataLoader(torch.randn(16, 4), batch_size=2))
open(f"fit-done-rank{trainer.global_rank}", "w").write(str(trainer.global_step))
"""


def fit_in_child(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(FIT))
    launched = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")
    environ = {k: v for k, v in os.environ.items() if k not in launched and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    environ.update(env, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # A regression waits in init_process_group forever: the timeout turns that into a failure here.
    return subprocess.run([sys.executable, str(script)], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=150)


def test_155_a_stale_local_rank_is_refused_before_any_process_waits(tmp_path: Path) -> None:
    """``LOCAL_RANK=0`` left in the shell, ``devices=2``: Lightning takes the process for one a launcher started and
    waited at "MEMBER: 1/2" forever. Refused when the Trainer is built (and when Fabric is); the Fix (unset it) fits,
    Lightning's own launcher starting the second process, whose LOCAL_RANK comes with MASTER_PORT & co."""
    stale = fit_in_child(tmp_path, LOCAL_RANK="0")
    assert stale.returncode != 0 and "Initializing distributed" not in stale.stderr  # refused before init_process_group
    for fragment in (
        "LOCAL_RANK=0 is set in the environment, so Lightning takes this process for one that a launcher of yours started",
        "it would wait at 'MEMBER: 1/2' for a process that never comes",
        "Fix: `unset LOCAL_RANK` and run the script again (Lightning then starts the 2 processes itself)",
    ):
        assert fragment in stale.stderr, stale.stderr[-3000:]
    fixed = fit_in_child(tmp_path)  # both ranks (Lightning started the second) trained their 2 steps
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert [(tmp_path / f"fit-done-rank{r}").read_text() for r in (0, 1)] == ["2", "2"]

    from lightning.fabric import Fabric

    for name in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "RANK"):
        os.environ.pop(name, None)
    os.environ["LOCAL_RANK"] = "0"
    refused(
        IntentError,
        lambda: Fabric(accelerator="cpu", devices=2, strategy="fsdp2"),
        "one of the 2 processes Fabric(devices=2) describes",
        "Fix: `unset LOCAL_RANK`",
    )


def test_156_a_slurm_number_set_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SLURM_NTASKS=abc`` gave Lightning's bare "invalid literal for int()" while it picked the cluster environment;
    refused by name in the Trainer and in Fabric (the same guard around each connector, for any strategy). A node count
    autoshard's launch check reads is refused the same way, in Fabric too."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(key)
    slurm = {"SLURM_JOB_NAME": "train", "SLURM_NTASKS": "abc", "SLURM_NNODES": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    refused(
        ValueError,  # an IntentError, and still the ValueError Lightning raised
        lambda: pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", logger=False),
        "SLURM_NTASKS='abc' is not a whole number",
        "Fix: `unset SLURM_NTASKS` (or set it to the number it stands for)",
    )
    for strategy in ("fsdp2", "ddp"):
        refused(
            ValueError,
            lambda strategy=strategy: Fabric(accelerator="cpu", devices=2, strategy=strategy),
            "SLURM_NTASKS='abc' is not a whole number",
            "Fix: `unset SLURM_NTASKS` (or set it to the number it stands for)",
        )
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_NNODES", "1 node")
    refused(
        IntentError,
        lambda: Fabric(accelerator="cpu", devices=2, strategy="fsdp2"),
        "SLURM_NNODES='1 node' is not a whole number",
        "Fix: `unset SLURM_NNODES`",
    )
    monkeypatch.setenv("SLURM_NNODES", "1")  # the Fix: the numbers srun sets
    assert pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", logger=False).world_size == 2


# -- 157-159: sizes and intent values ---------------------------------------------------------------------------------------
def test_157_a_size_with_a_unit_autoshard_does_not_read() -> None:
    """``memory_budget="80iB"`` was read as 80 bytes (the unit's letters were optional one by one)."""
    refused(
        IntentError,
        lambda: ShardingIntent(memory_budget="80iB"),
        "memory_budget '80iB' has the unit 'iB', which autoshard does not read: the units are B, KB, MB, GB, TB, KiB, MiB, GiB, TiB",
        "Fix: memory_budget '80GiB' (or the unit you meant)",
    )
    refused(IntentError, lambda: ShardingIntent(memory_budget="80Gi"), "Fix: memory_budget '80GiB'")
    assert ShardingIntent(memory_budget="80GiB").memory_budget == 80 * 2**30  # the Fix


def test_158_whole_floats_and_numpy_ints_are_bytes() -> None:
    """``80e9``, YAML's ``8.0e+10`` and numpy integers were refused without saying an int was wanted: a whole
    number is that many bytes; a fraction of a byte, or another type, is refused saying what is wanted."""
    import numpy as np
    import yaml

    for value in (80e9, np.int64(80_000_000_000), np.float64(8.0e10), "80e9", yaml.safe_load("memory_budget: 8.0e+10")["memory_budget"]):
        assert ShardingIntent(memory_budget=value).memory_budget == 80_000_000_000, value
    assert ShardingIntent.from_dict(yaml.safe_load("memory_budget: 8.0e+10")).memory_budget == 80_000_000_000
    refused(
        IntentError, lambda: ShardingIntent(memory_budget=80.5), "memory_budget 80.5 is not a whole number of bytes. Fix: memory_budget=80 (an int)"
    )
    refused(
        IntentError,
        lambda: ShardingIntent(memory_budget=[80, "GB"]),
        "memory_budget must be a number of bytes (an int) or a size string such as '70GiB', got list [80, 'GB']",
    )


def test_159_lightning_cli_intent_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In a LightningCLI YAML, ``intent: {memory_budget: 8.0e+10}`` (YAML's float) was refused inside
    jsonargparse's union error; now it is that many bytes. Intent fields straight under ``init_args`` were refused
    by jsonargparse before autoshard ran ("Option 'memory_budget' is not accepted"); now LightningCLI reads them from
    the strategy's signature (``**intent_fields: Unpack[IntentKeywords]``), so they are the same request as under
    ``intent:``, it passes only the fields the config gives (nothing undoes what ``intent:`` set; one that differs
    from it is refused: tests/test_intent_keywords.py), and a bad value gets autoshard's own message."""
    from lightning.pytorch.cli import LightningCLI

    from tests.test_bad_inputs import Net

    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads only the config given to it

    def strategy(init_args: str) -> Any:
        config = tmp_path / "config.yaml"
        config.write_text(
            "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n"
            "    class_path: autoshard.lightning.FSDP2Strategy\n    init_args:\n" + textwrap.indent(init_args, "      ")
        )
        return LightningCLI(Net, run=False, save_config_callback=None, args=["--config", str(config)]).trainer.strategy

    assert strategy("intent:\n  memory_budget: 8.0e+10\n").intent.memory_budget == 80_000_000_000
    assert strategy("memory_budget: 80GB\n").intent.memory_budget == 80_000_000_000
    assert strategy("memory_budget: 8.0e+10\n").intent.memory_budget == 80_000_000_000
    both = strategy("intent:\n  offload: params\n  activation_checkpointing: true\nmemory_budget: 80GB\n").intent
    assert (both.offload, both.activation_checkpointing, both.memory_budget) == ("params", True, 80_000_000_000)
    with pytest.raises(ValueError, match=r"unknown offload 'parms' \(did you mean 'params'\?\).*Fix: offload='params'"):
        strategy("offload: parms\n")
    with pytest.raises(SystemExit):  # a misspelt field name: jsonargparse's own refusal, naming it
        strategy("memry_budget: 80GB\n")
    assert "Option 'memry_budget' is not accepted" in capsys.readouterr().err
