"""`autoshard convert` and `ShardingIntent(init_from=...)` in one process: layouts round-trip exactly, DeepSpeed's own
reader reads what is written, Hugging Face reads the safetensors, and every refusal names what and how to fix it.
(The real engines, resuming across backends and world sizes, are in tests/distributed/test_convert.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autoshard.capability import Format
from autoshard.checkpoint.formats import detect_format
from autoshard.checkpoint.trust import CheckpointFormatError
from autoshard.convert import ConvertError, ConvertOptions, OptimizerState, TrainingState, convert, parse_size, read_checkpoint, write_dcp
from autoshard.engine.meta_init import copy_students_into_teachers
from autoshard.errors import IntentError
from autoshard.init_from import InitFromError, load_init_from, plan_init_from
from autoshard.intent import ShardingIntent
from autoshard.needs import EMAPair

pytestmark = [
    pytest.mark.filterwarnings("ignore:autoshard.*has no manifest:UserWarning"),  # sources written by hand here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # DCP in one process, on purpose
]
TRAINER = {"epoch": 0, "global_step": 2, "loops": {"fit_loop": {}}, "callbacks": {}, "lr_schedulers": [{"last_epoch": 2}]}


class Net(nn.Module):
    """Odd sizes (ZeRO pads partitions), a buffer, two optimizer groups."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)
        self.register_buffer("centre", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))) - self.centre


def trained_state(source: Path) -> TrainingState:
    """A Net after 2 AdamW steps, as the neutral form: what a DCP checkpoint of it holds."""
    net = Net()
    opt = torch.optim.AdamW([{"params": net.body.parameters()}, {"params": net.head.parameters(), "lr": 5e-3}], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 5)).square().mean().backward()
        opt.step()
    names = {id(p): n for n, p in net.named_parameters()}
    saved = opt.state_dict()
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[ids[i]] for i in g["params"]]} for g in saved["param_groups"]]
    state = {names[ids[i]]: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()}
    tensors = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return TrainingState(tensors, [OptimizerState(groups, state)], dict(TRAINER), source, Format.DCP, world_size=2)


@pytest.fixture()
def dcp(tmp_path: Path) -> tuple[Path, TrainingState]:
    state = trained_state(tmp_path / "src.ckpt")
    write_dcp(state, tmp_path / "src.ckpt")
    return tmp_path / "src.ckpt", state


def assert_same(a: TrainingState, b: TrainingState) -> None:
    assert set(a.tensors) == set(b.tensors)
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    (oa,), (ob,) = a.optimizers, b.optimizers
    assert oa.groups == ob.groups  # hyper-parameters and each group's parameter names, in order
    assert oa.state.keys() == ob.state.keys()
    for name, entry in oa.state.items():
        assert entry.keys() == ob.state[name].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(ob.state[name][k])) for k, v in entry.items())
    assert {k: v for k, v in b.trainer.items()} == a.trainer


def test_dcp_to_deepspeed_to_dcp_is_exact_at_any_world_size(dcp: tuple[Path, TrainingState], tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src, original = dcp
    to_ds = convert(src, tmp_path / "ds3", "deepspeed", ConvertOptions(world_size=3, precision="32-true"))
    assert detect_format(tmp_path / "ds3").format is Format.DEEPSPEED
    assert sorted(p.name for p in (tmp_path / "ds3" / "checkpoint").iterdir()) == sorted(
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(3) for kind in ("model", "optim")
    )
    assert (to_ds.target_world_size, to_ds.optimizer_states, to_ds.global_step) == (3, 12, 2)
    # DeepSpeed's own reader reassembles the weights from the 3 ranks' partitions written here.
    weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds3"))
    assert all(torch.equal(weights[n], original.tensors[n]) for n in original.tensors)
    resharded = convert(tmp_path / "ds3", tmp_path / "ds2", "deepspeed", ConvertOptions(world_size=2))  # DeepSpeed alone cannot
    assert resharded.source_world_size == 3 and resharded.target_world_size == 2
    back = convert(tmp_path / "ds2", tmp_path / "back", "dcp")
    assert back.source_format == "deepspeed" and back.buffers == 1
    assert_same(original, read_checkpoint(tmp_path / "back"))


def test_converted_output_is_published_whole_and_checked(dcp: tuple[Path, TrainingState], tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    src, _ = dcp
    convert(src, tmp_path / "ds", "deepspeed", ConvertOptions(world_size=2, precision="bf16-mixed"))
    out = tmp_path / "ds"
    manifest = json.loads((out / "autoshard-manifest.json").read_text())
    assert {"latest", "autoshard-convert.json", "checkpoint/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(manifest["files"])
    assert not list(tmp_path.glob(".*autoshard-tmp"))  # no staging left behind
    record = json.loads((out / "autoshard-convert.json").read_text())
    assert (record["source_format"], record["target_world_size"], record["global_step"]) == ("distributed", 2, 2)
    with open(out / "checkpoint" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "r+b") as f:  # bit rot after the save
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointFormatError, match="is corrupted: .*bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt' has sha256"):
        convert(out, tmp_path / "again", "dcp")


def test_safetensors_is_what_hugging_face_loads_tied_weights_once(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    wrapped = {f"model.{k}": v for k, v in model.state_dict().items()}  # a LightningModule holding it as self.model
    torch.save({"state_dict": wrapped, **TRAINER}, tmp_path / "last.ckpt")  # torch.save keeps the tie (one storage)
    done = convert(tmp_path / "last.ckpt", tmp_path / "hf", "safetensors", ConvertOptions(module="model", max_shard_size="40KB"))
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors.index.json" in files and "model-00001-of-00004.safetensors" in files, files
    assert done.tensors == 29 and any("lm_head.weight -> transformer.wte.weight" in n for n in done.notes)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and len(index["weight_map"]) == 28
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for k, v in model.state_dict().items() if k != "lm_head.weight")
    with safe_open(str(tmp_path / "hf" / index["weight_map"]["transformer.wte.weight"]), "pt") as f:
        assert json.loads(f.metadata()["autoshard_tied"]) == {"lm_head.weight": "transformer.wte.weight"}
    config.save_pretrained(tmp_path / "hf")  # the model card's config travels beside the weights, as on the Hub
    model.generation_config.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


@pytest.mark.parametrize(
    ("size", "expected"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("40KB", 40_000), ("1234", 1234), (7, 7)]
)
def test_max_shard_size_reads_like_hugging_face(size: Any, expected: int) -> None:
    assert parse_size(size) == expected


# -- refusals: what, why, Fix ----------------------------------------------------------------------------------------
def test_refuses_an_existing_output_and_the_source_itself(dcp: tuple[Path, TrainingState], tmp_path: Path) -> None:
    src, _ = dcp
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep me")
    # Not written by convert: never replaced, and the refusal does not point at --force (it would be refused too).
    with pytest.raises(
        ConvertError,
        match=r"refusing to overwrite .*taken': it already exists \(a directory holding mine.txt.*Fix: choose a new output path, e\.g\. .*, or move .* away first$",
    ):
        convert(src, tmp_path / "taken", "safetensors")
    with pytest.raises(ConvertError, match=r"even with --force: .*autoshard did not write it"):
        convert(src, tmp_path / "taken", "safetensors", ConvertOptions(force=True))
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep me"
    with pytest.raises(ConvertError, match="it is the checkpoint being converted. Fix: choose another output path"):
        convert(src, src, "safetensors", ConvertOptions(force=True))
    convert(src, tmp_path / "hf", "safetensors")
    with pytest.raises(ConvertError, match=r"refusing to overwrite .*hf'.*Fix: choose a new output path, or pass --force"):
        convert(src, tmp_path / "hf", "safetensors")
    convert(src, tmp_path / "hf", "safetensors", ConvertOptions(force=True))  # its own output: replaced only once the new one is complete
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_refuses_an_optimizer_keyed_by_position(tmp_path: Path) -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 5)).sum().backward()
    opt.step()
    torch.save({"state_dict": net.state_dict(), "optimizer_states": [opt.state_dict()], **TRAINER}, tmp_path / "ddp.ckpt")
    with pytest.raises(ConvertError) as info:
        convert(tmp_path / "ddp.ckpt", tmp_path / "out", "deepspeed", ConvertOptions(world_size=2, precision="32-true"))
    text = str(info.value)
    assert "optimizer #0 of" in text and "keyed by position (0, 1, 2, 3, ...)" in text
    assert "Fix: resume it once with strategy='fsdp2'" in text and "--to safetensors" in text
    assert not (tmp_path / "out").exists()


def test_refuses_what_deepspeed_cannot_hold(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    two = trained_state(tmp_path / "two")
    two.optimizers.append(OptimizerState([], {}))
    write_dcp(two, tmp_path / "two")
    with pytest.raises(ConvertError, match="holds 2 optimizers, and a DeepSpeed checkpoint holds exactly one optimizer's state. Fix:"):
        convert(tmp_path / "two", tmp_path / "o1", "deepspeed", ConvertOptions(world_size=2, precision="32-true"))
    odd = trained_state(tmp_path / "odd")
    odd.optimizers[0].state["head.bias"]["step"] = torch.tensor(1.0)  # a parameter that stepped once less
    write_dcp(odd, tmp_path / "odd")
    with pytest.raises(
        ConvertError, match=r"optimizer state 'step' differs between parameters \(head.weight: 2, head.bias: 1\).*one 'step' per flat group"
    ):
        convert(tmp_path / "odd", tmp_path / "o2", "deepspeed", ConvertOptions(world_size=2, precision="32-true"))
    factored = trained_state(tmp_path / "factored")
    factored.optimizers[0].state["body.weight"]["exp_avg_sq_row"] = torch.ones(7)  # Adafactor-like: one value per row
    write_dcp(factored, tmp_path / "factored")
    with pytest.raises(
        ConvertError, match=r"'exp_avg_sq_row' of body.weight has shape \(7,\), not the parameter's \(7, 5\), so it has no per-element mapping"
    ):
        convert(tmp_path / "factored", tmp_path / "o3", "deepspeed", ConvertOptions(world_size=2, precision="32-true"))
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_refuses_what_is_already_the_target_or_has_no_trainer_state(dcp: tuple[Path, TrainingState], tmp_path: Path) -> None:
    src, _ = dcp
    with pytest.raises(ConvertError, match="is already a DCP checkpoint, which fsdp2 resumes as is at any world size. Fix:"):
        convert(src, tmp_path / "o", "dcp")
    torch.save(Net().state_dict(), tmp_path / "weights.pt")
    with pytest.raises(
        ConvertError, match=r"holds no Lightning trainer state \(epoch, global_step, loops\).*Fix: convert the weights with --to safetensors"
    ):
        convert(tmp_path / "weights.pt", tmp_path / "o", "deepspeed", ConvertOptions(world_size=2, precision="32-true"))
    with pytest.raises(ConvertError, match="--max-shard-size 'lots' is not a size. Fix: write it as 5GB"):
        convert(src, tmp_path / "o", "safetensors", ConvertOptions(max_shard_size="lots"))
    with pytest.raises(
        ConvertError,
        match=r"--to deepspeed needs the precision of the run that resumes it: DeepSpeed names its optimizer files after it \(bf16_zero_pp_rank_\* under bf16\).*Fix: pass --precision",
    ):
        convert(src, tmp_path / "o", "deepspeed", ConvertOptions(world_size=2))
    with pytest.raises(ConvertError, match="fp16 training resumes with its dynamic loss scale, which only a DeepSpeed fp16 checkpoint holds"):
        convert(src, tmp_path / "o", "deepspeed", ConvertOptions(world_size=2, precision="16-mixed"))
    with pytest.raises(ConvertError, match="--module 'head' keeps one submodule's weights, which only --to safetensors writes"):
        convert(src, tmp_path / "o", "deepspeed", ConvertOptions(module="head"))
    (tmp_path / "notes").mkdir()
    with pytest.raises(ConvertError, match="cannot convert: .*is a directory holding nothing"):
        convert(tmp_path / "notes", tmp_path / "o", "safetensors")


def test_refuses_a_zero_stage_2_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    ckpt = tmp_path / "z2"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "latest").write_text("checkpoint")
    torch.save({"module": {}}, ckpt / "checkpoint" / "mp_rank_00_model_states.pt")
    with pytest.raises(ConvertError, match=r"ZeRO stage 1/2 checkpoint.*Fix: take the weights with `autoshard consolidate"):
        convert(ckpt, tmp_path / "o", "dcp")


def test_cli_prints_a_summary_or_json_and_refuses_with_exit_1(
    dcp: tuple[Path, TrainingState], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autoshard.cli import main

    src, _ = dcp
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "safetensors", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (summary["target"], summary["tensors"], summary["global_step"]) == ("safetensors", 5, 2)
    assert "autoshard convert: reading distributed checkpoint" in captured.err
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "safetensors"]) == 1
    assert "autoshard: error: refusing to overwrite" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "safetensors", "--json"]) == 1
    refused = json.loads(capsys.readouterr().out)  # --json: the refusal is JSON on stdout too, as for explain
    assert refused["command"] == "convert" and refused["error"]["message"].startswith("refusing to overwrite")


# -- init_from in one process (plain tensors; the sharded path is tests/distributed/test_convert.py) -----------------------
class Pair(nn.Module):
    """An EMA teacher/student pair of Nets with a tied weight in each."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = Net(), Net()
        self.student.tail = nn.Linear(7, 5)
        self.teacher.tail = nn.Linear(7, 5)
        self.student.tail.weight = self.student.body.weight  # tied: (7, 5) both
        self.teacher.tail.weight = self.teacher.body.weight


def test_init_from_fills_every_format_ties_and_teachers(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    torch.manual_seed(1)
    source = Pair().student
    weights = {k: v.clone() for k, v in source.state_dict().items() if k != "tail.weight"}  # the tie saved once
    save_file(weights, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": weights}, tmp_path / "w.ckpt")
    dcp_save({"state_dict": weights}, storage_writer=FileSystemWriter(str(tmp_path / "w.dcp")), no_dist=True)
    for path in ("w.safetensors", "w.ckpt", "w.dcp"):
        model = Pair()
        plan = plan_init_from(model, {"student": str(tmp_path / path)}, [EMAPair("teacher", "student")])
        assert {"student.tail.weight", "teacher.body.weight"} <= plan.covered  # tied alias, teacher from its student
        report = load_init_from(model, plan)
        copy_students_into_teachers(model, plan.copy_teachers)  # what FSDP2Strategy.setup does next
        for k, v in source.state_dict().items():
            assert torch.equal(model.student.state_dict()[k], v) and torch.equal(model.teacher.state_dict()[k], v), (path, k)
        assert report.copied_teachers == ("teacher",) and report.bytes_read == report.bytes_total


def test_init_from_names_missing_unexpected_and_reshaped(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {k: v for k, v in Net().state_dict().items() if k != "head.bias"}
    weights["body.weight"] = torch.zeros(7, 6)
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(InitFromError) as info:
        plan_init_from(Net(), {"": str(tmp_path / "w.safetensors")})
    text = str(info.value)
    assert "1 missing from the file: head.bias" in text and "1 in the file but not in the model: extra.weight" in text
    assert "1 with another shape: body.weight (file (7, 6), model (7, 5))" in text and "Fix:" in text
    with pytest.raises(InitFromError, match=r"init_from='.*nope' does not exist. Fix:"):
        plan_init_from(Net(), {"": str(tmp_path / "nope")})
    with pytest.raises(InitFromError, match=r"init_from names module path\(s\) 'backbone', which Net does not have. Fix:"):
        plan_init_from(Net(), {"backbone": str(tmp_path / "w.safetensors")})


def test_meta_init_accepts_modules_init_from_fills(tmp_path: Path) -> None:
    from autoshard.engine.meta_init import check_meta_init
    from autoshard.errors import AutoShardError

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, device="meta"))

    model = nn.Sequential(NoReset(), nn.Linear(3, 3, device="meta"))
    with pytest.raises(
        AutoShardError,
        match=r"NoReset own parameters or buffers and define no reset_parameters\(\), so they would start from uninitialized memory \(no init_from file holds them\)",
    ):
        check_meta_init(model)
    assert check_meta_init(model, covered={"0.w"}) is True


def test_intent_init_from_is_checked_and_round_trips() -> None:
    assert ShardingIntent(init_from="w.safetensors").init_from == "w.safetensors"
    intent = ShardingIntent(init_from={"model": Path("hf/")})
    assert intent.init_from == (("model", "hf"),) and hash(intent)
    assert ShardingIntent.from_dict(intent.to_dict()) == intent and intent.to_dict()["init_from"] == {"model": "hf"}
    for bad, message in [
        ({}, r"init_from=\{\} loads nothing. Fix:"),
        ({".model": "x"}, "must be a dotted module path"),
        ({"model": 3}, r"init_from\['model'\] must be a path, got 3"),
        ({"a": "x", "a.b": "y"}, "maps 'a.b' inside another mapped module"),
    ]:
        with pytest.raises(IntentError, match=message):
            ShardingIntent(init_from=bad)


def test_deepspeed_refuses_init_from_and_auto_shard_picks_fsdp2() -> None:
    pytest.importorskip("deepspeed")
    from autoshard.errors import IncompatibleBackendError
    from autoshard.lightning import AutoShardStrategy, FSDP2Strategy
    from autoshard.lightning.deepspeed import AutoShardDeepSpeedStrategy

    with pytest.raises(
        IncompatibleBackendError, match=r"(?s)pretrained weights into shards \(init_from\).*no hook between the two.*Fix: use strategy='fsdp2'"
    ):
        AutoShardDeepSpeedStrategy({"init_from": "w.safetensors"})
    assert type(AutoShardStrategy(init_from="w.safetensors")) is AutoShardStrategy and issubclass(AutoShardStrategy, FSDP2Strategy)
