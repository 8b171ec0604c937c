"""The ``autoshard`` command line: ``autoshard matrix`` prints what ``render_matrix`` renders; the quick commands
import neither torch nor Lightning; ``import autoshard`` registers the strategies whichever is imported first."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoshard import render_matrix
from autoshard.backends.matrix import matrix_data
from autoshard.cli import LAZY, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "fmt", "details"),
    [
        (["matrix"], "text", False),
        (["matrix", "--format", "markdown"], "markdown", False),
        (["matrix", "--details"], "text", True),
        (["matrix", "--json"], "json", False),
    ],
)
def test_matrix_prints_the_rendered_table(capsys, argv, fmt, details):
    assert main(argv) == 0
    assert capsys.readouterr().out == render_matrix(fmt, details=details) + "\n"


def test_parser_has_subcommands_each_with_its_function():
    parser = build_parser()
    args = parser.parse_args(["matrix", "--format", "markdown", "--details"])
    assert (args.command, args.format, args.details, args.func.__name__) == ("matrix", "markdown", True, "cmd_matrix")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "matrix" in sub.choices


def test_bad_format_and_missing_command_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["matrix", "--format", "html"])
    assert info.value.code == 2
    assert "invalid choice: 'html' (choose from 'text', 'markdown', 'json')" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_refusals_print_the_message_not_a_traceback(capsys, monkeypatch):
    from autoshard import IncompatibleBackendError, cli

    def refuse(args):
        raise IncompatibleBackendError("autoshard cannot run this on fsdp1")

    monkeypatch.setattr(cli, "cmd_matrix", refuse)
    assert main(["matrix"]) == 1
    assert capsys.readouterr().err == "autoshard: error: autoshard cannot run this on fsdp1\n"


def test_python_dash_m_autoshard(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["autoshard", "matrix", "--format", "markdown"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("autoshard", run_name="__main__")
    assert info.value.code == 0
    assert capsys.readouterr().out == render_matrix("markdown") + "\n"


def test_matrix_json_is_every_cell_with_its_reason_and_fix(capsys):
    assert main(["matrix", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == matrix_data()
    assert data["deepspeed_zero3"]["strategy"] == "autoshard-deepspeed"
    ema = data["deepspeed_zero3"]["cells"]["EMA teacher/student"]
    assert ema["support"] == "no" and ema["reason"] and ema["remedy"] == "use strategy='fsdp2' (or strategy='auto-shard')"


def test_version_short_and_long(capsys):
    for flag in ("-V", "--version"):
        with pytest.raises(SystemExit) as info:
            main([flag])
        assert info.value.code == 0 and capsys.readouterr().out == "autoshard 0.1.0\n"


def test_lazy_subcommands_show_the_help_their_module_gives():
    """`autoshard --help` lists explain and consolidate without importing them: the one-line help must not drift."""

    def helps(parser: argparse.ArgumentParser) -> dict[str, str]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {a.dest: a.help for a in sub._choices_actions}

    assert helps(build_parser(load=())) == helps(build_parser()) and set(LAZY) <= set(helps(build_parser()))


QUICK = (["--version"], ["-V"], ["--help"], ["matrix"], ["matrix", "--details"], ["matrix", "--format", "markdown"], ["matrix", "--json"])


def _script() -> list[str]:
    """The installed console script when there is one (what users type), else ``python -m autoshard``."""
    script = Path(sys.executable).with_name("autoshard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "autoshard"]


@pytest.mark.parametrize("argv", QUICK, ids=" ".join)
def test_quick_commands_import_neither_torch_nor_lightning(argv):
    """What a user waits for: these answer at once because nothing heavy is imported (PYTHONPROFILEIMPORTTIME
    lists every module the process imported, on stderr)."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run([*_script(), *argv], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert imported, "no import-time profile on stderr"
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "lightning", "deepspeed"))
    assert not heavy, f"autoshard {' '.join(argv)} imported {heavy[:5]}"


def test_import_autoshard_imports_neither_torch_nor_lightning():
    code = "import sys, autoshard; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'deepspeed'}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


REGISTERED = """
    import lightning.pytorch as pl
    from autoshard.errors import IncompatibleBackendError
    trainer = pl.Trainer(strategy="auto-shard", accelerator="cpu", devices=1, logger=False)
    print(type(trainer.strategy).__module__, type(trainer.strategy).__name__)
    try:
        pl.Trainer(strategy="fsdp", accelerator="cpu", devices=1, logger=False)
    except IncompatibleBackendError:
        print("fsdp refused")
"""


@pytest.mark.parametrize(
    "first",
    [
        "import autoshard\nimport lightning.pytorch",  # the lazy path: registered when Lightning is imported
        "import lightning.pytorch\nimport autoshard",  # Lightning already there: registered at once
        "from autoshard.lightning import FSDP2Strategy",  # autoshard's own Lightning module imports Lightning
        "import autoshard\nimport lightning",  # the top-level package imports lightning.pytorch
    ],
    ids=["autoshard-then-lightning", "lightning-then-autoshard", "autoshard.lightning-first", "autoshard-then-import-lightning"],
)
def test_import_autoshard_registers_the_strategies_whatever_comes_first(first):
    code = first + "\n" + textwrap.dedent(REGISTERED)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-3:] == ["autoshard.lightning.fsdp2 AutoShardStrategy", "fsdp refused", ""], done.stdout


@pytest.mark.parametrize("module", ["autoshard.explain", "autoshard"])
def test_python_dash_m_runs_without_a_runpy_warning(module):
    """runpy warns when the package's __init__ already imported the module it is about to run as __main__."""
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "RuntimeWarning" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.startswith("usage: autoshard")


# -- explain --json: one JSON object on stdout whatever happened ------------------------------------------------------
def _explain_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["explain", *argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out)


def test_explain_json_reports_a_bad_target_as_json(capsys):
    code, data = _explain_json(capsys, "autoshard.nope:Model")
    assert code == 1 and data["target"] == "autoshard.nope:Model" and data["intent"]["offload"] == "none"
    assert data["error"]["type"] == "AutoShardError" and "could not load TARGET 'autoshard.nope:Model'" in data["error"]["message"]
    assert "Fix:" in data["error"]["message"]


def test_explain_json_reports_a_bad_intent_as_json(capsys):
    code, data = _explain_json(capsys, "autoshard.demo:DinoLike", "--intent", "ofload=params")
    assert code == 1 and "intent" not in data
    assert data["error"]["type"] == "IntentError" and "'ofload' (did you mean 'offload'?)" in data["error"]["message"]
    code, data = _explain_json(capsys, "autoshard.demo:DinoLike", "--intent-file", "no/such/intent.yaml")
    assert code == 1 and data["error"]["type"] == "AutoShardError" and "cannot read --intent-file" in data["error"]["message"]
    code, data = _explain_json(capsys)
    assert code == 1 and data == {"target": None, "error": data["error"]} and "explain needs a TARGET" in data["error"]["message"]


def test_explain_json_refusal_has_the_same_error_shape_and_the_parts_computed(capsys):
    code, data = _explain_json(capsys, "autoshard.demo:DinoLike", "--backend", "deepspeed", "--world-sizes", "2")
    assert code == 1 and data["decision"] is None and data["needs"]["ema_pairs"]
    assert data["error"]["type"] == "IncompatibleBackendError"
    assert data["error"]["message"].startswith("autoshard cannot run this on deepspeed_zero3")


def test_explain_without_json_still_prints_errors_on_stderr(capsys):
    assert main(["explain", "autoshard.nope:Model"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("autoshard: error: could not load TARGET")


def test_explain_finds_a_module_target_in_the_current_directory(tmp_path, monkeypatch, capsys):
    """The console script's sys.path does not hold the directory it is run from; `python -m` would."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text("from autoshard.demo import DinoLike\n\ndef build():\n    return DinoLike()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("mypkg.models", "mypkg"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        code, data = _explain_json(capsys, "mypkg.models:build", "--world-sizes", "2")
    finally:
        for name in ("mypkg.models", "mypkg"):
            sys.modules.pop(name, None)
    assert code == 0 and data["module"] == "DinoLike"
    assert str(tmp_path) not in sys.path


def test_json_answers_json_even_for_an_unexpected_exception(capsys, monkeypatch):
    """A bug is not a refusal, but a script reading --json still gets one object; without --json, the traceback."""
    from autoshard import cli

    def broken(args):
        raise KeyError("format")

    monkeypatch.setattr(cli, "cmd_matrix", broken)
    assert main(["matrix", "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "KeyError" and error["message"].startswith("KeyError: 'format'. This is not a refusal autoshard knows")
    assert error["message"].endswith("Fix: run the same command without --json for the traceback, and report it")
    with pytest.raises(KeyError):
        main(["matrix"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["matrix", "--json"], True),
        (["matrix", "--format", "json"], True),
        (["matrix", "--format=json"], True),
        (["explain", "x", "--", "--json"], False),
        (["explain", "x"], False),
        (["matrix", "--format", "text"], False),
    ],
)
def test_json_is_read_from_the_words_typed(argv, expected):
    from autoshard.cli import wants_json

    assert wants_json(argv) is expected


def test_matrix_format_json_with_a_bad_option_answers_json(capsys):
    assert main(["matrix", "--format", "json", "--detials"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["message"] == (
        "unrecognized arguments: --detials. Fix: --details (not --detials); options are never abbreviated (`autoshard matrix --help` lists them)"
    )
