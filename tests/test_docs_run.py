"""Every command and snippet a reader of README.md or docs/ would type runs here, so the docs cannot drift.

- ``python`` blocks run page by page in one namespace, top to bottom, as a reader pastes them. Only the reader's
  own objects (``MyLightningModule``, ``dm``, ``model``) come from here, so a missing import fails. Every Trainer
  is this machine's: one CPU device, one step.
- ``yaml`` blocks are LightningCLI configs: instantiated (on one CPU device), the strategy and intent checked.
- Shell lines (untagged blocks) run as typed, in a project directory holding the files they name
  (``path/to/train.py``, ``mypkg/``, ``checkpoints/last.ckpt``). What cannot run here is checked as far as this
  machine allows: ``make`` (dry run), ``torchrun`` (its own parser), ``benchmarks/run.py`` (its command line, with
  stub benchmarks), ``python -m autoshard.demo`` (tests/distributed/test_fsdp2.py runs it), ``srun`` (skipped).
- Commands in prose (`` `autoshard ...` ``, `` `python -m ...` ``, `` `make ...` ``, `` `pip install ...` ``): the
  subcommand and each option exist, the module or extra exists.

``text`` and ``json`` blocks are output, not typed; NOT_TYPED names the untagged blocks that are not commands.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import autoshard  # noqa: F401  the docs' snippets and configs rely on the registered strategy names
from autoshard import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OUTPUT = {"text", "json"}
SHELL = {"", "bash", "sh", "shell", "console"}
# Fenced blocks that are neither output-tagged nor typed by a reader: (page, first line) -> what they are.
NOT_TYPED = {
    ("docs/benchmarks.md", "def _within(path: str, prefixes: Iterable[str]) -> bool:"): "an excerpt of autoshard's code",
}
ELSEWHERE = {"autoshard.demo": "tests/distributed/test_fsdp2.py::test_demo_trains_through_lightning_launcher"}
THIS_MACHINE = {
    "accelerator": "cpu",
    "devices": 1,
    "num_nodes": 1,
    "max_steps": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str

    @property
    def first(self) -> str:
        return next((s.strip() for s in self.body.splitlines() if s.strip()), "")


def fenced_blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
            found.append(Block(str(page.relative_to(ROOT)), text[: m.start()].count("\n") + 1, m.group(1), m.group(2)))
    return found


BLOCKS = fenced_blocks()
TYPED = [b for b in BLOCKS if b.lang not in OUTPUT and (b.page, b.first) not in NOT_TYPED]
COMMANDS = [(b, line.strip()) for b in TYPED if b.lang in SHELL for line in b.body.splitlines() if line.strip()]
PYTHON_PAGES = sorted({b.page for b in TYPED if b.lang == "python"})
YAML = [b for b in TYPED if b.lang == "yaml"]


def inline_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            if re.match(r"(autoshard|python|make|pip) ", span + " "):
                found.append((str(page.relative_to(ROOT)), span))
    return sorted(set(found))


# -- what the reader brings: a model, a datamodule, a training script, a package, a checkpoint -------------------------
MODEL = '''
import torch
import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyLightningModule(pl.LightningModule):
    """A reader's method: blocks in a backbone, a head, one optimizer."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for block in self.backbone.blocks:
            x = block(x)
        return self.head(x).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)


class MyDataModule(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
'''


def reader_objects() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "reader"}
    exec(compile(MODEL, "reader-model", "exec"), namespace)
    return {"MyLightningModule": namespace["MyLightningModule"], "dm": namespace["MyDataModule"](), "model": namespace["MyLightningModule"]()}


@pytest.fixture(autouse=True, scope="module")
def _environment_as_it_was() -> Any:
    """A fit in this process sets LOCAL_RANK, NODE_RANK, MASTER_PORT...: a later test's Lightning launcher would
    take them for its own and wait for ranks it never starts."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Any:
    """A reader runs each command in a fresh process: a fit here leaves its process group, and
    ``autoshard explain --batch`` (a fake process group of its own) refuses to run beside one."""
    import torch.distributed as dist

    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, _environment_as_it_was: Any) -> Path:
    """The directory a reader types the commands in."""
    import lightning.pytorch as pl

    root = tmp_path_factory.mktemp("project")
    (root / "path" / "to").mkdir(parents=True)
    (root / "path" / "to" / "train.py").write_text(MODEL + "\n\ndef make_model():\n    return MyLightningModule()\n")
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "models.py").write_text(MODEL + "\n\ndef build():\n    return MyLightningModule()\n")
    trainer = pl.Trainer(strategy="fsdp2", precision="bf16-mixed", default_root_dir=str(root / "logs"), **THIS_MACHINE)
    trainer.fit(reader_objects()["model"])
    trainer.save_checkpoint(root / "checkpoints" / "last.ckpt")  # a DCP directory, as after training
    import torch.distributed as dist

    if dist.is_initialized():  # as when the training process has exited
        dist.destroy_process_group()
    shutil.rmtree(root / "logs", ignore_errors=True)
    return root


def forget_mypkg() -> None:
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


@pytest.fixture
def workdir(project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh copy of the project per test, as the working directory; sys.path as the console script has it."""
    work = tmp_path / "work"
    shutil.copytree(project, work)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(work))])
    forget_mypkg()
    yield work
    forget_mypkg()


@pytest.fixture
def one_cpu_trainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Trainer(devices=8, accelerator="gpu", ...) as written, run here on one CPU device for one step."""
    import lightning.pytorch as pl

    init = pl.Trainer.__init__

    @functools.wraps(init)
    def here(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, **THIS_MACHINE, "default_root_dir": str(tmp_path / "logs")})

    monkeypatch.setattr(pl.Trainer, "__init__", here)


# -- the tests ----------------------------------------------------------------------------------------------------------
def test_the_docs_have_what_this_file_runs() -> None:
    assert len(COMMANDS) >= 10 and len(YAML) >= 4 and {"README.md", "docs/guide.md"} <= set(PYTHON_PAGES)


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_snippets_run_as_pasted(page: str, workdir: Path, one_cpu_trainer: None) -> None:
    namespace = {"__name__": "__main__", **reader_objects()}
    for block in (b for b in TYPED if b.page == page and b.lang == "python"):
        exec(compile(block.body, f"{block.page}:{block.line}", "exec"), namespace)


@pytest.mark.parametrize("block", YAML, ids=lambda b: f"{b.page}:{b.line}")
def test_yaml_configs_build_their_trainer(block: Block, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml = pytest.importorskip("yaml")
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.strategies import StrategyRegistry

    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI warns when pytest's own arguments are there too
    config = yaml.safe_load(block.body)
    config["trainer"].update({k: THIS_MACHINE[k] for k in ("accelerator", "devices", "num_nodes")})
    trainer = LightningCLI(reader_objects()["MyLightningModule"], run=False, args=config, save_config_callback=None).trainer
    strategy = config["trainer"]["strategy"]
    if isinstance(strategy, str):
        entry = StrategyRegistry[strategy]["strategy"]  # a class, or a factory ("auto-shard") that returns one
        assert type(trainer.strategy) is (entry if isinstance(entry, type) else type(StrategyRegistry.get(strategy)))
    else:
        module, _, name = strategy["class_path"].rpartition(".")
        assert type(trainer.strategy) is getattr(importlib.import_module(module), name)
        for key, value in strategy.get("init_args", {}).get("intent", {}).items():
            assert getattr(trainer.strategy.intent, key) == value, key


@pytest.mark.parametrize(("block", "line"), COMMANDS, ids=[f"{b.page}:{b.line} {line.split('#')[0].strip()}" for b, line in COMMANDS])
def test_shell_commands_run_as_typed(
    block: Block, line: str, workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = shlex.split(line, comments=True)
    tool, args = argv[0], argv[1:]
    if tool == "autoshard":
        code = cli.main(args)
        out = capsys.readouterr().out
        assert code == 0, out[-3000:]
        if "--json" in args:
            json.loads(out)
    elif tool == "python" and args[0] == "-m" and args[1] in ELSEWHERE:
        assert_runs_elsewhere(args[1])
    elif tool == "python" and args[0] == "-m":
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "RuntimeWarning" not in done.stderr, done.stderr[-3000:]
    elif tool == "python" and args[0] == "benchmarks/run.py":
        run_benchmarks_command_line(args[1:], monkeypatch)
    elif tool == "make":
        dry_run_make(args)
    elif tool == "torchrun":
        from torch.distributed.run import get_args_parser

        get_args_parser().parse_args([a.replace("$HOST", "localhost") for a in args])
    elif tool == "srun":
        pytest.skip("SLURM is not on this machine; tests/test_bad_inputs.py checks the SLURM environment srun sets")
    else:
        pytest.fail(f"{block.page}:{block.line}: no way to run {tool!r}; tag the block `text` if it is not typed")


@pytest.mark.parametrize(("page", "span"), inline_commands(), ids=[f"{p} {s}" for p, s in inline_commands()])
def test_commands_in_prose_exist(page: str, span: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    argv = shlex.split(span)
    tool, args = argv[0], argv[1:]
    if tool == "autoshard":
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if a.dest == "command")
        if args and args[0].startswith("-"):  # a top-level option: --version, --help
            args = ["", *args]
        else:
            assert args and args[0] in sub.choices, f"{page}: `{span}`: no subcommand {args[:1]}"
            parser = sub.choices[args[0]]
        options = {o for action in parser._actions for o in action.option_strings}
        unknown = [a.split("=")[0] for a in args[1:] if a.startswith("-") and a.split("=")[0] not in options]
        assert not unknown, f"{page}: `{span}`: {args[0]} has no option {unknown}"
    elif tool == "python" and args[0] == "-c":  # a one-liner a message gives: it must at least be Python
        compile(args[1], span, "exec")
    elif tool == "python" and args[0] == "-m":
        assert importlib.util.find_spec(args[1]) is not None, span
    elif tool == "python" and args[0] == "benchmarks/run.py":
        monkeypatch.chdir(tmp_path)
        run_benchmarks_command_line(args[1:], monkeypatch)
    elif tool == "python" and args[0].startswith("benchmarks/") and args[0].endswith(".py"):  # minutes each: not run
        script = ROOT / args[0]
        assert script.is_file(), f"{page}: `{span}`: no {args[0]}"
        source = script.read_text()
        assert "__main__" in source, f"{page}: `{span}`: {args[0]} is not a script"
        unknown = [a.split("=")[0] for a in args[1:] if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]
        assert not unknown, f"{page}: `{span}`: {args[0]} has no option {unknown}"
    elif tool == "make":
        dry_run_make(args)
    elif tool == "pip" and args[:1] == ["install"]:
        from packaging.requirements import Requirement

        declared = (ROOT / "pyproject.toml").read_text()
        for text in (a for a in args[1:] if not a.startswith("-")):
            requirement = Requirement(text)
            for extra in requirement.extras:
                assert requirement.name == "autoshard" and re.search(rf"^{extra} = \[", declared, flags=re.M), span
    else:
        pytest.fail(f"{page}: no check for `{span}`: add one here")


# -- how what cannot run here is checked ---------------------------------------------------------------------------------
def assert_runs_elsewhere(module: str) -> None:
    path, _, name = ELSEWHERE[module].partition("::")
    source = (ROOT / path).read_text()
    assert f"def {name}(" in source and f'"-m", "{module}"' in source, ELSEWHERE[module]


def run_benchmarks_command_line(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line as typed, each benchmark a stub: the benchmarks take minutes (make bench)."""
    spec = importlib.util.spec_from_file_location("autoshard_docs_bench_run", ROOT / "benchmarks" / "run.py")
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    for bench in (f"bench_{name}" for name in run.BENCHES):
        monkeypatch.setattr(run, bench, lambda *a: ({}, ["(stub)"]))
    assert run.main(args) == 0


def dry_run_make(args: list[str]) -> None:
    """``make -n``: the target exists and its recipe expands; running it is the job of the target itself."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if args[:1] == ["demo"]:
        assert "-m autoshard.demo" in done.stdout
        assert_runs_elsewhere("autoshard.demo")
