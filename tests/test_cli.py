"""The ``autoshard`` command line: ``autoshard matrix`` prints what ``render_matrix`` renders."""

from __future__ import annotations

import argparse
import runpy
import sys

import pytest

from autoshard import render_matrix
from autoshard.cli import build_parser, main


@pytest.mark.parametrize(
    ("argv", "fmt", "details"),
    [(["matrix"], "text", False), (["matrix", "--format", "markdown"], "markdown", False), (["matrix", "--details"], "text", True)],
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
    assert "invalid choice: 'html' (choose from 'text', 'markdown')" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_refusals_print_the_message_not_a_traceback(capsys, monkeypatch):
    from autoshard import IncompatibleBackendError
    from autoshard import cli

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
