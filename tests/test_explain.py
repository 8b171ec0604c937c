"""``autoshard explain``: a module built on meta, explained as text or JSON, refused with the fix, never on a GPU."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from autoshard.backends.deepspeed import REDUCE_BUCKET_SIZE
from autoshard.backends.matrix import MATRIX_BEGIN, MATRIX_END, matrix_markdown, write_matrix
from autoshard.demo import DinoLike
from autoshard.errors import AutoShardError
from autoshard.explain import main, register_cli

ROOT = Path(__file__).resolve().parents[1]
FACTORY = '''
import torch
import torch.nn.functional as F
from torch import nn
import lightning.pytorch as pl
from autoshard.demo import DinoLike, OnlineProbe


def dino_with_probe():
    """The demo method with its online probe: the probe's optimizer must count, and the probe stay whole."""
    return DinoLike(dim=33), [OnlineProbe(dim=33)]


class Plain(pl.LightningModule):
    """One optimizer, no teacher, one forward: the kind of method ZeRO-3 can run."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))

    def training_step(self, batch, batch_idx):
        return self.blocks(batch).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
'''


@pytest.fixture(scope="module")
def factory_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("explain") / "factories.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


def run_explain(*argv: str) -> tuple[int, str]:
    """Through register_cli on a parser of our own, as cli.py wires it."""
    parser = argparse.ArgumentParser(prog="autoshard")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["explain", *argv])
    out = io.StringIO()
    return args.func(args, stream=out), out.getvalue()


def as_json(*argv: str) -> dict[str, Any]:
    code, out = run_explain(*argv, "--json")
    assert code == 0, out
    return json.loads(out)


def test_demo_target_explains_needs_decision_plan_and_memory() -> None:
    report = as_json("autoshard.demo:DinoLike", "--world-sizes", "1,2,8")
    assert report["decision"]["backend"] == "fsdp2" and report["error"] is None
    assert report["needs"]["ema_pairs"] == [{"teacher": "teacher", "student": "student"}]
    units = [u["name"] for u in report["plan"]["units"]]
    assert [u.removeprefix("teacher") for u in units if u.startswith("teacher")] == [
        u.removeprefix("student") for u in units if u.startswith("student")
    ]  # the teacher is sharded exactly like the student
    memory = {m["world_size"]: m for m in report["memory"]}
    assert sorted(memory) == [1, 2, 8]
    assert memory[2]["model_states"] < 0.52 * memory[1]["model_states"]
    assert memory[8]["ema_teacher"] > 0 and memory[8]["optimizer_states"] > memory[8]["parameters"]
    features = {f["feature"]: f["cells"] for f in report["features"]}
    assert features["EMA teacher/student"]["deepspeed_zero3"]["support"] == "no"


def test_file_target_with_callbacks_counts_the_probe(factory_file: Path) -> None:
    code, out = run_explain(f"{factory_file}:dino_with_probe", "--world-sizes", "2")
    assert code == 0, out
    assert "==== autoshard: FSDP2 plan ====" in out
    needs = out.split("== needs ==")[1].split("== decision ==")[0]
    assert "optimizers: 2 " in needs and "callback OnlineProbe" in needs
    assert "modules trained by callbacks (kept whole): probe" in needs
    memory = out.split("== per-rank memory ==")[1]
    assert "optimizer SGD" in memory and "    probe " in memory  # its optimizer counted, the probe whole on every rank
    assert "not on the meta device" not in out and "\x1b[" not in out  # built on meta; plain text in logs


class CountsItsOptimizerCalls(DinoLike):
    """stable-pretraining's probes wrap configure_optimizers and assert a single call: explain must make only one."""

    calls = 0

    def configure_optimizers(self) -> Any:
        type(self).calls += 1
        assert type(self).calls == 1, "configure_optimizers called twice"
        return super().configure_optimizers()


def test_explain_calls_configure_optimizers_once() -> None:
    CountsItsOptimizerCalls.calls = 0
    report = as_json(f"{__name__}:CountsItsOptimizerCalls", "--world-sizes", "2")
    assert CountsItsOptimizerCalls.calls == 1
    assert report["needs"]["num_optimizers"] == 1 and report["memory"][0]["optimizer_states"] > 0


def test_refusal_prints_the_error_and_exits_nonzero() -> None:
    code, out = run_explain("autoshard.demo:DinoLike", "--backend", "deepspeed")
    assert code == 1
    assert "autoshard cannot run this on deepspeed_zero3" in out and "Fix:" in out
    assert "EMA teacher/student" in out
    assert "== per-rank memory ==" not in out


@pytest.mark.skipif(not any(d.metadata["Name"] == "deepspeed" for d in metadata.distributions()), reason="deepspeed not installed")
def test_deepspeed_target_prints_its_config_and_deepspeeds_figures(factory_file: Path) -> None:
    report = as_json(f"{factory_file}:Plain", "--backend", "deepspeed", "--intent", "offload=optimizer", "--world-sizes", "8")
    assert report["decision"]["backend"] == "deepspeed_zero3"
    assert report["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert report["deepspeed_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    (memory,) = report["memory"]
    total = 4 * (64 * 64 + 64)
    bucket = 4 * REDUCE_BUCKET_SIZE  # ZeRO-3's reduce bucket, allocated whole (bf16-mixed: reduced in fp32)
    assert memory["device"] == 4 * (64 * 64 + 64) + int(2 * total / 8) + bucket  # DeepSpeed: largest layer x 4 + 2 B/param / N


def test_intent_options_file_and_precision_reach_the_plan(tmp_path: Path) -> None:
    intent_file = tmp_path / "intent.yaml"
    intent_file.write_text("intent:\n  reshard_after_forward: false\n  exclude: [student.head]\n")
    report = as_json(
        "autoshard.demo:DinoLike",
        "--intent-file",
        str(intent_file),
        "--intent",
        "param_dtype=bfloat16",
        "--precision",
        "bf16-true",
        "--world-sizes",
        "2",
    )
    assert report["intent"]["reshard_after_forward"] is False and report["intent"]["precision"] == "bf16-true"
    assert report["plan"]["settings"]["mp_policy"]["param_dtype"] == "bfloat16"
    assert not any(u["name"].startswith("student.head") for u in report["plan"]["units"])
    assert report["memory"][0]["precision"] == "bf16-true"


def test_typos_and_bad_targets_are_refused_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["autoshard.demo:DinoLike", "--intent", "ofload=params"]) == 1
    assert "'ofload' (did you mean 'offload'?)" in capsys.readouterr().err
    with pytest.raises(AutoShardError, match="could not load TARGET 'autoshard.nope:Model'"):
        run_explain("autoshard.nope:Model")
    with pytest.raises(AutoShardError, match="path/to/file.py:factory or package.module:factory"):
        run_explain("autoshard.demo")


def test_write_matrix_replaces_only_the_generated_block(tmp_path: Path) -> None:
    page = tmp_path / "matrix.md"
    page.write_text(f"# Title\n\nintro\n\n{MATRIX_BEGIN}\nstale\n{MATRIX_END}\n\noutro\n")
    write_matrix(page)
    text = page.read_text()
    assert text.startswith("# Title\n\nintro\n\n") and text.endswith("\n\noutro\n")
    assert matrix_markdown() in text and "stale" not in text
    write_matrix(page)
    assert page.read_text() == text


def test_module_entry_point_runs_without_deepspeed_or_a_gpu() -> None:
    code = (
        "import sys; from autoshard.explain import main; rc = main(['autoshard.demo:DinoLike', '--world-sizes', '1,2']);"
        " assert 'deepspeed' not in sys.modules, 'explain imported deepspeed'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("==== autoshard explain: autoshard.demo:DinoLike ====")
    assert "==== autoshard: FSDP2 plan ====" in done.stdout and "== per-rank memory ==" in done.stdout
    assert "\x1b[" not in done.stdout


def test_packaged_demo_factory_brings_its_probe() -> None:
    report = as_json("autoshard.demo:dino_with_probe", "--world-sizes", "2")
    assert report["needs"]["num_optimizers"] == 2 and report["needs"]["callback_modules"] == ["probe"]
    assert report["decision"]["backend"] == "fsdp2"
